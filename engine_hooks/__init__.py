"""kvguard.engine_hooks (the ``engine_hooks/`` folder, mapped in pyproject.toml)."""

# Imported as a top-level ``engine_hooks`` (a source checkout on sys.path), this folder would
# load a second copy of every module beside kvguard.engine_hooks's, with its own module state;
# and a top-level ``engine_hooks`` is another project's name on PyPI. Refuse, naming the fix.
if __name__ != "kvguard.engine_hooks":
    raise ImportError(f"import kvguard.engine_hooks, not {__name__!r} (pip install -e . maps the folder)")

"""kvguard.sidecar (the ``sidecar/`` folder, mapped in pyproject.toml)."""

# Imported as a top-level ``sidecar`` (a source checkout on sys.path), this folder would
# load a second copy of every module beside kvguard.sidecar's, with its own module state;
# and a top-level ``sidecar`` is another project's name on PyPI. Refuse, naming the fix.
if __name__ != "kvguard.sidecar":
    raise ImportError(f"import kvguard.sidecar, not {__name__!r} (pip install -e . maps the folder)")

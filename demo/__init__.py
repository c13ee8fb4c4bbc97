"""kvguard.demo (the ``demo/`` folder; its own distribution, kvguard-demo, demo/pyproject.toml).

The incident demo (``kvguard demo``), the test models (``kvguard model``), the engine
harness the tests and the demo share, and the CPU-only shims for SGLang test engines.
Engine and sidecar images do not install it.
"""

if __name__ != "kvguard.demo":
    raise ImportError(f"import kvguard.demo, not {__name__!r} (pip install -e demo/ maps the folder)")

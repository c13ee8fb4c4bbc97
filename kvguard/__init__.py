"""kvguard: KV-cache integrity and observability for LLM serving engines.

One import namespace for the folders at the top of the repository, mapped in
pyproject.toml (``[tool.setuptools.package-dir]``):

- ``kvguard.engine_hooks`` (``engine_hooks/``): loaded inside the engine.
- ``kvguard.sidecar`` (``sidecar/``): the sidecar, its CLI and its tools.
"""

__version__ = "0.1.0"

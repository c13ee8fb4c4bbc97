"""kvguard's tests, one package per layer (docs/testing.md, "Layout").

A package so that every test module has a unique dotted name (``tests.sidecar.test_ledger``)
and the shared helpers import as ``tests.support.<module>``: pytest's default
``--import-mode=prepend`` puts the repository root on ``sys.path`` for them.
"""

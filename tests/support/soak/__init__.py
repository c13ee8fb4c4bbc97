"""Helpers of the engine soak test (tests/integration/test_soak_engine.py, docs/soak.md).

* :mod:`soak.workload` - the request mix (a seeded plan) and the HTTP clients that
  send it to a real SGLang server or prefill/decode pair, concurrently.
* :mod:`soak.watch` - an in-process sidecar that also keeps the raw records, the
  counters the test asserts on, and a dump of the records behind every finding.
"""

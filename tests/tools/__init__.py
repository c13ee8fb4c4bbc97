"""What ships around the product: the CLI tools (preflight, canary), the demo harness and its
models, bench smoke runs, the specification, packaging, deploy/, dashboards and alert rules,
and the coverage-guided fuzzing of the record path (``fuzz/``, ``make fuzz``)."""

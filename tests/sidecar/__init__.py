"""The sidecar (``kvguard.sidecar``) without an engine: pipeline, tracker, judge, detectors,
ledger, ingest, API, metrics, incidents, recorder, replay, sinks, the catalogue and what it
generates; ``reliability/`` runs the real sidecar process against synthetic rings."""

"""Detectors: small classes that turn tracker verdicts into findings. No I/O.

Each is called on the ingest thread and must not block or raise.
"""

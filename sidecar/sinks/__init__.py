"""Where findings go. Every sink has ``send(finding)``, ``force_flush()``, ``shutdown()``;
``send`` is called on the ingest thread and must not block for long or raise."""

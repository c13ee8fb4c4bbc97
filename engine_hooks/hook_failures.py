"""The failure policy the engine adapters share (SGLang's, vLLM's): a hook whose own code raises
is counted, logged once, reported to the sidecar as PROBE_ERROR and disabled for the rest of
the process; the engine never sees the exception."""

from __future__ import annotations

import logging

_probes_module = None


def current_probes():
    """The process-wide Probes (looked up each time, so that tests can swap it). The module is
    imported once (not at the top: it imports this one); an import statement per call cost
    ~1 µs, and every hook calls this."""
    global _probes_module
    if _probes_module is None:
        from kvguard.engine_hooks import probes as probes_mod

        _probes_module = probes_mod
    return _probes_module.get_probes()


class HookFailures:
    """Which hooks of one adapter (``engine``: "sglang", "vllm") failed, and how often."""

    def __init__(self, engine: str, log: logging.Logger, probes=current_probes):
        self.engine, self.log, self.probes = engine, log, probes
        self.disabled: set[str] = set()
        self.errors: dict[str, int] = {}

    def failed(self, name: str, exc: BaseException) -> None:
        """Count, report once, disable: the engine must never see our failure."""
        first = name not in self.disabled
        self.disabled.add(name)
        self.errors[name] = self.errors.get(name, 0) + 1
        if first:
            self.log.warning(
                "kvguard %s hook %s failed and is disabled: %s: %s", self.engine, name, type(exc).__name__, exc
            )
            try:
                self.probes().report_probe_error(f"{self.engine}.{name}", exc)
            except Exception:  # noqa: BLE001
                pass

    def clear(self) -> None:
        self.disabled.clear()
        self.errors.clear()

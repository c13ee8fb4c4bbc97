"""The sinks the spine needs: JSON lines on a stream, the log, and memory (for tests)."""

from __future__ import annotations

import logging
import sys
import threading

from ..findings import Finding

log = logging.getLogger("kvguard.findings")


class JsonLinesSink:
    """One JSON object per finding, one per line (``kvguard sidecar --json``)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def send(self, finding: Finding) -> None:
        with self._lock:
            self.stream.write(finding.to_json() + "\n")
            self.stream.flush()

    def force_flush(self) -> None:
        self.stream.flush()

    def shutdown(self) -> None:
        self.force_flush()


class LogSink:
    def send(self, finding: Finding) -> None:
        level = logging.ERROR if finding.severity == "critical" else logging.WARNING
        log.log(level, "%s [%s] %s", finding.kind, finding.severity, finding.summary)

    def force_flush(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class MemorySink:
    def __init__(self):
        self.findings: list[Finding] = []
        self._lock = threading.Lock()

    def send(self, finding: Finding) -> None:
        with self._lock:
            self.findings.append(finding)

    def force_flush(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

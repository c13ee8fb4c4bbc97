"""Where the pipeline's components hand what they find: the detectors, the incident store,
the sinks and the event history, behind four calls.

A component (the page records, requests, transfers, stored objects) updates its own model and
gets typed events back (sidecar/events.py); it passes each to :meth:`Outlet.judge`, which runs
the detectors that observe the event's type and files and delivers what they find. It never
reaches into another component or the pipeline: this object is all it shares with them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from .detectors.base import At
from .detectors.registry import DetectorSet
from .findings import EngineRef, Finding
from .history import History
from .incidents import IncidentStore
from .tracker import EngineTracker

log = logging.getLogger("kvguard.pipeline")

SIDECAR_ENGINE = EngineRef("sidecar", 0, 0)  # findings about the sidecar's own links (the shared ledger)


def with_telemetry(sinks, tracer=None, finding_logs=None) -> list:
    """The sinks a finding goes to: the given ones, then the tracer (findings become span
    events; sidecar/tracing.py), then the log-record sink (sidecar/finding_logs.py), after the
    tracer so that the span the finding went on is known when its record is made."""
    if finding_logs is not None and finding_logs.tracer is None:
        finding_logs.tracer = tracer
    return [*sinks, *(s for s in (tracer, finding_logs) if s is not None)]


def engine_ref(tracker: EngineTracker) -> EngineRef:
    h = tracker.hello
    if h is None:
        return EngineRef("unknown", 0, 0)
    return EngineRef(tracker.role_name, h.tp_rank, h.pid)


class Outlet:
    """The detectors, the incidents, the sinks and the history, as the components use them.

    ``sender_of(room)``: the (rid, tenant) of the prefill request that served a room, when
    known (the transfer ledger's); a finding about a room's reader names it (``_name_sender``).
    """

    def __init__(
        self,
        detectors: DetectorSet,
        incidents: IncidentStore,
        sinks: list,
        history: History | None,
        sender_of: Callable[[int], tuple[str, str] | None] = lambda room: None,
    ):
        self.detectors = detectors
        self.incidents = incidents
        self.sinks = sinks
        self.history = history
        self.sender_of = sender_of
        self.findings_by_kind: Counter = Counter()
        self.incidents_by_kind: Counter = Counter()
        self.findings_suppressed = 0

    # ------------------------------------------------------------------ detection
    def observe(self, event, t: EngineTracker | None, ts_ns: int) -> list[Finding]:
        """The findings of every detector that observes this event's type (not filed yet)."""
        if not self.detectors.observes(type(event)):
            return []
        at = At(t, engine_ref(t) if t is not None else SIDECAR_ENGINE, t.engine_id if t is not None else 0, ts_ns)
        found = self.detectors.observe(event, at)
        if t is not None and t.pool_index and found:  # a pool besides 0: the finding says which
            info = t.pool_info
            for finding in found:
                finding.evidence.setdefault("pool", t.pool_index)
                if info is not None:
                    finding.evidence.setdefault("pool_name", info.name)
                    finding.evidence.setdefault("pool_kind", info.kind.name.lower())
        return found

    def judge(self, event, t: EngineTracker | None, ts_ns: int) -> list[Finding]:
        """:meth:`observe`, then :meth:`emit` what it found."""
        found = self.observe(event, t, ts_ns)
        return self.emit(found) if found else []

    def emit(self, findings: list[Finding]) -> list[Finding]:
        """File findings into incidents; deliver the first finding of each new incident, and a
        repeat that names an exposed party its incident had not named."""
        out = []
        for finding in findings:
            self._name_sender(finding)
            self.findings_by_kind[(finding.kind, finding.severity)] += 1
            incident, is_new = self.incidents.observe(finding)
            if is_new:
                self.incidents_by_kind[(finding.kind, finding.severity)] += 1
                out.append(finding)
            elif incident.exposed_grew:
                out.append(finding)
            else:
                self.findings_suppressed += 1
        for finding in out:
            self.deliver("send", finding)
        return out

    def _name_sender(self, finding: Finding) -> None:
        """A finding about a request with a bootstrap_room also names the prefill request that
        served the room when its rid differs from the reader's (a client that sent no rid through
        SGLang's router: each engine drew its own), so both ends can be looked up."""
        reader = finding.reader
        if reader is None or reader.bootstrap_room is None or "sender_rid" in finding.evidence:
            return
        sender = self.sender_of(reader.bootstrap_room)
        if sender is not None and sender[0] and sender[0] != reader.rid:
            finding.evidence["sender_rid"], finding.evidence["sender_tenant"] = sender

    # ------------------------------------------------------------------ delivery
    def deliver(self, method: str, item) -> None:
        for sink in self.sinks:
            fn = getattr(sink, method, None)
            if fn is None:
                continue
            try:
                fn(item)
            except Exception as exc:  # noqa: BLE001 - a sink failure must not stop detection
                log.error("sink %s failed: %s", type(sink).__name__, exc)

    def resolved(self, incidents) -> None:
        for inc in incidents:
            self.deliver("resolve", inc)

    def record(self, *args, **kwargs) -> None:
        """One event into the bounded history timelines are served from (when kept)."""
        if self.history is not None:
            self.history.append(*args, **kwargs)

"""The detector set: the detectors a pipeline runs, and what it calls on them.

The pipeline holds one :class:`DetectorSet` and calls ``observe`` (by event type, through a
table built once), ``tick``, ``on_engine_gone``, ``stats`` and ``settings`` on it; each fans
out to the detectors that define the optional hook (sidecar/detectors/base.py), found once
here. Nothing outside this module and :func:`default_detectors` names a detector class.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ..findings import Finding
from .base import At, Detector
from .config import PoolContextDetector
from .content import ContentDetector
from .coverage import CoverageDetector
from .gaps import EventsLostDetector
from .guard import GuardDetector
from .identity import PrefixIdentityDetector
from .inflight import InFlightTransferDetector
from .isolation import TenantIsolationDetector
from .lifetime import DoubleFreeDetector, WriteDetector
from .offload import OffloadDetector
from .probing import PrefixProbingDetector
from .reads import ReadDetector
from .scopes import ScopeDetector
from .sends import UnwrittenSendDetector
from .tier1 import Tier1Detector
from .transfers import ChecksumDetector, LedgerDegradedDetector, OrphanDetector, TransferSizeDetector
from .ttft import TTFTDetector

D = TypeVar("D")


def default_detectors(
    *, isolate_tenants: bool = False, ttft_anomaly: bool = True, detect_prefix_probing: bool = False
) -> list[Detector]:
    """Every detector the sidecar runs, in dispatch order (an event's detectors see it in
    this order), with the switches the sidecar's options set (tenants declared isolated
    are watched for probing too)."""
    return [
        ReadDetector(),
        TenantIsolationDetector(isolate_tenants),
        PrefixProbingDetector(isolate_tenants or detect_prefix_probing),
        WriteDetector(),
        DoubleFreeDetector(),
        Tier1Detector(),
        GuardDetector(),
        PoolContextDetector(),
        CoverageDetector(),
        TransferSizeDetector(),
        ChecksumDetector(),
        OrphanDetector(),
        UnwrittenSendDetector(),
        InFlightTransferDetector(),
        ScopeDetector(),
        PrefixIdentityDetector(),
        ContentDetector(),
        OffloadDetector(),
        LedgerDegradedDetector(),
        EventsLostDetector(),
        TTFTDetector(enabled=ttft_anomaly),
    ]


def dispatch_table(detectors) -> dict[type, tuple]:
    """event type -> the detectors that observe it, in the order given (built once)."""
    table: dict[type, list] = {}
    for detector in detectors:
        for event_type in detector.events:
            table.setdefault(event_type, []).append(detector)
    return {event_type: tuple(ds) for event_type, ds in table.items()}


def _with(detectors, hook: str) -> tuple:
    return tuple(d for d in detectors if callable(getattr(d, hook, None)))


class DetectorSet:
    """The detectors, and the optional hooks each defines, found once."""

    def __init__(self, detectors: list[Detector]):
        self.detectors = tuple(detectors)
        self.for_event = dispatch_table(detectors)
        self._ticking = _with(detectors, "tick")
        self._engine_watching = _with(detectors, "on_engine_gone")
        self._publishing = tuple(d for d in _with(detectors, "stats") if getattr(d, "stats_field", None))
        self._switchable = tuple(d for d in detectors if getattr(d, "switch", None))
        self.wants_shared_reads = any(
            getattr(d, "wants_shared_reads", False) and getattr(d, "enabled", True) for d in detectors
        )

    def __iter__(self):
        return iter(self.detectors)

    def observe(self, event, at: At) -> list[Finding]:
        """The findings of every detector that observes this event's type (not filed yet)."""
        found: list[Finding] = []
        for detector in self.for_event.get(type(event), ()):
            found += detector.observe(event, at)
        return found

    def observes(self, event_type: type) -> bool:
        return event_type in self.for_event

    def tick(self, now_ns: int) -> list[Finding]:
        found: list[Finding] = []
        for detector in self._ticking:
            found += detector.tick(now_ns)
        return found

    def on_engine_gone(self, engine_id: int, ts_ns: int) -> list[Finding]:
        found: list[Finding] = []
        for detector in self._engine_watching:
            found += detector.on_engine_gone(engine_id, ts_ns)
        return found

    def stats(self) -> dict[str, Any]:
        """``{stats_field: stats()}`` of every detector that publishes figures."""
        return {d.stats_field: d.stats() for d in self._publishing}

    def settings(self) -> dict[str, bool]:
        """``{switch: on}`` of every switchable detector (the recorded verdict options)."""
        return {d.switch: bool(d.enabled) for d in self._switchable}  # type: ignore[attr-defined]

    def switches_on(self) -> set[str]:
        return {switch for switch, on in self.settings().items() if on}

    def get(self, cls: type[D]) -> D:
        """The one detector of class ``cls`` (for tests and tools that inspect its state)."""
        (found,) = [d for d in self.detectors if isinstance(d, cls)]
        return found

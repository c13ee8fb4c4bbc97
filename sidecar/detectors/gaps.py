"""``events_lost``: a gap in an engine's record stream (a LOST marker).

The ring was full (or unreadable) and the engine counted the records it dropped
rather than wait. Until each page is reallocated its ownership is unknown: reads in
the window are counted as unverified, not judged. The finding carries the gap's size
and the engine's running total; the incident that groups an engine's gaps adds them up.
"""

from __future__ import annotations

from typing import ClassVar

from ..catalogue import KIND
from ..events import RecordsLost
from ..findings import WARNING, Finding
from .base import At


class EventsLostDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.events_lost,)
    events: ClassVar[tuple[type, ...]] = (RecordsLost,)

    def observe(self, lost: RecordsLost, at: At) -> list[Finding]:
        engine = at.engine
        summary = (
            f"{engine.role} rank {engine.rank}: {lost.count} records lost in this gap, {lost.engine_total} on this "
            f"engine so far (ring full or unreadable); page ownership is unknown until pages are reallocated: "
            f"reads in this window are not verified"
        )
        evidence = {
            "records_lost": lost.count,
            "first_missing_seq": lost.first_missing_seq,
            "engine_records_lost_total": lost.engine_total,
        }
        return [Finding(KIND.events_lost, WARNING, engine, None, [], [], at.ts_ns, summary, evidence)]

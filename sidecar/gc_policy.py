"""The sidecar's garbage-collector policy: long-lived state out of every collection.

CPython's cyclic collector holds the GIL while it walks every object of the generation it
collects. The sidecar's long-lived state is mostly tracked objects (the engines' ended-request
directories alone are up to 800,000 ``RequestInfo``), so a full collection took 100-600 ms,
and nothing else in the process ran meanwhile: not ``/healthz`` (issue 14: probes over 100 ms
on a saturated sidecar were these pauses; with the collector off they stayed under 25 ms),
not the ingest loop.

Every ``period_s`` the ingest thread, between two cycles, runs a full collection and then
``gc.freeze()``: what survived moves to the permanent generation, which no later collection
walks, so each collection only walks what was made since (seconds of traffic: a few ms).
Frozen objects are still freed by reference counting when dropped (requests leaving the
directories are: they hold no cycles); only a reference cycle that was alive at a freeze and
dies later is never collected. The sidecar's own state makes none (measured: 0 unreachable
objects after a 15 s flood with the collector off); HTTP connections do, and one that lives
across a freeze and then closes keeps its few KB (``kvguard_gc_frozen_objects`` shows the
permanent generation; `make soak-memory` shows RSS).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("kvguard")

FREEZE_PERIOD_S = 10.0


class GcFreeze:
    def __init__(self, period_s: float = FREEZE_PERIOD_S, clock=time.monotonic):
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self.clock = clock
        self._next = 0.0
        self.runs = 0
        self.pause_s_total = 0.0  # collections and freezes run here
        self.last_pause_s = 0.0

    def freeze_now(self) -> float:
        """A full collection of what is not frozen yet, then freeze the survivors; returns the pause."""
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        pause = time.perf_counter() - t0
        self.runs += 1
        self.pause_s_total += pause
        self.last_pause_s = pause
        self._next = self.clock() + self.period_s
        return pause

    def maybe_run(self) -> None:
        """For ``Sidecar.between_cycles``: freeze when the period has passed."""
        if self.clock() >= self._next:
            self.freeze_now()

    @staticmethod
    def frozen_objects() -> int:
        return gc.get_freeze_count()

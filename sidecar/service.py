"""The running sidecar: a RingSet drained into a Pipeline on one ingest thread."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .ingest import CYCLE_BYTES, DEFAULT_MAX_RINGS, RingSet
from .ledger.shared import SharedLedger, parse_ledger_url
from .memory_budget import DEFAULT_BUDGET_BYTES, MemoryBudget
from .pipeline import Pipeline
from .stats import PipelineStats

if TYPE_CHECKING:
    from .gc_policy import GcFreeze

log = logging.getLogger("kvguard.sidecar")

STALL_S = 5.0  # no cycle finished for this long, none running: the ingest loop is stuck
CYCLE_STALL_S = 60.0  # one cycle running this long is stuck too (a saturated one takes seconds)


class Sidecar:
    def __init__(
        self,
        ring_dir: str,
        sinks=(),
        poll_interval_s: float = 0.01,
        slack_ns: int = 50_000_000,
        remove_dead_rings: bool = True,
        recorder=None,
        history_events: int = 1 << 20,
        isolate_tenants: bool = False,
        tracer=None,
        ttft_anomaly: bool = True,
        ledger: str = "memory",
        ledger_cluster: str = "default",
        orphan_timeout_s: float = 120.0,
        max_rings: int = DEFAULT_MAX_RINGS,
        memory_budget: int = DEFAULT_BUDGET_BYTES,
        detect_prefix_probing: bool = False,
        finding_logs=None,
    ):
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {poll_interval_s}")
        if orphan_timeout_s <= 0:
            raise ValueError(f"--orphan-timeout-s must be > 0, got {orphan_timeout_s}")
        # "memory" or redis://HOST:PORT/DB (LedgerConfigError, a ValueError, names --ledger and the value)
        self.shared_ledger = None
        url = parse_ledger_url(ledger)
        if url is not None:
            self.shared_ledger = SharedLedger(url, cluster=ledger_cluster)
        self.rings = RingSet(ring_dir, slack_ns=slack_ns, remove_dead=remove_dead_rings, max_rings=max_rings)
        self.pipeline = Pipeline(
            sinks,
            history_events=history_events,
            isolate_tenants=isolate_tenants,
            detect_prefix_probing=detect_prefix_probing,
            tracer=tracer,
            finding_logs=finding_logs,
            ttft_anomaly=ttft_anomaly,
            shared_ledger=self.shared_ledger,
            orphan_timeout_s=orphan_timeout_s,
            # raises MemoryBudgetError (a ValueError naming --memory-budget) when too small
            memory_budget=MemoryBudget(memory_budget, history_events),
        )
        # sidecar.recorder.Recorder (or None): records every batch before it is applied; never raises
        self.recorder = recorder
        # so that `kvguard replay` judges the recording with the same settings (a recorder-like
        # object that keeps records some other way need not take them)
        set_options = getattr(recorder, "set_options", None)
        if callable(set_options):
            set_options(self.pipeline.verdict_options())
        self.poll_interval_s = poll_interval_s
        self.lock = threading.Lock()  # guards pipeline + rings against the metrics scrape
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_ns = time.monotonic_ns()
        self.last_poll_ns = 0
        self.cycle_started_ns = 0  # the ingest cycle running now (0 between cycles)
        self.backlogged = False  # the last cycle left records in a ring: the next one starts at once
        # called by the ingest thread between two cycles, without the lock held (e.g. a metrics
        # snapshot a scrape asked for while the lock was busy)
        self.between_cycles: list = []
        self.gc_freeze: GcFreeze | None = None  # where the process runs one (`kvguard sidecar`)
        # the command line's settings, redacted, as `kvguard sidecar` sets them (None elsewhere):
        # what an incident's bundle shows (sidecar/bundle.py)
        self.settings: dict | None = None

    def run_once(self, flush: bool = False) -> list:
        with self.lock:
            self.cycle_started_ns = time.monotonic_ns()
            # a flush (tests, replay, stop) reads as much as a ring poll may copy (8 MiB a ring)
            self.backlogged = self.rings.poll(
                max_bytes=(8 << 20) * max(1, len(self.rings.readers)) if flush else CYCLE_BYTES
            )
            findings = []
            records = self.rings.ready(flush=flush)
            if self.recorder is not None:
                self.recorder.record_batch(records)  # also rotates by age when idle
            for rec in records:
                findings += self.pipeline.apply(rec)
            now = time.monotonic_ns()
            if not self.rings.pending:  # everything of retired engines has been applied
                for engine_id in self.rings.take_gone():
                    findings += self.pipeline.on_engine_gone(engine_id, now)
                    if self.recorder is not None:  # replay applies it at the same point in the stream
                        self.recorder.record_engine_gone(engine_id, now)
            findings += self.pipeline.tick(now)
            if self.recorder is not None:
                self.recorder.record_tick(now)
            self.last_poll_ns = now
            self.cycle_started_ns = 0
            return findings

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.exception("ingest cycle failed")
                self.cycle_started_ns = 0
            for hook in self.between_cycles:
                try:
                    hook()
                except Exception:
                    log.exception("between-cycles hook failed")
            self._stop.wait(0 if self.backlogged else self.poll_interval_s)
        self.run_once(flush=True)

    def start(self) -> Sidecar:
        if self.shared_ledger is not None:
            self.shared_ledger.start()
        self._thread = threading.Thread(target=self._loop, name="kvguard-ingest", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.shared_ledger is not None:
            self.shared_ledger.stop()
        with self.lock:
            self.rings.close()
            if self.recorder is not None:
                self.recorder.close()
        for sink in self.pipeline.sinks:
            try:
                sink.shutdown()
            except Exception:
                log.exception("sink shutdown failed")

    def pipeline_stats(self) -> PipelineStats:
        """The pipeline's figures as plain values (sidecar/stats.py), for readers such as the
        metrics collector that must not depend on the pipeline's models. The caller holds
        ``lock`` (the ingest thread changes the models between two records)."""
        return self.pipeline.stats()

    def healthy(self) -> tuple[bool, dict]:
        """Never takes the ingest lock (a saturated cycle held it for seconds, past the
        probes' timeout): every figure here is one attribute read. Alive means the ingest
        thread runs and either finished a cycle in the last ``STALL_S`` or is inside one that
        started less than ``CYCLE_STALL_S`` ago (a long cycle under load is progress, not a
        hang a restart would fix)."""
        now = time.monotonic_ns()
        age_s = (now - self.last_poll_ns) / 1e9 if self.last_poll_ns else None
        started = self.cycle_started_ns
        cycle_s = (now - started) / 1e9 if started else None
        ok = (
            self._thread is not None
            and self._thread.is_alive()
            and age_s is not None
            and (age_s < STALL_S or (cycle_s is not None and cycle_s < CYCLE_STALL_S))
        )
        stats = self.rings.stats
        detail = {
            "ingest_alive": ok,
            "last_poll_age_s": age_s,
            "cycle_running_s": cycle_s,
            "rings_attached": len(self.rings.readers),
            "records_lost": stats.records_lost,
            "ring_errors": stats.ring_errors,
            # pairing across pods may be degraded; the sidecar itself is healthy (no restart helps)
            "ledger": "memory"
            if self.shared_ledger is None
            else ("degraded" if self.shared_ledger.degraded else "shared"),
        }
        return ok, detail

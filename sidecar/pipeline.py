"""records -> components -> events -> detectors -> findings -> incidents -> sinks. No I/O
besides the sinks.

``Pipeline.apply(record)`` is the whole detection path for one record. The pipeline is a
router: it finds the engine (and the pool) a record belongs to and hands it to the component
that owns that part of the model:

- pages (sidecar/page_records.py): the page model and its judge, pools, coverage, gaps;
- requests (sidecar/request_records.py): HELLO, request begin / end / reject, the guard;
- transfers (sidecar/transfer_flow.py): the transfer ledger and its pairing;
- stored objects (sidecar/offload.py): host / storage tier stores and loads.

Each component hands the typed events its model returns to the outlet (sidecar/outlet.py),
which runs the detectors that observe them (sidecar/detectors/registry.py) and files what they
find into incidents (sidecar/incidents.py): the first finding of an incident is delivered to
the sinks, repeats (the same bad read on every decode step) only update the incident and are
counted in ``findings_suppressed``. Every record also feeds the bounded event history that
timelines are served from.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

from kvguard.engine_hooks import wire

from .detectors.guard import GUARD_ABORT_KINDS
from .detectors.registry import DetectorSet, default_detectors
from .engine_parts import EngineParts
from .finding_kinds import possible_findings
from .findings import EngineRef, Finding
from .history import History
from .incidents import IncidentStore
from .ledger import TransferLedger
from .memory_budget import DEFAULT_BUDGET_BYTES, MemoryBudget
from .offload import StoredObjects
from .outlet import SIDECAR_ENGINE, Outlet, engine_ref, with_telemetry
from .page_records import PageRecords
from .request_records import RequestRecords
from .stats import EngineStats, PipelineStats
from .tracker import EngineTracker, RequestDirectory
from .transfer_flow import Transfers

__all__ = ["Pipeline", "SIDECAR_ENGINE"]

BUDGET_RESIZE_NS = 5_000_000_000  # the directories' share follows the live requests this often

log = logging.getLogger("kvguard.pipeline")

# with a shared ledger, how long a receiver that finished waits for the sender's facts from the other
# pod (its sidecar reads its ring, publishes, and this sidecar polls: a few cycles, plus outages)
SHARED_GRACE_NS = 10_000_000_000

# records that belong to one pool of an engine (the header's ``pool``, contract 1.5); the rest
# (requests, transfers, tiers) are the engine's and come with pool 0
POOL_RECORD_KINDS = frozenset(
    (wire.Kind.ALLOC, wire.Kind.FREE, wire.Kind.ASSIGN, wire.Kind.FORWARD, wire.Kind.CONTENT_CHANGED)
)
# what a pool that shares pool 0's pages (POOL ``shares_pages``) has only once, on pool 0's model
SHARED_PAGE_KINDS = frozenset((wire.Kind.ALLOC, wire.Kind.FREE, wire.Kind.CONTENT_CHANGED))


class Pipeline:
    def __init__(
        self,
        sinks=(),
        history_events: int = 1 << 20,
        incidents: IncidentStore | None = None,
        isolate_tenants: bool = False,
        tracer=None,
        ttft_anomaly: bool = True,
        shared_ledger=None,
        orphan_timeout_s: float = 120.0,
        memory_budget: MemoryBudget | None = None,
        detect_prefix_probing: bool = False,
        finding_logs=None,
    ):
        # sidecar.tracing.TraceRecorder or None: request spans; it is also a sink (findings become span events)
        self.tracer = tracer
        self.sinks = with_telemetry(sinks, tracer, finding_logs)
        self.history = History(history_events) if history_events else None
        # sizes the engines' ended-request directories (sidecar/memory_budget.py)
        self.memory_budget = memory_budget or MemoryBudget(DEFAULT_BUDGET_BYTES, history_events)
        self._budget_sized_ns = 0
        self.incidents = incidents or IncidentStore()
        self.incidents.max_bytes = self.memory_budget.incidents_bytes  # the budget's share
        self.engines: dict[int, EngineTracker] = {}
        self.parts = EngineParts()  # rings that are one part of another process's engine (vLLM's Worker)
        self.ledger = TransferLedger(
            orphan_timeout_ns=int(orphan_timeout_s * 1e9), max_bytes=self.memory_budget.ledger_bytes
        )  # the budget's share
        # sidecar.ledger.shared.SharedLedger or None: the other pod's transfer facts (docs/detectors.md)
        self.shared_ledger = shared_ledger
        self.ledger.shared = shared_ledger is not None
        # while Redis is unreachable, a finished receiver is held up to 10 waits past its own
        # (docs/detectors.md: 100 s), not 10 of the embedded ledger's 2 s grace
        self.ledger.max_hold_ns = 10 * SHARED_GRACE_NS
        self.last_tick_ns = 0  # the last tick's time (the records' clock): open transfers' age
        # the detectors (sidecar/detectors/): each declares its kinds, the events it observes and
        # the optional hooks it needs; the set calls them (this class never names a detector)
        self.detectors = DetectorSet(
            default_detectors(
                isolate_tenants=isolate_tenants, ttft_anomaly=ttft_anomaly, detect_prefix_probing=detect_prefix_probing
            )
        )
        # the components, each owning its part of the model; the outlet is all they share
        self.out = Outlet(self.detectors, self.incidents, self.sinks, self.history)
        self.transfers = Transfers(
            self.out, self.engines, self.ledger, shared_ledger, orphan_timeout_s, SHARED_GRACE_NS
        )
        self.out.sender_of = self.transfers.sender_of  # a finding about a room's reader names its sender
        self.pages = PageRecords(self.out, self.engines, self.memory_budget)
        self.requests = RequestRecords(self.out, self.engines, self.transfers, self.memory_budget, self.parts, tracer)
        self.stored_objects = StoredObjects(self.out, self.pages.identity)
        self._handlers = self._record_handlers()
        self.records_by_kind: Counter = Counter()
        self.apply_errors = 0

    @property
    def orphan_timeout_s(self) -> float:
        """How long decode may wait for a sender before its room is an orphan (the transfers')."""
        return self.transfers.orphan_timeout_s

    @orphan_timeout_s.setter
    def orphan_timeout_s(self, seconds: float) -> None:  # the ledger ages rooms on it too
        self.transfers.orphan_timeout_s = seconds
        self.ledger.orphan_timeout_ns = int(seconds * 1e9)

    def verdict_options(self) -> dict:
        """The settings that change what this pipeline finds, as a recording keeps them for
        ``kvguard replay`` (sidecar/replay.py ``VERDICT_OPTIONS``; ``shared_ledger`` is
        recorded only: a replay has no other pod's facts)."""
        return {
            **self.detectors.settings(),  # isolate_tenants, ttft_anomaly
            "orphan_timeout_s": float(self.orphan_timeout_s),
            "shared_ledger": self.shared_ledger is not None,
        }

    # ------------------------------------------------------------------ routing
    def tracker(self, engine_id: int) -> EngineTracker:
        tracker = self.engines.get(engine_id)
        if tracker is None:
            tracker = self.engines[engine_id] = EngineTracker(
                engine_id, RequestDirectory(self.memory_budget.ended_per_engine)
            )
            self.memory_budget.size_directories(list(self.engines.values()))
        return tracker

    @staticmethod
    def engine_ref(tracker: EngineTracker) -> EngineRef:
        return engine_ref(tracker)

    def apply(self, rec: wire.Record) -> list[Finding]:
        """Apply one record; never raises (a failure is logged and counted)."""
        self.records_by_kind[rec.kind.name] += wire.records_in(rec)  # (an AssignRun is several)
        try:
            return self._apply(rec)
        except Exception:
            self.apply_errors += 1
            log.exception("kvguard could not apply %s seq %d of engine %d", rec.kind.name, rec.seq, rec.engine_id)
            return []

    def _apply(self, rec: wire.Record) -> list[Finding]:
        if rec.kind == wire.Kind.ENGINE_PART:
            self.parts.on_part(rec.engine_id, rec.body)
            return []
        if self.parts.primary_of:  # a part's records belong to its engine's timeline (sidecar/engine_parts.py)
            engine_id = self.parts.route(rec.engine_id)
            if engine_id is None:
                return []
            if engine_id != rec.engine_id:
                rec = replace(rec, engine_id=engine_id)
        t = self.tracker(rec.engine_id)
        if rec.pool:  # one of the engine's other pools (contract 1.5): its own timeline
            if rec.kind == wire.Kind.POOL:
                return self.pages.on_pool(t, rec)
            pool_tracker = t.pools.get(rec.pool)
            if pool_tracker is None or rec.kind not in POOL_RECORD_KINDS:
                self.pages.undeclared_pool(t, rec)
                return []
            shared = pool_tracker.pool_info is not None and pool_tracker.pool_info.shares_pages
            if not (shared and rec.kind in SHARED_PAGE_KINDS):  # (a shared pool's pages are pool 0's)
                t = pool_tracker
        if t.unseen_since_loss:  # requests live at a gap: each record naming one shows it outlived it
            t.on_named(rec.body)
        handler = self._handlers.get(rec.kind)
        return handler(t, rec) if handler is not None else []

    def _record_handlers(self) -> dict:
        """record kind -> its handler ``(tracker, record) -> findings``: the whole dispatch."""
        K = wire.Kind
        x = self.transfers
        table = {
            **self.pages.handlers(),
            **self.requests.handlers(),
            # prefill/decode transfers (sidecar/transfer_flow.py)
            K.XFER_SEND: x.on_xfer_send,
            K.XFER_RESERVE: lambda t, rec: x.on_reserve(t, rec.body, rec.ts_ns),
            K.XFER_DIGEST: lambda t, rec: x.on_digest(rec.engine_id, rec.body, rec.ts_ns),
            K.XFER_DONE: x.on_xfer_done,
            # host / storage tiers (sidecar/offload.py)
            K.KV_STORE: self.stored_objects.on_kv_store,
            K.KV_LOAD: self.stored_objects.on_kv_load,
            K.KV_DIGEST: self.stored_objects.on_kv_digest,
        }
        return table

    # ------------------------------------------------------------------ housekeeping
    def on_engine_gone(self, engine_id: int, ts_ns: int) -> list[Finding]:
        """An engine process exited (its ring was retired): close what only it could clear.
        TTFT suspects still waiting for later requests are judged now (no more will come)."""
        if self.parts.is_part(engine_id):  # a part's exit ends nothing: its engine's ring says when that goes
            self.parts.on_gone(engine_id)
            return []
        self.parts.on_gone(engine_id)
        tracker = self.engines.get(engine_id)
        if tracker is None:
            return []
        # judged while the engine is still here: the prefill-evidence gate reads its history
        found = self.out.emit(self.detectors.on_engine_gone(engine_id, ts_ns))
        del self.engines[engine_id]
        self.memory_budget.size_directories(list(self.engines.values()))  # its share goes to the others
        self.pages.forget_engine(engine_id)
        self.ledger.forget_engine(engine_id)
        self.transfers.inflight.forget_engine(engine_id)
        if self.tracer is not None:
            self.tracer.on_engine_gone(engine_ref(tracker), ts_ns)
        if tracker.hello is not None:
            self.out.resolved(self.incidents.on_engine_gone(tracker.hello.pid, ts_ns))
        return found

    def tick(self, now_ns: int) -> list[Finding]:
        self.last_tick_ns = now_ns  # the clock open transfers are aged on (stats)
        found = self.transfers.tick(now_ns)
        found += self.out.emit(self.detectors.tick(now_ns))
        self.out.resolved(self.incidents.tick(now_ns))
        for tracker in self.engines.values():
            tracker.retire_idle_requests(now_ns)
            for pool_tracker in tracker.pools.values():
                pool_tracker.retire_idle_requests(now_ns)
        if now_ns - self._budget_sized_ns >= BUDGET_RESIZE_NS:  # live requests come and go
            self._budget_sized_ns = now_ns
            self.memory_budget.size_directories(list(self.engines.values()))
        return found

    def _request_live(self, engine_id: int, req_key: int) -> bool:
        tracker = self.engines.get(engine_id)
        return tracker is not None and req_key in tracker.requests.live

    # ------------------------------------------------------------------ what it publishes
    # the components' counters, read where callers have always read them
    findings_by_kind = property(lambda self: self.out.findings_by_kind)
    incidents_by_kind = property(lambda self: self.out.incidents_by_kind)
    findings_suppressed = property(lambda self: self.out.findings_suppressed)
    records_lost = property(lambda self: self.pages.records_lost)
    records_lost_by_engine = property(lambda self: self.pages.records_lost_by_engine)
    records_undeclared_pool = property(lambda self: self.pages.records_undeclared_pool)
    guard_aborts = property(lambda self: self.requests.guard_aborts)
    loads_unverified = property(lambda self: self.stored_objects.loads_unverified)
    objects_forgotten = property(lambda self: self.stored_objects.objects_forgotten)
    load_digests_compared = property(lambda self: self.stored_objects.load_digests_compared)

    def engine_stats(self) -> tuple[EngineStats, ...]:
        """Each engine's page model, in the order the engines were first seen (sidecar/stats.py)."""
        return tuple(tracker.stats() for tracker in self.engines.values())

    def stats(self) -> PipelineStats:
        """Every figure the pipeline publishes, as plain values (sidecar/stats.py): what
        /metrics renders, so that no reader depends on how the models keep them. Taken
        under the sidecar's lock; its cost is one pass over the incident store and a page
        count per engine, the rest is sized by fixed label sets."""
        engines = self.engine_stats()
        return PipelineStats(
            records_by_kind=dict(self.records_by_kind),
            findings=dict(self.findings_by_kind),
            incidents_opened=dict(self.incidents_by_kind),
            possible_findings=tuple(possible_findings(self)),
            apply_errors=self.apply_errors,
            engines=engines,
            incidents=self.incidents.stats(),
            memory=self.memory_budget.stats(self.engines.values(), self.incidents, self.ledger),
            **self.detectors.stats(),  # ttft
            ledger=replace(
                self.ledger.stats((e.engine_id for e in engines), self.last_tick_ns, self._request_live),
                in_flight=self.transfers.inflight.stats(),
            ),
            # the queued alert sinks; the log and JSON-lines sinks (and the tracer) write
            # synchronously and cannot fail quietly, so they have nothing to report
            sinks=tuple(sink.delivery_stats() for sink in self.sinks if hasattr(sink, "delivery_stats")),
            guard_aborts={kind: self.guard_aborts[kind] for kind in GUARD_ABORT_KINDS},
            loads_unverified=self.loads_unverified,
            objects_forgotten=self.objects_forgotten,
            load_digests_compared=self.load_digests_compared,
            records_without_engine=self.parts.records_without_engine,
            records_undeclared_pool=self.records_undeclared_pool,
            page_identity=self.pages.identity.as_dict(),
        )

"""records -> trackers -> detectors -> findings -> incidents -> sinks. No I/O besides the sinks.

``Pipeline.apply(record)`` is the whole detection path for one record. Findings are
filed into incidents (sidecar/incidents.py): the first finding of an incident is
delivered to the sinks, repeats (the same bad read on every decode step) only update
the incident and are counted in ``findings_suppressed``. Every record also feeds the
bounded event history that timelines are served from.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import numpy as np

from kvguard.engine_hooks import wire

from .detectors.base import At
from .detectors.guard import ACTIONS, CARRIED_RULES, GUARD_ABORT_KINDS
from .detectors.registry import DetectorSet, default_detectors
from .engine_parts import EngineParts
from .events import ContentChangedAt, PagesFreedTwice, RecordsLost, RequestEnded
from .finding_kinds import possible_findings
from .findings import EngineRef, Finding
from .history import Event, History
from .incidents import IncidentStore
from .ledger import TransferLedger
from .memory_budget import DEFAULT_BUDGET_BYTES, MemoryBudget
from .offload import OffloadFlow
from .stats import EngineStats, PipelineStats
from .tracker import ROLE_NAMES, EngineTracker, RequestDirectory
from .transfer_flow import TransferFlow

BUDGET_RESIZE_NS = 5_000_000_000  # the directories' share follows the live requests this often

log = logging.getLogger("kvguard.pipeline")

# with a shared ledger, how long a receiver that finished waits for the sender's facts from the other
# pod (its sidecar reads its ring, publishes, and this sidecar polls: a few cycles, plus outages)
SHARED_GRACE_NS = 10_000_000_000


SIDECAR_ENGINE = EngineRef("sidecar", 0, 0)  # findings about the sidecar's own links (the shared ledger)

# records that belong to one pool of an engine (the header's ``pool``, contract 1.5); the rest
# (requests, transfers, tiers) are the engine's and come with pool 0
POOL_RECORD_KINDS = frozenset(
    (wire.Kind.ALLOC, wire.Kind.FREE, wire.Kind.ASSIGN, wire.Kind.FORWARD, wire.Kind.CONTENT_CHANGED)
)
# what a pool that shares pool 0's pages (POOL ``shares_pages``) has only once, on pool 0's model
SHARED_PAGE_KINDS = frozenset((wire.Kind.ALLOC, wire.Kind.FREE, wire.Kind.CONTENT_CHANGED))


class Pipeline(TransferFlow, OffloadFlow):
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
    ):
        # sidecar.tracing.TraceRecorder or None: request spans; it is also a sink (findings become span events)
        self.tracer = tracer
        self.sinks = list(sinks) + ([tracer] if tracer is not None else [])
        self.history = History(history_events) if history_events else None
        # sizes the engines' ended-request directories (sidecar/memory_budget.py)
        self.memory_budget = memory_budget or MemoryBudget(DEFAULT_BUDGET_BYTES, history_events)
        self._budget_sized_ns = 0
        self.incidents = incidents or IncidentStore()
        self.incidents.max_bytes = self.memory_budget.incidents_bytes  # the budget's share
        self.engines: dict[int, EngineTracker] = {}
        self.ledger = TransferLedger(
            orphan_timeout_ns=int(orphan_timeout_s * 1e9), max_bytes=self.memory_budget.ledger_bytes
        )  # the budget's share
        # sidecar.ledger.shared.SharedLedger or None: the other pod's transfer facts (docs/detectors.md)
        self.shared_ledger = shared_ledger
        self.ledger.shared = shared_ledger is not None
        self.orphan_timeout_s = orphan_timeout_s
        self.last_tick_ns = 0  # the last tick's time (the records' clock): open transfers' age
        self.shared_grace_ns = SHARED_GRACE_NS
        # while Redis is unreachable, a finished receiver is held up to 10 waits past its own
        # (docs/detectors.md: 100 s), not 10 of the embedded ledger's 2 s grace
        self.ledger.max_hold_ns = 10 * SHARED_GRACE_NS
        self._degraded_reported_ns = 0
        # the detectors (sidecar/detectors/): each declares its kinds, the events it observes and
        # the optional hooks it needs; the set calls them (this class never names a detector)
        self.detectors = DetectorSet(default_detectors(isolate_tenants=isolate_tenants, ttft_anomaly=ttft_anomaly))
        self._init_offload()
        self._handlers = self._record_handlers()
        self.records_by_kind: Counter = Counter()
        self.findings_by_kind: Counter = Counter()
        self.incidents_by_kind: Counter = Counter()
        self.findings_suppressed = 0
        self.guard_aborts: Counter = Counter()  # finding kind -> requests the engine's guard failed
        self.records_lost = 0
        self.records_lost_by_engine: dict[int, int] = {}  # engine id -> records lost since first seen
        self.apply_errors = 0
        self.parts = EngineParts()  # rings that are one part of another process's engine (vLLM's Worker)
        # records naming a pool their engine never declared (POOL), or a kind a pool does not hold: skipped
        self.records_undeclared_pool = 0

    def verdict_options(self) -> dict:
        """The settings that change what this pipeline finds, as a recording keeps them for
        ``kvguard replay`` (sidecar/replay.py ``VERDICT_OPTIONS``; ``shared_ledger`` is
        recorded only: a replay has no other pod's facts)."""
        return {
            **self.detectors.settings(),  # isolate_tenants, ttft_anomaly
            "orphan_timeout_s": float(self.orphan_timeout_s),
            "shared_ledger": self.shared_ledger is not None,
        }

    # ------------------------------------------------------------------ helpers
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
        h = tracker.hello
        if h is None:
            return EngineRef("unknown", 0, 0)
        return EngineRef(tracker.role_name, h.tp_rank, h.pid)

    def _observe(self, event, t: EngineTracker | None, ts_ns: int) -> list[Finding]:
        """The findings of every detector that observes this event's type (not filed yet)."""
        if not self.detectors.observes(type(event)):
            return []
        at = At(t, self.engine_ref(t) if t is not None else SIDECAR_ENGINE, t.engine_id if t is not None else 0, ts_ns)
        found = self.detectors.observe(event, at)
        if t is not None and t.pool_index and found:  # a pool besides 0: the finding says which
            info = t.pool_info
            for finding in found:
                finding.evidence.setdefault("pool", t.pool_index)
                if info is not None:
                    finding.evidence.setdefault("pool_name", info.name)
                    finding.evidence.setdefault("pool_kind", info.kind.name.lower())
        return found

    def _emit(self, findings: list[Finding]) -> list[Finding]:
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
            self._deliver("send", finding)
        return out

    def _name_sender(self, finding: Finding) -> None:
        """A finding about a request with a bootstrap_room also names the prefill request that
        served the room when its rid differs from the reader's (a client that sent no rid through
        SGLang's router: each engine drew its own), so both ends can be looked up."""
        reader = finding.reader
        if reader is None or reader.bootstrap_room is None or "sender_rid" in finding.evidence:
            return
        state = self.ledger.find(reader.bootstrap_room)
        if state is not None and state.sender_rid and state.sender_rid != reader.rid:
            finding.evidence["sender_rid"] = state.sender_rid
            finding.evidence["sender_tenant"] = state.sender_tenant

    def _deliver(self, method: str, item) -> None:
        for sink in self.sinks:
            fn = getattr(sink, method, None)
            if fn is None:
                continue
            try:
                fn(item)
            except Exception as exc:  # noqa: BLE001 - a sink failure must not stop detection
                log.error("sink %s failed: %s", type(sink).__name__, exc)

    def _resolved(self, incidents) -> None:
        for inc in incidents:
            self._deliver("resolve", inc)

    def _record(self, *args, **kwargs) -> None:
        if self.history is not None:
            self.history.append(*args, **kwargs)

    # ------------------------------------------------------------------ records
    def apply(self, rec: wire.Record) -> list[Finding]:
        """Apply one record; never raises (a failure is logged and counted)."""
        self.records_by_kind[rec.kind.name] += 1
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
                return self._on_pool(t, rec)
            pool_tracker = t.pools.get(rec.pool)
            if pool_tracker is None or rec.kind not in POOL_RECORD_KINDS:
                self._undeclared_pool(t, rec)
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
        return {
            K.FORWARD: lambda t, rec: self._on_forward(t, rec.body, rec.ts_ns),
            K.ALLOC: self._on_alloc,
            K.ASSIGN: self._on_assign,
            K.FREE: self._on_free,
            K.REQ_BEGIN: self._on_request_begin,
            K.REQ_END: self._on_request_end,
            K.REQ_SCOPE: self._on_scope,
            # what the engine holds and what of it is watched (contract 1.5)
            K.COVERAGE: self._on_coverage,
            K.POOL: self._on_pool,
            # host / storage tiers (sidecar/offload.py)
            K.KV_STORE: self._on_kv_store,
            K.KV_LOAD: self._on_kv_load,
            K.KV_DIGEST: self._on_kv_digest,
            K.CONTENT_CHANGED: lambda t, rec: self._emit(
                self._observe(ContentChangedAt(rec.body.pages, rec.body.slots_changed), t, rec.ts_ns)
            ),
            K.REJECT: self._on_reject,
            K.HELLO: self._on_hello,
            K.XFER_SEND: self._on_xfer_send,
            K.XFER_RESERVE: lambda t, rec: self._on_reserve(t, rec.body, rec.ts_ns),
            K.XFER_DIGEST: lambda t, rec: self._on_digest(rec.engine_id, rec.body, rec.ts_ns),
            K.XFER_DONE: self._on_xfer_done,
            K.LOST: self._on_lost,
            # the engine's own read check (sidecar/detectors/tier1.py)
            K.TIER1_VIOLATION: lambda t, rec: self._emit(self._observe(rec.body, t, rec.ts_ns)),
            # what the engine's guard did (sidecar/detectors/guard.py)
            K.GUARD: self._on_guard,
        }

    def _on_scope(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        t.on_scope(rec.body)
        for pool_tracker in t.pools.values():  # their pages take the writer's scope too
            pool_tracker.on_scope(rec.body)
        return []

    def _on_coverage(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """An engine's COVERAGE, or a part's (vLLM's Worker reports its own, about its
        forwards): merged by component, so either order gives the engine's whole account."""
        items = {item.component: item for item in (t.coverage.items if t.coverage is not None else ())}
        items.update((item.component, item) for item in rec.body.items)
        t.coverage = wire.Coverage(list(items.values()))
        if t.coverage_reported or not t.coverage.gaps:
            return []  # one coverage_gap per engine: a later gap shows in /metrics and /v1/engines
        t.coverage_reported = True
        return self._emit(self._observe(t.coverage, t, rec.ts_ns))

    def _on_pool(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """A pool besides pool 0 (POOL, after the engine's HELLO): a tracker of its own, sharing
        the engine's request directory, with the HELLO's identity and this pool's page figures."""
        info: wire.PoolInfo = rec.body
        if t.hello is None or rec.pool == 0 or t.pool_index:
            self._undeclared_pool(t, rec)
            return []
        pool_tracker = EngineTracker(t.engine_id, t.requests, info)
        pool_tracker.pool_index = rec.pool
        if info.shares_pages:
            # the same pages as pool 0 (vLLM's KV cache groups: one block pool, aliased memory): one
            # page model, so a block one group freed and another took is judged as such; the rows
            # are this pool's. Its judge is the full one: the page-change log is pool 0's to consume
            pool_tracker.pool = t.pool
            pool_tracker.incremental = False
        hello = replace(
            t.hello,
            page_size=info.page_size,
            pool_pages=info.pool_pages,
            pool_tokens=info.pool_pages * info.page_size,
        )
        t.pools.pop(rec.pool, None)  # declared again (a replayed sticky copy): the new one replaces it
        allowed = self.memory_budget.pages_allowed(list(self.engines.values()))  # (t's own pools included)
        pool_tracker.on_hello(hello, max_pages=allowed)
        t.pools[rec.pool] = pool_tracker
        log.info(
            "engine %d pool %d (%s, %s): page_size %d, %d pages%s",
            rec.engine_id,
            rec.pool,
            info.name,
            info.kind.name.lower(),
            info.page_size,
            info.pool_pages,
            f", window {info.window_tokens} tokens" if info.window_tokens else "",
        )
        return []

    def _undeclared_pool(self, t: EngineTracker, rec: wire.Record) -> None:
        self.records_undeclared_pool += 1
        if self.records_undeclared_pool == 1:
            log.warning(
                "engine %d: %s record for pool %d, which the engine did not declare (or a kind no pool "
                "holds): skipped and counted in kvguard_records_undeclared_pool_total (logged once)",
                rec.engine_id,
                rec.kind.name,
                rec.pool,
            )

    def _on_guard(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        carried_kind = CARRIED_RULES.get(body.rule)
        if carried_kind is not None:  # the request's read / checksum findings, raised after this, carry the action
            t.requests.get_or_stub(body.req_key).guard_action = ACTIONS[body.action]
            if body.action == wire.GuardAction.ABORTED:
                self.guard_aborts[carried_kind] += 1
            return []
        found = self._observe(body, t, rec.ts_ns)
        if rec.body.action == wire.GuardAction.ABORTED:
            # counted before filing: a finding that joins an open incident is not delivered
            # again, but the engine still failed that request
            for f in found:
                self.guard_aborts[f.kind] += 1
        return self._emit(found)

    def _on_alloc(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        pages = t.on_alloc(rec.body.pages)  # the valid ids: one past the pool's limit is counted and skipped
        self._record(rec.ts_ns, rec.engine_id, Event.ALLOC, 0, pages, t.pool.gen[pages], pool=t.pool_index)
        return []

    def _on_assign(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        crossed = t.on_assign(body)
        self._record(
            rec.ts_ns, rec.engine_id, Event.ASSIGN, body.req_key, body.pages, aux=body.row_start, pool=t.pool_index
        )
        return [] if crossed is None else self._emit(self._observe(crossed, t, rec.ts_ns))

    def _on_free(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        self._record(rec.ts_ns, rec.engine_id, Event.FREE, 0, body.pages, aux=int(body.free_kind), pool=t.pool_index)
        already = t.on_free(body.pages)
        if len(already) == 0:
            return []
        return self._emit(self._observe(PagesFreedTwice(already, body.free_kind.name.lower()), t, rec.ts_ns))

    def _on_request_begin(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, eid = rec.body, rec.engine_id
        t.on_request_begin(body, rec.ts_ns)
        self._record(rec.ts_ns, eid, Event.REQ_BEGIN, body.req_key, aux=body.prompt_tokens)
        if body.room != wire.NO_ROOM and self._role(t) == wire.Role.PREFILL:
            self._publish_sender(
                self.ledger.on_sender_begin(eid, body.req_key, body.room, body.warmup, rid=body.rid, tenant=body.tenant)
            )
        if self.tracer is not None:
            self.tracer.on_request_begin(self.engine_ref(t), t.requests.get(body.req_key))
        return []

    def _on_request_end(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, ts = rec.body, rec.ts_ns
        info = t.requests.get(body.req_key)
        row = t.rows.get(body.req_key)
        pages = 0 if row is None else int((row.pages > 0).sum())  # before on_request_end drops the row
        written = t.take_prompt_pages_written(body.req_key)
        t.on_request_end(body, ts)
        for pool_tracker in t.pools.values():  # its rows in the engine's other pools go too
            pool_tracker.release_row(body.req_key)
        self._record(ts, rec.engine_id, Event.REQ_END, body.req_key, aux=int(body.finish))
        found = self._transfer_end(t, info, body, ts)
        if info is not None and t.hello is not None:
            ps = max(t.page_size, 1)
            span = -(-info.prompt_tokens // ps) - info.cached_tokens // ps  # pages the uncached prompt spans
            found += self._emit(self._observe(RequestEnded(info, None if written is None else (written, span)), t, ts))
            self._resolved(self.incidents.on_request_end(t.hello.pid, info.rid, ts))
        if self.tracer is not None:  # after the TTFT finding, so that it lands on the open span
            self.tracer.on_request_end(
                self.engine_ref(t), t.requests.get(body.req_key), pages=pages, output_tokens=body.output_tokens
            )
        return found

    def _on_reject(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        t.on_reject(body)
        self._record(rec.ts_ns, rec.engine_id, Event.REJECT, body.req_key, aux=int(body.phase))
        info = t.requests.get(body.req_key)
        if self._role(t) == wire.Role.PREFILL and info is not None and info.room is not None:
            gave_up = "abort" if body.phase == wire.Phase.CLIENT_ABORT else "reject"
            return self._sender_gave_up(body.req_key, info.room, gave_up, rec.ts_ns)
        return []

    def _on_hello(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, ts = rec.body, rec.ts_ns
        allowed = self.memory_budget.pages_allowed([o for o in self.engines.values() if o is not t])
        if body.pool_pages > allowed:
            log.error(
                "engine %d (pid %d) announces a pool of %d pages; --memory-budget %d leaves room to model "
                "%d: pages past %d are not tracked (counted in kvguard_page_ids_out_of_range_total, their "
                "reads unverified). Raise --memory-budget (and the container's memory limit)",
                rec.engine_id,
                body.pid,
                body.pool_pages,
                self.memory_budget.total_bytes,
                allowed,
                allowed,
            )
        t.on_hello(body, max_pages=allowed)
        self.parts.on_hello(rec.engine_id, body.pid)
        self.memory_budget.size_directories(list(self.engines.values()))  # its page model is known now
        log.info(
            "engine %d: %s %s rank %d pid %d, page_size %d, pool %d pages / %d tokens, context %d",
            rec.engine_id,
            body.engine_name,
            ROLE_NAMES.get(body.role),
            body.tp_rank,
            body.pid,
            body.page_size,
            body.pool_pages,
            body.pool_tokens,
            body.context_len,
        )
        found = self._observe(body, t, ts)
        if not found:
            self._resolved(self.incidents.on_engine_hello(body.pid, ROLE_NAMES.get(body.role), True, ts))
        return self._emit(found)

    def _on_forward(self, t: EngineTracker, f: wire.Forward, ts_ns: int) -> list[Finding]:
        # a forward writes its new tokens' KV before attention reads the rows
        findings = []
        if t.writes_overlap(f.write_pages):  # a page written twice: the order matters, one request at a time
            w_off = np.concatenate(([0], np.cumsum(f.write_counts, dtype=np.int64)))
            for i, key in enumerate(f.req_keys.tolist()):
                if w_off[i + 1] > w_off[i]:
                    written = f.write_pages[w_off[i] : w_off[i + 1]].astype(np.int64)
                    verdict = t.check_write(key, written)
                    if verdict is not None:
                        findings += self._emit(self._observe(verdict, t, ts_ns))
                    t.mark_written(key, written, ts_ns)
        else:  # the whole batch at once: verdicts only for the requests that wrote where they should not
            for _i, verdict in t.check_writes(f.req_keys, f.write_counts, f.write_pages):
                findings += self._emit(self._observe(verdict, t, ts_ns))
            t.mark_writes(f.req_keys, f.write_counts, f.write_pages, ts_ns)
        # (a forward's late write is not marked as replacing its owner's KV, as a late transfer
        # chunk is: it writes single token slots, the owner may write that slot itself before
        # it reads it, and the record names pages, not slots: docs/detectors.md, late_write)
        t.count_prompt_writes(f.req_keys, f.seq_lens, f.write_counts, f.write_pages)
        self._record(
            ts_ns, t.engine_id, Event.WRITE, np.repeat(f.req_keys, f.write_counts), f.write_pages, pool=t.pool_index
        )
        if not t.pool_index:  # (a read per request per forward: pool 0's says it)
            self._record(ts_ns, t.engine_id, Event.READ, f.req_keys, aux=f.seq_lens)
        # the whole batch is judged at once; verdicts come only for requests with something to look at
        for _i, read in t.classify_reads(
            f.req_keys, f.seq_lens, f.read_counts, f.read_pages, want_shared=self.detectors.wants_shared_reads
        ):
            found = self._observe(read, t, ts_ns)
            if found:
                findings += self._emit(found)
        return findings

    def _on_lost(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """One gap (a LOST marker): its own size, and the engine's running total, go into the
        finding; the incident that groups an engine's gaps adds them up (sidecar/incidents.py)."""
        self.records_lost += rec.body
        total = self.records_lost_by_engine[t.engine_id] = self.records_lost_by_engine.get(t.engine_id, 0) + rec.body
        t.on_lost(rec.ts_ns)
        for pool_tracker in t.pools.values():  # the gap may hide any pool's records
            pool_tracker.on_lost(None)
        return self._emit(self._observe(RecordsLost(rec.body, rec.seq, total), t, rec.ts_ns))

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
        found = self._emit(self.detectors.on_engine_gone(engine_id, ts_ns))
        del self.engines[engine_id]
        self.memory_budget.size_directories(list(self.engines.values()))  # its share goes to the others
        self.records_lost_by_engine.pop(engine_id, None)
        self.ledger.forget_engine(engine_id)
        if self.tracer is not None:
            self.tracer.on_engine_gone(self.engine_ref(tracker), ts_ns)
        if tracker.hello is not None:
            self._resolved(self.incidents.on_engine_gone(tracker.hello.pid, ts_ns))
        return found

    def _request_live(self, engine_id: int, req_key: int) -> bool:
        tracker = self.engines.get(engine_id)
        return tracker is not None and req_key in tracker.requests.live

    def tick(self, now_ns: int) -> list[Finding]:
        self.last_tick_ns = now_ns  # the clock open transfers are aged on (stats)
        found = self._tick_shared(now_ns) if self.shared_ledger is not None else []
        page_size_of = lambda eid: self.engines[eid].page_size if eid in self.engines else 1
        found += self._apply_final(self.ledger.expire(now_ns, page_size_of), now_ns)
        for state in self.ledger.orphans(now_ns):
            found += self._orphan(state, now_ns)
        found += self._emit(self.detectors.tick(now_ns))
        self._resolved(self.incidents.tick(now_ns))
        for tracker in self.engines.values():
            tracker.retire_idle_requests(now_ns)
            for pool_tracker in tracker.pools.values():
                pool_tracker.retire_idle_requests(now_ns)
        if now_ns - self._budget_sized_ns >= BUDGET_RESIZE_NS:  # live requests come and go
            self._budget_sized_ns = now_ns
            self.memory_budget.size_directories(list(self.engines.values()))
        return found

    # ------------------------------------------------------------------ what it publishes
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
            ledger=self.ledger.stats((e.engine_id for e in engines), self.last_tick_ns, self._request_live),
            # the queued alert sinks; the log and JSON-lines sinks (and the tracer) write
            # synchronously and cannot fail quietly, so they have nothing to report
            sinks=tuple(sink.delivery_stats() for sink in self.sinks if hasattr(sink, "delivery_stats")),
            guard_aborts={kind: self.guard_aborts[kind] for kind in GUARD_ABORT_KINDS},
            loads_unverified=self.loads_unverified,
            objects_forgotten=self.objects_forgotten,
            load_digests_compared=self.load_digests_compared,
            records_without_engine=self.parts.records_without_engine,
            records_undeclared_pool=self.records_undeclared_pool,
        )

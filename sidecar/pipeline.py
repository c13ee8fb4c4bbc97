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

import numpy as np

from kvguard.engine_hooks import wire

from .detectors.config import PoolContextDetector
from .detectors.isolation import TenantIsolationDetector
from .detectors.lifetime import DoubleFreeDetector, WriteDetector
from .detectors.reads import ReadDetector
from .detectors.tier1 import tier1_findings
from .detectors.transfers import ChecksumDetector, OrphanDetector, TransferSizeDetector, ledger_degraded_finding
from .detectors.ttft import TTFTDetector
from .findings import WARNING, EngineRef, Finding
from .history import Event, History
from .incidents import IncidentStore
from .ledger import REMOTE_ENGINE, RoomState, TransferLedger
from .memory_budget import DEFAULT_BUDGET_BYTES, MemoryBudget
from .provisional import ProvisionalWrite
from .tracker import EngineTracker, RequestDirectory

BUDGET_RESIZE_NS = 5_000_000_000  # the directories' share follows the live requests this often

log = logging.getLogger("kvguard.pipeline")

ROLE_NAMES = {wire.Role.UNIFIED: "unified", wire.Role.PREFILL: "prefill", wire.Role.DECODE: "decode"}
# with a shared ledger, how long a receiver that finished waits for the sender's facts from the other
# pod (its sidecar reads its ring, publishes, and this sidecar polls: a few cycles, plus outages)
SHARED_GRACE_NS = 10_000_000_000
DEGRADED_REPEAT_NS = 30_000_000_000  # a degraded ledger re-reports this often (keeps its incident firing)


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
        self.shared_grace_ns = SHARED_GRACE_NS
        # while Redis is unreachable, a finished receiver is held up to 10 waits past its own
        # (docs/detectors.md: 100 s), not 10 of the embedded ledger's 2 s grace
        self.ledger.max_hold_ns = 10 * SHARED_GRACE_NS
        self._degraded_reported_ns = 0
        self.checksum_detector = ChecksumDetector()
        self.orphan_detector = OrphanDetector()
        self.read_detector = ReadDetector()
        self.transfer_detector = TransferSizeDetector()
        self.config_detector = PoolContextDetector()
        self.write_detector = WriteDetector()
        self.double_free_detector = DoubleFreeDetector()
        # off by default: on the real PD soak its model still flagged a normally prefilled request
        self.ttft_detector = TTFTDetector(enabled=ttft_anomaly, prefill_evidence=self._prompt_pages_written)
        self.isolation_detector = TenantIsolationDetector(isolate_tenants)
        self.records_by_kind: Counter = Counter()
        self.findings_by_kind: Counter = Counter()
        self.incidents_by_kind: Counter = Counter()
        self.findings_suppressed = 0
        self.records_lost = 0
        self.records_lost_by_engine: dict[int, int] = {}  # engine id -> records lost since first seen
        self.apply_errors = 0

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
        return EngineRef(ROLE_NAMES.get(h.role, "unknown"), h.tp_rank, h.pid)

    def _emit(self, findings: list[Finding]) -> list[Finding]:
        """File findings into incidents; deliver the first finding of each new incident."""
        out = []
        for finding in findings:
            self._name_sender(finding)
            self.findings_by_kind[(finding.kind, finding.severity)] += 1
            _incident, is_new = self.incidents.observe(finding)
            if is_new:
                self.incidents_by_kind[(finding.kind, finding.severity)] += 1
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
        t = self.tracker(rec.engine_id)
        body, kind = rec.body, rec.kind
        ts, eid = rec.ts_ns, rec.engine_id
        if t.unseen_since_loss:  # requests live at a gap: each record naming one shows it outlived it
            t.on_named(body)
        if kind == wire.Kind.FORWARD:
            return self._on_forward(t, body, rec.ts_ns)
        if kind == wire.Kind.ALLOC:
            pages = t.on_alloc(body.pages)  # the valid ids: one past the pool's limit is counted and skipped
            self._record(ts, eid, Event.ALLOC, 0, pages, t.pool.gen[pages])
        elif kind == wire.Kind.ASSIGN:
            t.on_assign(body)
            self._record(ts, eid, Event.ASSIGN, body.req_key, body.pages, aux=body.row_start)
        elif kind == wire.Kind.FREE:
            self._record(ts, eid, Event.FREE, 0, body.pages, aux=int(body.free_kind))
            already = t.on_free(body.pages)
            found = self.double_free_detector.observe(
                t, self.engine_ref(t), already, body.free_kind.name.lower(), rec.ts_ns
            )
            return self._emit(found)
        elif kind == wire.Kind.REQ_BEGIN:
            t.on_request_begin(body, rec.ts_ns)
            self._record(ts, eid, Event.REQ_BEGIN, body.req_key, aux=body.prompt_tokens)
            if body.room != wire.NO_ROOM and self._role(t) == wire.Role.PREFILL:
                self._publish_sender(
                    self.ledger.on_sender_begin(
                        eid, body.req_key, body.room, body.warmup, rid=body.rid, tenant=body.tenant
                    )
                )
            if self.tracer is not None:
                self.tracer.on_request_begin(self.engine_ref(t), t.requests.get(body.req_key))
        elif kind == wire.Kind.REQ_END:
            info = t.requests.get(body.req_key)
            row = t.rows.get(body.req_key)
            pages = 0 if row is None else int((row.pages > 0).sum())  # before on_request_end drops the row
            t.on_request_end(body, rec.ts_ns)
            self._record(ts, eid, Event.REQ_END, body.req_key, aux=int(body.finish))
            found = self._transfer_end(t, info, body, ts)
            if info is not None and t.hello is not None:
                found += self._emit(self.ttft_detector.observe(eid, self.engine_ref(t), info, ts))
                self._resolved(self.incidents.on_request_end(t.hello.pid, info.rid, ts))
            if self.tracer is not None:  # after the TTFT finding, so that it lands on the open span
                self.tracer.on_request_end(
                    self.engine_ref(t), t.requests.get(body.req_key), pages=pages, output_tokens=body.output_tokens
                )
            return found
        elif kind == wire.Kind.REJECT:
            t.on_reject(body)
            self._record(ts, eid, Event.REJECT, body.req_key, aux=int(body.phase))
            info = t.requests.get(body.req_key)
            if self._role(t) == wire.Role.PREFILL and info is not None and info.room is not None:
                gave_up = "abort" if body.phase == wire.Phase.CLIENT_ABORT else "reject"
                return self._sender_gave_up(body.req_key, info.room, gave_up, ts)
        elif kind == wire.Kind.HELLO:
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
            found = self.config_detector.observe(self.engine_ref(t), body, rec.ts_ns)
            if not found:
                self._resolved(self.incidents.on_engine_hello(body.pid, ROLE_NAMES.get(body.role), True, ts))
            return self._emit(found)
        elif kind == wire.Kind.XFER_SEND:
            found = self._late_send(body, ts)
            receiver = self.ledger.pending.get(body.room)
            receiver_t = self.engines.get(receiver.receiver_engine) if receiver is not None else None
            final = self.ledger.on_send(rec.engine_id, body, receiver_t.page_size if receiver_t else t.page_size)
            if final is not None:
                found += self._apply_final([final], ts)
            self._publish_sender(self.ledger.find(body.room, sender_key=body.req_key))
            return found
        elif kind == wire.Kind.XFER_RESERVE:
            return self._on_reserve(t, body, ts)
        elif kind == wire.Kind.XFER_DIGEST:
            return self._on_digest(eid, body, ts)
        elif kind == wire.Kind.XFER_DONE:
            if body.side == wire.Side.RECEIVER:
                found = self._on_transfer_done(t, body, rec.ts_ns)
                self._publish_receiver(self.ledger.find(body.room, receiver_key=body.req_key))
                return found
            if self.shared_ledger is not None:  # a prefill pod: its rooms have no receiver here, retire them
                self.ledger.on_sender_done(body.req_key, body.room)
        elif kind == wire.Kind.LOST:
            return self._on_lost(t, rec)
        elif kind == wire.Kind.TIER1_VIOLATION:  # the engine's own read check (sidecar/detectors/tier1.py)
            return self._emit(tier1_findings(t, self.engine_ref(t), body, ts))
        return []

    def _on_forward(self, t: EngineTracker, f: wire.Forward, ts_ns: int) -> list[Finding]:
        # a forward writes its new tokens' KV before attention reads the rows
        findings = []
        engine = self.engine_ref(t)
        if t.writes_overlap(f.write_pages):  # a page written twice: the order matters, one request at a time
            w_off = np.concatenate(([0], np.cumsum(f.write_counts, dtype=np.int64)))
            for i, key in enumerate(f.req_keys.tolist()):
                if w_off[i + 1] > w_off[i]:
                    written = f.write_pages[w_off[i] : w_off[i + 1]].astype(np.int64)
                    verdict = t.check_write(key, written)
                    if verdict is not None:
                        findings += self._emit(self.write_detector.observe(t, engine, verdict, ts_ns))
                    t.mark_written(key, written, ts_ns)
        else:  # the whole batch at once: verdicts only for the requests that wrote where they should not
            for _i, verdict in t.check_writes(f.req_keys, f.write_counts, f.write_pages):
                findings += self._emit(self.write_detector.observe(t, engine, verdict, ts_ns))
            t.mark_writes(f.req_keys, f.write_counts, f.write_pages, ts_ns)
        self._record(ts_ns, t.engine_id, Event.WRITE, np.repeat(f.req_keys, f.write_counts), f.write_pages)
        self._record(ts_ns, t.engine_id, Event.READ, f.req_keys, aux=f.seq_lens)
        # the whole batch is judged at once; verdicts come only for requests with something to look at
        for _i, verdict in t.classify_reads(
            f.req_keys, f.seq_lens, f.read_counts, f.read_pages, want_shared=self.isolation_detector.enabled
        ):
            found = self.read_detector.observe(t, engine, verdict, ts_ns)
            found += self.isolation_detector.observe(t, engine, verdict, ts_ns)
            if found:
                findings += self._emit(found)
        return findings

    def _on_transfer_done(self, t: EngineTracker, x: wire.XferDone, ts_ns: int) -> list[Finding]:
        grace = self.shared_grace_ns if self.shared_ledger is not None else None
        pairing = self.ledger.on_receiver_done(x, t.page_size, ts_ns, grace_ns=grace)
        if pairing is None:
            return []
        row = t.rows.get(pairing.receiver_key)
        if pairing.provisional:
            # the sender's last chunk is not applied yet (its record may trail the receiver's):
            # take the pages as written for now, remember what they held, decide on the chunk
            if row is not None:
                row_pages = row.pages[: pairing.reserved_pages]
                idx = np.flatnonzero(row_pages > 0)
                pages = row_pages[idx].astype(np.int64)
                pairing.state.provisional = ProvisionalWrite(
                    pages,
                    t.pool.gen[pages].copy(),
                    t.pool.written_gen[pages].copy(),
                    idx,
                    t.pool.last_writer[pages].copy(),
                    t.requests.get(pairing.receiver_key),
                )
                t.pool.written_gen[pages] = t.pool.gen[pages]
            return []
        return self._apply_pairing(t, pairing, ts_ns)

    def _apply_pairing(self, t: EngineTracker, pairing, ts_ns: int) -> list[Finding]:
        row = t.rows.get(pairing.receiver_key)
        saved = getattr(pairing.state, "provisional", None)
        found: list[Finding] = []
        if saved is not None:
            pages = saved.pages
            unchanged = t.pool.gen[pages] == saved.gens  # not reallocated meanwhile
            t.pool.changed(pages[unchanged])  # written_gen goes back: logged for the tracker's incremental judge
            t.pool.written_gen[pages[unchanged]] = saved.written_gen[unchanged]  # undo the provisional mark
            if row is None and pairing.sent_tokens < pairing.reserved_tokens:
                # the reader ended (and freed its pages) before the sender's facts came: judge
                # the read it made meanwhile from what its pages held then
                verdict = saved.late_read_verdict(pairing.written_row_pages)
                if verdict is not None:
                    found += self.read_detector.observe(t, self.engine_ref(t), verdict, ts_ns)
        if row is not None:
            idx = pairing.written_row_pages[pairing.written_row_pages < len(row.pages)]
            t.mark_written(pairing.receiver_key, row.pages[idx], ts_ns)
            self._record(
                ts_ns, t.engine_id, Event.TRANSFER_WRITE, pairing.receiver_key, row.pages[idx], aux=pairing.sent_tokens
            )
            if saved is not None and pairing.sent_tokens < pairing.reserved_tokens:
                # decode already attended over these pages while we waited: judge that read now
                verdict = t.classify_read(pairing.receiver_key, pairing.reserved_tokens, None)
                if verdict is not None:
                    found += self.read_detector.observe(t, self.engine_ref(t), verdict, ts_ns)
        found += self.transfer_detector.observe(t, self.engine_ref(t), pairing, ts_ns)
        return self._emit(found)

    def _apply_final(self, pairings, ts_ns: int) -> list[Finding]:
        found = []
        for pairing in pairings:
            t = self.engines.get(pairing.receiver_engine)
            if t is not None:
                found += self._apply_pairing(t, pairing, ts_ns)
        return found

    # ------------------------------------------------------------------ transfers: the ledger
    @staticmethod
    def _role(t: EngineTracker):
        return None if t.hello is None else t.hello.role

    def _on_reserve(self, t: EngineTracker, x: wire.XferReserve, ts_ns: int) -> list[Finding]:
        state = self.ledger.on_reserve(t.engine_id, x, ts_ns)
        info = t.requests.get(x.req_key)
        state.warmup = state.warmup or bool(info is not None and info.warmup)
        if self.shared_ledger is not None and not state.warmup:
            self._publish_receiver(state)
            until = ts_ns + self.ledger.orphan_timeout_ns + 2 * self.shared_grace_ns
            self.shared_ledger.watch(x.room, "sender", until)
        if self.ledger.orphan_now(state, ts_ns):  # prefill had already rejected the prompt and ended
            return self._orphan(state, ts_ns)
        return []

    def _on_digest(self, engine_id: int, x: wire.XferDigest, ts_ns: int) -> list[Finding]:
        hit = self.ledger.on_digest(engine_id, x)
        if x.side == wire.Side.SENDER:
            state = self.ledger.find(x.room, sender_key=x.req_key)
            self._publish_sender(state)
        else:
            self._publish_receiver(self.ledger.find(x.room, receiver_key=x.req_key))
        return self._judge_digests(hit, ts_ns)

    def _judge_digests(self, hit, ts_ns: int) -> list[Finding]:
        """Both ends' digests are complete: the receiver's sidecar (this one, if it sees decode) judges."""
        if hit is None:
            return []
        state, verdict = hit
        t = self.engines.get(state.receiver_engine)
        if t is None:
            return []  # the receiver is in another pod: its sidecar owns the finding
        return self._emit(self.checksum_detector.observe(t, self.engine_ref(t), state, verdict, ts_ns))

    def _sender_gave_up(
        self, req_key: int, room: int, reason: str, ts_ns: int, local: bool = True, ended: bool = False
    ) -> list[Finding]:
        orphan = self.ledger.on_sender_gave_up(req_key, room, reason, ts_ns, ended=ended)
        if local:
            self._publish_sender(self.ledger.find(room, sender_key=req_key))
        return [] if orphan is None else self._orphan(orphan, ts_ns)

    def _transfer_end(self, t: EngineTracker, info, end: wire.ReqEnd, ts_ns: int) -> list[Finding]:
        """A request with a room ended: a prefill request that never sent its last chunk gave up;
        a decode request that ended holds no reserved pages any more."""
        if info is None or info.room is None:
            return []
        role = self._role(t)
        if role == wire.Role.PREFILL and end.finish in (wire.Finish.ABORT, wire.Finish.REJECT):
            return self._sender_gave_up(
                end.req_key, info.room, "reject" if end.finish == wire.Finish.REJECT else "abort", ts_ns, ended=True
            )
        if role == wire.Role.DECODE:
            self.ledger.on_receiver_end(end.req_key, info.room)
        return []

    def _orphan(self, state: RoomState, ts_ns: int) -> list[Finding]:
        t = self.engines.get(state.receiver_engine)
        if t is None:
            return []
        if self.shared_ledger is not None:
            self.shared_ledger.unwatch(state.room, "sender")
        return self._emit(self.orphan_detector.observe(t, self.engine_ref(t), state, self.orphan_timeout_s, ts_ns))

    def _publish_sender(self, state: RoomState | None) -> None:
        if self.shared_ledger is None or state is None or state.warmup or not state.sender_key:
            return
        chunks = [[c.token_start, c.token_end, int(c.is_last), c.num_pages] for c in state.chunks]
        self.shared_ledger.publish(
            "sender",
            state.room,
            state.sender_key,
            {
                "began": state.sender_began,
                "warmup": state.warmup,
                "gave_up": state.sender_gave_up,
                "ended": state.sender_ended,
                "rid": state.sender_rid,
                "tenant": state.sender_tenant,
                "chunks": chunks,
                "digests": state.sender_digest.to_json(),
            },
        )

    def _publish_receiver(self, state: RoomState | None) -> None:
        if (
            self.shared_ledger is None
            or state is None
            or state.warmup
            or state.reserved_pages is None
            or state.receiver_engine == REMOTE_ENGINE
        ):
            return
        self.shared_ledger.publish(
            "receiver",
            state.room,
            state.receiver_key,
            {
                "reserved_tokens": state.reserved_tokens,
                "reserved_pages": len(state.reserved_pages),
                "status": state.done_status,
                "digests": state.receiver_digest.to_json(),
            },
        )

    def _tick_shared(self, now_ns: int) -> list[Finding]:
        link = self.shared_ledger
        degraded = link.degraded  # read first: a recovery's results are queued before the flag flips back
        found: list[Finding] = []
        for room, side, facts in link.take_results():
            if side == "sender":
                found += self._apply_remote_sender(room, facts, now_ns)
        self.ledger.paused = degraded
        if not degraded:
            self._degraded_reported_ns = 0
        elif not self._degraded_reported_ns or now_ns - self._degraded_reported_ns >= DEGRADED_REPEAT_NS:
            self._degraded_reported_ns = now_ns
            waiting = len(self.ledger.pending) + sum(s.receiver_open for s in self.ledger.rooms.values())
            found += self._emit([ledger_degraded_finding(link.display_url, link.last_error, waiting, now_ns)])
        return found

    def _apply_remote_sender(self, room: int, facts: list[dict], now_ns: int) -> list[Finding]:
        """The sender's facts from another pod, applied like local records. Their chunks are not
        checked as late writes: without comparing two pods' clocks nothing orders them against
        decode's frees. Facts are matched to the receiver's story by room; a sender key the story
        already knows selects its facts, and facts of two sending requests for one room that the
        story cannot tell apart are set aside (counted) rather than guessed."""
        state = self.ledger.find(room)
        if state is None or state.receiver_engine is None or state.receiver_engine == REMOTE_ENGINE:
            return []  # nothing of ours waits for these facts (any more)
        by_key: dict[int, list[dict]] = {}
        for fact in facts:
            by_key.setdefault(int(fact["req_key"], 16), []).append(fact)
        if state.sender_key:
            sender_key, facts = state.sender_key, by_key.get(state.sender_key, [])
        elif len(by_key) == 1:
            ((sender_key, facts),) = by_key.items()
        else:
            self.ledger.rooms_ambiguous += 1
            return []
        t = self.engines.get(state.receiver_engine)
        page_size = t.page_size if t is not None else 1
        found: list[Finding] = []
        for fact in facts:
            if fact["began"]:
                self.ledger.on_sender_begin(
                    REMOTE_ENGINE,
                    sender_key,
                    room,
                    fact["warmup"],
                    rid=fact.get("rid", ""),
                    tenant=fact.get("tenant", ""),
                )
            for t0, t1, last, n_pages in fact["chunks"]:
                if (t0, t1, last) in state.remote_chunks:
                    continue
                if state.overflowed:  # (sidecar/ledger/memory.py MAX_CHUNKS_PER_ROOM) nothing more is kept
                    break
                state.remote_chunks.add((t0, t1, last))
                if self.ledger.rooms.get(room) is not state and self.ledger.pending.get(room) is not state:
                    continue  # decided already (closed): nothing to pair
                x = wire.XferSend(sender_key, room, 0, t0, t1, bool(last), np.zeros(n_pages, np.int64))
                final = self.ledger.on_send(REMOTE_ENGINE, x, page_size)
                if final is not None:
                    found += self._apply_final([final], now_ns)
            for alg, h0, hn, digest, t0, t1, layers, total in fact["digests"]:
                x = wire.XferDigest(sender_key, room, wire.Side.SENDER, alg, digest, t0, t1, layers, h0, hn, total)
                found += self._judge_digests(self.ledger.on_digest(REMOTE_ENGINE, x), now_ns)
            if fact["gave_up"]:
                found += self._sender_gave_up(
                    sender_key, room, fact["gave_up"], now_ns, local=False, ended=fact["ended"]
                )
        settled = state.compared or state.orphan_reported or state.sender_ended
        if settled or (
            state.done_status
            and state.sent_last
            and not state.receiver_digest.by_alg
            and self.ledger.pending.get(room) is not state
        ):
            self.shared_ledger.unwatch(room, "sender")
        return found

    def _late_send(self, x: wire.XferSend, ts_ns: int) -> list[Finding]:
        """A chunk sent for a room whose receiver already finished: does it land in pages
        that are now free or another request's?"""
        if x.room not in self.ledger.closed:
            return []
        receiver_engine = self.ledger.closed[x.room].receiver_engine
        t = self.engines.get(receiver_engine)
        if t is None or t.hello is None:
            return []
        hit = self.ledger.late_target(x, t.page_size)
        if hit is None:
            return []
        state, pages = hit
        verdict = t.check_write(state.receiver_key, pages, require_known_writer=False)
        if verdict is None:
            return []
        found = self.write_detector.observe(t, self.engine_ref(t), verdict, ts_ns)
        for f in found:
            f.evidence.update(
                {"via": "transfer", "bootstrap_room": x.room, "token_start": x.token_start, "token_end": x.token_end}
            )
        return self._emit(found)

    def _on_lost(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """One gap (a LOST marker): its own size, and the engine's running total, go into the
        finding; the incident that groups an engine's gaps adds them up (sidecar/incidents.py)."""
        self.records_lost += rec.body
        total = self.records_lost_by_engine[t.engine_id] = self.records_lost_by_engine.get(t.engine_id, 0) + rec.body
        t.on_lost(rec.ts_ns)
        engine = self.engine_ref(t)
        summary = (
            f"{engine.role} rank {engine.rank}: {rec.body} records lost in this gap, {total} on this engine "
            f"so far (ring full or unreadable); page ownership is unknown until pages are reallocated: "
            f"reads in this window are not verified"
        )
        finding = Finding(
            "events_lost",
            WARNING,
            engine,
            None,
            [],
            [],
            rec.ts_ns,
            summary,
            {"records_lost": rec.body, "first_missing_seq": rec.seq, "engine_records_lost_total": total},
        )
        return self._emit([finding])

    def _prompt_pages_written(self, engine_id: int, info) -> tuple[int, int] | None:
        """(pages this request's own forwards wrote while its seq_len was within its prompt,
        pages its uncached prompt spans), from the bounded history; None when the history no
        longer holds the request's REQ_BEGIN (its forwards may be gone too). Asked only for a
        ttft suspect, so the scan of the history is rare.

        Page writes are counted per forward, not as distinct pages: with chunked prefill the
        radix cache may take a chunk's KV over (remapping the row to identical cached pages)
        and free the request's own pages, which the next chunk then reuses (the soak shows
        it), so one page can legitimately carry two chunks of the same prompt."""
        t = self.engines.get(engine_id)
        if t is None or self.history is None:
            return None
        ev = self.history.request_events(info.key, limit=self.history.capacity)
        ev = ev[ev["engine"] == engine_id]
        if not (ev["event"] == Event.REQ_BEGIN).any():
            return None
        prompt = info.prompt_tokens
        prefill_ts = ev["ts_ns"][(ev["event"] == Event.READ) & (ev["aux"] <= prompt)]
        writes = ev[(ev["event"] == Event.WRITE) & np.isin(ev["ts_ns"], prefill_ts)]
        ps = max(t.page_size, 1)
        per_forward = np.unique(writes[["ts_ns", "page"]]) if len(writes) else writes
        return len(per_forward), -(-prompt // ps) - info.cached_tokens // ps

    # ------------------------------------------------------------------ housekeeping
    def on_engine_gone(self, engine_id: int, ts_ns: int) -> list[Finding]:
        """An engine process exited (its ring was retired): close what only it could clear.
        TTFT suspects still waiting for later requests are judged now (no more will come)."""
        tracker = self.engines.get(engine_id)
        if tracker is None:
            return []
        # judged while the engine is still here: the prefill-evidence gate reads its history
        found = self._emit(self.ttft_detector.on_engine_gone(engine_id, ts_ns))
        del self.engines[engine_id]
        self.memory_budget.size_directories(list(self.engines.values()))  # its share goes to the others
        self.records_lost_by_engine.pop(engine_id, None)
        self.ledger.forget_engine(engine_id)
        if self.tracer is not None:
            self.tracer.on_engine_gone(self.engine_ref(tracker), ts_ns)
        if tracker.hello is not None:
            self._resolved(self.incidents.on_engine_gone(tracker.hello.pid, ts_ns))
        return found

    def tick(self, now_ns: int) -> list[Finding]:
        found = self._tick_shared(now_ns) if self.shared_ledger is not None else []
        page_size_of = lambda eid: self.engines[eid].page_size if eid in self.engines else 1
        found += self._apply_final(self.ledger.expire(now_ns, page_size_of), now_ns)
        for state in self.ledger.orphans(now_ns):
            found += self._orphan(state, now_ns)
        found += self._emit(self.ttft_detector.tick(now_ns))
        self._resolved(self.incidents.tick(now_ns))
        for tracker in self.engines.values():
            tracker.retire_idle_requests(now_ns)
        if now_ns - self._budget_sized_ns >= BUDGET_RESIZE_NS:  # live requests come and go
            self._budget_sized_ns = now_ns
            self.memory_budget.size_directories(list(self.engines.values()))
        return found

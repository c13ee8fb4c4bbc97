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

from engine_hooks import wire

from .detectors.config import PoolContextDetector
from .detectors.isolation import TenantIsolationDetector
from .detectors.lifetime import DoubleFreeDetector, WriteDetector
from .detectors.reads import ReadDetector
from .detectors.transfers import TransferSizeDetector
from .detectors.ttft import TTFTDetector
from .findings import WARNING, EngineRef, Finding
from .history import Event, History
from .incidents import IncidentStore
from .ledger import TransferLedger
from .tracker import EngineTracker, RequestDirectory

log = logging.getLogger("kvguard.pipeline")

ROLE_NAMES = {wire.Role.UNIFIED: "unified", wire.Role.PREFILL: "prefill", wire.Role.DECODE: "decode"}


class Pipeline:
    def __init__(self, sinks=(), history_events: int = 1 << 20, incidents: IncidentStore | None = None,
                 isolate_tenants: bool = False, tracer=None, ttft_anomaly: bool = False):
        # sidecar.tracing.TraceRecorder or None: request spans; it is also a sink (findings become span events)
        self.tracer = tracer
        self.sinks = list(sinks) + ([tracer] if tracer is not None else [])
        self.history = History(history_events) if history_events else None
        self.incidents = incidents or IncidentStore()
        self.engines: dict[int, EngineTracker] = {}
        self.ledger = TransferLedger()
        self.read_detector = ReadDetector()
        self.transfer_detector = TransferSizeDetector()
        self.config_detector = PoolContextDetector()
        self.write_detector = WriteDetector()
        self.double_free_detector = DoubleFreeDetector()
        # off by default: on the real PD soak its model still flagged a normally prefilled request
        self.ttft_detector = TTFTDetector(enabled=ttft_anomaly)
        self.isolation_detector = TenantIsolationDetector(isolate_tenants)
        self.records_by_kind: Counter = Counter()
        self.findings_by_kind: Counter = Counter()
        self.incidents_by_kind: Counter = Counter()
        self.findings_suppressed = 0
        self.records_lost = 0
        self.apply_errors = 0

    # ------------------------------------------------------------------ helpers
    def tracker(self, engine_id: int) -> EngineTracker:
        tracker = self.engines.get(engine_id)
        if tracker is None:
            tracker = self.engines[engine_id] = EngineTracker(engine_id, RequestDirectory())
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
        except Exception:  # noqa: BLE001
            self.apply_errors += 1
            log.exception("kvguard could not apply %s seq %d of engine %d", rec.kind.name, rec.seq, rec.engine_id)
            return []

    def _apply(self, rec: wire.Record) -> list[Finding]:
        t = self.tracker(rec.engine_id)
        body, kind = rec.body, rec.kind
        ts, eid = rec.ts_ns, rec.engine_id
        if kind == wire.Kind.FORWARD:
            return self._on_forward(t, body, rec.ts_ns)
        if kind == wire.Kind.ALLOC:
            t.on_alloc(body.pages)
            self._record(ts, eid, Event.ALLOC, 0, body.pages, t.pool.gen[t.pool.ensure(body.pages.astype(np.int64))])
        elif kind == wire.Kind.ASSIGN:
            t.on_assign(body)
            self._record(ts, eid, Event.ASSIGN, body.req_key, body.pages, aux=body.row_start)
        elif kind == wire.Kind.FREE:
            self._record(ts, eid, Event.FREE, 0, body.pages, aux=int(body.free_kind))
            already = t.on_free(body.pages)
            found = self.double_free_detector.observe(t, self.engine_ref(t), already, body.free_kind.name.lower(),
                                                      rec.ts_ns)
            return self._emit(found)
        elif kind == wire.Kind.REQ_BEGIN:
            t.on_request_begin(body, rec.ts_ns)
            self._record(ts, eid, Event.REQ_BEGIN, body.req_key, aux=body.prompt_tokens)
            if self.tracer is not None:
                self.tracer.on_request_begin(self.engine_ref(t), t.requests.get(body.req_key))
        elif kind == wire.Kind.REQ_END:
            info = t.requests.get(body.req_key)
            row = t.rows.get(body.req_key)
            pages = 0 if row is None else int((row.pages > 0).sum())  # before on_request_end drops the row
            t.on_request_end(body, rec.ts_ns)
            self._record(ts, eid, Event.REQ_END, body.req_key, aux=int(body.finish))
            found = []
            if info is not None and t.hello is not None:
                found = self._emit(self.ttft_detector.observe(eid, self.engine_ref(t), info, ts))
                self._resolved(self.incidents.on_request_end(t.hello.pid, info.rid, ts))
            if self.tracer is not None:  # after the TTFT finding, so that it lands on the open span
                self.tracer.on_request_end(self.engine_ref(t), t.requests.get(body.req_key), pages=pages,
                                           output_tokens=body.output_tokens)
            return found
        elif kind == wire.Kind.REJECT:
            t.on_reject(body)
            self._record(ts, eid, Event.REJECT, body.req_key, aux=int(body.phase))
        elif kind == wire.Kind.HELLO:
            t.on_hello(body)
            log.info("engine %d: %s %s rank %d pid %d, page_size %d, pool %d pages / %d tokens, context %d",
                     rec.engine_id, body.engine_name, ROLE_NAMES.get(body.role), body.tp_rank, body.pid,
                     body.page_size, body.pool_pages, body.pool_tokens, body.context_len)
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
            return found
        elif kind == wire.Kind.XFER_RESERVE:
            self.ledger.on_reserve(rec.engine_id, body, rec.ts_ns)
        elif kind == wire.Kind.XFER_DONE:
            if body.side == wire.Side.RECEIVER:
                return self._on_transfer_done(t, body, rec.ts_ns)
        elif kind == wire.Kind.LOST:
            return self._on_lost(t, rec)
        return []

    def _on_forward(self, t: EngineTracker, f: wire.Forward, ts_ns: int) -> list[Finding]:
        # a forward writes its new tokens' KV before attention reads the rows
        findings = []
        engine = self.engine_ref(t)
        w_off = np.concatenate(([0], np.cumsum(f.write_counts, dtype=np.int64)))
        for i, key in enumerate(f.req_keys.tolist()):
            if w_off[i + 1] > w_off[i]:
                written = f.write_pages[w_off[i]:w_off[i + 1]].astype(np.int64)
                verdict = t.check_write(key, written)
                if verdict is not None:
                    findings += self._emit(self.write_detector.observe(t, engine, verdict, ts_ns))
                t.mark_written(key, written, ts_ns)
        self._record(ts_ns, t.engine_id, Event.WRITE, np.repeat(f.req_keys, f.write_counts), f.write_pages)
        self._record(ts_ns, t.engine_id, Event.READ, f.req_keys, aux=f.seq_lens)
        r_off = None
        if f.read_counts is not None:
            r_off = np.concatenate(([0], np.cumsum(f.read_counts, dtype=np.int64)))
        for i, key in enumerate(f.req_keys.tolist()):
            actual = None if r_off is None else f.read_pages[r_off[i]:r_off[i + 1]]
            verdict = t.classify_read(key, int(f.seq_lens[i]), actual)
            if verdict is not None:
                found = self.read_detector.observe(t, engine, verdict, ts_ns)
                found += self.isolation_detector.observe(t, engine, verdict, ts_ns)
                if found:
                    findings += self._emit(found)
        return findings

    def _on_transfer_done(self, t: EngineTracker, x: wire.XferDone, ts_ns: int) -> list[Finding]:
        pairing = self.ledger.on_receiver_done(x, t.page_size, ts_ns)
        if pairing is None:
            return []
        row = t.rows.get(pairing.receiver_key)
        if pairing.provisional:
            # the sender's last chunk is not applied yet (its record may trail the receiver's):
            # take the pages as written for now, remember what they held, decide on the chunk
            if row is not None:
                pages = row.pages[: pairing.reserved_pages]
                pages = pages[pages > 0]
                pairing.state.provisional = (pages, t.pool.gen[pages].copy(), t.pool.written_gen[pages].copy())
                t.pool.written_gen[pages] = t.pool.gen[pages]
            return []
        return self._apply_pairing(t, pairing, ts_ns)

    def _apply_pairing(self, t: EngineTracker, pairing, ts_ns: int) -> list[Finding]:
        row = t.rows.get(pairing.receiver_key)
        saved = getattr(pairing.state, "provisional", None)
        found: list[Finding] = []
        if saved is not None:
            pages, gens, written_gen = saved
            unchanged = t.pool.gen[pages] == gens  # not reallocated meanwhile
            t.pool.written_gen[pages[unchanged]] = written_gen[unchanged]  # undo the provisional mark
        if row is not None:
            idx = pairing.written_row_pages[pairing.written_row_pages < len(row.pages)]
            t.mark_written(pairing.receiver_key, row.pages[idx], ts_ns)
            self._record(ts_ns, t.engine_id, Event.TRANSFER_WRITE, pairing.receiver_key, row.pages[idx],
                         aux=pairing.sent_tokens)
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
            f.evidence.update({"via": "transfer", "bootstrap_room": x.room, "token_start": x.token_start,
                               "token_end": x.token_end})
        return self._emit(found)

    def _on_lost(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        self.records_lost += rec.body
        t.on_lost()
        engine = self.engine_ref(t)
        summary = (f"{engine.role} rank {engine.rank}: {rec.body} records lost (ring full or unreadable); page ownership is "
                   f"unknown until pages are reallocated: reads in this window are not verified")
        finding = Finding("events_lost", WARNING, engine, None, [], [], rec.ts_ns, summary,
                          {"records_lost": rec.body, "first_missing_seq": rec.seq})
        return self._emit([finding])

    # ------------------------------------------------------------------ housekeeping
    def on_engine_gone(self, engine_id: int, ts_ns: int) -> None:
        """An engine process exited (its ring was retired): close what only it could clear."""
        tracker = self.engines.pop(engine_id, None)
        if tracker is not None and self.tracer is not None:
            self.tracer.on_engine_gone(self.engine_ref(tracker), ts_ns)
        if tracker is not None and tracker.hello is not None:
            self._resolved(self.incidents.on_engine_gone(tracker.hello.pid, ts_ns))

    def tick(self, now_ns: int) -> None:
        page_size_of = lambda eid: self.engines[eid].page_size if eid in self.engines else 1  # noqa: E731
        self._apply_final(self.ledger.expire(now_ns, page_size_of), now_ns)
        self._resolved(self.incidents.tick(now_ns))

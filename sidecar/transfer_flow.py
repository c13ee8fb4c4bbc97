"""The transfers component: prefill/decode transfers through the transfer ledger.

It owns the ledger's use: the XFER_* records, the receiver's and sender's ends of a room,
pairing them, late chunks, orphaned rooms, and the facts exchanged with the other pod through
a shared ledger (docs/detectors.md, "Transfers"). It reads the engines' page models (a
pairing marks the receiver's pages written) and hands its events to the outlet
(sidecar/outlet.py); the pipeline routes the records to it and calls :meth:`Transfers.tick`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from kvguard.engine_hooks import wire

from .detectors.reads import reader_party
from .events import DigestsCompared, LedgerUnreachable, PagesChangedInFlight, SourcePagesSent, TransferOrphaned
from .findings import Finding, Party
from .history import Event
from .inflight import BYTES_PER_PAGE, InFlightChunk, InFlightSends
from .ledger import REMOTE_ENGINE, RoomState, TransferLedger
from .ledger.lanes import lane_key, room_of
from .outlet import Outlet
from .page_pool import FREE, OWNED, PADDING_PAGE
from .provisional import ProvisionalWrite

if TYPE_CHECKING:
    from .tracker import EngineTracker

IN_FLIGHT_MAX_AGE_NS = 60_000_000_000  # (at least) how long a sent chunk waits for its sender's completion
DEGRADED_REPEAT_NS = 30_000_000_000  # a degraded ledger re-reports this often (keeps its incident firing)


def role_of(t: EngineTracker):
    return None if t.hello is None else t.hello.role


def lane(t: EngineTracker, room: int) -> int:
    """The ledger's key for this engine rank's side of ``room`` (sidecar/ledger/lanes.py)."""
    return lane_key(room, t.hello.tp_rank if t.hello is not None else 0)


def _laned(t: EngineTracker, body):
    """A transfer record's body with its room as this rank's ledger key (rank 0: itself)."""
    key = lane(t, body.room)
    return body if key == body.room else dataclasses.replace(body, room=key)


class Transfers:
    """The transfer ledger and its pairing, for the engines this sidecar watches.

    ``engines``: the pipeline's engine id -> page model (read, never changed here);
    ``shared_ledger``: sidecar.ledger.shared.SharedLedger or None (the other pod's facts);
    ``shared_grace_ns``: with a shared ledger, how long a finished receiver waits for them."""

    def __init__(
        self,
        out: Outlet,
        engines: dict[int, EngineTracker],
        ledger: TransferLedger,
        shared_ledger: Any,
        orphan_timeout_s: float,
        shared_grace_ns: int,
    ):
        self.out = out
        self.engines = engines
        self.ledger = ledger
        self.shared_ledger = shared_ledger
        self.orphan_timeout_s = orphan_timeout_s
        self.shared_grace_ns = shared_grace_ns
        self._degraded_reported_ns = 0
        # chunks sent and not yet completed: their pages must not change hands meanwhile
        # (sidecar/inflight.py); an eighth of the ledger's byte share, at least 4,096 pages
        self.inflight = InFlightSends(max(4096, ledger.max_bytes // 8 // BYTES_PER_PAGE))

    # ------------------------------------------------------------------ transfer records
    def on_xfer_send(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, ts = _laned(t, rec.body), rec.ts_ns
        found = self._check_send_target(body, ts)
        receiver = self.ledger.pending.get(body.room)
        receiver_engine = receiver.receiver_engine if receiver is not None else None
        receiver_t = self.engines.get(receiver_engine) if receiver_engine is not None else None
        found += self._check_send_source(t, body, ts)
        self._hold_in_flight(t, body, ts)
        final = self.ledger.on_send(rec.engine_id, body, receiver_t.page_size if receiver_t else t.page_size)
        if final is not None:
            found += self._apply_final([final], ts)
        self.publish_sender(self.ledger.find(body.room, sender_key=body.req_key))
        return found

    def _check_send_source(self, t: EngineTracker, body: wire.XferSend, ts_ns: int) -> list[Finding]:
        """The pages a sender ships are read from its own row: each must be written for it
        (``unwritten_send``, sidecar/detectors/sends.py)."""
        verdict = t.judge.classify_send(body.req_key, body.token_start, body.pages)
        if verdict is None:
            return []
        party: Party | None = None  # the decode request it went to, when this sidecar sees it
        room = self.ledger.find(body.room, sender_key=body.req_key)
        receiver_t = (
            self.engines.get(room.receiver_engine) if room is not None and room.receiver_engine is not None else None
        )
        if room is not None and receiver_t is not None and room.receiver_key:
            party = reader_party(receiver_t.requests.get_or_stub(room.receiver_key))
        event = SourcePagesSent(verdict, room_of(body.room), body.token_start, body.token_end, party)
        return self.out.emit(self.out.observe(event, t, ts_ns))

    def on_xfer_done(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = _laned(t, rec.body)
        if body.side == wire.Side.RECEIVER:
            found = self._on_transfer_done(t, body, rec.ts_ns)
            self._publish_receiver(self.ledger.find(body.room, receiver_key=body.req_key))
            return found
        found = self._sender_completed(t, body, rec.ts_ns)
        if self.shared_ledger is not None:  # a prefill pod: its rooms have no receiver here, retire them
            self.ledger.on_sender_done(body.req_key, body.room)
        return found

    # ------------------------------------------------------------------ transfers in flight
    def _hold_in_flight(self, t: EngineTracker, x: wire.XferSend, ts_ns: int) -> None:
        """Keep what a chunk reads and where it lands, with their generations, until the
        sender completes (sidecar/inflight.py)."""
        info = t.requests.get(x.req_key)
        if t.hello is None or info is None or info.warmup or len(x.pages) == 0:
            return
        room = self.ledger.find(x.room, sender_key=x.req_key)
        receiver_t = None
        if room is not None and room.receiver_engine is not None:
            receiver_t = self.engines.get(room.receiver_engine)
        src = t.pool.ensure(x.pages.astype(np.int64))
        src = src[src != PADDING_PAGE]
        dst = np.zeros(0, np.int64)
        receiver_engine, receiver_key = None, 0
        if receiver_t is not None and receiver_t.hello is not None:
            # the receiver's pages while it waits, and also after it gave up (a chunk sent then is
            # judged at the send as well; pages handed on between the send and the completion are
            # the completion's: sidecar/inflight.py)
            hit = self.ledger.send_target(x, receiver_t.page_size)
            if hit is not None:
                state, dst = hit
                dst = receiver_t.pool.ensure(dst)
                dst = dst[dst != PADDING_PAGE]
                receiver_engine, receiver_key = receiver_t.engine_id, state.receiver_key
        if len(src) == 0 and len(dst) == 0:
            return
        dst_gens = receiver_t.pool.gen[dst] if receiver_t is not None and len(dst) else np.zeros(0, np.uint32)
        chunk = InFlightChunk(
            x.token_start, x.token_end, ts_ns, src.astype(np.int32), t.pool.gen[src], dst.astype(np.int32), dst_gens
        )
        self.inflight.on_send(t.engine_id, x.req_key, x.room, receiver_engine, receiver_key, chunk)

    def _sender_completed(self, t: EngineTracker, x: wire.XferDone, ts_ns: int) -> list[Finding]:
        """The sender's transfer ended. On success its bytes have moved: any of its chunks' pages
        handed to another request since the chunk was sent is a finding (sidecar/inflight.py);
        on failure nothing is known to have landed, and nothing is judged."""
        if x.status != wire.XferStatus.SUCCESS:
            self.inflight.abandon(t.engine_id, x.req_key, x.room)
            return []
        held = self.inflight.complete(t.engine_id, x.req_key, x.room)
        if held is None:
            return []
        state = self.ledger.find(x.room, sender_key=x.req_key)
        receiver_t = self.engines.get(held.receiver_engine) if held.receiver_engine is not None else None
        receiver_done = state is not None and state.done_status == wire.XferStatus.SUCCESS
        found: list[Finding] = []
        for chunk in held.chunks:
            moved = chunk.src_pages[t.pool.gen[chunk.src_pages] != chunk.src_gens].astype(np.int64)
            if len(moved):
                receiver = None
                if receiver_t is not None and held.receiver_key:
                    receiver = reader_party(receiver_t.requests.get_or_stub(held.receiver_key))
                event = PagesChangedInFlight(
                    "source", t.requests.get_or_stub(x.req_key), moved, room_of(x.room), chunk.token_start,
                    chunk.token_end, chunk.sent_ns, receiver,
                )  # fmt: skip
                found += self.out.observe(event, t, ts_ns)
            if receiver_t is None or receiver_done or not len(chunk.dst_pages):
                continue  # a receiver that reported success had every byte before this
            dst = chunk.dst_pages.astype(np.int64)
            pool = receiver_t.pool
            # handed to another request since the send and still its at the completion. A request
            # that came and went in between is not named: the bytes may have landed after it left
            # (the spec's model lands them at the completion; docs/detectors.md)
            moved = (pool.gen[dst] != chunk.dst_gens) & (pool.state[dst] == OWNED)
            moved[moved] = pool.owner_keys(dst[moved]) != np.uint64(held.receiver_key)
            if moved.any():
                sender = Party(state.sender_rid, state.sender_tenant, room_of(x.room)) if state is not None else None
                event = PagesChangedInFlight(
                    "destination", receiver_t.requests.get_or_stub(held.receiver_key), dst[moved], room_of(x.room),
                    chunk.token_start, chunk.token_end, chunk.sent_ns, sender,
                )  # fmt: skip
                # (not marked overwritten for the owner's next read: the owner may have written
                # them after the completion landed, and which came last is not known)
                found += self.out.observe(event, receiver_t, ts_ns)
        return self.out.emit(found)

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
                base = getattr(pairing.state, "reserved_row_base", 0)
                row_pages = row.pages[base : base + pairing.reserved_pages]
                idx = np.flatnonzero(row_pages > 0)
                pages = row_pages[idx].astype(np.int64)
                idx = idx + base  # row page indices, as the sender's written rows are
                state: Any = pairing.state  # the RoomState keeps the saved page state
                state.provisional = ProvisionalWrite(
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
            if row is None:
                # the reader ended before the sender's facts came (a short request, pairing through
                # the shared ledger): the pages the transfer did fill still hold its KV, and an engine
                # may keep them for later readers (vLLM's decode caches the pulled prompt's blocks;
                # their next sharer read them as never written before this)
                filled = unchanged & np.isin(saved.row_index, pairing.written_row_pages)
                if filled.any():
                    t.mark_written(pairing.receiver_key, pages[filled], ts_ns)
            if row is None and pairing.carried_tokens(t.page_size) < pairing.reserved_tokens:
                # the reader ended (and freed its pages) before the sender's facts came: judge
                # the read it made meanwhile from what its pages held then
                verdict = saved.late_read_verdict(pairing.written_row_pages)
                if verdict is not None:
                    found += self.out.observe(verdict, t, ts_ns)
        if row is not None:
            idx = pairing.written_row_pages[pairing.written_row_pages < len(row.pages)]
            # only the row's pages still at the generation they were reserved with (a buggy free
            # elsewhere may have released one under the receiver and the allocator handed it on:
            # that page is not the receiver's to be written), and not those another request's
            # late write replaced after the sender's chunk landed
            pages = row.pages[idx].astype(np.int64)
            still = (pages >= 0) & (pages < t.pool.num_pages)
            still[still] = (t.pool.gen[pages[still]] == row.gens[idx][still]) & (t.pool.state[pages[still]] != FREE)
            t.mark_written(pairing.receiver_key, t.not_overwritten(pages[still]), ts_ns)
            self.out.record(
                ts_ns, t.engine_id, Event.TRANSFER_WRITE, pairing.receiver_key, row.pages[idx], aux=pairing.sent_tokens
            )
            if saved is not None and pairing.carried_tokens(t.page_size) < pairing.reserved_tokens:
                # decode already attended over these pages while we waited: judge that read now
                verdict = t.judge.classify_read(pairing.receiver_key, pairing.reserved_tokens, None)
                if verdict is not None:
                    found += self.out.observe(verdict, t, ts_ns)
        found += self.out.observe(pairing, t, ts_ns)
        return self.out.emit(found)

    def _apply_final(self, pairings, ts_ns: int) -> list[Finding]:
        found = []
        for pairing in pairings:
            t = self.engines.get(pairing.receiver_engine)
            if t is not None:
                found += self._apply_pairing(t, pairing, ts_ns)
        return found

    # ------------------------------------------------------------------ transfers: the ledger
    def on_reserve(self, t: EngineTracker, x: wire.XferReserve, ts_ns: int) -> list[Finding]:
        x = _laned(t, x)
        state = self.ledger.on_reserve(t.engine_id, x, ts_ns)
        state.reserved_row_base = _row_base(t, x)
        info = t.requests.get(x.req_key)
        state.warmup = state.warmup or bool(info is not None and info.warmup)
        if self.shared_ledger is not None and not state.warmup:
            self._publish_receiver(state)
            until = ts_ns + self.ledger.orphan_timeout_ns + 2 * self.shared_grace_ns
            self.shared_ledger.watch(x.room, "sender", until)
        if self.ledger.orphan_now(state, ts_ns):  # prefill had already rejected the prompt and ended
            return self._orphan(state, ts_ns)
        return []

    def on_digest(self, engine_id: int, x: wire.XferDigest, ts_ns: int) -> list[Finding]:
        hit = self.ledger.on_digest(engine_id, x)
        if x.side == wire.Side.SENDER:
            state = self.ledger.find(x.room, sender_key=x.req_key)
            self.publish_sender(state)
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
        return self.out.emit(self.out.observe(DigestsCompared(state, verdict), t, ts_ns))

    def sender_gave_up(
        self, req_key: int, room: int, reason: str, ts_ns: int, local: bool = True, ended: bool = False
    ) -> list[Finding]:
        orphan = self.ledger.on_sender_gave_up(req_key, room, reason, ts_ns, ended=ended)
        if local:
            self.publish_sender(self.ledger.find(room, sender_key=req_key))
        return [] if orphan is None else self._orphan(orphan, ts_ns)

    def on_request_end(self, t: EngineTracker, info, end: wire.ReqEnd, ts_ns: int) -> list[Finding]:
        """A request with a room ended: a prefill request that never sent its last chunk gave up;
        a decode request that ended holds no reserved pages any more."""
        if info is None or info.room is None:
            return []
        role, room = role_of(t), lane(t, info.room)
        if role == wire.Role.PREFILL and end.finish in (wire.Finish.ABORT, wire.Finish.REJECT):
            return self.sender_gave_up(
                end.req_key, room, "reject" if end.finish == wire.Finish.REJECT else "abort", ts_ns, ended=True
            )
        if role == wire.Role.DECODE:
            self.ledger.on_receiver_end(end.req_key, room)
        return []

    def _orphan(self, state: RoomState, ts_ns: int) -> list[Finding]:
        t = self.engines.get(state.receiver_engine) if state.receiver_engine is not None else None
        if t is None:
            return []
        if self.shared_ledger is not None:
            self.shared_ledger.unwatch(state.room, "sender")
        return self.out.emit(self.out.observe(TransferOrphaned(state, self.orphan_timeout_s), t, ts_ns))

    def publish_sender(self, state: RoomState | None) -> None:
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

    def tick(self, now_ns: int) -> list[Finding]:
        """On the sidecar's clock: the other pod's facts (with a shared ledger), pairings whose
        wait for the sender's last chunk is over, and rooms orphaned by now."""
        found = self._tick_shared(now_ns) if self.shared_ledger is not None else []
        # a sender that never reports a completion (its request ended on a path without one; SGLang
        # ends a prefill request just before its XFER_DONE, so its end cannot close the room)
        self.inflight.expire(now_ns - max(4 * self.ledger.orphan_timeout_ns, IN_FLIGHT_MAX_AGE_NS))
        page_size_of = lambda eid: self.engines[eid].page_size if eid in self.engines else 1
        found += self._apply_final(self.ledger.expire(now_ns, page_size_of), now_ns)
        for state in self.ledger.orphans(now_ns):
            found += self._orphan(state, now_ns)
        return found

    def on_sender_begin(self, t: EngineTracker, body: wire.ReqBegin) -> None:
        """A prefill request with a room began: the room's sender is known (and published)."""
        self.publish_sender(
            self.ledger.on_sender_begin(
                t.engine_id, body.req_key, lane(t, body.room), body.warmup, rid=body.rid, tenant=body.tenant
            )
        )

    def sender_of(self, room: int) -> tuple[str, str] | None:
        """(rid, tenant) of the prefill request that served ``room``, when known."""
        state = self.ledger.find(room)
        return None if state is None else (state.sender_rid, state.sender_tenant)

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
            found += self.out.emit(
                self.out.observe(LedgerUnreachable(link.display_url, link.last_error, waiting), None, now_ns)
            )
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
                xd = wire.XferDigest(sender_key, room, wire.Side.SENDER, alg, digest, t0, t1, layers, h0, hn, total)
                found += self._judge_digests(self.ledger.on_digest(REMOTE_ENGINE, xd), now_ns)
            if fact["gave_up"]:
                found += self.sender_gave_up(
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

    def _check_send_target(self, x: wire.XferSend, ts_ns: int) -> list[Finding]:
        """A chunk lands in decode's reserved pages: are they still the receiver's? After the
        receiver gave up (waiting timeout, abort) they may be free or another request's (a late
        write); while it waits, a buggy free elsewhere may have released them under it."""
        state = self.ledger.find(x.room, sender_key=x.req_key)
        receiver_engine = state.receiver_engine if state is not None else None
        t = self.engines.get(receiver_engine) if receiver_engine is not None else None
        if t is None or t.hello is None:
            return []
        hit = self.ledger.send_target(x, t.page_size)
        if hit is None:
            return []
        state, pages = hit
        verdict = t.judge.check_write(state.receiver_key, pages, require_known_writer=False)
        # the chunk's KV is in those pages now, whoever holds them: it is what a stray read of
        # them exposes. (Whether they count as written for the receiver is the pairing's call,
        # made when both ends are known: sidecar/ledger.)
        pages = t.pool.ensure(pages)
        pages = pages[pages != PADDING_PAGE]
        t.pool.writer_slot[pages] = t.pool.slot(state.receiver_key)
        t.pool.mark_write_time(pages, ts_ns)
        if verdict is None:
            t.rewritten_by_owner(pages)
            return []
        mine = np.setdiff1d(pages, np.concatenate((verdict.freed, verdict.foreign)))
        t.rewritten_by_owner(mine)
        found = self.out.observe(verdict, t, ts_ns)
        t.mark_overwritten(verdict.foreign)
        for f in found:
            f.evidence.update(
                {
                    "via": "transfer",
                    "bootstrap_room": room_of(x.room),
                    "token_start": x.token_start,
                    "token_end": x.token_end,
                }
            )
        return self.out.emit(found)


def _row_base(t: EngineTracker, x: wire.XferReserve) -> int:
    """The row page index where the reservation starts in the receiver's row (0 when the
    row is not known or does not hold the first reserved page)."""
    row = t.rows.get(x.req_key)
    pages = x.pages[x.pages > 0] if len(x.pages) else x.pages
    if row is None or len(pages) == 0:
        return 0
    hit = np.flatnonzero(row.pages == int(pages[0]))
    return int(hit[0]) if len(hit) else 0

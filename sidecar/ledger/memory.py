"""Pairs the two ends of a KV transfer by ``bootstrap_room`` (embedded, in memory).

Decode only learns "transfer complete"; what was actually written into the pages it
reserved is what the prefill side says it sent. When the receiver reports success,
the ledger turns the sender's chunks for that room into "written" marks on decode's
pages (row pages ``token_start // page_size`` up to ``ceil(token_end / page_size)``)
and compares the tokens sent with the tokens reserved.

A room stays known for a while after its receiver finished (``closed``): a sender
chunk that arrives for it later is a write into pages decode may already have
freed or handed to another request (the cross-node late-write race); the pipeline
checks those pages' owners at that moment.

If this sidecar has never seen a prefill engine (a decode-only pod without a shared
ledger), nothing can be paired: the reserved pages are taken as written and the
transfer is counted as unverified, never alarmed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from engine_hooks import wire


@dataclass(slots=True)
class SentChunk:
    token_start: int
    token_end: int
    is_last: bool
    num_pages: int
    digest: int


@dataclass(slots=True)
class RoomState:
    room: int
    chunks: list[SentChunk] = field(default_factory=list)
    sender_engine: int | None = None
    reserved_tokens: int = 0
    reserved_pages: np.ndarray | None = None
    receiver_engine: int | None = None
    receiver_key: int = 0
    reserve_ns: int = 0
    done_status: int = 0  # receiver's XferStatus once it reported
    deadline_ns: int = 0  # pending pairing: give up waiting for the sender's last chunk at this time
    provisional: object = None  # what the pipeline saved when it took the pages as written provisionally


@dataclass(slots=True)
class Pairing:
    """The outcome for one completed transfer, as the decode tracker applies it."""

    room: int
    receiver_key: int
    written_row_pages: np.ndarray  # indices into the receiver's row that the sender filled
    sent_tokens: int
    reserved_tokens: int
    sent_pages: int
    reserved_pages: int
    verified: bool  # False: no sender record could be expected here
    provisional: bool = False  # receiver succeeded before the sender's last chunk was seen: decided later
    receiver_engine: int | None = None
    state: object = None  # the RoomState (provisional pairings keep their saved page state there)


class TransferLedger:
    def __init__(self, max_rooms: int = 100_000, max_closed: int = 10_000, grace_ns: int = 2_000_000_000):
        self.rooms: dict[int, RoomState] = {}
        # receiver reported success before the sender's last chunk was applied: the adapter emits
        # XFER_SEND after send_kv_chunk returns, and Mooncake's transfer thread may finish first
        self.pending: dict[int, RoomState] = {}
        self.grace_ns = grace_ns
        self.closed: OrderedDict[int, RoomState] = OrderedDict()  # receiver done; late chunks are suspect
        self.max_closed = max_closed
        self.max_rooms = max_rooms
        self.sender_engines_seen: set[int] = set()
        self.paired = 0
        self.unverified = 0

    def _room(self, room: int) -> RoomState:
        state = self.rooms.get(room)
        if state is None:
            if len(self.rooms) >= self.max_rooms:
                self.rooms.pop(next(iter(self.rooms)))  # oldest first: dicts keep insertion order
            state = self.rooms[room] = RoomState(room)
        return state

    def late_target(self, x: wire.XferSend, page_size: int) -> tuple[RoomState, np.ndarray] | None:
        """For a chunk sent after its receiver gave up: the room and the decode pages it lands in.
        (A receiver that reported success had all the bytes: nothing after that is late.)"""
        state = self.closed.get(x.room)
        if state is None or state.reserved_pages is None or state.done_status == wire.XferStatus.SUCCESS:
            return None
        first, end = x.token_start // page_size, -(-x.token_end // page_size)
        return state, state.reserved_pages[first:min(end, len(state.reserved_pages))].astype(np.int64)

    def _close(self, state: RoomState) -> None:
        self.closed[state.room] = state
        while len(self.closed) > self.max_closed:
            self.closed.popitem(last=False)

    def on_send(self, engine_id: int, x: wire.XferSend, page_size: int) -> Pairing | None:
        """Record a chunk; returns the final pairing when it completes a pending room."""
        self.sender_engines_seen.add(engine_id)
        chunk = SentChunk(x.token_start, x.token_end, x.is_last, len(x.pages), x.digest)
        pending = self.pending.get(x.room)
        if pending is not None:
            pending.chunks.append(chunk)
            if x.is_last:
                del self.pending[x.room]
                return self._pair(pending, page_size)
            return None
        state = self._room(x.room)
        state.sender_engine = engine_id
        state.chunks.append(chunk)
        return None

    def expire(self, now_ns: int, page_size_of) -> list[Pairing]:
        """Pending rooms whose sender never sent its last chunk in time: decide with what was sent."""
        out = []
        for room, state in list(self.pending.items()):
            if now_ns >= state.deadline_ns:
                del self.pending[room]
                out.append(self._pair(state, page_size_of(state.receiver_engine)))
        return out

    def on_reserve(self, engine_id: int, x: wire.XferReserve, ts_ns: int) -> None:
        state = self._room(x.room)
        state.receiver_engine, state.receiver_key = engine_id, x.req_key
        state.reserved_tokens, state.reserved_pages, state.reserve_ns = x.tokens, x.pages, ts_ns

    def on_receiver_done(self, x: wire.XferDone, page_size: int, ts_ns: int = 0) -> Pairing | None:
        state = self.rooms.pop(x.room, None)
        if state is not None and state.reserved_pages is not None:
            state.done_status = int(x.status)
            self._close(state)
        if state is None or state.reserved_pages is None or x.status != wire.XferStatus.SUCCESS:
            return None
        n_reserved = len(state.reserved_pages)
        if not state.chunks and not self.sender_engines_seen:
            self.unverified += 1
            return Pairing(x.room, state.receiver_key, np.arange(n_reserved), state.reserved_tokens,
                           state.reserved_tokens, n_reserved, n_reserved, verified=False,
                           receiver_engine=state.receiver_engine, state=state)
        if not any(c.is_last for c in state.chunks):
            state.deadline_ns = ts_ns + self.grace_ns
            self.pending[x.room] = state
            return Pairing(x.room, state.receiver_key, np.arange(n_reserved), state.reserved_tokens,
                           state.reserved_tokens, n_reserved, n_reserved, verified=False, provisional=True,
                           receiver_engine=state.receiver_engine, state=state)
        return self._pair(state, page_size)

    def _pair(self, state: RoomState, page_size: int) -> Pairing:
        n_reserved = len(state.reserved_pages)
        written: list[np.ndarray] = []
        sent_tokens = 0
        for c in state.chunks:
            first, end = c.token_start // page_size, -(-c.token_end // page_size)
            written.append(np.arange(first, min(end, n_reserved)))
            sent_tokens = max(sent_tokens, c.token_end)
        rows = np.unique(np.concatenate(written)) if written else np.zeros(0, np.int64)
        self.paired += 1
        return Pairing(state.room, state.receiver_key, rows, sent_tokens, state.reserved_tokens,
                       sum(c.num_pages for c in state.chunks), n_reserved, verified=True,
                       receiver_engine=state.receiver_engine, state=state)

"""Pairs the two ends of a KV transfer by ``bootstrap_room`` (the embedded, in-memory core).

Decode only learns "transfer complete"; what was actually written into the pages it
reserved is what the prefill side says it sent. When the receiver reports success,
the ledger turns the sender's chunks for that room into "written" marks on decode's
pages (row pages ``token_start // page_size`` up to ``ceil(token_end / page_size)``)
and compares the tokens sent with the tokens reserved. Both ends' digests (summed over
ranks, sidecar/ledger/digests.py) are compared once both are complete.

The two ends are paired by ``bootstrap_room`` alone: it is what SGLang's router (or
any client) gives both engines for one attempt, while each engine may draw its own rid
(a client that sends no rid through the router: prefill's and decode's rids differ).
Each side's request key (a hash of that side's rid) is kept apart, ``sender_key`` and
``receiver_key``, for reporting and to tell stories apart: an event whose side already
has another key in the live room means the room number now serves another attempt,
so the old story is closed and a new one starts. A retried chunk or digest of the
same attempt replaces its earlier copy instead of adding to it.

Every receiver that completed is accounted once, per receiving engine (``outcomes``):
*paired* (the sender's chunks were matched), *unverified* (no sender can be expected
here), *unpaired* (a sender was expected and none of its chunks matched the room
within the wait: a pairing failure of any cause, visible on its own) or *warmup*.

A room stays known for a while after its receiver finished (``closed``): a sender
chunk that arrives for it later is a write into pages decode may already have
freed or handed to another request (the cross-node late-write race); the pipeline
checks those pages' owners at that moment. A sender digest that trails the
receiver's completion is still compared there.

Orphans: a receiver that reserved pages and still holds them while the sender gave up
(rejected: when its request ended, or ``REJECT_GRACE_NS`` after the REJECT with no
chunk; aborted: after ``orphan_timeout_ns``) or never showed up at all
(no REQ_BEGIN or chunk for the room within ``orphan_timeout_ns``). Timeouts run on
this sidecar's clock: the receiver's records come from an engine on this host, and
facts from another pod (sidecar/ledger/shared.py) carry no time that is ever compared.

If no sender can be expected (this sidecar has never seen a prefill engine and no
shared ledger is configured), nothing can be paired: the reserved pages are taken as
written and the transfer is counted as unverified, never alarmed.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kvguard.engine_hooks import wire

from ..stats import LedgerStats
from .digests import DigestSum, DigestVerdict, Partial
from .lanes import rank_of, room_of

REMOTE_ENGINE = -1  # engine id under which facts from another pod's sidecar are applied
# a rejected sender may still send (SGLang 0.5.19 sends a 1-token placeholder for the prompt it
# rejected): without its REQ_END, it has this long to do so before the receiver is an orphan
REJECT_GRACE_NS = 5_000_000_000
# distinct token ranges one room's sender may send: SGLang sends one chunk per prefill chunk
# (context / --chunked-prefill-size: 2,048 for a 128k context in 64-token chunks). A ring
# sending more (a hostile or broken writer) made the room's list, and the linear scan each
# chunk costs, grow without bound; past this the room is taken as written and not judged.
MAX_CHUNKS_PER_ROOM = 4096
# What the ledger's byte bound charges (``TransferLedger.max_bytes``, the memory budget's share),
# rounded up from tracemalloc (tests/sidecar/test_ledger.py): a room, a chunk, a partial digest, and the
# reserved page ids as their array holds them.
ROOM_BYTES = 1_200
CHUNK_BYTES = 150
PART_BYTES = 250
DEFAULT_MAX_BYTES = 32 << 20
BLOCK_ROWS = int(wire.DigestAlg.XXH3_BLOCK_ROWS)
MAX_FORGOTTEN = 16_384  # rooms evicted with a receiver waiting: remembered so that its result is unverified
# how long after a receiver's success its room's digests may still complete: a rank's partial
# trails (tensor parallelism: every rank reports its own heads, sidecar/ledger/lanes.py); past it,
# an end with some ranks' parts but not all is counted incomplete (a missing or stuck rank)
DIGEST_WAIT_NS = 30_000_000_000


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
    sender_key: int = 0  # the sending request's key (a hash of prefill's rid; 0 until the sender is seen)
    sender_rid: str = ""  # for reporting: prefill's rid and tenant (the receiver's may differ)
    sender_tenant: str = ""
    chunks: list[SentChunk] = field(default_factory=list)
    sender_engine: int | None = None
    sender_began: bool = False  # the sender's engine began the request (REQ_BEGIN with this room)
    sender_gave_up: str = ""  # "reject" / "abort": the sender refused or dropped the request before its last chunk
    sender_gave_up_ns: int = 0
    sender_ended: bool = False  # ... and its request has ended (nothing can be sent any more)
    warmup: bool = False
    reserved_tokens: int = 0
    reserved_pages: np.ndarray | None = None
    # the receiver's row page index of its first reserved page: decode's own cached prefix
    # (0.5.23's decode radix cache) comes before it in the row, and the sender starts there
    reserved_row_base: int = 0
    receiver_engine: int | None = None
    receiver_key: int = 0  # the receiving request's key (a hash of decode's rid)
    reserve_ns: int = 0
    done_status: int = 0  # receiver's XferStatus once it reported
    receiver_ended: bool = False  # the receiving request ended (abort / reject) before any XFER_DONE
    deadline_ns: int = 0  # pending pairing: give up waiting for the sender's last chunk at this time
    provisional: object = None  # what the pipeline saved when it took the pages as written provisionally
    sender_digest: DigestSum = field(default_factory=DigestSum)
    receiver_digest: DigestSum = field(default_factory=DigestSum)
    compared: bool = False
    digests_checked: bool = False  # its digests were looked at DIGEST_WAIT_NS after the receiver's success
    orphan_reported: bool = False
    remote_chunks: set = field(default_factory=set)  # (start, end, last) of chunks applied from another pod
    overflowed: bool = False  # the sender sent more than MAX_CHUNKS_PER_ROOM ranges: not judged
    nbytes: int = ROOM_BYTES  # the byte bound's charge for this room (what it was charged as it grew)

    @property
    def sent_last(self) -> bool:
        return any(c.is_last for c in self.chunks)

    @property
    def receiver_open(self) -> bool:
        """The receiver holds reserved pages and has not finished with them."""
        return self.reserved_pages is not None and not self.done_status and not self.receiver_ended


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
    sent_start: int = 0  # the first token the sender's chunks covered (decode's cached prefix before it)

    def carried_tokens(self, page_size: int) -> int:
        """The tokens the sender's chunks carried into the reservation: from where it starts in
        the receiver's row (after decode's own cached prefix), or from the chunks' first token
        when they start later (the front of the reservation then stays unfilled)."""
        base = getattr(self.state, "reserved_row_base", 0)
        return self.sent_tokens - max(base * page_size, self.sent_start)


class TransferLedger:
    def __init__(
        self,
        max_rooms: int = 100_000,
        max_closed: int = 10_000,
        grace_ns: int = 2_000_000_000,
        orphan_timeout_ns: int = 120_000_000_000,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.rooms: dict[int, RoomState] = {}
        # the byte bound: rooms are charged as they grow; past max_bytes the charge is recounted
        # exactly and the oldest rooms go (closed ones first) down to 3/4 of it
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.rooms_evicted = 0  # rooms dropped to stay within max_bytes or max_rooms
        # room -> (receiver key, reserved pages, receiving engine) of rooms evicted while their receiver waited: its
        # result is then an unverified pairing (its pages taken as written), never silence, which
        # would leave them unwritten and alarm on the receiver's first read
        self.forgotten: OrderedDict[int, tuple[int, int, int | None]] = OrderedDict()
        # receiver reported success before the sender's last chunk was applied: the adapter emits
        # XFER_SEND after send_kv_chunk returns, and Mooncake's transfer thread may finish first
        self.pending: dict[int, RoomState] = {}
        self.grace_ns = grace_ns
        self.orphan_timeout_ns = orphan_timeout_ns
        self.closed: OrderedDict[int, RoomState] = OrderedDict()  # receiver done; late chunks are suspect
        self.max_closed = max_closed
        self.max_rooms = max_rooms
        self.sender_engines_seen: set[int] = set()
        # a shared ledger is configured: a sender is always expected (its facts arrive from another pod)
        self.shared = False
        # the shared ledger is unreachable: no verdict that needs the other pod's facts is made meanwhile
        self.paused = False
        self.max_hold_ns = 10 * grace_ns  # pending rooms kept past their deadline while paused, at most
        self._orphan_checks: list[tuple[int, int, int]] = []  # heap of (deadline, seq, room)
        self._check_seq = 0
        self.paired = 0
        self.unverified = 0
        self.unpaired = 0  # a sender was expected and none of its chunks matched the room in time
        self.warmups = 0  # warmup transfers (no sender by design), taken as written and not judged
        self.outcomes: Counter = Counter()  # (receiver engine id, outcome) -> completed transfers
        self.rooms_reused = 0
        self.rooms_ambiguous = 0  # another pod published two sending requests for one room: not paired
        self.digests_compared = 0
        self.digests_incomparable = 0  # both ends complete, but with no algorithm in common
        self.lanes_borrowed = 0  # receiving ranks with no sender of their own lane, paired with rank 0's chunks
        # end -> rooms where that end had some ranks' partial digests but never all of them
        self.digests_incomplete: Counter = Counter()

    # ------------------------------------------------------------------ lookup
    def expects_sender(self) -> bool:
        return self.shared or bool(self.sender_engines_seen)

    def find(self, room: int, sender_key: int | None = None, receiver_key: int | None = None) -> RoomState | None:
        """The live, pending or recently closed story of a room; with a side's key, only a story
        that side has not named with another key (0: not seen yet)."""
        for table in (self.rooms, self.pending, self.closed):
            state = table.get(room)
            if state is not None and _fits(state, sender_key, receiver_key):
                return state
        return None

    def _room(self, room: int, sender_key: int = 0, receiver_key: int = 0) -> RoomState:
        state = self.rooms.get(room)
        if state is not None and not _fits(state, sender_key or None, receiver_key or None):
            # the room number now serves another attempt: the old one's story ends here
            self.rooms_reused += 1
            self._close(self.rooms.pop(room))
            state = None
        if state is None:
            if len(self.rooms) >= self.max_rooms:
                self._evict(next(iter(self.rooms)))  # oldest first: dicts keep insertion order
            state = self.rooms[room] = RoomState(room)
            self._charge(state, 0)
        if sender_key:
            state.sender_key = sender_key
        if receiver_key:
            state.receiver_key = receiver_key
        return state

    # ------------------------------------------------------------------ the byte bound
    def _charge(self, state: RoomState, grew: int) -> None:
        """``state`` grew by ``grew`` bytes (0: it is new, charged its base)."""
        if grew:
            state.nbytes += grew
        self.nbytes += grew or state.nbytes
        if self.nbytes > self.max_bytes:
            self._make_room()

    def _held(self) -> dict[int, RoomState]:
        """Every room held, once (a room can be both closed and pending)."""
        return {id(s): s for table in (self.closed, self.pending, self.rooms) for s in table.values()}

    def _make_room(self) -> None:
        """Recount what is held (rooms leave the tables without a refund), then drop the oldest
        rooms, decided ones first, until 3/4 of the bound is left: the next recount is far off."""
        self.nbytes = sum(s.nbytes for s in self._held().values())
        target = self.max_bytes * 3 // 4
        while self.nbytes > target and self.closed:
            room, state = self.closed.popitem(last=False)
            if self.pending.get(room) is not state:
                self.nbytes -= state.nbytes
                self.rooms_evicted += 1
        while self.nbytes > target and len(self.rooms) > 1:
            self._evict(next(iter(self.rooms)))

    def _evict(self, room: int) -> None:
        state = self.rooms.pop(room)
        self.nbytes -= state.nbytes
        self.rooms_evicted += 1
        if state.receiver_open:
            self.forgotten[room] = (state.receiver_key, len(_reserved(state)), state.receiver_engine)
            self.forgotten.move_to_end(room)
            while len(self.forgotten) > MAX_FORGOTTEN:
                self.forgotten.popitem(last=False)

    def _close(self, state: RoomState) -> None:
        self.closed[state.room] = state
        self.closed.move_to_end(state.room)
        while len(self.closed) > self.max_closed:
            self.closed.popitem(last=False)

    def send_target(self, x: wire.XferSend, page_size: int) -> tuple[RoomState, np.ndarray] | None:
        """The decode pages a chunk lands in, with its room: for a room whose receiver gave up
        (closed without success: anything it writes is late) and for a room whose receiver
        still waits (its pages may have been freed or handed on under it). A receiver that
        reported success had all the bytes: a chunk recorded after that is not late."""
        state = self.closed.get(x.room)
        if state is not None and state.done_status == wire.XferStatus.SUCCESS:
            return None
        if state is None:
            state = self.rooms.get(x.room)
            if state is None or not state.receiver_open:
                return None
        if state.reserved_pages is None or (state.sender_key and state.sender_key != x.req_key):
            return None
        # chunk tokens count from the prompt's start; the reservation starts at row page
        # reserved_row_base (after decode's own cached prefix)
        n, base = len(state.reserved_pages), state.reserved_row_base
        first = max(x.token_start // page_size - base, 0)
        end = min(-(-x.token_end // page_size) - base, n)
        return state, state.reserved_pages[first:end].astype(np.int64)

    # ------------------------------------------------------------------ sender side
    def on_sender_begin(
        self, engine_id: int, req_key: int, room: int, warmup: bool, rid: str = "", tenant: str = ""
    ) -> RoomState:
        self.sender_engines_seen.add(engine_id)
        state = self.find(room, sender_key=req_key) or self._room(room, sender_key=req_key)
        state.sender_key = req_key
        state.sender_began = True
        state.warmup = state.warmup or warmup
        state.sender_rid = rid or state.sender_rid
        state.sender_tenant = tenant or state.sender_tenant
        return state

    def on_send(self, engine_id: int, x: wire.XferSend, page_size: int) -> Pairing | None:
        """Record a chunk; returns the final pairing when it completes a pending room."""
        self.sender_engines_seen.add(engine_id)
        chunk = SentChunk(x.token_start, x.token_end, x.is_last, len(x.pages), x.digest)
        pending = self.pending.get(x.room)
        if pending is not None and pending.sender_key in (0, x.req_key):
            pending.sender_key = x.req_key
            pending.sender_engine = engine_id
            if _add_chunk(pending, chunk):
                self._charge(pending, CHUNK_BYTES)
            if x.is_last:
                del self.pending[x.room]
                return self._pair(pending, page_size)
            return None
        state = self._room(x.room, sender_key=x.req_key)
        state.sender_engine = engine_id
        state.sender_began = True
        if _add_chunk(state, chunk):
            self._charge(state, CHUNK_BYTES)
        return None

    def _check_at(self, deadline_ns: int, room: int) -> None:
        self._check_seq += 1
        heapq.heappush(self._orphan_checks, (deadline_ns, self._check_seq, room))
        if len(self._orphan_checks) > 4 * self.max_rooms:  # stale entries of long-gone rooms: drop the oldest
            self._orphan_checks = heapq.nsmallest(2 * self.max_rooms, self._orphan_checks)
            heapq.heapify(self._orphan_checks)

    def on_sender_gave_up(
        self, req_key: int, room: int, reason: str, ts_ns: int, ended: bool = False
    ) -> RoomState | None:
        """The sending request was rejected or aborted (``ended``: and has ended) before its last
        chunk. Returns the room when its receiver holds pages that nothing will fill now.

        A REJECT alone is not the end: SGLang 0.5.19 rejects an over-long prompt and still sends a
        1-token placeholder (the incident), so a rejected sender gets ``REJECT_GRACE_NS`` to send;
        its REQ_END without a last chunk settles it at once. An abort usually reaches the receiver
        too: the receiver gets the orphan timeout to end."""
        state = self.find(room, sender_key=req_key) or self._room(room, sender_key=req_key)
        state.sender_key = req_key
        if state.sent_last:
            return None
        state.sender_began = True
        if not state.sender_gave_up or (reason == "reject" and state.sender_gave_up != "reject"):
            state.sender_gave_up, state.sender_gave_up_ns = reason, ts_ns
        state.sender_ended = state.sender_ended or ended
        wait = REJECT_GRACE_NS if state.sender_gave_up == "reject" else self.orphan_timeout_ns
        self._check_at(state.sender_gave_up_ns + wait, room)
        return state if self._orphaned(state, ts_ns) else None

    def on_sender_done(self, req_key: int, room: int) -> None:
        """The sender finished a transfer whose receiver is not in view (another pod): keep the room
        among the bounded closed ones rather than the live ones."""
        state = self.rooms.get(room)
        if state is not None and state.sender_key == req_key and state.reserved_pages is None:
            self._close(self.rooms.pop(room))

    # ------------------------------------------------------------------ receiver side
    def on_reserve(self, engine_id: int, x: wire.XferReserve, ts_ns: int) -> RoomState:
        state = self._room(x.room, receiver_key=x.req_key)
        if state.reserved_pages is not None:
            self.rooms_reused += 1  # the same request reserved again (a retried transfer): the newest counts
            state.receiver_digest = DigestSum()
            state.done_status, state.compared, state.orphan_reported = 0, False, False
        state.receiver_engine, state.receiver_key = engine_id, x.req_key
        grew = int(x.pages.nbytes) - (int(state.reserved_pages.nbytes) if state.reserved_pages is not None else 0)
        state.reserved_tokens, state.reserved_pages, state.reserve_ns = x.tokens, x.pages, ts_ns
        if grew > 0:
            self._charge(state, grew)
        self._check_at(ts_ns + self.orphan_timeout_ns, x.room)
        if state.sender_gave_up == "reject":
            self._check_at(state.sender_gave_up_ns + REJECT_GRACE_NS, x.room)
        return state

    def orphan_now(self, state: RoomState, ts_ns: int) -> bool:
        """Whether a room is an orphan to report right now (a reservation after its sender gave up)."""
        return bool(state.sender_gave_up) and self._orphaned(state, ts_ns)

    def on_receiver_end(self, req_key: int, room: int) -> None:
        """The receiving request ended (aborted, rejected) without a transfer result: nothing is held."""
        state = self.rooms.get(room)
        if state is not None and state.receiver_key == req_key and state.receiver_open:
            state.receiver_ended = True
            self._close(self.rooms.pop(room))

    def on_receiver_done(
        self, x: wire.XferDone, page_size: int, ts_ns: int = 0, grace_ns: int | None = None
    ) -> Pairing | None:
        state = self.rooms.get(x.room)
        if state is not None and state.receiver_key and state.receiver_key != x.req_key:
            return None  # the room now serves another request; this result is of an older one
        state = self.rooms.pop(x.room, None)
        if state is not None and state.reserved_pages is not None:
            state.done_status = int(x.status)
            self._close(state)
            if x.status == wire.XferStatus.SUCCESS:
                self._check_at(ts_ns + DIGEST_WAIT_NS, x.room)  # then: did every rank's digest arrive?
        if (state is None or state.reserved_pages is None) and x.status == wire.XferStatus.SUCCESS:
            # (a sender's chunk may have made the room again since: it holds no reservation)
            forgot = self.forgotten.pop(x.room, None)
            if forgot is not None and forgot[0] == x.req_key:  # evicted while it waited: not judged
                key, n, engine = forgot
                self._count_outcome(engine, "unverified")
                return Pairing(x.room, key, np.arange(n), 0, 0, n, n, verified=False, receiver_engine=engine)
        if state is None or state.reserved_pages is None or x.status != wire.XferStatus.SUCCESS:
            return None
        self._borrow_sender(state)
        n_reserved = len(state.reserved_pages)
        if state.warmup and not state.chunks:
            # SGLang's fake-bootstrap warmup: no sender exists and nothing is written into the pages
            # (their last writer stays whoever wrote them before); its own reads are never alarmed
            self._count(state, "warmup")
            return Pairing(
                state.room,
                state.receiver_key,
                np.zeros(0, np.int64),
                0,
                state.reserved_tokens,
                0,
                n_reserved,
                verified=False,
                receiver_engine=state.receiver_engine,
                state=state,
            )
        if not state.chunks and not self.expects_sender():
            self._count(state, "unverified")
            return self._unverified(state)
        if not state.sent_last:
            state.deadline_ns = ts_ns + (self.grace_ns if grace_ns is None else grace_ns)
            self.pending[x.room] = state
            return Pairing(
                x.room,
                state.receiver_key,
                np.arange(n_reserved),
                state.reserved_tokens,
                state.reserved_tokens,
                n_reserved,
                n_reserved,
                verified=False,
                provisional=True,
                receiver_engine=state.receiver_engine,
                state=state,
            )
        return self._pair(state, page_size)

    # ------------------------------------------------------------------ digests
    def on_digest(self, engine_id: int, x: wire.XferDigest) -> tuple[RoomState, DigestVerdict] | None:
        """Add one rank's partial digest; returns the comparison the first time both ends are complete."""
        keys = {"sender_key": x.req_key} if x.side == wire.Side.SENDER else {"receiver_key": x.req_key}
        state = self.find(x.room, **keys) or self._room(x.room, **keys)
        if x.side == wire.Side.SENDER:
            self.sender_engines_seen.add(engine_id)
            state.sender_key = x.req_key
        ends = state.sender_digest if x.side == wire.Side.SENDER else state.receiver_digest
        parts = sum(len(p) for p in ends.by_alg.values())
        ends.add(
            int(x.alg),
            x.head_start,
            Partial(x.head_count, x.digest, x.token_start, x.token_end, x.layers, x.total_heads),
        )
        if sum(len(p) for p in ends.by_alg.values()) > parts:
            self._charge(state, PART_BYTES)
        return self.compare(state)

    def compare(self, state: RoomState) -> tuple[RoomState, DigestVerdict] | None:
        if state.compared or state.reserved_pages is None:
            return None
        s_algs, r_algs = state.sender_digest.complete_algs(), state.receiver_digest.complete_algs()
        if not s_algs or not r_algs:
            return None
        state.compared = True
        s, r = state.sender_digest, state.receiver_digest
        # alg 4 hashes each rank's slice of whole blocks: two ends compare only if split alike
        common = sorted(a for a in s_algs & r_algs if a != BLOCK_ROWS or s.total_heads(a) == r.total_heads(a))
        if not common:
            self.digests_incomparable += 1
            return None
        self.digests_compared += 1
        alg = common[0]
        return state, DigestVerdict(alg, s.value(alg), r.value(alg), s.token_range(alg), r.token_range(alg))

    # ------------------------------------------------------------------ time
    def expire(self, now_ns: int, page_size_of) -> list[Pairing]:
        """Pending rooms whose sender never sent its last chunk in time: decide with what was sent.
        With a shared ledger, a room none of whose chunks arrived is unverified (the sender's pod may
        be unobserved), and while the ledger is unreachable rooms wait (bounded by ``max_hold_ns``)."""
        out = []
        for room, state in list(self.pending.items()):
            if now_ns < state.deadline_ns:
                continue
            if self.shared and self.paused and now_ns < state.deadline_ns + self.max_hold_ns:
                continue
            del self.pending[room]
            self._borrow_sender(state)
            if self.shared and not state.chunks:
                # the sender's pod was expected to publish and nothing matched: counted, not judged
                self._count(state, "unpaired")
                out.append(self._unverified(state))
            else:
                out.append(self._pair(state, page_size_of(state.receiver_engine)))
        return out

    def _borrow_sender(self, state: RoomState) -> None:
        """A receiving rank whose lane no sending rank ever spoke in (decode at a larger TP size
        than prefill: its rank r > 0 is fed by prefill's ranks below, whose lanes are others)
        takes rank 0's chunks: every sending rank sends the same token ranges, for its heads.
        Not when a sender of its own lane began (equal sizes: that rank's chunks decide), and
        the digests still compare every head on the room (sidecar/ledger/lanes.py)."""
        if state.chunks or state.sender_began or not rank_of(state.room):
            return
        first = self.find(room_of(state.room))
        if first is None or not first.chunks:
            return
        state.chunks = list(first.chunks)
        state.sender_key, state.sender_rid, state.sender_tenant = (
            first.sender_key,
            first.sender_rid,
            first.sender_tenant,
        )
        state.sender_engine = first.sender_engine
        self.lanes_borrowed += 1

    def orphans(self, now_ns: int) -> list[RoomState]:
        """Receivers whose sender gave up or never showed up within the timeout, once each."""
        out = []
        while self._orphan_checks and self._orphan_checks[0][0] <= now_ns:
            if self.paused and self.shared:
                break  # the other pod's facts may be stuck in the unreachable ledger: judge later
            _deadline, _seq, room = heapq.heappop(self._orphan_checks)
            state = self.rooms.get(room)
            if state is not None and self._orphaned(state, now_ns):
                out.append(state)
            closed = self.closed.get(room)
            if closed is not None and closed.done_status == wire.XferStatus.SUCCESS:
                self._check_digests(closed)
        return out

    def _check_digests(self, state: RoomState) -> None:
        """Once per completed room, DIGEST_WAIT_NS after the receiver's success: an end that
        reported some ranks' partials but never covered every head is counted (a rank missing,
        stuck or restarted mid-transfer); such a pair is never compared, so never mismatched.
        An end with no partial at all is an engine that does not digest (not counted here)."""
        if state.digests_checked or state.compared:
            return
        state.digests_checked = True
        for end, digests in (("sender", state.sender_digest), ("receiver", state.receiver_digest)):
            if digests.by_alg and not digests.complete_algs():
                self.digests_incomplete[end] += 1

    def _orphaned(self, state: RoomState, now_ns: int) -> bool:
        if state.orphan_reported or state.warmup or not state.receiver_open or state.sent_last:
            return False
        if state.sender_gave_up == "reject":
            hit = state.sender_ended or now_ns - state.sender_gave_up_ns >= REJECT_GRACE_NS
        elif state.sender_gave_up:
            hit = now_ns - max(state.sender_gave_up_ns, state.reserve_ns) >= self.orphan_timeout_ns
        else:
            hit = (
                not state.sender_began and self.expects_sender() and now_ns - state.reserve_ns >= self.orphan_timeout_ns
            )
        state.orphan_reported = hit
        return hit

    # ------------------------------------------------------------------ outcomes
    OUTCOMES = ("paired", "unverified", "unpaired", "warmup")

    def _count(self, state: RoomState, outcome: str) -> None:
        self._count_outcome(state.receiver_engine, outcome)

    def _count_outcome(self, receiver_engine: int | None, outcome: str) -> None:
        attr = "warmups" if outcome == "warmup" else outcome
        setattr(self, attr, getattr(self, attr) + 1)
        self.outcomes[(receiver_engine, outcome)] += 1

    def forget_engine(self, engine_id: int) -> None:
        """The receiving engine is gone: drop its outcome counts (its metric series end with it)."""
        for outcome in self.OUTCOMES:
            self.outcomes.pop((engine_id, outcome), None)

    def stats(self, receivers: Iterable[int], now_ns: int = 0, is_live=lambda engine_id, req_key: True) -> LedgerStats:
        """The ledger's figures (sidecar/stats.py), with every outcome of each engine in
        ``receivers`` at 0 until counted: an alert on ``unpaired`` sees the first one as an
        increase, and an engine that only sends still has its (zero) series. Open transfers
        are aged on ``now_ns``'s clock (the records' own: CLOCK_MONOTONIC of this host)."""
        outcomes = self.outcomes
        receivers = list(receivers)
        return LedgerStats(
            transfers_by_engine={
                engine_id: {outcome: outcomes[(engine_id, outcome)] for outcome in self.OUTCOMES}
                for engine_id in receivers
            },
            digests_compared=self.digests_compared,
            digests_incomparable=self.digests_incomparable,
            digests_incomplete={end: self.digests_incomplete[end] for end in ("sender", "receiver")},
            rooms_evicted=self.rooms_evicted,
            open_by_engine=self.open_receivers(receivers, now_ns, is_live),
        )

    def open_receivers(self, receivers: Iterable[int], now_ns: int, is_live) -> dict[int, tuple[int, float]]:
        """Per receiving engine: its reservations still waiting for their transfer (pages
        reserved, no XFER_DONE, the request not ended; warmups aside) whose request
        ``is_live(engine_id, req_key)`` still holds, and the oldest one's age in seconds.
        A decode request stuck here holds its pages until the engine's own timeout frees
        them (SGLang 300 s, vLLM's Mooncake 480 s), or for ever where that timeout is
        broken. One pass over the rooms at scrape time (about 20 ms at the 100,000-room bound)."""
        found: dict[int, tuple[int, float]] = {engine_id: (0, 0.0) for engine_id in receivers}
        for state in self.rooms.values():
            engine_id = state.receiver_engine
            if engine_id not in found or state.warmup or not state.receiver_open:
                continue
            if not is_live(engine_id, state.receiver_key):
                continue  # its request was retired (its engine's records were lost): not a wait
            n, oldest = found[engine_id]
            found[engine_id] = (n + 1, max(oldest, max(0, now_ns - state.reserve_ns) / 1e9))
        return found

    def _unverified(self, state: RoomState) -> Pairing:
        n = len(_reserved(state))
        return Pairing(
            state.room,
            state.receiver_key,
            np.arange(state.reserved_row_base, state.reserved_row_base + n),
            state.reserved_tokens,
            state.reserved_tokens,
            n,
            n,
            verified=False,
            receiver_engine=state.receiver_engine,
            state=state,
        )

    def _pair(self, state: RoomState, page_size: int) -> Pairing:
        if state.overflowed:  # chunks were not kept: whatever the verdict, it would rest on a part of them
            self._count(state, "unverified")
            return self._unverified(state)
        n_reserved = len(_reserved(state))
        top = state.reserved_row_base + n_reserved  # row pages past the reservation are not the transfer's
        written: list[np.ndarray] = []
        sent_tokens = 0
        for c in state.chunks:
            first, end = c.token_start // page_size, -(-c.token_end // page_size)
            written.append(np.arange(first, min(end, top)))
            sent_tokens = max(sent_tokens, c.token_end)
        rows = np.unique(np.concatenate(written)) if written else np.zeros(0, np.int64)
        # no chunk at all: a local sender was expected and none matched (judged as nothing written)
        self._count(state, "paired" if state.chunks else "unpaired")
        return Pairing(
            state.room,
            state.receiver_key,
            rows,
            sent_tokens,
            state.reserved_tokens,
            sum(c.num_pages for c in state.chunks),
            n_reserved,
            verified=True,
            receiver_engine=state.receiver_engine,
            state=state,
            sent_start=min((c.token_start for c in state.chunks), default=0),
        )


def _fits(state: RoomState, sender_key: int | None, receiver_key: int | None) -> bool:
    """Whether an event with these keys can belong to this story: a side that already named
    another key means another attempt uses the room number."""
    return (sender_key is None or not state.sender_key or state.sender_key == sender_key) and (
        receiver_key is None or not state.receiver_key or state.receiver_key == receiver_key
    )


def _add_chunk(state: RoomState, chunk: SentChunk) -> bool:
    """A chunk for a token range already seen (a retried send) replaces the earlier one.
    Returns whether the room holds one more chunk."""
    for i, c in enumerate(state.chunks):
        if (c.token_start, c.token_end) == (chunk.token_start, chunk.token_end):
            state.chunks[i] = chunk
            return False
    if len(state.chunks) >= MAX_CHUNKS_PER_ROOM:
        state.overflowed = True
        return False
    state.chunks.append(chunk)
    return True


def _reserved(state: RoomState) -> np.ndarray:
    """The receiver's reserved pages of a room known to hold a reservation: one it keeps open
    (``receiver_open``) or one waiting for, or decided on, its pairing (``on_done`` reached it
    only with its pages reserved)."""
    pages = state.reserved_pages
    assert pages is not None, f"room {state.room}: no reservation"
    return pages

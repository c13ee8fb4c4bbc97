"""Page ownership, rebuilt from the record stream. No I/O; called on the ingest thread.

One ``PagePool`` per engine KV pool owns the numpy arrays below; one ``EngineTracker``
per engine process applies records to it and keeps the live requests' rows.

Per page (index = page id)::

    state        UNKNOWN  never seen since the sidecar attached or since events were lost
                 FREE     in the allocator's free list
                 ALLOCATED handed out, not yet in any request's row
                 OWNED    in the row of a live request (``owner``)
                 CACHED   its owner ended and the prefix cache kept it (shared read-only)
    gen          bumps on every allocation: a row entry remembers the gen it was given
    written_gen  gen at the last KV write; ``written_gen == gen`` means written since allocated
    owner        request key of the current owner (0 = none)
    last_writer  request key whose KV was written there last; kept after free, because
                 pages are not zeroed and the last writer is whose data a stray read sees
    last_write_ns  (millisecond resolution)

``owner`` and ``last_writer`` are stored as u32 slots of a per-pool ``KeyTable`` and the
write time as u32 milliseconds; the properties of those names read them back exactly
(keys) and in ns. 22 bytes per page in all, with the incremental judge's ``clean_shared``.

Per live request: its row as parallel arrays indexed by row page (position // page_size):
the page (int32), and the gen it had when assigned with whether it came from the prefix
cache (one u32, ``Row.gen_shared``): 8 bytes per entry.

Pages we know nothing about (``UNKNOWN``) are never judged: a sidecar that attached
late, or lost records, reports a blind window instead of guessing.

Judging only what changed (``EngineTracker.classify_reads``): a read verdict is a pure
function of the reader's row entries and the state (state, gen, owner, written_gen) of
those pages. Each row remembers up to which entry it was last judged clean
(``Row.clean_n``); every change of a page's state is logged (``PagePool.changed``) with the
page's owner at that moment, and before a FORWARD is judged the log invalidates the rows
whose clean prefix holds a changed page (a private page: its owner; a page some row judged
clean as a prefix-cache entry: every row). A FORWARD without rows then judges, per
request, only the entries past its clean prefix; the clean prefix's pages count as read
and verified (they were, and nothing about them changed). Sampled rows, isolation checks,
a HELLO, lost records and a change log longer than the pool take the full judge.
``KVGUARD_JUDGE=full`` judges every page of every read every time (the reference the
differential test compares against).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvguard.engine_hooks import wire

log = logging.getLogger("kvguard.tracker")

UNKNOWN, FREE, ALLOCATED, OWNED, CACHED = 0, 1, 2, 3, 4
STATE_NAMES = {UNKNOWN: "unknown", FREE: "free", ALLOCATED: "allocated", OWNED: "owned", CACHED: "cached"}
PADDING_PAGE = 0  # SGLang reserves slot/page 0 as the padding target; never a request's data


MAX_PAGES = 1 << 22  # 4M pages (256M tokens at page size 64): beyond any real pool; row entries hold int32 ids
# a row entry's gen and prefix-cache flag share a u32 (Row.gen_shared): gens wrap at 2**31
GEN_MASK = np.uint32(0x7FFFFFFF)
SHARED_BIT = np.uint32(0x80000000)
# A request's row has one entry per page of its context: an ASSIGN placing pages past what the
# engine can hold (its HELLO's context length or pool, whichever is larger, plus ROW_SLACK_PAGES)
# is skipped and its pages counted in ``pages_out_of_range``: one 40-byte record must not make the
# sidecar allocate gigabytes of row. Before any HELLO, rows are bounded by ROW_ENTRIES_BEFORE_HELLO.
ROW_SLACK_PAGES = 1024
ROW_ENTRIES_BEFORE_HELLO = 1 << 20
KEYS_COMPACT_MIN = 1024  # request keys a pool's KeyTable holds before it first drops unnamed ones

JUDGE_ENV = "KVGUARD_JUDGE"


def _incremental_judge_from_env() -> bool:
    """``KVGUARD_JUDGE``: ``incremental`` (default) or ``full``; anything else fails at start-up."""
    raw = os.environ.get(JUDGE_ENV, "incremental")
    if raw not in ("incremental", "full"):
        raise ValueError(f"{JUDGE_ENV}={raw!r}: expected 'incremental' or 'full'")
    return raw == "incremental"


INCREMENTAL_JUDGE = _incremental_judge_from_env()


NO_SLOT = np.uint32(0xFFFFFFFF)  # a key with no slot: matches no page


class KeyTable:
    """Request keys (u64) by slot (u32), so that the per-page ``owner`` and ``last_writer``
    columns hold 4 bytes instead of 8. Slot 0 is key 0 (nobody). Plain arrays, no dict: a
    Python dict costs ~90 bytes per key, more than the 4 bytes per page it saves. Lookups
    binary-search a sorted index of the older slots and scan the few newest (``TAIL``), so a
    new key costs an append, not a re-sort. A key may hold several slots (a new row takes
    one without a lookup): the tracker compares keys (``PagePool.owner_keys``), never slots.
    Slots are never reused while a page names them; ``PagePool.compact_keys`` drops the
    unnamed ones, so the table stays about as large as the set of slots pages name."""

    TAIL = 64  # newest slots kept out of the sorted index (scanned) before it is rebuilt

    def __init__(self):
        self.keys = np.zeros(1, np.uint64)  # by slot
        self._indexed = 1  # slots [1, _indexed) are in the sorted index, newer ones are scanned
        self._sorted = np.zeros(0, np.uint64)  # the keys of slots [1, _indexed), ascending
        self._sorted_slot = np.zeros(0, np.uint32)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self._sorted.nbytes + self._sorted_slot.nbytes

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key (u32), ``NO_SLOT`` where it has none; key 0 is slot 0."""
        keys = np.asarray(keys, np.uint64)
        if len(self._sorted):
            pos = np.searchsorted(self._sorted, keys)
            np.minimum(pos, len(self._sorted) - 1, out=pos)
            out = np.where(self._sorted[pos] == keys, self._sorted_slot[pos], NO_SLOT)
        else:
            out = np.full(len(keys), NO_SLOT, np.uint32)
        if self._indexed < len(self.keys):
            miss = np.flatnonzero(out == NO_SLOT)
            if len(miss):
                eq = keys[miss, None] == self.keys[None, self._indexed :]
                hit = eq.any(axis=1)
                out[miss[hit]] = self._indexed + eq[hit].argmax(axis=1)
        out[keys == 0] = 0
        return out

    def find_one(self, key: int) -> np.uint32:
        if key == 0:
            return np.uint32(0)
        k = np.uint64(key)
        pos = int(np.searchsorted(self._sorted, k))
        if pos < len(self._sorted) and self._sorted[pos] == k:
            return self._sorted_slot[pos]
        if self._indexed < len(self.keys):
            hit = np.flatnonzero(self.keys[self._indexed :] == k)
            if len(hit):
                return np.uint32(self._indexed + hit[0])
        return NO_SLOT

    def intern(self, keys: np.ndarray) -> np.ndarray:
        """Slot of each key, giving the new ones a slot."""
        keys = np.asarray(keys, np.uint64)
        out = self.find(keys)
        missing = out == NO_SLOT
        if missing.any():
            new = np.unique(keys[missing])
            first = len(self.keys)
            self._append(new)
            out[missing] = first + np.searchsorted(new, keys[missing]).astype(np.uint32)
        return out

    def intern_one(self, key: int) -> np.uint32:
        slot = self.find_one(key)
        return slot if slot != NO_SLOT else self.append_one(key)

    def append_one(self, key: int) -> np.uint32:
        """A new slot for ``key`` without looking it up (it may already have one)."""
        slot = np.uint32(len(self.keys))
        self._append(np.array([key], np.uint64))
        return slot

    def keep(self, slots: np.ndarray) -> np.ndarray:
        """Keep only ``slots`` (ascending, unique); returns old slot -> new slot."""
        if len(slots) == 0 or slots[0] != 0:
            slots = np.concatenate(([0], slots)).astype(np.uint32)
        remap = np.full(len(self.keys), NO_SLOT, np.uint32)
        remap[slots] = np.arange(len(slots), dtype=np.uint32)
        self.keys = self.keys[slots]
        self._index()
        return remap

    def _append(self, new: np.ndarray) -> None:
        self.keys = np.concatenate((self.keys, new))
        if len(self.keys) - self._indexed > self.TAIL:
            self._index()

    def _index(self) -> None:
        order = np.argsort(self.keys[1:])
        self._sorted = self.keys[1:][order]
        self._sorted_slot = (order + 1).astype(np.uint32)
        self._indexed = len(self.keys)


class _Column:
    """A read-only per-page view of a narrowed column in its original units (what the
    detectors, the API, the tests and the soak read: request keys, nanoseconds), decoded
    for the pages asked for only."""

    __slots__ = ("_decode", "_len")

    def __init__(self, decode, length: int):
        self._decode, self._len = decode, length

    def __getitem__(self, idx):
        return self._decode(idx)

    def __setitem__(self, idx, value):
        raise TypeError("read-only view: the tracker writes the narrowed columns (owner_slot, writer_slot, ...)")

    def __len__(self) -> int:
        return self._len

    def __array__(self, dtype=None, copy=None):
        a = self._decode(slice(None))
        return a if dtype is None else a.astype(dtype)

    def tolist(self) -> list:
        return self._decode(slice(None)).tolist()


class PagePool:
    """The per-page arrays of one KV pool. Grows if the engine names a larger page id,
    up to ``limit``: larger ids are refused and counted (``pages_out_of_range``), so a
    corrupt record cannot make the sidecar allocate gigabytes.

    22 bytes per page: ``owner`` and ``last_writer`` are u32 slots of ``keys`` (a request key
    is 8 bytes), and the last write time is kept in milliseconds (u32, ``write_epoch_ns``
    on); ``owner`` / ``last_writer`` / ``last_write_ns`` read them back as keys and ns."""

    def __init__(self, num_pages: int, limit: int = MAX_PAGES):
        n = max(min(int(num_pages), limit), 1)
        self.limit = limit
        self.pages_out_of_range = 0
        self.state = np.zeros(n, np.uint8)
        self.gen = np.zeros(n, np.uint32)
        self.written_gen = np.zeros(n, np.uint32)
        self.keys = KeyTable()
        self.owner_slot = np.zeros(n, np.uint32)  # slot of the owner's key (0 = none)
        self.writer_slot = np.zeros(n, np.uint32)  # slot of the last writer's key (0 = none)
        # 0: never written; else 1 + ms since write_epoch_ns (u32: 49 days; rebased past that)
        self.last_write_ms = np.zeros(n, np.uint32)
        self.write_epoch_ns: int | None = None
        self.keys_compact_at = KEYS_COMPACT_MIN
        self.keys_epoch = 0  # bumped when compact_keys renumbers the slots
        self._slots_memo: tuple[np.ndarray, np.ndarray] | None = None  # (keys, their slots): PagePool.slots
        # some live row judged this page clean as a prefix-cache (shared) entry: a change to it
        # re-judges every row (who shares a page is not tracked; such changes are rare)
        self.clean_shared = np.zeros(n, bool)
        # pages whose state changed since the last incremental judge, with their owner's key then
        self.changes: list[tuple[np.ndarray, np.ndarray]] = []
        self.changes_len = 0
        self.changes_overflow = False  # too many to replay, or all forgotten: re-judge everything

    ARRAYS = ("state", "gen", "written_gen", "owner_slot", "writer_slot", "last_write_ms", "clean_shared")

    @property
    def nbytes(self) -> int:
        """The per-page arrays and the key table."""
        return sum(getattr(self, name).nbytes for name in self.ARRAYS) + self.keys.nbytes

    # --------------------------------------------------------- the narrowed columns, read back
    @property
    def owner(self) -> _Column:
        """Request key owning each page (0 = none)."""
        return _Column(lambda idx: self.keys.keys[self.owner_slot[idx]], self.num_pages)

    @property
    def last_writer(self) -> _Column:
        """Request key whose KV was written to each page last (0 = none)."""
        return _Column(lambda idx: self.keys.keys[self.writer_slot[idx]], self.num_pages)

    @property
    def last_write_ns(self) -> _Column:
        """When each page was last written (ms resolution; 0 = never)."""
        return _Column(self._write_ns, self.num_pages)

    def _write_ns(self, idx):
        ms = self.last_write_ms[idx].astype(np.int64)
        epoch = self.write_epoch_ns or 0
        return np.where(ms > 0, epoch + (ms - 1) * 1_000_000, 0)

    # --------------------------------------------------------- writing them
    def owner_keys(self, pages: np.ndarray) -> np.ndarray:
        return self.keys.keys[self.owner_slot[pages]]

    def slots(self, keys: np.ndarray) -> np.ndarray:
        """Slots for request keys about to be stored in ``owner_slot`` / ``writer_slot``.
        A FORWARD's batch asks twice (``check_writes``, ``mark_writes``) and a decode batch
        is mostly the one of the step before: the last answer is kept."""
        memo = self._slots_memo
        if memo is not None and len(memo[0]) == len(keys) and np.array_equal(memo[0], keys):
            return memo[1]
        if len(self.keys) >= self.keys_compact_at:
            self.compact_keys()
        out = self.keys.intern(keys)
        self._slots_memo = (np.array(keys, np.uint64), out)
        return out

    def slot(self, key: int) -> np.uint32:
        if len(self.keys) >= self.keys_compact_at:
            self.compact_keys()
        return self.keys.intern_one(key)

    def reserve_keys(self, n: int) -> None:
        """Compact now if ``n`` more keys would reach the threshold (slots taken one at a time
        then stay valid together)."""
        if len(self.keys) + n >= self.keys_compact_at:
            self.compact_keys()

    def new_slot(self, key: int) -> np.uint32:
        if len(self.keys) >= self.keys_compact_at:
            self.compact_keys()
        return self.keys.append_one(key)

    def compact_keys(self) -> None:
        """Drop the keys no page names any more (requests ended and their pages reused)."""
        self._slots_memo = None
        self.keys_epoch += 1
        used = np.unique(np.concatenate((self.owner_slot, self.writer_slot)))
        remap = self.keys.keep(used)
        self.owner_slot = remap[self.owner_slot]
        self.writer_slot = remap[self.writer_slot]
        # the next compaction after as many new keys again as 1/16 of the pool (>= KEYS_COMPACT_MIN):
        # at most ~1.25 bytes per page of dead keys, and a compaction (~1 ms) per thousands of requests
        self.keys_compact_at = len(self.keys) + max(KEYS_COMPACT_MIN, self.num_pages // 16)

    def mark_write_time(self, pages: np.ndarray, ts_ns: int) -> None:
        if self.write_epoch_ns is None:
            self.write_epoch_ns = ts_ns
        ms = (ts_ns - self.write_epoch_ns) // 1_000_000 + 1
        if ms >= 0xFFFFFFFF:  # 49 days on: move the epoch forward, older writes clamp to it
            shift = ms - (1 << 31)
            self.write_epoch_ns += shift * 1_000_000
            old = self.last_write_ms
            old[old > 0] = np.maximum(old[old > 0].astype(np.int64) - shift, 1).astype(np.uint32)
            ms -= shift
        self.last_write_ms[pages] = max(ms, 1)  # (before the epoch: records up to the merge slack out of order)

    def changed(self, pages: np.ndarray) -> None:
        """Log that state / gen / owner / written_gen of ``pages`` (valid ids) is about to
        change in a way that can spoil a clean read (``EngineTracker._classify_changed``).
        Call it BEFORE the change: the owner logged is the one a clean row judged.

        A clean entry is known, not free, the reader's (same gen; shared, or owned by the
        reader) and written at its gen. Allocation (gen), free (state), a claim (state, owner)
        and lowering written_gen can spoil that and are logged; a KV write (written_gen :=
        gen) and a request's pages turning CACHED (its row is gone; CACHED is known and not
        free for the readers sharing them) cannot, and are not."""
        if len(pages) == 0 or self.changes_overflow:
            return
        self.changes.append((pages, self.owner_keys(pages)))
        self.changes_len += len(pages)
        if self.changes_len > len(self.state):  # cheaper to re-judge everything than to replay
            self.changes_overflow = True
            self.changes.clear()

    @property
    def num_pages(self) -> int:
        return len(self.state)

    def ensure(self, pages: np.ndarray) -> np.ndarray:
        """Valid page ids (non-negative), growing the arrays to hold the largest."""
        valid = (pages >= 0) & (pages < self.limit)
        if not valid.all():
            self.pages_out_of_range += int((~valid).sum())
            pages = pages[valid]
        if len(pages) and int(pages.max()) >= self.num_pages:
            new = min(max(int(pages.max()) + 1, 2 * self.num_pages), self.limit)
            for name in self.ARRAYS:
                old = getattr(self, name)
                grown = np.zeros(new, old.dtype)
                grown[: len(old)] = old
                setattr(self, name, grown)
        return pages

    def forget_all(self) -> None:
        """Events were lost: nothing about any page can be trusted until it is reallocated."""
        self.state[:] = UNKNOWN
        self.changes_overflow = True

    def counts_by_state(self) -> dict[str, int]:
        counts = np.bincount(self.state, minlength=len(STATE_NAMES))
        return {STATE_NAMES[s]: int(counts[s]) for s in STATE_NAMES}


@dataclass(slots=True)
class RequestInfo:
    key: int
    rid: str = ""
    tenant: str = ""
    room: int | None = None
    warmup: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    begin_ns: int = 0
    end_ns: int = 0
    finish: str = ""
    ttft_ns: int = 0
    rejected: str = ""
    reprefilled: bool = False  # KV released and prefilled again (REQ_END flag): TTFT not comparable
    known: bool = True  # False: a stub for a request whose REQ_BEGIN we never saw (not judged)


@dataclass(slots=True)
class Row:
    """A live request's row, one entry per row page: 8 bytes, an int32 page (ids are below
    ``PagePool.limit`` <= ``MAX_PAGES``; -1 = not assigned) and a u32 holding the page's gen
    when assigned (``GEN_MASK``: gens count allocations modulo 2**31) and, in ``SHARED_BIT``,
    whether it came from the prefix cache. ``gens`` / ``shared`` read them apart.

    Every row holds its own copy of its prefix-cache entries: at the reference workload the
    rows' entries are four times the pool (docs/performance.md, "Memory")."""

    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    gen_shared: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    # entries [0, clean_n) were judged clean (nothing to report) in judge epoch clean_epoch and
    # none of their pages changed since; clean_reads of them are pages (id > 0) a read counts
    clean_n: int = 0
    clean_reads: int = 0
    clean_epoch: int = -1
    # the request key's slot in the pool's KeyTable, valid while slot_epoch == PagePool.keys_epoch
    slot: int = 0
    slot_epoch: int = -1

    def forget_clean(self, n: int) -> None:
        """Entries from ``n`` on must be judged again."""
        if self.clean_n > n:
            self.clean_n = n
            self.clean_reads = int(np.count_nonzero(self.pages[:n] > 0))

    def ensure(self, n: int) -> None:
        if n > len(self.pages):
            extra = n - len(self.pages)
            self.pages = np.concatenate((self.pages, np.full(extra, -1, np.int32)))
            self.gen_shared = np.concatenate((self.gen_shared, np.zeros(extra, np.uint32)))

    @property
    def gens(self) -> np.ndarray:
        """The gen each entry's page had when assigned."""
        return self.gen_shared & GEN_MASK

    @property
    def shared(self) -> np.ndarray:
        """Whether each entry came from the prefix cache."""
        return self.gen_shared >= SHARED_BIT


class RequestDirectory:
    """rid / tenant by request key, for live and recently ended requests (bounded LRU)."""

    def __init__(self, max_ended: int = 100_000):
        self.max_ended = max_ended
        self._ended: OrderedDict[int, RequestInfo] = OrderedDict()
        self.live: dict[int, RequestInfo] = {}
        self._stub_seen_ns: dict[int, int] = {}  # first retire_idle scan that saw a live stub

    def begin(self, info: RequestInfo) -> None:
        self._ended.pop(info.key, None)
        self.live[info.key] = info

    def get(self, key: int) -> RequestInfo | None:
        return self.live.get(key) or self._ended.get(key)

    def get_or_stub(self, key: int) -> RequestInfo:
        info = self.get(key)
        if info is None:
            info = RequestInfo(key, rid=f"key:{key:016x}", tenant="", known=False)
            self.live[key] = info
        return info

    def retire_idle(self, now_ns: int, idle_ns: int, holds_kv) -> int:
        """Move to the ended LRU the live requests begun more than ``idle_ns`` ago that
        hold nothing (``holds_kv(key)`` false): requests the engine refused or aborted
        before they held KV never get a REQ_END (SGLang frees nothing for them, and
        REQ_END follows ``release_kv_cache``), and would otherwise stay live forever.
        They stay findable by key until the LRU drops them. Returns how many moved."""
        stale = []
        for key, info in self.live.items():
            # stubs (no REQ_BEGIN seen) have no begin time: their age counts from the first scan that saw them
            since = info.begin_ns or self._stub_seen_ns.setdefault(key, now_ns)
            if now_ns - since > idle_ns and not holds_kv(key):
                stale.append(key)
        for key in stale:
            self.end(key)
        return len(stale)

    @property
    def num_ended(self) -> int:
        return len(self._ended)

    def resize(self, max_ended: int) -> None:
        """A new capacity for ended requests (the memory budget's share); the oldest go first."""
        self.max_ended = max_ended
        while len(self._ended) > max_ended:
            self._ended.popitem(last=False)

    def end(self, key: int) -> RequestInfo | None:
        self._stub_seen_ns.pop(key, None)
        info = self.live.pop(key, None)
        if info is not None:
            self._ended[key] = info
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)
        return info


@dataclass(slots=True)
class WriteVerdict:
    """KV writes that landed where they should not have."""

    writer: RequestInfo
    freed: np.ndarray  # pages free in the allocator when written (write after free)
    foreign: np.ndarray  # pages owned by another live request when written (late write)


@dataclass(slots=True)
class ReadVerdict:
    """The classification of one request's page reads in one forward (pages outside
    every category were fine)."""

    reader: RequestInfo
    unwritten: np.ndarray  # reserved for the reader, nothing wrote them for it
    foreign: np.ndarray  # not (or no longer) the reader's: another request owns or wrote them
    freed: np.ndarray  # free in the allocator while read
    unverified: int  # pages whose state is unknown (blind window)
    shared: np.ndarray = None  # legitimately shared prefix-cache pages read (for tenant isolation checks)
    unwritten_writers: np.ndarray = None  # a read judged late: the unwritten pages' last writers when read


# A live request that holds no KV and has not ended after this long was refused or
# aborted before it held any (no REQ_END comes for those): longer than SGLang's 300 s
# PD waiting timeout, so a request still queued for its transfer is never retired.
IDLE_REQUEST_NS = 600 * 10**9
RETIRE_SCAN_NS = 10 * 10**9
# A request live when records were lost, and named by no record since for this long, ended
# in the gap: its REQ_END (and FREEs) were among the lost records. A running request is
# named by every decode forward; one waiting for its KV transfer is held (``transfer_hold``)
# unless its hold fell in the gap too, and retiring it then is harmless (its reads go
# unverified, it stays findable by key in the ended LRU). Without this, every gap of an
# overloaded sidecar left its requests live with their rows (~4 KB each) forever: 93k of
# them, 500 MiB, in a 17-minute soak (issue 14).
LOST_UNSEEN_NS = 60 * 10**9


class EngineTracker:
    """Ownership state of one engine process, updated record by record."""

    def __init__(self, engine_id: int, directory: RequestDirectory):
        self.engine_id = engine_id
        self.hello: wire.Hello | None = None
        self.page_size = 1
        self.pool = PagePool(1)
        self.rows: dict[int, Row] = {}
        self.requests = directory
        self.pending_reads: dict[int, tuple[int, np.ndarray | None, int]] = {}
        self.transfer_hold: set[int] = set()  # decode requests whose incoming KV is not yet accounted
        self.pages_read = 0
        self.pages_unverified = 0
        self.requests_retired_idle = 0  # live requests that never ended and held nothing (RequestDirectory.retire_idle)
        # live request key -> time of the first gap (LOST) since a record last named it (LOST_UNSEEN_NS)
        self.unseen_since_loss: dict[int, int] = {}
        self.requests_retired_after_loss = 0  # of those, retired with their rows: their end fell in a gap
        self._next_retire_ns = 0
        self.incremental = INCREMENTAL_JUDGE  # judge only what changed (False: every page every time)
        self.judge_epoch = 0  # bumped to drop every row's clean prefix at once
        self.row_limit = ROW_ENTRIES_BEFORE_HELLO  # row entries (pages) a request may have (on_hello)
        self.assigns_out_of_range = 0  # ASSIGNs skipped for it (their pages are in pages_out_of_range)

    # ------------------------------------------------------------------ lifecycle
    def retire_idle_requests(self, now_ns: int, idle_ns: int = IDLE_REQUEST_NS) -> int:
        """Bound the live request directory (at most one scan per ``RETIRE_SCAN_NS``)."""
        if now_ns < self._next_retire_ns:
            return 0
        self._next_retire_ns = now_ns + RETIRE_SCAN_NS
        moved = self._retire_unseen_since_loss(now_ns) if self.unseen_since_loss else 0
        idle = self.requests.retire_idle(
            now_ns, idle_ns, lambda key: key in self.rows or key in self.transfer_hold or key in self.pending_reads
        )
        self.requests_retired_idle += idle
        return moved + idle

    def _retire_unseen_since_loss(self, now_ns: int) -> int:
        """End the requests live at a gap that no record named for ``LOST_UNSEEN_NS`` since
        (their row dropped: the pages it named are UNKNOWN since the gap, reallocation tells
        their next owner). A request still waiting on its transfer or on a deferred read is kept."""
        moved = 0
        live = self.requests.live
        for key, since in list(self.unseen_since_loss.items()):
            if key not in live:
                del self.unseen_since_loss[key]
            elif now_ns - since > LOST_UNSEEN_NS and key not in self.transfer_hold and key not in self.pending_reads:
                del self.unseen_since_loss[key]
                self.rows.pop(key, None)
                self.requests.end(key)
                moved += 1
        self.requests_retired_after_loss += moved
        return moved

    def on_named(self, body) -> None:
        """A record named these requests (a FORWARD's batch, or one request): they outlived the
        gap. Called only while some request is unseen since one (``unseen_since_loss``)."""
        keys = getattr(body, "req_keys", None)
        pop = self.unseen_since_loss.pop
        if keys is not None:
            for key in keys.tolist():
                pop(key, None)
        else:
            key = getattr(body, "req_key", None)
            if key is not None:
                pop(key, None)

    def on_hello(self, hello: wire.Hello, max_pages: int = MAX_PAGES) -> None:
        """``max_pages``: the most pages the memory budget lets this engine's model track."""
        self.hello = hello
        self.page_size = hello.page_size
        # page ids run 0..pool_pages (0 is padding); some slack for allocator rounding
        self.pool.limit = min(hello.pool_pages + 1 + 1024, MAX_PAGES, max(int(max_pages), 2))
        self.pool.ensure(np.array([min(hello.pool_pages, self.pool.limit - 1)], np.int64))
        self.pool.changes_overflow = True  # page size and limit may differ: judge everything again
        tokens = max(hello.context_len, hello.pool_tokens, hello.pool_pages * hello.page_size)
        self.row_limit = min(-(-tokens // max(self.page_size, 1)) + ROW_SLACK_PAGES, MAX_PAGES)

    def on_lost(self, ts_ns: int | None = None) -> None:
        """Records were lost: page states are unknown, and every live request may have ended in
        the gap (``ts_ns``: when; None, a hole in a recording, marks no request)."""
        self.pool.forget_all()
        if ts_ns is not None:
            mark = self.unseen_since_loss.setdefault
            for key in self.requests.live:
                mark(key, ts_ns)

    def _slots(self, req_keys: np.ndarray) -> np.ndarray:
        """Pool slots of a FORWARD's request keys: from the rows for a small batch (a prefill's
        one or few requests; a table lookup costs ~15 us), else ``PagePool.slots``."""
        if len(req_keys) > 8:
            return self.pool.slots(req_keys)
        self.pool.reserve_keys(len(req_keys))  # so that no slot taken below is renumbered by a compaction
        rows_get = self.rows.get
        return np.array([self._slot(key, rows_get(key)) for key in req_keys.tolist()], np.uint32)

    def _slot(self, key: int, row: Row | None) -> int:
        """The pool slot of ``key`` (interned), remembered on its row: a live request's ASSIGNs
        and writes need it again and again, and a table lookup costs ~2 us."""
        pool = self.pool
        if row is not None and row.slot_epoch == pool.keys_epoch:
            return row.slot
        # a new row: a slot of its own without a lookup (a key may have several slots)
        slot = pool.new_slot(key) if row is not None and row.slot_epoch == -1 else pool.slot(key)
        if row is not None:
            row.slot, row.slot_epoch = slot, pool.keys_epoch
        return slot

    def on_request_begin(self, r: wire.ReqBegin, ts_ns: int) -> None:
        room = None if r.room == wire.NO_ROOM else r.room
        self.requests.begin(
            RequestInfo(r.req_key, r.rid, r.tenant, room, r.warmup, r.prompt_tokens, r.cached_tokens, ts_ns)
        )

    def on_request_end(self, r: wire.ReqEnd, ts_ns: int) -> None:
        info = self.requests.get_or_stub(r.req_key)
        info.end_ns, info.finish, info.ttft_ns = ts_ns, r.finish.name.lower(), r.ttft_ns
        info.reprefilled = r.reprefilled
        row = self.rows.pop(r.req_key, None)
        self.pending_reads.pop(r.req_key, None)
        self.transfer_hold.discard(r.req_key)
        if row is not None:
            # what the request still owns was kept by the prefix cache (freed pages are FREE already)
            pages = row.pages[row.pages > 0]
            mine = pages[(self.pool.owner_keys(pages) == np.uint64(r.req_key)) & (self.pool.state[pages] == OWNED)]
            # (not logged for the incremental judge: CACHED is as good as OWNED for every other reader)
            self.pool.state[mine] = CACHED
        self.requests.end(r.req_key)

    def on_reject(self, r: wire.Reject) -> None:
        self.requests.get_or_stub(r.req_key).rejected = f"{r.phase.name.lower()}: {r.reason}"

    # ------------------------------------------------------------------ pages
    def on_alloc(self, pages: np.ndarray) -> np.ndarray:
        """Mark pages allocated (a new generation); returns the valid ones (ids past the
        pool's limit are counted in ``pages_out_of_range`` and skipped)."""
        pages = self.pool.ensure(pages.astype(np.int64))
        pool = self.pool
        pool.changed(pages)
        pool.gen[pages] = (pool.gen[pages] + 1) & GEN_MASK  # (a row entry keeps 31 bits of it)
        pool.state[pages] = ALLOCATED
        pool.owner_slot[pages] = 0
        return pages

    def on_free(self, pages: np.ndarray) -> np.ndarray:
        """Mark pages free; returns those that were already free (a double free)."""
        pages = self.pool.ensure(pages.astype(np.int64))
        pages = pages[pages != PADDING_PAGE]
        already = pages[self.pool.state[pages] == FREE]
        self.pool.changed(pages)
        self.pool.state[pages] = FREE
        self.pool.owner_slot[pages] = 0
        return already

    def _assign_changes_nothing(self, a: wire.Assign) -> bool:
        """A one-page ASSIGN that repeats what the row already holds: the SGLang adapter sends
        one per request per decode step (``alloc_for_decode``), and 63 of 64 name the page the
        request's previous token already got. Scalar checks instead of ~20 numpy calls; any
        doubt (a new entry, another generation, a page still to claim) takes the full path."""
        row = self.rows.get(a.req_key)
        if row is None or len(a.pages) != 1:
            return False
        page = int(a.pages[0])
        idx = a.row_start // self.page_size
        pool = self.pool
        if not (0 <= page < pool.num_pages and idx < len(row.pages) and int(row.pages[idx]) == page):
            return False
        shared = a.row_start < a.shared_until  # the entry's first position in this ASSIGN is row_start
        if int(row.gen_shared[idx]) != (int(pool.gen[page]) | (int(SHARED_BIT) if shared else 0)):
            return False
        return shared or int(pool.state[page]) != ALLOCATED  # an ALLOCATED page would be claimed now

    def on_assign(self, a: wire.Assign) -> None:
        if a.row_start // self.page_size + len(a.pages) > self.row_limit or a.row_end > self.row_limit * self.page_size:
            self._assign_out_of_range(a)
            return
        if self._assign_changes_nothing(a):
            self.requests.get_or_stub(a.req_key)
            return
        pages = self.pool.ensure(a.pages.astype(np.int64))
        if len(pages) != len(a.pages):
            return
        self.requests.get_or_stub(a.req_key)
        row = self.rows.setdefault(a.req_key, Row())
        first = a.row_start // self.page_size
        idx = np.arange(first, first + len(pages))
        row.forget_clean(first)  # entries from ``first`` on are rewritten
        row.ensure(first + len(pages))
        positions = np.maximum(idx * self.page_size, a.row_start)
        shared = positions < a.shared_until
        row.pages[idx] = pages
        row.gen_shared[idx] = self.pool.gen[pages] | (shared.astype(np.uint32) << np.uint32(31))
        pool = self.pool
        fresh = pages[~shared]
        # a freshly allocated page (or one we could not see allocated) becomes the request's
        claim = fresh[
            (pool.state[fresh] == ALLOCATED)
            | ((pool.state[fresh] == OWNED) & (pool.owner_keys(fresh) == np.uint64(a.req_key)))
        ]
        if len(claim) == 0:
            return
        pool.changed(claim)
        pool.state[claim] = OWNED
        pool.owner_slot[claim] = self._slot(a.req_key, row)

    def _assign_out_of_range(self, a: wire.Assign) -> None:
        """Skip an ASSIGN whose positions lie past any row this engine can have (counted, its first
        one logged): the row it asks for is never allocated."""
        self.pool.pages_out_of_range += max(len(a.pages), 1)
        self.assigns_out_of_range += 1
        if self.assigns_out_of_range == 1:
            log.warning(
                "engine %d: ASSIGN of request key %016x places %d pages at row positions [%d, %d), past the "
                "%d tokens a row can hold (the HELLO's context length or pool%s): skipped and counted in "
                "kvguard_page_ids_out_of_range_total (logged once per engine)",
                self.engine_id,
                a.req_key,
                len(a.pages),
                a.row_start,
                a.row_end,
                self.row_limit * self.page_size,
                "" if self.hello is not None else "; no HELLO seen yet",
            )

    def check_write(self, req_key: int, pages: np.ndarray, require_known_writer: bool = True) -> WriteVerdict | None:
        """Judge KV writes before they are applied (None: nothing to judge). A late transfer
        chunk is judged even when its decode request has already ended."""
        info = self.requests.get(req_key)
        if self.hello is None or info is None and require_known_writer:
            return None
        if info is None:
            info = RequestInfo(req_key, rid=f"key:{req_key:016x}", tenant="")
        elif not info.known and require_known_writer:
            return None
        pages = self.pool.ensure(pages.astype(np.int64))
        pages = pages[pages != PADDING_PAGE]
        state, owner = self.pool.state[pages], self.pool.owner_keys(pages)
        freed = pages[state == FREE]
        foreign = pages[(state == OWNED) & (owner != np.uint64(req_key)) & (owner != 0)]
        if len(freed) == 0 and len(foreign) == 0:
            return None
        return WriteVerdict(info, freed, foreign)

    def writes_overlap(self, write_pages: np.ndarray) -> bool:
        """Whether a forward's writes name a page twice: then the order of the writes matters
        (who wrote last, what a later writer's verdict sees) and they are applied one request
        at a time (``check_write`` / ``mark_written``) instead of by ``check_writes`` / ``mark_writes``."""
        return len(write_pages) > 1 and len(np.unique(write_pages)) != len(write_pages)

    def check_writes(
        self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray
    ) -> list[tuple[int, WriteVerdict]]:
        """``check_write`` for every request of a forward at once (request ``i`` wrote the next
        ``write_counts[i]`` pages of ``write_pages``); verdicts only for the requests that wrote
        where they should not have. Same rules and counts as calling ``check_write`` per request,
        provided no page is written twice (``writes_overlap``)."""
        if self.hello is None or len(write_pages) == 0:
            return []
        infos = [self.requests.get(key) for key in req_keys.tolist()]
        judged = np.array([info is not None and info.known for info in infos], bool)
        counts = write_counts.astype(np.int64)
        pages = write_pages.astype(np.int64)
        writer = np.repeat(np.arange(len(infos)), counts)
        judged_page = judged[writer]
        pool = self.pool
        valid = (pages >= 0) & (pages < pool.limit)
        if not valid.all():  # ``ensure`` counts them, for judged writers only (as check_write)
            pool.pages_out_of_range += int(np.count_nonzero(~valid & judged_page))
            pages, writer, judged_page = pages[valid], writer[valid], judged_page[valid]
        pool.ensure(pages)
        look = judged_page & (pages != PADDING_PAGE)
        state, owner = pool.state[pages], pool.owner_keys(pages)
        freed = look & (state == FREE)
        foreign = look & (state == OWNED) & (owner != req_keys.astype(np.uint64)[writer]) & (owner != 0)
        bad = freed | foreign
        if not bad.any():
            return []
        out = []
        for i in np.unique(writer[bad]).tolist():
            mine = look & (writer == i)
            out.append((i, WriteVerdict(infos[i], pages[mine & freed], pages[mine & foreign])))
        return out

    def mark_writes(self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray, ts_ns: int) -> None:
        """``mark_written`` for every request of a forward at once (no page written twice:
        ``writes_overlap``)."""
        if len(write_pages) == 0:
            return
        pages = write_pages.astype(np.int64)
        pool = self.pool
        writer = np.repeat(self._slots(req_keys), write_counts.astype(np.int64))
        valid = (pages >= 0) & (pages < pool.limit)
        if not valid.all():
            pool.pages_out_of_range += int(np.count_nonzero(~valid))
            pages, writer = pages[valid], writer[valid]
        pool.ensure(pages)
        real = pages != PADDING_PAGE
        if not real.all():
            pages, writer = pages[real], writer[real]
        known = pages[pool.state[pages] != UNKNOWN]
        pool.written_gen[known] = pool.gen[known]  # (not logged: see PagePool.changed)
        pool.writer_slot[pages] = writer
        pool.mark_write_time(pages, ts_ns)

    def mark_written(self, req_key: int, pages: np.ndarray, ts_ns: int) -> None:
        pages = self.pool.ensure(pages.astype(np.int64))
        pages = pages[pages != PADDING_PAGE]
        pool = self.pool
        known = pages[pool.state[pages] != UNKNOWN]
        pool.written_gen[known] = pool.gen[known]
        pool.writer_slot[pages] = self._slot(req_key, self.rows.get(req_key))
        pool.mark_write_time(pages, ts_ns)

    # ------------------------------------------------------------------ reads
    def row_pages_for(self, req_key: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        row = self.rows.get(req_key)
        if row is None:
            return None
        n = min(-(-int(seq_len) // self.page_size), len(row.pages))
        return row.pages[:n], row.gens[:n], row.shared[:n]

    def classify_read(self, req_key: int, seq_len: int, actual: np.ndarray | None) -> ReadVerdict | None:
        """Judge one request's read of its first ``seq_len`` tokens in one forward (None: the
        reader is not judged). ``actual`` are the pages the engine's own row held (when the
        record carried rows); otherwise the sidecar's model of the row is what was read.
        A batch of one through ``classify_reads``, so both apply the same rules."""
        counts = None if actual is None else np.array([len(actual)], np.int64)
        verdicts = self.classify_reads(
            np.array([req_key], np.uint64), np.array([seq_len], np.int64), counts, actual, every=True
        )
        return verdicts[0][1] if verdicts else None

    def classify_reads(
        self,
        req_keys: np.ndarray,
        seq_lens: np.ndarray,
        read_counts: np.ndarray | None = None,
        read_pages: np.ndarray | None = None,
        want_shared: bool = False,
        every: bool = False,
    ) -> list[tuple[int, ReadVerdict]]:
        """Judge every request's read in one forward at once: request ``i`` read its first
        ``seq_lens[i]`` tokens, i.e. (when the record carried rows) ``read_counts[i]`` pages of
        ``read_pages`` in request order, else the sidecar's model of its row.

        Returns ``(request index, verdict)`` only for the requests a detector has to look at:
        a violation or an unverified page (plus, with ``want_shared``, a shared prefix-cache
        page; with ``every``, every judged request). The clean common case builds nothing per
        request: the model rows are gathered into one array and every read page is judged by
        one set of numpy operations (it was a Python loop of ~20 numpy calls per request).

        Unless ``want_shared`` or ``every`` asks for more, a FORWARD without rows (the sidecar's
        own model is what was read), or whose rows are exactly the model's, has only what
        changed since each row was last judged judged (``_classify_changed``); the verdicts and
        counts are the same. Rows that differ from the model anywhere take the full judge.
        """
        if self.incremental and not want_shared and not every:
            if read_counts is None:
                return self._classify_changed(req_keys, seq_lens)
            unjudged = self._rows_as_modelled(req_keys, seq_lens, read_counts, read_pages)
            if unjudged is not None:
                self.pages_unverified += unjudged  # what readers we cannot judge read (as below)
                return self._classify_changed(req_keys, seq_lens)
        have_rows = read_counts is not None
        rc = read_counts.tolist() if have_rows else None
        # row pages each request's seq_len covers (ceil)
        need = (-(-seq_lens.astype(np.int64) // self.page_size)).tolist()
        rows_get = self.rows.get
        live_get, ended_get = self.requests.live.get, self.requests._ended.get  # RequestDirectory.get, inlined
        infos: list[RequestInfo | None] = []
        lens: list[int] = []
        parts_p, parts_g = [], []
        unjudged = 0  # actual pages of readers we cannot judge (counted unverified, as before)
        hello = self.hello
        for i, key in enumerate(req_keys.tolist()):
            info = live_get(key) or ended_get(key)
            row = rows_get(key)
            if hello is None or info is None or row is None or not info.known:
                infos.append(None)
                lens.append(0)
                if have_rows:
                    unjudged += rc[i]
                continue
            infos.append(info)
            n = len(row.pages)
            if need[i] < n:
                n = need[i]
            pad = 0
            if have_rows:
                n, pad = min(n, rc[i]), max(rc[i] - n, 0)
            if n == len(row.pages):  # the whole row (the common case): no slicing
                parts_p.append(row.pages)
                parts_g.append(row.gen_shared)
            else:
                parts_p.append(row.pages[:n])
                parts_g.append(row.gen_shared[:n])
            if pad:  # rows the model never saw assigned
                parts_p.append(np.full(pad, -2, np.int32))
                parts_g.append(np.zeros(pad, np.uint32))
            lens.append(n + pad)
        self.pages_unverified += unjudged
        if not parts_p:
            return []
        # row pages are int32 (memory); widened once here, not by every gather that indexes with them
        m_pages = np.concatenate(parts_p, dtype=np.int64)
        m_gens = np.concatenate(parts_g)
        lens_a = np.array(lens, np.int64)
        reader = np.repeat(np.arange(len(lens)), lens_a)
        if have_rows:
            pages = read_pages.astype(np.int64)
            if unjudged or len(pages) != len(m_pages):
                pages = pages[np.repeat(lens_a > 0, read_counts.astype(np.int64))]
        else:
            pages = m_pages
        pool = self.pool
        keep = (pages > PADDING_PAGE) & (pages < pool.limit)
        if not keep.all():
            pool.pages_out_of_range += int((pages >= pool.limit).sum())
            pages, m_pages, m_gens, reader = pages[keep], m_pages[keep], m_gens[keep], reader[keep]
        if len(pages) and int(pages.max()) >= pool.num_pages:  # ids below pool.limit already: only growth is left
            pool.ensure(pages)
        known, freed, foreign, unwritten, shared = self._judge_pages(pages, m_pages, m_gens, reader, req_keys)
        look = ~known | freed | foreign | unwritten
        if want_shared:
            look |= shared
        if every:
            flagged = [i for i, info in enumerate(infos) if info is not None]
        elif look.any():
            flagged = np.unique(reader[look]).tolist()
        else:
            return []
        off = np.searchsorted(reader, np.arange(len(lens) + 1)).tolist()
        out = []
        for i in flagged:
            s, e = off[i], off[i + 1]
            p = pages[s:e]
            out.append(
                (
                    i,
                    ReadVerdict(
                        infos[i],
                        p[unwritten[s:e]],
                        p[foreign[s:e]],
                        p[freed[s:e]],
                        int(np.count_nonzero(~known[s:e])),
                        p[shared[s:e]],
                    ),
                )
            )
        return out

    def _judge_pages(self, pages, m_pages, m_gens, reader, req_keys):
        """The read rules over read ``pages`` (ids in 0 < page < limit, the pool grown to hold
        them) against the readers' row entries (``m_pages``, ``m_gens`` as ``Row.gen_shared``;
        ``reader`` indexes ``req_keys``).
        Counts them as read (state known) or unverified; returns per page the masks known,
        freed, foreign, unwritten and shared (a legitimately read prefix-cache page)."""
        pool = self.pool
        state = pool.state[pages]
        gen = pool.gen[pages]
        known = state != UNKNOWN
        n_known = int(np.count_nonzero(known))
        self.pages_read += n_known
        self.pages_unverified += len(pages) - n_known
        freed = state == FREE  # FREE is known
        # the reader's own page: assigned to it at this generation, and either handed to it
        # through the prefix cache or owned by it (a fresh row entry naming another
        # request's page is not made legitimate by having been written into the row)
        # (ownership is looked up only where it decides: the entry matches and is not a prefix-cache page)
        mine = (m_pages == pages) & ((m_gens & GEN_MASK) == gen)
        m_shared = m_gens >= SHARED_BIT
        ask = np.flatnonzero(mine & ~m_shared)
        if len(ask):
            p_ask = pages[ask]
            mine[ask] = (pool.owner_keys(p_ask) == req_keys.astype(np.uint64)[reader[ask]]) & (
                pool.state[p_ask] == OWNED
            )
        ok = known & ~freed
        foreign = ok & ~mine
        ok_mine = ok & mine
        written = pool.written_gen[pages] == gen
        unwritten = ok_mine & ~written
        shared = ok_mine & written & m_shared
        return known, freed, foreign, unwritten, shared

    # ------------------------------------------------------------------ reads: only what changed
    def _rows_as_modelled(
        self, req_keys: np.ndarray, seq_lens: np.ndarray, read_counts: np.ndarray, read_pages: np.ndarray
    ) -> int | None:
        """Whether the engine's rows of a FORWARD are exactly the sidecar's model of them: every
        judged reader read as many pages as the model row covers, the same ones. Then judging
        the rows is judging the model. Returns the pages read by readers that are not judged
        (counted unverified), or None where anything differs."""
        rc = read_counts.astype(np.int64)
        rcl = rc.tolist()
        need = (-(-seq_lens.astype(np.int64) // self.page_size)).tolist()
        rows_get = self.rows.get
        live_get, ended_get = self.requests.live.get, self.requests._ended.get
        hello = self.hello
        parts, judged = [], []
        unjudged = 0
        for i, key in enumerate(req_keys.tolist()):
            info = live_get(key) or ended_get(key)
            row = rows_get(key)
            if hello is None or info is None or row is None or not info.known:
                unjudged += rcl[i]
                judged.append(False)
                continue
            n = len(row.pages)
            if need[i] < n:
                n = need[i]
            if rcl[i] != n:
                return None
            parts.append(row.pages if n == len(row.pages) else row.pages[:n])
            judged.append(True)
        actual = read_pages if not unjudged else read_pages[np.repeat(np.array(judged, bool), rc)]
        model = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else actual[:0]
        if len(actual) != len(model) or not np.array_equal(actual, model):
            return None
        return unjudged

    def _absorb_changes(self) -> None:
        """Replay the page-change log into the rows' clean prefixes (before judging a FORWARD)."""
        pool = self.pool
        if pool.changes_overflow:
            self._forget_all_clean()
            return
        if not pool.changes:
            return
        if len(pool.changes) == 1:
            pages, owners = pool.changes[0]
        else:
            pages = np.concatenate([c[0] for c in pool.changes])
            owners = np.concatenate([c[1] for c in pool.changes])
        pool.changes.clear()
        pool.changes_len = 0
        if pool.clean_shared[pages].any():  # a page some row judged clean as a shared entry
            self._forget_all_clean()
            return
        # any other clean entry is a private one: the page's owner (at the change) is its only reader
        held = owners != 0
        if not held.any():
            return
        pages, owners = pages[held], owners[held]
        epoch = self.judge_epoch
        keys = np.unique(owners)
        for key in keys.tolist():
            row = self.rows.get(key)
            if row is None or row.clean_epoch != epoch or row.clean_n == 0:
                continue
            head = row.pages[: row.clean_n]
            mine = pages if len(keys) == 1 else pages[owners == np.uint64(key)]
            hit = np.flatnonzero(head == mine[0]) if len(mine) == 1 else np.flatnonzero(np.isin(head, mine))
            if len(hit):
                row.forget_clean(int(hit[0]))

    def _forget_all_clean(self) -> None:
        pool = self.pool
        self.judge_epoch += 1  # every row's clean prefix is void
        pool.clean_shared[:] = False
        pool.changes.clear()
        pool.changes_len = 0
        pool.changes_overflow = False

    def _classify_changed(self, req_keys: np.ndarray, seq_lens: np.ndarray) -> list[tuple[int, ReadVerdict]]:
        """``classify_reads`` for a FORWARD without rows, judging per request only the row
        entries past its clean prefix (``Row.clean_n``). The clean prefix holds nothing to report
        and its pages count as read (judged known, unchanged since); the rest goes through the
        same rules (``_judge_pages``), and the prefix grows to the first entry with something to
        report. Same verdicts, counts and ``pages_out_of_range`` as the full judge."""
        self._absorb_changes()
        if self.hello is None:
            return []  # nobody is judged; without rows nothing counts as unverified either
        ps = self.page_size
        need = (-(-seq_lens.astype(np.int64) // ps)).tolist()
        rows_get = self.rows.get
        live_get, ended_get = self.requests.live.get, self.requests._ended.get  # RequestDirectory.get, inlined
        epoch = self.judge_epoch
        clean_reads = 0
        dirty = []  # (request index, row, first entry to judge, entries read, clean reads before it)
        for i, key in enumerate(req_keys.tolist()):
            info = live_get(key) or ended_get(key)
            if info is None or not info.known:
                continue
            row = rows_get(key)
            if row is None:
                continue
            n = len(row.pages)
            if need[i] < n:
                n = need[i]
            if row.clean_epoch == epoch:
                c = row.clean_n
                if c >= n:  # all clean (the common decode step)
                    clean_reads += row.clean_reads if c == n else int(np.count_nonzero(row.pages[:n] > 0))
                    continue
                base = row.clean_reads
                clean_reads += base
            else:
                c = base = 0
            dirty.append((i, row, c, n, base))
        self.pages_read += clean_reads
        if not dirty:
            return []
        if len(dirty) == 1:
            _i, row, c, n, _base = dirty[0]
            # (int32 row pages widened once here, not by every gather that indexes with them)
            pages_all, gens_all = row.pages[c:n].astype(np.int64), row.gen_shared[c:n]
        else:
            pages_all = np.concatenate([d[1].pages[d[2] : d[3]] for d in dirty], dtype=np.int64)
            gens_all = np.concatenate([d[1].gen_shared[d[2] : d[3]] for d in dirty])
        idx = np.array([d[0] for d in dirty], np.int64)
        seg_len = np.array([d[3] - d[2] for d in dirty], np.int64)
        seg = np.repeat(np.arange(len(dirty)), seg_len)  # dirty request of each entry
        pool = self.pool
        keep = (pages_all > PADDING_PAGE) & (pages_all < pool.limit)
        all_kept = bool(keep.all())
        if all_kept:
            pages, gens, seg_k = pages_all, gens_all, seg
        else:
            pool.pages_out_of_range += int((pages_all >= pool.limit).sum())
            pages, gens, seg_k = pages_all[keep], gens_all[keep], seg[keep]
        if len(pages) and int(pages.max()) >= pool.num_pages:
            pool.ensure(pages)
        known, freed, foreign, unwritten, shared = self._judge_pages(pages, pages, gens, idx[seg_k], req_keys)
        look = ~known | freed | foreign | unwritten
        # entries with nothing to report: padding / unassigned ids (never read) and clean kept pages
        if all_kept:
            bad = look
        else:
            bad = pages_all >= pool.limit
            bad[keep] = look
        starts = np.concatenate(([0], np.cumsum(seg_len)))
        good_len = seg_len.copy()  # per dirty request: entries clean from its first one on
        bad_at = np.flatnonzero(bad)
        if len(bad_at):
            who, first = np.unique(seg[bad_at], return_index=True)
            good_len[who] = bad_at[first] - starts[who]
        counted = np.concatenate(([0], np.cumsum(pages_all > 0)))
        newly_counted = counted[starts[:-1] + good_len] - counted[starts[:-1]]
        newly_clean = np.arange(len(pages_all)) < (starts[:-1] + good_len)[seg]
        marks = newly_clean & (gens_all >= SHARED_BIT) & (pages_all > 0)
        if marks.any():
            pool.clean_shared[pages_all[marks]] = True
        for j, (_i, row, c, _n, base) in enumerate(dirty):  # (a request twice in a batch: the same values)
            row.clean_epoch = epoch
            row.clean_n = c + int(good_len[j])
            row.clean_reads = base + int(newly_counted[j])
        if not look.any():
            return []
        out = []
        off = np.searchsorted(seg_k, np.arange(len(dirty) + 1)).tolist()
        for j in np.unique(seg_k[look]).tolist():
            i, row, c, _n, _base = dirty[j]
            s, e = off[j], off[j + 1]
            p = pages[s:e]
            head = row.pages[:c]
            shared_pages = p[shared[s:e]]
            if c:  # the clean prefix's legitimately read prefix-cache pages belong to the verdict too
                shared_pages = np.concatenate((head[(row.gen_shared[:c] >= SHARED_BIT) & (head > 0)], shared_pages))
            info = self.requests.get(int(req_keys[i]))
            out.append(
                (
                    i,
                    ReadVerdict(
                        info,
                        p[unwritten[s:e]],
                        p[foreign[s:e]],
                        p[freed[s:e]],
                        int(np.count_nonzero(~known[s:e])),
                        shared_pages,
                    ),
                )
            )
        return out

"""The page model: the per-page arrays of one engine KV pool (``PagePool``, with the
``KeyTable`` its owner and writer columns keep request keys in) and a live request's row of
pages (``Row``). Apart from ``EngineTracker`` (sidecar/tracker.py), which applies records to
them, and from the judge (sidecar/judge.py), which reads them: how the pages are laid out in
memory is a concern of its own.

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
Kept only once an engine uses them: each page's writer scope (8 bytes, REQ_SCOPE) and its
content identity with the allocation it was recorded for and whose tokens it is of (20 bytes, PAGE_IDENTITY,
sidecar/page_identity.py).

Per live request: its row as parallel arrays indexed by row page (position // page_size):
the page (int32), and the gen it had when assigned with whether it came from the prefix
cache (one u32, ``Row.gen_shared``): 8 bytes per entry.
"""

from __future__ import annotations

import numpy as np

from . import native

UNKNOWN, FREE, ALLOCATED, OWNED, CACHED = 0, 1, 2, 3, 4
STATE_NAMES = {UNKNOWN: "unknown", FREE: "free", ALLOCATED: "allocated", OWNED: "owned", CACHED: "cached"}
PADDING_PAGE = 0  # SGLang reserves slot/page 0 as the padding target; never a request's data


MAX_PAGES = 1 << 22  # 4M pages (256M tokens at page size 64): beyond any real pool; row entries hold int32 ids
# a row entry's gen and prefix-cache flag share a u32 (Row.gen_shared): gens wrap at 2**31
GEN_MASK = np.uint32(0x7FFFFFFF)
SHARED_BIT = np.uint32(0x80000000)
KEYS_COMPACT_MIN = 1024  # request keys a pool's KeyTable holds before it first drops unnamed ones


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

    # what the compiled kernels look keys up in (``kvguard.sidecar.native``)
    @property
    def sorted_keys(self) -> np.ndarray:
        return self._sorted

    @property
    def sorted_slots(self) -> np.ndarray:
        return self._sorted_slot

    @property
    def indexed(self) -> int:
        return self._indexed

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
        # (pages, their owners' keys): arrays, or lists of one (``changed_one``)
        self.changes: list[tuple[np.ndarray | list[int], np.ndarray | list[int]]] = []
        self.changes_len = 0
        self.changes_overflow = False  # too many to replay, or all forgotten: re-judge everything
        # the prefix-cache scope of each page's last writer (REQ_SCOPE), kept only once an
        # engine names a scope: 8 bytes per page where salts are in use, none elsewhere
        self.scope: np.ndarray | None = None
        # the content identity (PAGE_IDENTITY) recorded for each page's allocation, that
        # allocation as gen + 1 (0: none recorded), and the key of the request whose tokens the
        # identity is of (its writer, or the writer of the stored object a load brought back),
        # kept only once an engine sends identities: 20 bytes per page where
        # KVGUARD_PAGE_IDENTITY is on, none elsewhere
        self.identity: np.ndarray | None = None
        self.identity_gen: np.ndarray | None = None
        self.identity_writer: np.ndarray | None = None

    ARRAYS: tuple[str, ...] = (
        "state",
        "gen",
        "written_gen",
        "owner_slot",
        "writer_slot",
        "last_write_ms",
        "clean_shared",
    )

    def enable_scopes(self) -> None:
        """Start keeping each page's writer scope; pages written before hold the default (0)."""
        if self.scope is None:
            self.scope = np.zeros(self.num_pages, np.uint64)
            self.ARRAYS = self.ARRAYS + ("scope",)  # grown and counted with the others from now on

    def enable_identity(self) -> None:
        """Start keeping each page's content identity; no page has one recorded yet."""
        if self.identity is None:
            self.identity = np.zeros(self.num_pages, np.uint64)
            self.identity_gen = np.zeros(self.num_pages, np.uint32)
            self.identity_writer = np.zeros(self.num_pages, np.uint64)
            self.ARRAYS = self.ARRAYS + ("identity", "identity_gen", "identity_writer")

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
        if memo is not None and len(memo[0]) == len(keys) and native.array_equal(memo[0], keys):
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

    def write_ms(self, ts_ns: int) -> int | None:
        """What ``mark_write_time`` stores for a write at ``ts_ns``, where it needs no epoch set
        or moved first (else None: ``mark_write_time`` does that)."""
        epoch = self.write_epoch_ns
        if epoch is None:
            return None
        ms = (ts_ns - epoch) // 1_000_000 + 1
        return None if ms >= 0xFFFFFFFF else max(ms, 1)

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
        change in a way that can spoil a clean read (``Judge._classify_changed``).
        Call it BEFORE the change: the owner logged is the one a clean row judged.

        A clean entry is known, not free, the reader's (same gen; shared, or owned by the
        reader) and written at its gen. Allocation (gen), free (state), a claim (state, owner)
        and lowering written_gen can spoil that and are logged; a KV write (written_gen :=
        gen) and a request's pages turning CACHED (its row is gone; CACHED is known and not
        free for the readers sharing them) cannot, and are not."""
        if len(pages) == 0 or self.changes_overflow:
            return
        self.changed_owners(pages, self.owner_keys(pages))

    def changed_owners(self, pages: np.ndarray, owners: np.ndarray) -> None:
        """``changed``, with the pages' owner keys before the change already read."""
        if len(pages) == 0 or self.changes_overflow:
            return
        self.changes.append((pages, owners))
        self.changes_len += len(pages)
        if self.changes_len > len(self.state):  # cheaper to re-judge everything than to replay
            self.changes_overflow = True
            self.changes.clear()

    def changed_one(self, page: int) -> None:
        """``changed`` for one page, by scalars (a decode step's new page claimed by its request)."""
        if self.changes_overflow:
            return
        self.changes.append(([page], [int(self.keys.keys[self.owner_slot[page]])]))
        self.changes_len += 1
        if self.changes_len > len(self.state):
            self.changes_overflow = True
            self.changes.clear()

    def one_page_each(self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray) -> bool:
        """Whether a forward's writes are a decode step's: one page per request, in request
        order, every id a real page this pool holds (nothing to select, widen or grow for)."""
        return (
            len(write_pages) == len(req_keys)
            and int(write_counts.max()) == 1
            and int(write_pages.min()) > PADDING_PAGE
            and int(write_pages.max()) < self.num_pages
        )

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


class RowScalars:
    """The judge's per-row scalars as arrays indexed by ``Row.index``: the row's length and its
    clean prefix (``clean_n``, ``clean_reads``, ``clean_epoch``). A decode step's FORWARD asks
    them of every request in the batch; held in arrays they are read for the whole batch by a
    few numpy operations instead of ~10 attribute reads per request. Indexes of ended rows are
    reused (``release``), so the table is as large as the most rows live at once."""

    __slots__ = (
        "length",
        "clean_n",
        "clean_reads",
        "clean_epoch",
        "tail_page",
        "tail_gen_shared",
        "stamp",
        "_free",
        "next_stamp",
    )

    # name -> value of a fresh row
    FRESH = (
        ("length", 0),
        ("clean_n", 0),
        ("clean_reads", 0),
        ("clean_epoch", -1),
        ("tail_page", -1),
        ("tail_gen_shared", 0),
        ("stamp", -1),
    )

    def __init__(self, capacity: int = 64):
        # (the row's last entry, page and gen_shared, so that a batch of one-page ASSIGNs is
        # told apart from the row without touching it: ``EngineTracker.on_assign_run``)
        self.tail_page = np.full(capacity, -1, np.int64)
        self.tail_gen_shared = np.zeros(capacity, np.uint32)
        self.length = np.zeros(capacity, np.int64)
        self.clean_n = np.zeros(capacity, np.int64)
        self.clean_reads = np.zeros(capacity, np.int64)
        self.clean_epoch = np.full(capacity, -1, np.int64)
        # a stamp no other state of any row had (``touch``): a row whose stamp is unchanged
        # since a forward holds the entries it held then (the judge compares the engine's rows
        # of the next forward with the last ones there, ``Judge._rows_as_modelled``)
        self.stamp = np.full(capacity, -1, np.int64)
        self.next_stamp = 0
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name, _fresh in self.FRESH)

    def take(self) -> int:
        """A fresh row's index (nothing judged clean, no entries)."""
        if not self._free:
            old = len(self.length)
            for name, fresh in self.FRESH:
                arr = getattr(self, name)
                grown = np.full(2 * old, fresh, arr.dtype)
                grown[:old] = arr
                setattr(self, name, grown)
            self._free = list(range(2 * old - 1, old - 1, -1))
        index = self._free.pop()
        for name, fresh in self.FRESH:
            getattr(self, name)[index] = fresh
        self.touch(index)
        return index

    def touch(self, index: int) -> None:
        """Row ``index``'s entries changed: a new stamp."""
        self.stamp[index] = self.next_stamp
        self.next_stamp += 1

    def release(self, index: int) -> None:
        self.clean_epoch[index] = -1
        self._free.append(index)


class _InTable:
    """A row's scalar, kept in the ``RowScalars`` column of the same name at the row's index."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, row: Row, owner: type | None = None) -> int:
        return int(getattr(row.table, self.name)[row.index])

    def __set__(self, row: Row, value: int) -> None:
        getattr(row.table, self.name)[row.index] = value


class Row:
    """A live request's row, one entry per row page: 8 bytes, an int32 page (ids are below
    ``PagePool.limit`` <= ``MAX_PAGES``; -1 = not assigned) and a u32 holding the page's gen
    when assigned (``GEN_MASK``: gens count allocations modulo 2**31) and, in ``SHARED_BIT``,
    whether it came from the prefix cache. ``gens`` / ``shared`` read them apart.

    Its length and clean prefix live in the tracker's ``RowScalars`` at ``index`` (the judge
    reads them for a whole batch at once); a row made without a table gets one of its own.

    Every row holds its own copy of its prefix-cache entries: at the reference workload the
    rows' entries are four times the pool (docs/performance.md, "Memory")."""

    __slots__ = ("pages", "gen_shared", "slot", "slot_epoch", "table", "index", "_pages_buf", "_gens_buf")

    def __init__(self, table: RowScalars | None = None):
        # ``pages`` / ``gen_shared`` are views of the row's entries into buffers with room for
        # a few more: a decode step appends one entry to some rows, and a copy of the whole
        # row per append cost ~4 us (the room: a sixteenth of the row, at least 8 entries)
        self._pages_buf = np.zeros(0, np.int32)
        self._gens_buf = np.zeros(0, np.uint32)
        self.pages = self._pages_buf
        self.gen_shared = self._gens_buf
        # the request key's slot in the pool's KeyTable, valid while slot_epoch == PagePool.keys_epoch
        self.slot: int | np.uint32 = 0
        self.slot_epoch = -1
        self.table = table if table is not None else RowScalars(1)
        self.index = self.table.take()

    # entries [0, clean_n) were judged clean (nothing to report) in judge epoch clean_epoch and
    # none of their pages changed since; clean_reads of them are pages (id > 0) a read counts
    clean_n = _InTable()
    clean_reads = _InTable()
    clean_epoch = _InTable()

    def forget_clean(self, n: int) -> None:
        """Entries from ``n`` on must be judged again."""
        t, i = self.table, self.index
        if t.clean_n[i] > n:
            t.clean_n[i] = n
            t.clean_reads[i] = int(np.count_nonzero(self.pages[:n] > 0))

    def tail_changed(self) -> None:
        """Entries were (re)written (every write to ``pages`` / ``gen_shared`` ends with this
        call): a new stamp, and the copy of the last entry in the table follows
        (``EngineTracker.on_assign_run`` tells repeated ASSIGNs by it)."""
        self.table.touch(self.index)
        if len(self.pages):
            self.table.tail_page[self.index] = self.pages[-1]
            self.table.tail_gen_shared[self.index] = self.gen_shared[-1]

    def ensure(self, n: int) -> None:
        """At least ``n`` entries (new ones unassigned: page -1)."""
        have = len(self.pages)
        if n <= have:
            return
        if n > len(self._pages_buf):  # (entries past the row in a buffer are never written: fresh)
            room = n + max(8, n >> 4)
            pages = np.full(room, -1, np.int32)
            gens = np.zeros(room, np.uint32)
            pages[:have] = self.pages
            gens[:have] = self.gen_shared
            self._pages_buf, self._gens_buf = pages, gens
        self.pages = self._pages_buf[:n]
        self.gen_shared = self._gens_buf[:n]
        self.table.length[self.index] = n
        self.table.touch(self.index)

    def append_one(self, page: int, gen_shared: int) -> None:
        """One entry past the row's end (a decode step's token starting a page): ``ensure``,
        the entry written, ``tail_changed``, with one new stamp and the tail copied from the
        arguments (the same state as those three calls leave)."""
        n = len(self.pages) + 1
        if n > len(self._pages_buf):
            self.ensure(n)
        else:
            self.pages = self._pages_buf[:n]
            self.gen_shared = self._gens_buf[:n]
        self.pages[n - 1] = page
        self.gen_shared[n - 1] = gen_shared
        t, i = self.table, self.index
        t.length[i] = n
        t.touch(i)
        t.tail_page[i] = page
        t.tail_gen_shared[i] = gen_shared

    @property
    def nbytes(self) -> int:
        """The memory its entries take, the room for more included."""
        return int(self._pages_buf.nbytes + self._gens_buf.nbytes)

    @property
    def gens(self) -> np.ndarray:
        """The gen each entry's page had when assigned."""
        return self.gen_shared & GEN_MASK

    @property
    def shared(self) -> np.ndarray:
        """Whether each entry came from the prefix cache."""
        return self.gen_shared >= SHARED_BIT

"""Page ownership, rebuilt from the record stream. No I/O; called on the ingest thread.

One ``PagePool`` per engine KV pool owns the per-page numpy arrays; one ``EngineTracker``
per engine process applies records to it and keeps the live requests' rows.

The page model is in sidecar/page_pool.py, the request directory in
sidecar/request_directory.py, the rows in sidecar/rows.py, the read and write rules
(``Judge``, held by each ``EngineTracker`` as ``judge``) in sidecar/judge.py; their names are
importable from here too.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from itertools import filterfalse

import numpy as np

from kvguard.engine_hooks import wire

from . import native

# (EngineTracker reads INCREMENTAL_JUDGE from this module: tests patch it here)
from .events import PrefixHit, PrefixSharedAcrossScopes, ReadVerdict, WriteVerdict
from .judge import INCREMENTAL_JUDGE, JUDGE_ENV, Judge
from .page_pool import (
    ALLOCATED,
    CACHED,
    FREE,
    GEN_MASK,
    KEYS_COMPACT_MIN,
    MAX_PAGES,
    NO_SLOT,
    OWNED,
    PADDING_PAGE,
    SHARED_BIT,
    STATE_NAMES,
    UNKNOWN,
    KeyTable,
    PagePool,
    Row,
)
from .request_directory import RequestDirectory, RequestInfo
from .rows import RowTable
from .stats import CoverageEntry, EngineStats, PoolStats

__all__ = [
    "ALLOCATED",
    "CACHED",
    "FREE",
    "GEN_MASK",
    "IDLE_REQUEST_NS",
    "INCREMENTAL_JUDGE",
    "JUDGE_ENV",
    "KEYS_COMPACT_MIN",
    "LOST_UNSEEN_NS",
    "MAX_PAGES",
    "NO_SLOT",
    "OWNED",
    "PADDING_PAGE",
    "RETIRE_SCAN_NS",
    "ROLE_NAMES",
    "ROW_ENTRIES_BEFORE_HELLO",
    "ROW_SLACK_PAGES",
    "SHARED_BIT",
    "STATE_NAMES",
    "UNKNOWN",
    "EngineTracker",
    "Judge",
    "KeyTable",
    "PagePool",
    "ReadVerdict",
    "RequestDirectory",
    "RequestInfo",
    "Row",
    "WriteVerdict",
]

log = logging.getLogger("kvguard.tracker")

# the role label of findings, incidents and metrics; "unknown" before the engine's HELLO
ROLE_NAMES = {wire.Role.UNIFIED: "unified", wire.Role.PREFILL: "prefill", wire.Role.DECODE: "decode"}

# A request's row has one entry per page of its context: an ASSIGN placing pages past what the
# engine can hold (its HELLO's context length or pool, whichever is larger, plus ROW_SLACK_PAGES)
# is skipped and its pages counted in ``pages_out_of_range``: one 40-byte record must not make the
# sidecar allocate gigabytes of row. Before any HELLO, rows are bounded by ROW_ENTRIES_BEFORE_HELLO.
ROW_SLACK_PAGES = 1024
ROW_ENTRIES_BEFORE_HELLO = 1 << 20

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


def coverage_entries(coverage: wire.Coverage | None) -> tuple[CoverageEntry, ...]:
    """An engine's COVERAGE as plain values for /metrics and /v1 (sidecar/stats.py)."""
    if coverage is None:
        return ()

    def names(bits: int) -> tuple[str, ...]:
        return tuple(c.name.lower() for c in wire.Capability if bits & c and c.name)

    return tuple(
        CoverageEntry(item.component, item.status.name.lower(), names(item.watched), names(item.missing), item.detail)
        for item in coverage.items
    )


MAX_OVERWRITTEN = 4096  # pages kept in EngineTracker.overwritten (each a late write's)
MAX_EARLY_WRITERS = 4096  # requests kept in EngineTracker.early_written (writes before their REQ_BEGIN)


class EngineTracker:
    """Ownership state of one engine process, updated record by record."""

    def __init__(self, engine_id: int, directory: RequestDirectory, pool_info: wire.PoolInfo | None = None):
        self.engine_id = engine_id
        # which of the engine's pools this tracker models: 0, the token KV pool its HELLO
        # describes, or one a POOL record declared (contract 1.5; it then shares the engine's
        # request directory, and its HELLO is the engine's with this pool's page figures)
        self.pool_index = 0
        self.pool_info = pool_info
        self.coverage: wire.Coverage | None = None  # the engine's COVERAGE (pool 0's tracker keeps it)
        self.coverage_reported = False  # its coverage_gap was raised (once per engine)
        # pool 0's tracker: the trackers of the engine's other pools, by index (POOL records)
        self.pools: dict[int, EngineTracker] = {}
        self.hello: wire.Hello | None = None
        self.page_size = 1
        self.pool = PagePool(1)
        self.rows = RowTable()  # live rows by request key
        self.requests = directory
        # the read and write rules over this pool's pages and rows (and their counts)
        self.judge = Judge(self.pool, self.rows, directory, INCREMENTAL_JUDGE)
        self.transfer_hold: set[int] = set()  # decode requests whose incoming KV is not yet accounted
        self.requests_retired_idle = 0  # live requests that never ended and held nothing (RequestDirectory.retire_idle)
        # live request key -> time of the first gap (LOST) since a record last named it (LOST_UNSEEN_NS)
        self.unseen_since_loss: dict[int, int] = {}
        self.requests_retired_after_loss = 0  # of those, retired with their rows: their end fell in a gap
        self._next_retire_ns = 0
        self.row_limit = ROW_ENTRIES_BEFORE_HELLO  # row entries (pages) a request may have (on_hello)
        self.assigns_out_of_range = 0  # ASSIGNs skipped for it (their pages are in pages_out_of_range)
        # The ttft detector's evidence that a prompt was prefilled, kept as the forwards come:
        # live requests still within their prompt -> [prompt tokens, pages their own forwards
        # wrote while within it]; at the first forward past the prompt the count moves to
        # prompt_written until the request ends (take_prompt_pages_written). Per forward, not
        # distinct pages: with chunked prefill the radix cache may take a chunk's KV over and
        # free the request's pages, which its next chunk then reuses.
        self.prompt_writing: dict[int, list[int]] = {}
        self.prompt_written: dict[int, int] = {}
        # page -> gen: pages of a live request that another request's late write landed in since
        # the owner's own transfer chunk did (mark_overwritten). The owner's transfer pairing
        # does not count them as written for it. Only late writes put pages here (a bug's).
        self.overwritten: dict[int, int] = {}
        # request key -> [(pages, their gens)] written for a request before its REQ_BEGIN (a
        # load an adapter reports during admission, before the request's first row). The pages
        # take its scope when its REQ_SCOPE comes (on_scope), so that handing them to the
        # request on its rows is not a share across scopes; dropped at its end.
        self.early_written: OrderedDict[int, list[tuple[np.ndarray, np.ndarray]]] = OrderedDict()

    # ------------------------------------------------------------------ lifecycle
    def retire_idle_requests(self, now_ns: int, idle_ns: int = IDLE_REQUEST_NS) -> int:
        """Bound the live request directory (at most one scan per ``RETIRE_SCAN_NS``)."""
        if now_ns < self._next_retire_ns:
            return 0
        self._next_retire_ns = now_ns + RETIRE_SCAN_NS
        if self.pool_index:  # the directory is pool 0's: drop the rows of requests it has ended
            live = self.requests.live
            for key in [k for k in self.rows if k not in live]:
                self.release_row(key)
            return 0
        moved = self._retire_unseen_since_loss(now_ns) if self.unseen_since_loss else 0
        idle = self.requests.retire_idle(now_ns, idle_ns, lambda key: key in self.rows or key in self.transfer_hold)
        self.requests_retired_idle += idle
        if moved or idle:  # their prompt counts go with them
            live = self.requests.live
            for counts in (self.prompt_writing, self.prompt_written):
                for key in [k for k in counts if k not in live]:
                    del counts[key]
        return moved + idle

    def _retire_unseen_since_loss(self, now_ns: int) -> int:
        """End the requests live at a gap that no record named for ``LOST_UNSEEN_NS`` since
        (their row dropped: the pages it named are UNKNOWN since the gap, reallocation tells
        their next owner). A request still waiting on its transfer is kept."""
        moved = 0
        live = self.requests.live
        for key, since in list(self.unseen_since_loss.items()):
            if key not in live:
                del self.unseen_since_loss[key]
            elif now_ns - since > LOST_UNSEEN_NS and key not in self.transfer_hold:
                del self.unseen_since_loss[key]
                self._drop_row(key)
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
        self.judge.on_hello(hello)
        if self.pool_index == 0:  # a new HELLO: the engine declares its other pools (and coverage) again after it
            self.pools.clear()
            self.coverage = None
            self.coverage_reported = False
        if self.pool_info is not None and self.pool_info.shares_pages:
            tokens = max(hello.context_len, hello.pool_tokens)
            self.row_limit = min(-(-tokens // max(self.page_size, 1)) + ROW_SLACK_PAGES, MAX_PAGES)
            return  # the page model is pool 0's, sized by its HELLO
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
        self.overwritten.clear()
        # a forward of any live request may be in the gap: its prompt count is not evidence any more
        self.prompt_writing.clear()
        self.prompt_written.clear()
        if ts_ns is not None:
            mark = self.unseen_since_loss.setdefault
            for key in self.requests.live:
                mark(key, ts_ns)

    # ------------------------------------------------------------------ what it publishes
    @property
    def role_name(self) -> str:
        h = self.hello
        return ROLE_NAMES.get(h.role, "unknown") if h is not None else "unknown"

    def stats(self) -> EngineStats:
        """This engine's figures for /metrics and /v1/engines (sidecar/stats.py). The page counts
        are one numpy bincount over the states (under a millisecond for 100k pages, taken per
        scrape, not kept up on the ingest path); the rest are counters read as they are."""
        h = self.hello
        return EngineStats(
            engine_id=self.engine_id,
            role=self.role_name,
            pid=h.pid if h is not None else None,
            rank=h.tp_rank if h is not None else None,
            page_size=self.page_size,
            pool_pages=h.pool_pages if h is not None else None,
            pool_tokens=h.pool_tokens if h is not None else None,
            context_len=h.context_len if h is not None else None,
            pages_by_state=self.pool.counts_by_state(),
            pages_read=self.judge.pages_read,
            pages_unverified=self.judge.pages_unverified,
            pages_out_of_range=self.pool.pages_out_of_range,
            live_requests=len(self.rows),
            coverage=coverage_entries(self.coverage),
            pools=tuple(self._pool_stats(index, t) for index, t in sorted(self.pools.items())),
        )

    @staticmethod
    def _pool_stats(index: int, t: EngineTracker) -> PoolStats:
        info = t.pool_info
        assert info is not None  # a pool tracker is made from its POOL record
        return PoolStats(
            index=index,
            kind=info.kind.name.lower(),
            name=info.name,
            page_size=info.page_size,
            pool_pages=info.pool_pages,
            window_tokens=info.window_tokens,
            pages_by_state={} if info.shares_pages else t.pool.counts_by_state(),  # (shared: pool 0's)
            pages_read=t.judge.pages_read,
            pages_unverified=t.judge.pages_unverified,
            pages_out_of_range=t.pool.pages_out_of_range,
        )

    def _slots(self, req_keys: np.ndarray) -> np.ndarray:
        """Pool slots of a FORWARD's request keys: from the rows for a small batch (a prefill's
        one or few requests; a table lookup costs ~15 us), else ``PagePool.slots``."""
        if len(req_keys) > 8:
            return self.pool.slots(req_keys)
        self.pool.reserve_keys(len(req_keys))  # so that no slot taken below is renumbered by a compaction
        rows_get = self.rows.get
        return np.array([self._slot(key, rows_get(key)) for key in req_keys.tolist()], np.uint32)

    def _slot(self, key: int, row: Row | None) -> int | np.uint32:
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
        self.prompt_written.pop(r.req_key, None)
        if r.prompt_tokens > 0 and not r.warmup:
            self.prompt_writing[r.req_key] = [r.prompt_tokens, 0]

    def count_prompt_writes(
        self, req_keys: np.ndarray, seq_lens: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray
    ) -> None:
        """A forward: add the pages it wrote for each request still within its prompt (the
        forward reads ``seq_len`` <= prompt tokens). Costs one isin over the batch while any
        request is prefilling, nothing otherwise."""
        writing = self.prompt_writing
        if not writing:
            return
        if len(writing) <= 8:  # the usual few requests still prefilling: a compare each beats a sort
            keys_u64 = req_keys.astype(np.uint64, copy=False)
            found = [np.flatnonzero(keys_u64 == np.uint64(key)) for key in writing]
            hits = np.sort(np.concatenate(found)) if len(found) > 1 else found[0]
        else:
            hits = np.flatnonzero(np.isin(req_keys, np.fromiter(writing, np.uint64, len(writing))))
        if len(hits) == 0:
            return
        w_off = np.concatenate(([0], np.cumsum(write_counts, dtype=np.int64)))
        keys, lens = req_keys.tolist(), seq_lens.tolist()
        for i in hits.tolist():
            key = keys[i]
            entry = writing.get(key)
            if entry is None:  # named twice in one batch (a corrupt record), gone at the first
                continue
            if lens[i] <= entry[0]:
                entry[1] += len(np.unique(write_pages[w_off[i] : w_off[i + 1]]))
            else:  # past its prompt: decoding
                del writing[key]
                self.prompt_written[key] = entry[1]

    def take_prompt_pages_written(self, req_key: int) -> int | None:
        """The pages this request's forwards wrote within its prompt, once (at its end); None
        when its REQ_BEGIN was not seen (the sidecar attached later, or a gap)."""
        entry = self.prompt_writing.pop(req_key, None)
        if entry is not None:
            return entry[1]
        return self.prompt_written.pop(req_key, None)

    def on_request_end(self, r: wire.ReqEnd, ts_ns: int) -> None:
        info = self.requests.get_or_stub(r.req_key)
        info.end_ns, info.finish, info.ttft_ns = ts_ns, r.finish.name.lower(), r.ttft_ns
        info.reprefilled = r.reprefilled
        self.release_row(r.req_key)
        self.requests.end(r.req_key)

    def release_row(self, req_key: int) -> None:
        """The request ended: its row goes (in this pool; the engine's other pools are told by
        the pipeline, their directory being this one)."""
        self.early_written.pop(req_key, None)
        row = self._drop_row(req_key)
        self.transfer_hold.discard(req_key)
        if row is not None:
            # what the request still owns was kept by the prefix cache (freed pages are FREE already)
            pages = row.pages[row.pages > 0]
            mine = pages[(self.pool.owner_keys(pages) == np.uint64(req_key)) & (self.pool.state[pages] == OWNED)]
            # (not logged for the incremental judge: CACHED is as good as OWNED for every other reader)
            self.pool.state[mine] = CACHED

    def _drop_row(self, req_key: int) -> Row | None:
        return self.rows.drop(req_key)

    def share_pool(self, other: EngineTracker) -> None:
        """Model the same pages as ``other`` (pools aliasing one block pool: vLLM's KV cache
        groups): one page model, so a block one group freed and another took is judged as such;
        the rows stay this pool's."""
        self.pool = other.pool
        self.judge.share_pool(other.pool)

    def on_reject(self, r: wire.Reject) -> None:
        self.requests.get_or_stub(r.req_key).rejected = f"{r.phase.name.lower()}: {r.reason}"

    # ------------------------------------------------------------------ pages
    def on_alloc(self, pages: np.ndarray) -> np.ndarray:
        """Mark pages allocated (a new generation); returns the valid ones (ids past the
        pool's limit are counted in ``pages_out_of_range`` and skipped)."""
        return self.on_alloc_gens(pages)[0]

    def on_alloc_gens(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``on_alloc``, with the pages' new generations."""
        pool = self.pool
        kernels = native.KERNELS
        if kernels is not None and len(pages):  # the lines below in one call (kvguard.sidecar.native)
            owners, gens = np.empty(len(pages), np.uint64), np.empty(len(pages), np.uint32)
            if kernels.alloc(pages, pool.state, pool.gen, pool.owner_slot, pool.keys.keys, owners, gens) == 1:
                pool.changed_owners(pages, owners)
                return pages, gens
        pages = self._alloc(pages)
        return pages, pool.gen[pages]

    def _alloc(self, pages: np.ndarray) -> np.ndarray:
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

    def _assign_appends_one(self, key: int, page: int, row_start: int, shared_until: int) -> bool:
        """A one-page ASSIGN (``key``, ``page`` at ``row_start``) that appends a page to its
        request's row (a decode step's token starting a page: most of the ASSIGNs the SGLang
        adapter sends), applied by scalars with ``on_assign``'s rules instead of ~20 numpy
        calls. False (nothing done) for anything else: no row yet, another entry, a page the
        pool does not hold yet, a prefix-cache page while scopes are in use."""
        row = self.rows.get(key)
        pool = self.pool
        if row is None:
            return False
        entry = row_start // self.page_size
        shared = row_start < shared_until  # (the entry's first position here is row_start)
        if entry != len(row.pages) or not 0 <= page < pool.num_pages or (shared and pool.scope is not None):
            return False
        self.requests.get_or_stub(key)
        # (the entry is the row's next one, and its clean prefix ends before it already)
        row.append_one(page, int(pool.gen[page]) | (int(SHARED_BIT) if shared else 0))
        if not shared:  # a freshly allocated page (or one we could not see allocated) becomes the request's
            state = int(pool.state[page])
            if state == ALLOCATED or (state == OWNED and int(pool.keys.keys[pool.owner_slot[page]]) == key):
                pool.changed_one(page)
                pool.state[page] = OWNED
                pool.owner_slot[page] = self._slot(key, row)
        return True

    def on_scope(self, s: wire.ReqScope) -> None:
        """A request's prefix-cache scope (it follows the request's REQ_BEGIN)."""
        info = self.requests.get(s.req_key)
        if info is None:
            return
        info.scope = s.scope
        self.pool.enable_scopes()
        pool = self.pool
        assert pool.scope is not None
        for pages, gens in self.early_written.pop(s.req_key, ()):
            pool.scope[pages[pool.gen[pages] == gens]] = s.scope  # still the pages it wrote

    def _scope_of(self, key: int) -> int:
        info = self.requests.get(key)
        return info.scope if info is not None else 0

    def _shared_across_scopes(self, req_key: int, shared_pages: np.ndarray) -> PrefixSharedAcrossScopes | None:
        """Prefix-cache pages just handed to a request whose KV was written under another scope
        (salt / extra key): the engine's cache let the two scopes share KV."""
        pool = self.pool
        assert pool.scope is not None
        reader = self.requests.get(req_key)
        if reader is None or not reader.known or len(shared_pages) == 0:
            return None
        p = shared_pages[
            (pool.state[shared_pages] != UNKNOWN) & (pool.written_gen[shared_pages] == pool.gen[shared_pages])
        ]
        crossed = p[pool.scope[p] != np.uint64(reader.scope)]
        if len(crossed) == 0:
            return None
        return PrefixSharedAcrossScopes(reader, crossed, pool.scope[crossed].copy())

    def on_assign(self, a: wire.Assign) -> tuple[PrefixSharedAcrossScopes | PrefixHit, ...]:
        """Apply an ASSIGN; the events it gives: a prefix-cache hit at the row's start
        (``PrefixHit``), and pages shared across prefix-cache scopes."""
        if a.row_start // self.page_size + len(a.pages) > self.row_limit or a.row_end > self.row_limit * self.page_size:
            self._assign_out_of_range(a)
            return ()
        if self._assign_changes_nothing(a):
            self.requests.get_or_stub(a.req_key)
            return ()
        if len(a.pages) == 1 and self._assign_appends_one(a.req_key, int(a.pages[0]), a.row_start, a.shared_until):
            return ()
        pages = self.pool.ensure(a.pages.astype(np.int64))
        if len(pages) != len(a.pages):
            return ()
        self.requests.get_or_stub(a.req_key)
        row = self.rows.get(a.req_key)
        if row is None:
            row = self.rows.new(a.req_key)
        first = a.row_start // self.page_size
        idx = np.arange(first, first + len(pages))
        row.forget_clean(first)  # entries from ``first`` on are rewritten
        row.ensure(first + len(pages))
        positions = np.maximum(idx * self.page_size, a.row_start)
        shared = positions < a.shared_until
        row.pages[idx] = pages
        row.gen_shared[idx] = self.pool.gen[pages] | (shared.astype(np.uint32) << np.uint32(31))
        row.tail_changed()
        pool = self.pool
        fresh = pages[~shared]
        # a freshly allocated page (or one we could not see allocated) becomes the request's
        claim = fresh[
            (pool.state[fresh] == ALLOCATED)
            | ((pool.state[fresh] == OWNED) & (pool.owner_keys(fresh) == np.uint64(a.req_key)))
        ]
        if len(claim):
            pool.changed(claim)
            pool.state[claim] = OWNED
            pool.owner_slot[claim] = self._slot(a.req_key, row)
        if not a.shared_until or not shared.any():
            return ()
        events: list[PrefixSharedAcrossScopes | PrefixHit] = []
        if first == 0:  # the row's prefix came from the cache: who wrote it (a few ASSIGNs per request)
            hit = self._prefix_hit(a.req_key, a.shared_until, pages[shared])
            if hit is not None:
                events.append(hit)
        if pool.scope is not None:  # salts in use: the cache must keep scopes apart
            crossed = self._shared_across_scopes(a.req_key, pages[shared])
            if crossed is not None:
                events.append(crossed)
        return tuple(events)

    def _prefix_hit(self, req_key: int, hit_tokens: int, shared_pages: np.ndarray) -> PrefixHit | None:
        """The prefix-cache pages a request's row starts with that hold KV at their generation,
        and who wrote them; None for a reader not judged or nothing written."""
        reader = self.requests.get(req_key)
        if reader is None or not reader.known:
            return None
        pool = self.pool
        held = shared_pages[(shared_pages > PADDING_PAGE) & (pool.state[shared_pages] != UNKNOWN)]
        held = held[pool.written_gen[held] == pool.gen[held]]
        if len(held) == 0:
            return None
        return PrefixHit(reader, int(hit_tokens), held, pool.last_writer[held])

    def on_assign_run(self, run: wire.AssignRun) -> np.ndarray:
        """A batch of one-page ASSIGNs (``wire.AssignRun``): the positions, ascending, that must
        be applied one by one (``on_assign``); the others change nothing and are settled here.

        An ASSIGN changes nothing when, as ``_assign_changes_nothing`` has it, it names the
        page its row's entry already holds, at the page's generation, with the same
        prefix-cache flag, and the page has nothing to claim; here only for the row's last
        entry (a decode step's token goes there), all of them at once over ``RowScalars``.
        Judged against the state before the batch: an ASSIGN changes only its own row and
        claims its own pages, so only a later ASSIGN of the same request can be affected
        by an earlier one that changes something, and those go one by one too."""
        n = len(run)
        ps = self.page_size
        keys = run.req_keys
        idx = self.rows.indexes(keys)  # (a decode step's run names the batch of its FORWARD: kept)
        kernels = native.KERNELS
        if kernels is not None:  # the rules below in one call (kvguard.sidecar.native)
            table = self.rows.scalars
            nothing, one_by_one = np.empty(n, bool), np.empty(n, bool)
            got = kernels.assign_run(
                idx,
                keys,
                run.row_start,
                run.row_end,
                run.shared_until,
                run.pages,
                table.length,
                table.tail_page,
                table.tail_gen_shared,
                self.pool.gen,
                self.pool.state,
                nothing,
                one_by_one,
                ps,
                self.row_limit,
            )
            if got >= 0:
                for key in kernels.absent_keys(keys, nothing, self.requests.live):
                    self.requests.get_or_stub(key)  # (as below)
                return np.flatnonzero(one_by_one)
        every = int(idx.min()) >= 0
        at = idx if every else np.where(idx >= 0, idx, 0)
        table, pool = self.rows.scalars, self.pool
        pages = run.pages
        entry = run.row_start // ps
        shared = run.row_start < run.shared_until  # the entry's first position in each ASSIGN is row_start
        any_shared = bool(shared.any())
        # the bounds by a few reductions (in a decode step's run every ASSIGN is in bounds)
        in_bounds = (
            int(pages.min()) >= 0
            and int(pages.max()) < pool.num_pages
            and int(entry.max()) < self.row_limit
            and int(run.row_end.max()) <= self.row_limit * ps
        )
        if in_bounds:
            page = pages
            nothing = (entry == table.length[at] - 1) & (table.tail_page[at] == pages)
        else:
            in_range = (entry < self.row_limit) & (run.row_end.astype(np.int64) <= self.row_limit * ps)
            valid = (pages >= 0) & (pages < pool.num_pages)
            page = np.where(valid, pages, 0)
            nothing = in_range & valid & (entry == table.length[at] - 1) & (table.tail_page[at] == pages)
        if not every:
            nothing &= idx >= 0
        if any_shared:
            gen_shared = pool.gen[page] | (shared.astype(np.uint32) << np.uint32(31))
            nothing &= (table.tail_gen_shared[at] == gen_shared) & (shared | (pool.state[page] != ALLOCATED))
        else:  # (decode tokens are past the prefix: no SHARED_BIT anywhere)
            nothing &= (table.tail_gen_shared[at] == pool.gen[page]) & (pool.state[page] != ALLOCATED)
        one_by_one = ~nothing
        if one_by_one.any() and nothing.any():
            first = np.flatnonzero(one_by_one)
            if len(first) > 32:  # many: everything from the first one on, in order
                one_by_one[first[0] :] = True
            else:
                later = np.arange(n)
                for i in first.tolist():
                    if i + 1 < n and (keys[i + 1 :] == keys[i]).any():  # (its request again later: rare)
                        one_by_one |= (keys == keys[i]) & (later > i)
        # on_assign's stub for a request the directory does not hold (a row of an ended request
        # may outlive its directory entry in an engine's other pools)
        for key in filterfalse(self.requests.live.__contains__, keys[nothing].tolist()):
            self.requests.get_or_stub(key)
        return np.flatnonzero(one_by_one)

    def on_assign_run_rest(
        self, run: wire.AssignRun, positions: np.ndarray
    ) -> list[tuple[int, PrefixSharedAcrossScopes | PrefixHit]]:
        """Apply, in order, the ASSIGNs of a run that ``on_assign_run`` left to be applied one
        by one, as ``on_assign`` would: those that append a page to their row (a decode step's
        token starting a page) by scalars, the rest as ASSIGNs of their own. Returns the
        events they gave (``on_assign``), with their positions."""
        out: list[tuple[int, PrefixSharedAcrossScopes | PrefixHit]] = []
        row_limit = self.row_limit * self.page_size
        sel = positions
        for i, key, start, end, shared_until, page in zip(
            sel.tolist(),
            run.req_keys[sel].tolist(),
            run.row_start[sel].tolist(),
            run.row_end[sel].tolist(),
            run.shared_until[sel].tolist(),
            run.pages[sel].tolist(),
        ):
            if end <= row_limit and self._assign_appends_one(key, page, start, shared_until):
                continue
            for event in self.on_assign(run.assign(i)):  # (changes nothing, out of range, a new row, ...)
                out.append((i, event))
        return out

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

    def decode_writes(
        self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray, ts_ns: int
    ) -> bool:
        """A decode step's writes, judged and marked at once: one page per request
        (``PagePool.one_page_each``), no page named twice, none freed or another request's, no
        salts. True: marked as ``mark_writes`` would, nothing to report (``check_writes`` would
        give no verdict); False: nothing done, for the general path (``writes_overlap``,
        ``check_writes``, ``mark_writes``). One gather of the pages' state for the three, or
        one call of the compiled kernel (``kvguard.sidecar.native``: the same rules)."""
        pool = self.pool
        if not len(write_pages) or pool.scope is not None or self.hello is None:  # (nothing written: returns at once)
            return False
        kernels = native.KERNELS
        if kernels is not None and pool.write_epoch_ns is not None:
            ms = pool.write_ms(ts_ns)
            if ms is not None:
                done = kernels.decode_writes(*self.decode_writes_args(req_keys, write_counts, write_pages, ms))
                if done >= 0:
                    return done == 1
                # a writer without a slot yet: the numpy path below interns it
        if not pool.one_page_each(req_keys, write_counts, write_pages):
            return False
        state = pool.state[write_pages]
        if self.judge.one_page_writes_bad(req_keys, write_pages, state) or self.judge.writes_overlap(write_pages):
            return False
        self._mark_one_page_each(req_keys, write_pages, state, ts_ns)
        return True

    def decode_writes_args(
        self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray, ms: int
    ) -> tuple:
        """The compiled ``decode_writes``' arguments: the step's arrays, the pool's columns and key
        table, the write time as ``PagePool.write_ms`` gives it."""
        pool, keys = self.pool, self.pool.keys
        return (
            req_keys,
            write_counts,
            write_pages,
            pool.state,
            pool.owner_slot,
            keys.keys,
            pool.gen,
            pool.written_gen,
            pool.writer_slot,
            pool.last_write_ms,
            keys.sorted_keys,
            keys.sorted_slots,
            keys.indexed,
            ms,
        )

    def _mark_one_page_each(self, req_keys: np.ndarray, write_pages: np.ndarray, state: np.ndarray, ts_ns: int) -> None:
        """``mark_writes`` of one page per request (``PagePool.one_page_each``, no salts;
        ``state`` the pages' states): nothing to select or widen first."""
        pool = self.pool
        known = write_pages if int(state.min()) != UNKNOWN else write_pages[state != UNKNOWN]
        pool.written_gen[known] = pool.gen[known]  # (not logged: see PagePool.changed)
        pool.writer_slot[write_pages] = self._slots(req_keys)
        pool.mark_write_time(write_pages, ts_ns)

    def mark_writes(self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray, ts_ns: int) -> None:
        """``mark_written`` for every request of a forward at once (no page written twice:
        ``writes_overlap``)."""
        if len(write_pages) == 0:
            return
        pool = self.pool
        if pool.scope is None and pool.one_page_each(req_keys, write_counts, write_pages):
            self._mark_one_page_each(req_keys, write_pages, pool.state[write_pages], ts_ns)
            return
        pages = write_pages.astype(np.int64)
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
        if pool.scope is not None:  # salts in use: each page takes its writer's scope
            scopes = np.array([self._scope_of(k) for k in req_keys.tolist()], np.uint64)
            written = np.repeat(scopes, write_counts.astype(np.int64))
            if not valid.all():
                written = written[valid]
            pool.scope[pages] = written[real]

    def mark_written(self, req_key: int, pages: np.ndarray, ts_ns: int) -> None:
        pages = self.pool.ensure(pages.astype(np.int64))
        pages = pages[pages != PADDING_PAGE]
        pool = self.pool
        known = pages[pool.state[pages] != UNKNOWN]
        pool.written_gen[known] = pool.gen[known]
        pool.writer_slot[pages] = self._slot(req_key, self.rows.get(req_key))
        pool.mark_write_time(pages, ts_ns)
        if pool.scope is not None:
            pool.scope[pages] = self._scope_of(req_key)
        if req_key and self.requests.get(req_key) is None:  # a request not begun yet (early_written)
            self.early_written.setdefault(req_key, []).append((pages, pool.gen[pages].copy()))
            self.early_written.move_to_end(req_key)
            while len(self.early_written) > MAX_EARLY_WRITERS:
                self.early_written.popitem(last=False)

    def mark_overwritten(self, pages: np.ndarray) -> None:
        """Pages of another live request that a late transfer chunk just landed in
        (``WriteVerdict.foreign``; the chunk is already their last writer): they no longer hold
        what their owner wrote, so the owner's next read of them is judged unwritten and names
        the late writer as the exposed party, until the owner writes them again."""
        pool = self.pool
        if len(self.overwritten) + len(pages) > MAX_OVERWRITTEN:  # drop the reallocated ones, then the oldest
            self.overwritten = {p: g for p, g in self.overwritten.items() if pool.gen[p] == g}
            while len(self.overwritten) + len(pages) > MAX_OVERWRITTEN and self.overwritten:
                del self.overwritten[next(iter(self.overwritten))]
        for p in pages.tolist():
            self.overwritten[p] = int(pool.gen[p])
        pages = pages[pool.written_gen[pages] == pool.gen[pages]]
        if len(pages):
            pool.changed(pages)  # written_gen goes back: logged for the incremental judge
            pool.written_gen[pages] = pool.gen[pages] - np.uint32(1)

    def not_overwritten(self, pages: np.ndarray) -> np.ndarray:
        """``pages`` without those a late write replaced at their current gen (mark_overwritten)."""
        if not self.overwritten or len(pages) == 0:
            return pages
        gens = self.pool.gen[pages]
        keep = [self.overwritten.get(p) != g for p, g in zip(pages.tolist(), gens.tolist())]
        return pages[np.array(keep, bool)]

    def rewritten_by_owner(self, pages: np.ndarray) -> None:
        """The owner's own transfer chunk landed in ``pages``: what a late write put there is gone."""
        if self.overwritten:
            for p in pages.tolist():
                self.overwritten.pop(p, None)

    # ------------------------------------------------------------------ reads
    def row_pages_for(self, req_key: int, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        row = self.rows.get(req_key)
        if row is None:
            return None
        n = min(-(-int(seq_len) // self.page_size), len(row.pages))
        return row.pages[:n], row.gens[:n], row.shared[:n]

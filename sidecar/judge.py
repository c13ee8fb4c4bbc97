"""The judge: the read and write rules (``ReadVerdict``, ``WriteVerdict``) over the page model,
and judging only what changed since a request's row was last judged clean. One per
``EngineTracker`` (sidecar/tracker.py), which holds it as ``tracker.judge``: the tracker
applies records to the page pool and the rows, the judge reads the same objects (it is
handed them, never the tracker) and keeps its own counts and clean-prefix epoch.

Pages we know nothing about (``UNKNOWN``) are never judged: a sidecar that attached
late, or lost records, reports a blind window instead of guessing.

Judging only what changed (``Judge.classify_reads``): a read verdict is a pure
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

import os
from itertools import compress
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from kvguard.engine_hooks import wire

from . import native
from .events import ReadVerdict, WriteVerdict
from .page_pool import FREE, GEN_MASK, OWNED, PADDING_PAGE, SHARED_BIT, UNKNOWN, PagePool, Row
from .request_directory import RequestDirectory, RequestInfo
from .rows import RowTable

JUDGE_ENV = "KVGUARD_JUDGE"
_ROW_PAGES = attrgetter("pages")


def _incremental_judge_from_env() -> bool:
    """``KVGUARD_JUDGE``: ``incremental`` (default) or ``full``; anything else fails at start-up."""
    raw = os.environ.get(JUDGE_ENV, "incremental")
    if raw not in ("incremental", "full"):
        raise ValueError(f"{JUDGE_ENV}={raw!r}: expected 'incremental' or 'full'")
    return raw == "incremental"


# (EngineTracker reads it through sidecar/tracker.py, where tests patch it)
INCREMENTAL_JUDGE = _incremental_judge_from_env()


# row entries a forward adds up to which ``Judge._all_clean`` judges them one by one (a decode
# step adds one per request whose token starts a page; numpy's per-call cost beats scalars above)
_SCALAR_ENTRIES = 32
_GEN_MASK, _SHARED_BIT = int(GEN_MASK), int(SHARED_BIT)


# model row entries up to which ``Judge._rows_as_modelled`` keeps its buffer between forwards
# (1 MiB: the reference batch, 256 requests of 512 pages, takes half of it)
_MODEL_ROWS_KEPT = 1 << 18


# rows changed since the last forward's rows up to which ``Judge._rows_as_seen`` compares them one
# by one (each a couple of numpy calls) rather than gathering every model row
_SEEN_CHANGED_MAX = 48


class _RowsSeen(NamedTuple):
    """The last forward whose engine rows were found to be the model, every reader judged: its
    keys, the row entries each read, the rows' stamps then, and the rows as the engine sent
    them (a read-only view of that record)."""

    keys: np.ndarray
    n: np.ndarray
    stamps: np.ndarray
    actual: np.ndarray


class _Batch(NamedTuple):
    """A forward's readers against the rows: each key's row index (-1: none), whether it has
    one, whether all do, the index to read the row scalars at (0 for those without), and
    the row entries each read (its ``seq_len`` in pages, at most its row's length)."""

    idx: np.ndarray
    has: np.ndarray
    every: bool
    at: np.ndarray
    n: np.ndarray


class Judge:
    """The verdicts over one pool's page model: KV writes (``check_write``, ``check_writes``) and
    reads (``classify_read``, ``classify_reads``, ``classify_send``), judged fully or only where
    something changed. Counts the pages it judged (``pages_read``) and could not
    (``pages_unverified``)."""

    def __init__(self, pool: PagePool, rows: RowTable, requests: RequestDirectory, incremental: bool = True):
        self.pool = pool
        self.rows = rows
        self.requests = requests
        self.hello: wire.Hello | None = None  # the engine's (no HELLO: nobody is judged)
        self.page_size = 1
        self.incremental = incremental  # judge only what changed (False: every page every time)
        self.judge_epoch = 0  # bumped to drop every row's clean prefix at once
        self.pages_read = 0
        self.pages_unverified = 0
        self._rows_seen: list[_RowsSeen] = []  # (``_rows_as_seen``: at most two, the newest first)
        self._model_rows = np.zeros(0, np.int32)  # (``_rows_as_modelled``: the batch's model rows, reused)

    def on_hello(self, hello: wire.Hello) -> None:
        self.hello = hello
        self.page_size = hello.page_size

    def share_pool(self, pool: PagePool) -> None:
        """Judge over another tracker's page model (pages aliased by several pools): the full
        judge, since that pool's change log is its own tracker's judge's to consume."""
        self.pool = pool
        self.incremental = False

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
        if len(write_pages) < 2:
            return False
        ordered = np.sort(write_pages)
        return bool((ordered[1:] == ordered[:-1]).any())

    def check_writes(
        self, req_keys: np.ndarray, write_counts: np.ndarray, write_pages: np.ndarray
    ) -> list[tuple[int, WriteVerdict]]:
        """``check_write`` for every request of a forward at once (request ``i`` wrote the next
        ``write_counts[i]`` pages of ``write_pages``); verdicts only for the requests that wrote
        where they should not have. Same rules and counts as calling ``check_write`` per request,
        provided no page is written twice (``writes_overlap``)."""
        if self.hello is None or len(write_pages) == 0:
            return []
        pool = self.pool
        if pool.one_page_each(req_keys, write_counts, write_pages):
            # the same rules with nothing to select or widen first, and none of the writers looked up
            if not self.one_page_writes_bad(req_keys, write_pages, pool.state[write_pages]):
                return []
        counts = write_counts.astype(np.int64)
        pages = write_pages.astype(np.int64)
        writer = np.repeat(np.arange(len(req_keys)), counts)
        valid = (pages >= 0) & (pages < pool.limit)
        infos: list[RequestInfo | None] | None = None
        if not valid.all():  # ``ensure`` counts them, for judged writers only (as check_write)
            infos = self._writer_infos(req_keys)
            judged = np.array([info is not None and info.known for info in infos], bool)
            pool.pages_out_of_range += int(np.count_nonzero(~valid & judged[writer]))
            pages, writer = pages[valid], writer[valid]
        pool.ensure(pages)
        # the rules first, over every writer; who is judged (a known request) is looked up only
        # for the writers they flag (a clean forward builds nothing per request)
        look = pages != PADDING_PAGE
        state, owner = pool.state[pages], pool.owner_keys(pages)
        freed = look & (state == FREE)
        foreign = look & (state == OWNED) & (owner != req_keys.astype(np.uint64)[writer]) & (owner != 0)
        bad = freed | foreign
        if not bad.any():
            return []
        if infos is None:
            infos = self._writer_infos(req_keys)
        out = []
        for i in np.unique(writer[bad]).tolist():
            info = infos[i]
            if info is None or not info.known:
                continue
            mine = look & (writer == i)
            out.append((i, WriteVerdict(info, pages[mine & freed], pages[mine & foreign])))
        return out

    def one_page_writes_bad(self, req_keys: np.ndarray, write_pages: np.ndarray, state: np.ndarray) -> bool:
        """``check_write``'s rules over one page per request (``PagePool.one_page_each``; ``state``
        the pages' states): whether any writer wrote a freed page or another request's."""
        owner = self.pool.owner_keys(write_pages)
        return bool(((state == FREE) | ((state == OWNED) & (owner != req_keys) & (owner != 0))).any())

    def _writer_infos(self, req_keys: np.ndarray) -> list[RequestInfo | None]:
        get = self.requests.get
        return [get(key) for key in req_keys.tolist()]

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
            batch = self._batch(req_keys, seq_lens)
            if read_counts is None:
                return self._classify_changed(batch, req_keys)
            assert read_pages is not None  # the record carried rows: read_counts and read_pages come together
            unjudged = self._rows_as_modelled(batch, req_keys, read_counts, read_pages)
            if unjudged is not None:
                self.pages_unverified += unjudged  # what readers we cannot judge read (as below)
                return self._classify_changed(batch, req_keys)
        have_rows = read_counts is not None
        rc = read_counts.tolist() if read_counts is not None else []  # (read only with rows)
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
            assert read_counts is not None and read_pages is not None  # (rows: counts and pages together)
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
            info = infos[i]
            assert info is not None  # only judged readers have pages (or are flagged by ``every``)
            out.append(
                (
                    i,
                    ReadVerdict(
                        info,
                        p[unwritten[s:e]],
                        p[foreign[s:e]],
                        p[freed[s:e]],
                        int(np.count_nonzero(~known[s:e])),
                        p[shared[s:e]],
                    ),
                )
            )
        return out

    def classify_send(self, req_key: int, token_start: int, pages: np.ndarray) -> ReadVerdict | None:
        """Judge the source pages a sender shipped (an XFER_SEND: one page per row page from the
        page holding ``token_start`` on) as a read by the sending request, against its row: each
        must be its own page (or a prefix-cache page handed to it) and written at this
        generation. None when nothing is wrong or the sender is not judged (unknown, warmup
        is the detector's call). Not counted as pages read: /metrics counts forwards' reads."""
        info = self.requests.get(req_key)
        row = self.rows.get(req_key)
        if self.hello is None or info is None or row is None or not info.known or len(pages) == 0:
            return None
        pages = pages.astype(np.int64)
        first = int(token_start) // self.page_size
        m_pages = row.pages[first : first + len(pages)].astype(np.int64)
        m_gens = row.gen_shared[first : first + len(pages)]
        if len(m_pages) < len(pages):  # row pages the model never saw assigned: not the sender's
            missing = len(pages) - len(m_pages)
            m_pages = np.concatenate((m_pages, np.full(missing, -2, np.int64)))
            m_gens = np.concatenate((m_gens, np.zeros(missing, np.uint32)))
        pool = self.pool
        keep = (pages > PADDING_PAGE) & (pages < pool.limit)
        pages, m_pages, m_gens = pages[keep], m_pages[keep], m_gens[keep]
        if len(pages) == 0:
            return None
        pool.ensure(pages)
        reader = np.zeros(len(pages), np.int64)
        known, freed, foreign, unwritten, _ = self._judge_pages(
            pages, m_pages, m_gens, reader, np.array([req_key], np.uint64), count=False
        )
        if not (freed | foreign | unwritten).any():
            return None
        return ReadVerdict(info, pages[unwritten], pages[foreign], pages[freed], int(np.count_nonzero(~known)))

    def _judge_pages(self, pages, m_pages, m_gens, reader, req_keys, count: bool = True):
        """The read rules over read ``pages`` (ids in 0 < page < limit, the pool grown to hold
        them) against the readers' row entries (``m_pages``, ``m_gens`` as ``Row.gen_shared``;
        ``reader`` indexes ``req_keys``).
        Counts them (``count``) as read (state known) or unverified; returns per page the masks
        known, freed, foreign, unwritten and shared (a legitimately read prefix-cache page)."""
        pool = self.pool
        state = pool.state[pages]
        gen = pool.gen[pages]
        known = state != UNKNOWN
        if count:
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
    def _batch(self, req_keys: np.ndarray, seq_lens: np.ndarray) -> _Batch:
        """A forward's readers against the rows, for the whole batch at once (see ``_Batch``)."""
        idx = self.rows.indexes(req_keys)
        kernels = native.KERNELS
        if kernels is not None:  # the lines below in one call (kvguard.sidecar.native)
            m = len(idx)
            has, at, n = np.empty(m, bool), np.empty(m, np.int64), np.empty(m, np.int64)
            every = kernels.batch_rows(idx, seq_lens, self.rows.scalars.length, has, at, n, self.page_size)
            if every >= 0:
                return _Batch(idx, has, every == 1, idx if every else at, n)
        has = idx >= 0
        every = bool(has.all())
        at = idx if every else np.where(has, idx, 0)
        need = -(-seq_lens.astype(np.int64) // self.page_size)
        n = np.minimum(need, self.rows.scalars.length[at])
        return _Batch(idx, has, every, at, n)

    def _judged(self, req_keys: np.ndarray, batch: _Batch) -> np.ndarray | None:
        """Which readers are judged: a row, a HELLO, and the request's REQ_BEGIN seen (a key with
        a row is in the directory: the ASSIGN that made the row put it there, and the row goes
        when the request ends). None: every one of them."""
        if self.hello is None:
            return np.zeros(len(req_keys), bool)
        stubs = self.requests.stubs
        if batch.every and not stubs:
            return None
        judged = batch.has
        if stubs:
            judged = judged & ~np.isin(req_keys, np.fromiter(stubs, np.uint64, len(stubs)))
        return judged

    def _rows_as_modelled(
        self, batch: _Batch, req_keys: np.ndarray, read_counts: np.ndarray, read_pages: np.ndarray
    ) -> int | None:
        """Whether the engine's rows of a FORWARD are exactly the sidecar's model of them: every
        judged reader read as many pages as the model row covers, the same ones. Then judging
        the rows is judging the model. Returns the pages read by readers that are not judged
        (counted unverified), or None where anything differs. Per batch: the row lengths are
        compared as arrays and the model rows gathered by C-level passes."""
        judged = self._judged(req_keys, batch)
        rows = self.rows
        if judged is None:  # (the common case: every reader judged, nothing to select)
            if not native.array_equal(read_counts, batch.n):
                self._forget_seen(req_keys)
                return None
            for seen in self._rows_seen:
                if len(seen.keys) == len(req_keys) and native.array_equal(seen.keys, req_keys):
                    if self._rows_as_seen(seen, req_keys, batch, read_pages):
                        return 0
                    break
            unjudged = 0
            keys = req_keys.tolist()
            n, at = batch.n, batch.at
        else:
            rc = read_counts.astype(np.int64)
            n, at = batch.n[judged], batch.at[judged]
            if not np.array_equal(rc[judged], n):
                return None
            unjudged = int(rc[~judged].sum())
            keys = list(compress(req_keys.tolist(), judged.tolist()))
        parts = list(map(_ROW_PAGES, map(rows.row_of, keys)))  # (judged readers have rows)
        if not native.array_equal(n, rows.scalars.length[at]):  # rows read in part: only what they read
            parts = [pages[:k] for pages, k in zip(parts, n.tolist())]
        if unjudged:
            assert judged is not None  # (readers not judged: a selection)
            actual = read_pages[np.repeat(judged, read_counts.astype(np.int64))]
        else:
            actual = read_pages
        if len(parts) > 1:
            model = np.concatenate(parts, out=self._model_rows_buffer(int(n.sum())))
        else:
            model = parts[0] if parts else actual[:0]
        if len(actual) != len(model) or not native.array_equal(actual, model):
            return None
        if judged is None:
            self._remember_seen(_RowsSeen(req_keys, batch.n, rows.scalars.stamp[batch.at], read_pages))
        return unjudged

    def _model_rows_buffer(self, entries: int) -> np.ndarray:
        """Room for a batch's model rows, kept from one forward with rows to the next: a fresh
        array of a batch's 131k entries is 512 KiB of new memory, and its page faults cost
        about as much as gathering the rows into it. Kept up to ``_MODEL_ROWS_KEPT`` entries
        (a larger batch gets an array of its own, as before)."""
        if entries > _MODEL_ROWS_KEPT:
            return np.empty(entries, np.int32)
        if len(self._model_rows) < entries:
            self._model_rows = np.empty(min(max(entries, 2 * len(self._model_rows)), _MODEL_ROWS_KEPT), np.int32)
        return self._model_rows[:entries]

    def _remember_seen(self, seen: _RowsSeen) -> None:
        """Keep the rows of the last two batches that were the model (a decode step's batch and
        a prefill's between two of its steps), the newest first; the same batch's replaced."""
        self._forget_seen(seen.keys)
        self._rows_seen = [seen, *self._rows_seen[:1]]

    def _forget_seen(self, req_keys: np.ndarray) -> None:
        self._rows_seen = [
            s for s in self._rows_seen if len(s.keys) != len(req_keys) or not native.array_equal(s.keys, req_keys)
        ]

    def _rows_as_seen(self, seen: _RowsSeen, req_keys: np.ndarray, batch: _Batch, read_pages: np.ndarray) -> bool:
        """``_rows_as_modelled`` against the last forward whose rows were found to be the model,
        for the same batch (every reader judged): a row whose stamp (``RowScalars.touch``) and
        length read are unchanged since holds what it held, so the engine's row must be what it
        sent then; only the rows that changed are compared with the model. The same answer
        without gathering the whole batch's model rows (a decode step's batch changes a few
        rows between forwards). True: the rows are the model (remembered for the next forward)."""
        n = batch.n
        kernels = native.KERNELS
        if kernels is not None and len(seen.n) == len(n):  # the two lines below in one call
            stamps, changed = np.empty(len(n), np.int64), np.empty(len(n), np.int64)
            changed = changed[
                : kernels.rows_changed(batch.at, self.rows.scalars.stamp, seen.stamps, n, seen.n, stamps, changed)
            ]
        else:
            stamps = self.rows.scalars.stamp[batch.at]
            changed = np.flatnonzero((stamps != seen.stamps) | (n != seen.n))
        if len(changed) > _SEEN_CHANGED_MAX:  # comparing with the model at once is cheaper
            self._forget_seen(req_keys)
            return False
        same = -1  # the compiled comparisons (kvguard.sidecar.native): 1 equal, 0 not; -1 the numpy ones
        if kernels is not None and len(n):
            row_of = self.rows.row_of
            models = tuple(row_of(key).pages for key in req_keys[changed].tolist())
            same = kernels.rows_as_seen(read_pages, seen.actual, n, seen.n, changed, models)
        if same == 0 or same < 0 and not self._rows_equal(read_pages, seen, n, changed, req_keys):
            return False
        rest = [s for s in self._rows_seen if s is not seen]  # (this batch's entry is replaced)
        self._rows_seen = [_RowsSeen(req_keys, n, stamps, read_pages), *rest[:1]]
        return True

    def _rows_equal(
        self, actual: np.ndarray, seen: _RowsSeen, n: np.ndarray, changed: np.ndarray, req_keys: np.ndarray
    ) -> bool:
        """``_rows_as_seen``'s comparisons by numpy: the unchanged rows' stretches against the
        last forward's, each changed row against its model row."""
        before = seen.actual
        if not len(changed):
            return np.array_equal(actual, before)
        now_at = [0, *n.cumsum().tolist()]
        then_at = [0, *seen.n.cumsum().tolist()]
        row_of = self.rows.row_of
        start = 0  # the first row of the stretch of unchanged rows before the next changed one
        for i in changed.tolist():
            if i > start and not np.array_equal(actual[now_at[start] : now_at[i]], before[then_at[start] : then_at[i]]):
                return False
            if not np.array_equal(
                actual[now_at[i] : now_at[i + 1]], row_of(req_keys[i].item()).pages[: now_at[i + 1] - now_at[i]]
            ):
                return False
            start = i + 1
        return start >= len(n) or np.array_equal(actual[now_at[start] :], before[then_at[start] :])

    def _absorb_changes(self) -> None:
        """Replay the page-change log into the rows' clean prefixes (before judging a FORWARD)."""
        pool = self.pool
        if pool.changes_overflow:
            self._forget_all_clean()
            return
        if not pool.changes:
            return
        kernels = native.KERNELS
        if kernels is not None:  # the first look below in one call (kvguard.sidecar.native)
            seen = kernels.changes_scan(pool.changes, pool.clean_shared)
            if seen == 0:  # no changed page had an owner: nothing to replay
                pool.changes.clear()
                pool.changes_len = 0
                return
            if seen == 1:  # a page some row judged clean as a shared entry
                self._forget_all_clean()
                return
        # (typed here: ``changed_one`` logs lists, and int64 with uint64 would make floats)
        if len(pool.changes) == 1:
            pages, owners = np.asarray(pool.changes[0][0], np.int64), np.asarray(pool.changes[0][1], np.uint64)
        else:
            pages = np.concatenate([c[0] for c in pool.changes], dtype=np.int64)
            owners = np.concatenate([c[1] for c in pool.changes], dtype=np.uint64, casting="unsafe")  # (keys: >= 0)
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

    def _all_clean(
        self, keys: list[int], rows: list[Row], firsts: list[int], ends: list[int], bases: list[int], epoch: int
    ) -> bool:
        """The few row entries a decode step adds (a page that a request's token just started),
        judged by scalars: True when every one has nothing to report, and then they are
        counted and the rows' clean prefixes grown exactly as ``_classify_changed`` would.
        False (nothing done) at the first entry the rules could object to, or one the pool
        must grow for: the vectorized path judges the lot and writes the verdicts. The same
        rules as ``_judge_pages`` on a row's own entries (``m_pages`` are the pages)."""
        pool = self.pool
        state, gen, written_gen, owner_slot, owner_key = (
            pool.state,
            pool.gen,
            pool.written_gen,
            pool.owner_slot,
            pool.keys.keys,
        )
        num_pages = pool.num_pages
        counted: list[int] = []
        marks: list[int] = []
        for key, row, c, n in zip(keys, rows, firsts, ends):
            k = 0
            for p, g in zip(row.pages[c:n].tolist(), row.gen_shared[c:n].tolist()):
                if p <= PADDING_PAGE:  # padding or an entry never assigned: not read, nothing to report
                    continue
                if p >= num_pages:  # out of range, or the pool grows for it: the vectorized path
                    return False
                st = state[p]
                if st == UNKNOWN or st == FREE:  # not judged, or read after its free
                    return False
                page_gen = gen[p]
                if g & _GEN_MASK != page_gen or written_gen[p] != page_gen:  # another gen's, or unwritten
                    return False
                if g < _SHARED_BIT:
                    if st != OWNED or owner_key[owner_slot[p]] != key:  # not the reader's own
                        return False
                else:  # a prefix-cache entry judged clean (``PagePool.clean_shared``)
                    marks.append(p)
                k += 1
            counted.append(k)
        self.pages_read += sum(counted)
        if marks:
            pool.clean_shared[marks] = True
        table = self.rows.scalars
        for row, n, base, k in zip(rows, ends, bases, counted):
            i = row.index
            table.clean_epoch[i] = epoch
            table.clean_n[i] = n
            table.clean_reads[i] = base + k
        return True

    def _clean_split(self, batch: _Batch, epoch: int) -> tuple[int, list[int], tuple[list[int], ...]]:
        """A batch's readers with a row, split by their clean prefixes: the clean reads of those
        whose prefix covers exactly what they read, those whose prefix covers more (``shorter``)
        and the dirty ones (batch index, clean_n, entries read, clean_epoch: lists)."""
        table, at, n_all, has = self.rows.scalars, batch.at, batch.n, batch.has
        kernels = native.KERNELS
        if kernels is not None:  # the lines below in one call (kvguard.sidecar.native)
            clean_reads, shorter, *dirty = kernels.clean_rows(
                at, has, n_all, table.clean_n, table.clean_epoch, table.clean_reads, epoch
            )
            return clean_reads, shorter, tuple(dirty)
        c_all = table.clean_n[at]
        # rows whose clean prefix covers what this step reads (the common decode step): counted,
        # not judged. A clean prefix was judged while its reader was known, and a row goes when
        # its request ends, so these readers are known ones.
        clean = (table.clean_epoch[at] == epoch) & (c_all >= n_all)
        if not batch.every:
            clean &= has
        exact = clean & (c_all == n_all)
        clean_reads = int(table.clean_reads[at[exact]].sum())
        dirty_at = np.flatnonzero(~clean if batch.every else has & ~clean)
        shorter_at: list[int] = []
        if len(dirty_at) + int(np.count_nonzero(exact)) != len(at):  # (a shorter prefix: rare)
            shorter_at = np.flatnonzero(clean & ~exact).tolist()
        dirty = (
            dirty_at.tolist(),
            c_all[dirty_at].tolist(),
            n_all[dirty_at].tolist(),
            table.clean_epoch[at[dirty_at]].tolist(),
        )
        return clean_reads, shorter_at, dirty

    def _classify_changed(self, batch: _Batch, req_keys: np.ndarray) -> list[tuple[int, ReadVerdict]]:
        """``classify_reads`` for a FORWARD without rows, judging per request only the row
        entries past its clean prefix (``Row.clean_n``). The clean prefix holds nothing to report
        and its pages count as read (judged known, unchanged since); the rest goes through the
        same rules (``_judge_pages``), and the prefix grows to the first entry with something to
        report. Same verdicts, counts and ``pages_out_of_range`` as the full judge."""
        self._absorb_changes()
        if self.hello is None:
            return []  # nobody is judged; without rows nothing counts as unverified either
        # requests without a row are not judged (nothing was assigned to them: nothing they
        # read is modelled)
        has, at, n_all = batch.has, batch.at, batch.n
        if not batch.every and not has.any():
            return []
        table = self.rows.scalars
        epoch = self.judge_epoch
        clean_reads, shorter, dirty = self._clean_split(batch, epoch)
        if not shorter and not dirty[0]:
            self.pages_read += clean_reads
            return []
        keys = req_keys.tolist()
        rows_get = self.rows.get
        for i in shorter:  # reads a shorter prefix than judged clean
            row = rows_get(keys[i])
            assert row is not None  # (the row table's index and rows hold the same keys)
            clean_reads += int(np.count_nonzero(row.pages[: int(n_all[i])] > 0))
        if not dirty[0]:
            self.pages_read += clean_reads
            return []
        live_get, ended_get = self.requests.live.get, self.requests._ended.get  # RequestDirectory.get, inlined
        # per dirty request: its index in the batch, its row, the first entry to judge, the
        # entries read, the clean reads before it
        d_i: list[int] = []
        d_rows: list[Row] = []
        d_c: list[int] = []
        d_n: list[int] = []
        d_base: list[int] = []
        for i, c, n, e in zip(*dirty):
            key = keys[i]
            info = live_get(key) or ended_get(key)
            if info is None or not info.known:
                continue
            row = rows_get(key)
            assert row is not None
            if e == epoch:
                base = row.clean_reads
                clean_reads += base
            else:
                c = base = 0
            d_i.append(i)
            d_rows.append(row)
            d_c.append(c)
            d_n.append(n)
            d_base.append(base)
        self.pages_read += clean_reads
        if not d_i:
            return []
        if sum(d_n) - sum(d_c) <= _SCALAR_ENTRIES and self._all_clean(
            [keys[i] for i in d_i], d_rows, d_c, d_n, d_base, epoch
        ):
            return []
        if len(d_i) == 1:
            row, c, n = d_rows[0], d_c[0], d_n[0]
            # (int32 row pages widened once here, not by every gather that indexes with them)
            pages_all, gens_all = row.pages[c:n].astype(np.int64), row.gen_shared[c:n]
        else:
            pages_all = np.concatenate([r.pages[c:n] for r, c, n in zip(d_rows, d_c, d_n)], dtype=np.int64)
            gens_all = np.concatenate([r.gen_shared[c:n] for r, c, n in zip(d_rows, d_c, d_n)])
        idx = np.array(d_i, np.int64)
        c_arr = np.array(d_c, np.int64)
        seg_len = np.array(d_n, np.int64) - c_arr
        seg = np.repeat(np.arange(len(d_i)), seg_len)  # dirty request of each entry
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
        bad_at = np.flatnonzero(bad)
        counted_pages = pages_all > 0
        marks = counted_pages & (gens_all >= SHARED_BIT)
        if len(bad_at) == 0 and seg_len.all():  # every dirty entry clean (the usual): whole segments
            good_len = seg_len
            newly_counted = np.add.reduceat(counted_pages, np.cumsum(seg_len) - seg_len, dtype=np.int64)
        else:
            starts = np.concatenate(([0], np.cumsum(seg_len)))
            good_len = seg_len.copy()  # per dirty request: entries clean from its first one on
            who, first = np.unique(seg[bad_at], return_index=True)
            good_len[who] = bad_at[first] - starts[who]
            counted = np.concatenate(([0], np.cumsum(counted_pages)))
            newly_counted = counted[starts[:-1] + good_len] - counted[starts[:-1]]
            marks &= np.arange(len(pages_all)) < (starts[:-1] + good_len)[seg]
        if marks.any():
            pool.clean_shared[pages_all[marks]] = True
        # (a request twice in a batch: the same values, either write wins)
        rows_at = at[idx]
        table.clean_epoch[rows_at] = epoch
        table.clean_n[rows_at] = c_arr + good_len
        table.clean_reads[rows_at] = np.array(d_base, np.int64) + newly_counted
        if not look.any():
            return []
        out = []
        off = np.searchsorted(seg_k, np.arange(len(d_i) + 1)).tolist()
        for j in np.unique(seg_k[look]).tolist():
            i, row, c = d_i[j], d_rows[j], d_c[j]
            s, e = off[j], off[j + 1]
            p = pages[s:e]
            head = row.pages[:c]
            shared_pages = p[shared[s:e]]
            if c:  # the clean prefix's legitimately read prefix-cache pages belong to the verdict too
                shared_pages = np.concatenate((head[(row.gen_shared[:c] >= SHARED_BIT) & (head > 0)], shared_pages))
            info = self.requests.get(int(req_keys[i]))
            assert info is not None  # a dirty reader was found in the directory above
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

"""Per-page content identity on the page model (PAGE_IDENTITY, contract 1.6). No I/O.

The engine (``KVGUARD_PAGE_IDENTITY``, engine_hooks/page_identity.py) reports, per request,
the content identity of its full row pages: ``written`` for the pages its forwards filled,
``hit`` for the prefix-cache pages it was handed, each computed from the request's own
tokens. Both name row pages, not page ids: the request's row (``EngineTracker.rows``, from
the ASSIGN that precedes the record) says which page each one is.

- ``written``: each page takes the identity for its current allocation (``PagePool.gen``);
  a row entry that no longer names the page's current allocation (reallocated since, or a
  stale row), a page free or unknown (a gap), or padding records nothing.
- ``hit``: each page whose identity was recorded for its current allocation is judged; one
  that differs from the reader's holds another prefix or other positions than the reader's
  prompt (``PrefixContentMismatch``, the ``prefix_content_mismatch`` finding). A page with no
  identity for its current allocation (never recorded: written before the feature was on, by
  another engine and received by a transfer, loaded as part of a stored object, or never
  full; recorded for an older allocation; unknown since a gap) is never judged: it is
  counted as ``unknown``.
- loads (sidecar/offload.py): a store keeps its pages' identities with the object, and a load
  of the whole object gives each page it fills the identity (and its writer) of the object's
  page there (``carry_loaded``): a lookup handed another prefix's object is judged at its hit.

Each identity keeps whose tokens it is of (``PagePool.identity_writer``): the writer of the
page, or of the stored object's page a load brought back; a mismatch names them.

Identities are per engine process (the engine's salt): the model of one engine only ever
compares ids of that engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvguard.engine_hooks import wire

from .events import PrefixContentMismatch
from .page_pool import FREE, GEN_MASK, PADDING_PAGE, UNKNOWN, PagePool
from .rows import RowTable


@dataclass(slots=True)
class IdentityCounts:
    """Pages of PAGE_IDENTITY records, by what became of them."""

    recorded: int = 0  # written: identity kept for the page's allocation
    loaded: int = 0  # a load of a whole stored object: the object's identity given to the page it filled
    matched: int = 0  # hit: judged, the reader's identity equals the page's
    mismatched: int = 0  # hit: judged, they differ (a finding)
    unknown: int = 0  # not recorded / not judged: no row entry, reallocated, unknown state, none recorded

    def as_dict(self) -> dict[str, int]:
        return {
            "recorded": self.recorded,
            "loaded": self.loaded,
            "matched": self.matched,
            "mismatched": self.mismatched,
            "unknown": self.unknown,
        }


def _row_pages(pool: PagePool, rows: RowTable, body: wire.PageIdentity) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(index into ``body.ids``, row page index, page) of the entries that name the current
    allocation of a real page in a known, not free state."""
    row = rows.get(body.req_key)
    n = len(body.ids)
    if row is None or n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = int(body.first_row_page)
    stop = min(first + n, len(row.pages))
    if stop <= first:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    index = np.arange(first, stop)
    pages = row.pages[first:stop].astype(np.int64)
    gens = row.gens[first:stop]
    ok = (pages > PADDING_PAGE) & (pages < pool.num_pages)
    safe = np.where(ok, pages, 0)
    ok &= (pool.gen[safe] & GEN_MASK) == gens
    state = pool.state[safe]
    ok &= (state != UNKNOWN) & (state != FREE)
    return index[ok] - first, index[ok], pages[ok]


def record_written(pool: PagePool, rows: RowTable, body: wire.PageIdentity, counts: IdentityCounts) -> None:
    """A request's own full pages: their identity for their current allocation."""
    pool.enable_identity()
    assert pool.identity is not None and pool.identity_gen is not None
    assert pool.identity_writer is not None
    at, _index, pages = _row_pages(pool, rows, body)
    pool.identity[pages] = body.ids[at]
    pool.identity_gen[pages] = (pool.gen[pages] & GEN_MASK) + np.uint32(1)
    pool.identity_writer[pages] = body.req_key
    counts.recorded += len(pages)
    counts.unknown += len(body.ids) - len(pages)


def stored_identities(pool: PagePool, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The identities of ``pages`` (device pages a store copied out), for the stored object:
    (ids, whose tokens, known) per page; None when the engine sends no identities or none of
    the pages has one recorded for its current allocation."""
    if pool.identity is None or pool.identity_gen is None or pool.identity_writer is None or not len(pages):
        return None
    known = pool.identity_gen[pages] == (pool.gen[pages] & GEN_MASK) + np.uint32(1)
    if not known.any():
        return None
    return pool.identity[pages].copy(), pool.identity_writer[pages].copy(), known


def carry_loaded(
    pool: PagePool, pages: np.ndarray, stored: tuple[np.ndarray, np.ndarray, np.ndarray], counts: IdentityCounts
) -> None:
    """A load of a whole stored object into ``pages`` (its destination, in the object's page
    order): each page holds what the object's page there held, so it takes that page's identity
    for its current allocation, and that identity's writer. Pages the object had none for
    keep none."""
    ids, writers, known = stored
    if len(pages) != len(ids):
        return  # (not the object's pages one for one: nothing is carried)
    pool.enable_identity()
    assert pool.identity is not None and pool.identity_gen is not None and pool.identity_writer is not None
    at = pages[known]
    pool.identity[at] = ids[known]
    pool.identity_gen[at] = (pool.gen[at] & GEN_MASK) + np.uint32(1)
    pool.identity_writer[at] = writers[known]
    counts.loaded += len(at)


def judge_hit(
    pool: PagePool, rows: RowTable, body: wire.PageIdentity, reader, counts: IdentityCounts
) -> PrefixContentMismatch | None:
    """Prefix-cache pages handed to ``reader`` (its RequestInfo, None when unknown): those whose
    recorded identity differs from the reader's, with their last writers; None when all that
    could be judged matched (or nothing could)."""
    pool.enable_identity()
    assert pool.identity is not None and pool.identity_gen is not None
    at, index, pages = _row_pages(pool, rows, body)
    known = pool.identity_gen[pages] == (pool.gen[pages] & GEN_MASK) + np.uint32(1)
    at, index, pages = at[known], index[known], pages[known]
    counts.unknown += len(body.ids) - len(pages)
    differ = pool.identity[pages] != body.ids[at]
    bad = int(np.count_nonzero(differ))
    counts.matched += len(pages) - bad
    counts.mismatched += bad
    if not bad or reader is None:
        return None
    bad_pages = pages[differ]
    assert pool.identity_writer is not None
    # whose tokens the page's identity is of: its writer, or the writer of the stored object a
    # load brought it back from (the loader wrote the page, the KV is the object's)
    return PrefixContentMismatch(reader, index[differ], bad_pages, pool.identity_writer[bad_pages], len(pages))

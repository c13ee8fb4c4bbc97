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
  another engine and loaded from a tier or a transfer, or never full; recorded for an older
  allocation; unknown since a gap) is never judged: it is counted as ``unknown``.

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
    matched: int = 0  # hit: judged, the reader's identity equals the page's
    mismatched: int = 0  # hit: judged, they differ (a finding)
    unknown: int = 0  # not recorded / not judged: no row entry, reallocated, unknown state, none recorded

    def as_dict(self) -> dict[str, int]:
        return {
            "recorded": self.recorded,
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
    at, _index, pages = _row_pages(pool, rows, body)
    pool.identity[pages] = body.ids[at]
    pool.identity_gen[pages] = (pool.gen[pages] & GEN_MASK) + np.uint32(1)
    counts.recorded += len(pages)
    counts.unknown += len(body.ids) - len(pages)


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
    return PrefixContentMismatch(reader, index[differ], bad_pages, pool.last_writer[bad_pages], len(pages))

"""A hybrid sliding-window engine (GPT-OSS, ...): the SWA pool as a pool of its own.

SGLang's ``SWATokenToKVPoolAllocator`` drives two sub-allocators in step: ``full_attn_allocator``
over the full-attention layers' pool (whose slots are what ``req_to_token`` holds) and
``swa_attn_allocator`` over the window layers' pool (``SWAKVPool.swa_kv_pool``). Each full slot
has a SWA twin, ``full_to_swa_index_mapping[slot]`` (0: none: never paired, or released), at the
same offset in its page. The window layers write a forward's tokens at the twins of its
``out_cache_loc`` and read the twins of the last ``W`` positions (``sliding_window_size``);
SWA pages behind the window are freed while the request lives (``maybe_evict_swa`` before an
allocation, the radix tree's tombstones), with no request named at the free.

The adapter declares the SWA pool as pool ``State.swa_pool`` (``POOL kind=sliding_window``, its
page ids are the SWA sub-allocator's) and keeps, per request, a row in it:

* allocations and frees: the class hooks of hooks_allocator.py fire for both sub-allocators;
  ``_runtime.pool_of`` tells them apart by instance;
* rows: every time a pool-0 row goes out (hooks_rows.py: ``alloc_for_extend``,
  ``alloc_for_decode``, ``ReqToTokenPool.write``) its twin goes out too: the same positions
  through the mapping, at that moment;
* the window: after each forward (and at a new row, and before ``alloc_for_decode`` /
  ``alloc_for_extend``, which run SGLang's own eviction) the row's positions below the window
  of the request's next forward (``floor((q0 - W) / page) * page``, ``q0`` its first computed
  position) are pointed at page 0, which is never judged. Every SWA page SGLang frees on purpose is below that bound
  (its eviction threshold is ``q0 - ceil(max(W, page) / page) * page``, page-floored; the tree
  frees only unlocked windows), so a free is never under a reader; a page freed inside the
  window, or handed to another request while the mapping still names it, is: the reader's next
  SWA read finds it free or another's;
* forwards: after pool 0's, a FORWARD on the SWA pool with the same lengths, the twins of the
  written slots, and (when the row sampler is due) the engine's rows translated, nulled below
  the bound as the model is.

Verified on 0.5.23 unified engines (coverage.py ``SWA_VERIFIED_VERSIONS``); the per-request SWA
ring, unified memory, pure-SWA models, speculative decoding, HiCache and prefill/decode roles
are declared unwatched there.
"""

from __future__ import annotations

import numpy as np

from . import _runtime as rt
from ._runtime import State


def translate(full_slots) -> np.ndarray:
    """The SWA twins (int64 numpy) of full-pool slots, through the engine's mapping: on a host
    pool a numpy view of the engine's own tensor (the engine updates it in place, the view
    sees it; a torch gather costs ~7 µs of dispatch whatever its size), on a device one gather
    and one copy to the host."""
    host = State.swa_mapping_host
    if host is not None:
        return host[np.asarray(full_slots, np.int64)]  # (fancy indexing: a copy)
    import torch

    mapping = State.swa_mapping
    idx = full_slots if isinstance(full_slots, torch.Tensor) else torch.as_tensor(np.asarray(full_slots))
    if idx.numel() == 0:
        return np.zeros(0, np.int64)
    return rt.host_int64(mapping[idx.to(mapping.device).long()], copy=True)


def _bound(q0: int) -> int:
    """The page-aligned position below which the forward computing from ``q0`` reads no SWA."""
    ps = State.page_size
    return (max(q0 - State.swa_window, 0) // ps) * ps


def null_below_window(rids, first_positions, one_step: bool = False) -> None:
    """Point each request's SWA row at page 0 below the window of its coming forward (whose
    first computed position is ``first_positions[i]``), where that bound moved.

    ``one_step``: every request's bound is already the one of ``first_positions[i] - 1`` (a
    decode step after a forward), so it moves only where ``q0 - W`` reaches a page start: a
    vector test, then the dictionary for those few (one request in ``page_size`` per step)."""
    n = len(rids)
    if n == 0:
        return
    ps, window = State.page_size, State.swa_window
    q0 = np.asarray(first_positions, np.int64)[:n]
    if one_step:
        candidates = np.flatnonzero(((q0 - window) % ps == 0) & (q0 > window))
        if len(candidates) == 0:
            return
    else:
        candidates = np.arange(n)
    nulled = State.swa_nulled
    p = rt.probes()
    pool = State.swa_pool
    one_page: list = []  # (rid, position): a bound that moved by one page, the usual decode case
    for i in candidates.tolist():
        rid = rids[i]
        old = nulled.get(rid)
        if old is None:
            continue  # no SWA row sent for it (yet): its first ASSIGN sets the bound
        new = _bound(int(q0[i]))
        if new <= old:
            continue
        if new - old == ps:
            one_page.append((rid, old))
        else:
            p.row_pages_assigned(rid, old, new, old, [0] * ((new - old) // ps), pool=pool)
        nulled[rid] = new
    if one_page:  # one ASSIGN each (page index old // ps -> page 0), written under one ring lock
        moved_rids, positions = zip(*one_page)
        p.decode_rows_assigned(moved_rids, positions, [0] * len(positions), pool=pool)


def extend_twins(reqs, held, prefix_lens, seq_lens, block) -> None:
    """After ``alloc_for_extend``: each request's SWA row twin of what hooks_rows sent for pool 0
    (``block``: their req_to_token rows on the host). A new row starts at 0, nulled below the
    window of this extend (``q0`` = its prefix); a later chunk continues from its prefix."""
    p = rt.probes()
    pool = State.swa_pool
    for i, r in enumerate(reqs):
        prefix, seq = prefix_lens[i], seq_lens[i]
        if held[i]:
            start, bound = prefix, State.swa_nulled.get(r.rid, 0)
        else:
            start, bound = 0, _bound(prefix)
            State.swa_nulled[r.rid] = bound
        if seq <= start:
            continue
        twins = translate(block[i, start:seq])
        if bound > start:
            twins[: bound - start] = 0
        p.rows_assigned(r.rid, start, seq, prefix, twins, pool=pool)


def decode_twins(rids, positions, full_slots) -> None:
    """After ``alloc_for_decode``: the SWA twins of the new page-starting slots."""
    rt.probes().decode_rows_assigned(rids, positions, translate(full_slots), pool=State.swa_pool)


def write_twin(rid, start: int, stop: int, shared_until: int, values) -> None:
    """A ``ReqToTokenPool.write`` of positions ``[start, stop)`` (a radix rebind onto the tree's
    slots, ...): their twins, page 0 below the request's nulled bound (the tree may free those)."""
    bound = State.swa_nulled.get(rid)
    if bound is None:
        return
    twins = translate(values)
    if bound > start:
        twins[: bound - start] = 0
    rt.probes().rows_assigned(rid, start, stop, shared_until, twins, pool=State.swa_pool)


def forget(rid: str) -> None:
    State.swa_nulled.pop(rid, None)


def forward(rids, seq_lens, counts, out, read_pages, read_counts) -> None:
    """The SWA pool's FORWARD of a batch, after pool 0's: the same lengths, the twins of the
    written slots; when pool 0 sent the engine's rows (``read_pages``: the pages at each row's
    page-start positions), their twins, page 0 below each request's bound. Then each row's
    bound moves to the window of the request's next forward (its first position: this one's
    ``seq_len``): whatever SGLang frees before that forward is below it."""
    ps = State.page_size
    written = translate(out) if len(out) else out
    swa_pages = None
    if read_pages is not None:
        swa_pages = translate(np.asarray(read_pages, np.int64) * ps) // ps
        get = State.swa_nulled.get
        counts_read = np.asarray(read_counts, np.int64)
        below = np.fromiter((get(rid, 0) for rid in rids), np.int64, count=len(rids)) // ps
        # each row page's index within its request's row; page 0 where it is below the bound
        index_in_row = np.arange(len(swa_pages)) - np.repeat(np.cumsum(counts_read) - counts_read, counts_read)
        swa_pages[index_in_row < np.repeat(below, counts_read)] = 0
    rt.probes().forward(
        rids,
        seq_lens,
        written,
        written_counts=counts,
        read_pages=swa_pages,
        read_counts=read_counts if swa_pages is not None else None,
        pool=State.swa_pool,
    )
    decode = len(counts) > 0 and bool((counts == 1).all())
    null_below_window(rids, seq_lens, one_step=decode)

"""Mamba / linear-attention state slots (Qwen3-Next, Nemotron-H, ...) as a pool of their own.

A hybrid linear-attention model keeps, beside the token KV pages of its full-attention layers,
one recurrent state per request: a slot of ``MambaPool`` (``conv`` and ``temporal`` per layer),
handed out by ``MambaSlotAllocator`` and found through ``HybridReqToTokenPool``'s
``req_index_to_mamba_index_mapping``. The slot is read and overwritten in place by every
forward of its request. A slot handed to the wrong request is the same leak as a KV page: the
reader continues from another tenant's state.

The adapter declares the slots as pool ``State.state_pool`` (``POOL kind=state``, one token per
page, page ids = slot ids; hooks_requests.py at HELLO, when coverage.py found the layout it
follows) and reports:

* ALLOC: ``MambaSlotAllocator._do_alloc`` (the group pre-allocation ``alloc_group_begin`` and
  ``alloc`` both take slots there; hooking ``alloc`` alone would miss the pre-allocated ones
  and then see ``alloc_group_end`` return slots never seen allocated);
* FREE: ``MambaSlotAllocator.free`` (a request's release or retraction, the radix tree's
  eviction of a cached state, ``alloc_group_end`` returning unused ones) and ``clear``;
* ASSIGN: a request's row in the pool is one entry, position 0 -> its slot, sent from
  ``alloc_for_extend`` (hooks_rows.py) when the request is (re)admitted or its slot changed;
* FORWARD: per forward, each request of the batch writes and then reads its slot (the order
  FORWARD judges in). The slot written is the adapter's model (the slot last assigned);
  the slot read is the engine's own mapping when the row sampler is due
  (engine_hooks/row_sampler.py), else the model's row.

Slot 0 is the padding target of padded batch rows (``MambaSlotAllocator.clear``): never handed
out, never reported. A finished request's slot usually goes to the radix tree (no FREE): the
sidecar turns it cached at REQ_END, as it does the request's KV pages, and the tree's later
eviction frees it with no request attached.

Not modelled here (coverage.py keeps these engines unwatched or says what is not followed):
the copy-on-write of a tree state into a request's slot at a prefix hit and the checkpoint
copies into tree slots (copies outside a forward), ``extra_buffer`` ping-pong slots, the int8
checkpoint pool, speculative decoding's state rollback, prefill/decode transfer of state.
"""

from __future__ import annotations

import numpy as np

from . import _runtime as rt
from ._runtime import State


def _mine(alloc) -> bool:
    return State.state_pool != 0 and alloc is State.state_allocator and State.hello_done


# --------------------------------------------------------------------------- allocator
def _do_alloc_post(result, self, *args, **kwargs):
    if result is None or not _mine(self) or result.numel() == 0:
        return
    slots = rt.host_int64(result)
    rt.probes().page_ids_allocated(slots[slots > 0].tolist(), pool=State.state_pool)


def do_alloc_hook(name: str):
    return rt.after(name, _do_alloc_post)


def _free_pre(self, *args, **kwargs):
    if not _mine(self):
        return None
    free_index = args[0] if args else kwargs.get("free_index")
    if free_index is None or not hasattr(free_index, "numel") or free_index.numel() == 0:
        return None
    return rt.host_int64(free_index, copy=True)  # a copy: the engine owns the tensor


def _free_post(slots, result, self, *args, **kwargs):
    if slots is not None:
        slots = slots[slots > 0]
        if len(slots):
            rt.probes().pages_freed(slots, "page_ids", pool=State.state_pool)


def free_hook(name: str):
    return rt.around(name, _free_pre, _free_post)


def _clear_pre(self, *args, **kwargs):
    """Every slot not free before ``clear()`` becomes free (flush_cache)."""
    if not _mine(self):
        return None
    free_now = rt.host_int64(self.free_slots)
    return np.setdiff1d(np.arange(1, int(self.size) + 1, dtype=np.int64), free_now)


def _clear_post(allocated, result, self, *args, **kwargs):
    if allocated is not None and len(allocated):
        rt.probes().pages_freed(allocated, "page_ids", pool=State.state_pool)


def clear_hook(name: str):
    return rt.around(name, _clear_pre, _clear_post)


# --------------------------------------------------------------------------- rows
def assign(reqs, held: list) -> None:
    """Each request's state row, position 0 -> its slot, after ``alloc_for_extend``: on a
    (re)admission (``held[i]`` false: a retracted request may get back the slot number it
    had, freed and allocated again in between) or when the slot changed. Requests are begun
    (hooks_rows.py) before this runs."""
    p = rt.probes()
    for i, r in enumerate(reqs):
        slot = getattr(r.kv, "mamba_pool_idx", None)
        if slot is None:
            continue
        slot = int(slot)
        if held[i] and State.state_slot.get(r.rid) == slot:
            continue
        State.state_slot[r.rid] = slot
        p.row_pages_assigned(r.rid, 0, 1, 0, (slot,), pool=State.state_pool)


def forget(rid: str) -> None:
    """The request ended: its slot is the tree's or free (bookkeeping only)."""
    State.state_slot.pop(rid, None)


# --------------------------------------------------------------------------- forward
def forward(runner, fb, rids, sampled: bool) -> None:
    """Pool ``State.state_pool``'s FORWARD for the batch: each request with a known slot writes
    it and reads it (one page each). ``sampled``: read the engine's own mapping too."""
    slot_of = State.state_slot
    slots = [slot_of.get(rid, 0) for rid in rids]
    keep = [i for i, s in enumerate(slots) if s > 0]
    if not keep:
        return
    n = len(rids)
    ones = np.ones(len(keep), np.int64)
    written = np.fromiter((slots[i] for i in keep), np.int64, count=len(keep))
    read_pages = read_counts = None
    if sampled:
        mapping = runner.req_to_token_pool.req_index_to_mamba_index_mapping
        rows = fb.req_pool_indices[:n]
        engine_slots = rt.host_int64(mapping[rows.to(mapping.device).long()])
        read_pages, read_counts = engine_slots[keep], ones
    kept_rids = rids if len(keep) == n else [rids[i] for i in keep]
    rt.probes().forward(
        kept_rids,
        ones,
        written,
        written_counts=ones,
        read_pages=read_pages,
        read_counts=read_counts,
        pool=State.state_pool,
    )

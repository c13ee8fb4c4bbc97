"""Token-to-KV allocator hooks: pages_allocated / pages_freed.

SGLang's allocators hand out *token slots*; page = slot // page_size. Page 0 (slot
0 .. page_size-1) is never handed out: it is the padding target of dummy/padded
writes.

Allocation: ``alloc`` (page-aligned, whole pages) and, on paged allocators,
``alloc_extend`` / ``alloc_decode``, which do not go through ``alloc``. Their
result also contains slots in the request's already-owned, partially filled last
page; only slots at offset 0 of a page start a *new* page, so exactly those are
reported (``slots[slots % page_size == 0]``).

Free: ``free`` (slots; a paged allocator frees every page touched),
``free_segment`` (a kv-row segment), ``free_page_ids`` (page ids, 0.5.23). Inside
``free_group_begin() .. free_group_end()`` frees are queued, not returned to the
free list; they are reported at ``free_group_end`` with kind "group". ``clear``
(flush_cache / resize) returns every page: the pages that were not free before
are reported as freed (kind "page_ids").
"""

from __future__ import annotations

from . import _runtime as rt
from ._runtime import State


def _is_tensor(x) -> bool:
    return hasattr(x, "numel") and hasattr(x, "detach")


# --------------------------------------------------------------------------- alloc
def _alloc_pre(self, *args, **kwargs):
    return rt.depth("alloc") == 0


def _alloc_post(outer, result, self, *args, **kwargs):
    if not outer or not State.hello_done or result is None or not _is_tensor(result):
        return
    if result.numel() == 0:
        return
    ps = int(getattr(self, "page_size", 1) or 1)
    slots = rt.host_int64(result)  # numpy on the host: cheaper than torch ops on a few hundred slots
    new_page_slots = slots if ps == 1 else slots[slots % ps == 0]
    if len(new_page_slots):
        pool = rt.pool_of(self)
        if pool:
            rt.probes().page_ids_allocated((new_page_slots // ps).tolist(), pool=pool)
        else:
            rt.probes().pages_allocated(new_page_slots, page_starts=ps > 1)


def alloc_hook(name: str):
    return rt.around(name, _alloc_pre, _alloc_post, cats=("alloc",))


# --------------------------------------------------------------------------- free
def _grouping(alloc) -> bool:
    return getattr(alloc, "free_group", None) is not None


def _free_pre(self, *args, **kwargs):
    # outer call, not queued in a free group
    return rt.depth("free") == 0 and not _grouping(self)


def _first_arg(args, kwargs, key):
    return args[0] if args else kwargs.get(key)


def _free_slots_post(emit, result, self, *args, **kwargs):
    if not emit or not State.hello_done:
        return
    slots = _first_arg(args, kwargs, "free_index")
    if slots is None or not _is_tensor(slots) or slots.numel() == 0:
        return
    rt.probes().pages_freed(slots, rt.free_kind_override() or "free", pool=rt.pool_of(self))


def _free_page_ids_post(emit, result, self, *args, **kwargs):
    if not emit or not State.hello_done:
        return
    page_ids = _first_arg(args, kwargs, "page_ids")
    if page_ids is None or not _is_tensor(page_ids) or page_ids.numel() == 0:
        return
    kind = rt.free_kind_override()
    pool = rt.pool_of(self)
    if kind is None:
        rt.probes().pages_freed(page_ids, "page_ids", pool=pool)
    else:  # e.g. "deferred": that kind takes slots
        rt.probes().pages_freed(page_ids * int(self.page_size), kind, pool=pool)


def free_hook(name: str):
    return rt.around(name, _free_pre, _free_slots_post, cats=("free",))


def free_page_ids_hook(name: str):
    return rt.around(name, _free_pre, _free_page_ids_post, cats=("free",))


# free_group_end: what was queued since free_group_begin, captured before the
# flush. Slot lists: ``free_group`` (all versions), ``free_page_reps_group``
# (0.5.19 paged free_segment); page-id list: ``free_page_ids_group`` (0.5.23).
_GROUP_SLOT_LISTS = ("free_group", "free_page_reps_group")
_GROUP_PAGE_ID_LISTS = ("free_page_ids_group",)


def _group_end_pre(self, *args, **kwargs):
    if rt.depth("free") != 0:
        return None
    slots: list = []
    for attr in _GROUP_SLOT_LISTS:
        slots.extend(getattr(self, attr, None) or [])
    page_ids: list = []
    for attr in _GROUP_PAGE_ID_LISTS:
        page_ids.extend(getattr(self, attr, None) or [])
    return slots, page_ids


def _group_end_post(pending, result, self, *args, **kwargs):
    if pending is None or not State.hello_done:
        return
    import torch

    slots, page_ids = pending
    parts = [s.reshape(-1) for s in slots if s.numel()]
    ps = int(getattr(self, "page_size", 1) or 1)
    parts += [(p.reshape(-1) * ps) for p in page_ids if p.numel()]
    if parts:
        rt.probes().pages_freed(torch.cat(parts), rt.free_kind_override() or "group", pool=rt.pool_of(self))


def free_group_end_hook(name: str):
    return rt.around(name, _group_end_pre, _group_end_post, cats=("free",))


# clear(): every page becomes free at once.
def _free_page_ids_now(alloc):
    import numpy as np

    parts = []
    for attr in ("free_pages", "release_pages"):
        t = getattr(alloc, attr, None)
        if t is not None and _is_tensor(t) and t.numel():
            parts.append(t.detach().cpu().numpy().reshape(-1))
    for t in getattr(alloc, "staged_pages", None) or []:
        if _is_tensor(t) and t.numel():
            parts.append(t.detach().cpu().numpy().reshape(-1))
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _clear_pre(self, *args, **kwargs):
    if not State.hello_done or rt.depth("free") != 0:
        return None
    import numpy as np

    ps = int(getattr(self, "page_size", 1) or 1)
    num_pages = int(getattr(self, "num_pages", 0) or (int(self.size) // ps))
    free_now = _free_page_ids_now(self)  # page ids (== slots on the page_size 1 allocator)
    allocated = np.setdiff1d(np.arange(1, num_pages + 1, dtype=np.int64), free_now, assume_unique=True)
    return allocated


def _clear_post(allocated, result, self, *args, **kwargs):
    if allocated is not None and len(allocated):
        rt.probes().pages_freed(allocated, "page_ids", pool=rt.pool_of(self))


def clear_hook(name: str):
    return rt.around(name, _clear_pre, _clear_post, cats=("free",))

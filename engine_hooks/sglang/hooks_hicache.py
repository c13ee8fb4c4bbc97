"""HiCache (SGLang's hierarchical cache): KV copied between the device pool and the host
pool -> KV_STORE / KV_LOAD (wire contract 1.1; judged by sidecar/offload.py).

Why: a load-back writes device pages outside any forward. Unseen, the pages it fills
look never written, and every request that reads a prefix loaded back from the host
would be an ``unwritten_read`` (seen on a real 0.5.23 engine before these hooks); and a
load-back that lands in pages freed or handed on meanwhile (SGLang #31427 / #30321), or
a backup of pages that hold no KV of their current allocation, would go unjudged.

Where (0.5.20-0.5.23; every device <-> host copy of the KV pool goes through the two
``L2TransferEngine`` calls, whoever asked for it):

* ``L2TransferEngine.submit_device_to_host(transfers)`` (AFTER): a backup, queued on the
  device-to-host stream: one KV_STORE per transfer of the KV pool, of the device pages it
  copies out. The object: one 64-bit key per backup, remembered per host page, so a
  load-back names the backup its host pages came from (a load may take only part of
  one, after a radix node was split). Whose: the radix cache's (a tree backup, write
  through or write back), or the request's for a decode retraction backup
  (``UnifiedRadixCache.backup_kv_cache``).
* ``HybridCacheController.load(host_indices, ...)`` (AFTER): the controller allocated the
  destination pages and queued the copy: KV_LOAD ``issued``, one per backup object the
  host pages belong to, for the request whose prefix lookup asked for it
  (``UnifiedRadixCache.init_load_back``, AROUND: the request is known while it runs, and
  its REQ_BEGIN goes out there, before its first row: ``for_request_hook``).
* ``L2TransferEngine.submit_host_to_device(transfers, ...)`` (AFTER): the copy of every
  queued load was submitted: KV_LOAD ``completed`` for each. On a GPU the bytes land on
  the host-to-device stream while the forward waits for them layer by layer
  (``layer_transfer_counter``), so for every later reader they are there: the sidecar
  counts the pages as written by the load from here. A copy with no issued load behind
  it is a retraction restore (``UnifiedRadixCache.restore_kv_cache``, AROUND: its
  request).

Digests (host pools, the transfer digests' alg 3 over every layer and head, tokens in
host-slot order): a backup's, of the device pages it copied out (taken after the copy,
which on a host pool is done when the call returns), and a load-back's, of the pages it
filled, when the load takes the whole backup (a load of part of one, after a radix node
was split or of a prompt's page-aligned prefix, says none): the sidecar compares the two
(``checksum_mismatch``, ``evidence.via = "load"``), so host KV that changed at rest, or
host slots another backup reused under a queued load, is caught. Device pools: none (the
copy runs on a side stream; reading the pages at submission would race it).

What is not said: the object's scope (a radix node is found under the request's own
extra key and salt, so the pages the load fills take the loading request's scope, and
sharing them across scopes is judged where they are shared, on rows). Host slot frees
need no record: a later backup into the same host pages replaces their object. Device
indices are read on the host once per copy submission: on a GPU that read waits for the
stream, like the adapter's per-step reads of the forward's slots (README, "Not covered"),
but per backup or load-back submitted, not per step.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import xxhash

from .. import digest as dg
from . import _runtime as rt
from . import content_hooks
from ._runtime import State

log = logging.getLogger("kvguard.sglang")

MAX_PENDING_LOADS = 4096  # issued loads not yet submitted (a healthy engine submits them the same step)
MAX_OBJECTS = 100_000  # backups remembered for whole-object digests (as the sidecar's bound)


class Run(NamedTuple):
    """Part of a load that one backup's host pages feed."""

    key: int  # the backup's object key (0: host pages no backup was seen into)
    device_slots: np.ndarray
    host_slots: np.ndarray


class Tier:
    """This process's view of the host pool: which backup each host page holds, the loads
    issued and not yet submitted, and the request a tree or retraction call runs for."""

    host_object: np.ndarray | None = None  # host page -> object key of the backup it holds (0: none)
    host_page_size = 1
    pending: OrderedDict = OrderedDict()  # first device slot -> (rid, [Run])
    objects: OrderedDict = OrderedDict()  # object key -> (first host page, host pages) of its backup
    view: dg.PoolView | bool | None = (
        None  # the KV pool's digest view; False: not digested (device pool, unknown layout)
    )
    for_request: str | None = None  # rid of the request a tree / retraction call runs for
    _key_base = 0
    _seq = 0

    @classmethod
    def reset(cls) -> None:
        cls.host_object, cls.host_page_size = None, 1
        cls.pending = OrderedDict()
        cls.objects = OrderedDict()
        cls.view = None
        cls.for_request = None
        cls._key_base, cls._seq = 0, 0

    @classmethod
    def new_key(cls) -> int:
        """A key no other engine's backup shares (the sidecar keeps objects of every engine)."""
        if not cls._key_base:
            cls._key_base = xxhash.xxh3_64_intdigest(f"{os.getpid()}:{time.time_ns()}".encode()) & ~0xFFFFFFFF
        cls._seq += 1
        return (cls._key_base | (cls._seq & 0xFFFFFFFF)) or 1


def _is_kv_transfer(transfer) -> bool:
    """A transfer of the main KV pool (not a draft model's, not a side pool's)."""
    if getattr(transfer, "is_draft", False):
        return False
    kv_pool = getattr(State, "kv_pool", None)
    return kv_pool is None or transfer.device_pool is kv_pool


def _kv_transfers(args, kwargs):
    """The submitted transfers (``submit_*(transfers, ...)``) of the main KV pool, with their
    device slots on the host; none before HELLO."""
    if not State.hello_done:
        return
    for t in args[0] if args else kwargs.get("transfers", ()):
        if _is_kv_transfer(t):
            device_slots = rt.host_int64(t.device_indices)
            if len(device_slots):
                yield t, device_slots


def _host_pages(host_pool, host_slots: np.ndarray) -> np.ndarray:
    """The host pages of ``host_slots``; the first backup sizes the map from its host pool."""
    if Tier.host_object is None:
        Tier.host_page_size = int(getattr(host_pool, "page_size", 1) or 1)
        size = int(getattr(host_pool, "size", 0) or (int(host_slots.max()) + 1 if len(host_slots) else 1))
        Tier.host_object = np.zeros(size // Tier.host_page_size + 1, np.uint64)
    pages = host_slots // Tier.host_page_size
    if len(pages) and int(pages.max()) >= len(Tier.host_object):  # a pool larger than it said: grow
        grown = np.zeros(int(pages.max()) * 2 + 1, np.uint64)
        grown[: len(Tier.host_object)] = Tier.host_object
        Tier.host_object = grown
    return pages


def _object_runs(host_pool, host_slots: np.ndarray, device_slots: np.ndarray) -> list[Run]:
    """One Run per stretch of host slots holding one backup, in order."""
    keys = Tier.host_object[_host_pages(host_pool, host_slots)]  # type: ignore[index]
    if len(keys) == 0:
        return []
    cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(keys)]))
    return [Run(int(keys[a]), device_slots[a:b], host_slots[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]


def _pool_view():
    """The KV pool as the digests read it, or None (a device pool, a layout not digested;
    said once in the log)."""
    if Tier.view is None:
        try:
            view = dg.pool_view(State.kv_pool)
            if str(getattr(view.device, "type", view.device)) != "cpu":
                raise dg.Unsupported(f"KV pool on {view.device}: the copy runs on a side stream")
            Tier.view = view
        except Exception as exc:  # noqa: BLE001 - no digest, the records still go out
            Tier.view = False
            log.info("kvguard: HiCache backups and load-backs are not digested: %s", exc)
    return Tier.view or None


def _digest(ordered_slots: np.ndarray) -> int:
    """The digest of the KV in ``ordered_slots`` (device slots in the backup's host-slot
    order, ``_in_object_order``), tokens in that order (0: none)."""
    view = _pool_view()
    if view is None or len(ordered_slots) == 0:
        return 0
    try:
        return dg.transfer_digest(view, ordered_slots, 0, dg.HEAD_STREAMS) or 1
    except dg.Unsupported as exc:
        dg.skips.skip(f"HiCache copy not digested: {exc}")
        return 0


def _in_object_order(device_slots: np.ndarray, host_slots: np.ndarray) -> np.ndarray:
    """``device_slots`` in host-slot order: the backup's own order, the same for its store and
    every load of it (a copy's device indices come in whatever order the caller gathered them),
    so that a store's page i and a whole load's page i hold the same tokens (the sidecar carries
    each page's content identity by that position, sidecar/offload.py)."""
    if len(host_slots) < 2 or bool((host_slots[1:] >= host_slots[:-1]).all()):
        return device_slots
    return device_slots[np.argsort(host_slots, kind="stable")]


def _whole_object(run: Run) -> bool:
    """Whether ``run`` loads every host page of its backup (then its digest compares)."""
    obj = Tier.objects.get(run.key)
    if obj is None or len(run.host_slots) == 0:
        return False
    pages = np.unique(run.host_slots // Tier.host_page_size)
    return len(pages) == obj[1] and int(pages[0]) == obj[0]


# ------------------------------------------------------------------ backups (device -> host)
def _stored_post(result, engine, *args, **kwargs) -> None:
    for t, device_slots in _kv_transfers(args, kwargs):
        host_slots = rt.host_int64(t.host_indices)
        key = Tier.new_key()
        pages = _host_pages(t.host_pool, host_slots)  # (sizes the map on the first backup)
        Tier.host_object[pages] = np.uint64(key)  # type: ignore[index]
        unique = np.unique(pages)
        Tier.objects[key] = (int(unique[0]), len(unique))
        while len(Tier.objects) > MAX_OBJECTS:
            Tier.objects.popitem(last=False)
        ordered = _in_object_order(device_slots, host_slots)
        rt.probes().kv_stored(Tier.for_request, key, ordered, digest=_digest(ordered), unit="slots")


def stored_hook(name: str):
    return rt.after(name, _stored_post)


# ------------------------------------------------------------------ load-backs (host -> device)
def _load_issued_post(result, controller, *args, **kwargs) -> None:
    """The controller chose the destination (``result``: device slots, None when it could not)."""
    if result is None or not State.hello_done or Tier.host_object is None:
        return
    host_indices = args[0] if args else kwargs.get("host_indices")
    if getattr(controller, "mem_pool_device", None) is not None and getattr(State, "kv_pool", None) is not None:
        if controller.mem_pool_device is not State.kv_pool:
            return  # a draft model's controller
    host_slots, device_slots = rt.host_int64(host_indices), rt.host_int64(result)
    if len(device_slots) == 0 or len(host_slots) != len(device_slots):
        return
    runs = _object_runs(None, host_slots, device_slots)  # (the map exists: a backup came first)
    rid = Tier.for_request
    p = rt.probes()
    for run in runs:
        p.kv_loaded(rid, run.key, _in_object_order(run.device_slots, run.host_slots), "issued", unit="slots")
    Tier.pending[int(device_slots[0])] = (rid, runs)
    while len(Tier.pending) > MAX_PENDING_LOADS:
        Tier.pending.popitem(last=False)


def load_issued_hook(name: str):
    return rt.after(name, _load_issued_post)


def _loaded_post(result, engine, *args, **kwargs) -> None:
    p = rt.probes()
    for t, device_slots in _kv_transfers(args, kwargs):
        covered = []
        firsts = np.fromiter(Tier.pending, np.int64, len(Tier.pending))
        for first in firsts[np.isin(firsts, device_slots)].tolist():  # the issued loads in this copy
            rid, runs = Tier.pending.pop(first)
            for run in runs:
                _completed(p, rid, run)
                covered.append(run.device_slots)
        rest = device_slots
        if covered:
            rest = device_slots[~np.isin(device_slots, np.concatenate(covered))]
        if len(rest):  # a copy no load was issued for: a retraction restore, for its request
            host_slots = rt.host_int64(t.host_indices)
            if len(host_slots) == len(device_slots):
                host_rest = host_slots[np.isin(device_slots, rest)] if covered else host_slots
                for run in _object_runs(t.host_pool, host_rest, rest):
                    _completed(p, Tier.for_request, run)


def _completed(p, rid: str | None, run: Run) -> None:
    ordered = _in_object_order(run.device_slots, run.host_slots)
    digest = _digest(ordered) if _whole_object(run) else 0
    p.kv_loaded(rid, run.key, ordered, "completed", digest=digest, unit="slots")
    content_hooks.loaded(run.device_slots)  # KV at rest (KVGUARD_CONTENT_CHECK): a write it did not make


def loaded_hook(name: str):
    return rt.after(name, _loaded_post)


# ------------------------------------------------------------------ whose call it is
def _device_prefix_len(req) -> int:
    """The prefix the radix cache matched on the device for ``req`` (``prefix_len``,
    which admission adds the tokens loaded to; ``prefix_indices`` is filled later)."""
    n = getattr(req, "prefix_len", None)
    if isinstance(n, int):
        return n
    prefix = getattr(req, "prefix_indices", None)
    return len(prefix) if prefix is not None else 0


def for_request_hook(name: str):
    """AROUND ``init_load_back(params)`` / ``backup_kv_cache(req)`` / ``restore_kv_cache(req,
    ...)``: the copies issued inside run for that request. Not ``rt.around``: the request
    must be forgotten even when the original raises.

    A load-back is issued during admission, before the request's first row (where REQ_BEGIN
    is otherwise sent): after ``init_load_back`` returns, REQ_BEGIN goes out with the prefix
    the request is admitted with (its device prefix and the tokens loaded), so the load's
    completion names a known request. (Its ``issued`` record comes first; the sidecar takes
    a KV_LOAD naming a request not begun yet.)"""

    def hook(original, *args, **kwargs):
        previous = Tier.for_request
        req = None
        if rt.is_enabled(name) and State.hello_done:
            try:
                first = args[1] if len(args) > 1 else (kwargs.get("params") or kwargs.get("req"))
                req = getattr(first, "req", first)
                Tier.for_request = getattr(req, "rid", None)
            except Exception as exc:  # noqa: BLE001
                rt.hook_failed(name, exc)
        try:
            result = original(*args, **kwargs)
        finally:
            Tier.for_request = previous
        if req is not None and getattr(req, "rid", None) is not None and isinstance(result, tuple):
            try:  # init_load_back -> (tokens loaded, last node)
                loaded = result[0] if isinstance(result[0], int) else len(result[0])
                rt.ensure_begun(req, cached_tokens=_device_prefix_len(req) + int(loaded))
            except Exception as exc:  # noqa: BLE001
                rt.hook_failed(name, exc)
        return result

    hook.__name__ = hook.__qualname__ = f"kvguard_{name}"
    return hook

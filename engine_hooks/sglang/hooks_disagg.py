"""Prefill/decode disaggregation hooks: transfer_reserved / transfer_sent / transfer_done.

Decode side (srt/disaggregation/decode.py):
* ``DecodePreallocQueue._pre_alloc(req, prefix_indices, prefix_len, total_prefix_len)``
  binds a row and allocates the destination slots for the KV prefill will send;
  it returns them (``kv_loc``, positions ``[total_prefix_len, +len)``). ->
  rows_assigned (the decode-side radix prefix ``[0, prefix_len)`` as shared) and
  transfer_reserved(rid, room, tokens=len(kv_loc), slots=kv_loc). When it is
  called to resume a *retracted* request (``resume_retracted_reqs``) no transfer
  follows, so only the rows are reported.
* ``DecodeTransferQueue.pop_transferred``: requests it returns polled Success ->
  transfer_done(receiver, success); requests it removed without returning them
  failed (poll Failed, or aborted at commit) -> transfer_done(receiver, failed).
* ``DecodeTransferQueue._do_release``: the deferred release of a failed transfer's
  pages (after the prefill drain ack or timeout): frees inside it are kind
  "deferred".

Prefill side (srt/disaggregation/prefill.py, ``SchedulerDisaggregationPrefillMixin``):
* ``send_kv_chunk(req, last_chunk, end_idx)`` sends token range
  ``[req.start_send_idx, new req.start_send_idx)``; the pages are those of the
  request's row over that range (what the engine hands to ``sender.send``). ->
  transfer_sent(unit="slots").
* ``process_disagg_prefill_inflight_queue``: the requests it returns are done;
  transfer_done(sender, success), or failed when ``handle_inflight_transfer_failure``
  ran for them.
"""

from __future__ import annotations

from . import _runtime as rt
from ._runtime import State


def _room(req) -> int:
    room = getattr(req, "bootstrap_room", None)
    return -1 if room is None else int(room)


# --------------------------------------------------------------------------- decode
def _arg(args, kwargs, i, key, default=None):
    return args[i] if len(args) > i else kwargs.get(key, default)


def _pre_alloc_pre(self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    prefix_len = _arg(args, kwargs, 2, "prefix_len") or 0
    total_prefix_len = _arg(args, kwargs, 3, "total_prefix_len")
    if total_prefix_len is None:
        total_prefix_len = prefix_len
    resumed = any(func == "resume_retracted_reqs" for _f, func in rt.caller_frames(4))
    return req, int(prefix_len), int(total_prefix_len), resumed


def _pre_alloc_post(token, kv_loc, self, *args, **kwargs):
    if not State.hello_done or kv_loc is None:
        return
    req, prefix_len, total_prefix_len, resumed = token
    if getattr(getattr(self, "scheduler", None), "enable_hisparse", False):
        return  # kv_loc are host indices there; not modelled
    from .hooks_rows import _rows_block

    n = int(kv_loc.numel())
    end = total_prefix_len + n
    rt.ensure_begun(req, cached_tokens=prefix_len)
    row = int(req.kv.req_pool_idx)
    block = _rows_block(self.req_to_token_pool.req_to_token, [row], end)[0]
    p = rt.probes()
    if prefix_len > 0:
        p.rows_assigned(req.rid, 0, prefix_len, prefix_len, block[:prefix_len])
    if n:
        p.rows_assigned(req.rid, total_prefix_len, end, total_prefix_len, block[total_prefix_len:end])
    if not resumed:
        p.transfer_reserved(req.rid, _room(req), n, kv_loc)


def pre_alloc_hook(name: str):
    return rt.around(name, _pre_alloc_pre, _pre_alloc_post, cats=("rows",))


def _pop_transferred_pre(self, *args, **kwargs):
    rids_to_check = _arg(args, kwargs, 0, "rids_to_check")
    return [
        dr.req for dr in self.queue if rids_to_check is None or dr.req.rid in rids_to_check
    ]


def _pop_transferred_post(before, result, self, *args, **kwargs):
    if not State.hello_done or not before:
        return
    returned = {id(r) for r in result or ()}
    still_queued = {id(dr.req) for dr in self.queue}
    p = rt.probes()
    for req in before:
        if id(req) in returned:
            p.transfer_done(req.rid, _room(req), "receiver", "success")
        elif id(req) not in still_queued:
            p.transfer_done(req.rid, _room(req), "receiver", "failed")


def pop_transferred_hook(name: str):
    return rt.around(name, _pop_transferred_pre, _pop_transferred_post)


def deferred_release_hook(name: str):
    return rt.around(name, None, None, free_kind="deferred")


# --------------------------------------------------------------------------- prefill
def _send_pre(self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    return req, int(req.start_send_idx or 0)


def _send_post(token, result, self, *args, **kwargs):
    if not State.hello_done:
        return
    req, start = token
    last_chunk = bool(_arg(args, kwargs, 1, "last_chunk", False))
    end = int(req.start_send_idx or 0)
    if end < start or (end == start and not last_chunk):
        return  # nothing sent (skipped)
    from .hooks_rows import _rows_block

    slots = _rows_block(self.req_to_token_pool.req_to_token, [int(req.kv.req_pool_idx)], end)[0, start:end]
    rt.ensure_begun(req)
    rt.probes().transfer_sent(req.rid, _room(req), start, end, slots, last_chunk, unit="slots")


def send_kv_chunk_hook(name: str):
    return rt.around(name, _send_pre, _send_post)


def _inflight_post(result, self, *args, **kwargs):
    if not State.hello_done:
        return
    p = rt.probes()
    for req in result or ():
        status = "failed" if State.xfer_failed.pop(req.rid, None) else "success"
        p.transfer_done(req.rid, _room(req), "sender", status)


def inflight_queue_hook(name: str):
    return rt.after(name, _inflight_post)


def _transfer_failure_pre(self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    State.xfer_failed[req.rid] = True


def transfer_failure_hook(name: str):
    return rt.around(name, _transfer_failure_pre, None)

"""Request rows (req_to_token) and forward hooks: rows_assigned / forward.

``req_to_token[row, pos]`` is the token slot holding position ``pos`` of the request
bound to ``row``. Rows are written by:

* ``alloc_for_extend(batch)`` (srt/mem_cache/allocation.py): prefix slots from the
  radix cache at ``[0, prefix_len)`` plus freshly allocated slots at
  ``[prefix_len, seq_len)``. On GPU the write is a Triton kernel that bypasses
  ``ReqToTokenPool.write``, so the row is read back *after* the call.
* ``alloc_for_decode(batch, token_per_req)``: one (or ``token_per_req``) new slot at
  position ``seq_len`` (the old length); that slot is usually inside the request's
  existing last page.
* ``ReqToTokenPool.write`` / ``DecodeReqToTokenPool.write`` from anywhere else
  (radix-cache checkpoints rebinding a row onto the tree's pages, decode
  pre-allocation, HiCache loads); the row's owner comes from the row -> rid map
  kept by the pools' ``alloc``/``free``. Writes made inside the hooked functions
  above are not reported twice.

``ModelRunner.forward`` gives, per batch, each request's rid, the tokens its
attention reads (``seq_lens``), the slots it writes (``out_cache_loc`` split by
``extend_seq_lens`` or evenly for decode) and the actual row
``req_to_token[row, :seq_len]`` it reads.
"""

from __future__ import annotations

import os

from . import _runtime as rt
from ._runtime import State

# Writes coming from these engine files rebind positions onto prefix-cache pages.
_SHARED_WRITERS = ("radix", "hicache", "session")


def _rows_block(req_to_token, rows: list, length: int, step: int = 1):
    """req_to_token[rows, :length:step] on the host, one copy."""
    import torch

    if length <= 0:
        return torch.zeros((len(rows), 0), dtype=torch.int64)
    idx = torch.as_tensor(rows, dtype=torch.int64, device=req_to_token.device)
    return req_to_token[idx, :length:step].to("cpu", torch.int64)


ROW_SAMPLE_ENV = "KVGUARD_ROW_SAMPLE_EVERY"


def row_sample_every() -> int:
    """Send the engine's actual rows (page-table truth) with every Nth forward; 0 = never.

    The sidecar judges every read of every forward against its own model of each
    request's row (built from the ASSIGN records); the sampled rows additionally catch
    rows corrupted behind the hooks' back. Default 16: at batch 256 and 32k context a
    sampled step gathers ~131k page ids (about a millisecond on the host), every other
    step sends only seq_lens.
    """
    raw = os.environ.get(ROW_SAMPLE_ENV, "16")
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        rt.log.error("kvguard: %s=%r is not a non-negative integer; using 16", ROW_SAMPLE_ENV, raw)
        return 16
    return value


_forward_count = [0]


# --------------------------------------------------------------------------- row map
def _pool_alloc_post(result, self, *args, **kwargs):
    if result is None:
        return
    reqs = args[0] if args else kwargs.get("reqs")
    for r in reqs or ():
        row = r.kv.req_pool_idx
        if row is not None:
            State.row_rid[int(row)] = r.rid


def pool_alloc_hook(name: str):
    return rt.after(name, _pool_alloc_post)


def _pool_free_pre(self, *args, **kwargs):
    req = args[0] if args else kwargs.get("req")
    return (req.kv.req_pool_idx, req.rid)


def _pool_free_post(token, result, self, *args, **kwargs):
    row, rid = token
    if row is not None and State.row_rid.get(int(row)) == rid:
        del State.row_rid[int(row)]


def pool_free_hook(name: str):
    return rt.around(name, _pool_free_pre, _pool_free_post)


# --------------------------------------------------------------------------- write
def _shared_caller() -> bool:
    for filename, _func in rt.caller_frames(6):
        base = filename.rsplit("/", 1)[-1]
        if any(s in base for s in _SHARED_WRITERS):
            return True
    return False


def _write_post(result, self, *args, **kwargs):
    if rt.depth("rows") or not State.hello_done:
        return
    indices = args[0] if args else kwargs.get("indices")
    values = args[1] if len(args) > 1 else kwargs.get("values")
    if not isinstance(indices, tuple) or len(indices) != 2 or values is None:
        return
    row, cols = indices
    p = rt.probes()
    if isinstance(cols, slice):
        if hasattr(row, "numel") and row.numel() != 1:
            return
        rid = State.row_rid.get(int(row))
        if rid is None:
            return
        n = int(values.numel()) if hasattr(values, "numel") else len(values)
        start = int(cols.start or 0)
        stop = int(cols.stop) if cols.stop is not None else start + n
        if stop - start != n or n == 0:
            return
        shared_until = stop if _shared_caller() else start
        p.rows_assigned(rid, start, stop, shared_until, values)
    elif hasattr(row, "numel") and hasattr(cols, "numel"):
        # element-wise (rows[i], cols[i]) = values[i]: the decode write
        rows = rt.to_list(row.reshape(-1))
        positions = rt.to_list(cols.reshape(-1))
        vals = values.reshape(-1).to("cpu")
        if len(rows) != len(positions) or len(rows) != vals.numel():
            return
        for i, (r, pos) in enumerate(zip(rows, positions)):
            rid = State.row_rid.get(int(r))
            if rid is not None:
                p.rows_assigned(rid, int(pos), int(pos) + 1, int(pos), vals[i : i + 1])


def write_hook(name: str):
    return rt.after(name, _write_post)


# --------------------------------------------------------------------------- alloc_for_*
def _extend_pre(batch, *args, **kwargs):
    return [bool(r.kv.holds_kv) for r in batch.reqs]


def _extend_post(held, result, batch, *args, **kwargs):
    if not State.hello_done or not batch.reqs:
        return
    reqs = batch.reqs
    prefix_lens = [int(x) for x in batch.prefix_lens]
    seq_lens = [int(x) for x in rt.to_list(batch.seq_lens_cpu)]
    rows = [int(r.kv.req_pool_idx) for r in reqs]
    block = _rows_block(batch.req_to_token_pool.req_to_token, rows, max(seq_lens))
    p = rt.probes()
    for i, r in enumerate(reqs):
        prefix, seq = prefix_lens[i], seq_lens[i]
        rt.ensure_begun(r, cached_tokens=0 if held[i] else prefix)
        start = prefix if held[i] else 0  # a later chunk: its earlier rows are already known
        p.rows_assigned(r.rid, start, seq, prefix, block[i, start:seq])


def alloc_for_extend_hook(name: str):
    return rt.around(name, _extend_pre, _extend_post, cats=("rows",))


def _token_per_req(args, kwargs) -> int:
    return int(args[0] if args else kwargs.get("token_per_req", 1))


def _decode_pre(batch, *args, **kwargs):
    if getattr(getattr(batch, "model_config", None), "is_encoder_decoder", False):
        return None  # positions are offset by encoder_lens; not modelled
    return [int(x) for x in rt.to_list(batch.seq_lens_cpu)]


def _decode_post(old_lens, result, batch, *args, **kwargs):
    if old_lens is None or not State.hello_done or result is None:
        return
    tpr = _token_per_req(args, kwargs)
    out = result.reshape(-1).to("cpu")
    if out.numel() != tpr * len(batch.reqs):
        return
    p = rt.probes()
    ps = State.page_size
    for i, r in enumerate(batch.reqs):
        s = old_lens[i]
        if tpr == 1 and s % ps:
            continue  # the token lands in the request's current last page, already assigned
        p.rows_assigned(r.rid, s, s + tpr, s, out[i * tpr : (i + 1) * tpr])


def alloc_for_decode_hook(name: str):
    return rt.around(name, _decode_pre, _decode_post, cats=("rows",))


# --------------------------------------------------------------------------- forward
def _forward_pre(self, *args, **kwargs):
    if not State.hello_done or getattr(self, "is_draft_worker", False):
        return
    fb = args[0] if args else kwargs.get("forward_batch")
    mode = fb.forward_mode
    if mode is None or mode.is_idle():
        return
    rids = fb.rids
    if not rids:
        return
    import torch

    n = len(rids)
    seq_src = fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens
    seq_lens = [int(x) for x in rt.to_list(seq_src)[:n]]
    out = fb.out_cache_loc.reshape(-1).to("cpu")
    if mode.is_extend() and fb.extend_seq_lens_cpu is not None:
        counts = [int(x) for x in list(fb.extend_seq_lens_cpu)[:n]]
    else:
        counts = [out.numel() // n] * n
    if sum(counts) != out.numel():  # padded / speculative layouts we do not model: report no writes
        out, counts = out[:0], [0] * n
    read_rows = None
    every = State.row_sample_every
    _forward_count[0] += 1
    if every and _forward_count[0] % every == 0:
        ps = State.page_size
        rows = [int(x) for x in rt.to_list(fb.req_pool_indices)[:n]]
        block = _rows_block(self.req_to_token_pool.req_to_token, rows, max(seq_lens) if seq_lens else 0, ps)
        read_rows = [block[i, : -(-seq_lens[i] // ps)] for i in range(n)]
    rt.probes().forward(list(rids), seq_lens, out, read_rows, written_counts=counts, rows_are_page_starts=True)


def forward_hook(name: str):
    return rt.around(name, _forward_pre, None)

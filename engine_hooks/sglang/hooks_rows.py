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
* ``alloc_for_spec_decode(tree_cache, req_to_token_pool, *, reqs, req_pool_indices,
  cur_kv_lens, ..., nxt_kv_lens_cpu, num_needed_tokens, batch)`` (speculative decoding:
  EAGLE, EAGLE3, MTP/NEXTN, NGRAM): allocates each request's row ahead, positions
  ``[cur_kv_len, nxt_kv_len)`` (``cur`` = ``kv_allocated_len``, ``nxt`` = its committed length
  plus twice the draft window, rounded up to a page), and writes them with
  ``assign_req_to_token_pool_func`` (a kernel, not ``ReqToTokenPool.write``): the row is
  read back after the call, as for ``alloc_for_extend``. The verify and draft forwards
  write there; rejected draft tokens' slots stay the request's until its release frees
  the row past the kept length (``_release_overallocated_kv_indices``, a hooked free).
* ``ReqToTokenPool.write`` / ``DecodeReqToTokenPool.write`` from anywhere else
  (radix-cache checkpoints rebinding a row onto the tree's pages, decode
  pre-allocation, HiCache loads); the row's owner comes from the row -> rid map
  kept by the pools' ``alloc``/``free``. Writes made inside the hooked functions
  above are not reported twice.

``ModelRunner.forward`` gives, per batch, each request's rid, the tokens its
attention reads (``seq_lens``), the slots it writes (``out_cache_loc`` split by
``extend_seq_lens`` or evenly for decode) and the actual row
``req_to_token[row, :seq_len]`` it reads. A ``TARGET_VERIFY`` forward (speculative
decoding's verify step on the target model) has ``seq_lens`` = the tokens already in the
cache (the prefix its attention reads from the pool) and writes ``draft_token_num`` slots
per request, ``req_to_token[row, seq_len : seq_len + draft_token_num]``, whose tokens
attend to the prefix and to each other (tree mask): reported as those writes and a read
of ``seq_len + draft_token_num`` tokens. The draft model's own forwards
(``is_draft_worker``: its prefill, ``DRAFT_EXTEND_V2`` after each verify, draft decode
steps) are reported like the target's: its KV pool is a buffer of its own at the same slots,
on the target's allocator and rows (coverage.py watches a draft only where that holds), so its
writes and reads are of the same pages. The content check stays on the target's pool.
"""

from __future__ import annotations

import time

import numpy as np

from ..probe_support import same_counts
from . import _runtime as rt
from . import content_hooks, identity_hooks
from . import hooks_state as state_slots
from . import hooks_swa as swa
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


def _rows_span(req_to_token, rows: list, lo: int, hi: int):
    """req_to_token[rows, lo:hi] on the host, one copy."""
    import torch

    idx = torch.as_tensor(rows, dtype=torch.int64, device=req_to_token.device)
    return req_to_token[idx, lo:hi].to("cpu", torch.int64)


# --------------------------------------------------------------------------- row map
def _pool_alloc_post(result, self, *args, **kwargs):
    if result is None:
        return
    reqs = args[0] if args else kwargs.get("reqs")
    tier1 = rt.probes().tier1
    for r in reqs or ():
        row = r.kv.req_pool_idx
        if row is not None:
            State.row_rid[int(row)] = r.rid
            if tier1 is not None:
                tier1.bind_row(int(row), r.rid)


def pool_alloc_hook(name: str):
    return rt.after(name, _pool_alloc_post)


def _pool_free_pre(self, *args, **kwargs):
    req = args[0] if args else kwargs["req"]
    return (req.kv.req_pool_idx, req.rid)


def _pool_free_post(token, result, self, *args, **kwargs):
    row, rid = token
    if row is not None and State.row_rid.get(int(row)) == rid:
        del State.row_rid[int(row)]
        tier1 = rt.probes().tier1
        if tier1 is not None:
            tier1.unbind_row(int(row))


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
        if State.swa_pool:
            swa.write_twin(rid, start, stop, shared_until, values)
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
                if State.swa_pool:
                    swa.write_twin(rid, int(pos), int(pos) + 1, int(pos), vals[i : i + 1])


def write_hook(name: str):
    return rt.after(name, _write_post)


# --------------------------------------------------------------------------- alloc_for_*
def _extend_pre(batch, *args, **kwargs):
    held = [bool(r.kv.holds_kv) for r in batch.reqs]
    if State.swa_pool and State.hello_done and any(held):
        # a later chunk: its SWA row below this extend's window goes to page 0 before
        # alloc_for_extend runs SGLang's own eviction (hooks_swa.py)
        prefix_lens = batch.prefix_lens
        swa.null_below_window(
            [r.rid for r, h in zip(batch.reqs, held) if h], [int(x) for x, h in zip(prefix_lens, held) if h]
        )
    return held


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
    if identity_hooks.Identity.state != "off":  # what the rows' full pages hold (KVGUARD_PAGE_IDENTITY)
        identity_hooks.guarded(identity_hooks.extended, reqs, held, prefix_lens, seq_lens)
    if State.swa_pool:  # a hybrid sliding-window model: the same rows in the SWA pool (hooks_swa.py)
        swa.extend_twins(reqs, held, prefix_lens, seq_lens, block)
    if State.state_pool:  # a hybrid linear-attention model: each request's state slot (hooks_state.py)
        state_slots.assign(reqs, held)


def alloc_for_extend_hook(name: str):
    return rt.around(name, _extend_pre, _extend_post, cats=("rows",))


def _token_per_req(args, kwargs) -> int:
    return int(args[0] if args else kwargs.get("token_per_req", 1))


def _decode_pre(batch, *args, **kwargs):
    if getattr(getattr(batch, "model_config", None), "is_encoder_decoder", False):
        return None  # positions are offset by encoder_lens; not modelled
    # a copy: the scheduler advances seq_lens after the call
    old_lens = rt.host_int64(batch.seq_lens_cpu, copy=True)
    if State.swa_pool and State.hello_done and batch.reqs:
        # the SWA rows below this step's window go to page 0 before alloc_for_decode runs
        # SGLang's own eviction (maybe_evict_swa; hooks_swa.py); q0 = the position computed
        swa.null_below_window([r.rid for r in batch.reqs], old_lens[: len(batch.reqs)], one_step=True)
    return old_lens


def _decode_post(old_lens, result, batch, *args, **kwargs):
    if old_lens is None or not State.hello_done or result is None:
        return
    tpr = _token_per_req(args, kwargs)
    n = len(batch.reqs)
    if result.numel() != tpr * n or len(old_lens) < n:
        return
    old_lens = old_lens[:n]
    reqs = batch.reqs
    if tpr == 1:
        # one token per request: only requests whose token starts a page get a new row page
        # (the others' token lands in their current last page, already assigned)
        starts = (old_lens % State.page_size == 0).nonzero()[0]
        if len(starts) == 0:
            return
        out = rt.host_int64(result)  # only on page-start steps (a device read on a GPU)
        rids = [reqs[i].rid for i in starts.tolist()]
        rt.probes().decode_rows_assigned(rids, old_lens[starts], out[starts])
        if State.swa_pool:
            swa.decode_twins(rids, old_lens[starts], out[starts])
        return
    out = rt.host_int64(result)
    p = rt.probes()
    for i in range(n):
        s = int(old_lens[i])
        p.rows_assigned(reqs[i].rid, s, s + tpr, s, out[i * tpr : (i + 1) * tpr])
        if State.swa_pool:
            swa.write_twin(reqs[i].rid, s, s + tpr, s, out[i * tpr : (i + 1) * tpr])


def alloc_for_decode_hook(name: str):
    return rt.around(name, _decode_pre, _decode_post, cats=("rows",))


def _spec_decode_post(token, result, tree_cache, req_to_token_pool, *args, **kwargs):
    if not State.hello_done or int(kwargs.get("num_needed_tokens") or 0) <= 0:
        return  # nothing allocated: the kernel wrote no row entry
    reqs = kwargs["reqs"]
    n = len(reqs)
    if n == 0:
        return
    cur = rt.host_int64(kwargs["cur_kv_lens_cpu"])[:n]
    nxt = rt.host_int64(kwargs["nxt_kv_lens_cpu"])[:n]
    rows = rt.host_int64(kwargs["req_pool_indices"])[:n]
    if len(cur) != n or len(nxt) != n or len(rows) != n:
        raise ValueError(f"alloc_for_spec_decode: {n} requests, {len(cur)} / {len(nxt)} lengths, {len(rows)} rows")
    grow = (nxt > cur).nonzero()[0]
    if len(grow) == 0:
        return
    lo, hi = int(cur[grow].min()), int(nxt[grow].max())
    # the row entries the kernel wrote, read back: [cur, nxt) of each request that grew
    block = _rows_span(req_to_token_pool.req_to_token, rows[grow].tolist(), lo, hi)
    p = rt.probes()
    for j, i in enumerate(grow.tolist()):
        r = reqs[i]
        start, stop = int(cur[i]), int(nxt[i])
        rt.ensure_begun(r)
        p.rows_assigned(r.rid, start, stop, start, block[j, start - lo : stop - lo])


def alloc_for_spec_decode_hook(name: str):
    return rt.around(name, None, _spec_decode_post, cats=("rows",))


# --------------------------------------------------------------------------- forward
_gather_buf: list = [None]


def _gather_buffer(n: int, width: int, dtype):
    import torch

    buf = _gather_buf[0]
    if buf is None or buf.numel() < n * width or buf.dtype != dtype:
        buf = _gather_buf[0] = torch.empty(max(n * width, 1 << 16), dtype=dtype)
    return buf[: n * width].view(n, width)


def _row_page_starts(req_to_token, rows, seq_lens: np.ndarray, ps: int):
    """(flat page ids, pages per request): each row's slots at positions 0, ps, 2*ps, ...
    below its seq_len, requests back to back; one strided gather, one mask."""
    import torch

    counts = -(-seq_lens // ps)
    width = int(counts.max()) if len(counts) else 0
    if width <= 0:
        return np.zeros(0, np.int64), counts
    idx = rows if isinstance(rows, torch.Tensor) else torch.as_tensor(rows, dtype=torch.int64)
    cols = req_to_token[:, : width * ps : ps]
    idx = idx.to(req_to_token.device).long()
    if req_to_token.device.type == "cpu":  # into a reused buffer: a fresh one costs page faults every time
        block = torch.index_select(cols, 0, idx, out=_gather_buffer(len(idx), cols.shape[1], cols.dtype)).numpy()
    else:
        block = cols.index_select(0, idx).cpu().numpy()
    counts = np.minimum(counts, block.shape[1])
    # slot -> page in the tensor's own dtype (int32 in SGLang): a shift when ps is a power of two
    if ps & (ps - 1) == 0:
        block = np.right_shift(block, ps.bit_length() - 1, out=block)
    else:
        block = block // ps
    if (counts == block.shape[1]).all():
        return block.reshape(-1).copy(), counts  # a copy: the buffer is reused
    return block[np.arange(block.shape[1])[None, :] < counts[:, None]], counts


def _forward_pre(self, *args, **kwargs):
    if not State.hello_done:
        return
    # a draft model's runner (EAGLE / MTP): its pool is its own buffer at the target's slots, on
    # the target's allocator and rows (coverage.py checks that), so its writes and reads are the
    # same pages' and judged the same way; the content check fingerprints the target's pool only
    draft = getattr(self, "is_draft_worker", False)
    fb = args[0] if args else kwargs["forward_batch"]
    mode = fb.forward_mode
    if mode is None or mode.is_idle():
        return
    rids = fb.rids
    if not rids:
        return
    n = len(rids)
    p = rt.probes()
    seq_lens = rt.host_int64(fb.seq_lens_cpu if fb.seq_lens_cpu is not None else fb.seq_lens)[:n]
    out = rt.host_int64(fb.out_cache_loc)
    verify = getattr(mode, "is_target_verify", None)  # (0.5.19 - 0.5.23 have it; a stand-in may not)
    if verify is not None and verify():
        seq_lens, out, counts = _verify_layout(fb, n, seq_lens, out)
    elif mode.is_extend() and fb.extend_seq_lens_cpu is not None:
        counts = rt.host_int64(fb.extend_seq_lens_cpu)[:n]
    elif len(out) % n == 0:  # each request the same number of slots (a decode step: one each)
        counts = same_counts(n, len(out) // n)
    else:  # padded layouts we do not model: report no writes
        out, counts = out[:0], np.zeros(n, np.int64)
    if int(counts.sum()) != len(out):  # (the same, for the layouts above that carry their counts)
        out, counts = out[:0], np.zeros(n, np.int64)
    req_to_token = self.req_to_token_pool.req_to_token
    check = None if draft else content_hooks.active(self)
    if check is not None and len(out):
        # KV at rest: the slots each reader attends over that this forward does not write first
        # still hold what hooked writes left there (a slot about to be written may hold anything)
        kept = seq_lens - counts
        content_hooks.guarded(content_hooks.verify_reads, check, req_to_token, fb.req_pool_indices, kept)
    if p.tier1 is not None:  # the engine's own read check, on the engine's device (engine_hooks/tier1.py)
        p.tier1.check(req_to_token, fb.req_pool_indices, fb.seq_lens, rids, max_seq_len=int(seq_lens.max()) if n else 0)
    read_pages = read_counts = None
    sampler = State.row_sampler
    if sampler.due():  # the engine's actual rows with this forward (engine_hooks/row_sampler.py)
        t0 = time.perf_counter_ns()
        read_pages, read_counts = _row_page_starts(req_to_token, fb.req_pool_indices[:n], seq_lens, State.page_size)
        sampler.spent(time.perf_counter_ns() - t0)
    p.forward(rids, seq_lens, out, written_counts=counts, read_pages=read_pages, read_counts=read_counts)
    if State.swa_pool and not draft:  # the window layers' pool (hooks_swa.py)
        swa.forward(rids, seq_lens, counts, out, read_pages, read_counts)
    if State.state_pool and not draft:  # the requests' recurrent state slots (hooks_state.py)
        state_slots.forward(self, fb, rids, read_pages is not None)
    return (check, out) if check is not None else None


def _verify_layout(fb, n: int, seq_lens: np.ndarray, out: np.ndarray):
    """A TARGET_VERIFY forward as FORWARD reports it: ``(read lengths, written slots, written
    per request)``. Each request writes ``draft_token_num`` slots, its row at ``[seq_len,
    seq_len + draft_token_num)`` (``assign_extend_cache_locs``), and reads its cached prefix
    ``[0, seq_len)`` plus those tokens (writes first, then reads: FORWARD's order). A layout
    that does not split so (padding, a draft width we cannot read) reports no writes and reads
    of the cached prefix only: fewer reads judged, never a position the rows were not told."""
    width = getattr(getattr(fb, "spec_info", None), "draft_token_num", None)
    width = int(width) if isinstance(width, (int, np.integer)) and int(width) > 0 else 0
    if width and len(out) == n * width:
        return seq_lens + width, out, np.full(n, width, np.int64)
    return seq_lens, out[:0], np.zeros(n, np.int64)


def _forward_post(token, result, self, *args, **kwargs):
    if token is not None:  # the forward wrote its new tokens' KV: fingerprint it
        check, out = token
        content_hooks.guarded(content_hooks.written, check, out)


def forward_hook(name: str):
    return rt.around(name, _forward_pre, _forward_post)

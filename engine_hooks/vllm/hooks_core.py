"""The EngineCore's side: blocks handed out, touched, freed; rows; requests begin and end.

vLLM's ``BlockPool`` counts references: a block is free once its count is 0, but a block
that holds a prefix-cache hash stays *readable* at 0 (an eviction candidate that a later
prefix hit may ``touch`` back) until ``get_new_blocks`` evicts it for another request.
kvguard's page model has the SGLang radix cache's shape instead (pages the cache keeps stay
allocated; eviction frees them), so the mapping is:

* ALLOC: the blocks ``get_new_blocks`` returns (an evicted cached block among them is
  allocated anew: a new generation, so its old readers' rows are stale);
* FREE: a block whose count reached 0 with no hash (nothing can read it again), a cached
  block evicted while at 0 outside an allocation (``evict_blocks``, a prefix-cache reset),
  and any block whose count went below 0 (freed more often than handed out: the sidecar
  judges what that means);
* ASSIGN: each request's blocks in its row, from ``allocate_slots``: the first call names
  the prefix-cache hits as shared (``shared_until`` = the hit tokens), later calls the blocks
  appended; a row that changed in place (a CoW or skipped block) is announced again whole;
* REQ_BEGIN at a request's first allocation (its prefix hit is known then, for the TTFT
  rule and the scope), with its ``cache_salt`` as the prefix-cache scope; REQ_END when the
  scheduler frees a finished request; a preempted request's row is announced again from 0
  when it is scheduled again.
"""

from __future__ import annotations

import logging

import numpy as np

from . import _runtime as rt
from ._runtime import State

log = logging.getLogger("kvguard.vllm")

_FINISH = {0: "stop", 1: "length", 2: "abort", 3: "abort", 4: "stop"}  # vllm.v1.engine.FinishReason


def _ids(blocks) -> np.ndarray:
    return np.fromiter((b.block_id for b in blocks), dtype=np.int64)


def _emit_alloc(page_ids) -> None:
    if len(page_ids):
        rt.probes().pages_allocated(np.asarray(page_ids, np.int64) * State.page_size)


def _emit_free(page_ids) -> None:
    if len(page_ids):
        rt.probes().pages_freed(np.asarray(page_ids, np.int64), kind="page_ids")


# --------------------------------------------------------------------------- HELLO
def _role(vllm_config) -> str:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(kv, "kv_role", None) if kv is not None else None
    return {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role or "", "unified")


def _model_name(model_config) -> str:
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model", "")
    if isinstance(name, (list, tuple)):
        name = name[0] if name else ""
    return str(name)


def scheduler_init_post(_token, _result, self, *args, **kwargs) -> None:
    """HELLO once the scheduler's KV cache manager (and its block pool) exists."""
    cfg = self.kv_cache_config
    groups = cfg.kv_cache_groups
    if len(groups) != 1:
        log.warning(
            "kvguard: %d KV cache groups (a hybrid or multi-spec model): not modelled, this engine is not watched",
            len(groups),
        )
        return
    manager = self.kv_cache_manager
    page_size = int(groups[0].kv_cache_spec.block_size)
    num_blocks = int(cfg.num_blocks)
    max_len = int(self.max_model_len)
    State.page_size = page_size
    State.block_pool = manager.block_pool
    rt.probes().hello(
        _role(self.vllm_config),
        0,
        page_size,
        num_blocks,
        num_blocks * page_size,
        max_len,
        max_len,
        "vllm",
        State.engine_version,
        _model_name(self.vllm_config.model_config),
    )
    State.hello_done = True


# --------------------------------------------------------------------------- block pool
def get_new_blocks_pre(self, *args, **kwargs):
    State.in_alloc += 1


def get_new_blocks_post(_token, result, self, *args, **kwargs) -> None:
    State.in_alloc -= 1
    if State.hello_done and self is State.block_pool:
        _emit_alloc(_ids(result))


def _cached(pool, block) -> bool:
    return block.block_hash is not None or block.block_id in pool.cached_block_hashes_by_block


def free_blocks(original, name: str):
    """``BlockPool.free_blocks`` takes an iterable (a ``reversed`` iterator): materialise it once
    so that both the engine and we see every block."""

    def wrapper(self, ordered_blocks, *args, **kwargs):
        if not State.hello_done or self is not State.block_pool or name in rt._disabled:
            return original(self, ordered_blocks, *args, **kwargs)
        blocks = list(ordered_blocks)
        result = original(self, blocks, *args, **kwargs)
        try:
            freed = [
                b.block_id
                for b in blocks
                if not b.is_null
                and (b.pool is None or b.pool is self)
                and (b.ref_cnt < 0 or (b.ref_cnt == 0 and not _cached(self, b)))
            ]
            _emit_free(freed)
        except Exception as exc:  # noqa: BLE001
            rt.hook_failed(name, exc)
        return result

    return wrapper


def evict_post(_token, evicted, self, block, *args, **kwargs) -> None:
    """A cached block evicted while nobody holds it, outside an allocation: free for good."""
    if evicted and not State.in_alloc and State.hello_done and self is State.block_pool and block.ref_cnt == 0:
        if not block.is_null:
            _emit_free([block.block_id])


def reset_prefix_cache_post(_token, ok, self, *args, **kwargs) -> None:
    """Every hash dropped: the blocks at 0 (all of them but the null block) are free for good."""
    if ok and State.hello_done and self is State.block_pool:
        _emit_free([b.block_id for b in self.blocks if b.ref_cnt == 0 and not b.is_null])


# --------------------------------------------------------------------------- rows
def _req_blocks(manager, rid: str):
    return manager.coordinator.single_type_managers[0].req_to_blocks.get(rid, ())


def allocate_slots_pre(self, request, num_new_tokens, num_new_computed_tokens=0, *args, **kwargs):
    # the prefix hit this call adds (first allocation only) and the computed tokens before it
    return (
        int(num_new_computed_tokens),
        int(request.num_computed_tokens),
        int(kwargs.get("num_external_computed_tokens", args[3] if len(args) > 3 else 0) or 0),
    )


def allocate_slots_post(token, result, self, request, *args, **kwargs) -> None:
    if result is None or not State.hello_done or token is None:
        return
    rid = request.request_id
    blocks = _req_blocks(self, rid)
    n = len(blocks)
    if n == 0:
        return
    p = rt.probes()
    hit, computed, external = token
    if rid not in State.begun:
        State.begun[rid] = True
        salt = getattr(request, "cache_salt", None)
        p.request_begin(
            rid,
            rt.tenant_of(request),
            None,
            int(request.num_prompt_tokens),
            computed + hit + external,
            False,
            cache_salt=salt,
        )
    ps = State.page_size
    announced = State.rows.get(rid)
    if announced is None:  # its first allocation (or the first since a preemption): the hit is shared
        start, shared_until = 0, computed + hit
    else:
        count, last, shared_until = announced
        if count == n and blocks[n - 1].block_id == last:
            return  # nothing new this step (a decode token inside its last block)
        # blocks appended (the usual), or the row changed in place: announce it whole
        start = count if count <= n and blocks[count - 1].block_id == last else 0
    ids = _ids(blocks[start:] if start else blocks)
    p.row_pages_assigned(rid, start * ps, n * ps, max(shared_until, start * ps), ids)
    State.rows[rid] = (n, int(ids[-1]), shared_until)


def row_released_post(_token, _result, self, request, *args, **kwargs) -> None:
    """``KVCacheManager.free`` / ``pop_blocks_for_free``: the request holds no row now (it ended,
    or was preempted and will be announced again from 0)."""
    State.rows.pop(request.request_id, None)


# --------------------------------------------------------------------------- requests
def free_request_pre(self, request, *args, **kwargs) -> None:
    """``Scheduler._free_request``: the request finished (stop, length, abort)."""
    rid = request.request_id
    if State.begun.pop(rid, None) is None:
        return  # never scheduled: it held no KV
    reason = request.get_finished_reason()
    finish = _FINISH.get(int(reason), "unknown") if reason is not None else "unknown"
    rt.probes().request_end(
        rid,
        finish,
        0,  # TTFT is not measured by the vLLM adapter yet (the TTFT rule skips 0)
        0,
        int(request.num_output_tokens),
        str(getattr(request, "stop_reason", "") or ""),
    )

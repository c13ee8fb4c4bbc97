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
* ASSIGN: each request's blocks in its row, from the step ``Scheduler.schedule`` returns
  (the block ids the Worker applies to its tables): a new request's whole row with its
  prefix-cache hit as shared (``shared_until`` = its computed tokens), a running request's
  blocks gained this step, a request resumed after a preemption its whole new row;
* REQ_BEGIN when a request is first scheduled (its prefix hit is known then, for the TTFT
  rule and the scope), with its ``cache_salt`` as the prefix-cache scope; REQ_END when the
  scheduler frees a finished request, with its TTFT (first scheduled forward to first
  token, watched in ``Scheduler.update_from_output`` for the requests still prefilling).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .. import coverage as cvc
from . import _runtime as rt
from . import coverage as cov
from . import hooks_connector as hconn
from . import hooks_groups as hg
from . import hooks_transfer as htx
from . import identity_hooks as hid
from ._runtime import State

log = logging.getLogger("kvguard.vllm")

_FINISH = {0: "stop", 1: "length", 2: "abort", 3: "abort", 4: "stop"}  # vllm.v1.engine.FinishReason


def _emit_alloc(page_ids: list) -> None:
    if page_ids:
        rt.probes().page_ids_allocated(page_ids)


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
    """HELLO once the scheduler's KV cache manager (and its block pool) exists, then what the
    engine holds and what of it is watched (COVERAGE, contract 1.5): KV cache group 0 is pool
    0, each further group a pool of its own sharing pool 0's block ids (one block pool, the
    same memory). An engine with a group kvguard does not follow says so and sends nothing
    more (HELLO and COVERAGE only: never half an engine)."""
    cfg = self.kv_cache_config
    groups = [cov.describe_group(i, g) for i, g in enumerate(cfg.kv_cache_groups)]
    manager = self.kv_cache_manager
    num_blocks = int(cfg.num_blocks)
    max_len = int(self.max_model_len)
    page_size = groups[0].block_size if groups else 1
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
    for g in groups[1:]:
        if g.kind:
            rt.probes().pool_declared(
                g.index, g.block_size, num_blocks, g.kind, f"kv cache group {g.index}: {g.spec}", g.window, True
            )
    try:
        items = cov.engine_core_items(self, State.engine_version, groups)
    except Exception as exc:  # noqa: BLE001 - an engine we cannot read: said, and nothing else sent
        items = [cvc.unwatched("engine", f"kvguard could not inspect the scheduler: {type(exc).__name__}: {exc}")]
    # a row per group where the rows are not simply appended to (more than one group, or one
    # that releases blocks while the request lives): hooks_groups.py, which needs its own hook
    group_rows = bool(groups) and (len(groups) > 1 or groups[0].kind != "full_attention")
    missing = [n for n in State.missing_hooks if group_rows or n != hg.HOOK_NAME]
    if missing:
        items.append(cvc.unwatched("hooks", "not installed on this vLLM: " + ", ".join(missing)))
    rt.probes().coverage(items)
    for line in cvc.log_lines(items):
        log.info(line)
    if not groups or not cvc.ownership_followed(items):
        log.warning(
            "kvguard: this vLLM engine holds KV kvguard cannot follow (%s): it reports no page records, only that "
            "it is unwatched (a coverage_gap finding in the sidecar)",
            "; ".join(i.component for i in items if not i.watched & cvc.OWNERSHIP),
        )
        return
    State.page_size = page_size
    State.groups = groups
    if group_rows:
        State.group_rows = [rt.Bounded() for _ in groups]
    State.block_pool = manager.block_pool
    State.scheduler = self
    State.hello_done = True
    try:  # after HELLO: its records need the page size; a failure leaves the rest running
        hconn.attach(self)
    except Exception as exc:  # noqa: BLE001
        rt.hook_failed("KVConnector.attach", exc)


# --------------------------------------------------------------------------- block pool
def get_new_blocks_pre(self, *args, **kwargs):
    State.in_alloc += 1


def get_new_blocks_post(_token, result, self, *args, **kwargs) -> None:
    State.in_alloc -= 1
    if State.hello_done and self is State.block_pool:
        _emit_alloc([b.block_id for b in result])


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
            if State.skipping is not None:  # released from a live request's row: held for it (hooks_groups)
                State.skipping.append(([b.block_id for b in blocks if not b.is_null], freed))
                return result
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


def reset_prefix_cache_pre(self, *args, **kwargs):
    """The cached blocks nobody holds, before the reset drops their hashes: the reset frees
    exactly these for good (blocks at 0 without a hash were reported free already)."""
    if not State.hello_done or self is not State.block_pool:
        return None
    return [b.block_id for b in self.blocks if b.ref_cnt == 0 and not b.is_null and _cached(self, b)]


def reset_prefix_cache_post(cached_idle, ok, self, *args, **kwargs) -> None:
    if ok and cached_idle:
        _emit_free(cached_idle)


# --------------------------------------------------------------------------- rows
def schedule_post(_token, out, self, *args, **kwargs) -> None:
    """``Scheduler.schedule``: the step's rows, as the Worker will apply them. A new request
    brings its whole row (its prefix-cache hit is the row's first ``num_computed_tokens``); a
    running one the blocks it gained this step (mostly none); one resumed after a preemption
    its whole new row. One hook per step instead of one per request and allocation: at batch
    256 the per-request hooks cost ~1.7 µs each (docs/performance.md)."""
    if out is None or not State.hello_done:
        return
    if State.group_rows:
        _schedule_groups(self, out)
        return
    p = rt.probes()
    ps = State.page_size
    rows = State.rows
    now = time.perf_counter_ns()
    for new in out.scheduled_new_reqs:
        rid = new.req_id
        ids = new.block_ids[0]
        # the row's prefix-cache hit (shared); tokens a KV connector loads are the request's own
        shared = hconn.shared_until(rid, int(new.num_computed_tokens))
        _begin(self, p, new, now)
        if ids:
            p.row_pages_assigned(rid, 0, len(ids) * ps, shared, ids)
        rows[rid] = len(ids)
    cached = out.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    # decode steps where requests cross into a new block (at batch 256, every 32nd step the
    # whole batch does): one ASSIGN each for the token written first in it, encoded together
    # and written under one ring lock (one call each was most of the adapter's mean step cost)
    crossing: list = []
    for rid, gained, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        if not gained or not gained[0]:
            continue  # the usual decode step: no new block
        ids = gained[0]
        if rid in resumed:  # after a preemption: a new row, its own cached blocks shared
            p.row_pages_assigned(rid, 0, len(ids) * ps, hconn.shared_until(rid, int(computed)), ids)
            rows[rid] = len(ids)
            continue
        start = rows.get(rid)
        if start is None:
            continue  # a row we never saw begin (attached mid-run): nothing to place it against
        if len(ids) == 1 and computed == start * ps:
            crossing.append((rid, ids[0]))
        else:
            p.row_pages_assigned(rid, start * ps, (start + len(ids)) * ps, start * ps, ids)
        rows[rid] = start + len(ids)
    if crossing:
        rids, blocks = zip(*crossing)
        positions = [rows[rid] * ps - ps for rid in rids]
        p.decode_rows_assigned(rids, positions, np.asarray(blocks, np.int64) * ps)
    if hid.Identity.state != "off":  # (KVGUARD_PAGE_IDENTITY: after the rows it names)
        hid.guarded(hid.scheduled, self, out)
    hconn.loads_landed_in_schedule(out)


def _begin(sched, p, new, now: int) -> None:
    """REQ_BEGIN of a request scheduled for the first time (its prefix hit is known now)."""
    rid = new.req_id
    if rid not in State.ttft_ns:
        State.prefilling.setdefault(rid, now)  # its first forward: TTFT counts from here
    if rid in State.begun:
        return
    State.begun[rid] = True
    request = sched.requests.get(rid)
    p.request_begin(
        rid,
        rt.tenant_of(request),
        htx.request_room(request),  # a prefill/decode transfer's room, else none
        int(getattr(request, "num_prompt_tokens", 0) or 0),
        int(new.num_computed_tokens),  # prompt tokens this engine does not compute: the hit and a connector's load
        False,
        cache_salt=getattr(request, "cache_salt", None),
    )


def _schedule_groups(sched, out) -> None:
    """``schedule_post`` for an engine of several KV cache groups: a row per group (hooks_groups.py)."""
    p = rt.probes()
    now = time.perf_counter_ns()
    for new in out.scheduled_new_reqs:
        _begin(sched, p, new, now)
        hg.new_rows(p, new.req_id, new.block_ids, hconn.shared_until(new.req_id, int(new.num_computed_tokens)))
    cached = out.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    crossing: list[list] = [[] for _ in State.groups]
    for rid, gained, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
        if gained is None:
            continue
        if rid in resumed:  # after a preemption: a new row, its own cached blocks shared
            hg.new_rows(p, rid, gained, hconn.shared_until(rid, int(computed)))
        else:
            hg.appended(p, rid, gained, crossing)
    hg.flush(p, crossing)
    hconn.loads_landed_in_schedule(out)


def update_from_output_post(_token, _result, self, scheduler_output, *args, **kwargs) -> None:
    """``Scheduler.update_from_output``: the step's forward is done (its connector saves
    too), and the requests that were prefilling may have their first token now. Only those
    are looked at (a handful per step, not the batch)."""
    if State.prefilling:
        now = time.perf_counter_ns()
        requests = self.requests
        for rid, started in list(State.prefilling.items()):
            request = requests.get(rid)
            if request is None:
                del State.prefilling[rid]
            elif request.num_output_tokens > 0:
                del State.prefilling[rid]
                State.ttft_ns[rid] = now - started
    if State.pending_stores:
        hconn.stores_landed(scheduler_output)


# --------------------------------------------------------------------------- requests
def free_request_pre(self, request, *args, **kwargs):
    """``Scheduler._free_request``: the request finished (stop, length, abort). Returns its
    REQ_END's arguments (the post hook emits them, or holds them while a send is pending)."""
    rid = request.request_id
    if hid.Identity.tips:  # (KVGUARD_PAGE_IDENTITY: while its row is still the sidecar's)
        hid.guarded(hid.finished, request)
    State.rows.pop(rid, None)
    if State.group_rows:
        hg.forget(rid)
    State.prefilling.pop(rid, None)
    ttft = State.ttft_ns.pop(rid, 0)
    hconn.forget(rid)
    if State.begun.pop(rid, None) is None:
        return None  # never scheduled: it held no KV
    reason = request.get_finished_reason()
    finish = _FINISH.get(int(reason), "unknown") if reason is not None else "unknown"
    arrival = float(getattr(request, "arrival_time", 0.0) or 0.0)  # wall clock, stamped by the API server
    e2e = int((time.time() - arrival) * 1e9) if arrival else 0
    return (
        (
            rid,
            finish,
            ttft,  # from its first forward to its first token: the prefill's own time (0: never got one)
            e2e,
            int(request.num_output_tokens),
            str(getattr(request, "stop_reason", "") or ""),
        ),
        # recomputed after a preemption: the cached-token count of its REQ_BEGIN no longer holds
        {"reprefilled": int(getattr(request, "num_preemptions", 0) or 0) > 0},
    )


def free_request_post(end_args, _result, self, request, *args, **kwargs) -> None:
    """A request whose blocks the scheduler kept (still in ``requests``) waits for a KV
    connector's send: a prefill request's REQ_END goes out when it is sent (hooks_transfer)."""
    delayed = request.request_id in self.requests
    if State.sending and htx.sender_freed(request, end_args, delayed):
        return
    if end_args is not None:
        rt.probes().request_end(*end_args[0], **end_args[1])

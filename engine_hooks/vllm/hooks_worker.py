"""The Worker's side: what each forward writes and reads, from the worker's own block tables.

``GPUModelRunner._prepare_inputs`` (the CPU runner inherits it) runs once per forward after
the persistent batch took the step's scheduler output: request ``i`` of the batch has
``num_computed_tokens_cpu[i]`` tokens in its KV and ``num_scheduled_tokens[i]`` scheduled now,
so this forward writes positions ``[c, c + s)`` and attention reads ``[0, c + s)`` over row
``i`` of the block table. One FORWARD record per forward carries the written pages and the
sequence lengths; the block-table rows themselves go out when the row sampler says so
(engine_hooks/row_sampler.py), so the sidecar checks the worker's tables against the
EngineCore's rows within its CPU budget.

This process's ring opens with ENGINE_PART (its EngineCore, the parent process, says HELLO):
the sidecar applies these records to the EngineCore's timeline (sidecar/engine_parts.py).
Only tensor-parallel rank 0 of pipeline stage 0 reports: every rank and stage holds the same tables.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from .. import coverage as cvc
from . import _runtime as rt
from . import coverage as cov
from . import hooks_connector_worker as hconn_worker
from . import hooks_transfer_worker as htx_worker
from ._runtime import State

log = logging.getLogger("kvguard.vllm")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised (a test), a layout without TP groups
        return 0


def _pp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return int(get_pp_group().rank_in_group)
    except Exception:  # noqa: BLE001 - as _tp_rank
        return 0


def _tp_size() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - as _tp_rank
        return 1


def _worker_groups(runner, tables) -> list[tuple[int, str, int]]:
    """Per block table (one per KV cache group): (block size, what its blocks hold, window)."""
    cfg = getattr(runner, "kv_cache_config", None)
    specs = [g.kv_cache_spec for g in cfg.kv_cache_groups] if cfg is not None else []
    out = []
    for i, table in enumerate(tables):
        spec = specs[i] if i < len(specs) else None
        kind = cov.group_kind(spec) if spec is not None else ("full_attention" if len(tables) == 1 else "")
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding_window" else 0
        out.append((int(table.block_size), kind, window))
    return out


def _announce(runner) -> None:
    """ENGINE_PART once (and what this worker reports: COVERAGE), or the reason this worker
    stays silent (logged once)."""
    State.part_done = True
    tables = runner.input_batch.block_table.block_tables
    stage = _pp_rank()
    if stage != 0:
        # a later pipeline stage runs the same batch on the same block tables for its own layers:
        # stage 0 reports the forwards; this one sends nothing (no digest parts either: a stage's
        # slice is layers, not heads, and transfers are not watched under pipeline parallelism)
        State.worker_silent = f"pipeline stage {stage}"
        State.tp_rank = 0
        log.info(
            "kvguard: this vLLM worker reports nothing: pipeline stage %d (stage 0 reports the shared tables)", stage
        )
        return
    rank = _tp_rank()
    State.tp_rank, State.tp_size = rank, max(_tp_size(), rank + 1)
    if rank != 0:
        log.info(
            "kvguard: this vLLM worker reports no forwards: tensor-parallel rank %d (rank 0 reports the shared "
            "tables); it reports its own part of each transfer digest",
            rank,
        )
        State.worker_silent = f"tensor-parallel rank {rank}"
        State.page_size = int(tables[0].block_size) if tables else 1
        # routed to its EngineCore like rank 0 (its digests must meet the engine's transfers)
        rt.probes().engine_part(os.getppid(), "worker", rank, State.page_size)
        try:
            htx_worker.attach(runner)
        except Exception as exc:  # noqa: BLE001
            rt.hook_failed("KVConnector.transfer_attach", exc)
        return
    groups = _worker_groups(runner, tables)
    cache_bs = int(runner.cache_config.block_size)
    specs = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None) or []
    for i, (bs, kind, _window) in enumerate(groups):
        group_bs = int(specs[i].kv_cache_spec.block_size) if i < len(specs) else cache_bs
        if not kind:
            State.worker_silent = f"KV cache group {i} holds blocks kvguard does not follow"
        elif bs != group_bs:
            State.worker_silent = (
                f"kernel block size {bs} of group {i} differs from the cache's {group_bs}: not modelled"
            )
    State.page_size = groups[0][0] if groups else 1
    p = rt.probes()
    p.engine_part(os.getppid(), "worker", rank, State.page_size)
    if State.worker_silent:
        log.info("kvguard: this vLLM worker reports no forwards: %s", State.worker_silent)
        p.coverage([cvc.unwatched("worker", f"its forwards are not reported: {State.worker_silent}")])
        return
    State.worker_groups = groups
    for i, (bs, _kind, _window) in enumerate(groups[1:], start=1):
        p.use_pool_page_size(i, bs)
    detail = ", ".join(
        f"group {i}: block {bs}" + (f", window {w}" if w else "") + (f" ({k})" if k != "full_attention" else "")
        for i, (bs, k, w) in enumerate(groups)
    )
    p.coverage([cvc.item("worker", cvc.OWNERSHIP, 0, f"tensor-parallel rank 0 reports every forward: {detail}")])
    try:  # optional: a failure here must not take the forward hook down with it
        hconn_worker.attach()
    except Exception as exc:  # noqa: BLE001
        rt.hook_failed("KVConnector.worker_attach", exc)
    try:
        htx_worker.attach(runner)
    except Exception as exc:  # noqa: BLE001
        rt.hook_failed("KVConnector.transfer_attach", exc)


def execute_model_pre(self, scheduler_output, *args, **kwargs) -> None:
    """Announce before the first step, forward or not: a decode worker's first steps only pull
    KV (no forward, so no ``_prepare_inputs``), and its connector must be watched by then."""
    if not State.part_done:
        _announce(self)


def prepare_inputs_pre(self, scheduler_output, num_scheduled_tokens, *args, **kwargs) -> None:
    if not State.part_done:
        _announce(self)
    if State.worker_silent:
        return
    batch = self.input_batch
    n = int(batch.num_reqs)
    if n == 0:
        return
    rids = batch.req_ids[:n]
    computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
    scheduled = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
    seq_lens = computed + scheduled
    sampled = State.row_sampler.due()
    t0 = time.perf_counter_ns() if sampled else 0
    tables = batch.block_table.block_tables
    for g, (ps, kind, window) in enumerate(State.worker_groups):
        _forward(g, tables[g].block_table.np, ps, kind, window, n, rids, computed, seq_lens, sampled)
    if sampled:
        State.row_sampler.spent(time.perf_counter_ns() - t0)


def _forward(g: int, table, ps: int, kind: str, window: int, n: int, rids, computed, seq_lens, sampled: bool):
    """One group's FORWARD: per request the blocks it writes (positions ``[computed, seq_len)``)
    and, when sampled, the row entries the forward reads. A sliding-window group reads only
    the blocks from the window's start (``computed - window + 1``), a state group only the
    state entries from ``computed - 1`` on: the worker's tables are append-only and keep the
    ids of blocks the EngineCore released (behind the window, older states), which nothing
    reads any more and may belong to another request by now."""
    first = computed // ps
    last = (seq_lens - 1) // ps
    if (last == first).all():  # decode (or chunks inside one block): one written page each
        written = table[np.arange(n), first].astype(np.int64)
        counts = np.ones(n, np.int64)
    else:
        counts = last - first + 1
        written = np.concatenate([table[i, first[i] : last[i] + 1] for i in range(n)]).astype(np.int64)
    read_pages = read_counts = None
    if sampled:
        read_counts = last + 1
        width = int(read_counts.max())
        block = table[:n, :width].copy() if kind != "full_attention" else table[:n, :width]
        if kind == "sliding_window":
            below = np.maximum(computed - window + 1, 0) // ps
            block[np.arange(width)[None, :] < below[:, None]] = 0
        elif kind == "state":
            below = np.maximum(computed - 1, 0) // ps
            block[np.arange(width)[None, :] < below[:, None]] = 0
        read_pages = block[np.arange(width)[None, :] < read_counts[:, None]]
    # one slot per written page (its first): the probe turns slots into pages
    rt.probes().forward(
        rids, seq_lens, written * ps, written_counts=counts, read_pages=read_pages, read_counts=read_counts, pool=g
    )

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
Only tensor-parallel rank 0 reports: every rank holds the same tables.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from . import _runtime as rt
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


def _announce(runner) -> None:
    """ENGINE_PART once, or the reason this worker stays silent (logged once)."""
    State.part_done = True
    tables = runner.input_batch.block_table.block_tables
    rank = _tp_rank()
    if rank != 0:
        State.worker_silent = f"tensor-parallel rank {rank} (rank 0 reports the shared tables)"
    elif len(tables) != 1:
        State.worker_silent = f"{len(tables)} KV cache groups (a hybrid model): not modelled"
    elif int(tables[0].block_size) != int(runner.cache_config.block_size):
        State.worker_silent = (
            f"kernel block size {tables[0].block_size} differs from the cache's {runner.cache_config.block_size}: "
            "not modelled"
        )
    elif getattr(runner, "speculative_config", None) is not None:
        State.worker_silent = "speculative decoding: not modelled"
    if State.worker_silent:
        log.info("kvguard: this vLLM worker reports no forwards: %s", State.worker_silent)
        return
    State.page_size = int(tables[0].block_size)
    rt.probes().engine_part(os.getppid(), "worker", rank, State.page_size)
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
    ps = State.page_size
    computed = batch.num_computed_tokens_cpu[:n].astype(np.int64)
    scheduled = np.asarray(num_scheduled_tokens[:n], dtype=np.int64)
    seq_lens = computed + scheduled
    table = batch.block_table.block_tables[0].block_table.np
    first = computed // ps
    last = (seq_lens - 1) // ps
    if (last == first).all():  # decode (or chunks inside one block): one written page each
        written = table[np.arange(n), first].astype(np.int64)
        counts = np.ones(n, np.int64)
    else:
        counts = last - first + 1
        written = np.concatenate([table[i, first[i] : last[i] + 1] for i in range(n)]).astype(np.int64)
    read_pages = read_counts = None
    if State.row_sampler.due():
        t0 = time.perf_counter_ns()
        read_counts = last + 1
        width = int(read_counts.max())
        block = table[:n, :width]
        read_pages = block[np.arange(width)[None, :] < read_counts[:, None]]
        State.row_sampler.spent(time.perf_counter_ns() - t0)
    # one slot per written page (its first): the probe turns slots into pages
    rt.probes().forward(
        rids, seq_lens, written * ps, written_counts=counts, read_pages=read_pages, read_counts=read_counts
    )

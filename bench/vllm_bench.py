"""The vLLM adapter's probe cost per decode step, on real vLLM objects (no model, no server).

Run with vLLM's environment (``bench/run.py`` does: ``.venv/vllm/<version>/bin/python -m
bench.vllm_bench``). What a decode step of vLLM's v1 engine does to the KV bookkeeping is
done here with vLLM's own classes: the scheduler's ``KVCacheManager.allocate_slots(request,
1)`` for every running request (a new block every 32 tokens, from the real ``BlockPool``),
then the Worker's ``_prepare_inputs`` view of the batch: a real ``MultiGroupBlockTable``
holding the same rows. kvguard's hooks are installed as the plugin installs them, writing
to a real ring; the figure is the CPU time spent in the hooks' own code per step
(``thread_time_ns``, the clock reads charged by the meter subtracted), EngineCore and
Worker together: the block pool's hooks inside ``allocate_slots``, the scheduler's per-step
hook on the step's rows (fed the real ``CachedRequestData`` a step produces) and the
Worker's per-forward hook. Batch 256 at ~1k tokens of context per request.

``--shape``: ``mha`` (one full-attention group of 32-token blocks, 8 kv heads), ``mla`` (one
``MLAAttentionSpec`` group: a 576-wide latent, 16-token blocks, as vLLM's CPU MLA backends
take), ``hybrid`` (a sliding-window group, window 256, and a full-attention group: a row per
group, the window's blocks released while the requests decode; hooks_groups.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

CONTEXT_TOKENS = 1024  # each request starts with this many tokens and decodes from there
BLOCK = 32


class SchedulerOutputView:
    """The two fields of ``SchedulerOutput`` the hook reads (the real one needs a whole step's worth)."""

    def __init__(self, new_reqs, cached):
        self.scheduled_new_reqs, self.scheduled_cached_reqs = new_reqs, cached


class Meter:
    def __init__(self):
        self.cpu = 0
        self.calls = 0

    def wrap(self, fn):
        if fn is None:
            return None

        def call(*args, **kwargs):
            c = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.thread_time_ns() - c
                self.calls += 1

        return call


def meter_overhead_ns(n: int = 5000) -> float:
    m = Meter()
    f = m.wrap(lambda: None)
    for _ in range(n):
        f()
    return m.cpu / n


WINDOW = 256  # the hybrid shape's sliding window


def _specs(shape: str):
    """(block size, the KV cache groups' specs) of a shape."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    if shape == "mha":
        return BLOCK, [FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)]
    if shape == "mla":
        return 16, [MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)]
    if shape == "hybrid":
        return BLOCK, [
            SlidingWindowSpec(
                block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=WINDOW
            ),
            FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16),
        ]
    raise ValueError(f"shape must be mha, mla or hybrid, got {shape!r}")


def bench(batch: int, steps: int, ring_dir: str, shape: str = "mha") -> dict:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import CachedRequestData
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from kvguard.engine_hooks import probes as probes_mod
    from kvguard.engine_hooks.probes import Probes
    from kvguard.engine_hooks.ring import RingWriter
    from kvguard.engine_hooks.vllm import _runtime as rt
    from kvguard.engine_hooks.vllm import hooks_core as hc
    from kvguard.engine_hooks.vllm import hooks_worker as hw
    from kvguard.engine_hooks.vllm import plugin

    block, specs = _specs(shape)
    max_len = CONTEXT_TOKENS + steps + block
    per_req = -(-max_len // block)
    num_blocks = batch * per_req * len(specs) + 1
    groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    # (no prefix caching: the requests carry no block hasher; the hooks do the same work either way)
    manager = KVCacheManager(
        cfg, max_model_len=max_len, scheduler_block_size=block, hash_block_size=block, enable_caching=False
    )
    n_groups = len(specs)

    writer = RingWriter(ring_dir, 64 << 20)
    probes_mod.reset_probes_for_tests(Probes(writer, page_size=BLOCK))
    rt.State.reset()
    meter = Meter()
    targets = []
    for t in plugin.TARGETS:  # every hook as the plugin installs it, each one metered
        targets.append(t)
    timed = [
        plugin.Target(t.module, t.cls, t.attr, t.params, meter.wrap(t.pre), meter.wrap(t.post), t.custom)
        for t in targets
    ]
    saved = plugin.TARGETS
    plugin.TARGETS = tuple(timed)
    try:
        plugin.install("0.32.0")
    finally:
        plugin.TARGETS = saved
    scheduler = type("Scheduler", (), {"requests": {}})()
    scheduler.kv_cache_config, scheduler.kv_cache_manager, scheduler.max_model_len = cfg, manager, max_len
    scheduler.vllm_config = type(
        "VllmConfig",
        (),
        {
            "kv_transfer_config": None,
            "speculative_config": None,
            "model_config": type("M", (), {"served_model_name": "bench", "hf_config": None})(),
            "cache_config": type("CC", (), {"cache_dtype": "auto", "enable_prefix_caching": False})(),
            "parallel_config": type("P", (), {})(),
        },
    )()
    hc.scheduler_init_post(None, None, scheduler)  # HELLO, its pools and COVERAGE, as the engine's hook sends them
    assert rt.State.hello_done, "the bench's engine shape is not one kvguard watches"

    params = SamplingParams(max_tokens=steps + 8)
    reqs = []
    for i in range(batch):
        r = Request(f"bench-{i}", list(range(1, CONTEXT_TOKENS + 1)), params, None, cache_salt=None)
        manager.allocate_slots(r, CONTEXT_TOKENS)
        r.num_computed_tokens = CONTEXT_TOKENS
        reqs.append(r)
    table = MultiGroupBlockTable(
        max_num_reqs=batch,
        max_num_batched_tokens=max(8192, batch),
        pin_memory=False,
        device=torch.device("cpu"),
        block_sizes=[block] * n_groups,
        max_num_blocks=[per_req] * n_groups,
    )
    for i, r in enumerate(reqs):
        table.add_row(tuple(manager.get_block_ids(r.request_id)), i)

    class Batch:
        num_reqs = batch
        req_ids = [r.request_id for r in reqs]
        num_computed_tokens_cpu = np.array([r.num_computed_tokens for r in reqs], np.int32)
        block_table = table

    class Runner:
        input_batch = Batch
        cache_config = type("C", (), {"block_size": block})
        speculative_config = None
        kv_cache_config = cfg

    scheduled = np.ones(batch, np.int32)
    execute = meter.wrap(hw.execute_model_pre)
    prepare = meter.wrap(hw.prepare_inputs_pre)
    schedule_post = meter.wrap(hc.schedule_post)
    update_from_output = meter.wrap(hc.update_from_output_post)
    for r in reqs:  # (their first step: a new request's whole row)
        ids = manager.get_block_ids(r.request_id)
        rt.State.rows[r.request_id] = len(ids[0])
        for g, rows in enumerate(rt.State.group_rows):
            rows[r.request_id] = list(ids[g])
        rt.State.begun[r.request_id] = True
    overhead = meter_overhead_ns()
    per_step = []
    reader_pos = writer._write_pos
    for _step in range(steps):
        meter.cpu = meter.calls = 0
        gained = []
        for i, r in enumerate(reqs):  # the scheduler's decode step
            before = [len(g) for g in manager.get_block_ids(r.request_id)]
            manager.allocate_slots(r, 1)
            ids = manager.get_block_ids(r.request_id)
            new = tuple(list(ids[g][before[g] :]) for g in range(n_groups))
            if any(new):
                table.append_row(new, i)
                gained.append(new)
            else:
                gained.append(None)
        out = SchedulerOutputView(
            [],
            CachedRequestData(
                req_ids=[r.request_id for r in reqs],
                resumed_req_ids=set(),
                new_token_ids=[],
                all_token_ids={},
                new_block_ids=gained,
                num_computed_tokens=[r.num_computed_tokens for r in reqs],
                num_output_tokens=[0] * batch,
            ),
        )
        schedule_post(None, out, scheduler)  # what Scheduler.schedule's hook sees
        execute(Runner, None)  # the worker's step begins (its first: ENGINE_PART)
        prepare(Runner, None, scheduled)  # the worker's view of the same step
        update_from_output(None, None, scheduler, out)  # the step's output (TTFT, connector stores)
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(7)
        Batch.num_computed_tokens_cpu += 1
        per_step.append((meter.cpu - meter.calls * overhead) / 1e3)
        writer._u64[16] = writer._write_pos  # a consumer keeping up (read_pos): the ring never fills
    plugin.uninstall()
    probes = probes_mod.get_probes()
    errors, disabled = probes.probe_errors, sorted(rt.disabled_hooks() | probes.disabled_probes)
    ring_bytes, dropped = writer._write_pos - reader_pos, writer.dropped_records
    writer.close(unlink=True)
    probes_mod.reset_probes_for_tests(None)
    body = per_step[2:] or per_step
    return {
        "shape": shape,
        "groups": n_groups,
        "batch": batch,
        "steps": steps,
        "probe_cpu_us_per_step": round(statistics.mean(body), 1),
        "probe_cpu_us_per_step_median": round(statistics.median(body), 1),
        # each step's figure: the mean carries the step where the batch crosses into new blocks
        # (every 32 tokens) and any garbage collection a hook happened to trigger
        "per_step_us": [round(x, 1) for x in per_step],
        "ring_bytes_per_step": round(ring_bytes / steps, 1),
        "meter_overhead_ns_per_call": round(overhead, 1),
        "hook_calls_per_step": meter.calls,
        "probe_errors": errors,
        "disabled_hooks": disabled,
        "dropped_records": dropped,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="mha", help="comma list of mha, mla, hybrid (the first fills 'batches')")
    args = ap.parse_args(argv)
    shapes = [x for x in args.shapes.split(",") if x]
    out: dict = {"batches": {}, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            got = {str(b): bench(b, args.steps, tmp, shape) for b in [int(x) for x in args.batches.split(",") if x]}
            out["shapes"][shape] = got
            if shape == shapes[0]:
                out["batches"] = got
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())

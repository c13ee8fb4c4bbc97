"""Engine-side cost: the SGLang adapter's real hook functions on real SGLang 0.5.23 objects, on CPU.

Run in a subprocess with SGLang on PYTHONPATH (``bench/run.py`` does)::

    PYTHONPATH=.venv/sglang/0.5.23:demo/shim python -m bench.engine_bench --json out.json

What one decode step is here, per batch size B (1, 64, 256), at the reference shape
(page 64, pool 32,768 pages, mean context 32k tokens, 4 shared 26,624-token prefixes):

* a real ``PagedTokenToKVPoolAllocator`` (CPU, torch-native path) and a real
  ``ReqToTokenPool`` whose rows hold each request's token slots;
* the real ``sglang.srt.mem_cache.allocation.alloc_for_decode(batch, 1)`` on a
  ScheduleBatch-shaped namespace (the fields that function and the hooks read), wrapped
  by the adapter's ``alloc_for_decode`` AROUND hook, with the allocator's ``alloc_decode``
  (AROUND) and the pool's ``write`` (AFTER) hooked the way SGLang's HookRegistry wraps
  them;
* a real ``ForwardBatch`` (DECODE) passed to the adapter's ``ModelRunner.forward``
  AROUND hook, whose original is a stub (the model's compute is not kvguard's cost).

Probes write into a real 16 MiB shared-memory ring, drained (decoded) after every step
outside the timed region. The cost charged to kvguard per step is, for every hook,
its own time minus the time of the original it wraps (measured inside the wrapper), so
the engine's own work is never counted. Clocks: ``thread_time_ns`` (CPU of this thread;
torch is set to 1 intra-op thread so all work runs here) and ``perf_counter_ns`` (wall).

Every batch size is measured twice: without and with Tier 1 (engine_hooks/tier1.py,
``KVGUARD_TIER1=1``), the in-engine read check: one page-strided gather of the batch's
rows, a tag gather and a compare per step. On this CPU "device" that work runs on the
host and is charged to the forward hook; on a GPU it is a few small kernels whose
host cost is their launches. The setup reports every request's rows through the probes
(the shared prefixes as SHARED, the private pages as the request's own), so Tier 1
checks real tags; a bench step with a violation would be a false alarm, and is counted
(``tier1_violations``, expected 0).

The ring is written through once before measuring: a production ring is warm after
its first few seconds, and first-touch page faults on a fresh 16 MiB ring would
otherwise be charged to the first sampled-row steps.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

PAGE = 64
POOL_PAGES = 32_768
PREFIX_TOKENS = 26_624
PREFIX_GROUPS = 4
PROMPT_TOKENS = 5_184
OUTPUT_TOKENS = 1_920


class Meter:
    """Time of a hook minus the time of the original it wraps, on two clocks."""

    def __init__(self, name: str):
        self.name = name
        self.cpu = self.wall = self.inner_cpu = self.inner_wall = 0
        self.calls = 0

    def reset(self) -> None:
        self.cpu = self.wall = self.inner_cpu = self.inner_wall = self.calls = 0

    @property
    def own_cpu(self) -> int:
        return self.cpu - self.inner_cpu

    @property
    def own_wall(self) -> int:
        return self.wall - self.inner_wall

    def around(self, hook, original):
        """``hook(original, *args)`` as HookRegistry's AROUND wrapper calls it, timed."""

        def inner(*args, **kwargs):
            c, w = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self.inner_cpu += time.thread_time_ns() - c
                self.inner_wall += time.perf_counter_ns() - w

        def call(*args, **kwargs):
            c, w = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return hook(inner, *args, **kwargs)
            finally:
                self.cpu += time.thread_time_ns() - c
                self.wall += time.perf_counter_ns() - w
                self.calls += 1

        return call

    def after(self, hook, original):
        """HookRegistry's AFTER wrapper: the original, then ``hook(result, *args)`` (timed)."""

        def call(*args, **kwargs):
            result = original(*args, **kwargs)
            c, w = time.thread_time_ns(), time.perf_counter_ns()
            hook(result, *args, **kwargs)
            self.cpu += time.thread_time_ns() - c
            self.wall += time.perf_counter_ns() - w
            self.calls += 1
            return result

        return call


def _generated(i: int, batch: int) -> int:
    return ((2 * i + 1) * OUTPUT_TOKENS) // (2 * batch)  # staggered; mean 960, so mean context 32,768


class Engine:
    """One decode rank's batch of B requests on real SGLang objects, hooks applied."""

    def __init__(self, batch: int, steps: int, ring_dir: str, tier1: bool = False):
        import torch
        from sglang.srt.mem_cache import allocation
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from kvguard.engine_hooks import probes as probes_mod
        from kvguard.engine_hooks import row_sampler
        from kvguard.engine_hooks.ring import RingReader, RingWriter
        from kvguard.engine_hooks.sglang import _runtime as rt
        from kvguard.engine_hooks.sglang import hooks_allocator as ha
        from kvguard.engine_hooks.sglang import hooks_rows as hr

        self.torch, self.hr, self.rt = torch, hr, rt
        self.batch = batch
        rt.State.reset()
        rt.State.row_sampler = row_sampler.from_env()  # what the plugin ships (the budget unless set)
        self.writer = RingWriter(ring_dir)
        self.reader = RingReader(self.writer.path)
        self.probes = probes_mod.Probes(self.writer, page_size=PAGE)
        probes_mod.reset_probes_for_tests(self.probes)
        self.probes.hello(
            "decode", 0, PAGE, POOL_PAGES, POOL_PAGES * PAGE, 131_072, 131_072, "sglang", "0.5.23", "bench-glm-mla"
        )
        rt.State.page_size = PAGE
        if tier1:
            self.probes.start_tier1(POOL_PAGES)

        alloc = PagedTokenToKVPoolAllocator(POOL_PAGES * PAGE, PAGE, torch.bfloat16, "cpu", None, False)
        cap = PREFIX_TOKENS + PROMPT_TOKENS + OUTPUT_TOKENS + steps + PAGE
        pool = ReqToTokenPool(size=batch, max_context_len=cap, device="cpu", enable_memory_saver=False)
        prefixes = [alloc.alloc(PREFIX_TOKENS) for _ in range(PREFIX_GROUPS)]
        reqs, seqs = [], []
        for i in range(batch):
            private = PROMPT_TOKENS + _generated(i, batch)
            slots = alloc.alloc(math.ceil(private / PAGE) * PAGE)[:private]
            seq = PREFIX_TOKENS + private
            pool.req_to_token[i + 1, :seq] = torch.cat((prefixes[i % PREFIX_GROUPS], slots)).to(torch.int32)
            reqs.append(
                SimpleNamespace(
                    rid=f"bench-req-{i}",
                    kv=SimpleNamespace(req_pool_idx=i + 1, kv_allocated_len=seq, kv_committed_len=seq, holds_kv=True),
                )
            )
            seqs.append(seq)
        rt.State.hello_done = True
        # what the adapter would have reported while these requests were admitted and prefilled
        for g in prefixes:
            self.probes.pages_allocated(g)
        for i, r in enumerate(reqs):
            row = pool.req_to_token[i + 1, : seqs[i]]
            self.probes.pages_allocated(row[PREFIX_TOKENS:])
            hr._pool_alloc_post(True, pool, [r])
            self.probes.rows_assigned(r.rid, 0, seqs[i], PREFIX_TOKENS, row)

        # hooks, wrapped the way HookRegistry wraps them (instance attributes: no global patching)
        self.meters = {n: Meter(n) for n in ("alloc_decode", "write", "alloc_for_decode", "forward")}
        m = self.meters
        hooked_alloc_decode = m["alloc_decode"].around(
            ha.alloc_hook("PagedTokenToKVPoolAllocator.alloc_decode"), PagedTokenToKVPoolAllocator.alloc_decode
        )
        alloc.alloc_decode = lambda *a, **k: hooked_alloc_decode(alloc, *a, **k)
        hooked_write = m["write"].after(hr.write_hook("ReqToTokenPool.write"), ReqToTokenPool.write)
        pool.write = lambda *a, **k: hooked_write(pool, *a, **k)
        self.alloc_for_decode = m["alloc_for_decode"].around(
            hr.alloc_for_decode_hook("alloc_for_decode"), allocation.alloc_for_decode
        )
        self.forward = m["forward"].around(hr.forward_hook("ModelRunner.forward"), lambda runner, fb: None)

        tree_cache = SimpleNamespace(
            token_to_kv_pool_allocator=alloc, page_size=PAGE, supports_prefix_sharing=lambda: False
        )
        self.sched = SimpleNamespace(
            reqs=reqs,
            seq_lens=torch.tensor(seqs, dtype=torch.int64),
            seq_lens_cpu=torch.tensor(seqs),
            req_pool_indices=torch.arange(1, batch + 1, dtype=torch.int64),
            req_pool_indices_cpu=torch.arange(1, batch + 1, dtype=torch.int64),
            req_to_token_pool=pool,
            tree_cache=tree_cache,
            model_config=SimpleNamespace(is_encoder_decoder=False),
            device="cpu",
            maybe_evict_swa=lambda: None,
            encoder_lens=None,
        )
        self.runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
        self.pool, self.alloc = pool, alloc
        self.records = self.bytes = 0
        self.warm_ring()
        self.records = self.bytes = 0

    def warm_ring(self) -> None:
        """Write the ring through once (drained as it goes), as a running engine's ring is."""
        import numpy as np

        from kvguard.engine_hooks import wire

        filler = wire.pages_payload(np.zeros(16_000, np.int64))
        for _ in range(self.writer.capacity // len(filler) + 2):
            self.writer.write(wire.Kind.ALLOC, filler)
            self.drain()

    def forward_batch(self, out_cache_loc):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        b = self.sched
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=self.batch,
            input_ids=self.torch.zeros(self.batch, dtype=self.torch.int64),
            req_pool_indices=b.req_pool_indices,
            seq_lens=b.seq_lens,
            out_cache_loc=out_cache_loc,
            seq_lens_sum=int(b.seq_lens_cpu.sum()),
            seq_lens_cpu=b.seq_lens_cpu,
            rids=[r.rid for r in b.reqs],
        )

    def step(self):
        """alloc_for_decode -> seq_lens + 1 -> ModelRunner.forward, as the scheduler does."""
        out = self.alloc_for_decode(self.sched, 1)
        self.sched.seq_lens = self.sched.seq_lens + 1
        self.sched.seq_lens_cpu = self.sched.seq_lens_cpu + 1
        fb = self.forward_batch(out)
        self.forward(self.runner, fb)
        return fb

    def drain(self) -> None:
        before = self.reader.read_pos
        result = self.reader.poll(max_bytes=64 << 20)
        self.records += len(result.records)
        self.bytes += self.reader.read_pos - before

    def close(self) -> None:
        from kvguard.engine_hooks import probes as probes_mod

        probes_mod.reset_probes_for_tests(None)
        self.rt.State.reset()
        self.reader.close()
        self.writer.close(unlink=True)


def meter_overhead_cpu_us(calls: int = 2000) -> float:
    """CPU µs one AROUND Meter charges to the hook it times when hook and original do
    nothing (its own clock reads): part of every hook's figure, not kvguard's work."""
    m = Meter("calibration")
    call = m.around(lambda original, *a: original(*a), lambda: None)
    for _ in range(calls):
        call()
    return m.own_cpu / calls / 1e3


def _best_of(fn, repeat: int) -> tuple[float, float]:
    """(CPU µs, wall µs): the median of ``repeat`` calls."""
    cpu, wall = [], []
    for _ in range(repeat):
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        cpu.append(time.thread_time_ns() - c)
        wall.append(time.perf_counter_ns() - w)
    return statistics.median(cpu) / 1e3, statistics.median(wall) / 1e3


def bench_batch(batch: int, steps: int, warmup: int = 3, profile: bool = False, tier1: bool = False) -> dict:
    tmp = tempfile.mkdtemp(prefix="kvg-eng-")
    eng = Engine(batch, steps + warmup, tmp, tier1=tier1)
    try:
        for _ in range(warmup):
            eng.step()
            eng.drain()
        for m in eng.meters.values():
            m.reset()
        eng.records = eng.bytes = 0
        t1 = eng.probes.tier1
        checks0 = t1.checks if t1 else 0
        samples0 = eng.rt.State.row_sampler.samples
        per_step_cpu = []
        prof = cProfile.Profile() if profile else None
        fb = None
        for _ in range(steps):
            before = sum(m.own_cpu for m in eng.meters.values())
            if prof:
                prof.enable()
            fb = eng.step()
            if prof:
                prof.disable()
            per_step_cpu.append(sum(m.own_cpu for m in eng.meters.values()) - before)
            eng.drain()
        m = eng.meters
        own_cpu = sum(x.own_cpu for x in m.values()) / steps / 1e3
        own_wall = sum(x.own_wall for x in m.values()) / steps / 1e3
        out = {
            "batch": batch,
            "steps": steps,
            "tier1": tier1,
            "probe_cpu_us_per_step": own_cpu,
            "probe_cpu_us_per_step_median": statistics.median(per_step_cpu) / 1e3,
            "probe_cpu_us_per_step_max": max(per_step_cpu) / 1e3,
            "probe_wall_us_per_step": own_wall,
            "by_hook_cpu_us": {n: x.own_cpu / steps / 1e3 for n, x in m.items()},
            # the engine's own CPU work inside the hooked alloc_for_decode (context, not kvguard's cost)
            "engine_alloc_for_decode_cpu_us": (
                m["alloc_for_decode"].inner_cpu - m["alloc_decode"].own_cpu - m["write"].own_cpu
            )
            / steps
            / 1e3,
            "row_samples": eng.rt.State.row_sampler.samples - samples0,  # forwards that carried the rows
            "records_per_step": eng.records / steps,
            "ring_bytes_per_step": eng.bytes / steps,
            "dropped_records": eng.writer.dropped_records,
            "probe_errors": eng.probes.probe_errors,
            "disabled_hooks": sorted(eng.rt.disabled_hooks()),
            "tier1_checks": t1.checks - checks0 if t1 else 0,  # in the measured steps
            "tier1_violations": t1.violations if t1 else 0,
            "tier1_errors": t1.errors if t1 else 0,
        }
        # the timers' own share of the figure above: one AROUND meter per alloc_for_decode,
        # alloc_decode and forward call (the AFTER write meter reads its clocks outside the hook)
        arounds = sum(m[n].calls for n in ("alloc_for_decode", "alloc_decode", "forward")) / steps
        out["meter_overhead_cpu_us_per_step"] = meter_overhead_cpu_us() * arounds
        out["components_cpu_us"] = components(eng, fb)
        if prof:
            from bench.sidecar_bench import top_functions

            out["profile"] = top_functions(prof, 12)
        return out
    finally:
        eng.close()
        shutil.rmtree(tmp, ignore_errors=True)


def components(eng: Engine, fb) -> dict:
    """Parts of the forward hook, each timed alone on the last step's inputs (µs of CPU)."""
    import numpy as np

    from kvguard.engine_hooks import wire
    from kvguard.engine_hooks.tier1 import Tier1

    hr, p = eng.hr, eng.probes
    rids = list(fb.rids)
    seq = fb.seq_lens_cpu.numpy().astype(np.int64)
    req_to_token = eng.pool.req_to_token
    repeat = 5 if eng.batch >= 64 else 50
    res = {
        "request_keys_hashed": _best_of(lambda: [wire.request_key(r) for r in rids], repeat)[0],
        "request_keys_cached": _best_of(lambda: p.request_keys(rids), repeat)[0],
        "row_page_starts_gather": _best_of(
            lambda: hr._row_page_starts(req_to_token, fb.req_pool_indices, seq, PAGE), repeat
        )[0],
    }
    t1 = p.tier1 or Tier1(POOL_PAGES, PAGE)
    res["tier1_check"] = _best_of(
        lambda: t1.check(req_to_token, fb.req_pool_indices, fb.seq_lens, rids, int(seq.max())), repeat
    )[0]
    res.update(content_check_parts(req_to_token, fb, seq, repeat))
    return res


CONTENT_BUDGETS = (128, 512)  # KVGUARD_CONTENT_CHECK=N: read slots verified per forward (the first is the figure)
CONTENT_SLOTS = 131_072  # a host KV buffer of 8 heads x 128 dims bf16 (a Llama-3-8B layer): 256 MiB per K or V


def content_check_parts(req_to_token, fb, seq, repeat: int) -> dict:
    """The content check's per-step work (engine_hooks/content.py): the verify before a
    forward (pick CONTENT_BUDGET of the readers' slots, gather their rows' slots, re-hash,
    compare) and the record after it (hash the batch's written slots), on a layer-0 K/V
    buffer of a real model's per-slot size. Slot ids are taken modulo the buffer (the
    bench's pool is larger than memory would hold at this size); the cost per slot is the same."""
    import numpy as np
    import torch

    from kvguard.engine_hooks import content as ct
    from kvguard.engine_hooks.sglang import content_hooks

    k = torch.zeros(CONTENT_SLOTS, 8, 128, dtype=torch.bfloat16)
    v = torch.zeros(CONTENT_SLOTS, 8, 128, dtype=torch.bfloat16)
    check = ct.ContentCheck(k, v, CONTENT_BUDGETS[0])
    check.written(np.arange(1, CONTENT_SLOTS))  # every slot fingerprinted (touches the buffer once)
    wrapped = torch.remainder(req_to_token, CONTENT_SLOTS)
    out = (fb.out_cache_loc.numpy() % CONTENT_SLOTS).astype(np.int64)
    res = {"content_written": _best_of(lambda: check.written(out), repeat)[0]}
    for budget in CONTENT_BUDGETS:
        check.budget = budget
        res[f"content_verify_{budget}"] = _best_of(
            lambda: content_hooks.verify_reads(check, wrapped, fb.req_pool_indices, seq - 1), repeat
        )[0]
    assert check.slots_changed == 0
    return res


def run(batches=(1, 64, 256), steps: int = 40, profile_batch: int | None = None) -> dict:
    """``profile_batch``: also run that batch size once more under cProfile and keep only
    its profile. Never the measured run: the profiler's per-call cost doubled the figures
    at batch 256 (226 µs mean under cProfile against 126 without, same minutes)."""
    import torch

    torch.set_num_threads(1)
    import sglang

    results = {
        "sglang_version": getattr(sglang, "__version__", "?"),
        "torch_version": torch.__version__,
        "batches": {},
        "batches_tier1": {},
    }
    for b in batches:
        n = steps if b > 1 else steps * 4
        results["batches"][str(b)] = bench_batch(b, n)
        results["batches_tier1"][str(b)] = bench_batch(b, n, tier1=True)
        if b == profile_batch:
            results["batches"][str(b)]["profile"] = bench_batch(b, n, profile=True)["profile"]
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="add a cProfile of the largest batch (a separate run: the figures are measured without it)",
    )
    args = ap.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    res = run(batches, args.steps, profile_batch=max(batches) if args.profile else None)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

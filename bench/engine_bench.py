"""Engine-side cost: the SGLang adapter's real hook functions on real SGLang 0.5.23 objects, on CPU.

Run in a subprocess with SGLang on PYTHONPATH (``bench/run.py`` does)::

    PYTHONPATH=.venv/sglang/0.5.23:sidecar/demo/shim python -m bench.engine_bench --json out.json

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

Tier 1 (the on-device read check) does not exist yet: its figure is reported as null.
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

    def __init__(self, batch: int, steps: int, ring_dir: str):
        import torch
        from sglang.srt.mem_cache import allocation
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from engine_hooks import probes as probes_mod
        from engine_hooks.ring import RingReader, RingWriter
        from engine_hooks.sglang import _runtime as rt
        from engine_hooks.sglang import hooks_allocator as ha
        from engine_hooks.sglang import hooks_rows as hr

        self.torch, self.hr, self.rt = torch, hr, rt
        self.batch = batch
        rt.State.reset()
        self.writer = RingWriter(ring_dir)
        self.reader = RingReader(self.writer.path)
        self.probes = probes_mod.Probes(self.writer, page_size=PAGE)
        probes_mod.reset_probes_for_tests(self.probes)
        self.probes.hello("decode", 0, PAGE, POOL_PAGES, POOL_PAGES * PAGE, 131_072, 131_072, "sglang", "0.5.23",
                          "bench-glm-mla")
        rt.State.page_size = PAGE

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
            reqs.append(SimpleNamespace(rid=f"bench-req-{i}", kv=SimpleNamespace(
                req_pool_idx=i + 1, kv_allocated_len=seq, kv_committed_len=seq, holds_kv=True)))
            seqs.append(seq)
        rt.State.hello_done = True

        # hooks, wrapped the way HookRegistry wraps them (instance attributes: no global patching)
        self.meters = {n: Meter(n) for n in ("alloc_decode", "write", "alloc_for_decode", "forward")}
        m = self.meters
        hooked_alloc_decode = m["alloc_decode"].around(
            ha.alloc_hook("PagedTokenToKVPoolAllocator.alloc_decode"), PagedTokenToKVPoolAllocator.alloc_decode)
        alloc.alloc_decode = lambda *a, **k: hooked_alloc_decode(alloc, *a, **k)
        hooked_write = m["write"].after(hr.write_hook("ReqToTokenPool.write"), ReqToTokenPool.write)
        pool.write = lambda *a, **k: hooked_write(pool, *a, **k)
        self.alloc_for_decode = m["alloc_for_decode"].around(hr.alloc_for_decode_hook("alloc_for_decode"),
                                                             allocation.alloc_for_decode)
        self.forward = m["forward"].around(hr.forward_hook("ModelRunner.forward"), lambda runner, fb: None)

        tree_cache = SimpleNamespace(token_to_kv_pool_allocator=alloc, page_size=PAGE,
                                     supports_prefix_sharing=lambda: False)
        self.sched = SimpleNamespace(
            reqs=reqs, seq_lens=torch.tensor(seqs, dtype=torch.int64), seq_lens_cpu=torch.tensor(seqs),
            req_pool_indices=torch.arange(1, batch + 1, dtype=torch.int64),
            req_pool_indices_cpu=torch.arange(1, batch + 1, dtype=torch.int64), req_to_token_pool=pool,
            tree_cache=tree_cache, model_config=SimpleNamespace(is_encoder_decoder=False), device="cpu",
            maybe_evict_swa=lambda: None, encoder_lens=None)
        self.runner = SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
        self.pool, self.alloc = pool, alloc
        self.records = self.bytes = 0

    def forward_batch(self, out_cache_loc):
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        b = self.sched
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=self.batch,
                            input_ids=self.torch.zeros(self.batch, dtype=self.torch.int64),
                            req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens, out_cache_loc=out_cache_loc,
                            seq_lens_sum=int(b.seq_lens_cpu.sum()), seq_lens_cpu=b.seq_lens_cpu,
                            rids=[r.rid for r in b.reqs])

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
        from engine_hooks import probes as probes_mod

        probes_mod.reset_probes_for_tests(None)
        self.rt.State.reset()
        self.reader.close()
        self.writer.close(unlink=True)


def _best_of(fn, repeat: int) -> tuple[float, float]:
    """(CPU µs, wall µs): the median of ``repeat`` calls."""
    cpu, wall = [], []
    for _ in range(repeat):
        c, w = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        cpu.append(time.thread_time_ns() - c)
        wall.append(time.perf_counter_ns() - w)
    return statistics.median(cpu) / 1e3, statistics.median(wall) / 1e3


def bench_batch(batch: int, steps: int, warmup: int = 3, profile: bool = False) -> dict:
    tmp = tempfile.mkdtemp(prefix="kvg-eng-")
    eng = Engine(batch, steps + warmup, tmp)
    try:
        for _ in range(warmup):
            eng.step()
            eng.drain()
        for m in eng.meters.values():
            m.reset()
        eng.records = eng.bytes = 0
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
            "probe_cpu_us_per_step": own_cpu,
            "probe_cpu_us_per_step_median": statistics.median(per_step_cpu) / 1e3,
            "probe_wall_us_per_step": own_wall,
            "by_hook_cpu_us": {n: x.own_cpu / steps / 1e3 for n, x in m.items()},
            # the engine's own CPU work inside the hooked alloc_for_decode (context, not kvguard's cost)
            "engine_alloc_for_decode_cpu_us": (m["alloc_for_decode"].inner_cpu - m["alloc_decode"].own_cpu
                                               - m["write"].own_cpu) / steps / 1e3,
            "records_per_step": eng.records / steps,
            "ring_bytes_per_step": eng.bytes / steps,
            "dropped_records": eng.writer.dropped_records,
            "probe_errors": eng.probes.probe_errors,
            "disabled_hooks": sorted(eng.rt.disabled_hooks()),
        }
        out["components_cpu_us"] = components(eng, fb)
        out["proposals"] = proposals(eng, fb)
        if prof:
            from bench.sidecar_bench import top_functions

            out["profile"] = top_functions(prof, 12)
        return out
    finally:
        eng.close()
        shutil.rmtree(tmp, ignore_errors=True)


def components(eng: Engine, fb) -> dict:
    """Where the forward hook's time goes, on the last step's inputs (each part timed alone)."""
    from engine_hooks import wire

    torch, hr, p = eng.torch, eng.hr, eng.probes
    n = eng.batch
    seq_lens = [int(x) for x in fb.seq_lens_cpu.tolist()]
    rows = [int(x) for x in fb.req_pool_indices.tolist()]
    out = fb.out_cache_loc.reshape(-1).to("cpu")
    written = list(torch.split(out, [1] * n))
    req_to_token = eng.pool.req_to_token
    block = hr._rows_block(req_to_token, rows, max(seq_lens))
    read_rows = [block[i, : seq_lens[i]] for i in range(n)]
    rids = list(fb.rids)
    repeat = 5 if n >= 64 else 50
    res = {}
    res["rows_block_copy"] = _best_of(lambda: hr._rows_block(req_to_token, rows, max(seq_lens)), repeat)[0]
    res["probes_forward_with_rows"] = _best_of(lambda: p.forward(rids, seq_lens, written, read_rows), repeat)[0]
    eng.drain()
    res["probes_forward_without_rows"] = _best_of(lambda: p.forward(rids, seq_lens, written, None), repeat)[0]
    eng.drain()
    res["request_keys_xxh3"] = _best_of(lambda: [wire.request_key(r) for r in rids], repeat)[0]
    res["rows_assigned_x_batch"] = _best_of(
        lambda: [p.rows_assigned(r, s - 1, s, s - 1, written[i]) for i, (r, s) in enumerate(zip(rids, seq_lens))],
        repeat)[0]
    eng.drain()
    return res


def proposals(eng: Engine, fb) -> dict:
    """Prototypes of cheaper probes on the same inputs, each checked to emit the same bytes.

    Timings include publishing into the ring.

    * ``forward_no_rows``: the FORWARD the adapter would send without rows,
      built with whole-batch numpy (request keys cached per rid, write pages as one
      ``out_cache_loc // page_size``), byte-identical to ``Probes.forward(..., None)``.
    * ``forward_rows_page_strided``: the same FORWARD *with* rows, gathering only each
      row's page-start columns (``req_to_token[idx, ::page_size]``, 64x fewer elements than
      the whole token row) and flattening with one mask; byte-identical to what the
      adapter sends today.
    * ``assign_page_starts_only``: ``alloc_for_decode``'s ASSIGNs only for requests whose
      new token starts a page (the others' row pages are already known); ~B/64 records
      instead of B (the sidecar's verdicts on such streams are checked in
      tests/test_bench_smoke.py: a clean stream stays clean).
    """
    import numpy as np

    from engine_hooks import wire

    from .workload import CaptureWriter

    torch, p = eng.torch, eng.probes
    ps = PAGE
    n = eng.batch
    rids = list(fb.rids)
    seq_lens = [int(x) for x in fb.seq_lens_cpu.tolist()]
    rows = fb.req_pool_indices
    out = fb.out_cache_loc.reshape(-1)
    req_to_token = eng.pool.req_to_token
    block = eng.hr._rows_block(req_to_token, [int(r) for r in rows.tolist()], max(seq_lens))
    read_rows = [block[i, : seq_lens[i]] for i in range(n)]
    written = list(torch.split(out, [1] * n))

    def reference(read):
        real, cap = p.writer, CaptureWriter()
        p.writer = cap
        try:
            p.forward(rids, seq_lens, written, read)
        finally:
            p.writer = real
        return cap.items[0][1]

    key_cache = {r: wire.request_key(r) for r in rids}  # filled at REQ_BEGIN in a real probe

    def no_rows(publish: bool = True) -> bytes:
        keys = np.fromiter((key_cache[r] for r in rids), np.uint64, n)
        seq = fb.seq_lens_cpu.numpy().astype(np.uint32)
        wpages = (out.numpy() // ps).astype(np.int32)
        f = wire.Forward(keys, seq, np.ones(n, np.uint32), wpages, None, None, 0)
        payload = wire.forward_payload(f)
        if publish:
            p.writer.write(wire.Kind.FORWARD, payload)
        return payload

    def with_rows(publish: bool = True) -> bytes:
        keys = np.fromiter((key_cache[r] for r in rids), np.uint64, n)
        seq = fb.seq_lens_cpu.numpy()
        counts = -(-seq // ps)
        pages = (req_to_token[rows, : int(counts.max()) * ps : ps] // ps).numpy()  # one small gather
        flat = pages[np.arange(pages.shape[1])[None, :] < counts[:, None]]
        f = wire.Forward(keys, seq.astype(np.uint32), np.ones(n, np.uint32), (out.numpy() // ps).astype(np.int32),
                         counts.astype(np.uint32), flat, 0)
        payload = wire.forward_payload(f)
        if publish:
            p.writer.write(wire.Kind.FORWARD, payload)
        return payload

    old = np.asarray(seq_lens) - 1

    def assign_page_starts():
        starts = np.flatnonzero(old % ps == 0)
        for i in starts.tolist():
            p.rows_assigned(rids[i], int(old[i]), int(old[i]) + 1, int(old[i]), written[i])

    repeat = 5 if n >= 64 else 50
    eng.drain()
    res = {
        "forward_no_rows_us": _best_of(no_rows, repeat)[0],
        "forward_no_rows_identical": no_rows(False) == reference(None),
        "forward_rows_page_strided_us": _best_of(with_rows, repeat)[0],
        "forward_rows_page_strided_identical": with_rows(False) == reference(read_rows),
        "assign_page_starts_only_us": _best_of(assign_page_starts, repeat)[0],
        "assign_page_starts_records": int(np.count_nonzero(old % ps == 0)),
    }
    eng.drain()
    return res


def run(batches=(1, 64, 256), steps: int = 40, profile_batch: int | None = 256) -> dict:
    import torch

    torch.set_num_threads(1)
    import sglang

    results = {"sglang_version": getattr(sglang, "__version__", "?"), "torch_version": torch.__version__,
               "batches": {}}
    for b in batches:
        results["batches"][str(b)] = bench_batch(b, steps if b > 1 else steps * 4, profile=(b == profile_batch))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", required=True, help="write results here")
    args = ap.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    res = run(batches, args.steps, profile_batch=max(batches))
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

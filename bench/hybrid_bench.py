"""Engine-side cost of a hybrid model's second pool on SGLang: what the adapter adds per decode
step, on top of the full-attention pool's hooks (bench/engine_bench.py), for

* a hybrid sliding-window model (GPT-OSS-style, engine_hooks/sglang/hooks_swa.py): the window
  check before ``alloc_for_decode``, the SWA twins of the page-starting slots, and the SWA
  pool's FORWARD (the written slots' twins through the full-to-SWA mapping, then each row's
  bound moved to the next forward's window);
* a hybrid linear-attention model (Qwen3-Next-style, engine_hooks/sglang/hooks_state.py): the
  state pool's FORWARD (each request's slot written and read), with and without the engine's
  own mapping read (the row sampler's choice).

The adapter's own functions run with the real Probes into a real shared-memory ring (16 MiB:
never full in a run, so no record is dropped), at the reference shape of bench/engine_bench.py (64-token pages,
32k-token contexts) and GPT-OSS's 128-token window. CPU of this thread (``thread_time_ns``),
torch on one intra-op thread; the mean and the median per step.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import types

PAGE = 64
WINDOW = 128  # GPT-OSS's sliding window
POOL_PAGES = 32_768
CONTEXT = 32_000


def _named(cls_name: str, **fields):
    obj = type(cls_name, (), {})()
    for key, value in fields.items():
        setattr(obj, key, value)
    return obj


def _setup(ring_dir: str, batch: int):
    import numpy as np
    import torch

    from kvguard.engine_hooks import coverage as cv
    from kvguard.engine_hooks import probes as probes_mod
    from kvguard.engine_hooks.probes import Probes
    from kvguard.engine_hooks.ring import RingWriter
    from kvguard.engine_hooks.sglang import _runtime as rt
    from kvguard.engine_hooks.sglang import hooks_requests as hq

    torch.set_num_threads(1)
    writer = RingWriter(ring_dir, 1 << 24)
    p = Probes(writer, page_size=PAGE)
    probes_mod.reset_probes_for_tests(p)
    rt.State.reset()
    rt.State.page_size = PAGE
    slots = POOL_PAGES * PAGE
    mapping = torch.cat((torch.arange(slots + PAGE, dtype=torch.int64), torch.tensor([-1])))  # twin = same slot
    kvcache = _named("SWAKVPool", swa_kv_pool=_named("MHATokenToKVPool"))
    alloc = _named(
        "SWATokenToKVPoolAllocator",
        swa_attn_allocator=_named("PagedTokenToKVPoolAllocator", size=slots),
        full_to_swa_index_mapping=mapping,
        get_kvcache=lambda: kvcache,
    )
    mamba = _named("MambaSlotAllocator", size=batch + 1)
    rtt = _named(
        "HybridReqToTokenPool",
        mamba_allocator=mamba,
        mamba_pool=None,
        req_index_to_mamba_index_mapping=torch.arange(batch + 1, dtype=torch.int32),
    )
    sched = types.SimpleNamespace(token_to_kv_pool_allocator=alloc, sliding_window_size=WINDOW, req_to_token_pool=rtt)
    p.hello("unified", 0, PAGE, POOL_PAGES, slots, 131_072, 131_072, "sglang", "0.5.23", "bench-hybrid")
    items = [cv.item(c, cv.OWNERSHIP) for c in ("kv_pool", "swa_pool", "state_pool")]
    hq._declare_pools(sched, items)
    rt.State.hello_done = True
    rids = [f"bench-{i:04d}" for i in range(batch)]
    seq = np.array([CONTEXT + 37 * i for i in range(batch)], np.int64)
    for i, rid in enumerate(rids):
        rt.State.swa_nulled[rid] = max(int(seq[i]) - WINDOW, 0) // PAGE * PAGE
        rt.State.state_slot[rid] = i + 1
    runner = types.SimpleNamespace(req_to_token_pool=rtt)
    fb = types.SimpleNamespace(req_pool_indices=torch.arange(1, batch + 1))
    return writer, rids, seq, runner, fb


def bench(batch: int = 256, steps: int = 400) -> dict:
    import numpy as np

    from kvguard.engine_hooks import probes as probes_mod
    from kvguard.engine_hooks.sglang import _runtime as rt
    from kvguard.engine_hooks.sglang import hooks_state, hooks_swa

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        writer, rids, seq, runner, fb = _setup(tmp, batch)
        try:
            ones = np.ones(batch, np.int64)
            written = (np.arange(batch, dtype=np.int64) * 97 + 5) * PAGE  # each request's current page
            swa_steps, state_steps, state_sampled = [], [], []
            assert writer.dropped_records == 0
            for _ in range(steps):
                old = seq.copy()
                t0 = time.thread_time_ns()
                hooks_swa.null_below_window(rids, old, one_step=True)  # alloc_for_decode's pre hook
                starts = np.flatnonzero(old % PAGE == 0)  # page-starting tokens: their twins
                if len(starts):
                    hooks_swa.decode_twins([rids[i] for i in starts.tolist()], old[starts], written[starts])
                seq += 1
                hooks_swa.forward(rids, seq, ones, written + (seq % PAGE), None, None)
                t1 = time.thread_time_ns()
                hooks_state.forward(runner, fb, rids, False)
                t2 = time.thread_time_ns()
                hooks_state.forward(runner, fb, rids, True)
                t3 = time.thread_time_ns()
                swa_steps.append((t1 - t0) / 1e3)
                state_steps.append((t2 - t1) / 1e3)
                state_sampled.append((t3 - t2) / 1e3)
            out["dropped_records"] = writer.dropped_records  # (0: every record was written)
        finally:
            probes_mod.reset_probes_for_tests(None)
            rt.State.reset()
    for key, values in (
        ("swa_extra_us_per_step", swa_steps),
        ("state_extra_us_per_step", state_steps),
        ("state_extra_sampled_us_per_step", state_sampled),
    ):
        out[f"{key}_b{batch}"] = round(statistics.fmean(values), 2)
        out[f"{key}_b{batch}_median"] = round(statistics.median(values), 2)
    return out

"""The GPU section of ``make bench``: kvguard's device-side costs next to a decode-like
attention step over the same KV, as step-time ratios (target: Tier 1 <= 1.01).

Runs when CUDA is present. Without it ``make bench`` skips the section and says so
(``notes["gpu"]``, every ``gpu.*`` figure null); ``run(device="cpu")`` at tiny sizes is
what the smoke test runs so that this code keeps working, and such CPU figures are
never reported as GPU costs.

What one step is (``Shape``, defaults = the reference decode rank of
docs/performance.md on a 70B-class model at TP 8: 8 query heads and 1 kv head per
rank, head_dim 128, bf16, 80 layers, page 64):

* **attention**: for every layer, ``scaled_dot_product_attention`` of one query token
  per sequence over its ``context`` tokens of K and V, laid out per sequence. With one
  kv head per rank that layout is exactly a paged pool whose pages happen to be in
  order, and the kernel reads every KV byte once, as a paged decode kernel does. One
  layer's KV buffer serves every layer (the same bytes read per layer as a real
  model, a fraction of the memory). Projections, MLP and sampling are left out: a
  real step is longer, so the ratios here are upper bounds.
* **Tier 1** (``engine_hooks/tier1.py``, the real class): one check per step over the
  batch's ``req_to_token`` rows, which name the same pages, with tags set through the
  calls the hooks make (bind_row, assigned). Timed as the step with the check issued
  after the attention kernels against the step without it, interleaved.
* **guard** (``KVGUARD_GUARD=full``, docs/guard.md): the same check, its result waited
  for by the guard's ``process_batch_result`` hook where the scheduler waits for the
  step's sampled tokens anyway, plus the guard's two per-step hooks (the real ones, from
  ``bench/guard_bench.py``). Both sides of this ratio end with that wait (a plain step
  synchronizes too), timed on the host clock.
* **content check** (``KVGUARD_CONTENT_CHECK=512`` on a device pool,
  ``engine_hooks/content_device.py``): before the step, 512 of the batch's read slots
  picked on the host and gathered from ``req_to_token`` on the device, fingerprinted there;
  after it, the step's 256 written slots fingerprinted; 16 bytes per slot back through
  pinned memory, looked at on a later step. Timed like Tier 1.
* **device digest** (alg 2 ``device_reduced``, what device pools emit): one
  request's KV, ``context`` tokens of every layer, through the real
  ``transfer_digest`` on a pool view of the same buffer (the reduction on the device,
  8 bytes per (layer, head, token) to the host, xxh3 there). It runs once per
  transfer, not per step: reported per transfer and as the step-time ratio if one
  transfer ended every step (the worst case for a decode rank).

Times: CUDA events around whole steps on the current stream (CPU: perf_counter), the
median of ``steps`` after ``warmup``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

CONTENT_BUDGET = 512  # read slots verified per step (KVGUARD_CONTENT_CHECK=512)


@dataclass(frozen=True)
class Shape:
    batch: int = 256
    context: int = 32_768  # tokens per sequence (the reference mean)
    layers: int = 80
    q_heads: int = 8
    kv_heads: int = 1
    head_dim: int = 128
    page_size: int = 64
    steps: int = 20
    warmup: int = 3

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)

    @property
    def kv_bytes_per_layer(self) -> int:
        return self.batch * self.pages_per_seq * self.page_size * self.kv_heads * self.head_dim * 2 * 2


TINY = Shape(batch=4, context=256, layers=2, q_heads=2, kv_heads=1, head_dim=32, page_size=16, steps=3, warmup=1)


def available() -> tuple[bool, str]:
    """(True, device name) when CUDA is usable here, else (False, why not)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    return True, torch.cuda.get_device_name(0)


class _Pool:
    """An SGLang-like MHA pool for the digest: per layer the same K and V buffers."""

    def __init__(self, k, v, layers: int, page_size: int):
        self.k_buffer, self.v_buffer = [k] * layers, [v] * layers
        self.page_size, self.kv_cache_layout, self.start_layer = page_size, "nhd", 0


class _Timer:
    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def time_ms(self, fn) -> float:
        torch = self.torch
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def run(device: str = "cuda", shape: Shape = Shape()) -> dict:
    import torch
    import torch.nn.functional as F

    from kvguard.engine_hooks import digest as dg
    from kvguard.engine_hooks.tier1 import Tier1

    dev = torch.device(device)
    s = shape
    ps, per_seq = s.page_size, s.pages_per_seq
    tokens_per_seq = per_seq * ps
    slots_total = s.batch * tokens_per_seq + ps  # page 0 stays padding, as in SGLang
    g = torch.Generator(device=dev).manual_seed(0)
    # the pool, in SGLang's NHD layout; each sequence's pages in order from page 1
    k = torch.randn(slots_total, s.kv_heads, s.head_dim, generator=g, device=dev, dtype=torch.bfloat16)
    v = torch.randn(slots_total, s.kv_heads, s.head_dim, generator=g, device=dev, dtype=torch.bfloat16)
    seq_k = k[ps:].view(s.batch, tokens_per_seq, s.kv_heads, s.head_dim).transpose(1, 2)
    seq_v = v[ps:].view(s.batch, tokens_per_seq, s.kv_heads, s.head_dim).transpose(1, 2)
    q = torch.randn(s.batch, s.q_heads, 1, s.head_dim, generator=g, device=dev, dtype=torch.bfloat16)
    gqa = s.q_heads != s.kv_heads

    def attention():
        for _ in range(s.layers):
            F.scaled_dot_product_attention(q, seq_k, seq_v, enable_gqa=gqa)

    # Tier 1 as the hooks feed it: each request binds its row and is assigned its pages
    tier1 = Tier1(s.batch * per_seq + 1, ps)
    rids = [f"r{i}" for i in range(s.batch)]
    req_to_token = torch.zeros(s.batch, tokens_per_seq, dtype=torch.int32, device=dev)
    for i, rid in enumerate(rids):
        pages = torch.arange(1 + i * per_seq, 1 + (i + 1) * per_seq, dtype=torch.int64)
        tier1.bind_row(i, rid)
        tier1.assigned(rid, 0, 0, pages.numpy())
        req_to_token[i] = (pages[:, None] * ps + torch.arange(ps)).reshape(-1).to(dev, torch.int32)
    req_pool_indices = torch.arange(s.batch, device=dev)
    seq_lens = torch.full((s.batch,), s.context, device=dev, dtype=torch.int64)

    def check():
        tier1.check(req_to_token, req_pool_indices, seq_lens, rids, s.context)

    def step_with_tier1():
        attention()
        check()

    timer = _Timer(torch, dev)
    for _ in range(s.warmup):
        attention()
        step_with_tier1()
    plain, with_t1, check_alone = [], [], []
    for _ in range(s.steps):  # interleaved: both see the same clocks and neighbours
        plain.append(timer.time_ms(attention))
        with_t1.append(timer.time_ms(step_with_tier1))
        check_alone.append(timer.time_ms(check))
    tier1.flush()

    # KVGUARD_GUARD=full: the check's result waited for at the scheduler's own wait
    from bench import guard_bench

    def sync():
        if dev.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def plain_synced():
        attention()
        sync()

    with guard_bench.full_hooks(s.batch, tier1) as guard_hooks:

        def step_with_guard():
            attention()
            check()
            guard_hooks()  # waits for the check (Tier 1's flush)
            sync()

        for _ in range(s.warmup):
            plain_synced()
            step_with_guard()
        synced, guarded = [], []
        for _ in range(s.steps):
            synced.append(_wall_ms(plain_synced))
            guarded.append(_wall_ms(step_with_guard))

    # the content check on the device pool: 512 read slots verified, the step's written slots recorded
    content, content_step, content_alone = _content(torch, dev, s, k, v, req_to_token, req_pool_indices, attention)
    for _ in range(s.warmup):
        content_step()
    plain_c, with_c, c_alone = [], [], []
    for _ in range(s.steps):
        plain_c.append(timer.time_ms(attention))
        with_c.append(timer.time_ms(content_step))
        c_alone.append(_wall_ms(content_alone))
    content.flush()

    # the device digest of one request's KV (all layers), on the same buffers
    view = dg.pool_view(_Pool(k, v, s.layers, ps))
    first_seq = torch.arange(ps, ps + s.context, device=dev, dtype=torch.int64)

    def digest():
        dg.transfer_digest(view, first_seq, 0, dg.DEVICE_REDUCED)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(s.warmup):
        digest()
    digest_ms = []
    for _ in range(max(3, s.steps // 4)):
        t0 = time.perf_counter()  # the host part (xxh3 of the reduced units) counts too
        digest()
        digest_ms.append((time.perf_counter() - t0) * 1e3)

    step_ms, step_t1_ms = statistics.median(plain), statistics.median(with_t1)
    d_ms = statistics.median(digest_ms)
    synced_ms, guard_ms = statistics.median(synced), statistics.median(guarded)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shape": asdict(s),
        "kv_gb_read_per_step": s.kv_bytes_per_layer * s.layers / 1e9,
        "step_ms": step_ms,
        "step_tier1_ms": step_t1_ms,
        "tier1_step_ratio": step_t1_ms / step_ms,
        "tier1_check_us": statistics.median(check_alone) * 1e3,
        "tier1_checks": tier1.checks,
        "tier1_violations": tier1.violations,
        "tier1_errors": tier1.errors,
        "step_synced_ms": synced_ms,
        "step_guard_ms": guard_ms,
        "guard_step_ratio": guard_ms / synced_ms,
        "content_step_ratio": statistics.median(with_c) / statistics.median(plain_c),
        "content_check_us": statistics.median(c_alone) * 1e3,
        "content_slots_checked": content.slots_checked,
        "content_slots_changed": content.slots_changed,  # nothing wrote outside the hooks: must be 0
        "digest_ms_per_transfer": d_ms,
        "digest_transfer_gb": s.context * s.layers * s.kv_heads * s.head_dim * 2 * 2 / 1e9,
        "digest_step_ratio_one_transfer_per_step": (step_ms + d_ms) / step_ms,
    }


def _wall_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _content(torch, dev, s: Shape, k, v, req_to_token, req_pool_indices, attention):
    """The device content check on the bench's pool, every slot fingerprinted once (as the
    forwards that wrote them would leave it); returns (check, step with it, the check alone)."""
    import numpy as np

    from kvguard.engine_hooks import content as ct
    from kvguard.engine_hooks.sglang import content_hooks

    check = ct.for_pool(k, v, CONTENT_BUDGET, "device")
    for lo in range(1, k.shape[0], 1 << 20):
        check.written(torch.arange(lo, min(lo + (1 << 20), k.shape[0]), device=dev))
    check.flush()
    written = req_to_token[:, -1].long()  # the step's new token per sequence (its last slot)
    kept = np.full(s.batch, s.context - 1, np.int64)  # what each reader attends over, less the new token

    def alone():
        content_hooks.verify_reads(check, req_to_token, req_pool_indices, kept)
        content_hooks.written(check, written)

    def step():
        content_hooks.verify_reads(check, req_to_token, req_pool_indices, kept)
        attention()
        content_hooks.written(check, written)

    return check, step, alone

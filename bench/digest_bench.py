"""Transfer digest cost (engine_hooks/digest.py) next to raw xxh3 on the same bytes.

* ``raw_xxh3``: raw xxh3-64 over page-sized buffers (one layer's KV of one page of a
  GLM-class MLA model, 64 tokens x (512 latent + 64 rope) x 2 bytes = 73,728 bytes;
  256 distinct pages, 18 MiB, larger than the caches): the ceiling of any digest.
* ``digest_path``: the host digest (alg ``unit_bytes``) of one transfer out of an
  NHD MHA pool (8 kv heads x 128 dims, bf16, page 16 tokens: 64 KiB of K+V per page and
  layer), pages scattered in the pool, against raw xxh3 over exactly those bytes as
  they sit in the pool (each page's K block and V block of each layer, contiguous).
  The digest must gather the tokens head-major first (the definition is per head in
  token order), so it pays one copy of the bytes on top of the hashing.
* ``tiny_transfer_us``: microseconds per transfer on the tests' tiny GPT-2 (2 layers,
  4 kv heads x 16 dims, bf16) for a given prompt length, sender (in 64-token chunks)
  and receiver (one shot); mostly fixed per-(layer, head) costs at this size.

Times are CPU time of the measuring thread (``thread_time_ns``), best of the rounds.
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

PAGE_BYTES = 64 * (512 + 64) * 2  # 73,728


def raw_xxh3(page_bytes: int = PAGE_BYTES, pages: int = 256, rounds: int = 8) -> dict:
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, page_bytes * pages, dtype=np.uint8)
    views = [memoryview(buf[i * page_bytes:(i + 1) * page_bytes]) for i in range(pages)]
    h = xxhash.xxh3_64_intdigest
    best = None
    for _ in range(rounds):
        c0 = time.thread_time_ns()
        for v in views:
            h(v)
        cpu = time.thread_time_ns() - c0
        best = cpu if best is None else min(best, cpu)
    return {"page_bytes": page_bytes, "pages": pages, "gbps": page_bytes * pages / best,  # bytes/ns == GB/s
            "xxhash_version": xxhash.VERSION}


def _best_ns(fn, rounds: int) -> int:
    best = None
    for _ in range(rounds):
        c0 = time.thread_time_ns()
        fn()
        cpu = time.thread_time_ns() - c0
        best = cpu if best is None else min(best, cpu)
    return best


class _Pool:
    """An SGLang-like NHD MHA pool: per layer k_buffer/v_buffer [slots, heads, dim]."""

    def __init__(self, layers: int, heads: int, dim: int, slots: int, page_size: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.page_size, self.kv_cache_layout, self.start_layer = page_size, "nhd", 0
        self.k_buffer = [torch.randn(slots, heads, dim, generator=g).to(torch.bfloat16) for _ in range(layers)]
        self.v_buffer = [torch.randn(slots, heads, dim, generator=g).to(torch.bfloat16) for _ in range(layers)]


def _transfer_slots(tokens: int, pool_slots: int, page_size: int, seed: int = 1) -> np.ndarray:
    """Slots of a ``tokens``-long transfer: whole pages in random order, page-aligned positions."""
    rng = np.random.default_rng(seed)
    n_pages = -(-tokens // page_size)
    pages = rng.permutation(np.arange(1, pool_slots // page_size))[:n_pages]
    return (pages[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)[:tokens].astype(np.int64)


def digest_path(tokens: int = 4096, layers: int = 8, heads: int = 8, dim: int = 128, page_size: int = 16,
                rounds: int = 5) -> dict:
    import torch

    from engine_hooks import digest as dg

    pool_slots = 2 * tokens + page_size
    pool = _Pool(layers, heads, dim, pool_slots, page_size)
    slots = _transfer_slots(tokens, pool_slots, page_size)
    view = dg.pool_view(pool)
    slots_t = torch.as_tensor(slots)
    nbytes = tokens * layers * heads * dim * 2 * 2  # K and V, bf16

    page_starts = slots[::page_size]
    blocks = []
    for buf in pool.k_buffer + pool.v_buffer:
        raw = buf.view(torch.uint8).numpy().reshape(pool_slots, -1)
        for i, s in enumerate(page_starts):
            n = min(page_size, tokens - i * page_size)
            blocks.append(memoryview(raw[s:s + n]).cast("B"))
    h = xxhash.xxh3_64_intdigest

    def raw_same_bytes():
        for b in blocks:
            h(b)

    digest_ns = _best_ns(lambda: dg.transfer_digest(view, slots_t, 0, dg.UNIT_BYTES), rounds)
    raw_ns = _best_ns(raw_same_bytes, rounds)
    return {"tokens": tokens, "layers": layers, "kv_heads": heads, "head_dim": dim, "dtype": "bfloat16",
            "page_size": page_size, "bytes": nbytes, "block_bytes": page_size * heads * dim * 2,
            "digest_ms": digest_ns / 1e6, "raw_ms": raw_ns / 1e6,
            "gbps": nbytes / digest_ns, "raw_same_bytes_gbps": nbytes / raw_ns, "ratio": raw_ns / digest_ns}


def tiny_transfer_us(tokens: int, rounds: int = 20, chunk: int = 64) -> dict:
    """The tests' tiny GPT-2 (sidecar/demo/model.py): 2 layers, 4 kv heads x 16 dims."""
    import torch

    from engine_hooks import digest as dg

    page_size = 4
    pool_slots = 2 * tokens + page_size * 4
    view = dg.pool_view(_Pool(2, 4, 16, pool_slots, page_size))
    slots = torch.as_tensor(_transfer_slots(tokens, pool_slots, page_size))

    def sender():
        s = dg.StreamingDigest(view, 0, dg.UNIT_BYTES)
        for a in range(0, tokens, chunk):
            s.update(slots[a:a + chunk])
        return s.digest()

    def receiver():
        return dg.transfer_digest(view, slots, 0, dg.UNIT_BYTES)

    def receiver_device_reduced():
        return dg.transfer_digest(view, slots, 0, dg.DEVICE_REDUCED)

    assert sender() == receiver()
    return {"tokens": tokens, "kv_bytes": tokens * 2 * 4 * 16 * 2 * 2,
            "sender_chunked_us": _best_ns(sender, rounds) / 1e3,
            "receiver_us": _best_ns(receiver, rounds) / 1e3,
            "receiver_device_reduced_on_cpu_us": _best_ns(receiver_device_reduced, rounds) / 1e3}

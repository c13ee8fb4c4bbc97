"""Transfer digest cost (engine_hooks/digest.py) next to raw xxh3 on the same bytes.

* ``raw_xxh3``: raw xxh3-64 over page-sized buffers (one layer's KV of one page of a
  GLM-class MLA model, 64 tokens x (512 latent + 64 rope) x 2 bytes = 73,728 bytes;
  256 distinct pages, 18 MiB, larger than the caches): the ceiling of any digest.
* ``digest_path``: the host digest (alg ``head_streams``, what the hooks emit for CPU
  pools) of one transfer out of an NHD MHA pool (8 kv heads x 128 dims, bf16, page 16
  tokens: 64 KiB of K+V per page and layer), pages scattered in the pool, against raw
  xxh3 over exactly those bytes as they sit in the pool (each page's K block and V
  block of each layer, contiguous; the faster of the xxhash package and the compiled
  library's own loop), digest and raw timed in interleaved rounds. The digest is what
  the hooks run: the compiled routine (engine_hooks/native) when it loads, which
  hashes each head's rows where they lie; the numpy path (one gather copy of the
  bytes, then the hash) is timed alongside, as are the same bytes as one contiguous
  buffer and alg 1 (``unit_bytes``, K and V interleaved per token: gather, then an
  interleaving copy).
* ``tiny_transfer_us``: microseconds per transfer on the tests' tiny GPT-2 (2 layers,
  4 kv heads x 16 dims, bf16) for a given prompt length, sender (in 64-token chunks)
  and receiver (one shot); mostly fixed per-(layer, head) costs at this size.

Times are CPU time of the whole process (``process_time_ns``, so that work torch
may hand to its intra-op threads is counted too; nothing else runs meanwhile), best of
the rounds.
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

from kvguard.engine_hooks import native

PAGE_BYTES = 64 * (512 + 64) * 2  # 73,728


def raw_xxh3(page_bytes: int = PAGE_BYTES, pages: int = 256, rounds: int = 8) -> dict:
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, page_bytes * pages, dtype=np.uint8)
    views = [memoryview(buf[i * page_bytes : (i + 1) * page_bytes]) for i in range(pages)]
    h = xxhash.xxh3_64_intdigest
    best = None
    for _ in range(rounds):
        c0 = time.process_time_ns()
        for v in views:
            h(v)
        cpu = time.process_time_ns() - c0
        best = cpu if best is None else min(best, cpu)
    return {
        "page_bytes": page_bytes,
        "pages": pages,
        "gbps": page_bytes * pages / best,  # bytes/ns == GB/s
        "xxhash_version": xxhash.VERSION,
    }


def _interleaved_best_ns(fns: dict, rounds: int) -> dict:
    """Best CPU ns of each function, their rounds interleaved: the load on a shared
    machine moves within seconds, and a ratio is only fair if both sides saw the same."""
    best: dict = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            c0 = time.process_time_ns()
            fn()
            cpu = time.process_time_ns() - c0
            best[name] = min(best.get(name, cpu), cpu)
    return best


def _best_ns(fn, rounds: int) -> int:
    best = None
    for _ in range(rounds):
        c0 = time.process_time_ns()
        fn()
        cpu = time.process_time_ns() - c0
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


def gather_alternatives(view, slots: np.ndarray, rounds: int) -> dict:
    """alg 3 computed the other exact ways we tried (whole transfer, one layer's K or V
    at a time), each checked equal to ``transfer_digest``; CPU ms of each. The hooks use
    the fastest single-threaded one (``np_take_head_major``, engine_hooks/digest.py)."""
    import torch

    from kvguard.engine_hooks import digest as dg

    index = view.row_index(slots)
    index_t = torch.as_tensor(index)
    heads = view.heads

    def digest_of(rows_of) -> int:
        total = 0
        for i in range(view.layers):
            for which in ("k", "v"):
                rows = rows_of(which, i)  # [H, T, row_bytes], each head's rows contiguous
                for h in range(heads):
                    total += xxhash.xxh3_64_intdigest(rows[h].data, seed=dg.stream_seed(i, h, which))
        return total & dg.MASK64

    def torch_index_select(which, i):  # the same rows as np.take, torch's kernel (may use intra-op threads)
        flat = torch.from_numpy(view.flat_rows(which, i))
        return torch.index_select(flat, 0, index_t).numpy().reshape(heads, len(slots), -1)

    def gather_then_copy(which, i):  # token rows (H x row_bytes contiguous per token), then head-major copy
        return np.ascontiguousarray(view._host_bytes(which, i)[slots].transpose(1, 0, 2))

    def per_head_fancy(which, i):  # one strided fancy-index gather per head
        buf = view._host_bytes(which, i)
        return [buf[:, h][slots] for h in range(heads)]

    want = dg.transfer_digest(view, slots, 0, dg.HEAD_STREAMS)
    out = {"np_take_head_major": _best_ns(lambda: dg.transfer_digest(view, slots, 0, dg.HEAD_STREAMS), rounds)}
    for name, fn in (
        ("torch_index_select_head_major", torch_index_select),
        ("gather_then_head_major_copy", gather_then_copy),
        ("per_head_fancy_gather", per_head_fancy),
    ):
        assert digest_of(fn) == want, name  # exact, or it is not an alternative
        out[name] = _best_ns(lambda fn=fn: digest_of(fn), rounds)
    scratch = np.empty(heads * len(slots) * view.row_bytes("k"), np.uint8).reshape(heads * len(slots), -1)

    def take_only():  # the gather alone (no hashing): what the copy costs
        for i in range(view.layers):
            for which in ("k", "v"):
                np.take(view.flat_rows(which, i), index, axis=0, out=scratch, mode="clip")

    out["np_take_gather_only"] = _best_ns(take_only, rounds)
    return {k: v / 1e6 for k, v in out.items()}


def digest_path(
    tokens: int = 4096, layers: int = 8, heads: int = 8, dim: int = 128, page_size: int = 16, rounds: int = 5
) -> dict:
    import torch

    from kvguard.engine_hooks import digest as dg

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
            blocks.append(memoryview(raw[s : s + n]).cast("B"))
    h = xxhash.xxh3_64_intdigest

    def raw_same_bytes():
        for b in blocks:
            h(b)

    alg = view.alg()
    lib = native.library()
    implementation = native.status()

    def digest():  # what the hooks run
        dg.transfer_digest(view, slots_t, 0, alg)

    contenders = {"digest": digest, "raw_py": raw_same_bytes}
    if lib is not None:  # the same bytes without Python's per-call cost: the faster raw is the ceiling
        bufs = [b.view(torch.uint8).numpy().reshape(pool_slots, -1) for b in pool.k_buffer + pool.v_buffer]
        row = bufs[0].shape[1]
        full = np.ascontiguousarray(page_starts[: tokens // page_size] * row, dtype=np.int64)
        tail = tokens - len(full) * page_size  # a last partial page, if any

        def raw_c_same_bytes():
            for b in bufs:
                lib.kvg_xxh3_blocks(b.ctypes.data, page_size * row, full.ctypes.data, len(full))
                if tail:
                    lib.kvg_xxh3(b.ctypes.data + int(page_starts[-1]) * row, tail * row)

        contenders["raw_c"] = raw_c_same_bytes
    best = _interleaved_best_ns(contenders, 2 * rounds)
    digest_ns, raw_py_ns, raw_c_ns = best["digest"], best["raw_py"], best.get("raw_c")
    raw_ns = min(raw_py_ns, raw_c_ns or raw_py_ns)
    contiguous = np.ascontiguousarray(np.concatenate([np.frombuffer(b, np.uint8) for b in blocks]))
    contiguous_ns = _best_ns(lambda c=contiguous: xxhash.xxh3_64_intdigest(c), rounds)  # if it all lay in one buffer
    del contiguous
    with native.forced(False):
        numpy_ns = _best_ns(lambda: dg.transfer_digest(view, slots_t, 0, alg), rounds)
    unit_bytes_ns = _best_ns(lambda: dg.transfer_digest(view, slots_t, 0, dg.UNIT_BYTES), rounds)
    with native.forced(False):
        alternatives = gather_alternatives(view, slots, rounds)
    return {
        "tokens": tokens,
        "layers": layers,
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": "bfloat16",
        "page_size": page_size,
        "bytes": nbytes,
        "block_bytes": page_size * heads * dim * 2,
        "alg": alg,
        "implementation": implementation,
        "native": lib is not None,
        "digest_ms": digest_ns / 1e6,
        "raw_ms": raw_ns / 1e6,
        "gbps": nbytes / digest_ns,
        "raw_same_bytes_gbps": nbytes / raw_ns,
        "ratio": raw_ns / digest_ns,
        "raw_same_bytes_python_gbps": nbytes / raw_py_ns,
        "raw_same_bytes_native_gbps": None if raw_c_ns is None else nbytes / raw_c_ns,
        "raw_contiguous_gbps": nbytes / contiguous_ns,
        "numpy_path_gbps": nbytes / numpy_ns,
        "numpy_path_ratio": raw_ns / numpy_ns,
        "unit_bytes_ms": unit_bytes_ns / 1e6,
        "unit_bytes_ratio": raw_ns / unit_bytes_ns,
        "alternatives_ms": alternatives,
    }


def tiny_transfer_us(tokens: int, rounds: int = 20, chunk: int = 64) -> dict:
    """The tests' tiny GPT-2 (demo/model.py): 2 layers, 4 kv heads x 16 dims."""
    import torch

    from kvguard.engine_hooks import digest as dg

    page_size = 4
    pool_slots = 2 * tokens + page_size * 4
    view = dg.pool_view(_Pool(2, 4, 16, pool_slots, page_size))
    slots = torch.as_tensor(_transfer_slots(tokens, pool_slots, page_size))

    alg = view.alg()

    def sender():
        s = dg.StreamingDigest(view, 0, alg)
        for a in range(0, tokens, chunk):
            s.update(slots[a : a + chunk])
        return s.digest()

    def receiver():
        return dg.transfer_digest(view, slots, 0, alg)

    def receiver_unit_bytes():
        return dg.transfer_digest(view, slots, 0, dg.UNIT_BYTES)

    def receiver_device_reduced():
        return dg.transfer_digest(view, slots, 0, dg.DEVICE_REDUCED)

    assert sender() == receiver()
    return {
        "tokens": tokens,
        "kv_bytes": tokens * 2 * 4 * 16 * 2 * 2,
        "alg": alg,
        "sender_chunked_us": _best_ns(sender, rounds) / 1e3,
        "receiver_us": _best_ns(receiver, rounds) / 1e3,
        "receiver_unit_bytes_us": _best_ns(receiver_unit_bytes, rounds) / 1e3,
        "receiver_device_reduced_on_cpu_us": _best_ns(receiver_device_reduced, rounds) / 1e3,
    }

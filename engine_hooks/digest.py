"""Transfer digests: xxh3 over a KV pool's (layer, kv head, token) units.

Pure torch/numpy + xxhash (no engine imports): the SGLang hooks hand in the pool and
the token slots. The definitions (docs/wire-format.md, "Transfer digests"); all three
sum per-(layer, head) stream hashes, so a rank's partial over its kv heads adds up
(mod 2**64) with the other ranks' to the whole, whatever the TP split:

* alg 3 ``head_streams`` (host pools, emitted today): per (l, h) two xxh3-64 streams,
  ``K(l, h)`` = head h's K bytes of every token in token order, seed ``(l << 16) | h``,
  and ``V(l, h)`` = its V bytes likewise, seed ``(1 << 32) | (l << 16) | h`` (a latent
  pool has one "head" and no V stream); digest = sum of every K(l, h) and V(l, h).
  Each stream is one head's rows back to back: the compiled routine
  (engine_hooks/native, ``make native``) feeds them to xxh3 where they lie in the
  pool; without it one numpy gather per buffer lines them up first
  (``StreamingDigest._update_head_streams``). Same digests either way.
* alg 1 ``unit_bytes`` (host pools until alg 3; still computed for recordings and
  comparisons): unit (l, h, t) = head h's K bytes then V bytes for token t in layer l;
  d(l, h) = xxh3-64, seed ``(l << 16) | h``, over the stream of that head's units in
  token order; digest = sum of d(l, h).
* alg 2 ``device_reduced`` (device pools): as alg 1 over one little-endian u64 per
  unit (below).

Every digest is mod 2**64 over the layers and heads this rank holds. Because each part
is a stream hash, a sender may feed it chunk by chunk (:class:`StreamingDigest`) and
still equal a receiver that hashes everything at once.

alg 2 (device pools, :func:`reduce_units`): each unit is reduced on the device to
``u64 = (r1 << 32) | r2`` where, with the unit's bytes read as little-endian u32 words
``w_0 .. w_{n-1}`` (the unit's byte length must be a multiple of 4),
``r_j = sum_i (w_i mod P_j) * G_j**(i+1) mod P_j`` with P_1 = 2**31 - 1,
G_1 = 16807, P_2 = 2**31 - 19, G_2 = 48271. All terms stay below 2**62 before each
``mod``, so int64 arithmetic is exact on any device (no wrapping), and the sum is
order-independent, hence deterministic. (w mod P_1, w mod P_2) determines a u32 word,
and G_j**(i+1) is never 0 mod P_j, so any change to a single word changes both r_j.
Only ``layers x heads x tokens`` u64 cross to the host.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import cast

import numpy as np
import xxhash

from kvguard.engine_hooks import native

log = logging.getLogger("kvguard.digest")

MASK64 = (1 << 64) - 1
UNIT_BYTES = "unit_bytes"  # wire.DigestAlg.XXH3_UNIT_BYTES (host pools before alg 3; no longer emitted)
HEAD_STREAMS = "head_streams"  # wire.DigestAlg.XXH3_HEAD_STREAMS (host pools)
DEVICE_REDUCED = "device_reduced"  # wire.DigestAlg.XXH3_DEVICE_REDUCED (device pools)

BLOCK_BYTES = 64 << 20  # bound on one layer's temporaries per update (see StreamingDigest.block_tokens)
HOST_BLOCK_BYTES = 4 << 20  # alg 3: bound on its reused gather buffer (measured: 1-16 MiB within noise, 256 KiB slower)

P1, G1 = (1 << 31) - 1, 16807
P2, G2 = (1 << 31) - 19, 48271

# Element types whose bytes we hash as they are stored. Anything else is skipped: a
# dtype we do not know might not be a plain array of bytes (e.g. packed sub-byte types).
_KNOWN_DTYPES = {
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "uint8",
    "int8",
    "int16",
    "int32",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
}


class Unsupported(Exception):
    """This pool or tensor cannot be digested here (the caller skips, logs once, counts)."""


V_STREAM = 1 << 32  # alg 3: set in the seed of a head's V stream (its K stream's seed lacks it)


def seed(layer: int, head: int) -> int:
    return ((int(layer) << 16) | int(head)) & MASK64


def stream_seed(layer: int, head: int, which: str) -> int:
    """alg 3: the seed of head ``head``'s K (``which="k"``) or V stream in layer ``layer``."""
    return seed(layer, head) | (V_STREAM if which == "v" else 0)


INDEX_STREAM = 2 << 32  # alg 3: a DSA pool's indexer K cache, one stream per layer (docs/wire-format.md)


def index_seed(layer: int) -> int:
    """alg 3: the seed of layer ``layer``'s indexer-cache stream (a DSA pool's index K pages)."""
    return (INDEX_STREAM | (int(layer) << 16)) & MASK64


# --------------------------------------------------------------------------- skips
class SkipCounter:
    """Why digests were not computed: counted per reason, each reason logged once."""

    def __init__(self):
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def skip(self, reason: str) -> None:
        with self._lock:
            first = reason not in self.counts
            self.counts[reason] += 1
        if first:
            log.warning("kvguard: transfer digests skipped: %s (logged once, counted)", reason)

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()


skips = SkipCounter()


# --------------------------------------------------------------------------- pool views
def _torch():
    import torch

    return torch


def _check_dtype(t) -> None:
    name = str(t.dtype).replace("torch.", "")
    if name not in _KNOWN_DTYPES:
        raise Unsupported(f"KV dtype {name} is not a known plain element type")


@dataclass
class PoolView:
    """How to read units out of one KV pool (SGLang MHATokenToKVPool-like objects).

    ``k``/``v``: per-layer tensors, layout ``nhd`` ([slots, heads, dim]) or ``hnd``
    ([pages, heads, page_size, dim]). ``v`` is None for a latent (MLA) pool.
    """

    k: list
    v: list | None
    layout: str
    page_size: int
    start_layer: int
    heads: int
    device: object
    # a DSA pool's indexer K cache on the host: per layer its [pages, page_bytes] uint8 rows (None
    # for a layer that keeps none), hashed page by page into alg 3's indexer streams; None: no
    # indexer, or one the digest does not cover (``index_unsupported`` says why)
    index_rows: list | None = None
    index_unsupported: str = ""

    @property
    def layers(self) -> int:
        return len(self.k)

    def alg(self) -> str:
        dev = str(getattr(self.device, "type", self.device))
        if dev == "cpu":
            return HEAD_STREAMS
        if dev == "cuda":
            return DEVICE_REDUCED
        raise Unsupported(f"KV pool on device {dev!r}")

    def _rows(self, buf, slots):
        if self.layout == "nhd":
            return buf.index_select(0, slots)  # [T, H, D]
        pages = slots // self.page_size
        offs = slots % self.page_size
        return buf[pages, :, offs, :]  # advanced indices split by a slice: [T, H, D]

    def _host_bytes(self, which: str, i: int) -> np.ndarray:
        """Layer ``i``'s K or V buffer as a numpy uint8 view (no copy), the element bytes last."""
        cache = self.__dict__.setdefault("_np", {})
        got = cache.get((which, i))
        if got is None:
            torch = _torch()
            buf = (self.k if which == "k" else cast(list, self.v))[i]  # "v" only where the pool has V
            got = cache[(which, i)] = buf.view(torch.uint8).numpy()
        return got

    def host_units(self, i: int, slots: np.ndarray) -> np.ndarray:
        """:meth:`units` for a host pool with numpy: one gather, then one copy into
        head-major order (measured ~8x faster than the same in torch on CPU)."""
        parts = []
        pages = self._whole_pages(slots) if self.layout == "nhd" else None
        for which in ("k", "v") if self.v is not None else ("k",):
            buf = self._host_bytes(which, i)
            if pages is not None and buf.flags.c_contiguous:  # whole pages (large blocks), then cut the tail
                ps = self.page_size
                rows = buf[: buf.shape[0] // ps * ps].reshape(-1, ps, *buf.shape[1:])[pages]
                rows = rows.reshape(-1, *buf.shape[1:])[: len(slots)]
            elif self.layout == "nhd":
                rows = buf[slots]  # [T, H, bytes]
            else:
                rows = buf[slots // self.page_size, :, slots % self.page_size, :]  # [T, H, bytes]
            parts.append(rows.transpose(1, 0, 2))
        return np.concatenate(parts, axis=2) if len(parts) > 1 else np.ascontiguousarray(parts[0])

    def _whole_pages(self, slots: np.ndarray) -> np.ndarray | None:
        """The page ids when ``slots`` are whole pages in order (a paged allocator's rows
        from a page-aligned position), else None."""
        ps = self.page_size
        if ps <= 1 or len(slots) == 0 or slots[0] % ps:
            return None
        pages = slots[::ps] // ps
        expect = (pages[:, None] * ps + np.arange(ps)).reshape(-1)[: len(slots)]
        return pages if np.array_equal(expect, slots) else None

    def units(self, i: int, slots):
        """Layer ``i`` (pool-local) units of ``slots``: a contiguous [H, T, unit_bytes] uint8 tensor."""
        torch = _torch()
        k = self._rows(self.k[i], slots)
        parts = [k] if self.v is None else [k, self._rows(self.v[i], slots)]
        t = int(slots.numel())
        # [T, H, bytes] views, then one copy into head-major order (cat writes it contiguous)
        byte_parts = [p.reshape(t, self.heads, -1).contiguous().view(torch.uint8).transpose(0, 1) for p in parts]
        return torch.cat(byte_parts, dim=2) if len(byte_parts) > 1 else byte_parts[0].contiguous()

    # ------------------------------------------------------------------- alg 3 (host)
    def row_index(self, slots: np.ndarray) -> np.ndarray:
        """For each (head, token) of ``slots``, head-major, the row of a buffer's flat
        ``[rows, row_bytes]`` view holding that head's bytes for that token: NHD
        ``slot*H + h``; HND ``((slot // ps)*H + h)*ps + slot % ps``."""
        hs = np.arange(self.heads, dtype=np.int64)[:, None]
        if self.layout == "nhd":
            return (slots[None, :] * self.heads + hs).reshape(-1)
        ps = self.page_size
        return (((slots // ps)[None, :] * self.heads + hs) * ps + (slots % ps)[None, :]).reshape(-1)

    def row_bytes(self, which: str) -> int:
        buf = (self.k if which == "k" else cast(list, self.v))[0]  # "v" only where the pool has V
        return int(buf.shape[-1]) * buf.element_size()

    def flat_rows(self, which: str, i: int) -> np.ndarray | None:
        """Layer ``i``'s K or V buffer as ``[rows, row_bytes]`` uint8 (a view, no copy),
        or None when the buffer is not one contiguous block."""
        buf = self._host_bytes(which, i)
        return buf.reshape(-1, buf.shape[-1]) if buf.flags.c_contiguous else None

    def head_stream_plan(self, head_start: int, use_native: bool) -> HeadStreamPlan:
        """alg 3's per-(layer, K/V) work list for this pool, built once per head offset
        (the pool's buffers never move): see :class:`HeadStreamPlan`."""
        cache = self.__dict__.setdefault("_plans", {})
        key = (int(head_start), bool(use_native))
        got = cache.get(key)
        if got is None:
            got = cache[key] = HeadStreamPlan.build(self, int(head_start), bool(use_native))
        return got

    def head_rows_copied(self, which: str, i: int, slots: np.ndarray) -> np.ndarray:
        """alg 3 for a non-contiguous buffer: gather the slots' rows, then copy them
        head-major, ``[H, T, row_bytes]`` (two copies; SGLang's pools never need it)."""
        buf = self._host_bytes(which, i)
        if self.layout == "nhd":
            rows = buf[slots]
        else:
            rows = buf[slots // self.page_size, :, slots % self.page_size, :]
        return np.ascontiguousarray(rows.transpose(1, 0, 2))


@dataclass
class HeadStreamPlan:
    """alg 3 for one pool and head offset. ``entries``: per (layer, K/V) the flat
    ``[rows, row_bytes]`` view (None: not contiguous), row bytes, the heads' stream
    seeds (None when the compiled routine takes that buffer), K/V and layer.
    Contiguous buffers go to the compiled routine when it is used: their states are
    ``native_seeds``, fed through ``buffers``."""

    entries: list
    native_seeds: np.ndarray
    buffers: native.Buffers | None
    min_rows: int

    @classmethod
    def build(cls, view: PoolView, head_start: int, use_native: bool) -> HeadStreamPlan:
        entries: list = []
        seeds: list[int] = []
        native_entries: list[tuple[int, np.ndarray]] = []
        for i in range(view.layers):
            for w in ("k",) if view.v is None else ("k", "v"):
                flat = view.flat_rows(w, i)
                stream_seeds = [stream_seed(view.start_layer + i, head_start + h, w) for h in range(view.heads)]
                kept: list[int] | None = stream_seeds
                if use_native and flat is not None:
                    native_entries.append((len(seeds), flat))
                    seeds += stream_seeds
                    kept = None
                entries.append((flat, view.row_bytes(w), kept, w, i))
        flats = [e[0] for e in entries if e[0] is not None]
        return cls(
            entries,
            np.array(seeds, np.uint64),
            native.Buffers(view.heads, native_entries) if native_entries else None,
            min(f.shape[0] for f in flats) if flats else 1 << 62,
        )


def pool_view(pool) -> PoolView:
    """A :class:`PoolView` of an SGLang KV pool, or :class:`Unsupported` with the reason."""
    k = getattr(pool, "k_buffer", None)
    v = getattr(pool, "v_buffer", None)
    if k is None or v is None:
        kv = getattr(pool, "kv_buffer", None)
        if kv is not None:
            return latent_view(pool, kv)
        raise Unsupported(f"KV pool {type(pool).__name__} has no k_buffer/v_buffer")
    layout = str(getattr(pool, "kv_cache_layout", "nhd") or "nhd")
    if layout not in ("nhd", "hnd"):
        raise Unsupported(f"KV cache layout {layout!r}")
    if not k or len(k) != len(v):
        raise Unsupported("k_buffer/v_buffer are empty or of different lengths")
    want_dims = 3 if layout == "nhd" else 4
    for t in (k[0], v[0]):
        _check_dtype(t)
        if t.dim() != want_dims:
            raise Unsupported(f"{layout} KV buffer with {t.dim()} dims")
    heads = int(k[0].shape[1])
    if int(v[0].shape[1]) != heads:
        raise Unsupported("K and V hold different head counts")
    return PoolView(
        list(k),
        list(v),
        layout,
        int(getattr(pool, "page_size", 1) or 1),
        int(getattr(pool, "start_layer", 0) or 0),
        heads,
        k[0].device,
    )


def latent_view(pool, kv) -> PoolView:
    """A latent (MLA / DSA) pool: per layer ``[slots, 1, kv_lora_rank + rope]`` of one latent
    "head" (its stored bytes: an fp8 pool's as stored). Digested as head 0 of 1 with no V
    (docs/wire-format.md, alg 3: ``K(l, 0)`` only); every attention-TP rank holds the same
    latent, so one rank reports it (hooks_disagg.head_layout). A DSA pool's indexer K cache
    (``index_key_cache``) is added as ``index_rows`` where alg 3 defines it (:func:`index_rows`),
    else ``index_unsupported`` says why (docs/coverage.md)."""
    if not kv:
        raise Unsupported("kv_buffer is empty")
    t = kv[0]
    _check_dtype(t)
    if t.dim() != 3 or int(t.shape[1]) != 1:
        raise Unsupported(f"latent KV buffer of shape {tuple(t.shape)}: expected [slots, 1, latent]")
    view = PoolView(
        list(kv),
        None,
        "nhd",
        int(getattr(pool, "page_size", 1) or 1),
        int(getattr(pool, "start_layer", 0) or 0),
        1,
        t.device,
    )
    index = getattr(pool, "index_key_cache", None)
    if index is not None:
        try:
            view.index_rows = index_rows(pool, index, len(kv))
        except Unsupported as exc:
            view.index_unsupported = str(exc)
    return view


def index_rows(pool, index, layers: int) -> list:
    """A DSA pool's indexer K cache as alg 3 reads it: per layer the ``[pages, page_bytes]``
    rows of ``index.buffer`` (page p's index K and scales for its page_size tokens), or None
    for a layer that keeps none (SGLang's ``skip_topk_layers``: a 0-row placeholder).
    Unsupported for what the digest does not define: pooled index keys (``index_kpool`` > 1),
    a device buffer (alg 2 carries no indexer stream), a layout other than one row per page."""
    if int(getattr(pool, "index_kpool", 1) or 1) != 1:
        raise Unsupported("pooled index keys (index_kpool > 1)")
    buffers = getattr(index, "buffer", None)
    if not buffers or len(buffers) != layers:
        raise Unsupported("the indexer cache's buffers do not match the pool's layers")
    out = []
    torch = _torch()
    for b in buffers:
        if b.dim() != 2 or b.dtype != torch.uint8:
            raise Unsupported(
                f"indexer cache buffer of shape {tuple(b.shape)} / {b.dtype}: expected [pages, bytes] uint8"
            )
        if str(b.device.type) != "cpu":
            raise Unsupported("the indexer cache is on a device: its bytes are in host digests only")
        out.append(b.numpy() if int(b.shape[0]) else None)
    return out


# --------------------------------------------------------------------------- alg 2 reduction
_mult_cache: dict = {}


def _multipliers(n_words: int, device):
    """G_j ** (i + 1) mod P_j for i < n_words, as int64 tensors on ``device`` (cached)."""
    key = (n_words, str(device))
    got = _mult_cache.get(key)
    if got is None:
        torch = _torch()
        out = []
        for p, g in ((P1, G1), (P2, G2)):
            m = np.empty(n_words, dtype=np.int64)
            x = 1
            for i in range(n_words):
                x = (x * g) % p
                m[i] = x
            out.append(torch.from_numpy(m).to(device))
        got = _mult_cache[key] = tuple(out)
    return got


def reduce_units(units):
    """[H, T, unit_bytes] uint8 -> [H, T] int64 holding each unit's u64 (module docstring)."""
    torch = _torch()
    n_bytes = int(units.shape[-1])
    if n_bytes % 4:
        raise Unsupported(f"unit of {n_bytes} bytes is not a whole number of u32 words")
    words = units.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # u32 values, little-endian
    m1, m2 = _multipliers(n_bytes // 4, units.device)
    r1 = ((words % P1) * m1 % P1).sum(dim=-1) % P1
    r2 = ((words % P2) * m2 % P2).sum(dim=-1) % P2
    return (r1 << 32) | r2  # r1 < 2**31: fits a non-negative int64


# --------------------------------------------------------------------------- digests
def _on_host(view: PoolView, alg: str) -> bool:
    return alg in (UNIT_BYTES, HEAD_STREAMS) and str(getattr(view.device, "type", view.device)) == "cpu"


def _as_slots(slots, view: PoolView, alg: str):
    """int64 slots: numpy for the host path, a torch tensor on the pool's device otherwise."""
    torch = _torch()
    if _on_host(view, alg):
        if isinstance(slots, torch.Tensor):
            slots = slots.detach().to("cpu").numpy()
        return np.asarray(slots, dtype=np.int64).reshape(-1)
    if not isinstance(slots, torch.Tensor):
        slots = torch.as_tensor(np.asarray(slots, dtype=np.int64))
    return slots.reshape(-1).to(device=view.device, dtype=torch.int64)


def layer_streams(view: PoolView, i: int, slots, alg: str) -> np.ndarray:
    """The bytes each head of layer ``i`` adds to its stream for ``slots``: [H, n] uint8 (host)."""
    if _on_host(view, alg):
        return view.host_units(i, slots).reshape(view.heads, -1)
    u = view.units(i, slots)
    if alg == DEVICE_REDUCED:
        u = reduce_units(u)  # [H, T] on the device; only these cross
        return u.to("cpu").numpy().view(np.uint8).reshape(view.heads, -1)
    return u.to("cpu").numpy().reshape(view.heads, -1)


class StreamingDigest:
    """The per-(layer, head) streams kept open across chunks (the sender's view of a
    chunked transfer): alg 1/2 one stream per (layer, head), alg 3 a K and a V stream."""

    def __init__(self, view: PoolView, head_start: int, alg: str):
        self.view, self.head_start, self.alg = view, int(head_start), alg
        self._scratch: np.ndarray | None = None
        if alg == HEAD_STREAMS:
            if str(getattr(view.device, "type", view.device)) != "cpu":
                raise Unsupported("alg head_streams hashes host (CPU) pools only")
            lib = native.library()
            plan = view.head_stream_plan(self.head_start, lib is not None)
            self._plan, self._min_rows = [], plan.min_rows  # hashers None: the compiled routine's
            for flat, rb, stream_seeds, w, i in plan.entries:
                hashers = None if stream_seeds is None else [xxhash.xxh3_64(seed=x) for x in stream_seeds]
                self._plan.append((flat, rb, hashers, w, i))
            self._native = None if plan.buffers is None else native.NativeStreams(lib, plan.native_seeds)
            self._native_buffers = plan.buffers
            self._max_row_bytes = max(rb for _f, rb, *_ in plan.entries)
        else:
            self.hashers = [
                [xxhash.xxh3_64(seed=seed(view.start_layer + i, self.head_start + h)) for h in range(view.heads)]
                for i in range(view.layers)
            ]
        self._step = self.block_tokens()
        # a DSA pool's indexer pages (alg 3, host): one stream per layer, each page once, in order
        self._index: list[tuple[np.ndarray, xxhash.xxh3_64]] | None = None
        if alg == HEAD_STREAMS and view.index_rows is not None:
            self._index = [
                (rows, xxhash.xxh3_64(seed=index_seed(view.start_layer + i)))
                for i, rows in enumerate(view.index_rows)
                if rows is not None
            ]
            self._last_page = -1

    def update(self, slots) -> None:
        slots = _as_slots(slots, self.view, self.alg)
        n = len(slots)
        if self._index is not None and n:
            self._update_index(np.asarray(slots, dtype=np.int64))
        step = self._step
        for a in range(0, n, step):  # token blocks bound the temporaries (the stream hash does not care)
            block = slots[a : a + step]
            if self.alg == HEAD_STREAMS:
                self._update_head_streams(block)
                continue
            for i in range(self.view.layers):
                streams = layer_streams(self.view, i, block, self.alg)
                for h, hasher in enumerate(self.hashers[i]):
                    hasher.update(streams[h].data)

    def _update_head_streams(self, block: np.ndarray) -> None:
        """alg 3: per layer and K/V, each head's rows of ``block`` into its stream.

        Contiguous buffers: one ``np.take`` of the flat ``[rows, row_bytes]`` view by
        :meth:`PoolView.row_index` (the same for every layer, K and V alike) writes the
        rows head-major into a reused buffer: the gather and the head order in one pass,
        a memmove per row, on this thread only (torch's index_select is as fast on one
        thread but hands work to its intra-op threads, which under load cost several
        times more CPU; docs/performance.md "Digest"). ``mode="clip"`` because
        ``np.take`` buffers ``out`` in its default mode; the indices are bounds-checked
        once per block here instead. With the compiled routine (engine_hooks/native) the
        same rows go to xxh3 where they lie, by the same index: no copy."""
        v, t = self.view, len(block)
        index = v.row_index(block)
        if t and (int(block.min()) < 0 or int(index.max()) >= self._min_rows):
            raise IndexError(f"KV slots outside the pool ({self._min_rows} rows)")
        heads = v.heads
        buffers, streams = self._native_buffers, self._native  # (both set, or both None)
        if buffers is not None and streams is not None:
            buffers.update(streams, index, t)
        for flat, rb, hashers, which, i in self._plan:
            if hashers is None:  # done above
                continue
            if flat is None:
                rows = v.head_rows_copied(which, i, block)
            else:
                need = heads * t * self._max_row_bytes
                scratch = self._scratch
                if scratch is None or scratch.size < need:  # grows to one block at most, reused across chunks
                    scratch = self._scratch = np.empty(need, dtype=np.uint8)
                dst = scratch[: heads * t * rb].reshape(heads * t, rb)
                np.take(flat, index, axis=0, out=dst, mode="clip")
                rows = dst.reshape(heads, t, rb)
            for h in range(heads):
                hashers[h].update(rows[h].data)

    def _update_index(self, slots: np.ndarray) -> None:
        """The indexer pages ``slots`` lie in, each once and in token order (a chunk that ends
        inside a page and the next one that goes on in it name that page once)."""
        pages = slots // self.view.page_size
        first = np.empty(len(pages), dtype=bool)
        first[0] = pages[0] != self._last_page
        np.not_equal(pages[1:], pages[:-1], out=first[1:])
        new = pages[first]
        self._last_page = int(pages[-1])
        if len(new) == 0:
            return
        assert self._index is not None  # (update calls this only with an indexer)
        for rows, hasher in self._index:
            if int(new.max()) >= rows.shape[0]:
                raise IndexError(f"indexer page {int(new.max())} outside the cache ({rows.shape[0]} pages)")
            hasher.update(np.take(rows, new, axis=0).data)

    def block_tokens(self) -> int:
        """Tokens per block so that one layer's temporaries stay near BLOCK_BYTES (alg 2
        widens each u32 word to int64 and keeps a few such arrays); whole pages."""
        v = self.view
        if self.alg == HEAD_STREAMS:  # one reused [H, tokens, row_bytes] buffer; small blocks stay in cache
            per_token, budget = v.heads * self._max_row_bytes, HOST_BLOCK_BYTES
        else:
            unit = sum(int(b[0].shape[-1]) * b[0].element_size() for b in (v.k, v.v) if b is not None)
            per_token, budget = v.heads * unit * (16 if self.alg == DEVICE_REDUCED else 2), BLOCK_BYTES
        tokens = max(1, budget // max(1, per_token))
        return max(v.page_size, tokens // v.page_size * v.page_size)

    def digest(self) -> int:
        if self.alg == HEAD_STREAMS:
            total = 0 if self._native is None else self._native.digest_sum()
            for _flat, _rb, hashers, _w, _i in self._plan:
                if hashers is not None:
                    total += sum(h.intdigest() for h in hashers)
            for _rows, hasher in self._index or ():
                total += hasher.intdigest()
            return total & MASK64
        return sum(h.intdigest() for row in self.hashers for h in row) & MASK64


def transfer_digest(view: PoolView, slots, head_start: int, alg: str) -> int:
    """The digest of ``slots`` (token order) in one go (the receiver's view)."""
    d = StreamingDigest(view, head_start, alg)
    d.update(slots)
    return d.digest()


def reference_digest(units_by_layer, start_layer: int = 0, head_start: int = 0) -> int:
    """Straight from the definition, for tests: ``units_by_layer[l][h][t]`` = unit bytes."""
    total = 0
    for li, heads in enumerate(units_by_layer):
        for h, units in enumerate(heads):
            total += xxhash.xxh3_64_intdigest(b"".join(units), seed=seed(start_layer + li, head_start + h))
    return total & MASK64


def reference_head_streams(k_rows, v_rows=None, start_layer: int = 0, head_start: int = 0) -> int:
    """alg 3 straight from the definition, for tests: ``k_rows[l][h][t]`` = head h's K
    bytes for token t in layer l, ``v_rows`` likewise (None for a latent pool)."""
    total = 0
    for li, heads in enumerate(k_rows):
        for h, rows in enumerate(heads):
            layer, head = start_layer + li, head_start + h
            total += xxhash.xxh3_64_intdigest(b"".join(rows), seed=stream_seed(layer, head, "k"))
            if v_rows is not None:
                total += xxhash.xxh3_64_intdigest(b"".join(v_rows[li][h]), seed=stream_seed(layer, head, "v"))
    return total & MASK64


def reference_index_streams(page_rows_by_layer, start_layer: int = 0) -> int:
    """alg 3's indexer streams straight from the definition, for tests: ``page_rows_by_layer[l]``
    = the bytes of each indexer page the transfer covers, in order (each page once)."""
    total = 0
    for li, rows in enumerate(page_rows_by_layer):
        total += xxhash.xxh3_64_intdigest(b"".join(rows), seed=index_seed(start_layer + li))
    return total & MASK64


def reference_reduce(unit: bytes) -> int:
    """alg 2's per-unit u64 in plain Python, for tests."""
    words = np.frombuffer(unit, dtype="<u4").tolist()
    r = []
    for p, g in ((P1, G1), (P2, G2)):
        acc, x = 0, 1
        for w in words:
            x = x * g % p
            acc += (w % p) * x
        r.append(acc % p)
    return (r[0] << 32) | r[1]

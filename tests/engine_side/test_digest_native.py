"""The compiled alg-3 routine (engine_hooks/native) against the numpy path and the
definition.

`make test` builds it (`make native`), so it must be loaded here; the equality tests
run every pool shape through both paths and through ``reference_head_streams``, with
row lengths that take the in-place route (multiples of 64 bytes, shorter and longer
than xxh3's 256-byte buffer) and the per-row route (anything else).
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import digest as dg  # noqa: E402
from kvguard.engine_hooks import native  # noqa: E402


@pytest.fixture
def path(monkeypatch):
    """Switch between the compiled routine ("native") and the numpy path ("numpy")."""

    def use(which: str):
        monkeypatch.setenv(native.ENV, "1" if which == "native" else "0")
        native.reload()

    yield use
    native.reload()


class _Pool:
    def __init__(self, layers, heads, dim, slots, page_size, dtype, layout, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.page_size, self.kv_cache_layout, self.start_layer = page_size, layout, 2
        self.k_buffer, self.v_buffer = [], []
        for dst in (self.k_buffer, self.v_buffer):
            for _ in range(layers):
                t = torch.randn(slots, heads, dim, generator=g).to(dtype)
                if layout == "hnd":
                    t = t.view(slots // page_size, page_size, heads, dim).transpose(1, 2).contiguous()
                dst.append(t)


def _reference(pool, view, slots) -> int:
    def rows(bufs):
        out = []
        for buf in bufs:
            b = buf.view(torch.uint8).numpy()
            if view.layout == "nhd":
                per = [[b[s, h].tobytes() for s in slots] for h in range(view.heads)]
            else:
                ps = view.page_size
                per = [[b[s // ps, h, s % ps].tobytes() for s in slots] for h in range(view.heads)]
            out.append(per)
        return out

    return dg.reference_head_streams(
        rows(pool.k_buffer), rows(pool.v_buffer), start_layer=pool.start_layer, head_start=3
    )


SHAPES = [  # (heads, dim, dtype, page_size, layout): row bytes in the comment
    (2, 128, torch.bfloat16, 16, "nhd"),  # 256: one buffer's worth per row
    (3, 64, torch.bfloat16, 1, "nhd"),  # 128
    (2, 128, torch.float32, 4, "nhd"),  # 512: longer than the buffer
    (2, 96, torch.bfloat16, 8, "hnd"),  # 192, HND layout
    (2, 128, torch.float8_e4m3fn, 16, "nhd"),  # 128 one-byte elements
    (4, 16, torch.bfloat16, 16, "nhd"),  # 32: per-row update route
    (2, 40, torch.float16, 2, "hnd"),  # 80: per-row update route
]


def test_the_built_library_is_loaded(path):
    """`make test` builds it: a missing or refused library here is a build problem."""
    path("native")
    assert native.library() is not None, native.status()
    assert "in place" in native.status()


@pytest.mark.parametrize("heads,dim,dtype,page_size,layout", SHAPES)
def test_native_equals_numpy_and_the_definition(path, heads, dim, dtype, page_size, layout):
    pool = _Pool(3, heads, dim, 64 * page_size, page_size, dtype, layout)
    rng = np.random.default_rng(1)
    pages = rng.permutation(np.arange(1, 64))[:9]
    slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[: 9 * page_size - page_size // 2]
    view = dg.pool_view(pool)
    got = {}
    for which in ("native", "numpy"):
        path(which)
        assert (native.library() is not None) == (which == "native")
        one_shot = dg.transfer_digest(view, slots, 3, dg.HEAD_STREAMS)
        chunked = dg.StreamingDigest(view, 3, dg.HEAD_STREAMS)
        for a, b in ((0, 1), (1, 2), (2, 7), (7, 40), (40, len(slots))):  # cuts inside and across rows' pages
            chunked.update(slots[a:b])
        assert chunked.digest() == one_shot
        got[which] = one_shot
    assert got["native"] == got["numpy"] == _reference(pool, view, slots)


def test_native_streams_survive_many_short_calls(path):
    """One token per call for a long stream: every call ends with the row buffered."""
    pool = _Pool(2, 2, 128, 512, 16, torch.bfloat16, "nhd", seed=4)
    view = dg.pool_view(pool)
    slots = np.arange(16, 16 + 300)
    path("native")
    d = dg.StreamingDigest(view, 0, dg.HEAD_STREAMS)
    for s in slots:
        d.update(np.array([s]))
    path("numpy")
    assert d.digest() == dg.transfer_digest(view, slots, 0, dg.HEAD_STREAMS)


def test_native_changes_with_one_flipped_bit(path):
    pool = _Pool(2, 2, 128, 256, 16, torch.bfloat16, "nhd", seed=5)
    view = dg.pool_view(pool)
    slots = np.arange(32, 96)
    path("native")
    before = dg.transfer_digest(view, slots, 0, dg.HEAD_STREAMS)
    pool.k_buffer[1].view(torch.uint8)[70, 1, 200] ^= 0x10
    assert dg.transfer_digest(view, slots, 0, dg.HEAD_STREAMS) != before


def test_native_refuses_rows_outside_the_buffer(path):
    path("native")
    lib = native.library()
    assert lib is not None, native.status()
    streams = native.NativeStreams(lib, [1, 2])
    flat = np.zeros((10, 64), np.uint8)
    before = streams.digest_sum()
    with pytest.raises(IndexError, match="outside"):
        native.Buffers(2, [(0, flat)]).update(streams, np.array([0, 1, 2, 10], np.int64), 2)
    assert streams.digest_sum() == before  # nothing consumed
    with pytest.raises(IndexError):
        native.Buffers(2, [(1, flat)]).update(streams, np.array([0, 1, 2, 3], np.int64), 2)  # states 1..3 of 2


def test_a_library_that_hashes_differently_is_refused(monkeypatch, caplog):
    """The self-test at load compares against the xxhash package; a library that
    disagrees (another xxhash.h, a miscompile) is not used, and the log says why."""
    real_bind = native._bind

    class Wrong:
        def __init__(self, lib):
            self._lib = lib

        def __getattr__(self, name):
            return getattr(self._lib, name)

        def kvg_digest_sum(self, states, n):
            return (self._lib.kvg_digest_sum(states, n) + 1) & ((1 << 64) - 1)

    monkeypatch.setattr(native, "_bind", lambda p: Wrong(real_bind(p)))
    monkeypatch.setenv(native.ENV, "1")
    native.reload()
    try:
        with caplog.at_level("WARNING", logger="kvguard.digest"):
            assert native.library() is None
        assert "numpy path" in native.status() and "!=" in native.status()
        assert "native transfer digest not used" in caplog.text
    finally:
        native.reload()


def test_bad_setting_names_the_key_and_value(monkeypatch):
    monkeypatch.setenv(native.ENV, "fast")
    native.reload()
    try:
        with pytest.raises(ValueError, match="KVGUARD_DIGEST_NATIVE='fast'"):
            native.library()
    finally:
        native.reload()


def test_same_build_raw_xxh3_is_xxh3(path):
    path("native")
    lib = native.library()
    assert lib is not None, native.status()
    buf = np.random.default_rng(2).integers(0, 256, 100_003, dtype=np.uint8)
    assert lib.kvg_xxh3(buf.ctypes.data, buf.size) == xxhash.xxh3_64_intdigest(buf.tobytes())


def test_every_built_library_passes_the_self_test():
    """The baseline build too, not only the AVX2 one this CPU picks."""
    built = [p for p in (native.HERE / native.LIB_BASE, native.HERE / native.LIB_AVX2) if p.exists()]
    assert native.HERE / native.LIB_BASE in built
    for p in built:
        lib = native._bind(p)
        assert lib.kvg_in_place() == 1
        native._self_test(lib)

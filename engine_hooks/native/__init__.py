"""The compiled alg-3 digest routine (head_streams.c), loaded with ctypes.

Optional by design: the engine hooks fall back to the numpy path of
engine_hooks/digest.py when it is not there, and say why (:func:`status`). Both give
the same digests; this one skips the gather copy (docs/performance.md "Digest").

Built by ``make native`` (gcc and Debian's libxxhash-dev, which the Makefile's apt
target installs) into this folder, twice: a baseline x86-64 build and, where the CPU
has AVX2, an AVX2 build, which is preferred. A library is used only after it hashes
test rows of every shape the hooks can hand it exactly as the xxhash package does
(:func:`_self_test`); one that does not is refused and the reason logged.

``KVGUARD_DIGEST_NATIVE=0`` turns it off (the numpy path), ``=1`` (the default) uses
it when it loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger("kvguard.digest")

HERE = Path(__file__).resolve().parent
LIB_BASE = "libkvguard_digest.so"
LIB_AVX2 = "libkvguard_digest_avx2.so"
ABI = 3
ENV = "KVGUARD_DIGEST_NATIVE"
STATE_ALIGN = 64  # XXH3_state_t is declared 64-byte aligned

_lock = threading.Lock()
_loaded: tuple | None = None  # (lib or None, description)


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " avx2" in line
    except OSError:
        pass
    return False


def _bind(path: Path):
    lib = ctypes.CDLL(str(path))
    lib.kvg_abi.restype = ctypes.c_int
    lib.kvg_in_place.restype = ctypes.c_int
    lib.kvg_xxhash_version.restype = ctypes.c_int
    lib.kvg_state_size.restype = ctypes.c_size_t
    lib.kvg_reset.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    lib.kvg_reset.restype = ctypes.c_int
    lib.kvg_digest_sum.argtypes = (ctypes.c_void_p, ctypes.c_int64)
    lib.kvg_digest_sum.restype = ctypes.c_uint64
    lib.kvg_xxh3.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.kvg_xxh3.restype = ctypes.c_uint64
    lib.kvg_xxh3_blocks.argtypes = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64)
    lib.kvg_xxh3_blocks.restype = ctypes.c_uint64
    lib.kvg_update_buffers.argtypes = (
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
    )
    lib.kvg_update_buffers.restype = ctypes.c_int
    if lib.kvg_abi() != ABI:
        raise OSError(f"ABI {lib.kvg_abi()} != {ABI} (rebuild with `make native`)")
    return lib


def _self_test(lib) -> None:
    """Every row length the hooks may pass (stripe multiples and not; shorter and
    longer than xxh3's 256-byte buffer), cut into calls several ways, against the
    xxhash package over the same bytes joined. Raises AssertionError on a mismatch."""
    rng = np.random.default_rng(7)
    cases = [
        (row_bytes, heads, n_rows, cuts)
        for row_bytes in (2, 32, 64, 128, 192, 256, 320, 512, 1152)
        for heads, n_rows, cuts in ((2, 1, (1,)), (2, 3, (1, 2)), (2, 5, (5,)), (3, 40, (1, 3, 17, 19)))
    ]
    cases.append((256, 33, 9, (4,)))  # more heads than one group of the C routine
    for row_bytes, heads, n_rows, cuts in cases:
        flat = rng.integers(0, 256, (heads * n_rows + 3, row_bytes), dtype=np.uint8)
        order = rng.permutation(flat.shape[0])[: heads * n_rows].astype(np.int64).reshape(heads, n_rows)
        seeds = [(5 << 16) | h for h in range(heads)]
        states = NativeStreams(lib, seeds)
        a = 0
        for b in (*cuts, n_rows):
            if b > a:  # the entry point the hooks use
                Buffers(heads, [(0, flat)]).update(states, order[:, a:b].reshape(-1), b - a)
                a = b
        want = sum(xxhash.xxh3_64_intdigest(flat[order[h]].tobytes(), seed=seeds[h]) for h in range(heads))
        got = states.digest_sum()
        assert got == want & ((1 << 64) - 1), f"row_bytes={row_bytes} rows={n_rows}: {got:#x} != {want:#x}"


def _load() -> tuple:
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting in ("0", "off", "false", "no"):
        return None, f"off ({ENV}={setting})"
    if setting not in ("1", "on", "true", "yes", "auto", ""):
        raise ValueError(f"{ENV}={setting!r}: expected 0 or 1")
    tried = []
    candidates = ([HERE / LIB_AVX2] if _cpu_has_avx2() else []) + [HERE / LIB_BASE]
    for path in candidates:
        if not path.exists():
            tried.append(f"{path.name}: not built (`make native`)")
            continue
        try:
            lib = _bind(path)
            _self_test(lib)
        except (OSError, AttributeError, AssertionError) as e:
            tried.append(f"{path.name}: {e}")
            continue
        how = "in place" if lib.kvg_in_place() else "xxh3 update per row"
        return lib, f"{path.name} (xxhash {lib.kvg_xxhash_version()}, {how})"
    return None, "numpy path: " + "; ".join(tried)


def library():
    """The loaded library, or None (then :func:`status` says why). Loaded once."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
                if _loaded[0] is None:
                    log.warning("kvguard: native transfer digest not used: %s", _loaded[1])
                else:
                    log.info("kvguard: native transfer digest: %s", _loaded[1])
    return _loaded[0]


def status() -> str:
    """What computes alg-3 digests in this process, in words (never raises: for logs)."""
    try:
        library()
    except ValueError as exc:
        return f"not loaded: {exc}"
    assert _loaded is not None  # library() set it or raised
    return _loaded[1]


def reload() -> None:
    """Forget the loaded library (tests switch ``KVGUARD_DIGEST_NATIVE``)."""
    global _loaded
    with _lock:
        _loaded = None


@contextlib.contextmanager
def forced(on: bool):
    """Within the block, use the library (``on``, if it loads) or the numpy path; for
    side-by-side measurements (bench/digest_bench.py). Not for concurrent use."""
    global _loaded
    with _lock:
        saved = _loaded
        _loaded = _load() if on else (None, "numpy path (forced)")
    try:
        yield
    finally:
        with _lock:
            _loaded = saved


class NativeStreams:
    """``n`` xxh3-64 stream states in one 64-byte aligned block the library writes."""

    def __init__(self, lib, seeds):
        self.lib, self.n = lib, len(seeds)
        size = int(lib.kvg_state_size())
        raw = np.zeros(self.n * size + STATE_ALIGN, np.uint8)
        off = (-raw.ctypes.data) % STATE_ALIGN
        self._raw = raw  # keeps the memory alive
        self._block = raw[off : off + self.n * size]
        self._size = size
        self.block_address = self._block.ctypes.data
        seeds_a = np.ascontiguousarray(seeds, dtype=np.uint64)
        if lib.kvg_reset(self.block_address, seeds_a.ctypes.data, self.n):
            raise OSError("XXH3 reset failed")

    def digest_sum(self) -> int:
        return int(self.lib.kvg_digest_sum(self._block.ctypes.data, self.n))


class Buffers:
    """A fixed set of flat ``[rows, row_bytes]`` buffers (every layer's K and V of a
    pool), each feeding ``heads`` consecutive states from its ``first``. Checked and
    laid out once (a pool's buffers never move), then fed by one library call per
    block of tokens: the per-call cost of ctypes is microseconds, and a small
    transfer would make hundreds of calls otherwise."""

    def __init__(self, heads: int, entries):
        self.heads = int(heads)
        flats = []
        for first, flat in entries:
            if flat.dtype != np.uint8 or flat.ndim != 2 or not flat.flags.c_contiguous:
                raise ValueError("flat must be a C-contiguous [rows, row_bytes] uint8 array")
            if first < 0:
                raise IndexError(f"first state {first}")
            flats.append(flat)
        self._flats = flats  # keeps the buffers alive while their addresses are held
        self.count = len(flats)
        self.states_needed = max((first + self.heads for first, _ in entries), default=0)
        self._bases = np.array([f.ctypes.data for f in flats], np.uint64)
        self._n_rows = np.array([f.shape[0] for f in flats], np.int64)
        self._row_bytes = np.array([f.shape[1] for f in flats], np.int64)
        self._firsts = np.array([first for first, _ in entries], np.int64)

    def update(self, streams: NativeStreams, index: np.ndarray, n: int) -> None:
        """Rows ``index`` ([heads, n] head-major int64) of every buffer into its states."""
        if streams.n < self.states_needed:
            raise IndexError(f"{self.states_needed} states needed, {streams.n} given")
        index = np.ascontiguousarray(index, dtype=np.int64)
        if index.size != self.heads * n:
            raise ValueError(f"index holds {index.size} rows, want {self.heads} x {n}")
        rc = streams.lib.kvg_update_buffers(
            streams.block_address,
            self.heads,
            self.count,
            self._bases.ctypes.data,
            self._n_rows.ctypes.data,
            self._row_bytes.ctypes.data,
            self._firsts.ctypes.data,
            index.ctypes.data,
            n,
        )
        if rc:
            raise IndexError(f"KV rows outside a buffer ({int(self._n_rows.min())} rows)")

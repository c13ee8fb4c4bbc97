"""The sidecar's compiled kernels (kernels.c), a CPython extension module.

Optional by design, like the engine's digest routine (``kvguard.engine_hooks.native``):
each kernel is the exact rule set of a numpy path that stays in the Python code, and
that path runs wherever the module is missing, refused or turned off. Both give the
same verdicts, counts and page model (tests/sidecar/test_native_kernels.py runs both);
the kernel does in one call what the numpy path does in tens of calls of ~1 us fixed
cost each (docs/performance.md, "Bottlenecks and proposals", item 10).

Built by ``make native`` (``sidecar/native/build.sh``: a C compiler and Python's
headers) next to this file, and by the sidecar image's build stage. A module is used
only if its interface version is this file's (``ABI``) and it passes a small self-test
on load; otherwise the reason is logged once and the numpy paths run.

``KVGUARD_SIDECAR_NATIVE=0`` turns it off, ``=1`` (the default) uses it when it loads.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import numpy as np

log = logging.getLogger("kvguard.native")

ABI = 1
ENV = "KVGUARD_SIDECAR_NATIVE"

_status = "not loaded yet"


def _self_test(mod: ModuleType) -> str | None:
    """Why ``mod`` must not be used, or None: a two-request decode step over a four-page
    pool, marked as the numpy path marks it, and one that names a page twice refused."""
    state = np.array([0, 3, 3, 0], np.uint8)  # page 1 and 2 owned by keys 7 and 9, page 3 unknown
    owner_slot = np.array([0, 1, 2, 0], np.uint32)
    slot_keys = np.array([0, 7, 9], np.uint64)
    gen = np.array([0, 5, 6, 7], np.uint32)
    written_gen = np.zeros(4, np.uint32)
    writer_slot = np.zeros(4, np.uint32)
    last_write_ms = np.zeros(4, np.uint32)
    sorted_keys, sorted_slots = np.array([7, 9], np.uint64), np.array([1, 2], np.uint32)

    def call(keys, pages):
        return mod.decode_writes(
            np.array(keys, np.uint64),
            np.ones(len(keys), np.uint32),
            np.array(pages, np.int32),
            state,
            owner_slot,
            slot_keys,
            gen,
            written_gen,
            writer_slot,
            last_write_ms,
            sorted_keys,
            sorted_slots,
            3,
            11,
        )

    if call([9, 9], [2, 2]) != 0 or written_gen.any():
        return "self-test: a page named twice was not refused"
    if call([9, 7], [1, 2]) != 0 or written_gen.any():
        return "self-test: a write to another request's page was not refused"
    if call([7, 9], [1, 3]) != 1:  # (page 3's state is unknown: its writer is kept, not its gen)
        return "self-test: a clean decode step was refused"
    if (
        written_gen.tolist() != [0, 5, 0, 0]
        or writer_slot.tolist() != [0, 1, 0, 2]
        or last_write_ms.tolist() != [0, 11, 0, 11]
    ):
        return "self-test: a clean decode step was marked wrongly"
    return None


def _load() -> ModuleType | None:
    global _status
    if os.environ.get(ENV, "1") == "0":
        _status = f"off ({ENV}=0): numpy paths"
        return None
    try:
        mod = importlib.import_module(f"{__name__}._kernels")
    except ImportError as exc:
        _status = f"not built ({exc}; `make native` builds it): numpy paths"
        log.info("sidecar kernels %s", _status)
        return None
    problem = f"interface version {mod.abi()}, this sidecar needs {ABI}" if mod.abi() != ABI else _self_test(mod)
    if problem:
        _status = f"refused ({problem}): numpy paths"
        log.warning("sidecar kernels %s", _status)
        return None
    _status = f"compiled ({os.path.basename(mod.__file__ or '_kernels')})"
    return mod


KERNELS: ModuleType | None = _load()


def array_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two 1-D integer arrays, compiled where the kernels are loaded and
    the types allow an exact answer (numpy's otherwise)."""
    kernels = KERNELS
    if kernels is not None:
        same = kernels.same_values(a, b)
        if same >= 0:
            return same == 1
    return bool(np.array_equal(a, b))


def status() -> str:
    """Which path runs, and why: for logs, ``kvguard preflight`` and the bench."""
    return _status

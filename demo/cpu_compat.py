"""CPU-only compatibility switches for running real SGLang without a GPU.

Test and demo only. The kvguard SGLang plugin calls :func:`apply` in every engine
scheduler process when ``KVGUARD_SGLANG_CPU_COMPAT=1`` (set by
``demo/engines.py``); production engines never set it.

What it changes:
  * ``MooncakeKVSender.supports_host_tensor_indices = False`` (SGLang >= 0.5.21).
    With it True, prefill copies page indices into ``pin_memory=True`` host memory
    and records a ``torch.cuda.Event``; both fail without CUDA ("pin_memory=True
    requires a CUDA..."). False makes prefill take the plain
    ``kv_to_page_indices`` path. Older releases (0.5.19) lack the attribute and
    need nothing.

Never raises: a failure is logged and reported in the returned dict.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

ENV_VAR = "KVGUARD_SGLANG_CPU_COMPAT"


def _disable_host_tensor_indices() -> str:
    try:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    except Exception as exc:  # noqa: BLE001 - Mooncake/SGLang may be absent or broken
        logger.warning("kvguard cpu_compat: cannot import MooncakeKVSender: %r", exc)
        return f"import failed: {exc!r}"
    if not hasattr(MooncakeKVSender, "supports_host_tensor_indices"):
        return "not needed (attribute absent in this SGLang version)"
    MooncakeKVSender.supports_host_tensor_indices = False
    return "set False"


def apply() -> dict[str, str]:
    """Apply every CPU switch; return ``{switch: outcome}`` for logging."""
    results: dict[str, str] = {}
    for name, fn in (("MooncakeKVSender.supports_host_tensor_indices", _disable_host_tensor_indices),):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - compat shims must not break the engine
            logger.warning("kvguard cpu_compat: %s failed: %r", name, exc)
            results[name] = f"failed: {exc!r}"
    logger.info("kvguard cpu_compat applied: %s", results)
    return results

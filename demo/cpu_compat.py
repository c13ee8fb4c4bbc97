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
  * HiCache (``--enable-hierarchical-cache --hicache-io-backend direct
    --hicache-mem-layout layer_first``) on a CPU, SGLang 0.5.23's ``pool_host`` package:
      - the host pool's buffer is allocated without ``cudaHostRegister``
        (``common.ALLOC_MEMORY_FUNCS["cpu"]``; the default registers it through
        ``torch.cuda.cudart()``: "Torch not compiled with CUDA enabled");
      - ``pool_host.mha.transfer_kv_direct``, imported from sgl_kernel only on CUDA/HIP,
        becomes a torch index copy with the same meaning (``dst[di] = src[si]`` per
        buffer): without it the first backup fails with a NameError;
      - ``torch.cpu.Stream.synchronize`` (absent in torch's CPU stub; called on
        L2TransferEngine's error path) becomes a no-op: CPU copies are synchronous.
    Releases without ``pool_host`` (0.5.19) are left alone.

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


def _alloc_host_unregistered(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """``pool_host.common.alloc_with_host_register`` without the CUDA registration."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """torch stand-in for ``sgl_kernel.kvcacheio.transfer_kv_direct``: for every buffer,
    ``dst[dst_indices] = src[src_indices]``."""
    import torch

    if len(src_layers) != len(dst_layers) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: buffers or indices of different lengths")
    si, di = src_indices.to(torch.long), dst_indices.to(torch.long)
    for src, dst in zip(src_layers, dst_layers):
        dst[di.to(dst.device)] = src[si.to(src.device)].to(dst.device)


def _hicache_on_cpu() -> str:
    try:
        from sglang.srt.mem_cache.pool_host import common, mha
    except ImportError:
        return "not available (no sglang.srt.mem_cache.pool_host in this SGLang version)"
    import torch

    done = []
    if torch.cuda.is_available():
        return "not needed (CUDA is available)"
    common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_host_unregistered
    done.append("host pool unregistered")
    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = _transfer_kv_direct
        done.append("transfer_kv_direct = torch index copy")
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # type: ignore[attr-defined]
        done.append("torch.cpu.Stream.synchronize no-op")
    return ", ".join(done)


def apply() -> dict[str, str]:
    """Apply every CPU switch; return ``{switch: outcome}`` for logging."""
    results: dict[str, str] = {}
    for name, fn in (
        ("MooncakeKVSender.supports_host_tensor_indices", _disable_host_tensor_indices),
        ("HiCache on CPU", _hicache_on_cpu),
    ):
        try:
            results[name] = fn()
        except Exception as exc:  # noqa: BLE001 - compat shims must not break the engine
            logger.warning("kvguard cpu_compat: %s failed: %r", name, exc)
            results[name] = f"failed: {exc!r}"
    logger.info("kvguard cpu_compat applied: %s", results)
    return results

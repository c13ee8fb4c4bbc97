"""What the server says about its KV pool and context length (read, never assumed).

SGLang answers ``GET /server_info`` (``/get_server_info`` before 0.5.x, deprecated
since) with ``max_total_num_tokens`` (the KV pool, tokens), ``page_size``,
``chunked_prefill_size``, ``max_req_input_len``, ``disaggregation_mode``,
``version`` and the launch ``context_length``; ``GET /v1/models`` gives the
enforced ``max_model_len`` and the model id. A vLLM server (its model cards say
``owned_by: vllm``) gives its pool and block size in ``/metrics``
(``vllm:cache_config_info``, sidecar/preflight/vllm.py). OpenAI-compatible servers of
other engines answer only ``/v1/models`` (often without ``max_model_len``): the canary then
uses ``--context-length`` / ``--pool-tokens`` and says in its report what it could not
read. Every GET goes through the request budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..preflight import vllm
from .budget import Budget

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODELS_PATH = "/v1/models"


@dataclass
class ServerLimits:
    """One server's answers; None where it did not say."""

    url: str
    reachable: bool = False
    native: bool = False  # answered an SGLang server-info endpoint
    role: str | None = None  # "unified" | "prefill" | "decode" | None (not reported)
    version: str | None = None
    pool_tokens: int | None = None
    context_len: int | None = None
    max_req_input_len: int | None = None
    page_size: int | None = None
    chunked_prefill_size: int | None = None
    bootstrap_port: int | None = None
    served_port: int | None = None  # the "port" the answering SGLang server was launched with
    model_id: str | None = None
    unread: list[str] = field(default_factory=list)  # what could not be read, and why
    error: str | None = None  # the server could not be reached at all

    def to_json(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in (
                "url",
                "reachable",
                "native",
                "role",
                "version",
                "pool_tokens",
                "context_len",
                "max_req_input_len",
                "page_size",
                "chunked_prefill_size",
                "bootstrap_port",
                "served_port",
                "model_id",
                "unread",
                "error",
            )
        }


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and value > 0 else None


def _get(client: httpx.Client, budget: Budget, url: str) -> tuple[Any, str | None]:
    """(parsed JSON, None) or (None, one-line reason)."""
    budget.take(what=f"GET {url}")
    try:
        r = client.get(url)
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}"
    try:
        return r.json(), None
    except ValueError:
        return None, "not JSON"


def read_limits(client: httpx.Client, budget: Budget, base: str) -> ServerLimits:
    """Read one server (at most 3 GETs). Connection failures set ``error``."""
    lim = ServerLimits(base)
    info, why = None, None
    for path in SERVER_INFO_PATHS:
        info, why = _get(client, budget, base + path)
        if info is not None or (why or "").startswith(("ConnectError", "ConnectTimeout")):
            break
    if why and why.startswith(("ConnectError", "ConnectTimeout")):
        lim.error = f"cannot connect to {base}: {why}"
        return lim
    lim.reachable = True
    if isinstance(info, dict):
        lim.native = True
        mode = info.get("disaggregation_mode")
        lim.role = {None: None, "null": "unified", "prefill": "prefill", "decode": "decode"}.get(mode, str(mode))
        lim.version = str(info["version"]) if info.get("version") is not None else None
        lim.pool_tokens = _int(info.get("max_total_num_tokens"))
        lim.context_len = _int(info.get("context_length"))  # the launch value; /v1/models overrides
        lim.max_req_input_len = _int(info.get("max_req_input_len"))
        lim.page_size = _int(info.get("page_size"))
        lim.chunked_prefill_size = _int(info.get("chunked_prefill_size"))
        lim.bootstrap_port = _int(info.get("disaggregation_bootstrap_port"))
        lim.served_port = _int(info.get("port"))
        if lim.pool_tokens is None:
            lim.unread.append("KV pool size: server info has no max_total_num_tokens")
    else:
        lim.unread.append(
            f"SGLang server info ({' and '.join(SERVER_INFO_PATHS)}: {why}): no KV pool size, "
            f"page size or disaggregation mode"
        )
    models, why = _get(client, budget, base + MODELS_PATH)
    cards = models.get("data") if isinstance(models, dict) else None
    if isinstance(cards, list):
        bases = [c for c in cards if isinstance(c, dict) and c.get("parent") is None]
        if bases:
            lim.model_id = str(bases[0].get("id"))
            lens = [n for n in (_int(c.get("max_model_len")) for c in bases) if n]
            if lens:
                lim.context_len = max(lens)
    else:
        lim.unread.append(f"{MODELS_PATH} ({why or 'no data list'}): no model id or max_model_len")
    if lim.pool_tokens is None and vllm.is_vllm_models(models):
        _read_vllm_pool(client, budget, base, lim)
    if lim.context_len is None:
        lim.unread.append("context length: neither max_model_len nor context_length was reported")
    return lim


def _read_vllm_pool(client: httpx.Client, budget: Budget, base: str, lim: ServerLimits) -> None:
    """A vLLM server: its pool and block size from ``/metrics`` (sidecar/preflight/vllm.py)."""
    budget.take(what=f"GET {base}{vllm.METRICS_PATH}")
    try:
        r = client.get(base + vllm.METRICS_PATH)
        got = vllm.cache_info(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        got = None
    lim.unread = [u for u in lim.unread if not u.startswith("SGLang server info")]
    if got is None:
        lim.unread.append(f"KV pool size: vLLM's {vllm.METRICS_PATH} has no {vllm.CACHE_INFO}")
        return
    blocks, size = got
    lim.pool_tokens, lim.page_size = max(blocks - 1, 0) * size, size


def proxied(lim: ServerLimits) -> bool:
    """True when another server answered for ``lim.url``: SGLang's router in
    prefill/decode mode returns its first decode server's ``/get_server_info``, whose
    ``port`` is that server's, not the router's. (A port remapped by a proxy or a
    Kubernetes Service looks the same; the report says which way it was read.)"""
    if lim.served_port is None:
        return False
    parts = urlsplit(lim.url)
    url_port = parts.port or (443 if parts.scheme == "https" else 80)
    return url_port != lim.served_port

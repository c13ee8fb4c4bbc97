"""HTTP clients for the two API flavours, all streaming (for time to first token).

- :class:`NativeClient`: SGLang ``POST /generate`` (a unified server, or a router
  that does the prefill/decode dispatch itself). The tenant goes in ``routing_key``,
  the field kvguard's SGLang adapter reads (demo/engines.py tenant_payload),
  so the sidecar's findings name the same tenants as the canary's report.
- :class:`PairClient`: a prefill/decode pair without a router: the same
  ``/generate`` body with one random ``bootstrap_room`` and the prefill server's
  bootstrap host/port, posted to both at once, as SGLang's router does. Each probe
  costs two requests of the budget.
- :class:`OpenAIClient`: ``POST /v1/completions``; the tenant goes in the
  ``x-smg-routing-key`` header (the SGLang router's and the engine's) and ``user``.

Every request takes budget first (:class:`~sidecar.canary.budget.Budget`). A client
never raises for what the server does: refused connections, timeouts, HTTP errors
and error chunks all become a :class:`Reply` with ``error`` set.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from .budget import Budget

TENANT_HEADER = "x-smg-routing-key"
TENANT_FIELD = "routing_key"


@dataclass
class Reply:
    """What the client saw of one request."""

    status: int | None = None  # HTTP status; None: no response at all
    text: str = ""
    error: str | None = None  # transport error, HTTP error body, or an error chunk
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    aborted_by_client: bool = False
    rid: str | None = None  # the request id sent (native API): the sidecar's findings name it too

    @property
    def ok(self) -> bool:
        """What a status-code check sees: HTTP 200 and no error in the body."""
        return self.status == 200 and self.error is None


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return " ".join(r.text.split())[:300]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        err = err.get("message") or err
    return " ".join(str(err).split())[:300]


def _sse(r: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in r.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if isinstance(chunk, dict):
            yield chunk


def _chunk_error(chunk: dict[str, Any]) -> str | None:
    if "error" in chunk:
        err = chunk["error"]
        return " ".join(str(err.get("message", err) if isinstance(err, dict) else err).split())[:300]
    return None


class _Streamer:
    """Shared POST-and-stream logic; subclasses read their chunk format."""

    def __init__(self, http: httpx.Client, budget: Budget, timeout_s: float) -> None:
        self.http, self.budget, self.timeout_s = http, budget, timeout_s

    def _stream(
        self, url: str, body: dict[str, Any], headers: dict[str, str], abort_after_first: bool, reply: Reply, on_chunk
    ) -> Reply:
        t0 = time.monotonic()
        try:
            with self.http.stream("POST", url, json=body, headers=headers, timeout=self.timeout_s) as r:
                reply.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    reply.error = f"HTTP {r.status_code}: {_error_text(r)}"
                    return reply
                for chunk in _sse(r):
                    if reply.ttft_s is None:
                        reply.ttft_s = time.monotonic() - t0
                    err = _chunk_error(chunk)
                    if err is not None:
                        reply.error = err
                        continue
                    on_chunk(chunk, reply)
                    if abort_after_first:
                        reply.aborted_by_client = True
                        break  # leaving the block closes the connection: the server sees a client abort
        except (httpx.HTTPError, ValueError) as exc:
            reply.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200] or 'no detail'}"
        finally:
            reply.latency_s = time.monotonic() - t0
        if reply.error is None and reply.finish_reason == "abort" and not reply.aborted_by_client:
            reply.error = "the server aborted the request (finish_reason abort)"
        return reply


def _native_chunk(chunk: dict[str, Any], reply: Reply) -> None:
    text = chunk.get("text")
    if isinstance(text, str):
        # SGLang streams the whole text so far unless --incremental-streaming-output.
        reply.text = text if text.startswith(reply.text) else reply.text + text
    meta = chunk.get("meta_info") or {}
    fr = meta.get("finish_reason")
    if fr is not None:
        reply.finish_reason = fr.get("type") if isinstance(fr, dict) else str(fr)
        if isinstance(fr, dict) and fr.get("type") == "abort" and fr.get("message"):
            reply.error = " ".join(str(fr["message"]).split())[:300]
    for key in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        if isinstance(meta.get(key), int):
            setattr(reply, key, meta[key])


def _native_body(text: str, max_new_tokens: int, tenant: str) -> dict[str, Any]:
    return {
        "rid": f"kvg-canary-{uuid.uuid4().hex[:16]}",
        "text": text,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "stream": True,
        TENANT_FIELD: tenant,
    }


class NativeClient(_Streamer):
    flavour = "native"

    def __init__(self, http: httpx.Client, budget: Budget, timeout_s: float, base: str) -> None:
        super().__init__(http, budget, timeout_s)
        self.base = base

    def send(self, text: str, *, tenant: str, max_new_tokens: int, abort_after_first: bool = False) -> Reply:
        self.budget.take(what="POST /generate")
        body = _native_body(text, max_new_tokens, tenant)
        return self._stream(
            self.base + "/generate",
            body,
            {TENANT_HEADER: tenant},
            abort_after_first,
            Reply(rid=body["rid"]),
            _native_chunk,
        )


class PairClient(_Streamer):
    """A prefill/decode pair driven the way SGLang's router drives it."""

    flavour = "native (prefill/decode pair)"

    def __init__(
        self,
        http: httpx.Client,
        budget: Budget,
        timeout_s: float,
        prefill: str,
        decode: str,
        bootstrap_host: str,
        bootstrap_port: int | None,
    ) -> None:
        super().__init__(http, budget, timeout_s)
        self.prefill, self.decode = prefill, decode
        self.bootstrap_host, self.bootstrap_port = bootstrap_host, bootstrap_port
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvguard-canary-prefill")

    def send(self, text: str, *, tenant: str, max_new_tokens: int, abort_after_first: bool = False) -> Reply:
        self.budget.take(2, what="POST /generate to prefill and decode")
        body = {
            **_native_body(text, max_new_tokens, tenant),
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.randrange(1, 2**63),
        }
        # Prefill's answer matters only as a fallback reason: the client sees decode's.
        fp = self._pool.submit(self._prefill_post, {**body, "stream": False})
        reply = self._stream(
            self.decode + "/generate",
            body,
            {TENANT_HEADER: tenant},
            abort_after_first,
            Reply(rid=body["rid"]),
            _native_chunk,
        )
        prefill_error = fp.result()
        if reply.error and prefill_error:
            reply.error += f" (prefill: {prefill_error})"
        return reply

    def _prefill_post(self, body: dict[str, Any]) -> str | None:
        try:
            r = self.http.post(self.prefill + "/generate", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None if r.status_code == 200 else f"HTTP {r.status_code}: {_error_text(r)}"

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _openai_chunk(chunk: dict[str, Any], reply: Reply) -> None:
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict):
            reply.text += choice.get("text") or ""
            if choice.get("finish_reason"):
                reply.finish_reason = str(choice["finish_reason"])
    usage = chunk.get("usage") or {}
    if isinstance(usage.get("prompt_tokens"), int):
        reply.prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        reply.completion_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        reply.cached_tokens = details["cached_tokens"]


class OpenAIClient(_Streamer):
    flavour = "openai"

    def __init__(self, http: httpx.Client, budget: Budget, timeout_s: float, base: str, model: str) -> None:
        super().__init__(http, budget, timeout_s)
        self.base, self.model = base, model

    def send(self, text: str, *, tenant: str, max_new_tokens: int, abort_after_first: bool = False) -> Reply:
        self.budget.take(what="POST /v1/completions")
        body = {
            "model": self.model,
            "prompt": text,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": tenant,
        }
        return self._stream(
            self.base + "/v1/completions", body, {TENANT_HEADER: tenant}, abort_after_first, Reply(), _openai_chunk
        )

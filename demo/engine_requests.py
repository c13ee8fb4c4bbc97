"""The client side of a /generate request to a prefill/decode pair or its router:
:class:`GenerateResult`, plain and streamed posts, and what an engine's error text names
(:func:`ids_from_error`). Re-exported by :mod:`kvguard.demo.engines`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# ---------------------------------------------------------------- requests


@dataclass
class GenerateResult:
    """The client-visible outcome of one request sent to a prefill/decode pair.

    Through the router (``routed``) the client gets one answer, the router's, which
    relays decode's: it is in ``decode_status`` / ``decode_json`` / ``error``, and
    ``prefill_status`` / ``prefill_error`` stay None. ``rid`` is then decode's rid
    (``meta_info["id"]``; from the error text when decode failed the request; the
    client's own when it sent one) and ``room`` is None unless the answer names it
    (decode's transfer errors do): the router chose it.
    """

    rid: str | None
    room: int | None
    tenant: str | None
    prompt_len: int
    prefill_status: int | None  # HTTP status; None: no response (connection error), or routed
    decode_status: int | None
    decode_json: dict[str, Any] | None = None  # decode's body when it is JSON
    error: str | None = None  # decode's error text (what the client sees)
    prefill_error: str | None = None
    latency_s: float = 0.0  # send -> decode's complete response
    ttft_s: float | None = None  # send -> first streamed chunk (stream=True only)
    prefill_latency_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    routed: bool = False  # sent to SGLang's router (one request), not to both engines
    chunks: int = 0  # streamed chunks received (stream=True only)
    disconnected: bool = False  # the client closed the stream after disconnect_after_chunks chunks

    @property
    def meta_info(self) -> dict[str, Any]:
        return (self.decode_json or {}).get("meta_info") or {}

    @property
    def prompt_tokens(self) -> int | None:
        return self.meta_info.get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self.meta_info.get("completion_tokens")

    @property
    def finish_reason(self) -> str | None:
        fr = self.meta_info.get("finish_reason")
        return fr.get("type") if isinstance(fr, dict) else fr

    @property
    def ok(self) -> bool:
        """What a status-code check sees: decode answered 200 with no error."""
        return self.decode_status == 200 and self.error is None

    def summary(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "room": self.room,
            "tenant": self.tenant,
            "prompt_len": self.prompt_len,
            "routed": self.routed,
            "prefill_status": self.prefill_status,
            "decode_status": self.decode_status,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "error": self.error,
            "prefill_error": self.prefill_error,
            "disconnected": self.disconnected,
            "latency_s": round(self.latency_s, 3),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 3),
        }


# What decode's transfer errors say about the request, e.g. "Decode transfer failed for
# request rank=0 decode_req.req.rid='798c...' decode_req.req.bootstrap_room=2504... with ...".
_ERROR_RID = re.compile(r"\brid='([^']+)'")
_ERROR_ROOM = re.compile(r"\bbootstrap_room=(\d+)")


def ids_from_error(error: str | None) -> tuple[str | None, int | None]:
    """(rid, bootstrap_room) named in an engine's error text, None for what it does not name."""
    if not error:
        return None, None
    rid, room = _ERROR_RID.search(error), _ERROR_ROOM.search(error)
    return (rid.group(1) if rid else None), (int(room.group(1)) if room else None)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


@dataclass
class _Reply:
    status: int | None
    body: dict[str, Any] | None
    error: str | None
    latency_s: float
    ttft_s: float | None = None
    chunks: int = 0
    disconnected: bool = False


def _post(url: str, payload: dict[str, Any], timeout_s: float, t0: float) -> _Reply:
    try:
        r = httpx.post(url, json=payload, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return _Reply(None, None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    latency = time.monotonic() - t0
    if r.status_code != 200:
        return _Reply(r.status_code, None, _error_text(r), latency)
    try:
        return _Reply(200, r.json(), None, latency)
    except ValueError:
        return _Reply(200, None, f"non-JSON body: {r.text[:200]!r}", latency)


def _post_stream(
    url: str, payload: dict[str, Any], timeout_s: float, t0: float, disconnect_after_chunks: int | None = None
) -> _Reply:
    """SSE ``data: {...}`` chunks; SGLang reports errors in a chunk with HTTP 200.

    ``disconnect_after_chunks``: close the connection after that many chunks, as a
    client that goes away mid-stream (SGLang aborts the request when it notices).
    """
    ttft = None
    last: dict[str, Any] | None = None
    error = None
    chunks = 0
    cut = False
    try:
        with httpx.stream("POST", url, json=payload, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                return _Reply(r.status_code, None, _error_text(r), time.monotonic() - t0)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                chunks += 1
                if ttft is None:
                    ttft = time.monotonic() - t0
                if "error" in chunk:
                    err = chunk["error"]
                    error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
                else:
                    last = chunk
                if disconnect_after_chunks is not None and chunks >= disconnect_after_chunks:
                    cut = True
                    break  # leaving the block closes the connection
            status = r.status_code
    except (httpx.HTTPError, ValueError) as exc:
        return _Reply(None, last, f"{type(exc).__name__}: {exc}", time.monotonic() - t0, ttft, chunks)
    return _Reply(status, last, error, time.monotonic() - t0, ttft, chunks, cut)


def _result(d: _Reply, rid: str | None, room: int | None, tenant: str | None, prompt_len: int) -> GenerateResult:
    """A GenerateResult from decode's (or the router's) answer."""
    body_d = d.body or {}
    error = d.error
    fr = (body_d.get("meta_info") or {}).get("finish_reason")
    if error is None and isinstance(fr, dict) and fr.get("type") == "abort":
        # Streaming (and some abort paths) report a failure as HTTP 200 + abort.
        error = str(fr.get("message") or "aborted")
    return GenerateResult(
        rid=rid,
        room=room,
        tenant=tenant,
        prompt_len=prompt_len,
        prefill_status=None,
        decode_status=d.status,
        decode_json=d.body,
        error=error,
        latency_s=d.latency_s,
        ttft_s=d.ttft_s,
        output_ids=list(body_d.get("output_ids") or []),
        chunks=d.chunks,
        disconnected=d.disconnected,
    )

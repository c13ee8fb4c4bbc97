"""``kvguard preflight``: compare a live SGLang (or vLLM) server's KV pool with its context length.

Cloudflare's lesson from the 2026 incident: *compare the KV pool size with the
context length automatically, every deploy*. SGLang sizes the KV pool at start-up
from the memory left after the weights; the advertised context length is a separate
setting, and nothing forces the two to agree. Prompts that fit the context but not
the pool take the engine's reject path, the path the incident leaked through.

The command reads two endpoints of each server (no request is generated):

- ``GET /server_info``: ``max_total_num_tokens`` (the pool, in tokens), ``page_size``,
  ``disaggregation_mode`` (``"null"``, ``"prefill"`` or ``"decode"``),
  ``max_req_input_len``, ``version``, and ``context_length``, which is only the
  launch (CLI) value and is ``null`` when the flag was not given.
- ``GET /v1/models``: ``data[].max_model_len`` of the base model card(s) (LoRA
  adapters carry ``parent`` and ``max_model_len: null``): the context length the
  server actually enforces.

Verified on SGLang 0.5.19 and 0.5.23 HTTP servers (same top-level fields; see
docs/preflight.md).

A vLLM server (no ``/server_info`` outside its development mode) is read from
``/v1/models`` and ``/metrics`` instead (sidecar/preflight/vllm.py).

A ``--url`` may also be SGLang's router (``sglang-router``; it answers ``/server_info``
with 404): preflight lists its workers (``GET /workers``) and checks each one
directly, one report per worker with its URL and role (sidecar/preflight/router.py).

Exit codes, worst over all ``--url`` values and the workers behind them:

- 0 ``safe``: pool >= context length;
- 2 ``pool_smaller_than_context``;
- 1 ``unknown``: cannot tell (unreachable, timeout, HTTP error, not JSON, fields
  missing, malformed URL or token file); the reason is one line.

Usage errors of this sub-command exit 1 too, never 2: exit 2 is the verdict
"pool smaller than context" and a deploy gate must be able to trust it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..detectors.config import PoolVsContext, severity_for
from . import router, vllm

EXIT_SAFE = 0
EXIT_UNKNOWN = 1
EXIT_POOL_SMALLER = 2

SAFE = "safe"
POOL_SMALLER = "pool_smaller_than_context"
UNKNOWN = "unknown"
EXIT_CODES = {SAFE: EXIT_SAFE, POOL_SMALLER: EXIT_POOL_SMALLER, UNKNOWN: EXIT_UNKNOWN}

DEFAULT_TIMEOUT_S = 10.0
TOKEN_ENV = "KVGUARD_BEARER_TOKEN"  # the token itself (e.g. from a Kubernetes Secret)
TOKEN_FILE_ENV = "KVGUARD_BEARER_TOKEN_FILE"  # a file holding it

SERVER_INFO_PATH = "/server_info"
MODELS_PATH = "/v1/models"

# SGLang releases before this one lack both upstream fixes of the incident's reject
# path (0.5.20: aborted prefill results retired, #36988; 0.5.21: admission check).
FIRST_FIXED_SGLANG = (0, 5, 20)

_ROLE_NAMES = {None: "unified", "null": "unified", "prefill": "prefill", "decode": "decode"}
_MAX_WORKERS = 8
_SNIPPET = 120


class PreflightError(Exception):
    """The server's answer cannot be judged; the message is the one-line reason.

    ``status`` is the HTTP status when the server answered with one other than 200.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- the report


@dataclass
class Report:
    """What preflight learned about one server."""

    url: str
    verdict: str = UNKNOWN
    reason: str = ""
    role: str | None = None
    pool_tokens: int | None = None
    context_len: int | None = None
    max_req_input_len: int | None = None
    page_size: int | None = None
    version: str | None = None
    severity: str | None = None  # only for pool_smaller_than_context: "critical" on prefill
    context_source: str | None = None  # "/v1/models" or "/server_info"
    server_info_context_length: int | None = None  # the launch value, often null
    model_max_len: int | None = None  # /v1/models max_model_len (effective)
    notes: list[str] = field(default_factory=list)
    router: str | None = None  # the router URL this server was listed by (None: given directly)
    router_worker_type: str | None = None  # its type in the router's list: prefill, decode, regular

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def ratio(self) -> float | None:
        if self.pool_tokens is None or not self.context_len:
            return None
        return PoolVsContext(self.pool_tokens, self.context_len, self.max_req_input_len or 0).ratio

    def to_json(self) -> dict[str, Any]:
        ratio = self.ratio
        return {
            "url": self.url,
            "role": self.role,
            "pool_tokens": self.pool_tokens,
            "context_len": self.context_len,
            "max_req_input_len": self.max_req_input_len,
            "page_size": self.page_size,
            "verdict": self.verdict,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "ratio": None if ratio is None else round(ratio, 4),
            "severity": self.severity,
            "version": self.version,
            "context_source": self.context_source,
            "server_info_context_length": self.server_info_context_length,
            "model_max_len": self.model_max_len,
            "notes": list(self.notes),
            "router": self.router,
            "router_worker_type": self.router_worker_type,
        }


def _one_line(text: object, limit: int | None = None) -> str:
    s = " ".join(str(text).split())
    if limit is not None and len(s) > limit:
        s = s[: limit - 3] + "..."
    return s


# ---------------------------------------------------------------- inputs


def normalize_url(value: str) -> str:
    """The server's base URL (no trailing slash), or ValueError whose message names ``value``.

    Accepts ``http(s)://HOST[:PORT][/PATH-PREFIX]``; surrounding whitespace is ignored.
    """
    raw = value.strip() if isinstance(value, str) else value
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"--url {value!r} is empty: expected http://HOST:PORT")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in raw):
        raise ValueError(f"--url {value!r} contains whitespace or control characters")
    if "://" not in raw:
        raise ValueError(f"--url {value!r} has no scheme: expected http://HOST:PORT (did you mean 'http://{raw}'?)")
    try:
        parts = urlsplit(raw)
        port = parts.port  # ValueError when not a number in 0..65535
    except ValueError as exc:
        raise ValueError(f"--url {value!r} is not a valid URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"--url {value!r}: scheme must be http or https, got {parts.scheme!r}")
    host = parts.hostname
    if not host:
        raise ValueError(f"--url {value!r} has no host: expected http://HOST:PORT")
    if not re.fullmatch(r"[A-Za-z0-9._\-:%]+", host):
        raise ValueError(f"--url {value!r}: {host!r} is not a host name or IP address")
    if port == 0:
        raise ValueError(f"--url {value!r}: port 0 is not a server port")
    if parts.query or parts.fragment or raw.endswith(("?", "#")):
        raise ValueError(f"--url {value!r} must not have a query or fragment: give the server's base URL")
    base = urlunsplit((parts.scheme.lower(), parts.netloc, parts.path.rstrip("/"), "", ""))
    try:
        httpx.URL(base + SERVER_INFO_PATH)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise ValueError(f"--url {value!r} is not a valid URL: {exc}") from None
    return base


def display_url(url: str) -> str:
    """``url`` with any password in it masked (it ends up in logs and CI output)."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(":" + parts.password + "@", ":***@", 1)
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except ValueError:
        return url


def read_token(token_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The bearer token: ``--bearer-token-file``, else $KVGUARD_BEARER_TOKEN_FILE, else $KVGUARD_BEARER_TOKEN.

    Returns None when none is set; ValueError (one line, never the token) when unusable.
    """
    env = os.environ if environ is None else environ
    path = token_file or env.get(TOKEN_FILE_ENV) or None
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"cannot read the bearer token file {path!r}: {exc.__class__.__name__}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        source = f"bearer token file {path!r}"
    elif env.get(TOKEN_ENV):
        token = env[TOKEN_ENV].strip()
        source = f"${TOKEN_ENV}"
    else:
        return None
    if not token:
        raise ValueError(f"the {source} is empty")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"the {source} holds whitespace or non-ASCII characters inside the token")
    return token


def _timeout_arg(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
    if not math.isfinite(t) or t <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return t


# ---------------------------------------------------------------- reading the server


def _get_json(client: httpx.Client, base: str, path: str, deadline: float, timeout_s: float) -> Any:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise PreflightError(f"timed out after {timeout_s:g} s before GET {path}")
    try:
        r = client.get(base + path, timeout=remaining)
    except httpx.TimeoutException:
        raise PreflightError(f"GET {path} timed out after {timeout_s:g} s") from None
    except httpx.ConnectError as exc:
        raise PreflightError(f"cannot connect for GET {path}: {_one_line(exc) or 'connection failed'}") from None
    except httpx.HTTPError as exc:
        raise PreflightError(f"GET {path} failed: {type(exc).__name__}: {_one_line(exc, 200)}") from None
    if r.status_code != 200:
        hint = ""
        if r.status_code in (401, 403):
            hint = f" (the server wants a bearer token: --bearer-token-file or ${TOKEN_ENV})"
        body = _one_line(r.text, _SNIPPET)
        raise PreflightError(
            f"GET {path} answered HTTP {r.status_code}{hint}" + (f": {body}" if body else ""), status=r.status_code
        )
    try:
        return r.json()
    except ValueError:
        ctype = r.headers.get("content-type", "no content type")
        raise PreflightError(f"GET {path} did not return JSON ({ctype}): {_one_line(r.text, _SNIPPET)!r}") from None


def _count(data: dict[str, Any], key: str, where: str, *, required: bool) -> int | None:
    """A non-negative integer field; None when absent/null and not required; else PreflightError."""
    value = data.get(key)
    if value is None:
        if required:
            state = "null" if key in data else "missing"
            raise PreflightError(f"{where} field {key!r} is {state} (is this an SGLang server?)")
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PreflightError(f"{where} field {key!r} is {_one_line(repr(value), 60)}, not a token count")
    return value


def model_context_len(models: Any) -> tuple[int | None, list[str]]:
    """``max_model_len`` of the base model card(s) in a ``/v1/models`` answer, plus notes.

    LoRA adapter cards (``parent`` set, ``max_model_len`` null) are skipped. With several
    base models the largest context is the one to check. None when there is none.
    """
    notes: list[str] = []
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise PreflightError(f"GET {MODELS_PATH} has no 'data' list")
    lens = []
    for card in data:
        if not isinstance(card, dict) or card.get("parent") is not None:
            continue
        n = _count(card, "max_model_len", f"{MODELS_PATH} model {card.get('id')!r}", required=False)
        if n:
            lens.append(n)
    if not lens:
        return None, notes
    if len(set(lens)) > 1:
        notes.append(f"{MODELS_PATH} lists models with context lengths {sorted(set(lens))}; checking the largest")
    return max(lens), notes


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(x) for x in m.groups()) if m else None


def evaluate(url: str, server_info: Any, models: Any = None, models_error: str | None = None) -> Report:
    """Judge one server from its ``/server_info`` and ``/v1/models`` answers (no I/O).

    ``models`` is the parsed ``/v1/models`` body, or None with ``models_error`` saying why
    it could not be read. Never raises: problems become an ``unknown`` report.
    """
    rep = Report(url)
    try:
        _evaluate(rep, server_info, models, models_error)
    except PreflightError as exc:
        rep.verdict, rep.reason, rep.severity = UNKNOWN, str(exc), None
    return rep


def _evaluate(rep: Report, info: Any, models: Any, models_error: str | None) -> None:
    if not isinstance(info, dict):
        raise PreflightError(f"GET {SERVER_INFO_PATH} returned JSON {type(info).__name__}, not an object")
    where = SERVER_INFO_PATH
    version = info.get("version")
    rep.version = str(version) if version is not None else None
    if "disaggregation_mode" in info:  # absent: role stays None ("not reported")
        mode = info["disaggregation_mode"]
        known = _ROLE_NAMES.get(mode) if isinstance(mode, str) or mode is None else None
        rep.role = known or _one_line(mode if isinstance(mode, str) else repr(mode), 40)
    rep.page_size = _count(info, "page_size", where, required=False)
    rep.max_req_input_len = _count(info, "max_req_input_len", where, required=False)
    rep.server_info_context_length = _count(info, "context_length", where, required=False)
    pool = _count(info, "max_total_num_tokens", where, required=True)
    if pool == 0:
        raise PreflightError(f"{where} reports a KV pool of 0 tokens (max_total_num_tokens=0)")
    rep.pool_tokens = pool

    if models is not None:
        try:
            rep.model_max_len, notes = model_context_len(models)
            rep.notes += notes
        except PreflightError as exc:
            models_error = str(exc)
    cli_ctx = rep.server_info_context_length or None  # 0 is not a context length
    if rep.model_max_len:
        rep.context_len, rep.context_source = rep.model_max_len, MODELS_PATH
        if cli_ctx is not None and cli_ctx != rep.model_max_len:
            rep.notes.append(
                f"context lengths disagree: {SERVER_INFO_PATH} context_length={cli_ctx} is the launch value, "
                f"{MODELS_PATH} max_model_len={rep.model_max_len} is what the server enforces; using "
                f"{rep.model_max_len}"
            )
    elif cli_ctx is not None:
        rep.context_len, rep.context_source = cli_ctx, SERVER_INFO_PATH
        why = models_error or f"{MODELS_PATH} lists no max_model_len"
        rep.notes.append(
            f"effective context length unavailable ({why}); using {SERVER_INFO_PATH} "
            f"context_length={cli_ctx}, the launch value"
        )
    else:
        why = models_error or f"{MODELS_PATH} lists no max_model_len"
        raise PreflightError(
            f"no context length: {why}, and {SERVER_INFO_PATH} context_length is "
            f"{'null' if 'context_length' in info else 'missing'}"
        )

    assert pool is not None and rep.context_len is not None  # required above; else raised
    c = PoolVsContext(pool, rep.context_len, rep.max_req_input_len or 0)
    if c.pool_smaller:
        rep.verdict, rep.severity = POOL_SMALLER, severity_for(rep.role or "")
        limit = rep.max_req_input_len if rep.max_req_input_len is not None else pool
        rep.reason = (
            f"KV pool holds {pool} tokens but the context length is {rep.context_len} "
            f"({c.ratio:.2f}x): prompts longer than {limit} tokens fit the context but not the pool "
            f"and take the engine's reject path"
        )
        vt = _version_tuple(rep.version)
        if vt is not None and vt < FIRST_FIXED_SGLANG and rep.role == "prefill":
            rep.notes.append(
                f"SGLang {rep.version} predates the upstream fixes of this reject path "
                f"(0.5.20, 0.5.21): in prefill/decode mode it leaked other requests' KV"
            )
    else:
        rep.verdict = SAFE
        rep.reason = f"KV pool holds {pool} tokens, at least the context length {rep.context_len} ({c.ratio:.2f}x)"


def _probe(client: httpx.Client, base: str, deadline: float, timeout_s: float, follow_router: bool) -> tuple[str, Any]:
    """``("server", (server_info, models, models_error))`` or ``("router", GET /workers body)``.

    SGLang's router answers ``/server_info`` with 404 and lists its workers at ``/workers``
    (sidecar/preflight/router.py). Raises PreflightError when the URL is neither.
    """
    try:
        info = _get_json(client, base, SERVER_INFO_PATH, deadline, timeout_s)
    except PreflightError as exc:
        if exc.status != 404:
            raise
        if not follow_router:
            served = _probe_vllm(client, base, deadline, timeout_s)  # vLLM: no /server_info outside dev mode
            if served is not None:
                return "server", served
            raise
        try:
            body = _get_json(client, base, router.WORKERS_PATH, deadline, timeout_s)
        except PreflightError as wexc:
            if wexc.status == 404:
                served = _probe_vllm(client, base, deadline, timeout_s)
                if served is not None:
                    return "server", served
                raise PreflightError(
                    f"{exc}; GET {router.WORKERS_PATH} answered HTTP 404 too: neither an SGLang "
                    f"server, nor SGLang's router, nor a vLLM server at this URL"
                ) from None
            raise PreflightError(f"{exc}; as SGLang's router: {wexc}") from None
        if not router.is_router_listing(body):
            raise PreflightError(
                f"{exc}; GET {router.WORKERS_PATH} answered without a router's 'workers' list: "
                f"neither an SGLang server nor SGLang's router at this URL"
            ) from None
        return "router", body
    if follow_router and isinstance(info, dict) and "max_total_num_tokens" not in info:
        # Not a server's answer. A router that answers /server_info itself must still be
        # checked through its workers, never judged (or passed) on its own answer.
        try:
            body = _get_json(client, base, router.WORKERS_PATH, deadline, timeout_s)
        except PreflightError:
            body = None
        if router.is_router_listing(body):
            return "router", body
    models, models_error = None, None
    try:
        models = _get_json(client, base, MODELS_PATH, deadline, timeout_s)
    except PreflightError as exc:
        models_error = str(exc)
    return "server", (info, models, models_error)


def _probe_vllm(client: httpx.Client, base: str, deadline: float, timeout_s: float) -> tuple | None:
    """``(server_info, models, None)`` for a vLLM server (sidecar/preflight/vllm.py), else None.
    Raises PreflightError for a vLLM server whose /metrics cannot be read or lacks its cache config."""
    try:
        models = _get_json(client, base, MODELS_PATH, deadline, timeout_s)
    except PreflightError:
        return None
    if not vllm.is_vllm_models(models):
        return None
    remaining = deadline - time.monotonic()
    try:
        r = client.get(base + vllm.METRICS_PATH, timeout=max(remaining, 0.001))
    except httpx.HTTPError as exc:
        raise PreflightError(f"vLLM server: GET {vllm.METRICS_PATH} failed: {type(exc).__name__}") from None
    if r.status_code != 200:
        raise PreflightError(
            f"vLLM server: GET {vllm.METRICS_PATH} answered HTTP {r.status_code}", status=r.status_code
        )
    try:
        version = _get_json(client, base, vllm.VERSION_PATH, deadline, timeout_s)
    except PreflightError:
        version = None
    info = vllm.server_info(r.text, version)
    if info is None:
        raise PreflightError(f"vLLM server: GET {vllm.METRICS_PATH} has no {vllm.CACHE_INFO} with num_gpu_blocks")
    return info, models, None


def check(
    url: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    token: str | None = None,
    transport: httpx.BaseTransport | None = None,
    follow_router: bool = True,
) -> list[Report]:
    """Read and judge one ``--url`` (a raw value). Never raises.

    An SGLang server gives one report. SGLang's router gives one report per worker it
    lists, each read directly with its own ``timeout_s`` (plus a report with role
    ``router`` when the list is empty, malformed or lacks a prefill/decode side).
    """
    try:
        base = normalize_url(url)
    except ValueError as exc:
        return [Report(url if isinstance(url, str) else repr(url), reason=str(exc))]  # one line: repr()s
    shown = display_url(base)
    headers = {"Accept": "application/json", "User-Agent": "kvguard-preflight"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.Client(headers=headers, timeout=timeout_s, follow_redirects=False, transport=transport) as client:
            kind, answer = _probe(client, base, deadline, timeout_s, follow_router)
    except PreflightError as exc:
        return [Report(shown, reason=_one_line(exc))]
    except Exception as exc:  # noqa: BLE001 - a gate must answer "unknown", never a traceback
        return [Report(shown, reason=f"unexpected error: {type(exc).__name__}: {_one_line(exc, 200)}")]
    if kind == "router":
        return router.check_workers(shown, answer, timeout_s=timeout_s, token=token, transport=transport)
    rep = evaluate(shown, *answer)
    rep.reason = _one_line(rep.reason)
    return [rep]

"""The soak's request mix and the clients that send it (real HTTP, concurrent).

A plan is a seeded list of :class:`Planned` requests; :func:`run_plan` sends it
with a pool of client threads to a plain SGLang server (``send_unified``) or to a
prefill/decode pair behind SGLang's router (``send_routed``) and returns one :class:`Outcome` per request.

Request kinds (``UNIFIED_MIX`` / ``PD_MIX`` give the weights; new tokens are 1-8
unless said otherwise; token ids are random in 3..255):

=============  ==================================================================
short          a unique prompt of 4-40 tokens
prefix         one of its tenant's 2 prefixes (32 / 80 tokens) + 0-16 tokens:
               radix-cache hits (0 extra tokens: all but the last page is cached)
system         a 48-token prefix shared by every tenant + 4-24 tokens
medium         a unique prompt of 65-192 tokens: 2-3 prefill chunks of 64
pressure       24-64 tokens (half of them after a tenant prefix), 24-64 new
               tokens, sent in runs of ``burst`` (= client threads): together they
               outgrow the pool and SGLang retracts requests
near_limit     max_req_input_len-24 .. max_req_input_len-1 tokens (accepted), 1-4
               new tokens (prompt + new <= context length)
reject         max_req_input_len .. context-2 tokens, 1 new token: passes the
               tokenizer's context check, rejected by the scheduler (REJECT,
               1-token placeholder prefill, HTTP 400)
too_long       context .. context+200 tokens: refused by the tokenizer (HTTP 400),
               never reaches the scheduler (no records)
abort_api      streamed, 8-64 tokens, 24-64 new; POST /abort_request after 1-3 chunks
abort_close    the same; the client closes the stream after 1-3 chunks (SGLang
               aborts a disconnected stream ~2 s later, if it is still running)
abort_queued   streamed; /abort_request right after the request is sent, usually
               while it is still queued (PD: to both engines, before the transfer;
               routed: the client closes the stream before its first chunk)
retry          routed only: streamed, the client gives up before the first chunk
               and sends the same body again (the router draws a new room)
=============  ==================================================================

Routed PD (``send_routed``, SGLang's router in front of the pair): the client sends no
rid and no bootstrap fields, as users do; each worker draws its own rid and the router
adds one room. The only rid the client learns is decode's (``meta_info.id``): an
``abort_api`` request is aborted at decode with it (an operator's abort), and
disconnects reach both workers through the router.

Request ids are all the same length: SGLang's abort matches rids by *prefix*
(``req.rid.startswith(abort.rid)``), so "soak-1" would also abort "soak-10".
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from kvguard.demo.engines import tenant_payload

TENANTS = ("acme", "globex", "initech")
MIN_TOKEN, MAX_TOKEN = 3, 255  # 0/1/2 are <unk>/<s>/</s> in the tiny model
PREFIX_LENS = (32, 80)
SYSTEM_PREFIX_LEN = 48

UNIFIED_MIX: dict[str, float] = {
    "short": 0.46,
    "prefix": 0.22,
    "system": 0.08,
    "medium": 0.06,
    "pressure": 0.08,
    "near_limit": 0.005,
    "reject": 0.01,
    "too_long": 0.005,
    "abort_api": 0.03,
    "abort_close": 0.02,
    "abort_queued": 0.03,
}
# PD: no pressure bursts (decode's pool is twice prefill's), the rest as above
PD_MIX: dict[str, float] = {
    "short": 0.36,
    "prefix": 0.25,
    "system": 0.08,
    "medium": 0.10,
    "near_limit": 0.01,
    "reject": 0.02,
    "too_long": 0.01,
    "abort_api": 0.07,
    "abort_close": 0.06,
    "abort_queued": 0.04,
}
# Through SGLang's router (no rids): the same, plus clients that give up and retry
ROUTED_MIX: dict[str, float] = {**PD_MIX, "short": 0.32, "retry": 0.04}
ABORT_KINDS = ("abort_api", "abort_close", "abort_queued")


@dataclass(frozen=True)
class Limits:
    """What the engine accepts (from /server_info, or computed like SGLang does)."""

    context_len: int
    max_req_input_len: int


@dataclass
class Planned:
    idx: int
    kind: str
    rid: str
    tenant: str
    input_ids: list[int]
    max_new_tokens: int
    abort_after: int = 0  # streamed chunks read before aborting (abort kinds)

    @property
    def stream(self) -> bool:
        return self.kind in ABORT_KINDS or self.kind == "retry"


@dataclass
class Outcome:
    req: Planned
    status: int | None = None  # HTTP status of the (decode) server; None: no response
    finish: str | None = None  # meta_info.finish_reason.type
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    chunks: int = 0  # streamed chunks received
    latency_s: float = 0.0
    prefill_status: int | None = None  # PD only
    prefill_error: str | None = None
    engine_rid: str | None = None  # routed: the rid decode drew (meta_info.id), the only one the client sees
    attempts: int = 1  # routed retry: requests sent for this planned one

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish in ("length", "stop")


def _rid(phase: str, idx: int) -> str:
    # fixed width: no rid is a prefix of another (SGLang aborts by rid prefix)
    return f"soak-{phase[:3]}-{idx:07d}-{uuid.uuid4().hex[:12]}"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(MIN_TOKEN, MAX_TOKEN) for _ in range(n)]


def make_plan(
    n: int,
    limits: Limits,
    *,
    mix: dict[str, float] = UNIFIED_MIX,
    seed: int = 0,
    phase: str = "uni",
    tenants: Sequence[str] = TENANTS,
    burst: int = 1,
) -> list[Planned]:
    """``n`` requests, kinds drawn with ``mix``'s weights (at least one of each kind
    when ``n`` allows), in a seeded random order; ``pressure`` requests come in runs
    of ``burst`` (set it to the client concurrency) so that they decode together."""
    rng = random.Random(seed)
    prefixes = {t: [_tokens(rng, k) for k in PREFIX_LENS] for t in tenants}
    system = _tokens(rng, SYSTEM_PREFIX_LEN)
    kinds = list(mix)
    counts = {k: max(1, round(mix[k] * n)) if n >= 2 * len(kinds) else 0 for k in kinds}
    while sum(counts.values()) > n:
        counts[max(counts, key=counts.get)] -= 1
    chosen = [k for k in kinds for _ in range(counts[k])]
    chosen += rng.choices(kinds, weights=[mix[k] for k in kinds], k=n - len(chosen))
    rng.shuffle(chosen)
    if burst > 1:  # pressure requests in runs of `burst`: together they outgrow the pool
        rest = [k for k in chosen if k != "pressure"]
        n_pressure = len(chosen) - len(rest)
        bursts = [["pressure"] * min(burst, n_pressure - i) for i in range(0, n_pressure, burst)]
        slots = sorted(rng.sample(range(len(rest) + 1), len(bursts)))
        chosen = []
        for i, k in enumerate(rest + [None]):
            while slots and slots[0] == i:
                slots.pop(0)
                chosen += bursts.pop()
            if k is not None:
                chosen.append(k)
    ctx, limit = limits.context_len, limits.max_req_input_len
    plan = []
    for i, kind in enumerate(chosen):
        tenant = tenants[i % len(tenants)]
        mnt = rng.randint(1, 8)
        abort_after = 0
        if kind == "short":
            ids = _tokens(rng, rng.randint(4, 40))
        elif kind == "prefix":
            ids = rng.choice(prefixes[tenant]) + _tokens(rng, rng.choice((0, rng.randint(1, 16))))
        elif kind == "system":
            ids = system + _tokens(rng, rng.randint(4, 24))
        elif kind == "medium":
            ids = _tokens(rng, rng.randint(65, 192))
        elif kind == "pressure":
            base = rng.choice(prefixes[tenant][:2]) if rng.random() < 0.5 else []
            ids = base + _tokens(rng, rng.randint(24, 64))
            mnt = rng.randint(24, 64)
        elif kind == "near_limit":
            length = rng.randint(limit - 24, limit - 1)
            mnt = rng.randint(1, max(1, min(4, ctx - length)))
            ids = _tokens(rng, length)
        elif kind == "reject":
            mnt = 1
            length = rng.randint(limit, max(limit, ctx - 1 - mnt))
            ids = _tokens(rng, length)
        elif kind == "too_long":
            ids = _tokens(rng, rng.randint(ctx, ctx + 200))
        elif kind in ABORT_KINDS:
            ids = _tokens(rng, rng.randint(8, 64))
            mnt = rng.randint(24, 64)
            abort_after = 0 if kind == "abort_queued" else rng.randint(1, 3)
        elif kind == "retry":
            ids = (rng.choice(prefixes[tenant]) if rng.random() < 0.5 else []) + _tokens(rng, rng.randint(4, 64))
        else:
            raise ValueError(f"unknown request kind {kind!r}")
        plan.append(Planned(i, kind, _rid(phase, i), tenant, ids, mnt, abort_after))
    return plan


def mix_summary(plan: Sequence[Planned]) -> dict[str, Any]:
    """Counts per kind and tenant, prompt-length statistics and the total of max_new_tokens."""
    lens = [len(p.input_ids) for p in plan]
    return {
        "requests": len(plan),
        "by_kind": dict(sorted(Counter(p.kind for p in plan).items())),
        "by_tenant": dict(sorted(Counter(p.tenant for p in plan).items())),
        "prompt_tokens": {
            "min": min(lens),
            "max": max(lens),
            "mean": round(sum(lens) / len(lens), 1),
            "total": sum(lens),
        },
        "max_new_tokens_total": sum(p.max_new_tokens for p in plan),
    }


# ------------------------------------------------------------------ HTTP


def body_of(p: Planned, with_rid: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        **({"rid": p.rid} if with_rid else {}),
        "input_ids": p.input_ids,
        # NOTE: no ignore_eos: with it SGLang's admission reserves every new token
        # (ratio 1.0) and never has to retract. The dummy model does not stop early.
        "sampling_params": {"max_new_tokens": p.max_new_tokens, "temperature": 0.0},
        "stream": p.stream,
        **tenant_payload(p.tenant, routed=not with_rid),  # through the router the tenant rides in extra_key
        **extra,
    }


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:300]
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)[:300]
    return str(err)[:300]


def _fill_meta(out: Outcome, body: dict[str, Any] | None) -> None:
    meta = (body or {}).get("meta_info") or {}
    out.engine_rid = meta.get("id", out.engine_rid)
    fr = meta.get("finish_reason")
    out.finish = fr.get("type") if isinstance(fr, dict) else fr
    out.prompt_tokens = meta.get("prompt_tokens")
    out.completion_tokens = meta.get("completion_tokens")
    out.cached_tokens = meta.get("cached_tokens")
    if out.finish == "abort" and out.error is None and out.req.kind not in ABORT_KINDS:
        out.error = str((fr or {}).get("message") or "aborted")


def post_abort(client: httpx.Client, url: str, rid: str) -> None:
    try:
        client.post(url + "/abort_request", json={"rid": rid}, timeout=30.0)
    except httpx.HTTPError:
        pass


def _plain(client: httpx.Client, url: str, body: dict[str, Any], out: Outcome, timeout_s: float) -> None:
    try:
        r = client.post(url + "/generate", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return
    out.status = r.status_code
    if r.status_code != 200:
        out.error = _error_text(r)
        return
    try:
        _fill_meta(out, r.json())
    except ValueError:
        out.error = f"non-JSON body {r.text[:200]!r}"


def _streamed(
    client: httpx.Client,
    url: str,
    abort_urls: Sequence[str],
    body: dict[str, Any],
    out: Outcome,
    timeout_s: float,
    routed: bool = False,
) -> None:
    """Stream; abort as the request's kind says (the abort itself is never an error). ``routed``:
    the client knows no rid until decode's first chunk names it, so a queued abort is a close
    before the first chunk and ``abort_api`` aborts decode's rid at ``abort_urls``."""
    p = out.req
    last = None
    try:
        with client.stream("POST", url + "/generate", json=body, timeout=timeout_s) as r:
            out.status = r.status_code
            if r.status_code != 200:
                r.read()
                out.error = _error_text(r)
                return
            if routed and p.kind in ("abort_queued", "retry"):
                out.finish = "closed"
                return  # leaving the block closes the connection before any chunk
            if p.kind == "abort_queued":
                for u in abort_urls:
                    post_abort(client, u, p.rid)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    out.error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
                    continue
                last = chunk
                out.chunks += 1
                if out.chunks == p.abort_after:
                    if p.kind == "abort_close":
                        break  # leaving the block closes the connection mid-stream
                    rid = (chunk.get("meta_info") or {}).get("id") if routed else p.rid
                    for u in abort_urls:
                        post_abort(client, u, rid)
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    _fill_meta(out, last)
    if p.kind == "abort_close" and out.error is None:
        out.finish = out.finish if out.chunks < p.abort_after else "closed"


_local = threading.local()


def _client() -> httpx.Client:
    c = getattr(_local, "client", None)
    if c is None:
        c = _local.client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=4))
    return c


def send_unified(url: str, timeout_s: float = 300.0) -> Callable[[Planned], Outcome]:
    def send(p: Planned) -> Outcome:
        out = Outcome(p)
        t0 = time.monotonic()
        body = body_of(p)
        if p.stream:
            _streamed(_client(), url, [url], body, out, timeout_s)
        else:
            _plain(_client(), url, body, out, timeout_s)
        out.latency_s = time.monotonic() - t0
        return out

    return send


def send_routed(router_url: str, decode_url: str, timeout_s: float = 300.0) -> Callable[[Planned], Outcome]:
    """As users send through SGLang's router: one request, no rid, no bootstrap fields (the
    router adds bootstrap_host/port/room and forwards to a prefill and a decode worker)."""

    def send(p: Planned) -> Outcome:
        out = Outcome(p)
        t0 = time.monotonic()
        body = body_of(p, with_rid=False)
        if p.kind == "retry":  # gives up before the first chunk, then sends the same body again
            _streamed(_client(), router_url, [], body, out, timeout_s, routed=True)
            out = Outcome(p, attempts=2)
            _plain(_client(), router_url, {**body, "stream": False}, out, timeout_s)
        elif p.stream:
            _streamed(_client(), router_url, [decode_url], body, out, timeout_s, routed=True)
        else:
            _plain(_client(), router_url, body, out, timeout_s)
        out.latency_s = time.monotonic() - t0
        return out

    return send


def run_plan(
    plan: Sequence[Planned],
    send: Callable[[Planned], Outcome],
    concurrency: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[Outcome]:
    """Send every planned request with ``concurrency`` client threads; outcomes in plan order."""
    done = 0
    lock = threading.Lock()

    def one(p: Planned) -> Outcome:
        nonlocal done
        try:
            out = send(p)
        except Exception as exc:  # noqa: BLE001 - a client bug is an outcome, not a crash
            out = Outcome(p, error=f"client {type(exc).__name__}: {exc}")
        with lock:
            done += 1
            n = done
        if progress is not None:
            progress(n, len(plan))
        return out

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="soak-client") as pool:
        return list(pool.map(one, plan))


def outcome_summary(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Per kind: how the clients saw it (status / finish / error classes; PD: and prefill's status)."""
    per: dict[str, Counter] = {}
    for o in outcomes:
        c = per.setdefault(o.req.kind, Counter())
        seen = f"error {o.status}" if o.error is not None else f"{o.status} {o.finish}"
        if o.prefill_status is not None or o.prefill_error is not None:
            seen += f" (prefill {o.prefill_status})"
        c[seen] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(per.items())}

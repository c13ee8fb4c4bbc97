"""Run the canary: discover, plan, send, search B's outputs for A's markers.

Never raises for what the endpoint does; every way of not being able to run ends
in a :class:`~sidecar.canary.report.Report` with ``could_not_run`` set.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from ..preflight import normalize_url
from .budget import Budget, BudgetExhausted
from .clients import NativeClient, OpenAIClient, PairClient, Reply
from .limits import ServerLimits, proxied, read_limits
from .markers import DEFAULT_MIN_OVERLAP, MarkerSet, filler_text, find_leak
from .plan import DEFAULT_MAX_PROMPT_TOKENS, Probe, Sizing, build_plan
from .report import Finding, Report, RequestRecord

DEFAULT_TIMEOUT_S = 60.0  # per request: outlasts SGLang's default decode waiting timeout on a pair
DEFAULT_TIME_LIMIT_S = 600.0  # the whole run
# TTFT warning: a 200 whose TTFT is below this fraction of (uncached prompt tokens x the
# victims' median TTFT per uncached token), for prompts at least as long as the victims'.
TTFT_FRACTION = 0.2
SHARED_PREFIX = "public preamble shared by every tenant of this service: please answer briefly and politely. "


@dataclass
class Options:
    url: str
    prefill_url: str | None = None
    api: str = "auto"  # "auto" | "native" | "openai"
    model: str | None = None
    context_length: int | None = None
    pool_tokens: int | None = None
    budget: int = 64
    timeout_s: float = DEFAULT_TIMEOUT_S
    time_limit_s: float = DEFAULT_TIME_LIMIT_S
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    min_overlap: int = DEFAULT_MIN_OVERLAP
    seed: int | None = None
    tenant_a: str = "kvguard-canary-a"
    tenant_b: str = "kvguard-canary-b"
    on_request: Callable[[int], None] | None = None  # n requests about to go out (a progress bar)


def run_canary(opts: Options, transport: httpx.BaseTransport | None = None) -> Report:
    rep = Report(url=opts.url, budget=opts.budget)
    try:
        budget = Budget(opts.budget, on_take=opts.on_request)
    except ValueError as exc:
        return rep.fail(str(exc))
    rep.budget_obj = budget
    t_end = time.monotonic() + opts.time_limit_s
    try:
        base = normalize_url(opts.url)
        prefill = normalize_url(opts.prefill_url) if opts.prefill_url else None
    except ValueError as exc:
        return rep.fail(str(exc))
    with httpx.Client(
        transport=transport,
        timeout=min(opts.timeout_s, 10.0),
        follow_redirects=False,
        headers={"User-Agent": "kvguard-canary"},
    ) as http:
        try:
            return _run(opts, rep, http, budget, base, prefill, t_end)
        except BudgetExhausted as exc:  # a plan bug; the budget still held
            return rep.fail(f"stopped: {exc}")


def _run(
    opts: Options, rep: Report, http: httpx.Client, budget: Budget, base: str, prefill: str | None, t_end: float
) -> Report:
    lim = read_limits(http, budget, base)
    rep.servers.append(lim)
    if lim.error:
        return rep.fail(lim.error)
    pre: ServerLimits | None = None
    if prefill:
        pre = read_limits(http, budget, prefill)
        rep.servers.append(pre)
        if pre.error:
            return rep.fail(pre.error)
        if pre.role != "prefill":
            return rep.fail(f"--prefill-url {prefill} reports role {pre.role!r}, not prefill")
    # Who answers at --url: a decode server itself, or a router showing its first decode
    # server's info (SGLang's router does): requests go through a router as they are.
    behind_router = lim.role == "decode" and proxied(lim)
    if behind_router:
        rep.notes.append(
            f"{base} answered with the server info of the decode server on port {lim.served_port}: "
            f"treated as a prefill/decode router"
        )
        if pre is None and opts.pool_tokens is None:
            lim.unread.append(
                "the prefill pool: a router shows a decode server's info; give --prefill-url "
                "(read only) or --pool-tokens with the prefill pool (kvguard preflight --url PREFILL)"
            )
    elif lim.role in ("prefill", "decode") and not (lim.role == "decode" and pre is not None):
        return rep.fail(
            f"{base} is the {lim.role} server of a prefill/decode pair: point --url at the router "
            f"(what clients use), or give --url DECODE --prefill-url PREFILL and the canary sends each "
            f"request to both, as SGLang's router does"
        )
    elif pre is not None and lim.role != "decode":
        return rep.fail(
            f"--prefill-url needs --url to be a router or the decode server; {base} reports role {lim.role!r}"
        )

    api = opts.api
    if api == "auto":
        api = "native" if lim.native else "openai"
    model = opts.model or lim.model_id or (pre.model_id if pre else None)
    rep.model = model
    rep.api = api
    if api == "openai" and not model:
        return rep.fail("no model id: /v1/models listed none; give --model")

    client: NativeClient | PairClient | OpenAIClient
    per_request = 1
    if pre is not None and not behind_router:
        assert prefill is not None  # (``pre`` is the prefill server's)
        host = str(urlsplit(prefill).hostname or "127.0.0.1")
        if pre.bootstrap_port is None:
            pre.unread.append("disaggregation_bootstrap_port: not reported; using SGLang's default 8998")
        client = PairClient(http, budget, opts.timeout_s, prefill, base, host, pre.bootstrap_port or 8998)
        per_request = 2
        rep.api = client.flavour
    elif api == "native":
        client = NativeClient(http, budget, opts.timeout_s, base)
    else:
        client = OpenAIClient(http, budget, opts.timeout_s, base, model or "")  # (api openai: model checked above)
    if behind_router:
        rep.api += " (through a prefill/decode router)"

    pool_in = opts.pool_tokens or (pre.pool_tokens if pre else lim.pool_tokens)
    sizing = Sizing(
        pool_in=pool_in,
        pool_decode=lim.pool_tokens or pool_in,
        context_len=opts.context_length or lim.context_len or (pre.context_len if pre else None),
        max_input=(pre.max_req_input_len if pre else lim.max_req_input_len),
        max_prompt_tokens=opts.max_prompt_tokens,
    )
    rep.sizing = sizing
    try:
        plan = build_plan(sizing, budget.left, per_request)
    except ValueError as exc:
        return rep.fail(str(exc))
    rep.skipped += plan.skipped
    try:
        _send_plan(opts, rep, client, plan.probes, t_end)
    finally:
        if isinstance(client, PairClient):
            client.close()
    return rep


def _send_plan(opts: Options, rep: Report, client, probes: list[Probe], t_end: float) -> None:
    rng = random.Random(opts.seed)
    markers = MarkerSet.new(rng)
    rep.marker_run = markers.run_id
    victim_prompts: list[str] = []
    # Characters per token, per tenant's kind of text (markers and words tokenize differently):
    # measured on the first successful answer of each; B uses A's until its own is known.
    ratio: dict[str, float] = {}
    victim_rates: list[float] = []
    i = 0
    while i < len(probes):
        group = [probes[i]]
        if probes[i].group:
            while i + len(group) < len(probes) and probes[i + len(group)].group == probes[i].group:
                group.append(probes[i + len(group)])
        i += len(group)
        if time.monotonic() > t_end:
            rep.skipped.append(
                f"{len(group) + len(probes) - i} request(s) not sent: --time-limit {opts.time_limit_s:g} s reached"
            )
            break
        texts = []
        for p in group:
            chars = max(1, int(round(p.prompt_tokens * ratio.get(p.tenant, ratio.get("A", 1.0)))))
            prefix = SHARED_PREFIX if p.shared_prefix else ""
            if p.tenant == "A":
                text = markers.victim_text(len(victim_prompts), chars, prefix)
                victim_prompts.append(text)
            else:
                text = filler_text(chars, rng, prefix)
            texts.append(text)
        tenant = {"A": opts.tenant_a, "B": opts.tenant_b}

        def send(pt: tuple[Probe, str], tenant: dict[str, str] = tenant) -> Reply:
            probe, prompt = pt
            return client.send(
                prompt,
                tenant=tenant[probe.tenant],
                max_new_tokens=probe.max_new_tokens,
                abort_after_first=probe.abort_after_first,
            )

        if len(group) == 1:
            replies = [send((group[0], texts[0]))]
        else:
            with ThreadPoolExecutor(max_workers=len(group)) as pool:
                replies = list(pool.map(send, zip(group, texts)))
        for p, text, reply in zip(group, texts, replies):
            rec = RequestRecord(len(rep.requests), p, tenant[p.tenant], len(text), reply)
            rep.requests.append(rec)
            if reply.ok and reply.prompt_tokens and p.tenant not in ratio and not p.shared_prefix:
                ratio[p.tenant] = len(text) / reply.prompt_tokens
                rep.chars_per_token[rec.tenant] = round(ratio[p.tenant], 3)
            if p.tenant == "A" and reply.ok:
                uncached = (reply.prompt_tokens or 0) - (reply.cached_tokens or 0)
                if reply.ttft_s and uncached > 0:
                    victim_rates.append(reply.ttft_s / uncached)
            if p.phase == "victim" and p is probes[0] and not reply.ok:
                rep.fail(f"the first victim request failed: {_reason(reply)}; no marker is planted")
                return
            if p.tenant == "B":
                _judge(opts, rep, rec, text, victim_prompts, markers, victim_rates)
    if not any(r.reply.ok for r in rep.requests if r.probe.tenant == "A"):
        rep.fail("no victim request succeeded")
    elif not any(r.reply.status is not None for r in rep.requests if r.probe.tenant == "B"):
        rep.fail(
            "no probe request got an answer: "
            + "; ".join(sorted({_reason(r.reply) for r in rep.requests if r.probe.tenant == "B"}))[:300]
        )


def _reason(reply: Reply) -> str:
    return reply.error or f"HTTP {reply.status}"


def _judge(
    opts: Options,
    rep: Report,
    rec: RequestRecord,
    text: str,
    victim_prompts: list[str],
    markers: MarkerSet,
    victim_rates: list[float],
) -> None:
    reply, p, sizing = rec.reply, rec.probe, rep.sizing
    leak = find_leak(reply.text, text, victim_prompts, markers, opts.min_overlap)
    if leak is not None:
        rec.leak = leak
        rep.findings.append(
            Finding(
                "marker_leak",
                rec.index,
                f"request #{rec.index} ({p.phase}, tenant {rec.tenant}) answered with tenant {opts.tenant_a}'s marker "
                f"text {leak.fragment!r} ({len(leak.fragment)} characters; blocks {', '.join(leak.blocks) or '?'}) "
                f"from victim request(s) {', '.join('#' + str(_victim_index(rep, v)) for v in leak.victims) or '?'}",
            )
        )
    served = reply.ok and reply.finish_reason != "abort"
    if p.expect == "error" and served and sizing is not None:
        limit = sizing.context_len if p.phase == "over_context" else sizing.pool_in
        if reply.prompt_tokens is not None and limit is not None and reply.prompt_tokens <= limit:
            rec.note = (
                f"answered 200 with prompt_tokens {reply.prompt_tokens} <= {limit}: the server truncated or "
                f"tokenized it shorter; not judged"
            )
        else:
            what = "context length" if p.phase == "over_context" else "KV pool that must hold it"
            rep.findings.append(
                Finding(
                    "should_have_been_error",
                    rec.index,
                    f"request #{rec.index} ({p.phase}): a {reply.prompt_tokens or '?'}-token prompt, longer than the "
                    f"{what} ({limit}), was answered HTTP 200 with {reply.completion_tokens} generated tokens: its KV "
                    f"cannot all have been computed",
                )
            )
    if served and victim_rates and reply.ttft_s is not None and reply.prompt_tokens:
        uncached = reply.prompt_tokens - (reply.cached_tokens or 0)
        victim_len = max((r.reply.prompt_tokens or 0) for r in rep.requests if r.probe.tenant == "A")
        floor = TTFT_FRACTION * statistics.median(victim_rates) * uncached
        if uncached >= victim_len and reply.ttft_s < floor:
            rep.warnings.append(
                f"request #{rec.index} ({p.phase}): time to first token {reply.ttft_s * 1000:.0f} ms for "
                f"{uncached} uncached prompt tokens, below {TTFT_FRACTION:g} x the victims' "
                f"{statistics.median(victim_rates) * 1e6:.0f} us per token ({floor * 1000:.0f} ms): was the prompt "
                f"really computed?"
            )


def _victim_index(rep: Report, victim_no: int) -> int:
    """The request index of the ``victim_no``-th A request."""
    a = [r.index for r in rep.requests if r.probe.tenant == "A"]
    return a[victim_no] if victim_no < len(a) else -1

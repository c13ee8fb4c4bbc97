"""Which probes to send, sized to the limits the server reported and to the budget.

Sizes are in tokens; the runner turns them into characters with the ratio it
measures on the first victim request (the server reports ``prompt_tokens``).

Phases, in order (each B request's output is searched for A's markers):

1. ``victim`` (A): ``n`` marker prompts of ``victim_tokens`` (90% of the largest
   prompt the pool takes, at most ``--max-prompt-tokens`` and 2048), one at a time,
   enough to pass ~1.5x the decode-side pool through the allocator, so that freed
   pages hold markers when B comes.
2. ``near_pool`` (B): just under the pool: must succeed, with B's own text; its
   ``prompt_tokens`` measure how B's text tokenizes, for the sizes below.
3. ``over_pool`` (B): prompts longer than the pool that must hold them (prefill's
   in a prefill/decode pair) but within the context length: the incident's path. A
   healthy engine fails them; a 200 whose ``prompt_tokens`` exceed that pool is a
   finding by itself (the KV cannot have been computed).
4. ``over_context`` (B): context length + 16 tokens: must be an error.
5. ``shared_prefix``: A then B with the same public prefix (prefix cache), B's
   continuation its own.
6. ``abort``: a B stream cancelled after its first chunk, then a B request that
   may get its freed pages.
7. ``concurrent``: A and B requests at once.

When the budget does not hold the whole plan, phases are dropped from the end
(concurrency first), then ``over_pool`` lengths and victims are reduced; below
the minimum (discovery, 2 victims, 1 probe) the canary does not run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_VICTIM_TOKENS = 2048
DEFAULT_MAX_PROMPT_TOKENS = 16384
OVER_POOL_LENGTHS = 4
CONCURRENT_PAIRS = 4
PROBE_NEW_TOKENS = 32  # B's window onto what it attends to (tokens it generates)
VICTIM_NEW_TOKENS = 4


@dataclass
class Probe:
    """One request to send."""

    phase: str
    tenant: str  # "A" (victim) or "B" (prober)
    prompt_tokens: int
    max_new_tokens: int
    expect: str  # "ok" | "error" | "any"
    why: str
    group: int = 0  # probes with the same non-zero group are sent at once
    shared_prefix: bool = False
    abort_after_first: bool = False


@dataclass
class Sizing:
    """The numbers the plan is built from (tokens)."""

    pool_in: int | None  # the pool a prompt must fit (prefill's in a pair)
    pool_decode: int | None  # the pool decode-side pages come from (same as pool_in when unified)
    context_len: int | None
    max_input: int | None  # max_req_input_len where reported
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS


@dataclass
class Plan:
    probes: list[Probe]
    victim_tokens: int
    skipped: list[str] = field(default_factory=list)  # phases left out, and why

    def cost(self, per_request: int) -> int:
        return len(self.probes) * per_request


def _largest_fitting(s: Sizing) -> int | None:
    """The longest prompt the server should take (tokens), from what it reported."""
    known = [n for n in (s.pool_in, s.context_len, s.max_input) if n]
    return min(known) if known else None


def build_plan(s: Sizing, budget_left: int, per_request: int) -> Plan:
    """The plan for ``budget_left`` HTTP requests at ``per_request`` requests per probe.

    ValueError (its message is the reason) when the budget or the limits allow no run.
    """
    fit = _largest_fitting(s)
    if fit is None:
        raise ValueError(
            "no KV pool size or context length could be read; give --context-length (and "
            "--pool-tokens for OpenAI-only endpoints)"
        )
    victim_tokens = max(16, min(int(fit * 0.9), MAX_VICTIM_TOKENS, s.max_prompt_tokens))
    pool_decode = s.pool_decode or s.pool_in or fit
    n_victims = min(12, max(2, math.ceil(1.5 * pool_decode / victim_tokens) + 1))
    skipped: list[str] = []

    over_pool: list[int] = []
    if s.pool_in and s.context_len and s.pool_in < s.context_len:
        # NOTE: in a pair, decode must be able to reserve the prompt (its pool is the larger one), or it
        # waits instead of reading; a unified server has one pool, the one being exceeded.
        decode_cap = int(pool_decode * 0.95) if pool_decode > s.pool_in else s.context_len
        upper = min(s.context_len, decode_cap, s.max_prompt_tokens)
        if upper > s.pool_in + 1:
            step = (upper - s.pool_in) / (OVER_POOL_LENGTHS + 1)
            over_pool = sorted({int(s.pool_in + step * (k + 1)) for k in range(OVER_POOL_LENGTHS)})
        else:
            skipped.append(
                f"over_pool: the pool ({s.pool_in}) is smaller than the context ({s.context_len}) but "
                f"no longer prompt fits the decode pool or --max-prompt-tokens ({s.max_prompt_tokens})"
            )
    else:
        skipped.append(
            "over_pool: the pool holds the context length (or either is unknown): no prompt fits the "
            "context but not the pool"
        )

    def victims(n: int) -> list[Probe]:
        return [
            Probe("victim", "A", victim_tokens, VICTIM_NEW_TOKENS, "ok", "plant markers in the KV pool")
            for _ in range(n)
        ]

    # near_pool goes first: its answer also measures how B's text tokenizes (over_pool sizes use it)
    optional: list[tuple[str, list[Probe]]] = [
        (
            "near_pool",
            [
                Probe(
                    "near_pool",
                    "B",
                    max(16, min(fit, s.max_prompt_tokens) - 8),
                    16,
                    "ok",
                    "just under the largest prompt the pool takes",
                )
            ],
        )
    ]
    if s.context_len and s.context_len + 16 <= s.max_prompt_tokens:
        optional.append(
            (
                "over_context",
                [
                    Probe(
                        "over_context",
                        "B",
                        s.context_len + 16,
                        16,
                        "error",
                        "longer than the context length: must be rejected",
                    )
                ],
            )
        )
    else:
        skipped.append(
            f"over_context: context length {s.context_len} unknown or above --max-prompt-tokens ({s.max_prompt_tokens})"
        )
    optional.append(
        (
            "shared_prefix",
            [
                Probe(
                    "shared_prefix",
                    "A",
                    victim_tokens,
                    VICTIM_NEW_TOKENS,
                    "ok",
                    "markers after a public prefix",
                    shared_prefix=True,
                ),
                Probe(
                    "shared_prefix",
                    "B",
                    victim_tokens,
                    PROBE_NEW_TOKENS,
                    "ok",
                    "same public prefix, own continuation (prefix cache)",
                    shared_prefix=True,
                ),
            ],
        )
    )
    optional.append(
        (
            "abort",
            [
                Probe(
                    "abort",
                    "B",
                    victim_tokens,
                    256,
                    "any",
                    "stream cancelled after the first chunk",
                    abort_after_first=True,
                ),
                Probe("abort", "B", victim_tokens, PROBE_NEW_TOKENS, "ok", "may get the cancelled request's pages"),
            ],
        )
    )
    conc = []
    for _ in range(CONCURRENT_PAIRS):
        conc.append(Probe("concurrent", "A", victim_tokens, VICTIM_NEW_TOKENS, "ok", "markers, at once", group=1))
        conc.append(Probe("concurrent", "B", victim_tokens, PROBE_NEW_TOKENS, "ok", "alongside A", group=1))
    optional.append(("concurrent", conc))

    def over(lengths: list[int]) -> list[Probe]:
        return [
            Probe(
                "over_pool",
                "B",
                n,
                PROBE_NEW_TOKENS,
                "error",
                "fits the context, not the pool that must hold it (the 2026 incident's path)",
            )
            for n in lengths
        ]

    # Shrink to the budget: optional phases from the end, then over_pool lengths, then victims.
    probes_left = budget_left // per_request
    while True:
        rest = [p for _, ps in optional for p in ps]
        near = [p for p in rest if p.phase == "near_pool"]
        probes = victims(n_victims) + near + over(over_pool) + [p for p in rest if p.phase != "near_pool"]
        if len(probes) <= probes_left:
            break
        if optional:
            name, _ = optional.pop()
            skipped.append(f"{name}: not enough budget")
        elif len(over_pool) > 1:
            over_pool = over_pool[len(over_pool) // 2 :][: len(over_pool) - 1]
        elif n_victims > 2:
            n_victims -= 1
        else:
            break
    if len(probes) > probes_left or not any(p.tenant == "B" for p in probes):
        need = (2 + 1) * per_request
        raise ValueError(
            f"the budget leaves {budget_left} requests after discovery; the smallest plan (2 victim "
            f"requests and 1 probe) needs {need}"
        )
    return Plan(probes, victim_tokens, skipped)

"""The incident, replayed against a real SGLang prefill/decode pair on CPU.

Shape (../shared/brief/incident.md): the prefill KV pool is smaller than the
advertised context length. Tenants "acme" and "globex" send normal ~200-token
requests, so the decode pool's pages get written and freed (pages are not zeroed).
Then tenant "initech" sends a prompt longer than the prefill pool:

  * SGLang 0.5.19 (leaks): prefill rejects the prompt but still bootstraps it and
    sends 1 page; decode, which reserved pages for the full prompt, generates over
    pages last written by acme/globex. The client sees a normal completion.
  * SGLang 0.5.23 (fixed): prefill rejects it before bootstrap; decode holds its
    reservation until SGLANG_DISAGGREGATION_WAITING_TIMEOUT, then fails it (500).

NOTE: keep the decode pool small (1024 tokens): the allocator hands out never-used
pages before reused ones, so a large pool would give the long prompt fresh pages
and leave nothing stale to read.

The same scenario runs on the tiny GLM-5 and DeepSeek-V2 (``kvguard demo --model ...``,
demo/engines.py ``sglang_arch``). GLM-5's DSA pool has 64-token pages (prefill pool 512
tokens, decode 1024 = 16 pages): decode reserves 10 pages for the 600-token prompt, prefill
sends the first, decode's own first write lands in the last (position 600), and the 8 between
are read with what the earlier requests left there (seen on SGLang 0.5.19: acme's and globex's
latent KV in all 8).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvguard.demo.engines import Engine, GenerateResult, PDPair

NORMAL_TENANTS = ("acme", "globex")
LONG_TENANT = "initech"
# Token ids 0/1/2 are <unk>/<s>/</s> in the tiny model; prompts avoid them.
MIN_TOKEN_ID, MAX_TOKEN_ID = 3, 255

# Engine log lines that show the leak path (or its absence), per role.
EVIDENCE_PATTERNS = {
    "prefill": (
        r"exceeds the maximum allowed length",
        r"Traceback|Exception|\bERROR\b",
    ),
    "decode": (
        r"exceeds the maximum allowed length",
        r"KVTransferError|WaitingForInput|[Tt]imed out|Request .* timeout|abort",
        r"Traceback|Exception|\bERROR\b",
    ),
}
# Lines never worth showing (start-up noise that matches the patterns above).
_EVIDENCE_SKIP = re.compile(r"server_args=|Ignore import error|Failed to load plugin|openai_harmony")


def make_prompt(length: int, rng: random.Random) -> list[int]:
    """``length`` random token ids in 3..255 (no shared prefixes between prompts)."""
    return [rng.randint(MIN_TOKEN_ID, MAX_TOKEN_ID) for _ in range(length)]


# The leak in words, with the echo GPT-2 (demo/echo_model.py, docs/echo-model.md)
# on the default pools (prefill 256, decode 1024 tokens, page size 4), SGLang 0.5.19.
# Decode's allocator gives the 600-token prompt pages 1-150; with these lengths they were
# last written by requests #4 (acme), #5 (globex) and #6 (acme), and positions 188-254
# exist only in #4's pages (#4 is the only prompt longer than 200 tokens; #5's 148
# tokens keep #6's pages below page 150 from covering them). The echo model's query at
# new token i (i >= 1) looks up position 600 + i - 413 = 187 + i, so tokens 1..60 of the
# long request's completion are characters 188..247 of acme's request #4.
WORDS_DEMO = {
    "lag": 413,
    "normal_prompt_lens": (200, 200, 200, 200, 248, 148, 200, 200),
    "long_prompt_len": 600,
    "long_max_new_tokens": 61,
}
_WORDS = {
    "acme": "acme payroll: wire 2,400,000 USD to IBAN DE89370400440532013000 by Friday; CFO approval code 7731-ALPHA. ",
    "globex": "globex board memo: offer 41.50 per share for Initrode, vote on May 3, keep it quiet until the filing. ",
}


def words_demo_prompts(tenants: tuple[str, ...] = NORMAL_TENANTS) -> list[list[int]]:
    """The normal requests' prompts for :data:`WORDS_DEMO`: each tenant's confidential text,
    repeated to the request's length, as echo-model token ids (one per character)."""
    from kvguard.demo.echo_model import encode_text

    prompts = []
    for i, n in enumerate(WORDS_DEMO["normal_prompt_lens"]):
        tenant = tenants[i % len(tenants)]
        text = f"[{tenant} #{i}] " + _WORDS.get(tenant, f"{tenant} private notes. ") * 8
        prompts.append(encode_text(text[:n]))
    return prompts


@dataclass
class ScenarioRequest:
    """One request of the scenario and what its client saw."""

    kind: str  # "normal" | "long"
    result: GenerateResult
    prompt: list[int] = field(default_factory=list)  # the token ids sent

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.result.summary()}


@dataclass
class ScenarioResult:
    version: str
    prefill_pool_tokens: int
    decode_pool_tokens: int
    prefill_max_req_input_len: int | None
    requests: list[ScenarioRequest]
    duration_s: float
    evidence: dict[str, list[str]] = field(default_factory=dict)

    @property
    def normal(self) -> list[ScenarioRequest]:
        return [r for r in self.requests if r.kind == "normal"]

    @property
    def long(self) -> ScenarioRequest:
        return next(r for r in self.requests if r.kind == "long")

    @property
    def long_request_served(self) -> bool:
        """The incident's symptom: the over-length prompt got a normal completion."""
        return self.long.result.ok

    def summary(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "prefill_pool_tokens": self.prefill_pool_tokens,
            "decode_pool_tokens": self.decode_pool_tokens,
            "prefill_max_req_input_len": self.prefill_max_req_input_len,
            "duration_s": round(self.duration_s, 2),
            "long_request_served": self.long_request_served,
            "requests": [r.summary() for r in self.requests],
        }


def _tell(progress: Callable[[str], None] | None, n: int, total: int, req: ScenarioRequest) -> None:
    if progress is None:
        return
    r = req.result
    answer = f"HTTP {r.decode_status}" if r.decode_status is not None else "no answer"
    answer += f", {r.completion_tokens} tokens generated" if r.ok else f": {(r.error or '').strip()[:80]}"
    progress(f"request {n}/{total}: {r.tenant}, {len(req.prompt)} tokens -> {answer} ({r.latency_s:.1f} s)")


def collect_evidence(engine: Engine | None, patterns: tuple[str, ...], max_lines: int = 20) -> list[str]:
    """Log lines of ``engine`` matching any of ``patterns`` (first ``max_lines``)."""
    if engine is None:
        return []
    rx = re.compile("|".join(f"(?:{p})" for p in patterns))
    out: list[str] = []
    try:
        with open(engine.log_path, errors="replace") as f:
            for line in f:
                if rx.search(line) and not _EVIDENCE_SKIP.search(line):
                    out.append(line.rstrip())
                    if len(out) >= max_lines:
                        break
    except OSError:
        pass
    return out


def run_incident_scenario(
    pair: PDPair,
    *,
    num_normal: int = 8,
    normal_prompt_len: int = 200,
    long_prompt_len: int = 600,
    max_new_tokens: int = 8,
    normal_tenants: tuple[str, ...] = NORMAL_TENANTS,
    long_tenant: str = LONG_TENANT,
    seed: int = 0,
    concurrency: int = 1,
    settle_s: float = 1.0,
    stream: bool = False,
    normal_prompts: Sequence[Sequence[int]] | None = None,
    long_prompt: Sequence[int] | None = None,
    long_max_new_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ScenarioResult:
    """Normal requests from ``normal_tenants`` (round-robin, in waves of
    ``concurrency`` at once), a pause of ``settle_s`` for decode to free their pages,
    then one prompt of ``long_prompt_len`` tokens (longer than the prefill pool)
    from ``long_tenant``.

    NOTE: with the defaults (8 x 200 tokens, one at a time, into a 1024-token decode
    pool) the long request reserves decode pages 1..150, all last written by
    acme/globex. Why: SGLang's paged allocator takes pages from the front of its
    free list and merges in (sorted) released pages only when the front is too
    short. 8 requests leave ~47 pages at the front, so the 150-page reservation
    triggers the merge and starts at page 1; after 6 requests ~151 pages would be
    left and the reservation would include ~45 never-written pages.
    ``stream`` streams decode's answers to measure client TTFT; with streaming,
    SGLang reports a failed request as HTTP 200 plus an ``abort`` finish reason.
    Takes ~5 s on 0.5.19; on 0.5.23 the long request lasts until decode's
    waiting timeout.
    ``normal_prompts`` / ``long_prompt`` replace the random prompts (then
    ``num_normal`` / ``normal_prompt_len`` / ``long_prompt_len`` are ignored);
    ``long_max_new_tokens`` overrides ``max_new_tokens`` for the long request
    (see :data:`WORDS_DEMO` for the echo model). ``progress`` gets one line per request
    answered. Requests go through ``pair.generate``: to SGLang's router with no rid when
    the pair has one (each request's ``result.rid`` is then decode's rid).
    """
    if pair.prefill is None or pair.decode is None:
        raise RuntimeError("the PDPair is not started")
    rng = random.Random(seed)
    try:
        max_input = pair.prefill.server_info().get("max_req_input_len")
    except Exception:  # noqa: BLE001 - informational only
        max_input = None
    t0 = time.monotonic()
    requests: list[ScenarioRequest] = []
    if normal_prompts is None:
        normal_prompts = [make_prompt(normal_prompt_len, rng) for _ in range(num_normal)]
    prompts = [(normal_tenants[i % len(normal_tenants)], list(p)) for i, p in enumerate(normal_prompts)]
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for start in range(0, len(prompts), max(1, concurrency)):
            wave = prompts[start : start + max(1, concurrency)]
            futures = [
                pool.submit(pair.generate, p, tenant=t, max_new_tokens=max_new_tokens, stream=stream) for t, p in wave
            ]
            for f, (_, p) in zip(futures, wave):
                requests.append(ScenarioRequest("normal", f.result(), p))
                _tell(progress, len(requests), len(prompts) + 1, requests[-1])
    time.sleep(settle_s)
    long_ids = list(long_prompt) if long_prompt is not None else make_prompt(long_prompt_len, rng)
    if progress is not None:
        progress(
            f"request {len(prompts) + 1}/{len(prompts) + 1}: {long_tenant}, {len(long_ids)} tokens "
            f"(longer than the prefill pool)..."
        )
    r = pair.generate(long_ids, tenant=long_tenant, max_new_tokens=long_max_new_tokens or max_new_tokens, stream=stream)
    requests.append(ScenarioRequest("long", r, long_ids))
    _tell(progress, len(requests), len(requests), requests[-1])
    duration = time.monotonic() - t0
    evidence = {
        "prefill": collect_evidence(pair.prefill, EVIDENCE_PATTERNS["prefill"]),
        "decode": collect_evidence(pair.decode, EVIDENCE_PATTERNS["decode"]),
    }
    return ScenarioResult(
        version=pair.version,
        prefill_pool_tokens=pair.prefill_pool_tokens,
        decode_pool_tokens=pair.decode_pool_tokens,
        prefill_max_req_input_len=max_input,
        requests=requests,
        duration_s=duration,
        evidence=evidence,
    )

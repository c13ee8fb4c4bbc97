"""``ttft_anomaly``: time to first token implausibly short for the uncached prompt.

The incident's tell: the over-length request's answer arrived faster than an 8-page
prefill could have produced it, because nothing was prefilled. Prefill work grows with
the tokens that are not served from the prefix cache, so the model learns, per engine,
the time per *uncached* prompt token of requests that finished normally, and flags a
request that claims a normal finish with a time per uncached token far below what
this engine has ever plausibly needed.

Model: a rolling window (``window`` samples) of (uncached tokens, TTFT) of normally
finished requests with at least ``min_tokens`` uncached tokens. Prefill time does not
decrease with more tokens, so a request with n uncached tokens cannot plausibly get
its first token much sooner than requests with *fewer* tokens did: the floor for n is
the ``quantile`` (10th percentile) of the TTFTs of window samples with between n/8
and n uncached tokens (at least 5 of them), and the request is flagged when its TTFT
is below floor / ``factor`` (4x) AND its time per uncached token is 4x below the 10th
percentile of all samples' time per token. Either test alone false-alarms on real
traffic: per token, the per-request constant (scheduling, one step) makes short
prompts look slow and long ones anomalously fast (the soak found this); per request,
a request that did not queue looks fast next to ones that did. A prompt that was not
prefilled at all (the incident) fails both by orders of magnitude. Warm-up: no
verdicts until ``warmup`` samples were learned (a cold engine's first requests, with
compilation and cache misses, are learned from, never judged). Flagged samples are
not learned from, so an ongoing anomaly cannot drag the floor down. Requests that
were rejected or aborted, or with fewer than ``min_tokens`` uncached tokens (prefix
cache hits), warmup requests, and requests prefilled more than once (their KV was
released before they finished: SGLang's optimistic PD prefill retry re-prefills from
the prefix cache it just filled, so the cached-token count of REQ_BEGIN no longer
holds; flagged by the engine in REQ_END) are neither judged nor learned from.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..findings import WARNING, EngineRef, Finding
from ..tracker import RequestInfo
from .reads import reader_party

NORMAL_FINISH = ("stop", "length")


class TTFTModel:
    def __init__(self, window: int = 512, quantile: float = 10.0):
        self.samples: deque[tuple[int, int]] = deque(maxlen=window)  # (uncached tokens, ttft_ns)
        self.quantile = quantile

    def floor_ns_per_token(self) -> float:
        per_token = np.fromiter((t / n for n, t in self.samples), float, len(self.samples))
        return float(np.percentile(per_token, self.quantile))

    def floor_ns(self, uncached: int, min_candidates: int = 5) -> float | None:
        """10th percentile TTFT of samples with between uncached/8 and uncached tokens."""
        tokens = np.fromiter((n for n, _ in self.samples), np.int64, len(self.samples))
        ttfts = np.fromiter((t for _, t in self.samples), np.int64, len(self.samples))
        near = (tokens <= uncached) & (tokens * 8 >= uncached)
        if int(near.sum()) < min_candidates:
            return None
        return float(np.percentile(ttfts[near], self.quantile))


class TTFTDetector:
    def __init__(self, min_tokens: int = 32, warmup: int = 20, factor: float = 4.0, window: int = 512,
                 enabled: bool = True):
        self.enabled = enabled
        if factor <= 1:
            raise ValueError(f"ttft factor must be > 1, got {factor}")
        self.min_tokens, self.warmup, self.factor, self.window = min_tokens, warmup, factor, window
        self.models: dict[int, TTFTModel] = {}

    def observe(self, engine_id: int, engine: EngineRef, info: RequestInfo, ts_ns: int) -> list[Finding]:
        uncached = info.prompt_tokens - info.cached_tokens
        if not self.enabled or engine.role == "decode":
            return []  # decode never prefills: its "TTFT" is the transfer wait (the ledger judges transfers)
        if (info.warmup or not info.known or info.reprefilled or info.ttft_ns <= 0 or uncached < self.min_tokens
                or info.finish not in NORMAL_FINISH):
            return []
        model = self.models.setdefault(engine_id, TTFTModel(self.window))
        if len(model.samples) >= self.warmup:
            floor = model.floor_ns(uncached)
            too_fast_per_token = info.ttft_ns / uncached * self.factor < model.floor_ns_per_token()
            if floor is not None and info.ttft_ns * self.factor < floor and too_fast_per_token:
                return [self._finding(engine, info, uncached, floor, len(model.samples), ts_ns)]
        model.samples.append((uncached, info.ttft_ns))
        return []

    def _finding(self, engine: EngineRef, info: RequestInfo, uncached: int, floor: float, samples: int,
                 ts_ns: int) -> Finding:
        summary = (f"{engine.role} rank {engine.rank}: request {info.rid} (tenant {info.tenant or '?'}) got its first "
                   f"token after {info.ttft_ns / 1e6:.1f} ms for {uncached} uncached prompt tokens; requests with "
                   f"{uncached // 8}-{uncached} uncached tokens took at least {floor / 1e6:.1f} ms here (10th "
                   f"percentile): was the prompt really prefilled?")
        evidence = {"ttft_ns": info.ttft_ns, "uncached_tokens": uncached, "prompt_tokens": info.prompt_tokens,
                    "ns_per_token": round(info.ttft_ns / uncached, 1), "floor_ttft_ns": round(floor, 1),
                    "factor": self.factor, "samples": samples, "reader_rejected": info.rejected}
        return Finding("ttft_anomaly", WARNING, engine, reader_party(info), [], [], ts_ns, summary, evidence)

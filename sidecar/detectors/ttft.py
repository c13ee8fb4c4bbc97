"""``ttft_anomaly``: time to first token implausibly short for the uncached prompt.

The incident's tell: the over-length request's answer arrived faster than an 8-page
prefill could have produced it, because nothing was prefilled. Prefill work grows with
the tokens that are not served from the prefix cache, so the model learns, per engine,
the time per *uncached* prompt token of requests that finished normally, and flags a
request that claims a normal finish with a time per uncached token far below what
this engine has ever plausibly needed.

Model: a rolling window (``window`` samples) of ``ttft_ns / uncached_tokens`` for
normally finished requests with at least ``min_tokens`` uncached tokens. The floor is
the ``quantile`` (10th percentile) of the window: robust to outliers and, since
queueing only ever *adds* time, queueing delay cannot cause an alarm, it only makes
samples slower. A request is flagged when its time per uncached token is below
floor / ``factor`` (4x faster than the fast end of everything seen). Warm-up: no
verdicts until ``warmup`` samples were learned (a cold engine's first requests, with
compilation and cache misses, are learned from, never judged). Flagged samples are
not learned from, so an ongoing anomaly cannot drag the floor down. Requests that
were rejected or aborted, or with fewer than ``min_tokens`` uncached tokens (prefix
cache hits), and warmup requests are neither judged nor learned from.
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
        self.samples: deque[float] = deque(maxlen=window)
        self.quantile = quantile

    def floor_ns_per_token(self) -> float:
        return float(np.percentile(np.fromiter(self.samples, float), self.quantile))


class TTFTDetector:
    def __init__(self, min_tokens: int = 32, warmup: int = 20, factor: float = 4.0, window: int = 512):
        if factor <= 1:
            raise ValueError(f"ttft factor must be > 1, got {factor}")
        self.min_tokens, self.warmup, self.factor, self.window = min_tokens, warmup, factor, window
        self.models: dict[int, TTFTModel] = {}

    def observe(self, engine_id: int, engine: EngineRef, info: RequestInfo, ts_ns: int) -> list[Finding]:
        uncached = info.prompt_tokens - info.cached_tokens
        if (info.warmup or not info.known or info.ttft_ns <= 0 or uncached < self.min_tokens
                or info.finish not in NORMAL_FINISH):
            return []
        model = self.models.setdefault(engine_id, TTFTModel(self.window))
        per_token = info.ttft_ns / uncached
        if len(model.samples) >= self.warmup:
            floor = model.floor_ns_per_token()
            if per_token * self.factor < floor:
                return [self._finding(engine, info, uncached, per_token, floor, len(model.samples), ts_ns)]
        model.samples.append(per_token)
        return []

    def _finding(self, engine: EngineRef, info: RequestInfo, uncached: int, per_token: float, floor: float,
                 samples: int, ts_ns: int) -> Finding:
        summary = (f"{engine.role} rank {engine.rank}: request {info.rid} (tenant {info.tenant or '?'}) got its first "
                   f"token after {info.ttft_ns / 1e6:.1f} ms for {uncached} uncached prompt tokens "
                   f"({per_token / 1e3:.1f} us/token); this engine has needed at least {floor / 1e3:.1f} us/token "
                   f"(10th percentile of {samples} requests): was the prompt really prefilled?")
        evidence = {"ttft_ns": info.ttft_ns, "uncached_tokens": uncached, "prompt_tokens": info.prompt_tokens,
                    "ns_per_token": round(per_token, 1), "floor_ns_per_token": round(floor, 1),
                    "factor": self.factor, "samples": samples, "reader_rejected": info.rejected}
        return Finding("ttft_anomaly", WARNING, engine, reader_party(info), [], [], ts_ns, summary, evidence)

"""``ttft_anomaly``: time to first token implausibly short for the uncached prompt.

The incident's tell: the over-length request's answer arrived faster than an 8-page
prefill could have produced it, because nothing was prefilled. Prefill work grows with
the tokens that are not served from the prefix cache, so the model learns, per engine,
the TTFT of requests that finished normally against their *uncached* prompt tokens,
and flags a request that claims a normal finish with a TTFT far below what this engine
plausibly needs for that much prompt.

Model: a rolling window (``window`` samples) of (uncached tokens, TTFT) of normally
finished requests with at least ``min_tokens`` uncached tokens. Prefill time does not
decrease with more tokens, so a request with n uncached tokens cannot plausibly get
its first token much sooner than requests with *fewer* tokens did: the floor for n is
the ``quantile`` (10th percentile) of the TTFTs of samples with between n/8 and n
uncached tokens (at least 5 of them). A request is *suspect* when its TTFT is below
floor / ``factor`` (4x) AND its time per uncached token is 4x below the 10th
percentile of all samples' time per token. Either test alone false-alarms on real
traffic: per token, the per-request constant (scheduling, one step) makes short
prompts look slow and long ones anomalously fast (the soak found this); per request,
a request that did not queue looks fast next to ones that did.

Load changes: the floor is learned at whatever speed the engine had. When the engine
speeds up (load on the host drops, the batch mix changes), a normal request looks
fast next to a floor learned while it was slowed (the PD soak under outside CPU load
found this: a fixed floor flagged normal requests once the load went). So a suspect
is not judged against the past alone: its verdict waits for ``confirm`` later
requests of comparable size (between n/8 and n uncached tokens), and it is flagged
only if it is also too fast by both tests against requests that ran *after* it, at
the engine's new speed. If those later requests are just as fast, the engine sped
up: the suspect is learned from, and no finding is raised. A suspect more than
``certain_factor`` (32x) below the past floor is flagged at once: no load change
makes prefill 32 times faster, and the incident's placeholder prefill (one token for
a 2,000-token prompt) is hundreds of times below it. A suspect still waiting after
``max_wait_ns`` (or when its engine goes) is judged against everything learned by
then (the past window plus the later requests).

Evidence before timing: TTFT also depends on how much other work shares the request's
forwards (a PD soak at 8 concurrent clients: a prompt prefilled alone in 5-9 ms, its
size class 45-120 ms when prompts overlapped), so a request can be fast for a good
reason. Before a suspect waits or is flagged, the sidecar's own records are asked
(``RequestEnded.prompt_pages``, counted by the tracker as the forwards came): the pages
this request's own forwards wrote while its seq_len was within its prompt, against the
pages its uncached prompt spans. A suspect whose forwards wrote its whole uncached prompt (one page of slack) was
prefilled, just fast: it is learned from (``suspects_explained``), never flagged.
Only suspects the records cannot explain (prompt pages never written, or no count: the
request began before the sidecar attached, or a gap since) go on to the timing verdict, and a finding carries
both counts as evidence.

Warm-up: no verdicts until ``warmup`` samples were learned (a cold engine's first
requests, with compilation and cache misses, are learned from, never judged). Flagged
requests are not learned from, so an ongoing anomaly cannot drag the floor down.
Requests that were rejected or aborted, or with fewer than ``min_tokens`` uncached
tokens (prefix cache hits), warmup requests, and requests prefilled more than once
(their KV was released before they finished: SGLang's optimistic PD prefill retry
re-prefills from the prefix cache it just filled, so the cached-token count of
REQ_BEGIN no longer holds; flagged by the engine in REQ_END) are neither judged nor
learned from.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..catalogue import KIND, TTFT
from ..events import RequestEnded
from ..findings import WARNING, EngineRef, Finding, Party
from ..request_directory import RequestInfo
from ..stats import TTFTStats
from .base import At
from .reads import reader_party

NORMAL_FINISH = ("stop", "length")


class Samples:
    """The last ``window`` (uncached tokens, ttft_ns) pairs as two int64 ring buffers: the
    floors below are computed over them vectorised (they were a Python pass over a deque of
    tuples per request end, 40% of a saturated sidecar's time)."""

    __slots__ = ("uncached", "ttft_ns", "_n", "_next")

    def __init__(self, window: int):
        self.uncached = np.zeros(window, np.int64)
        self.ttft_ns = np.zeros(window, np.int64)
        self._n = self._next = 0

    def append(self, sample: tuple[int, int]) -> None:
        i = self._next
        self.uncached[i], self.ttft_ns[i] = sample
        self._next = (i + 1) % len(self.uncached)
        self._n = min(self._n + 1, len(self.uncached))

    def __len__(self) -> int:
        return self._n

    def __iter__(self):  # oldest first
        start = self._next if self._n == len(self.uncached) else 0
        for k in range(self._n):
            i = (start + k) % len(self.uncached)
            yield int(self.uncached[i]), int(self.ttft_ns[i])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(uncached, ttft_ns) of the samples held, in no particular order."""
        return self.uncached[: self._n], self.ttft_ns[: self._n]


def _arrays(samples) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(samples, Samples):
        return samples.arrays()
    pairs = np.asarray(list(samples), np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _floor_ns(samples, uncached: int, quantile: float, min_candidates: int) -> float | None:
    """``quantile`` TTFT of samples with between uncached/8 and uncached tokens."""
    n, t = _arrays(samples)
    near = t[(n <= uncached) & (n * 8 >= uncached)]
    if len(near) < min_candidates:
        return None
    return float(np.percentile(near, quantile))


def _floor_ns_per_token(samples, quantile: float) -> float:
    n, t = _arrays(samples)
    return float(np.percentile(t / n, quantile))


class TTFTModel:
    def __init__(self, window: int = 512, quantile: float = 10.0):
        self.samples = Samples(window)  # (uncached tokens, ttft_ns)
        self.quantile = quantile

    def floor_ns_per_token(self) -> float:
        return _floor_ns_per_token(self.samples, self.quantile)

    def floor_ns(self, uncached: int, min_candidates: int = 5) -> float | None:
        return _floor_ns(self.samples, uncached, self.quantile, min_candidates)


@dataclass(slots=True)
class Suspect:
    """A request too fast against the past, waiting for later requests to confirm it."""

    engine: EngineRef
    reader: Party
    info: RequestInfo
    uncached: int
    past_floor_ns: float
    samples: int
    seen_ns: int
    written: tuple | None = None  # (prompt pages its forwards wrote, pages its uncached prompt spans)
    later: deque = field(default_factory=lambda: deque(maxlen=512))  # (uncached, ttft_ns) of requests ended after it

    def comparable(self) -> int:
        return sum(1 for n, _t in self.later if n <= self.uncached and n * 8 >= self.uncached)


class TTFTDetector:
    def __init__(
        self,
        min_tokens: int = 32,
        warmup: int = 20,
        factor: float = 4.0,
        window: int = 512,
        enabled: bool = True,
        confirm: int = 5,
        certain_factor: float = 32.0,
        max_wait_ns: int = 300_000_000_000,
        max_suspects: int = 256,
    ):
        self.enabled = enabled
        if factor <= 1:
            raise ValueError(f"ttft factor must be > 1, got {factor}")
        if certain_factor < factor:
            raise ValueError(f"ttft certain_factor must be >= factor ({factor}), got {certain_factor}")
        self.min_tokens, self.warmup, self.factor, self.window = min_tokens, warmup, factor, window
        self.confirm, self.certain_factor, self.max_wait_ns = confirm, certain_factor, max_wait_ns
        self.max_suspects = max_suspects
        self.models: dict[int, TTFTModel] = {}
        self.suspects: dict[int, list[Suspect]] = {}  # engine id -> waiting, oldest first
        self.suspects_cleared = 0  # suspects the later requests showed to be a speed-up, not an anomaly
        self.suspects_explained = 0  # suspects whose own forwards wrote their whole uncached prompt

    def stats(self) -> TTFTStats:
        """The deferred verdicts' figures (sidecar/stats.py); all 0 while the detector is off."""
        return TTFTStats(
            suspects_waiting=sum(len(waiting) for waiting in self.suspects.values()),
            suspects_cleared=self.suspects_cleared,
            suspects_explained=self.suspects_explained,
        )

    # ------------------------------------------------------------------ input
    kinds: ClassVar[tuple[str, ...]] = (KIND.ttft_anomaly,)
    events: ClassVar[tuple[type, ...]] = (RequestEnded,)
    switch: ClassVar[str] = TTFT
    stats_field: ClassVar[str] = "ttft"  # PipelineStats.ttft

    def observe(self, ended: RequestEnded, at: At) -> list[Finding]:
        info, engine, engine_id, ts_ns = ended.info, at.engine, at.engine_id, at.ts_ns
        uncached = info.prompt_tokens - info.cached_tokens
        if not self.enabled or engine.role == "decode":
            return []  # decode never prefills: its "TTFT" is the transfer wait (the ledger judges transfers)
        if (
            info.warmup
            or not info.known
            or info.reprefilled
            or info.ttft_ns <= 0
            or uncached < self.min_tokens
            or info.finish not in NORMAL_FINISH
        ):
            return []
        model = self.models.setdefault(engine_id, TTFTModel(self.window))
        waiting = self.suspects.setdefault(engine_id, [])
        found = []
        for s in waiting:  # this request ran after every waiting suspect: it shows the engine's speed now
            s.later.append((uncached, info.ttft_ns))
        if len(model.samples) >= self.warmup:
            floor = model.floor_ns(uncached)
            if floor is not None and self._too_fast(info.ttft_ns, uncached, floor, model.floor_ns_per_token()):
                written = ended.prompt_pages  # None: the records cannot tell, timing alone
                if written is not None and written[0] + 1 >= written[1]:  # it was prefilled, just fast
                    self.suspects_explained += 1
                    model.samples.append((uncached, info.ttft_ns))
                    return self._settle(engine_id, ts_ns)
                suspect = Suspect(
                    engine, reader_party(info), info, uncached, floor, len(model.samples), ts_ns, written=written
                )
                if info.ttft_ns * self.certain_factor < floor:
                    found.append(self._finding(suspect, floor, "past", ts_ns))
                else:
                    waiting.append(suspect)
                    if len(waiting) > self.max_suspects:  # bounded: the oldest is judged now
                        found += self._decide(engine_id, waiting.pop(0), ts_ns, final=True)
                found += self._settle(engine_id, ts_ns)
                return found
        model.samples.append((uncached, info.ttft_ns))
        return found + self._settle(engine_id, ts_ns)

    def tick(self, now_ns: int) -> list[Finding]:
        """Judge suspects that waited ``max_wait_ns`` for comparable later requests."""
        found = []
        for engine_id, waiting in self.suspects.items():
            while waiting and now_ns - waiting[0].seen_ns >= self.max_wait_ns:
                found += self._decide(engine_id, waiting.pop(0), now_ns, final=True)
        return found

    def on_engine_gone(self, engine_id: int, ts_ns: int) -> list[Finding]:
        """No later requests will come: judge what is waiting, then forget the engine."""
        found = self.judge_waiting(engine_id, ts_ns)
        self.suspects.pop(engine_id, None)
        self.models.pop(engine_id, None)
        return found

    def judge_waiting(self, engine_id: int, ts_ns: int) -> list[Finding]:
        """Judge this engine's waiting suspects now, with what is known (shutdown, a soak's end)."""
        waiting = self.suspects.get(engine_id, [])
        found = [f for s in waiting for f in self._decide(engine_id, s, ts_ns, final=True)]
        waiting.clear()
        return found

    # ------------------------------------------------------------------ verdicts
    def _too_fast(self, ttft_ns: int, uncached: int, floor_ns: float, floor_ns_per_token: float) -> bool:
        return ttft_ns * self.factor < floor_ns and ttft_ns / uncached * self.factor < floor_ns_per_token

    def _settle(self, engine_id: int, ts_ns: int) -> list[Finding]:
        waiting = self.suspects.get(engine_id, [])
        ready = [s for s in waiting if s.comparable() >= self.confirm]
        if not ready:
            return []
        waiting[:] = [s for s in waiting if s.comparable() < self.confirm]
        return [f for s in ready for f in self._decide(engine_id, s, ts_ns, final=False)]

    def _decide(self, engine_id: int, s: Suspect, ts_ns: int, final: bool) -> list[Finding]:
        model = self.models.get(engine_id)
        if final:  # too few comparable later requests: the window, which holds the later normal ones too
            pool, basis = (list(model.samples) if model is not None else []), "past and later"
        else:
            pool, basis = list(s.later), "later"
        floor = _floor_ns(pool, s.uncached, 10.0, 5 if final else self.confirm)
        if floor is None and final:
            floor = s.past_floor_ns
        if (
            floor is not None
            and pool
            and self._too_fast(s.info.ttft_ns, s.uncached, floor, _floor_ns_per_token(pool, 10.0))
        ):
            return [self._finding(s, floor, basis, ts_ns)]
        self.suspects_cleared += 1
        if model is not None:
            model.samples.append((s.uncached, s.info.ttft_ns))  # the engine got faster: learn its new speed
        return []

    def _finding(self, s: Suspect, floor: float, basis: str, ts_ns: int) -> Finding:
        info, uncached, engine = s.info, s.uncached, s.engine
        summary = (
            f"{engine.role} rank {engine.rank}: request {info.rid} (tenant {info.tenant or '?'}) got its first "
            f"token after {info.ttft_ns / 1e6:.1f} ms for {uncached} uncached prompt tokens; requests with "
            f"{uncached // 8}-{uncached} uncached tokens took at least {floor / 1e6:.1f} ms here (10th "
            f"percentile): was the prompt really prefilled?"
        )
        evidence = {
            "ttft_ns": info.ttft_ns,
            "uncached_tokens": uncached,
            "prompt_tokens": info.prompt_tokens,
            "ns_per_token": round(info.ttft_ns / uncached, 1),
            "floor_ttft_ns": round(floor, 1),
            "past_floor_ttft_ns": round(s.past_floor_ns, 1),
            "floor_basis": basis,
            "later_requests": len(s.later),
            "factor": self.factor,
            "samples": s.samples,
            "prompt_pages_written": None if s.written is None else s.written[0],
            "uncached_prompt_pages": None if s.written is None else s.written[1],
            "reader_rejected": info.rejected,
        }
        return Finding(KIND.ttft_anomaly, WARNING, engine, s.reader, [], [], ts_ns, summary, evidence)

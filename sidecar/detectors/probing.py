"""``prefix_probing``: one tenant walking another tenant's cached prefix, and the isolation report.

Prompt-recovery attacks through the prefix cache (PromptPeek, InputSnatch, "Early Bird")
send prompts that are a guess of another tenant's prompt: the part recovered so far plus a
candidate token or a few, and read from the time to first token whether the cache held it.
What kvguard sees of each probe is a prefix-cache hit (``PrefixHit``: the pages a request's
row starts with, and who wrote them) whose reader's prompt ends just past the hit, on pages
another tenant wrote; and, as the guesses succeed, hits of growing length.

The finding (a warning, with ``--detect-prefix-probing``, which ``--isolate-tenants``
implies): within ``window_ns``, at least
``min_probes`` such hits by one tenant on another tenant's pages, each prompt at most a
page plus ``slack_tokens`` past its hit, at ``min_lengths`` or more distinct hit lengths.
An ordinary shared system prompt gives hits of one length, with the user's message after
it; a tenant's own conversation hits its own pages: neither raises it.

Always kept, whatever the switch (a few counters per tenant pair): the isolation report
(``report``): per (reader tenant, writer tenant), the prefix hits that crossed tenants in a
recent window, the evidence an auditor asks for under OWASP AISVS 5.5.5. Tenant names are
served by ``/v1`` only (never as /metrics labels). Requests without a tenant label, and
pages whose writer is not known any more, are left out of both.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..catalogue import KIND, PROBING
from ..events import PrefixHit
from ..findings import WARNING, Finding, Party
from .base import At
from .reads import reader_party

WINDOW_NS = 60 * 10**9  # probes counted over the last minute
MIN_PROBES = 8
MIN_LENGTHS = 3
SLACK_TOKENS = 4  # a probe's prompt ends at most a page plus this many tokens past its hit
BUCKET_NS = 60 * 10**9  # the report keeps per-minute counts ...
REPORT_BUCKETS = 60  # ... for an hour
MAX_PAIRS = 4096  # tenant pairs kept (the least recently hit dropped first, counted)
MAX_VICTIM_PARTIES = 8  # writer requests named in one finding
MAX_READERS = 1024  # distinct reader requests counted per pair (the report says "at least" past it)


@dataclass
class _Pair:
    """What crossed from one writer tenant to one reader tenant: per-minute counts, and the
    recent short-extension hits (the probing window)."""

    buckets: dict[int, list[int]] = field(default_factory=dict)  # minute -> [hits, pages]
    readers: set[int] = field(default_factory=set)  # reader request keys (bounded with the buckets)
    first_ns: int = 0
    last_ns: int = 0
    probes: deque = field(default_factory=lambda: deque(maxlen=4 * MIN_PROBES))


class PrefixProbingDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.prefix_probing,)
    events: ClassVar[tuple[type, ...]] = (PrefixHit,)
    switch: ClassVar[str] = PROBING  # (on with --detect-prefix-probing or --isolate-tenants)

    def __init__(
        self,
        enabled: bool = False,
        window_ns: int = WINDOW_NS,
        min_probes: int = MIN_PROBES,
        min_lengths: int = MIN_LENGTHS,
        slack_tokens: int = SLACK_TOKENS,
    ):
        self.enabled = enabled
        self.window_ns, self.min_probes, self.min_lengths = window_ns, min_probes, min_lengths
        self.slack_tokens = slack_tokens
        self.pairs: OrderedDict[tuple[str, str], _Pair] = OrderedDict()
        self.pairs_dropped = 0
        self.cross_tenant_hits = 0  # prefix hits on another tenant's pages, ever

    def observe(self, hit: PrefixHit, at: At) -> list[Finding]:
        reader = hit.reader
        tracker = at.tracker
        if not reader.tenant or tracker is None:
            return []
        found: list[Finding] = []
        for writer_key in np.unique(hit.writers).tolist():
            if not writer_key:
                continue
            writer = tracker.requests.get(int(writer_key))
            if writer is None or not writer.tenant or writer.tenant == reader.tenant:
                continue
            pages = hit.pages[hit.writers == writer_key]
            pair = self._pair(reader.tenant, writer.tenant)
            self._count(pair, reader.key, len(pages), at.ts_ns)
            self.cross_tenant_hits += 1
            # a probe: the reader's prompt ends a page (and a few tokens) past the hit at most
            extension = reader.prompt_tokens - hit.hit_tokens
            if reader.prompt_tokens and 0 <= extension <= tracker.page_size + self.slack_tokens:
                pair.probes.append((at.ts_ns, hit.hit_tokens, writer, pages[:8].tolist(), reader.rid))
                if self.enabled:
                    found += self._judge(pair, reader, writer.tenant, at)
        return found

    def _pair(self, reader_tenant: str, writer_tenant: str) -> _Pair:
        key = (reader_tenant, writer_tenant)
        pair = self.pairs.get(key)
        if pair is None:
            if len(self.pairs) >= MAX_PAIRS:
                self.pairs.popitem(last=False)
                self.pairs_dropped += 1
            pair = self.pairs[key] = _Pair()
        else:
            self.pairs.move_to_end(key)
        return pair

    @staticmethod
    def _count(pair: _Pair, reader_key: int, pages: int, ts_ns: int) -> None:
        minute = ts_ns // BUCKET_NS
        counts = pair.buckets.setdefault(minute, [0, 0])
        counts[0] += 1
        counts[1] += pages
        for old in [m for m in pair.buckets if m <= minute - REPORT_BUCKETS]:
            del pair.buckets[old]
        if len(pair.readers) < MAX_READERS:
            pair.readers.add(reader_key)
        pair.first_ns = pair.first_ns or ts_ns
        pair.last_ns = ts_ns

    def _judge(self, pair: _Pair, reader, victim_tenant: str, at: At) -> list[Finding]:
        recent = [p for p in pair.probes if at.ts_ns - p[0] <= self.window_ns]
        lengths = sorted({p[1] for p in recent})
        if len(recent) < self.min_probes or len(lengths) < self.min_lengths:
            return []
        pair.probes.clear()  # the next finding needs as many probes again
        victims: dict[int, Party] = {}
        for _ts, _tokens, writer, pages, _rid in recent:
            party = victims.get(writer.key)
            if party is None and len(victims) < MAX_VICTIM_PARTIES:
                party = victims[writer.key] = Party(writer.rid, writer.tenant, writer.room, [])
            if party is not None:
                party.pages = sorted(set(party.pages) | set(pages))
        parties = list(victims.values())
        span_s = max((recent[-1][0] - recent[0][0]) / 1e9, 1e-9)
        probers = sorted({p[4] for p in recent})
        engine = at.engine
        summary = (
            f"{engine.role} rank {engine.rank}: tenant {reader.tenant} hit prefixes written by tenant "
            f"{victim_tenant} {len(recent)} times in {span_s:.0f} s, each prompt a few tokens past the hit, "
            f"at {len(lengths)} hit lengths from {lengths[0]} to {lengths[-1]} tokens: the pattern of "
            "recovering another tenant's prompt through the prefix cache"
        )
        evidence = {
            "probes": len(recent),
            "window_s": self.window_ns / 1e9,
            "probes_per_min": round(len(recent) * 60 / span_s, 1) if len(recent) > 1 else None,
            "hit_lengths_tokens": lengths[:32],
            "max_tokens_past_hit": at.tracker.page_size + self.slack_tokens if at.tracker is not None else None,
            "victim_tenants": [victim_tenant],
            "probing_requests": probers[:16],
            "isolation": "declared",
        }
        pages = sorted({p for party in parties for p in party.pages})
        return [
            Finding(
                KIND.prefix_probing, WARNING, engine, reader_party(reader), pages, parties, at.ts_ns, summary, evidence
            )
        ]

    def report(self, now_ns: int, window_ns: int = REPORT_BUCKETS * BUCKET_NS) -> list[dict]:
        """Per tenant pair, the prefix hits that crossed from the writer tenant to the reader
        tenant in the last ``window_ns`` (whole minutes, at most an hour), most hits first."""
        since = (now_ns - min(window_ns, REPORT_BUCKETS * BUCKET_NS)) // BUCKET_NS
        out: list[dict] = []
        for (reader_tenant, writer_tenant), pair in self.pairs.items():
            hits = sum(c[0] for m, c in pair.buckets.items() if m > since)
            if not hits:
                continue
            out.append(
                {
                    "reader_tenant": reader_tenant,
                    "writer_tenant": writer_tenant,
                    "prefix_hits": hits,
                    "pages": sum(c[1] for m, c in pair.buckets.items() if m > since),
                    "reader_requests": len(pair.readers),
                    "probes_pending": len(pair.probes),
                    "first_ns": pair.first_ns,
                    "last_ns": pair.last_ns,
                }
            )
        out.sort(key=lambda r: (-int(r["prefix_hits"]), str(r["reader_tenant"]), str(r["writer_tenant"])))
        return out

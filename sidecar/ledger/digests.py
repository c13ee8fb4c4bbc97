"""One end's transfer digest, summed from per-rank partials (docs/wire-format.md, "Transfer digests").

A rank holding kv heads ``[head_start, head_start + head_count)`` of ``total_heads``
reports a partial sum; the end's digest is the sum mod 2**64 once the ranks' head
ranges tile ``[0, total_heads)`` exactly. A partial reported twice for the same heads
(a retried transfer, a restarted rank) replaces the earlier one; overlapping or
missing head ranges leave the end incomplete, and an incomplete end is never compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class Partial:
    head_count: int
    digest: int
    token_start: int
    token_end: int
    layers: int
    total_heads: int


# partial digests (distinct head ranges) one end of a room may have per algorithm: one per TP
# rank that sends, at most one per kv head
MAX_PARTS = 1024


@dataclass(slots=True)
class DigestSum:
    by_alg: dict[int, dict[int, Partial]] = field(default_factory=dict)  # alg -> head_start -> partial

    def add(self, alg: int, head_start: int, part: Partial) -> None:
        parts = self.by_alg.setdefault(int(alg), {})
        if len(parts) >= MAX_PARTS and int(head_start) not in parts:
            return  # past any real head count (a broken or hostile writer): the sum never completes
        parts[int(head_start)] = part

    def complete(self, alg: int) -> bool:
        parts = self.by_alg.get(alg)
        if not parts:
            return False
        totals = {p.total_heads for p in parts.values()}
        if len(totals) != 1:
            return False
        covered = 0
        for start in sorted(parts):
            if start != covered:
                return False  # a gap or an overlap: wait for (or never trust) the other ranks
            covered += parts[start].head_count
        return covered == totals.pop()

    def total_heads(self, alg: int) -> int:
        """The head count the parts of a complete ``alg`` tile (for alg 4: the TP size)."""
        return next(iter(self.by_alg[alg].values())).total_heads

    def value(self, alg: int) -> int:
        return sum(p.digest for p in self.by_alg[alg].values()) & MASK64

    def token_range(self, alg: int) -> tuple[int, int]:
        parts = self.by_alg[alg].values()
        return min(p.token_start for p in parts), max(p.token_end for p in parts)

    def complete_algs(self) -> set[int]:
        return {alg for alg in self.by_alg if self.complete(alg)}

    # --------------------------------------------------------------- (de)serialising for the shared ledger
    def to_json(self) -> list:
        return [
            [alg, start, p.head_count, p.digest, p.token_start, p.token_end, p.layers, p.total_heads]
            for alg, parts in self.by_alg.items()
            for start, p in parts.items()
        ]

    @staticmethod
    def entry_ok(e) -> bool:
        return (
            isinstance(e, list)
            and len(e) == 8
            and all(type(v) is int and 0 <= v <= MASK64 for v in e)
            and e[1] + e[2] <= e[7]
            and e[4] <= e[5]
        )


@dataclass(slots=True)
class DigestVerdict:
    """Both ends complete with a common algorithm: the outcome of the one comparison."""

    alg: int
    sender: int
    receiver: int
    sender_range: tuple[int, int]
    receiver_range: tuple[int, int]

    @property
    def match(self) -> bool:
        return self.sender == self.receiver

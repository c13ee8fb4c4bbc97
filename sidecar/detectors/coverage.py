"""``coverage_gap``: an engine holds KV or state that kvguard does not watch.

An adapter works out at start-up what the engine it is loaded into holds (its pools and
their classes, KV cache groups, recurrent-state pools, draft models, KV dtype, parallel
layout) and says, item by item, what of it kvguard follows (the COVERAGE record, contract
1.5). A part it cannot follow is never guessed at: its records are not sent (no false
finding can come from them), and this warning says once, per engine, what is not watched
and why, so that an SRE never takes a quiet sidecar for a protected engine. The same items
are in ``/metrics`` (``kvguard_engine_coverage_gaps``, ``kvguard_engine_component_watched``)
and ``/v1/engines`` for as long as the engine lives.
"""

from __future__ import annotations

from typing import ClassVar

from kvguard.engine_hooks import wire

from ..catalogue import KIND
from ..findings import WARNING, Finding
from .base import At


def capability_names(bits: int) -> list[str]:
    """``wire.Capability`` bits as lower-case names, in bit order."""
    return [c.name.lower() for c in wire.Capability if bits & c and c.name]


def describe_item(item: wire.CoverageItem) -> str:
    missing = capability_names(item.missing)
    what = "not watched" if item.status == wire.CoverageStatus.UNWATCHED else "partly watched"
    if missing and item.status == wire.CoverageStatus.PARTIAL:
        what += f" (no {', '.join(missing)})"
    return f"{item.component}: {what}: {item.detail}"


class CoverageDetector:
    """Called on each COVERAGE record (after an engine's HELLO). One finding per engine: the
    incident groups by engine and lasts as long as it (a COVERAGE replayed from the ring's
    sticky copy after a sidecar restart joins it)."""

    kinds: ClassVar[tuple[str, ...]] = (KIND.coverage_gap,)
    events: ClassVar[tuple[type, ...]] = (wire.Coverage,)

    def observe(self, coverage: wire.Coverage, at: At) -> list[Finding]:
        gaps = coverage.gaps
        if not gaps:
            return []
        engine = at.engine
        hello = at.tracker.hello if at.tracker is not None else None
        summary = (
            f"{engine.role} rank {engine.rank}: kvguard does not watch all of this engine: "
            + "; ".join(describe_item(item) for item in gaps)
            + ". Reads, writes and transfers there are not checked; the rest of the engine is"
        )
        evidence = {
            "unwatched": [
                {
                    "component": item.component,
                    "status": item.status.name.lower(),
                    "missing": capability_names(item.missing),
                    "detail": item.detail,
                }
                for item in gaps
            ],
            "watched": [item.component for item in coverage.items if item.status == wire.CoverageStatus.WATCHED],
        }
        if hello is not None:
            evidence["engine_version"] = f"{hello.engine_name} {hello.engine_version}"
            evidence["model"] = hello.model
        return [Finding(KIND.coverage_gap, WARNING, engine, None, [], [], at.ts_ns, summary, evidence)]

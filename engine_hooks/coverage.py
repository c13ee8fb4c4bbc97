"""What an adapter found in its engine and what of it kvguard watches: COVERAGE items.

Each adapter (engine_hooks/sglang/coverage.py, engine_hooks/vllm/coverage.py) inspects the
engine it is loaded into at start-up (pool and allocator classes, KV cache groups, state
pools, draft models, KV dtype, parallel layout, transfer path) and turns what it finds into
``wire.CoverageItem``s with :func:`item`. The rule they share: a component whose pages or
state kvguard cannot follow is said (``UNWATCHED``), and if that makes the engine's page
ownership unfollowable the adapter sends no page records at all rather than half of them
(a half-seen pool is where false alarms come from); a component that is followed but
lacks a capability (a digest over a layout not defined yet) is ``PARTIAL``, naming what
is missing. Nothing here imports an engine.
"""

from __future__ import annotations

import os

from . import wire

OWNERSHIP = wire.Capability.OWNERSHIP
DIGESTS = wire.Capability.DIGESTS
GUARD = wire.Capability.GUARD
CONTENT = wire.Capability.CONTENT


def item(component: str, watched: int, missing: int = 0, detail: str = "") -> wire.CoverageItem:
    """One component: what kvguard provides for it (``watched``) and what applies to it but
    is not provided (``missing``); the status follows (nothing missing: watched; ownership
    missing: unwatched; else partial)."""
    watched, missing = int(watched), int(missing) & ~int(watched)
    if not missing:
        status = wire.CoverageStatus.WATCHED
    elif not watched & OWNERSHIP:
        status = wire.CoverageStatus.UNWATCHED
    else:
        status = wire.CoverageStatus.PARTIAL
    return wire.CoverageItem(component, status, watched, missing, detail)


def unwatched(component: str, detail: str) -> wire.CoverageItem:
    return item(component, 0, OWNERSHIP, detail)


def parallel(layout: str, pipeline_stages: int, how: str, stages_why_not: str | None = None) -> wire.CoverageItem:
    """The parallel layout: ``how`` the ranks are watched. Pipeline parallelism (more than one
    stage: each holds its own layers' pool) is watched only where the adapter verified it
    (``stages_why_not`` None; ``how`` then says how the stages are watched), else declared
    unwatched with that reason."""
    if pipeline_stages > 1 and stages_why_not is not None:
        return unwatched("parallel", f"{layout}: {stages_why_not}")
    return item("parallel", OWNERSHIP, 0, f"{layout}: {how}")


def ownership_followed(items: list[wire.CoverageItem]) -> bool:
    """Whether every component's pages or state are followed: if not, the adapter sends
    HELLO and COVERAGE only (no page records that would describe half an engine)."""
    return all(i.watched & OWNERSHIP for i in items)


def optional_capabilities() -> int:
    """The opt-in in-engine capabilities switched on for this process (they apply only then):
    the guard (``KVGUARD_GUARD``) and the content check (``KVGUARD_CONTENT_CHECK``)."""
    caps = 0
    if os.environ.get("KVGUARD_GUARD", "").strip().lower() not in ("", "0", "off", "false", "no"):
        caps |= GUARD
    if os.environ.get("KVGUARD_CONTENT_CHECK", "").strip().lower() not in ("", "0", "off", "false", "no"):
        caps |= CONTENT
    return caps


def log_lines(items: list[wire.CoverageItem]) -> list[str]:
    """The engine log's account of the same items (one line each), so that an engine log
    alone says what kvguard watches."""
    out = []
    for i in items:
        missing = [c.name.lower() for c in wire.Capability if i.missing & c and c.name]
        status = i.status.name.lower() + (
            f" (no {', '.join(missing)})" if i.status == wire.CoverageStatus.PARTIAL else ""
        )
        out.append(f"kvguard coverage: {i.component}: {status}: {i.detail}")
    return out

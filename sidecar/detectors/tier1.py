"""Findings from the engine's own read check (Tier 1, engine_hooks/tier1.py).

The engine sends a TIER1_VIOLATION record the first time a reader's row names a
page that is neither its own nor shared through the prefix cache. The engine has
already logged and counted it; here it becomes the finding a sidecar raises:

- a page of another live request, or one handed out but in no row -> ``foreign_read``
  (exposed: the page's owner, from the record; else whoever the sidecar knows wrote it)
- a page free in the allocator -> ``use_after_free``

With ``KVGUARD_GUARD=full`` the engine's guard acts on the same reader first (a GUARD record
of rule ``read_foreign`` / ``read_freed`` arrives before this one): the finding's evidence
then carries ``action`` (``aborted`` / ``observed``), as the Tier 2 read findings do.

``evidence.source`` is ``"engine_tier1"``, so a read the sidecar also judged from the
FORWARD record (Tier 2) can be told apart. Warmup and health-check readers are never
alarmed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from kvguard.engine_hooks import wire

from ..catalogue import KIND
from ..findings import CRITICAL, EngineRef, Finding, Party
from ..tracker import EngineTracker
from .base import At
from .reads import GUARD_OUTCOME, exposed_parties, guard_evidence, reader_party


class Tier1Detector:
    """A TIER1_VIOLATION record: the engine's own read check caught a read."""

    kinds: ClassVar[tuple[str, ...]] = (KIND.foreign_read, KIND.use_after_free)
    events: ClassVar[tuple[type, ...]] = (wire.Tier1Violation,)

    def observe(self, violation: wire.Tier1Violation, at: At) -> list[Finding]:
        assert at.tracker is not None
        return tier1_findings(at.tracker, at.engine, violation, at.ts_ns)


def tier1_findings(tracker: EngineTracker, engine: EngineRef, v: wire.Tier1Violation, ts_ns: int) -> list[Finding]:
    info = tracker.requests.get(v.reader_key)
    if info is not None and info.warmup:
        return []
    reader = reader_party(info) if info is not None else Party(f"key:{v.reader_key:016x}", "", None)
    pages = v.pages.astype(np.int64)
    out = []
    for kind, mask in (
        (KIND.foreign_read, v.tags != wire.Tier1Tag.FREE),
        (KIND.use_after_free, v.tags == wire.Tier1Tag.FREE),
    ):
        if not mask.any():
            continue
        exposed = []
        for key in np.unique(v.owner_keys[mask]).tolist():
            if key == 0:
                continue
            owner = tracker.requests.get(int(key))
            owned = sorted(int(p) for p in pages[mask & (v.owner_keys == key)])
            exposed.append(
                Party(
                    owner.rid if owner else f"key:{int(key):016x}",
                    owner.tenant if owner else "",
                    owner.room if owner else None,
                    owned,
                )
            )
        if not exposed and tracker.hello is not None:  # no live owner: whoever's data the page holds
            exposed = exposed_parties(tracker, tracker.pool.ensure(pages[mask]), v.reader_key)
        what = "pages of other requests" if kind == KIND.foreign_read else "pages that are free in the allocator"
        summary = (
            f"{engine.role} rank {engine.rank}: the engine's own read check (Tier 1) saw request "
            f"{reader.rid} (tenant {reader.tenant or '?'}) read {int(mask.sum())} {what}"
        ) + GUARD_OUTCOME.get(info.guard_action if info is not None else "", "")
        out.append(
            Finding(
                kind,
                CRITICAL,
                engine,
                reader,
                sorted(int(p) for p in pages[mask]),
                exposed,
                ts_ns,
                summary,
                {
                    "source": "engine_tier1",
                    "row_page_indices": v.row_indices[mask].tolist(),
                    "engine_violations_total": int(v.violations_total),
                    **guard_evidence(info),
                },
            )
        )
    return out

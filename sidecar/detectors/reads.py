"""Read detectors: ``unwritten_read``, ``foreign_read`` and reads of freed pages.

Definitions (docs/detectors.md has the long form):
- unwritten_read: a request reads a page reserved for it that nothing wrote for it
  (neither its own forward nor, on decode, the KV transfer that filled it). The data
  there is whatever the page's previous owner left: the exposed parties are the
  page's last writers.
- foreign_read: a request reads a page that is not its own at this generation: the
  row names a page assigned to another request, or a page that was freed and
  reallocated since it was assigned. Exposed: the page's current owner / last writer.
- use_after_free: a request reads a page that is free in the allocator.
Warmup and health-check requests are tracked but never alarmed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import ReadVerdict
from ..findings import CRITICAL, WARNING, EngineRef, Finding, Party
from ..request_directory import RequestInfo
from ..tracker import EngineTracker
from .base import At


def reader_party(info: RequestInfo) -> Party:
    return Party(info.rid, info.tenant, info.room)


GUARD_OUTCOME = {
    "aborted": "; the engine's guard failed the request before that forward's token was returned",
    "observed": "; the engine's guard saw it and let it run (observed only)",
}


def guard_evidence(info: RequestInfo | None) -> dict:
    """What the engine's guard did about this reader's reads (KVGUARD_GUARD=full), for a read
    finding's evidence; empty when it did nothing (off, or no GUARD record for the reader)."""
    return {"action": info.guard_action} if info is not None and info.guard_action else {}


def exposed_parties(
    tracker: EngineTracker,
    pages: np.ndarray,
    reader_key: int,
    by: str = "last_writer",
    column: np.ndarray | None = None,
) -> list[Party]:
    """Group pages by the request whose data (or ownership) they carry, other than the reader.
    ``column``: those request keys per page as they were when the read happened, when the
    pool may have moved on since (a read judged late); else the pool's ``by`` column now."""
    if column is None:
        column = getattr(tracker.pool, by)[pages]
    parties = []
    for key in np.unique(column):
        key = int(key)
        if key in (0, reader_key):
            continue
        info = tracker.requests.get(key)
        name = info.rid if info else f"key:{key:016x}"
        tenant = info.tenant if info else ""
        parties.append(Party(name, tenant, info.room if info else None, sorted(int(p) for p in pages[column == key])))
    return parties


class ReadDetector:
    """One verdict in, zero to three findings out."""

    kinds: ClassVar[tuple[str, ...]] = (KIND.unwritten_read, KIND.foreign_read, KIND.use_after_free)
    events: ClassVar[tuple[type, ...]] = (ReadVerdict,)

    def observe(self, verdict: ReadVerdict, at: At) -> list[Finding]:
        tracker, engine, ts_ns = at.tracker, at.engine, at.ts_ns
        assert tracker is not None  # a read verdict comes from an engine's model
        if verdict.reader.warmup:
            return []
        out = []
        for kind, pages, by in (
            (KIND.unwritten_read, verdict.unwritten, "last_writer"),
            (KIND.foreign_read, verdict.foreign, "owner"),
            (KIND.use_after_free, verdict.freed, "last_writer"),
        ):
            if len(pages):
                column = verdict.unwritten_writers if kind == KIND.unwritten_read else None
                out.append(self._finding(tracker, engine, verdict.reader, kind, pages, by, ts_ns, column))
        return out

    def _finding(
        self,
        tracker: EngineTracker,
        engine: EngineRef,
        reader: RequestInfo,
        kind: str,
        pages: np.ndarray,
        by: str,
        ts_ns: int,
        column: np.ndarray | None = None,
    ) -> Finding:
        pages, first = np.unique(pages, return_index=True)
        column = None if column is None else np.asarray(column)[first]
        exposed = exposed_parties(tracker, pages, reader.key, by, column)
        if by == "owner":  # also name whoever's data sits there, if not the owner
            named = {p.rid for p in exposed}
            exposed += [p for p in exposed_parties(tracker, pages, reader.key) if p.rid not in named]
        tenants = sorted({p.tenant or "?" for p in exposed})
        what = {
            KIND.unwritten_read: "pages reserved for it that nothing wrote for it",
            KIND.foreign_read: "pages that belong to other requests",
            KIND.use_after_free: "pages that are free in the allocator",
        }[kind]
        summary = (
            f"{engine.role} rank {engine.rank}: request {reader.rid} (tenant {reader.tenant or '?'}) read "
            f"{len(pages)} {what}"
        )
        if exposed:
            summary += f"; they hold data of {len(exposed)} other request(s) of tenant(s) {', '.join(tenants)}"
        severity = CRITICAL if exposed or kind != KIND.unwritten_read else WARNING
        summary += GUARD_OUTCOME.get(reader.guard_action, "")
        return Finding(
            kind,
            severity,
            engine,
            reader_party(reader),
            [int(p) for p in pages],
            exposed,
            ts_ns,
            summary,
            {
                "reader_prompt_tokens": reader.prompt_tokens,
                "reader_rejected": reader.rejected,
                **guard_evidence(reader),
            },
        )

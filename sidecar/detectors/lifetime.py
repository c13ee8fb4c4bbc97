"""Lifetime detectors: ``double_free``, ``use_after_free`` (writes), ``late_write``.

- double_free: a page freed while it is already free. The allocator's free list
  then holds it twice, and two requests can be handed the same page.
- use_after_free (write): a forward writes KV into a page that is free in the
  allocator: whoever is handed the page next starts from this request's data.
- late_write: a forward writes KV into a page that now belongs to another live
  request (e.g. a write that outlived its request's abort, after the page was
  reassigned): the owner's KV is overwritten with another request's data.
Reads of free pages are judged by the read detector (same kind, ``use_after_free``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import PagesFreedTwice, WriteVerdict
from ..findings import CRITICAL, Finding
from .base import At
from .reads import exposed_parties, reader_party


class WriteDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.use_after_free, KIND.late_write)
    events: ClassVar[tuple[type, ...]] = (WriteVerdict,)

    def observe(self, verdict: WriteVerdict, at: At) -> list[Finding]:
        tracker, engine, ts_ns = at.tracker, at.engine, at.ts_ns
        assert tracker is not None  # a write verdict comes from an engine's model
        if verdict.writer.warmup:
            return []
        writer = verdict.writer
        out = []
        if len(verdict.freed):
            pages = np.unique(verdict.freed)
            out.append(
                Finding(
                    KIND.use_after_free,
                    CRITICAL,
                    engine,
                    reader_party(writer),
                    [int(p) for p in pages],
                    # nobody else's KV is exposed by the write itself: the writer's own KV now sits
                    # in free pages (the reader field names it), and a later read of them names it
                    [],
                    ts_ns,
                    f"{engine.role} rank {engine.rank}: request {writer.rid} (tenant {writer.tenant or '?'}) wrote KV "
                    f"into {len(pages)} page(s) that are free in the allocator",
                    {"access": "write"},
                )
            )
        if len(verdict.foreign):
            pages = np.unique(verdict.foreign)
            owners = exposed_parties(tracker, pages, writer.key, by="owner")
            out.append(
                Finding(
                    KIND.late_write,
                    CRITICAL,
                    engine,
                    reader_party(writer),
                    [int(p) for p in pages],
                    owners,
                    ts_ns,
                    f"{engine.role} rank {engine.rank}: request {writer.rid} (tenant {writer.tenant or '?'}) wrote KV "
                    f"into {len(pages)} page(s) that now belong to {len(owners)} other request(s)",
                    {"access": "write"},
                )
            )
        return out


class DoubleFreeDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.double_free,)
    events: ClassVar[tuple[type, ...]] = (PagesFreedTwice,)

    def observe(self, event: PagesFreedTwice, at: At) -> list[Finding]:
        tracker, engine, ts_ns, pages, free_kind = at.tracker, at.engine, at.ts_ns, event.pages, event.free_kind
        assert tracker is not None
        if len(pages) == 0:
            return []
        pages = np.unique(pages)
        last = exposed_parties(tracker, pages, 0)
        return [
            Finding(
                KIND.double_free,
                CRITICAL,
                engine,
                None,
                [int(p) for p in pages],
                last,
                ts_ns,
                f"{engine.role} rank {engine.rank}: {len(pages)} page(s) freed while already free ({free_kind} path): "
                f"the allocator may hand each to two requests",
                {"free_kind": free_kind},
            )
        ]

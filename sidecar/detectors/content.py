"""``checksum_mismatch`` with ``evidence.via = "content"``: KV bytes at rest changed with no
hooked write (the engine's content check, ``KVGUARD_CONTENT_CHECK``, engine_hooks/content.py).

The engine fingerprints each slot when a hooked path writes it (a forward, a transfer
completion) and re-checks slots before a forward reads them; a CONTENT_CHANGED record
names the pages of slots whose bytes changed in between. Nothing the sidecar saw wrote
them: a late RDMA write landing after its request was aborted and the page reassigned,
a direct pool write from a buggy path. Who wrote them is unknown (no record names the
writer); the request that owns the page now is the one whose KV is no longer what it
computed, and its next tokens are generated over it: it is the finding's reader, one
finding per owner. Pages without a live owner (free, or kept by the prefix cache) go
into one finding without a reader.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import ContentChangedAt
from ..findings import CRITICAL, Finding
from ..page_pool import OWNED
from .base import At
from .reads import reader_party


class ContentDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.checksum_mismatch,)
    events: ClassVar[tuple[type, ...]] = (ContentChangedAt,)

    def observe(self, changed: ContentChangedAt, at: At) -> list[Finding]:
        tracker, engine = at.tracker, at.engine
        assert tracker is not None
        pool = tracker.pool
        pages = np.unique(changed.pages.astype(np.int64))
        pages = pages[(pages > 0) & (pages < pool.num_pages)]
        if len(pages) == 0:
            return []
        owners = np.where(pool.state[pages] == OWNED, pool.owner_keys(pages), np.uint64(0))
        out = []
        for key in np.unique(owners).tolist():
            mine = pages[owners == key]
            info = tracker.requests.get(int(key)) if key else None
            if info is not None and info.warmup:
                continue
            whose = (
                f"request {info.rid} (tenant {info.tenant or '?'}) owns them: its next tokens are computed over KV it did not write"
                if info is not None
                else "no live request owns them (free, or kept by the prefix cache): whoever reads them next gets that KV"
            )
            summary = (
                f"{engine.role} rank {engine.rank}: the KV bytes of {len(mine)} page(s) changed with no write kvguard "
                f"saw (a late RDMA write or a direct pool write; the writer is unknown); {whose}"
            )
            evidence = {
                "via": "content",
                "slots_changed": int(changed.slots_changed),
                "writer": "unknown: no hooked path wrote these slots",
            }
            out.append(
                Finding(
                    KIND.checksum_mismatch,
                    CRITICAL,
                    engine,
                    reader_party(info) if info is not None else None,
                    [int(p) for p in mine],
                    [],
                    at.ts_ns,
                    summary,
                    evidence,
                )
            )
        return out

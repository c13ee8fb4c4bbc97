"""``cross_tenant_prefix_share``: a prefix-cache page written by one tenant, read by another.

Sharing KV through the radix/prefix cache across tenants is normal engine behaviour
and not a memory-safety bug: the reader's own prompt matched those tokens. But an
operator who promises tenants isolation (no cross-tenant cache hits: a timing side
channel, and a privacy boundary) wants to know when it happens. Off by default;
enabled with ``kvguard sidecar --isolate-tenants``.

Only pages whose last writer has a known, non-empty tenant different from the
reader's are reported; requests without a tenant label are never judged.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import ISOLATION, KIND
from ..events import ReadVerdict
from ..findings import WARNING, Finding, Party
from .base import At
from .reads import reader_party


class TenantIsolationDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.cross_tenant_prefix_share,)
    events: ClassVar[tuple[type, ...]] = (ReadVerdict,)
    switch: ClassVar[str] = ISOLATION
    wants_shared_reads: ClassVar[bool] = True

    def __init__(self, enabled: bool = False):
        self.enabled = enabled

    def observe(self, verdict: ReadVerdict, at: At) -> list[Finding]:
        tracker, engine, ts_ns = at.tracker, at.engine, at.ts_ns
        reader = verdict.reader
        if not self.enabled or verdict.shared is None or len(verdict.shared) == 0 or not reader.tenant:
            return []
        assert tracker is not None
        writers = tracker.pool.last_writer[verdict.shared]
        parties = []
        for key in np.unique(writers):
            info = tracker.requests.get(int(key))
            if info is None or not info.tenant or info.tenant == reader.tenant:
                continue
            pages = sorted(int(p) for p in verdict.shared[writers == key])
            parties.append(Party(info.rid, info.tenant, info.room, pages))
        if not parties:
            return []
        pages = sorted(p for party in parties for p in party.pages)
        tenants = ", ".join(sorted({p.tenant for p in parties}))
        summary = (
            f"{engine.role} rank {engine.rank}: request {reader.rid} (tenant {reader.tenant}) read "
            f"{len(pages)} prefix-cache page(s) written by tenant(s) {tenants}, and tenants are declared isolated"
        )
        return [
            Finding(
                KIND.cross_tenant_prefix_share,
                WARNING,
                engine,
                reader_party(reader),
                pages,
                parties,
                ts_ns,
                summary,
                {"isolation": "declared"},
            )
        ]

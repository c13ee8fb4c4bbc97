"""``cross_salt_prefix_share``: prefix-cache pages shared across two cache scopes.

An engine keys its prefix cache by the tokens and a scope: SGLang by ``extra_key`` (LoRA
adapter, caller-defined classes) and ``cache_salt``, vLLM by a salted block hash. Requests
of different scopes must never share cached KV: a salt is how an operator isolates tenants
in one engine, and an extra key separates KV that is not even the same model's (LoRA). A
page written under one scope and handed, through the cache, to a request of another is a
broken promise of the engine (a salt dropped on the way to the cache or to an external
cache tier: SGLang #37160, LMCache #4825, vLLM #44701), critical, with no flag to remember:
judged whenever the engine reports scopes (REQ_SCOPE) at all.

Judged once per handing-out (the ASSIGN that puts cached pages in the reader's row), not
per forward: the cost is zero on an engine whose requests carry no salt, and one lookup per
shared page otherwise. The default scope (no salt, no extra key) is a scope like any
other: a salted request sharing an unsalted request's page is reported too.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import PrefixSharedAcrossScopes
from ..findings import CRITICAL, Finding
from .base import At
from .reads import exposed_parties, reader_party


def _hex(scope: int) -> str:
    return f"{int(scope):016x}"


class ScopeDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.cross_salt_prefix_share,)
    events: ClassVar[tuple[type, ...]] = (PrefixSharedAcrossScopes,)

    def observe(self, shared: PrefixSharedAcrossScopes, at: At) -> list[Finding]:
        tracker, engine = at.tracker, at.engine
        assert tracker is not None  # the reader's model
        reader = shared.reader
        if reader.warmup:
            return []
        pages, first = np.unique(shared.pages, return_index=True)
        exposed = exposed_parties(tracker, pages, reader.key, "last_writer")
        writer_scopes = sorted({_hex(s) for s in shared.writer_scopes[first].tolist()})
        tenants = sorted({p.tenant or "?" for p in exposed})
        summary = (
            f"{engine.role} rank {engine.rank}: request {reader.rid} (tenant {reader.tenant or '?'}, cache scope "
            f"{_hex(reader.scope) if reader.scope else 'default'}) was handed {len(pages)} prefix-cache page(s) "
            f"written under another cache scope (salt / extra key)"
        )
        if exposed:
            summary += f": KV of {len(exposed)} request(s) of tenant(s) {', '.join(tenants)}"
        return [
            Finding(
                KIND.cross_salt_prefix_share,
                CRITICAL,
                engine,
                reader_party(reader),
                [int(p) for p in pages],
                exposed,
                at.ts_ns,
                summary,
                {"reader_scope": _hex(reader.scope), "writer_scopes": writer_scopes},
            )
        ]

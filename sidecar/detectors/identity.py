"""``prefix_content_mismatch``: a prefix-cache hit handed the reader a page that holds
another prefix, or other positions, than the reader's own.

Ownership cannot see it: the reader is the rightful holder of a shared prefix-cache page,
and the page was written. What is wrong is *what* the page holds: a stale partial-block key
after eviction and reallocation, an off-by-one write into a cached block, a radix block-
boundary error (vLLM #49125, #37076; SGLang #22819) hand a request KV computed from other
tokens, and it generates over them. With ``KVGUARD_PAGE_IDENTITY`` on, the engine reports each
full page's content identity when its request wrote it and, at a prefix hit, the identity
the reader's own tokens give the pages it was handed (sidecar/page_identity.py compares them).

Critical whenever it fires: the reader attends over KV that is not its prefix, written by the
page's last writer (``exposed``), whose prompt it may echo. Pages whose identity is unknown for
their current allocation are never judged; warmup and health-check readers are never alarmed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import PrefixContentMismatch
from ..findings import CRITICAL, Finding
from .base import At
from .reads import exposed_parties, reader_party


class PrefixIdentityDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.prefix_content_mismatch,)
    events: ClassVar[tuple[type, ...]] = (PrefixContentMismatch,)

    def observe(self, mismatch: PrefixContentMismatch, at: At) -> list[Finding]:
        tracker, engine = at.tracker, at.engine
        assert tracker is not None  # the reader's model
        reader = mismatch.reader
        if reader.warmup:
            return []
        # (a page may sit at several of the reader's row pages: named once)
        pages, first = np.unique(mismatch.pages, return_index=True)
        exposed = exposed_parties(tracker, pages, reader.key, column=mismatch.writers[first])
        rows = [int(i) for i in mismatch.row_indices]
        summary = (
            f"{engine.role} rank {engine.rank}: request {reader.rid} (tenant {reader.tenant or '?'}) was handed "
            f"{len(pages)} prefix-cache page(s) (row pages {_ranges(rows)}) whose content is not its prefix: "
            f"they hold KV computed from other tokens or positions"
        )
        if exposed:
            writers = ", ".join(f"{p.rid} (tenant {p.tenant or '?'})" for p in exposed)
            summary += f", written by {writers}"
        evidence = {"via": "prefix_hit", "row_pages": rows, "pages_judged": mismatch.judged}
        return [
            Finding(
                KIND.prefix_content_mismatch,
                CRITICAL,
                engine,
                reader_party(reader),
                [int(p) for p in pages],
                exposed,
                at.ts_ns,
                summary,
                evidence,
            )
        ]


def _ranges(values: list[int]) -> str:
    """``[1, 2, 3, 7]`` as ``1-3, 7`` (a summary stays one line for a long prefix)."""
    spans: list[list[int]] = []
    for v in values:
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

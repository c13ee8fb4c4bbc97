"""Transfers whose pages changed hands while in flight (sidecar/inflight.py).

- ``use_after_free`` with ``access: send``: a sender's source pages were allocated to another
  request between the chunk's ``XFER_SEND`` and the sender's completion. The transfer engine
  moves the bytes in that window, so what reached the receiver may be the new owner's KV: the
  receiver generates over another request's prompt. Exposed: the pages' owners and last
  writers since (other than the sender).
- ``late_write`` with ``via: transfer``, ``access: completion``: the receiver's reserved pages
  were allocated to another request before the sender's completion, and the receiver had not
  reported success (it gave up, timed out or released them early). The completion then
  lands in the new owner's pages and overwrites its KV. Exposed: the pages' owners now.

Both are critical: an engine that keeps a transfer's pages until it completes never shows
either. Warmup requests are never alarmed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import PagesChangedInFlight
from ..findings import CRITICAL, Finding
from .base import At
from .reads import exposed_parties, reader_party


class InFlightTransferDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.use_after_free, KIND.late_write)
    events: ClassVar[tuple[type, ...]] = (PagesChangedInFlight,)

    def observe(self, event: PagesChangedInFlight, at: At) -> list[Finding]:
        tracker, engine = at.tracker, at.engine
        assert tracker is not None  # the model of the engine whose pages changed
        request = event.request
        if request.warmup:
            return []
        pages = np.unique(event.pages)
        evidence: dict = {
            "via": "transfer",
            "bootstrap_room": event.room,
            "token_start": event.token_start,
            "token_end": event.token_end,
            "in_flight_since_ns": event.sent_ns,
        }
        who = f"request {request.rid} (tenant {request.tenant or '?'})"
        if event.side == "source":
            exposed = exposed_parties(tracker, pages, request.key, "owner")
            named = {p.rid for p in exposed}
            exposed += [p for p in exposed_parties(tracker, pages, request.key, "last_writer") if p.rid not in named]
            evidence["access"] = "send"
            if event.counterpart is not None:
                evidence["receiver"] = {"rid": event.counterpart.rid, "tenant": event.counterpart.tenant}
            to = f" to {event.counterpart.rid} (tenant {event.counterpart.tenant or '?'})" if event.counterpart else ""
            summary = (
                f"{engine.role} rank {engine.rank}: {who} sent room {event.room}{to} from {len(pages)} page(s) "
                f"that were handed to {len(exposed)} other request(s) before the transfer completed"
            )
            return [Finding(KIND.use_after_free, CRITICAL, engine, reader_party(request), [int(p) for p in pages],
                            exposed, at.ts_ns, summary, evidence)]  # fmt: skip
        owners = exposed_parties(tracker, pages, request.key, "owner")
        evidence["access"] = "completion"
        if event.counterpart is not None:
            evidence["sender_rid"], evidence["sender_tenant"] = event.counterpart.rid, event.counterpart.tenant
        summary = (
            f"{engine.role} rank {engine.rank}: the transfer for {who}, room {event.room}, completed after "
            f"{len(pages)} of its reserved page(s) were handed to {len(owners)} other request(s): their KV was overwritten"
        )
        return [Finding(KIND.late_write, CRITICAL, engine, reader_party(request), [int(p) for p in pages], owners,
                        at.ts_ns, summary, evidence)]  # fmt: skip

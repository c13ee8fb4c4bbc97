"""``unwritten_send``: a sender shipped source pages that its request never wrote.

A prefill engine sends, per chunk, the KV of the pages of its request's row over the
tokens it has computed. Each page it ships must be the request's own (or a prefix-cache
page handed to it) and written at its current allocation. A page its request never wrote
holds whatever the page's previous user left: the transfer carries that KV to decode,
which takes it as the prompt's (its pages are written by the transfer, so decode's reads
look clean and no read detector sees it). The bug family: a transfer that reads pages
before the forward that fills them (chunk boundaries, SGLang #33970), blocks evicted or
reused before a background sender shipped them (TensorRT-LLM #12542 / #12540).

Severity: critical when anyone else's KV went out (an exposed party: the last writer of an
unwritten page, the owner or last writer of a foreign one) or a page was free; a warning
when the unwritten pages never held anyone's KV (fresh pool pages). Warmup requests are
never alarmed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from ..catalogue import KIND
from ..events import SourcePagesSent
from ..findings import CRITICAL, WARNING, Finding
from .base import At
from .reads import exposed_parties, reader_party


class UnwrittenSendDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.unwritten_send,)
    events: ClassVar[tuple[type, ...]] = (SourcePagesSent,)

    def observe(self, sent: SourcePagesSent, at: At) -> list[Finding]:
        tracker, engine = at.tracker, at.engine
        assert tracker is not None  # the sender's model
        verdict = sent.verdict
        sender = verdict.reader
        if sender.warmup:
            return []
        unwritten, foreign, freed = (np.unique(p) for p in (verdict.unwritten, verdict.foreign, verdict.freed))
        pages = np.unique(np.concatenate((unwritten, foreign, freed)))
        # whose KV went out: an unwritten or freed page holds its last writer's, a foreign page
        # its owner's (and its last writer's, if someone else wrote it)
        exposed = exposed_parties(tracker, np.concatenate((unwritten, freed)), sender.key, "last_writer")
        named = {p.rid for p in exposed}
        for by in ("owner", "last_writer"):
            for party in exposed_parties(tracker, foreign, sender.key, by):
                if party.rid not in named:
                    exposed.append(party)
                    named.add(party.rid)
        receiver = sent.receiver
        offload = sent.via == "offload"
        if offload:  # a store to a host / storage object (sidecar/offload.py): whoever hits it reads this
            whose = f"request {sender.rid} (tenant {sender.tenant or '?'})" if sender.key else "the prefix cache"
            summary = (
                f"{engine.role} rank {engine.rank}: {whose} stored {len(pages)} page(s) holding no KV written at "
                f"their current allocation to host / storage object {sent.object_key:016x}"
            )
            taker = "a later hit on that object serves as its prompt's KV"
        else:
            to = f"decode request {receiver.rid} (tenant {receiver.tenant or '?'})" if receiver else "decode"
            summary = (
                f"{engine.role} rank {engine.rank}: request {sender.rid} (tenant {sender.tenant or '?'}) sent "
                f"{len(pages)} page(s) it never wrote (room {sent.room}, tokens {sent.token_start}-{sent.token_end}) "
                f"to {to}"
            )
            taker = "decode now takes as this prompt's KV"
        if exposed:
            tenants = sorted({p.tenant or "?" for p in exposed})
            summary += (
                f"; they hold data of {len(exposed)} other request(s) of tenant(s) {', '.join(tenants)}, which {taker}"
            )
        severity = CRITICAL if exposed or len(foreign) or len(freed) else WARNING
        evidence: dict = {
            "via": sent.via,
            "unwritten_pages": [int(p) for p in unwritten],
            "foreign_pages": [int(p) for p in foreign],
            "freed_pages": [int(p) for p in freed],
        }
        if offload:
            evidence["object_key"] = f"{sent.object_key:016x}"
        else:
            evidence.update(
                {
                    "bootstrap_room": sent.room,
                    "token_start": sent.token_start,
                    "token_end": sent.token_end,
                    "receiver": None if receiver is None else {"rid": receiver.rid, "tenant": receiver.tenant},
                }
            )
        return [
            Finding(
                KIND.unwritten_send,
                severity,
                engine,
                reader_party(sender) if sender.key else None,
                [int(p) for p in pages],
                exposed,
                at.ts_ns,
                summary,
                evidence,
            )
        ]

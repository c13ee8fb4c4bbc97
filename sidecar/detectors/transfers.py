"""Transfer detectors: ``transfer_size_mismatch`` (tokens sent != tokens reserved)."""

from __future__ import annotations

from ..findings import CRITICAL, EngineRef, Finding
from ..ledger import Pairing
from ..tracker import EngineTracker
from .reads import reader_party


class TransferSizeDetector:
    def observe(self, tracker: EngineTracker, engine: EngineRef, pairing: Pairing, ts_ns: int) -> list[Finding]:
        if not pairing.verified or pairing.sent_tokens >= pairing.reserved_tokens:
            return []
        reader = tracker.requests.get_or_stub(pairing.receiver_key)
        if reader.warmup:
            return []
        row = tracker.rows.get(pairing.receiver_key)
        unfilled = []
        if row is not None:
            filled = set(int(i) for i in pairing.written_row_pages)
            unfilled = [int(p) for i, p in enumerate(row.pages[: pairing.reserved_pages]) if i not in filled and p > 0]
        summary = (f"decode rank {engine.rank}: transfer for request {reader.rid} (room {pairing.room}) "
                   f"carried {pairing.sent_tokens} tokens into {pairing.reserved_tokens} reserved "
                   f"({pairing.sent_pages} of {pairing.reserved_pages} pages)")
        evidence = {"sent_tokens": pairing.sent_tokens, "reserved_tokens": pairing.reserved_tokens,
                    "sent_pages": pairing.sent_pages, "reserved_pages": pairing.reserved_pages}
        return [Finding("transfer_size_mismatch", CRITICAL, engine, reader_party(reader), unfilled, [], ts_ns,
                        summary, evidence)]

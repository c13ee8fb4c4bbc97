"""Transfer detectors, judged on the receiving (decode) side, whose pages are at stake.

- ``transfer_size_mismatch`` (critical): tokens sent != tokens reserved.
- ``checksum_mismatch`` (critical): both ends' digests complete with the same
  algorithm and different (docs/wire-format.md, "Transfer digests").
- ``orphan_transfer`` (warning): decode holds pages reserved for a transfer whose
  sender gave up or never showed up (sidecar/ledger/memory.py has the rules).
- ``ledger_degraded`` (warning): the shared ledger is unreachable; transfers that
  need the other pod's facts wait (bounded) or are counted as unverified.
Warmup and health-check requests are never alarmed.
"""

from __future__ import annotations

from typing import ClassVar

from ..catalogue import KIND
from ..events import DigestsCompared, LedgerUnreachable, TransferOrphaned
from ..findings import CRITICAL, WARNING, Finding
from ..ledger import DigestVerdict, Pairing, RoomState
from ..ledger.lanes import room_of
from .base import At
from .reads import guard_evidence, reader_party

ALG_NAMES = {1: "xxh3_unit_bytes", 2: "xxh3_device_reduced", 3: "xxh3_head_streams", 4: "xxh3_block_rows"}


def _held_pages(state: RoomState) -> list[int]:
    """The page ids the receiver reserved for the transfer (XFER_RESERVE), padding excluded."""
    return [] if state.reserved_pages is None else [int(p) for p in state.reserved_pages if p > 0]


class TransferSizeDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.transfer_size_mismatch,)
    events: ClassVar[tuple[type, ...]] = (Pairing,)

    def observe(self, pairing: Pairing, at: At) -> list[Finding]:
        tracker, engine, ts_ns = at.tracker, at.engine, at.ts_ns
        assert tracker is not None  # the receiver's model
        if not pairing.verified:
            return []
        # more: the sender's chunks span more tokens than decode reserved (counted from the
        # first token they cover, so decode's cached prefix before it is not counted as sent)
        span = pairing.sent_tokens - pairing.sent_start
        if span > pairing.reserved_tokens and pairing.sent_tokens > 0:
            return self._oversend(pairing, at, span)
        # fewer: the sender's chunks end before the reservation does, or start after it does
        # (it starts after decode's own cached prefix, if any: those tokens were never the
        # transfer's to send; a sender that starts later leaves the first reserved pages unfilled)
        base = getattr(pairing.state, "reserved_row_base", 0)
        sent = pairing.carried_tokens(tracker.page_size)
        if sent >= pairing.reserved_tokens:
            return []
        reader = tracker.requests.get_or_stub(pairing.receiver_key)
        if reader.warmup:
            return []
        row = tracker.rows.get(pairing.receiver_key)
        filled = set(int(i) for i in pairing.written_row_pages)
        # the reserved pages in row order: from the row, or (the reader ended before the
        # sender's facts came, across pods) from the reservation itself
        reserved = row.pages[base : base + pairing.reserved_pages] if row is not None else None
        if reserved is None and isinstance(pairing.state, RoomState) and pairing.state.reserved_pages is not None:
            reserved = pairing.state.reserved_pages
        unfilled = (
            []
            if reserved is None
            else [int(p) for i, p in enumerate(reserved, start=base) if i not in filled and p > 0]
        )
        summary = (
            f"decode rank {engine.rank}: transfer for request {reader.rid} (room {room_of(pairing.room)}) "
            f"carried {sent} tokens into {pairing.reserved_tokens} reserved "
            f"({pairing.sent_pages} of {pairing.reserved_pages} pages)"
        )
        evidence = {
            "direction": "fewer_sent",
            "sent_tokens": sent,
            "reserved_tokens": pairing.reserved_tokens,
            "sent_pages": pairing.sent_pages,
            "reserved_pages": pairing.reserved_pages,
        }
        return [
            Finding(
                KIND.transfer_size_mismatch,
                CRITICAL,
                engine,
                reader_party(reader),
                unfilled,
                [],
                ts_ns,
                summary,
                evidence,
            )
        ]

    def _oversend(self, pairing: Pairing, at: At, span: int) -> list[Finding]:
        """The sender shipped more than decode made room for: whatever lands past the
        reservation overwrites decode pages that are not this request's (vLLM/NIXL region
        mismatches); SGLang's Mooncake worker cuts the excess (its own warning). Either way
        the two ends disagree about the prompt, and decode's request holds KV for only part
        of what prefill computed."""
        tracker, engine = at.tracker, at.engine
        assert tracker is not None
        reader = tracker.requests.get_or_stub(pairing.receiver_key)
        if reader.warmup:
            return []
        summary = (
            f"decode rank {engine.rank}: transfer for request {reader.rid} (room {room_of(pairing.room)}) "
            f"carried {span} tokens ({pairing.sent_pages} pages) into {pairing.reserved_tokens} reserved "
            f"({pairing.reserved_pages} pages): {span - pairing.reserved_tokens} more than decode made room for, "
            "which land past the reservation unless the transfer engine cuts them"
        )
        evidence = {
            "direction": "more_sent",
            "sent_tokens": span,
            "reserved_tokens": pairing.reserved_tokens,
            "sent_pages": pairing.sent_pages,
            "reserved_pages": pairing.reserved_pages,
        }
        pages = _held_pages(pairing.state) if isinstance(pairing.state, RoomState) else []
        return [
            Finding(
                KIND.transfer_size_mismatch,
                CRITICAL,
                engine,
                reader_party(reader),
                pages,
                [],
                at.ts_ns,
                summary,
                evidence,
            )
        ]


# what decode's guard did (KVGUARD_GUARD=transfer, engine_hooks/sglang/guard_marker.py)
DIGEST_GUARD_OUTCOME = {
    "aborted": "; decode's guard failed the request before its first decode step: no token was computed over it",
    "observed": "; decode's guard saw it and let it run (observed only)",
}


class ChecksumDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.checksum_mismatch,)
    events: ClassVar[tuple[type, ...]] = (DigestsCompared,)

    def observe(self, compared: DigestsCompared, at: At) -> list[Finding]:
        tracker, engine, ts_ns = at.tracker, at.engine, at.ts_ns
        state: RoomState = compared.state
        verdict: DigestVerdict = compared.verdict
        assert tracker is not None  # the receiver's model
        if verdict.match or state.warmup:
            return []
        reader = tracker.requests.get_or_stub(state.receiver_key)
        if reader.warmup:
            return []
        pages = _held_pages(state)
        alg = ALG_NAMES.get(verdict.alg, str(verdict.alg))
        summary = (
            f"decode rank {engine.rank}: KV received for request {reader.rid} (room {room_of(state.room)}) differs "
            f"from what prefill sent: {alg} digest {verdict.receiver:016x} over tokens "
            f"[{verdict.receiver_range[0]}, {verdict.receiver_range[1]}) vs {verdict.sender:016x} over "
            f"[{verdict.sender_range[0]}, {verdict.sender_range[1]}) ({len(pages)} pages)"
            + DIGEST_GUARD_OUTCOME.get(reader.guard_action, "")
        )
        evidence = {
            "alg": alg,
            "sender_digest": f"{verdict.sender:016x}",
            "receiver_digest": f"{verdict.receiver:016x}",
            "sender_tokens": list(verdict.sender_range),
            "receiver_tokens": list(verdict.receiver_range),
            "bootstrap_room": room_of(state.room),
            **guard_evidence(reader),
        }
        return [
            Finding(KIND.checksum_mismatch, CRITICAL, engine, reader_party(reader), pages, [], ts_ns, summary, evidence)
        ]


class OrphanDetector:
    kinds: ClassVar[tuple[str, ...]] = (KIND.orphan_transfer,)
    events: ClassVar[tuple[type, ...]] = (TransferOrphaned,)

    def observe(self, orphaned: TransferOrphaned, at: At) -> list[Finding]:
        tracker, engine, ts_ns = at.tracker, at.engine, at.ts_ns
        state: RoomState = orphaned.state
        timeout_s = orphaned.timeout_s
        assert tracker is not None  # the receiver's model
        reader = tracker.requests.get_or_stub(state.receiver_key)
        if reader.warmup or state.warmup:
            return []
        pages = _held_pages(state)
        if state.sender_gave_up == "reject":
            why = "prefill rejected the request"
        elif state.sender_gave_up:
            why = f"prefill's request ended ({state.sender_gave_up}) without sending, {timeout_s:g} s ago or more"
        else:
            why = f"no prefill engine reported the room within {timeout_s:g} s"
        summary = (
            f"decode rank {engine.rank}: {len(pages)} pages reserved for request {reader.rid} "
            f"(room {room_of(state.room)}, {state.reserved_tokens} tokens) are held for a transfer that will not "
            f"come: {why}"
        )
        evidence = {
            "bootstrap_room": room_of(state.room),
            "reserved_tokens": state.reserved_tokens,
            "held_pages": len(pages),
            "sender": state.sender_gave_up or "never reported",
            "timeout_s": timeout_s,
        }
        return [
            Finding(KIND.orphan_transfer, WARNING, engine, reader_party(reader), pages, [], ts_ns, summary, evidence)
        ]


class LedgerDegradedDetector:
    """The shared ledger is unreachable (reported again every DEGRADED_REPEAT_NS while it lasts)."""

    kinds: ClassVar[tuple[str, ...]] = (KIND.ledger_degraded,)
    events: ClassVar[tuple[type, ...]] = (LedgerUnreachable,)

    def observe(self, event: LedgerUnreachable, at: At) -> list[Finding]:
        # at.engine is the sidecar itself (Pipeline: SIDECAR_ENGINE): no engine is at fault
        summary = (
            f"shared transfer ledger {event.display_url} unreachable ({event.last_error}): transfers cannot be "
            f"paired with the other pod; {event.waiting} wait for it (bounded), local detection continues"
        )
        evidence = {"ledger": event.display_url, "error": event.last_error, "transfers_waiting": event.waiting}
        return [Finding(KIND.ledger_degraded, WARNING, at.engine, None, [], [], at.ts_ns, summary, evidence)]

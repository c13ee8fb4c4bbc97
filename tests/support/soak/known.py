"""Known kvguard false alarms, recognised *precisely* from the record stream.

A finding is only excused here when the raw records prove that the engine did the
right thing; anything else stays a failure. Each signature names the root cause
(reported to the lead; the fix belongs in the sidecar, not in this test):

``ttft_per_token_model``
    ``ttft_anomaly`` for a request whose own FORWARD records wrote every page of its
    uncached prompt (unified / prefill), or, on decode, whose prompt the prefill side
    sent in full (an ``is_last`` XFER_SEND up to ``prompt_tokens``). The detector's
    floor is ``ttft / uncached_tokens`` of short prompts, whose TTFT is dominated by a
    per-request constant (queueing behind other requests, one scheduler step, the
    64-token prefill chunks): a longer or less-queued prompt is "4x faster per token"
    although it was prefilled normally.

``send_stamped_after_receiver_done``
    ``transfer_size_mismatch`` / decode ``unwritten_read`` for a room whose sender
    did send the whole reservation (``is_last`` XFER_SEND with ``token_end`` =
    reserved tokens), but whose XFER_SEND record carries a *later* timestamp than the
    receiver's XFER_DONE success. The adapter emits XFER_SEND after
    ``send_kv_chunk`` returns, while Mooncake's transfer thread may already have
    finished and decode polled success; the pipeline pairs at the receiver's
    XFER_DONE, finds no chunk, records 0 tokens sent and leaves the pages unwritten.
    When decode even finished the request and freed the pages before the XFER_SEND
    record, the late-send check adds ``use_after_free`` (or ``late_write``) with
    ``evidence.via == "transfer"``, although the receiver's *success* proves the
    bytes had landed before decode read, let alone freed, those pages.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.sidecar.findings import Finding

TTFT = "ttft_per_token_model"
SEND_ORDER = "send_stamped_after_receiver_done"


class KnownFalseAlarm(AssertionError):
    """Only known, precisely recognised kvguard false alarms remain (see known.py)."""


@dataclass
class RoomLog:
    sends: list = field(default_factory=list)  # (ts_ns, token_start, token_end, is_last)
    receiver_done: list = field(default_factory=list)  # (ts_ns, status)
    reserved_tokens: int | None = None
    reserved_pages: frozenset = frozenset()


class RecordIndex:
    """Per-request and per-room views of the kept records."""

    def __init__(self, records, page_size: int = 4):
        self.page_size = page_size
        self.begin: dict[tuple[int, int], wire.ReqBegin] = {}  # (engine, key) -> REQ_BEGIN
        self.written: dict[tuple[int, int], set] = defaultdict(set)  # pages written by a request's forwards
        # row page index -> every page ASSIGNed there (the radix cache may rebind a position)
        self.rows: dict[tuple[int, int], dict] = defaultdict(lambda: defaultdict(set))
        self.rooms: dict[int, RoomLog] = defaultdict(RoomLog)
        self.roles: dict[int, int] = {}
        for r in records:
            b, k, e = r.body, r.kind, r.engine_id
            if k == wire.Kind.HELLO:
                self.roles[e] = b.role
                self.page_size = b.page_size
            elif k == wire.Kind.REQ_BEGIN:
                self.begin[(e, b.req_key)] = b
            elif k == wire.Kind.ASSIGN:
                first = b.row_start // self.page_size
                for i, p in enumerate(b.pages.tolist()):
                    self.rows[(e, b.req_key)][first + i].add(p)
            elif k == wire.Kind.FORWARD:
                off = np.concatenate(([0], np.cumsum(b.write_counts, dtype=np.int64)))
                for i, key in enumerate(b.req_keys.tolist()):
                    self.written[(e, key)].update(b.write_pages[off[i] : off[i + 1]].tolist())
            elif k == wire.Kind.XFER_SEND:
                self.rooms[b.room].sends.append((r.ts_ns, b.token_start, b.token_end, b.is_last))
            elif k == wire.Kind.XFER_RESERVE:
                self.rooms[b.room].reserved_tokens = b.tokens
                self.rooms[b.room].reserved_pages = frozenset(b.pages.tolist())
            elif k == wire.Kind.XFER_DONE and b.side == wire.Side.RECEIVER:
                self.rooms[b.room].receiver_done.append((r.ts_ns, b.status))

    def engine_of(self, finding: Finding) -> int | None:
        for (e, _key), b in self.begin.items():
            if (
                finding.reader is not None
                and b.rid == finding.reader.rid
                and self.roles.get(e)
                == {
                    "unified": wire.Role.UNIFIED,
                    "prefill": wire.Role.PREFILL,
                    "decode": wire.Role.DECODE,
                }.get(finding.engine.role)
            ):
                return e
        return None

    def prefilled_in_full(self, engine: int, key: int) -> bool:
        """Every row page of the request's uncached prompt was written by its own forwards."""
        b = self.begin.get((engine, key))
        if b is None:
            return False
        ps = self.page_size
        need = range(b.cached_tokens // ps, -(-b.prompt_tokens // ps))
        row = self.rows.get((engine, key), {})
        written = self.written.get((engine, key), set())
        return all(row.get(i, set()) & written for i in need)

    def sent_in_full(self, room: int, tokens: int) -> bool:
        return any(last and end >= tokens for _ts, _start, end, last in self.rooms[room].sends)

    def send_after_done(self, room: int) -> bool:
        """The room's whole reservation was sent, but stamped after the receiver's success."""
        log = self.rooms.get(room)
        if log is None or not log.receiver_done or log.reserved_tokens is None:
            return False
        success = [ts for ts, status in log.receiver_done if status == wire.XferStatus.SUCCESS]
        full = [ts for ts, _s, end, last in log.sends if last and end >= log.reserved_tokens]
        return bool(success) and bool(full) and min(full) > min(success)


def known_false_alarm(finding: Finding, index: RecordIndex) -> str | None:
    """The signature name when ``finding`` is a known false alarm (proven by the records), else None."""
    if finding.reader is None:
        return None
    key = wire.request_key(finding.reader.rid)
    engine = index.engine_of(finding)
    room = finding.reader.bootstrap_room
    if finding.kind == "ttft_anomaly" and engine is not None:
        b = index.begin[(engine, key)]
        if finding.engine.role == "decode":
            return TTFT if room is not None and index.sent_in_full(room, b.prompt_tokens) else None
        return TTFT if index.prefilled_in_full(engine, key) else None
    late_send = finding.kind in ("use_after_free", "late_write") and finding.evidence.get("via") == "transfer"
    if finding.engine.role == "decode" and (late_send or finding.kind in ("transfer_size_mismatch", "unwritten_read")):
        if room is None or not index.send_after_done(room):
            return None
        return SEND_ORDER if set(finding.pages) <= index.rooms[room].reserved_pages else None
    return None

"""The kvguard wire contract, version 1: record layouts shared by engine and sidecar.

Every record is a fixed 32-byte little-endian header followed by a typed payload,
padded with zero bytes to a multiple of 8. ``docs/wire-format.md`` describes the
bytes in prose; this module is the executable form of that document, and of the
recording segment format of ``docs/recording-api.md`` (at the end). The decoded forms
of records are dataclasses in ``wire_types.py``, re-exported here.

Header (``HEADER``, 32 bytes)::

    off size field      meaning
      0   2  magic      0x4B47 ("GK" on the wire), constant
      2   1  version    contract version of the payload layout (1)
      3   1  kind       Kind below
      4   4  length     total record bytes, header + payload + padding, multiple of 8
      8   8  seq        per-ring sequence number; increments for every record the
                        producer *tried* to write, so dropped records leave a gap
     16   8  ts_ns      CLOCK_MONOTONIC nanoseconds when the probe fired
     24   4  engine_id  the producing ring's engine id (see ring.py)
     28   2  pool       KV pool index inside the engine (0 = the token KV pool)
     30   2  flags      kind-specific bits, 0 unless stated

Nothing private crosses this contract: page ids, counts, digests, request ids and
tenant labels only; never token ids, text or KV bytes.

Request ids are carried once, in REQ_BEGIN; every other record names the request by
its 64-bit key (``request_key(rid)``: xxh3-64 of the UTF-8 rid), so hot records
carry 8 bytes, not strings. The same rid gives the same key on prefill and decode.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .wire_types import (
    Assign,
    DecodeStats,
    Forward,
    Heartbeat,
    Hello,
    ProbeError,
    Record,
    Reject,
    ReqBegin,
    ReqEnd,
    SidecarEvent,
    Tier1Violation,
    XferDigest,
    XferDone,
    XferReserve,
    XferSend,
)

MAGIC = 0x4B47
VERSION = 1
HEADER = struct.Struct("<HBBIQQIHH")
HEADER_SIZE = HEADER.size
ALIGN = 8
NO_ROOM = (1 << 64) - 1  # bootstrap_room of a request that has none
MAX_STRING_BYTES = 256  # longer strings are truncated by the encoder
MAX_RECORD_BYTES = 1 << 26  # 64 MiB: anything longer is corrupt by definition

assert HEADER_SIZE == 32, HEADER_SIZE


class Kind(enum.IntEnum):
    PAD = 0  # ring filler up to the end of the data area; never decoded
    HELLO = 1
    REQ_BEGIN = 2
    REQ_END = 3
    ALLOC = 4
    ASSIGN = 5
    FORWARD = 6
    FREE = 7
    XFER_RESERVE = 8
    XFER_SEND = 9
    XFER_DONE = 10
    REJECT = 11
    HEARTBEAT = 12
    PROBE_ERROR = 13
    LOST = 14  # never on the wire: readers insert it at a sequence gap (body = records missing)
    XFER_DIGEST = 15  # digest of one end's KV for a transfer (sender: what it sent; receiver: what it reserved)
    TIER1_VIOLATION = 16  # the engine's own read check (engine_hooks/tier1.py) found a row page not the reader's


class Role(enum.IntEnum):
    UNIFIED = 0
    PREFILL = 1
    DECODE = 2


class Finish(enum.IntEnum):
    UNKNOWN = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    REJECT = 4


class FreeKind(enum.IntEnum):
    FREE = 0  # allocator.free, immediate
    GROUP = 1  # flushed at free_group_end
    DEFERRED = 2  # deferred release (e.g. after a transfer drained)
    PAGE_IDS = 3  # free_page_ids


class Side(enum.IntEnum):
    SENDER = 1
    RECEIVER = 2


class XferStatus(enum.IntEnum):
    SUCCESS = 1
    FAILED = 2
    ABORTED = 3


class DigestAlg(enum.IntEnum):
    """How an XFER_DIGEST was computed; digests of different algorithms are never compared.

    All are defined over (layer, kv head, token) units so that ends with different
    tensor-parallel sizes agree (docs/wire-format.md, "Transfer digests").
    """

    XXH3_UNIT_BYTES = 1  # host pools until alg 3 (no longer emitted; decoded for recordings): xxh3-64 over
    #                      each (layer, head)'s units, K then V bytes per token, in token order
    XXH3_DEVICE_REDUCED = 2  # device pools: units reduced to u64 on the device, then xxh3-64 on the host
    XXH3_HEAD_STREAMS = 3  # host pools: xxh3-64 over each (layer, head)'s K bytes, and over its V bytes, in token order


class Phase(enum.IntEnum):
    ADMISSION = 0
    PREFILL = 1
    DECODE = 2
    TRANSFER = 3
    CLIENT_ABORT = 4  # the client (or an operator) aborted it: an AbortReq, not a refusal by the engine


class Tier1Tag(enum.IntEnum):
    """What the engine's page tag said about a page a row named (TIER1_VIOLATION)."""

    FREE = 1  # in the allocator's free list: a use after free
    ALLOCATED = 2  # handed out but in no request's row yet
    OTHER_REQUEST = 3  # another live request's own page: a foreign read


# Fixed payload parts, after the header. Variable parts follow in the order given.
HELLO_FIXED = struct.Struct("<BBHIIIQQQ")
#   role, _, tp_rank, pid, page_size, pool_pages, pool_tokens, context_len, max_req_input_len;
#   then strings: engine_name, engine_version, model, kvguard_version
REQ_BEGIN_FIXED = struct.Struct("<QQIIB7x")  # req_key, room, prompt_tokens, cached_tokens, flags(bit0 warmup)
#   then strings: rid, tenant
REQ_END_FIXED = struct.Struct("<QQQIBB2x")  # req_key, ttft_ns, e2e_ns, output_tokens, finish, flags
#   then string: reason
PAGES_FIXED = struct.Struct("<IB3x")  # ALLOC/FREE: count, free_kind; then int32[count]
ASSIGN_FIXED = struct.Struct("<QIIII")  # req_key, row_start, row_end, shared_until, count; then int32[count]
FORWARD_FIXED = struct.Struct("<IIIBB2x")  # n_reqs, n_write_pages, n_read_pages, flags, mode
#   then u64 req_keys[n], u32 seq_lens[n], u32 write_counts[n], u32 read_counts[n] (if FWD_HAS_ROWS),
#   int32 write_pages[n_write_pages], int32 read_pages[n_read_pages]
XFER_RESERVE_FIXED = struct.Struct("<QQII")  # req_key, room, tokens, count; then int32 dst pages
XFER_SEND_FIXED = struct.Struct("<QQQIIIB3x")  # req_key, room, digest, token_start, token_end, count, is_last
XFER_DONE_FIXED = struct.Struct("<QQBB6x")  # req_key, room, side, status
XFER_DIGEST_FIXED = struct.Struct("<QQQIIHHHHBB6x")
#   req_key, room, digest, token_start, token_end, layers, head_start, head_count, total_heads, side, alg
REJECT_FIXED = struct.Struct("<QB7x")  # req_key, phase; then string reason
HEARTBEAT_FIXED = struct.Struct("<QQQ")  # records_written, records_dropped, probe_errors
TIER1_FIXED = struct.Struct("<QQII")  # reader req_key, violations so far in the engine, seq_len, count
#   then int32 pages[count], u32 row_page_index[count], u64 owner_keys[count], u8 tags[count] (Tier1Tag)
PROBE_ERROR_FIXED = struct.Struct("<I4x")  # count of errors so far for this probe; then strings probe, error type

FWD_HAS_ROWS = 1  # FORWARD flags: read_counts/read_pages carry the engine's actual rows
REQ_WARMUP = 1  # REQ_BEGIN flags: warmup / health-check request, never alarmed
REQ_END_REPREFILLED = 1  # REQ_END flags: KV released and prefilled again before the first token (not comparable TTFT)


def request_key(rid: str) -> int:
    """64-bit key for a request id; identical on every engine that sees the rid."""
    return xxhash.xxh3_64_intdigest(rid.encode("utf-8", "replace"))


# --------------------------------------------------------------------------- records
# The decoded forms of the other kinds are in wire_types.py (imported above): Pages stays here,
# with the FreeKind its default needs, so that wire_types needs nothing from this module.
@dataclass(slots=True)
class Pages:
    """ALLOC and FREE: a set of page ids (FREE also says which free path)."""

    pages: np.ndarray
    free_kind: FreeKind = FreeKind.FREE


# --------------------------------------------------------------------------- encoding
def _str_bytes(value: str) -> bytes:
    raw = value.encode("utf-8", "replace")[:MAX_STRING_BYTES]
    return struct.pack("<H", len(raw)) + raw


def _i32(pages) -> bytes:
    return np.ascontiguousarray(pages, dtype="<i4").tobytes()


def encode(kind: int, seq: int, ts_ns: int, engine_id: int, payload: bytes, pool: int = 0, flags: int = 0) -> bytes:
    """One whole record: header + payload + zero padding to a multiple of 8."""
    length = HEADER_SIZE + len(payload)
    padded = (length + ALIGN - 1) & ~(ALIGN - 1)
    head = HEADER.pack(MAGIC, VERSION, int(kind), padded, seq, ts_ns, engine_id, pool, flags)
    return head + payload + b"\0" * (padded - length)


def hello_payload(h: Hello) -> bytes:
    fixed = HELLO_FIXED.pack(
        int(h.role), 0, h.tp_rank, h.pid, h.page_size, h.pool_pages, h.pool_tokens, h.context_len, h.max_req_input_len
    )
    return fixed + b"".join(_str_bytes(s) for s in (h.engine_name, h.engine_version, h.model, h.kvguard_version))


def req_begin_payload(r: ReqBegin) -> bytes:
    flags = REQ_WARMUP if r.warmup else 0
    fixed = REQ_BEGIN_FIXED.pack(r.req_key, r.room, r.prompt_tokens, r.cached_tokens, flags)
    return fixed + _str_bytes(r.rid) + _str_bytes(r.tenant)


def req_end_payload(r: ReqEnd) -> bytes:
    flags = REQ_END_REPREFILLED if r.reprefilled else 0
    return REQ_END_FIXED.pack(r.req_key, r.ttft_ns, r.e2e_ns, r.output_tokens, int(r.finish), flags) + _str_bytes(
        r.reason
    )


def pages_payload(pages: np.ndarray, free_kind: FreeKind = FreeKind.FREE) -> bytes:
    return PAGES_FIXED.pack(len(pages), int(free_kind)) + _i32(pages)


def assign_payload(a: Assign) -> bytes:
    return ASSIGN_FIXED.pack(a.req_key, a.row_start, a.row_end, a.shared_until, len(a.pages)) + _i32(a.pages)


def forward_payload(f: Forward) -> bytes:
    has_rows = f.read_counts is not None
    read_pages = f.read_pages
    if has_rows and read_pages is None:
        raise ValueError("a Forward with read_counts needs read_pages")
    n = len(f.req_keys)
    n_read = len(read_pages) if has_rows and read_pages is not None else 0
    parts = [
        FORWARD_FIXED.pack(n, len(f.write_pages), n_read, FWD_HAS_ROWS if has_rows else 0, f.mode),
        np.ascontiguousarray(f.req_keys, dtype="<u8").tobytes(),
        np.ascontiguousarray(f.seq_lens, dtype="<u4").tobytes(),
        np.ascontiguousarray(f.write_counts, dtype="<u4").tobytes(),
    ]
    if has_rows:
        parts.append(np.ascontiguousarray(f.read_counts, dtype="<u4").tobytes())
    parts.append(_i32(f.write_pages))
    if has_rows:
        parts.append(_i32(read_pages))
    return b"".join(parts)


def xfer_reserve_payload(x: XferReserve) -> bytes:
    return XFER_RESERVE_FIXED.pack(x.req_key, x.room, x.tokens, len(x.pages)) + _i32(x.pages)


def xfer_send_payload(x: XferSend) -> bytes:
    fixed = XFER_SEND_FIXED.pack(x.req_key, x.room, x.digest, x.token_start, x.token_end, len(x.pages), int(x.is_last))
    return fixed + _i32(x.pages)


def xfer_done_payload(x: XferDone) -> bytes:
    return XFER_DONE_FIXED.pack(x.req_key, x.room, int(x.side), int(x.status))


def xfer_digest_payload(x: XferDigest) -> bytes:
    return XFER_DIGEST_FIXED.pack(
        x.req_key,
        x.room,
        x.digest,
        x.token_start,
        x.token_end,
        x.layers,
        x.head_start,
        x.head_count,
        x.total_heads,
        int(x.side),
        int(x.alg),
    )


def tier1_violation_payload(v: Tier1Violation) -> bytes:
    n = len(v.pages)
    if not len(v.row_indices) == len(v.owner_keys) == len(v.tags) == n:
        raise ValueError("TIER1_VIOLATION arrays differ in length")
    return b"".join(
        (
            TIER1_FIXED.pack(v.reader_key, v.violations_total, v.seq_len, n),
            _i32(v.pages),
            np.ascontiguousarray(v.row_indices, dtype="<u4").tobytes(),
            np.ascontiguousarray(v.owner_keys, dtype="<u8").tobytes(),
            np.ascontiguousarray(v.tags, dtype="u1").tobytes(),
        )
    )


def reject_payload(r: Reject) -> bytes:
    return REJECT_FIXED.pack(
        r.req_key,
        int(r.phase),
    ) + _str_bytes(r.reason)


def heartbeat_payload(h: Heartbeat) -> bytes:
    return HEARTBEAT_FIXED.pack(h.records_written, h.records_dropped, h.probe_errors)


def probe_error_payload(p: ProbeError) -> bytes:
    return PROBE_ERROR_FIXED.pack(p.count) + _str_bytes(p.probe) + _str_bytes(p.error)


# --------------------------------------------------------------------------- decoding
class DecodeError(ValueError):
    """A record whose payload does not fit its declared layout."""


class _Cursor:
    """Bounds-checked reads over one record's payload."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview, pos: int, end: int):
        self.buf, self.pos, self.end = buf, pos, end

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.end:
            raise DecodeError(f"payload truncated: need {n} bytes at {start - HEADER_SIZE}, have {self.end - start}")
        self.pos = start + n
        return start

    def fixed(self, s: struct.Struct) -> tuple:
        return s.unpack_from(self.buf, self.take(s.size))

    def array(self, dtype: str, count: int) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        start = self.take(count * itemsize)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()

    def string(self) -> str:
        (n,) = struct.unpack_from("<H", self.buf, self.take(2))
        if n > MAX_STRING_BYTES:
            raise DecodeError(f"string of {n} bytes exceeds {MAX_STRING_BYTES}")
        start = self.take(n)
        return bytes(self.buf[start : start + n]).decode("utf-8", "replace")


def _decode_hello(c: _Cursor) -> Hello:
    role, _, tp_rank, pid, page_size, pool_pages, pool_tokens, context_len, max_in = c.fixed(HELLO_FIXED)
    if page_size < 1:
        raise DecodeError(f"HELLO page_size {page_size} < 1")
    strings = [c.string() for _ in range(4)]
    return Hello(Role(role), tp_rank, pid, page_size, pool_pages, pool_tokens, context_len, max_in, *strings)


def _decode_req_begin(c: _Cursor) -> ReqBegin:
    key, room, prompt, cached, flags = c.fixed(REQ_BEGIN_FIXED)
    return ReqBegin(key, room, prompt, cached, bool(flags & REQ_WARMUP), c.string(), c.string())


def _decode_req_end(c: _Cursor) -> ReqEnd:
    key, ttft, e2e, out, finish, flags = c.fixed(REQ_END_FIXED)
    return ReqEnd(key, ttft, e2e, out, Finish(finish), c.string(), bool(flags & REQ_END_REPREFILLED))


def _decode_pages(c: _Cursor) -> Pages:
    count, free_kind = c.fixed(PAGES_FIXED)
    return Pages(c.array("<i4", count), FreeKind(free_kind))


def _decode_assign(c: _Cursor) -> Assign:
    key, start, end, shared_until, count = c.fixed(ASSIGN_FIXED)
    if not start <= shared_until <= end:
        raise DecodeError(f"ASSIGN shared_until {shared_until} outside row [{start}, {end})")
    return Assign(key, start, end, shared_until, c.array("<i4", count))


def _decode_forward(c: _Cursor) -> Forward:
    n, n_write, n_read, flags, mode = c.fixed(FORWARD_FIXED)
    keys = c.array("<u8", n)
    seq_lens = c.array("<u4", n)
    write_counts = c.array("<u4", n)
    read_counts = c.array("<u4", n) if flags & FWD_HAS_ROWS else None
    if int(write_counts.sum()) != n_write:
        raise DecodeError(f"FORWARD write counts sum to {int(write_counts.sum())}, header says {n_write}")
    write_pages = c.array("<i4", n_write)
    read_pages = None
    if read_counts is not None:
        if int(read_counts.sum()) != n_read:
            raise DecodeError(f"FORWARD read counts sum to {int(read_counts.sum())}, header says {n_read}")
        read_pages = c.array("<i4", n_read)
    return Forward(keys, seq_lens, write_counts, write_pages, read_counts, read_pages, mode)


def _decode_xfer_reserve(c: _Cursor) -> XferReserve:
    key, room, tokens, count = c.fixed(XFER_RESERVE_FIXED)
    return XferReserve(key, room, tokens, c.array("<i4", count))


def _decode_xfer_send(c: _Cursor) -> XferSend:
    key, room, digest, t0, t1, count, is_last = c.fixed(XFER_SEND_FIXED)
    if t1 < t0:
        raise DecodeError(f"XFER_SEND token_end {t1} < token_start {t0}")
    return XferSend(key, room, digest, t0, t1, bool(is_last), c.array("<i4", count))


def _decode_xfer_done(c: _Cursor) -> XferDone:
    key, room, side, status = c.fixed(XFER_DONE_FIXED)
    return XferDone(key, room, Side(side), XferStatus(status))


def _decode_xfer_digest(c: _Cursor) -> XferDigest:
    key, room, digest, t0, t1, layers, h0, hn, htotal, side, alg = c.fixed(XFER_DIGEST_FIXED)
    if t1 < t0:
        raise DecodeError(f"XFER_DIGEST token_end {t1} < token_start {t0}")
    if h0 + hn > htotal:
        raise DecodeError(f"XFER_DIGEST heads [{h0}, {h0 + hn}) exceed total {htotal}")
    return XferDigest(key, room, Side(side), DigestAlg(alg), digest, t0, t1, layers, h0, hn, htotal)


def _decode_tier1_violation(c: _Cursor) -> Tier1Violation:
    key, total, seq_len, n = c.fixed(TIER1_FIXED)
    pages, rows, owners, tags = c.array("<i4", n), c.array("<u4", n), c.array("<u8", n), c.array("u1", n)
    bad = tags[(tags < Tier1Tag.FREE) | (tags > Tier1Tag.OTHER_REQUEST)]
    if len(bad):
        raise DecodeError(f"TIER1_VIOLATION tag {int(bad[0])} unknown")
    return Tier1Violation(key, total, seq_len, pages, rows, owners, tags)


def _decode_reject(c: _Cursor) -> Reject:
    key, phase = c.fixed(REJECT_FIXED)
    return Reject(key, Phase(phase), c.string())


def _decode_heartbeat(c: _Cursor) -> Heartbeat:
    return Heartbeat(*c.fixed(HEARTBEAT_FIXED))


def _decode_probe_error(c: _Cursor) -> ProbeError:
    (count,) = c.fixed(PROBE_ERROR_FIXED)
    return ProbeError(count, c.string(), c.string())


_DECODERS = {
    Kind.HELLO: _decode_hello,
    Kind.REQ_BEGIN: _decode_req_begin,
    Kind.REQ_END: _decode_req_end,
    Kind.ALLOC: _decode_pages,
    Kind.FREE: _decode_pages,
    Kind.ASSIGN: _decode_assign,
    Kind.FORWARD: _decode_forward,
    Kind.XFER_RESERVE: _decode_xfer_reserve,
    Kind.XFER_SEND: _decode_xfer_send,
    Kind.XFER_DONE: _decode_xfer_done,
    Kind.XFER_DIGEST: _decode_xfer_digest,
    Kind.TIER1_VIOLATION: _decode_tier1_violation,
    Kind.REJECT: _decode_reject,
    Kind.HEARTBEAT: _decode_heartbeat,
    Kind.PROBE_ERROR: _decode_probe_error,
}


def read_header(buf, pos: int, end: int) -> tuple | None:
    """The header at ``pos`` if it is structurally valid (magic, length in bounds), else None."""
    if end - pos < HEADER_SIZE:
        return None
    head = HEADER.unpack_from(buf, pos)
    magic, _version, _kind, length = head[:4]
    if magic != MAGIC or length < HEADER_SIZE or length % ALIGN or length > end - pos or length > MAX_RECORD_BYTES:
        return None
    return head


def decode_stream(
    buf, stats: DecodeStats, start: int = 0, end: int | None = None, short_tail_ok: bool = False
) -> list[Record]:
    """Decode back-to-back records from ``buf[start:end]``.

    Never raises on bad bytes. A record of another contract version or of an unknown
    kind is skipped by its length and counted; a record whose payload does not fit
    its layout is skipped and counted; bytes that do not start with a valid header
    are counted as corrupt and the rest of the buffer is skipped, because record
    boundaries can no longer be trusted. ``short_tail_ok``: the buffer ends at the end
    of a ring's data area, where fewer than 32 unused bytes are normal.
    """
    view = memoryview(buf).cast("B")
    end = len(view) if end is None else end
    out: list[Record] = []
    pos = start
    while pos < end:
        if short_tail_ok and end - pos < HEADER_SIZE:
            break
        head = read_header(view, pos, end)
        if head is None:
            stats.corrupt_bytes += end - pos
            stats.last_error = f"no valid record header at byte {pos}"
            break
        _magic, version, kind, length, seq, ts_ns, engine_id, pool, _flags = head
        record_end = pos + length
        if version != VERSION:
            stats.bad_version += 1
            stats.last_error = f"record version {version}, this reader speaks {VERSION}"
        elif kind == Kind.PAD:
            pass
        elif kind not in _DECODERS:
            stats.unknown_kind += 1
        else:
            try:
                body = _DECODERS[Kind(kind)](_Cursor(view, pos + HEADER_SIZE, record_end))
            except (DecodeError, ValueError, struct.error) as exc:
                stats.bad_payload += 1
                stats.last_error = f"{Kind(kind).name} seq {seq}: {exc}"
            else:
                stats.records += 1
                out.append(Record(Kind(kind), seq, ts_ns, engine_id, pool, body))
        pos = record_end
    return out


# --------------------------------------------------------------------------- recordings
# Segment files (docs/recording-api.md; written and read by kvguard.sidecar.recorder):
#   segment header (64 bytes: magic, format version, wire contract version, clocks, ids, checksum)
#   chunk*         (24-byte chunk header: magic, length, record count, flags, xxh3-64) + records
# The records in a chunk are wire records as ``encode`` lays them out, plus LOST markers
# (kind LOST, u64 count: never on the wire) and the sidecar's own events (kinds 0xF0..0xF2).
FORMAT_VERSION = 1
SEGMENT_MAGIC = b"KVGRSEG\0"
# magic, format_version, header_size, wire_version, created_realtime_ns, created_monotonic_ns,
# recording_id, segment_index; then the xxh3-64 of these 56 bytes
SEGMENT_FIXED = struct.Struct("<8sHHB3xQQQI12x")
SEGMENT_HEADER_SIZE = SEGMENT_FIXED.size + 8  # 64
CHUNK_MAGIC = b"KVGC"
CHUNK_FIXED = struct.Struct("<4sIIHH")  # magic, data_length, record_count, flags, reserved; then xxh3-64
CHUNK_HEADER_SIZE = CHUNK_FIXED.size + 8  # 24
CHUNK_CARRIED = 0x0001  # chunk flags: context re-emitted at the start of a segment, not new events
CHUNK_TARGET_BYTES = 1 << 20  # records are grouped into chunks of about this size (one record may exceed it)
MAX_CHUNK_DATA = MAX_RECORD_BYTES + CHUNK_TARGET_BYTES  # anything larger is corrupt by definition
LOST_PAYLOAD = struct.Struct("<Q")  # the body of a recorded LOST marker: records missing (>= 1)
LOST_RECORD_BYTES = HEADER_SIZE + LOST_PAYLOAD.size  # 40
# Record kinds 0xF0..0xFF are reserved for recordings (never on the wire): sidecar-side events that
# change detection state without a record, so replay can apply them at the same point in the stream.
KIND_ENGINE_GONE = 0xF0  # the engine's ring was retired (Pipeline.on_engine_gone(engine_id, ts_ns))
KIND_TICK = 0xF1  # Pipeline.tick(ts_ns): time-based incident resolution
KIND_GAP = 0xF2  # the recorder itself failed to record ``count`` records here (u64 payload)
SIDECAR_EVENTS = {KIND_ENGINE_GONE: "engine_gone", KIND_TICK: "tick", KIND_GAP: "gap"}
_EVENT_PAYLOAD = {KIND_ENGINE_GONE: 0, KIND_TICK: 0, KIND_GAP: 8}
_EVENT_KINDS = {name: kind for kind, name in SIDECAR_EVENTS.items()}

assert SEGMENT_HEADER_SIZE == 64 and CHUNK_HEADER_SIZE == 24


class RecordingError(RuntimeError):
    """A file this reader will not read (missing, not a recording, newer format); the message says why."""


_PAYLOADS: dict[int, Callable[[Any], bytes]] = {
    Kind.HELLO: hello_payload,
    Kind.REQ_BEGIN: req_begin_payload,
    Kind.REQ_END: req_end_payload,
    Kind.ALLOC: lambda b: pages_payload(b.pages, b.free_kind),
    Kind.FREE: lambda b: pages_payload(b.pages, b.free_kind),
    Kind.ASSIGN: assign_payload,
    Kind.FORWARD: forward_payload,
    Kind.XFER_RESERVE: xfer_reserve_payload,
    Kind.XFER_SEND: xfer_send_payload,
    Kind.XFER_DONE: xfer_done_payload,
    Kind.XFER_DIGEST: xfer_digest_payload,
    Kind.TIER1_VIOLATION: tier1_violation_payload,
    Kind.REJECT: reject_payload,
    Kind.HEARTBEAT: heartbeat_payload,
    Kind.PROBE_ERROR: probe_error_payload,
    Kind.LOST: lambda count: LOST_PAYLOAD.pack(int(count)),
}


def encode_record(rec) -> bytes:
    """The wire bytes of a decoded record (a LOST marker or a ``SidecarEvent`` gets its
    recordings-only layout).

    For every record a v1 reader accepts this is byte-identical to what the engine
    wrote, except that header ``flags`` (0 in contract version 1) are not kept by the
    decoder and are written as 0.
    """
    if isinstance(rec, SidecarEvent):
        kind = _EVENT_KINDS[rec.kind]
        return sidecar_event_record(kind, rec.ts_ns, rec.engine_id, rec.count if _EVENT_PAYLOAD[kind] else None)
    return encode(rec.kind, rec.seq, rec.ts_ns, rec.engine_id, _PAYLOADS[rec.kind](rec.body), rec.pool)


def lost_record(engine_id: int, first_seq: int, count: int, ts_ns: int) -> bytes:
    """A LOST marker as recordings store it: ``count`` records from ``first_seq`` on are missing."""
    if count < 1:
        raise ValueError(f"a LOST marker covers at least one record, got {count}")
    return encode(Kind.LOST, first_seq, ts_ns, engine_id, LOST_PAYLOAD.pack(count))


def sidecar_event_record(kind: int, ts_ns: int, engine_id: int = 0, count: int | None = None) -> bytes:
    return encode(kind, 0, ts_ns, engine_id, b"" if count is None else LOST_PAYLOAD.pack(count))


def decode_chunk(data, stats: DecodeStats) -> list:
    """Decode the records of one chunk; never raises (bad records are counted in ``stats``).

    Wire records go through ``decode_stream``; LOST markers (not a wire kind) and
    sidecar events (``SidecarEvent``) are decoded here.
    """
    view = memoryview(data).cast("B")
    end = len(view)
    out: list[Record | SidecarEvent] = []
    pos = run = 0
    while pos < end:
        head = read_header(view, pos, end)
        if head is None:
            break  # decode_stream below counts the rest as corrupt
        _magic, version, kind, length, seq, ts_ns, engine_id, pool, _flags = head
        if kind == Kind.LOST and version == VERSION:
            if run < pos:
                out += decode_stream(view, stats, run, pos)
            (count,) = LOST_PAYLOAD.unpack_from(view, pos + HEADER_SIZE) if length == LOST_RECORD_BYTES else (0,)
            if count >= 1:
                stats.records += 1
                out.append(Record(Kind.LOST, seq, ts_ns, engine_id, pool, count))
            else:
                stats.bad_payload += 1
                stats.last_error = f"LOST seq {seq}: length {length}, count {count}"
            run = pos + length
        elif kind in SIDECAR_EVENTS and version == VERSION:
            if run < pos:
                out += decode_stream(view, stats, run, pos)
            want = HEADER_SIZE + _EVENT_PAYLOAD[kind]
            if length == want:
                count = LOST_PAYLOAD.unpack_from(view, pos + HEADER_SIZE)[0] if _EVENT_PAYLOAD[kind] else 0
                stats.records += 1
                out.append(SidecarEvent(SIDECAR_EVENTS[kind], ts_ns, engine_id, count))
            else:
                stats.bad_payload += 1
                stats.last_error = f"{SIDECAR_EVENTS[kind]} event: length {length}, expected {want}"
            run = pos + length
        pos += length
    if run < end:
        out += decode_stream(view, stats, run, end)
    return out


@dataclass(slots=True, frozen=True)
class SegmentHeader:
    format_version: int
    wire_version: int
    created_realtime_ns: int  # CLOCK_REALTIME when the segment was opened
    created_monotonic_ns: int  # CLOCK_MONOTONIC at the same instant: record ts_ns + offset = wall time
    recording_id: int  # random per writer run: segments of one run share it
    segment_index: int  # 0, 1, 2 ... within a run
    header_size: int = SEGMENT_HEADER_SIZE

    def pack(self) -> bytes:
        fixed = SEGMENT_FIXED.pack(
            SEGMENT_MAGIC,
            self.format_version,
            SEGMENT_HEADER_SIZE,
            self.wire_version,
            self.created_realtime_ns,
            self.created_monotonic_ns,
            self.recording_id,
            self.segment_index,
        )
        return fixed + struct.pack("<Q", xxhash.xxh3_64_intdigest(fixed))

    def wall_ns(self, ts_ns: int) -> int:
        """A record's CLOCK_MONOTONIC timestamp as CLOCK_REALTIME (same boot as the segment)."""
        return ts_ns + self.created_realtime_ns - self.created_monotonic_ns

    @classmethod
    def unpack(cls, raw: bytes, path: str = "") -> SegmentHeader:
        where = f"{path}: " if path else ""
        if not raw:
            raise RecordingError(f"{where}empty file, not a kvguard recording")
        if len(raw) < 8 or raw[:8] != SEGMENT_MAGIC:
            raise RecordingError(
                f"{where}not a kvguard recording (magic {bytes(raw[:8])!r}, expected {SEGMENT_MAGIC!r})"
            )
        if len(raw) < SEGMENT_HEADER_SIZE:
            raise RecordingError(f"{where}{len(raw)} bytes, shorter than a recording header ({SEGMENT_HEADER_SIZE})")
        fixed = bytes(raw[: SEGMENT_FIXED.size])
        _magic, fmt, header_size, wire_version, rt, mono, rec_id, index = SEGMENT_FIXED.unpack(fixed)
        if fmt > FORMAT_VERSION:
            raise RecordingError(
                f"{where}recording format version {fmt} is newer than this kvguard reads "
                f"({FORMAT_VERSION}): upgrade kvguard to replay it"
            )
        (checksum,) = struct.unpack_from("<Q", raw, SEGMENT_FIXED.size)
        if (
            checksum != xxhash.xxh3_64_intdigest(fixed)
            or fmt < 1
            or header_size < SEGMENT_HEADER_SIZE
            or header_size % ALIGN
        ):
            raise RecordingError(f"{where}recording header is corrupt (checksum or fields do not match)")
        if wire_version != VERSION:
            raise RecordingError(
                f"{where}recorded with wire contract version {wire_version}; this kvguard speaks "
                f"version {VERSION}: use a kvguard of that contract version to replay it"
            )
        return cls(fmt, wire_version, rt, mono, rec_id, index, header_size)


def encode_chunk(data: bytes, count: int, flags: int = 0) -> bytes:
    """One chunk: its header (``count`` records, ``flags``, xxh3-64 of header and data), then ``data``."""
    fixed = CHUNK_FIXED.pack(CHUNK_MAGIC, len(data), count, flags, 0)
    h = xxhash.xxh3_64()
    h.update(fixed)
    h.update(data)
    return fixed + struct.pack("<Q", h.intdigest()) + data

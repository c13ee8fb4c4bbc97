"""The recording segment format (docs/recording-api.md): segment header, chunks, recordings-only records.

Recordings hold wire records exactly as ``encode`` lays them out, so their bytes belong to
the same contract: ``kvguard.sidecar.recorder`` writes and reads segment files with what is
here, and ``kvguard replay`` feeds the decoded records to the detection pipeline. Besides
the framing (``SegmentHeader``, ``encode_chunk``), this module holds the re-encoding of a
decoded record (``encode_record``) and the records that never cross the wire: LOST markers
and the sidecar's own events, with their chunk decoder (``decode_chunk``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from .decode import decode_stream, read_header
from .encode import (
    assign_payload,
    content_changed_payload,
    coverage_payload,
    encode,
    engine_part_payload,
    forward_payload,
    guard_payload,
    heartbeat_payload,
    hello_payload,
    kv_digest_payload,
    kv_load_payload,
    kv_store_payload,
    page_identity_payload,
    pages_payload,
    pool_payload,
    probe_error_payload,
    reject_payload,
    req_begin_payload,
    req_end_payload,
    req_scope_payload,
    tier1_violation_payload,
    xfer_digest_payload,
    xfer_done_payload,
    xfer_reserve_payload,
    xfer_send_payload,
)
from .layout import ALIGN, HEADER_SIZE, MAX_RECORD_BYTES, VERSION, Kind
from .types import DecodeStats, Record, SidecarEvent

# Segment files (docs/recording-api.md; written and read by kvguard.sidecar.recorder):
#   segment header (64 bytes: magic, format version, wire contract version, clocks, ids, checksum)
#   chunk*         (24-byte chunk header: magic, length, record count, flags, xxh3-64) + records
# The records in a chunk are wire records as ``encode`` lays them out, plus LOST markers
# (kind LOST, u64 count: never on the wire) and the sidecar's own events (kinds 0xF0..0xF3).
# Version 2 added the OPTIONS event (0xF3); version 1 recordings are still read (no options:
# replay then uses its defaults and flags).
FORMAT_VERSION = 2
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
# the live sidecar's settings that change verdicts (a JSON object, UTF-8), at the start of
# every segment (in its CARRIED chunk) and wherever they change: replay uses them
KIND_OPTIONS = 0xF3
MAX_OPTIONS_BYTES = 4096
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
    Kind.GUARD: guard_payload,
    Kind.REQ_SCOPE: req_scope_payload,
    Kind.ENGINE_PART: engine_part_payload,
    Kind.KV_DIGEST: kv_digest_payload,
    Kind.COVERAGE: coverage_payload,
    Kind.POOL: pool_payload,
    Kind.PAGE_IDENTITY: page_identity_payload,
    Kind.CONTENT_CHANGED: content_changed_payload,
    Kind.KV_STORE: kv_store_payload,
    Kind.KV_LOAD: kv_load_payload,
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
        if rec.kind == "options":
            return options_record(rec.ts_ns, rec.options or {})
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


def options_record(ts_ns: int, options: dict) -> bytes:
    """The OPTIONS event: ``options`` as a JSON object (keys sorted), at most 4 KiB."""
    if not isinstance(options, dict):
        raise ValueError(f"options must be a dict, got {type(options).__name__}")
    payload = json.dumps(options, sort_keys=True, separators=(",", ":")).encode()
    if len(payload) > MAX_OPTIONS_BYTES:
        raise ValueError(f"options take {len(payload)} bytes, more than {MAX_OPTIONS_BYTES}")
    return encode(KIND_OPTIONS, 0, ts_ns, 0, payload)


def _decode_options(view, pos: int, length: int) -> dict | None:
    try:
        # the record is padded with NULs to a multiple of 8 bytes; JSON text has none
        got = json.loads(bytes(view[pos + HEADER_SIZE : pos + length]).rstrip(b"\0").decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return got if isinstance(got, dict) else None


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
        elif kind == KIND_OPTIONS and version == VERSION:
            if run < pos:
                out += decode_stream(view, stats, run, pos)
            options = _decode_options(view, pos, length) if length <= HEADER_SIZE + MAX_OPTIONS_BYTES else None
            if options is not None:
                stats.records += 1
                out.append(SidecarEvent("options", ts_ns, engine_id, 0, options))
            else:
                stats.bad_payload += 1
                stats.last_error = f"options event: {length} bytes that are not a JSON object"
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

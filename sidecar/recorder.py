"""Recordings: the record stream in segment files, the API to write them, and the reader.

``docs/recording-api.md`` describes the format byte by byte and the API with a runnable
example; this module is its executable form. In short, a segment file is::

    segment header (64 bytes: magic, format version, wire contract version, clocks, ids, checksum)
    chunk*         (24-byte chunk header: magic, length, record count, flags, xxh3-64) + records

and the records inside a chunk are wire records exactly as ``engine_hooks.wire.encode``
lays them out (each carries its ``engine_id``), plus LOST markers encoded as wire records
of kind ``LOST`` with an 8-byte payload (recordings only: never on the wire). The first
chunk of a rotated segment is flagged ``CARRIED``: the last HELLO of each engine,
re-emitted so that every segment can be replayed on its own.

Writers:

* ``RecordingWriter(path)``: one segment file, for tests, benchmarks and third parties;
  ``.engine(engine_id)`` gives a ``RingWriter`` look-alike for ``engine_hooks.probes.Probes``.
* ``Recorder(directory, max_bytes=..., max_age_s=...)``: rotating segments bounded by size
  and age, for the sidecar (``Sidecar(recorder=...)`` records every batch before applying it).
  It never raises once constructed: a full disk costs recordings, never detection.

Reader: ``SegmentReader(path)`` validates the header (``RecordingError`` with a clear
message otherwise) and yields ``(record, carried)`` pairs, counting (never raising on)
corrupt chunks, truncated tails and bad records.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from kvguard.engine_hooks import wire

log = logging.getLogger("kvguard.recorder")

FORMAT_VERSION = 1
SEGMENT_MAGIC = b"KVGRSEG\0"
# magic, format_version, header_size, wire_version, created_realtime_ns, created_monotonic_ns,
# recording_id, segment_index; then the xxh3-64 of these 56 bytes
_SEGMENT_FIXED = struct.Struct("<8sHHB3xQQQI12x")
SEGMENT_HEADER_SIZE = _SEGMENT_FIXED.size + 8  # 64
CHUNK_MAGIC = b"KVGC"
_CHUNK_FIXED = struct.Struct("<4sIIHH")  # magic, data_length, record_count, flags, reserved; then xxh3-64
CHUNK_HEADER_SIZE = _CHUNK_FIXED.size + 8  # 24
CHUNK_CARRIED = 0x0001  # chunk flags: context re-emitted at the start of a segment, not new events
CHUNK_TARGET_BYTES = 1 << 20  # records are grouped into chunks of about this size (one record may exceed it)
MAX_CHUNK_DATA = wire.MAX_RECORD_BYTES + CHUNK_TARGET_BYTES  # anything larger is corrupt by definition
LOST_PAYLOAD = struct.Struct("<Q")  # the body of a recorded LOST marker: records missing (>= 1)
LOST_RECORD_BYTES = wire.HEADER_SIZE + LOST_PAYLOAD.size  # 40
# Record kinds 0xF0..0xFF are reserved for recordings (never on the wire): sidecar-side events that
# change detection state without a record, so replay can apply them at the same point in the stream.
KIND_ENGINE_GONE = 0xF0  # the engine's ring was retired (Pipeline.on_engine_gone(engine_id, ts_ns))
KIND_TICK = 0xF1  # Pipeline.tick(ts_ns): time-based incident resolution
KIND_GAP = 0xF2  # the recorder itself failed to record ``count`` records here (u64 payload)
SIDECAR_EVENTS = {KIND_ENGINE_GONE: "engine_gone", KIND_TICK: "tick", KIND_GAP: "gap"}
_EVENT_PAYLOAD = {KIND_ENGINE_GONE: 0, KIND_TICK: 0, KIND_GAP: 8}

SEGMENT_SUFFIX = ".kvgrec"
OPEN_SUFFIX = ".kvgrec.open"  # the segment a Recorder is writing; renamed to .kvgrec when closed
_SEGMENT_NAME = re.compile(r"^kvguard-.*\.kvgrec(\.open)?$")

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_SEGMENT_AGE_S = 600.0
MIN_SEGMENT_BYTES = 64 << 10
MAX_SEGMENT_BYTES = 64 << 20
MAX_CARRIED_ENGINES = 256
RETRY_AFTER_ERROR_S = 1.0

assert SEGMENT_HEADER_SIZE == 64 and CHUNK_HEADER_SIZE == 24


class RecordingError(RuntimeError):
    """A file this reader will not read (missing, not a recording, newer format); the message says why."""


# --------------------------------------------------------------------------- records <-> bytes
_PAYLOADS = {
    wire.Kind.HELLO: wire.hello_payload,
    wire.Kind.REQ_BEGIN: wire.req_begin_payload,
    wire.Kind.REQ_END: wire.req_end_payload,
    wire.Kind.ALLOC: lambda b: wire.pages_payload(b.pages, b.free_kind),
    wire.Kind.FREE: lambda b: wire.pages_payload(b.pages, b.free_kind),
    wire.Kind.ASSIGN: wire.assign_payload,
    wire.Kind.FORWARD: wire.forward_payload,
    wire.Kind.XFER_RESERVE: wire.xfer_reserve_payload,
    wire.Kind.XFER_SEND: wire.xfer_send_payload,
    wire.Kind.XFER_DONE: wire.xfer_done_payload,
    wire.Kind.XFER_DIGEST: wire.xfer_digest_payload,
    wire.Kind.TIER1_VIOLATION: wire.tier1_violation_payload,
    wire.Kind.REJECT: wire.reject_payload,
    wire.Kind.HEARTBEAT: wire.heartbeat_payload,
    wire.Kind.PROBE_ERROR: wire.probe_error_payload,
    wire.Kind.LOST: lambda count: LOST_PAYLOAD.pack(int(count)),
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
    return wire.encode(rec.kind, rec.seq, rec.ts_ns, rec.engine_id, _PAYLOADS[rec.kind](rec.body), rec.pool)


def lost_record(engine_id: int, first_seq: int, count: int, ts_ns: int) -> bytes:
    """A LOST marker as recordings store it: ``count`` records from ``first_seq`` on are missing."""
    if count < 1:
        raise ValueError(f"a LOST marker covers at least one record, got {count}")
    return wire.encode(wire.Kind.LOST, first_seq, ts_ns, engine_id, LOST_PAYLOAD.pack(count))


@dataclass(slots=True, frozen=True)
class SidecarEvent:
    """A recordings-only event of the sidecar itself: ``kind`` is "engine_gone", "tick" or "gap"
    (``count`` records the recorder could not record)."""

    kind: str
    ts_ns: int
    engine_id: int = 0
    count: int = 0


_EVENT_KINDS = {name: kind for kind, name in SIDECAR_EVENTS.items()}


def sidecar_event_record(kind: int, ts_ns: int, engine_id: int = 0, count: int | None = None) -> bytes:
    return wire.encode(kind, 0, ts_ns, engine_id, b"" if count is None else LOST_PAYLOAD.pack(count))


def decode_chunk(data, stats: wire.DecodeStats) -> list:
    """Decode the records of one chunk; never raises (bad records are counted in ``stats``).

    Wire records go through ``wire.decode_stream``; LOST markers (not a wire kind) and
    sidecar events (``SidecarEvent``) are decoded here.
    """
    view = memoryview(data).cast("B")
    end = len(view)
    out: list[wire.Record] = []
    pos = run = 0
    while pos < end:
        head = wire.read_header(view, pos, end)
        if head is None:
            break  # decode_stream below counts the rest as corrupt
        _magic, version, kind, length, seq, ts_ns, engine_id, pool, _flags = head
        if kind == wire.Kind.LOST and version == wire.VERSION:
            if run < pos:
                out += wire.decode_stream(view, stats, run, pos)
            (count,) = LOST_PAYLOAD.unpack_from(view, pos + wire.HEADER_SIZE) if length == LOST_RECORD_BYTES else (0,)
            if count >= 1:
                stats.records += 1
                out.append(wire.Record(wire.Kind.LOST, seq, ts_ns, engine_id, pool, count))
            else:
                stats.bad_payload += 1
                stats.last_error = f"LOST seq {seq}: length {length}, count {count}"
            run = pos + length
        elif kind in SIDECAR_EVENTS and version == wire.VERSION:
            if run < pos:
                out += wire.decode_stream(view, stats, run, pos)
            want = wire.HEADER_SIZE + _EVENT_PAYLOAD[kind]
            if length == want:
                count = LOST_PAYLOAD.unpack_from(view, pos + wire.HEADER_SIZE)[0] if _EVENT_PAYLOAD[kind] else 0
                stats.records += 1
                out.append(SidecarEvent(SIDECAR_EVENTS[kind], ts_ns, engine_id, count))
            else:
                stats.bad_payload += 1
                stats.last_error = f"{SIDECAR_EVENTS[kind]} event: length {length}, expected {want}"
            run = pos + length
        pos += length
    if run < end:
        out += wire.decode_stream(view, stats, run, end)
    return out


# --------------------------------------------------------------------------- headers
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
        fixed = _SEGMENT_FIXED.pack(
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
        fixed = bytes(raw[: _SEGMENT_FIXED.size])
        _magic, fmt, header_size, wire_version, rt, mono, rec_id, index = _SEGMENT_FIXED.unpack(fixed)
        if fmt > FORMAT_VERSION:
            raise RecordingError(
                f"{where}recording format version {fmt} is newer than this kvguard reads "
                f"({FORMAT_VERSION}): upgrade kvguard to replay it"
            )
        (checksum,) = struct.unpack_from("<Q", raw, _SEGMENT_FIXED.size)
        if (
            checksum != xxhash.xxh3_64_intdigest(fixed)
            or fmt < 1
            or header_size < SEGMENT_HEADER_SIZE
            or header_size % wire.ALIGN
        ):
            raise RecordingError(f"{where}recording header is corrupt (checksum or fields do not match)")
        if wire_version != wire.VERSION:
            raise RecordingError(
                f"{where}recorded with wire contract version {wire_version}; this kvguard speaks "
                f"version {wire.VERSION}: use a kvguard of that contract version to replay it"
            )
        return cls(fmt, wire_version, rt, mono, rec_id, index, header_size)


def _chunk(data: bytes, count: int, flags: int = 0) -> bytes:
    fixed = _CHUNK_FIXED.pack(CHUNK_MAGIC, len(data), count, flags, 0)
    h = xxhash.xxh3_64()
    h.update(fixed)
    h.update(data)
    return fixed + struct.pack("<Q", h.intdigest()) + data


def segment_name(created_realtime_ns: int, recording_id: int, index: int) -> str:
    """``kvguard-<UTC time>-<recording id>-<index>.kvgrec``: names sort in recording order."""
    secs, ns = divmod(created_realtime_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs))
    return f"kvguard-{stamp}.{ns // 1000:06d}Z-{recording_id:016x}-{index:06d}{SEGMENT_SUFFIX}"


def is_segment_name(name: str) -> bool:
    return bool(_SEGMENT_NAME.match(name))


# --------------------------------------------------------------------------- writing
@dataclass
class RecorderStats:
    records_recorded: int = 0
    bytes_written: int = 0
    segments_opened: int = 0
    segments_deleted: int = 0
    write_errors: int = 0  # I/O failures (the records of that batch are not in the recording)
    records_not_recorded: int = 0  # records lost to write errors or encode errors
    encode_errors: int = 0
    last_error: str = ""


class EngineWriter:
    """One engine's stream into a recording: looks like ``engine_hooks.ring.RingWriter``.

    ``write(kind, payload, pool=0, flags=0) -> bool`` stamps the next sequence number,
    ``CLOCK_MONOTONIC`` (or the writer's clock) and this ``engine_id``; it never raises.
    ``drop(n)`` simulates a full ring: it spends ``n`` sequence numbers and records the
    LOST marker a ring reader would have inserted.
    """

    def __init__(self, owner: _Writer, engine_id: int):
        self._owner = owner
        self.engine_id = engine_id
        self.records_written = 0
        self.dropped_records = 0

    @property
    def path(self) -> str:
        return self._owner.path

    def write(self, kind: wire.Kind, payload: bytes, pool: int = 0, flags: int = 0) -> bool:
        try:
            self._owner.write_record(kind, payload, engine_id=self.engine_id, pool=pool, flags=flags)
        except Exception as exc:  # noqa: BLE001 - the RingWriter contract: never raise into the engine
            self.dropped_records += 1
            self._owner._note_error(f"engine {self.engine_id}: {type(exc).__name__}: {exc}")
            return False
        self.records_written += 1
        return True

    def write_sticky(self, kind: wire.Kind, payload: bytes) -> bool:
        """``RingWriter.write_sticky``: a ring keeps a copy for late consumers; a recording
        carries HELLOs over at every rotation instead, so this is ``write``."""
        return self.write(kind, payload)

    def drop(self, count: int = 1) -> None:
        self._owner.write_lost(self.engine_id, count)
        self.dropped_records += count

    def close(self, unlink: bool = False) -> None:  # RingWriter compatibility; the recording stays open
        pass


class _Writer:
    """What both writers share: the raw-record API, sequence numbers, HELLO carry-over."""

    path: str

    def __init__(self, clock_ns=time.monotonic_ns, wall_clock_ns=time.time_ns):
        self._clock = clock_ns
        self._wall = wall_clock_ns
        self._lock = threading.RLock()
        self._next_seq: dict[int, int] = {}
        self._hellos: OrderedDict[int, bytes] = OrderedDict()  # engine_id -> last HELLO, most recent last
        self.stats = RecorderStats()
        self.recording_id = int.from_bytes(os.urandom(8), "little")
        self._pending_tick: int | None = None

    # -------------------------------------------------------------- public API
    def write_record(
        self,
        kind: wire.Kind,
        payload: bytes,
        *,
        engine_id: int,
        ts_ns: int | None = None,
        seq: int | None = None,
        pool: int = 0,
        flags: int = 0,
    ) -> None:
        """Append one wire record. ``seq`` defaults to the engine's next sequence number,
        ``ts_ns`` to the writer's clock (``CLOCK_MONOTONIC``)."""
        kind = wire.Kind(kind)
        if kind in (wire.Kind.PAD, wire.Kind.LOST):
            raise ValueError(f"{kind.name} is not written with write_record (use write_lost for LOST)")
        with self._lock:
            seq = self._next_seq.get(engine_id, 0) if seq is None else int(seq)
            ts_ns = self._clock() if ts_ns is None else int(ts_ns)
            self._add(wire.encode(kind, seq, ts_ns, engine_id, bytes(payload), pool, flags), kind, engine_id, seq + 1)

    def write_lost(self, engine_id: int, count: int, *, seq: int | None = None, ts_ns: int | None = None) -> None:
        """Record that ``count`` records of this engine are missing from ``seq`` on (a blind window)."""
        with self._lock:
            seq = self._next_seq.get(engine_id, 0) if seq is None else int(seq)
            ts_ns = self._clock() if ts_ns is None else int(ts_ns)
            self._add(lost_record(engine_id, seq, count, ts_ns), wire.Kind.LOST, engine_id, seq + count)

    def record_tick(self, now_ns: int) -> None:
        """The sidecar called ``Pipeline.tick(now_ns)``. Ticks with no record after them are
        coalesced into the last one (a tick that resolves nothing changes nothing)."""
        with self._lock:
            self._pending_tick = int(now_ns)

    def record_engine_gone(self, engine_id: int, ts_ns: int) -> None:
        """The sidecar called ``Pipeline.on_engine_gone(engine_id, ts_ns)`` (the engine's ring was retired)."""
        with self._lock:
            self._flush_tick()
            self._append(sidecar_event_record(KIND_ENGINE_GONE, int(ts_ns), engine_id))

    def _flush_tick(self) -> None:
        if self._pending_tick is not None:
            tick, self._pending_tick = self._pending_tick, None
            self._append(sidecar_event_record(KIND_TICK, tick))

    def engine(self, engine_id: int | None = None) -> EngineWriter:
        """A ``RingWriter`` look-alike for one engine; ``Probes(recording.engine(1))`` writes into the file."""
        if engine_id is None:
            engine_id = (max(self._next_seq, default=0) + 1) & 0xFFFFFFFF
        with self._lock:
            self._next_seq.setdefault(engine_id, 0)
        return EngineWriter(self, engine_id)

    def record_batch(self, records) -> None:
        """Append decoded records (``wire.Record``, LOST markers included), in order, as one batch.
        ``SidecarEvent``s are accepted too, so what a ``SegmentReader`` yields can be written back."""
        records = records if isinstance(records, list) else list(records)
        with self._lock:
            for rec in records:
                try:
                    raw = encode_record(rec)
                except Exception as exc:  # noqa: BLE001 - one odd record must not cost the batch
                    self.stats.encode_errors += 1
                    self._unencodable()
                    self._note_error(
                        f"cannot encode {getattr(rec, 'kind', '?')} seq {getattr(rec, 'seq', '?')}: "
                        f"{type(exc).__name__}: {exc}"
                    )
                    continue
                if isinstance(rec, SidecarEvent):
                    self._flush_tick()
                    self._append(raw)
                    continue
                nxt = rec.seq + (rec.body if rec.kind == wire.Kind.LOST else 1)
                self._add(raw, rec.kind, rec.engine_id, nxt)
            for engine_id in {rec.engine_id for rec in records}:
                if engine_id in self._hellos:
                    self._hellos.move_to_end(engine_id)
            self.flush()

    # -------------------------------------------------------------- internals
    def _add(self, raw: bytes, kind: int, engine_id: int, next_seq: int) -> None:
        self._next_seq[engine_id] = next_seq
        self._flush_tick()
        self._append(raw)  # first: a segment this record opens must not carry the record itself
        if kind == wire.Kind.HELLO:
            self._hellos[engine_id] = raw
            self._hellos.move_to_end(engine_id)
            while len(self._hellos) > MAX_CARRIED_ENGINES:
                self._hellos.popitem(last=False)

    def _append(self, raw: bytes) -> None:
        raise NotImplementedError

    def _unencodable(self) -> None:
        self.stats.records_not_recorded += 1

    def flush(self) -> None:
        raise NotImplementedError

    def _note_error(self, message: str) -> None:
        self.stats.last_error = message

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class _Segment:
    """One open segment file: header written at creation, chunks appended."""

    def __init__(self, path: str, header: SegmentHeader, exclusive: bool = True):
        self.path = path
        self.header = header
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        fd = os.open(path, flags, 0o644)
        self.file = os.fdopen(fd, "wb", buffering=1 << 20)
        raw = header.pack()
        self.file.write(raw)
        self.size = len(raw)
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.records = 0  # records of its own (not carried)

    def add_chunk(self, records: list[bytes], flags: int = 0) -> int:
        data = b"".join(records)
        chunk = _chunk(data, len(records), flags)
        self.file.write(chunk)
        self.size += len(chunk)
        return len(chunk)

    def flush_pending(self) -> int:
        if not self.pending:
            return 0
        written = self.add_chunk(self.pending)
        self.pending, self.pending_bytes = [], 0
        return written

    def projected(self, extra: int) -> int:
        return self.size + CHUNK_HEADER_SIZE + self.pending_bytes + extra


class RecordingWriter(_Writer):
    """One segment file at ``path``, no rotation: the API for tests, benchmarks and third parties.

    ``RecordingWriter(path)`` creates the file (refuses to overwrite unless
    ``overwrite=True``) and writes the header at once, so a bad path fails here.
    Records are buffered into chunks of about 1 MiB; ``flush()`` makes everything so
    far readable, ``close()`` (or leaving a ``with`` block) finishes the file.
    Unlike the sidecar's ``Recorder``, I/O errors raise (``EngineWriter.write`` turns
    them into ``False`` for probes).
    """

    def __init__(self, path, *, overwrite: bool = False, clock_ns=time.monotonic_ns, wall_clock_ns=time.time_ns):
        super().__init__(clock_ns, wall_clock_ns)
        self.path = os.fspath(path)
        header = SegmentHeader(FORMAT_VERSION, wire.VERSION, wall_clock_ns(), clock_ns(), self.recording_id, 0)
        self._segment: _Segment | None = _Segment(self.path, header, exclusive=not overwrite)
        self.stats.segments_opened = 1
        self.stats.bytes_written = SEGMENT_HEADER_SIZE

    @property
    def records_written(self) -> int:
        return self.stats.records_recorded

    def _append(self, raw: bytes) -> None:
        seg = self._segment
        if seg is None:
            raise ValueError(f"{self.path}: recording is closed")
        if seg.pending and seg.pending_bytes + len(raw) > CHUNK_TARGET_BYTES:
            self.stats.bytes_written += seg.flush_pending()
        seg.pending.append(raw)
        seg.pending_bytes += len(raw)
        seg.records += 1
        self.stats.records_recorded += 1

    def flush(self) -> None:
        with self._lock:
            if self._segment is not None:
                self.stats.bytes_written += self._segment.flush_pending()
                self._segment.file.flush()

    def close(self) -> None:
        with self._lock:
            if self._segment is None:
                return
            self._flush_tick()
            self.flush()
            self._segment.file.close()
            self._segment = None


@dataclass(slots=True)
class _Closed:
    path: str
    size: int
    mtime_ns: int


class Recorder(_Writer):
    """Rotating segments in ``directory`` for the sidecar, bounded by size and by age.

    Disk budget (retention), applied before each new segment is opened and every few
    seconds: at most ``max_bytes`` in all (the open segment included), at most
    ``max_segments`` files, and no closed segment older than ``max_age_s``; the oldest
    go first. Only this format's files (``kvguard-*.kvgrec``) are ever deleted; one
    recorder per directory.

    Rotation: a segment is closed when the next record would take it past
    ``segment_bytes`` (default ``max_bytes / 8``, clamped to 64 KiB .. 64 MiB) or once it
    is ``segment_age_s`` old (default ``max_age_s / 8``, at most 10 minutes) and holds
    records; idle time never creates files. A new segment starts with the last HELLO of
    every recently active engine (a ``CARRIED`` chunk), so each segment replays alone.

    After construction nothing raises: an I/O error is logged once per streak, counted in
    ``stats``, the batch is not recorded (replay reports the gap) and writing resumes in
    a fresh segment at most once a second.
    """

    def __init__(
        self,
        directory,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float | None = None,
        max_segments: int | None = None,
        segment_bytes: int | None = None,
        segment_age_s: float | None = None,
        clock_ns=time.monotonic_ns,
        wall_clock_ns=time.time_ns,
    ):
        super().__init__(clock_ns, wall_clock_ns)
        self.directory = self.path = os.fspath(directory)
        if segment_bytes is None:
            segment_bytes = min(max(max_bytes // 8, MIN_SEGMENT_BYTES), MAX_SEGMENT_BYTES)
        if segment_age_s is None:
            segment_age_s = DEFAULT_SEGMENT_AGE_S if max_age_s is None else min(max_age_s / 8, DEFAULT_SEGMENT_AGE_S)
        problems = []
        if segment_bytes < 4096:
            problems.append(f"segment size {segment_bytes} bytes is below 4096")
        if max_bytes < segment_bytes:
            problems.append(
                f"max_bytes {max_bytes} is smaller than one segment ({segment_bytes} bytes); "
                f"allow at least {max(MIN_SEGMENT_BYTES, segment_bytes)} bytes"
            )
        if max_age_s is not None and max_age_s <= 0:
            problems.append(f"max_age_s must be > 0, got {max_age_s}")
        if segment_age_s <= 0:
            problems.append(f"segment_age_s must be > 0, got {segment_age_s}")
        if max_segments is not None and max_segments < 1:
            problems.append(f"max_segments must be >= 1, got {max_segments}")
        if problems:
            raise ValueError("; ".join(problems))
        self.max_bytes, self.max_age_s, self.max_segments = int(max_bytes), max_age_s, max_segments
        self.segment_bytes, self.segment_age_s = int(segment_bytes), float(segment_age_s)
        try:
            os.makedirs(self.directory, exist_ok=True)
            probe = os.path.join(self.directory, f".kvguard-write-test-{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
        except OSError as exc:
            raise RecordingError(f"recording directory {self.directory} is not writable: {exc}") from exc
        self._closed: list[_Closed] = self._scan()  # oldest first
        self._segment: _Segment | None = None
        self._opened_at_ns = 0
        self._index = 0
        self._retry_at_ns = 0
        self._failing = False
        self._next_retention_ns = 0
        self._closed_flag = False
        self._gap = 0  # records not recorded since the last GAP marker

    # -------------------------------------------------------------- directory
    def _scan(self) -> list[_Closed]:
        """Segments already in the directory (earlier runs): leftovers of a crash are closed now."""
        found = []
        for name in sorted(os.listdir(self.directory)):
            if not is_segment_name(name):
                continue
            path = os.path.join(self.directory, name)
            if name.endswith(OPEN_SUFFIX):
                final = path[: -len(".open")]
                try:
                    os.rename(path, final)
                    log.warning("recording segment %s was left open (sidecar crash?); closed as %s", path, final)
                    path = final
                except OSError:
                    pass
            try:
                st = os.stat(path)
            except OSError:
                continue
            found.append(_Closed(path, st.st_size, st.st_mtime_ns))
        return found

    @property
    def segments(self) -> list[str]:
        """Paths of the segments in recording order (oldest first), the open one last."""
        with self._lock:
            out = [c.path for c in self._closed]
            if self._segment is not None:
                out.append(self._segment.path)
            return out

    def disk_bytes(self) -> int:
        with self._lock:
            return sum(c.size for c in self._closed) + (self._segment.size if self._segment else 0)

    def _retention(self, room_for_new: bool) -> None:
        """Delete the oldest closed segments until the budget (leaving room for one more segment) holds."""
        now_wall = self._wall()
        budget = self.max_bytes - (self.segment_bytes if room_for_new else (self._segment.size if self._segment else 0))
        max_closed = None
        if self.max_segments is not None:
            max_closed = self.max_segments - (1 if (room_for_new or self._segment is not None) else 0)
        total = sum(c.size for c in self._closed)
        while self._closed:
            oldest = self._closed[0]
            too_old = self.max_age_s is not None and now_wall - oldest.mtime_ns > self.max_age_s * 1e9
            if not (total > budget or (max_closed is not None and len(self._closed) > max_closed) or too_old):
                break
            self._closed.pop(0)
            total -= oldest.size
            try:
                os.unlink(oldest.path)
                self.stats.segments_deleted += 1
            except FileNotFoundError:
                pass
            except OSError as exc:
                self._note_error(f"cannot delete old segment {oldest.path}: {exc}")

    # -------------------------------------------------------------- segments
    def _open(self) -> _Segment | None:
        now = self._clock()
        if now < self._retry_at_ns:
            return None
        try:
            self._retention(room_for_new=True)
            header = SegmentHeader(FORMAT_VERSION, wire.VERSION, self._wall(), now, self.recording_id, self._index)
            path = os.path.join(
                self.directory,
                segment_name(header.created_realtime_ns, self.recording_id, self._index)[: -len(SEGMENT_SUFFIX)]
                + OPEN_SUFFIX,
            )
            seg = _Segment(path, header)
            if self._hellos:
                seg.add_chunk(list(self._hellos.values()), CHUNK_CARRIED)
            seg.file.flush()
        except OSError as exc:
            self._io_error(f"cannot open a recording segment in {self.directory}: {exc}")
            return None
        self._index += 1
        self._segment, self._opened_at_ns = seg, now
        self.stats.segments_opened += 1
        self.stats.bytes_written += seg.size
        if self._failing:
            log.warning("recording resumed in %s", path)
            self._failing = False
        return seg

    def _close_segment(self, after_error: bool = False) -> None:
        seg, self._segment = self._segment, None
        if seg is None:
            return
        final = seg.path[: -len(".open")]
        if not after_error:
            try:
                count = len(seg.pending)
                self.stats.bytes_written += seg.flush_pending()
                self.stats.records_recorded += count
                seg.file.flush()
                os.fsync(seg.file.fileno())
            except OSError as exc:
                self._not_recorded(len(seg.pending))
                self._io_error(f"cannot finish segment {seg.path}: {exc}")
        try:
            seg.file.close()
        except OSError:
            pass
        try:
            os.rename(seg.path, final)
        except OSError:
            final = seg.path
        try:
            st = os.stat(final)
            self._closed.append(_Closed(final, st.st_size, st.st_mtime_ns))
        except OSError:
            pass

    @property
    def failing(self) -> bool:
        """True from a failed write (a full disk, a lost mount) until a segment opens again:
        records are not being recorded (kvguard_recording_failing)."""
        return self._failing

    def _unencodable(self) -> None:
        self._not_recorded(1)

    def _not_recorded(self, count: int) -> None:
        """``count`` records will be missing here: the next segment data starts with a GAP marker."""
        self.stats.records_not_recorded += count
        self._gap += count

    def _io_error(self, message: str) -> None:
        self.stats.write_errors += 1
        self._note_error(message)
        self._retry_at_ns = self._clock() + int(RETRY_AFTER_ERROR_S * 1e9)
        if not self._failing:
            log.error(
                "kvguard recording: %s; detection goes on, records are not recorded until writing works "
                "again (retrying at most once a second)",
                message,
            )
            self._failing = True

    def _append(self, raw: bytes) -> None:
        seg = self._segment
        if seg is not None and seg.records and seg.projected(len(raw)) > self.segment_bytes:
            self._close_segment()
            seg = None
        if seg is None:
            seg = self._open()
            if seg is None:
                self._not_recorded(1)
                return
        if self._gap:  # say where the recording has a hole, before the next record
            marker = sidecar_event_record(KIND_GAP, self._clock(), count=self._gap)
            self._gap = 0
            seg.pending.append(marker)
            seg.pending_bytes += len(marker)
            seg.records += 1
        if seg.pending and seg.pending_bytes + len(raw) > CHUNK_TARGET_BYTES:
            self._write_pending(seg)
        seg.pending.append(raw)
        seg.pending_bytes += len(raw)
        seg.records += 1

    def _write_pending(self, seg: _Segment) -> None:
        count = len(seg.pending)
        try:
            self.stats.bytes_written += seg.flush_pending()
            self.stats.records_recorded += count
        except OSError as exc:
            seg.pending, seg.pending_bytes = [], 0
            self._not_recorded(count)
            self._io_error(f"cannot write to {seg.path}: {exc}")
            self._close_segment(after_error=True)

    def maintain(self) -> None:
        """Age-based rotation and retention; ``record_batch`` calls it on every sidecar poll."""
        with self._lock:
            now = self._clock()
            seg = self._segment
            if seg is not None and seg.records and now - self._opened_at_ns >= self.segment_age_s * 1e9:
                self._close_segment()
            if now >= self._next_retention_ns:
                self._next_retention_ns = now + 5_000_000_000
                self._retention(room_for_new=False)

    def record_batch(self, records) -> None:
        """Record one batch of decoded records before the pipeline applies them. Never raises."""
        try:
            with self._lock:
                if self._closed_flag:
                    return
                self.maintain()
                if records:
                    super().record_batch(records)
        except Exception as exc:  # noqa: BLE001 - recording must never cost detection
            self._unexpected(exc)

    def record_tick(self, now_ns: int) -> None:
        """See ``_Writer.record_tick``. Never raises."""
        if not self._closed_flag:
            super().record_tick(now_ns)

    def record_engine_gone(self, engine_id: int, ts_ns: int) -> None:
        """See ``_Writer.record_engine_gone``. Never raises."""
        try:
            with self._lock:
                if not self._closed_flag:
                    super().record_engine_gone(engine_id, ts_ns)
        except Exception as exc:  # noqa: BLE001 - recording must never cost detection
            self._unexpected(exc)

    def _unexpected(self, exc: BaseException) -> None:
        self.stats.write_errors += 1
        self._note_error(f"recording failed: {type(exc).__name__}: {exc}")
        log.exception("kvguard recording failed")

    def flush(self) -> None:
        with self._lock:
            seg = self._segment
            if seg is None:
                return
            if seg.pending:
                self._write_pending(seg)
            seg = self._segment
            if seg is not None:
                try:
                    seg.file.flush()
                except OSError as exc:
                    self._io_error(f"cannot write to {seg.path}: {exc}")
                    self._close_segment(after_error=True)

    def close(self) -> None:
        """Finish the open segment (flush, fsync, rename to .kvgrec). Idempotent."""
        with self._lock:
            if self._closed_flag:
                return
            self._closed_flag = True
            try:
                self._flush_tick()
            except Exception as exc:  # noqa: BLE001
                self._note_error(f"recording failed: {type(exc).__name__}: {exc}")
            self.flush()
            self._close_segment()


# --------------------------------------------------------------------------- reading
@dataclass
class ReadStats:
    chunks: int = 0
    corrupt_chunks: int = 0  # chunks whose checksum or header did not hold (their records are skipped)
    corrupt_bytes: int = 0  # bytes skipped while looking for the next valid chunk
    truncated_bytes: int = 0  # an unfinished last chunk (crash mid-write, or a segment still being written)
    decode: wire.DecodeStats = field(default_factory=wire.DecodeStats)  # bad records inside good chunks
    problems: list = field(default_factory=list)


class SegmentReader:
    """Read one segment file. The constructor validates the header (``RecordingError``);
    iterating yields ``(record, carried)`` and never raises on bad bytes after that."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(SEGMENT_HEADER_SIZE)
                self.header = SegmentHeader.unpack(raw, self.path)
                self._mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        except FileNotFoundError as exc:
            raise RecordingError(f"{self.path}: no such file") from exc
        except IsADirectoryError as exc:
            raise RecordingError(f"{self.path}: is a directory") from exc
        except (OSError, ValueError) as exc:
            raise RecordingError(f"{self.path}: cannot read: {exc}") from exc
        self.size = size
        self.stats = ReadStats()

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _problem(self, message: str) -> None:
        if len(self.stats.problems) < 100:
            self.stats.problems.append(f"{self.path}: {message}")

    def _chunk_at(self, pos: int):
        """(flags, data, end) of a valid chunk at ``pos``; 'short' if it runs past the end; None if invalid."""
        mm = self._mm
        if self.size - pos < CHUNK_HEADER_SIZE:
            n = min(len(CHUNK_MAGIC), self.size - pos)
            return "short" if mm[pos : pos + n] == CHUNK_MAGIC[:n] else None
        magic, length, _count, flags, _reserved = _CHUNK_FIXED.unpack_from(mm, pos)
        if magic != CHUNK_MAGIC or length % wire.ALIGN or length > MAX_CHUNK_DATA:
            return None
        end = pos + CHUNK_HEADER_SIZE + length
        if end > self.size:
            return "short"
        (checksum,) = struct.unpack_from("<Q", mm, pos + _CHUNK_FIXED.size)
        h = xxhash.xxh3_64()
        h.update(mm[pos : pos + _CHUNK_FIXED.size])
        data = mm[pos + CHUNK_HEADER_SIZE : end]
        h.update(data)
        if h.intdigest() != checksum:
            return None
        return flags, data, end

    def _resync(self, pos: int) -> int | None:
        """The next valid chunk at an 8-aligned position after ``pos``, or None."""
        base = self.header.header_size % wire.ALIGN
        pos += 1
        while True:
            pos = self._mm.find(CHUNK_MAGIC, pos)
            if pos < 0:
                return None
            if (pos - base) % wire.ALIGN == 0 and isinstance(self._chunk_at(pos), tuple):
                return pos
            pos += 1

    def chunks(self):
        """Yield ``(flags, data)`` of every valid chunk; count and skip the rest."""
        if self._mm is None:
            return
        pos = self.header.header_size
        while pos < self.size:
            got = self._chunk_at(pos)
            if isinstance(got, tuple):
                flags, data, pos = got
                self.stats.chunks += 1
                yield flags, data
                continue
            nxt = self._resync(pos)
            if nxt is None:
                if got == "short":
                    self.stats.truncated_bytes += self.size - pos
                    self._problem(
                        f"last {self.size - pos} bytes are an unfinished chunk (writer stopped "
                        f"mid-write, or the segment is still being written)"
                    )
                else:
                    self.stats.corrupt_chunks += 1
                    self.stats.corrupt_bytes += self.size - pos
                    self._problem(f"corrupt data from byte {pos} to the end ({self.size - pos} bytes skipped)")
                return
            self.stats.corrupt_chunks += 1
            self.stats.corrupt_bytes += nxt - pos
            self._problem(f"corrupt chunk at byte {pos}: {nxt - pos} bytes skipped, resumed at byte {nxt}")
            pos = nxt

    def __iter__(self):
        d = self.stats.decode
        for flags, data in self.chunks():
            carried = bool(flags & CHUNK_CARRIED)
            before = d.unknown_kind + d.bad_version + d.bad_payload + d.corrupt_bytes
            records = decode_chunk(data, d)
            if d.unknown_kind + d.bad_version + d.bad_payload + d.corrupt_bytes != before:
                self._problem(f"bad record(s) in an intact chunk, skipped; last: {d.last_error or 'unknown kind'}")
            for rec in records:
                yield rec, carried


# --------------------------------------------------------------------------- CLI value parsers
class BadValue(ValueError, argparse.ArgumentTypeError):
    """A flag value that does not parse (argparse prints the message as is)."""


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_bytes(value: str) -> int:
    """``1073741824``, ``512M``, ``1G`` (binary units) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise BadValue(f"not a size: {value!r} (examples: 1073741824, 512M, 4G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_seconds(value: str) -> float:
    """``3600``, ``90s``, ``30m``, ``24h``, ``7d`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise BadValue(f"not a duration: {value!r} (examples: 3600, 90s, 30m, 24h, 7d)")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if seconds <= 0:
        raise BadValue(f"duration must be > 0, got {value!r}")
    return seconds

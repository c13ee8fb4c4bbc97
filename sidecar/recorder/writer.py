"""The writers' shared core and ``RecordingWriter`` (one segment file, no rotation).

``RecordingWriter(path)`` is for tests, benchmarks and third parties;
``.engine(engine_id)`` gives an ``EngineWriter``, a ``RingWriter`` look-alike for
``engine_hooks.probes.Probes``. The sidecar's rotating ``Recorder`` (rotating.py)
shares ``_Writer``: the raw-record API, sequence numbers and HELLO carry-over.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.wire import (
    CHUNK_TARGET_BYTES,
    FORMAT_VERSION,
    KIND_ENGINE_GONE,
    KIND_TICK,
    SEGMENT_HEADER_SIZE,
    SegmentHeader,
    SidecarEvent,
    encode_record,
    lost_record,
    options_record,
    sidecar_event_record,
)

from .format import _Segment

MAX_CARRIED_ENGINES = 256
# records carried over with an engine's HELLO (contract 1.5), at most this many per engine
CARRIED_WITH_HELLO = (wire.Kind.COVERAGE, wire.Kind.POOL)
MAX_CARRIED_PER_ENGINE = 16


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

    def write_batch(self, kind: wire.Kind, payloads, pool: int = 0) -> int:
        """``RingWriter.write_batch``: several records of one kind with one timestamp (each
        its own record and seq); returns how many were recorded. Probes that write in
        batches (``decode_rows_assigned``) need it."""
        try:
            with self._owner._lock:
                ts_ns = self._owner._clock()
                written = 0
                for payload in payloads:
                    written += self._write_at(kind, payload, ts_ns, pool)
                return written
        except Exception as exc:  # noqa: BLE001 - the RingWriter contract: never raise into the engine
            self._owner._note_error(f"engine {self.engine_id}: {type(exc).__name__}: {exc}")
            return 0

    def _write_at(self, kind, payload: bytes, ts_ns: int, pool: int = 0) -> bool:
        try:
            self._owner.write_record(kind, payload, engine_id=self.engine_id, ts_ns=ts_ns, pool=pool)
        except Exception as exc:  # noqa: BLE001
            self.dropped_records += 1
            self._owner._note_error(f"engine {self.engine_id}: {type(exc).__name__}: {exc}")
            return False
        self.records_written += 1
        return True

    def write_sticky(self, kind: wire.Kind, payload: bytes, pool: int = 0, append: bool = False) -> bool:
        """``RingWriter.write_sticky``: a ring keeps a copy for late consumers; a recording
        carries HELLOs (with their COVERAGE and POOL records) over at every rotation
        instead, so this is ``write``."""
        return self.write(kind, payload, pool)

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
        # engine_id -> its last HELLO (or ENGINE_PART) and the COVERAGE / POOL records sent after
        # it, most recent engine last: what a new segment starts with
        self._hellos: OrderedDict[int, list[bytes]] = OrderedDict()
        self.stats = RecorderStats()
        self.recording_id = int.from_bytes(os.urandom(8), "little")
        self._pending_tick: int | None = None
        self._options: bytes | None = None  # the OPTIONS event every segment starts with

    def set_options(self, options: dict) -> None:
        """The settings of the sidecar being recorded that change its verdicts (its pipeline's
        ``verdict_options()``): an OPTIONS event here, and at the start of every later
        segment, so that ``kvguard replay`` judges the recording as the live sidecar did."""
        with self._lock:
            self._options = options_record(self._clock(), dict(options))
            self._options_changed(self._options)

    def _options_changed(self, raw: bytes) -> None:
        self._flush_tick()
        self._append(raw)

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
        # (the ring reader's AssignRuns are recorded as the records they stand for)
        records = list(wire.expand_runs(records))
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
        if kind == wire.Kind.HELLO or kind == wire.Kind.ENGINE_PART:  # a part's identity, as a HELLO
            self._hellos[engine_id] = [raw]
            self._hellos.move_to_end(engine_id)
            while len(self._hellos) > MAX_CARRIED_ENGINES:
                self._hellos.popitem(last=False)
        elif kind in CARRIED_WITH_HELLO and engine_id in self._hellos:  # what the engine said about itself
            carried = self._hellos[engine_id]
            if len(carried) < MAX_CARRIED_PER_ENGINE:
                carried.append(raw)

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

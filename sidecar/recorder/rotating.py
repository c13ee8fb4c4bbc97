"""``Recorder``: the sidecar's rotating segments, bounded by size and by age (retention).

It never raises once constructed: a full disk costs recordings, never detection.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.wire import (
    CHUNK_CARRIED,
    CHUNK_TARGET_BYTES,
    FORMAT_VERSION,
    KIND_GAP,
    RecordingError,
    SegmentHeader,
    sidecar_event_record,
)

from .format import OPEN_SUFFIX, SEGMENT_SUFFIX, _Segment, is_segment_name, segment_name
from .writer import _Writer

log = logging.getLogger("kvguard.recorder")

DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_SEGMENT_AGE_S = 600.0
MIN_SEGMENT_BYTES = 64 << 10
MAX_SEGMENT_BYTES = 64 << 20
RETRY_AFTER_ERROR_S = 1.0


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
            carried = [self._options] if self._options is not None else []
            for engine_records in self._hellos.values():
                carried += engine_records
            if carried:
                seg.add_chunk(carried, CHUNK_CARRIED)
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

    def _options_changed(self, raw: bytes) -> None:
        """Into the open segment, if any; every segment opened from now on starts with them."""
        if self._segment is not None:
            self._flush_tick()
            self._append(raw)

    def set_options(self, options: dict) -> None:
        """See ``_Writer.set_options``. Never raises (a bad value is logged and not recorded)."""
        try:
            super().set_options(options)
        except Exception as exc:  # noqa: BLE001 - recording must never cost detection
            self._unexpected(exc)

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

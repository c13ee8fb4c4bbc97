"""``SegmentReader``: read one segment file, counting (never raising on) damage.

The constructor validates the header (``RecordingError`` with a clear message
otherwise); iterating yields ``(record, carried)`` pairs and counts corrupt chunks,
truncated tails and bad records in ``stats``.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field

import xxhash

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.wire import (
    CHUNK_CARRIED,
    CHUNK_FIXED,
    CHUNK_HEADER_SIZE,
    CHUNK_MAGIC,
    MAX_CHUNK_DATA,
    SEGMENT_HEADER_SIZE,
    RecordingError,
    SegmentHeader,
    decode_chunk,
)


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
                self._mm: mmap.mmap | None = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
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
        assert mm is not None  # (chunks() reads only an open segment)
        if self.size - pos < CHUNK_HEADER_SIZE:
            n = min(len(CHUNK_MAGIC), self.size - pos)
            return "short" if mm[pos : pos + n] == CHUNK_MAGIC[:n] else None
        magic, length, _count, flags, _reserved = CHUNK_FIXED.unpack_from(mm, pos)
        if magic != CHUNK_MAGIC or length % wire.ALIGN or length > MAX_CHUNK_DATA:
            return None
        end = pos + CHUNK_HEADER_SIZE + length
        if end > self.size:
            return "short"
        (checksum,) = struct.unpack_from("<Q", mm, pos + CHUNK_FIXED.size)
        h = xxhash.xxh3_64()
        h.update(mm[pos : pos + CHUNK_FIXED.size])
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
            pos = self._mm.find(CHUNK_MAGIC, pos) if self._mm is not None else -1
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

"""Segment files on disk: their names, and one open segment being written.

The bytes of a segment (header, chunk framing, the recordings-only record kinds) are
defined in the contract module, ``kvguard.engine_hooks.wire`` (``wire/recording.py``), and
described in ``docs/recording-api.md``; this module only puts them in files.
"""

from __future__ import annotations

import os
import re
import time

from kvguard.engine_hooks.wire import CHUNK_HEADER_SIZE, SegmentHeader, encode_chunk

SEGMENT_SUFFIX = ".kvgrec"
OPEN_SUFFIX = ".kvgrec.open"  # the segment a Recorder is writing; renamed to .kvgrec when closed
_SEGMENT_NAME = re.compile(r"^kvguard-.*\.kvgrec(\.open)?$")


def segment_name(created_realtime_ns: int, recording_id: int, index: int) -> str:
    """``kvguard-<UTC time>-<recording id>-<index>.kvgrec``: names sort in recording order."""
    secs, ns = divmod(created_realtime_ns, 1_000_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs))
    return f"kvguard-{stamp}.{ns // 1000:06d}Z-{recording_id:016x}-{index:06d}{SEGMENT_SUFFIX}"


def is_segment_name(name: str) -> bool:
    return bool(_SEGMENT_NAME.match(name))


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
        chunk = encode_chunk(data, len(records), flags)
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

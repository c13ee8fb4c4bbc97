"""Recordings: the record stream in segment files, the API to write them, and the reader.

``docs/recording-api.md`` describes the format byte by byte and the API with a runnable
example. The bytes are defined in the contract module, ``kvguard.engine_hooks.wire``
(its ``recording.py``: segment header, chunk framing, LOST markers and the sidecar's own
events, kinds 0xF0..0xF2, beside the record layouts); this package writes and reads the files:

* ``writer.py``: ``RecordingWriter(path)``, one segment file, for tests, benchmarks and
  third parties; ``.engine(engine_id)`` gives an ``EngineWriter``, a ``RingWriter``
  look-alike for ``engine_hooks.probes.Probes``.
* ``rotating.py``: ``Recorder(directory, max_bytes=..., max_age_s=...)``, rotating
  segments bounded by size and age, for the sidecar (``Sidecar(recorder=...)`` records
  every batch before applying it). It never raises once constructed: a full disk costs
  recordings, never detection.
* ``reader.py``: ``SegmentReader(path)`` validates the header (``RecordingError`` with a
  clear message otherwise) and yields ``(record, carried)`` pairs, counting (never
  raising on) corrupt chunks, truncated tails and bad records.
* ``format.py``: segment file names and the open segment being written;
  ``flags.py``: the parsers of the recording flags' values.

Every name below is importable from ``kvguard.sidecar.recorder``, as before the split.
"""

from kvguard.engine_hooks.wire import (
    CHUNK_CARRIED,
    CHUNK_HEADER_SIZE,
    CHUNK_MAGIC,
    CHUNK_TARGET_BYTES,
    FORMAT_VERSION,
    KIND_ENGINE_GONE,
    KIND_GAP,
    KIND_TICK,
    LOST_PAYLOAD,
    LOST_RECORD_BYTES,
    MAX_CHUNK_DATA,
    SEGMENT_HEADER_SIZE,
    SEGMENT_MAGIC,
    SIDECAR_EVENTS,
    RecordingError,
    SegmentHeader,
    SidecarEvent,
    decode_chunk,
    encode_record,
    lost_record,
    sidecar_event_record,
)
from kvguard.engine_hooks.wire import encode_chunk as _chunk  # noqa: F401 - the tests' name for wire.encode_chunk

from .flags import BadValue, parse_bytes, parse_seconds
from .format import OPEN_SUFFIX, SEGMENT_SUFFIX, _Segment, is_segment_name, segment_name  # noqa: F401 - _Segment: tests patch it
from .reader import ReadStats, SegmentReader
from .rotating import (
    DEFAULT_MAX_BYTES,
    DEFAULT_SEGMENT_AGE_S,
    MAX_SEGMENT_BYTES,
    MIN_SEGMENT_BYTES,
    RETRY_AFTER_ERROR_S,
    Recorder,
)
from .writer import MAX_CARRIED_ENGINES, EngineWriter, RecorderStats, RecordingWriter

__all__ = [
    "CHUNK_CARRIED",
    "CHUNK_HEADER_SIZE",
    "CHUNK_MAGIC",
    "CHUNK_TARGET_BYTES",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_SEGMENT_AGE_S",
    "FORMAT_VERSION",
    "KIND_ENGINE_GONE",
    "KIND_GAP",
    "KIND_TICK",
    "LOST_PAYLOAD",
    "LOST_RECORD_BYTES",
    "MAX_CARRIED_ENGINES",
    "MAX_CHUNK_DATA",
    "MAX_SEGMENT_BYTES",
    "MIN_SEGMENT_BYTES",
    "OPEN_SUFFIX",
    "RETRY_AFTER_ERROR_S",
    "SEGMENT_HEADER_SIZE",
    "SEGMENT_MAGIC",
    "SEGMENT_SUFFIX",
    "SIDECAR_EVENTS",
    "BadValue",
    "EngineWriter",
    "ReadStats",
    "Recorder",
    "RecorderStats",
    "RecordingError",
    "RecordingWriter",
    "SegmentHeader",
    "SegmentReader",
    "SidecarEvent",
    "decode_chunk",
    "encode_record",
    "is_segment_name",
    "lost_record",
    "parse_bytes",
    "parse_seconds",
    "segment_name",
    "sidecar_event_record",
]

"""The kvguard wire contract, version 1: record layouts shared by engine and sidecar.

Every record is a fixed 32-byte little-endian header followed by a typed payload,
padded with zero bytes to a multiple of 8. ``docs/wire-format.md`` describes the
bytes in prose; this package is the executable form of that document, and of the
recording segment format of ``docs/recording-api.md``. It is one contract, imported as
one name: ``from kvguard.engine_hooks import wire`` and ``wire.X`` (or
``from kvguard.engine_hooks.wire import X``) for every name below. Nothing else in
the tree defines bytes; ``ring.py`` frames these records in its shared-memory ring.

The package is split by concern only to keep each file readable:

- ``layout.py``: the header (``HEADER``, its table of fields), ``Kind`` and the other
  enums, every payload's fixed struct and flag bits, ``request_key``.
- ``types.py``: the decoded forms of records (``Hello``, ``Forward``, ``Record``,
  ``DecodeStats``, ...), dataclasses.
- ``encode.py``: ``encode`` and the ``*_payload`` encoders the engine's probes call.
- ``decode.py``: ``read_header``, ``decode_stream`` and the payload decoders.
- ``recording.py``: segment header, chunk framing, the recordings-only records (LOST
  markers, sidecar events) and ``encode_record`` / ``decode_chunk``.

Nothing private crosses this contract: page ids, counts, digests, request ids and
tenant labels only; never token ids, text or KV bytes.

Request ids are carried once, in REQ_BEGIN; every other record names the request by
its 64-bit key (``request_key(rid)``: xxh3-64 of the UTF-8 rid), so hot records
carry 8 bytes, not strings. The same rid gives the same key on prefill and decode.
"""

from __future__ import annotations

from .decode import DecodeError, decode_stream, read_header
from .encode import (
    assign_payload,
    encode,
    forward_payload,
    guard_payload,
    heartbeat_payload,
    hello_payload,
    pages_payload,
    probe_error_payload,
    reject_payload,
    req_begin_payload,
    req_end_payload,
    tier1_violation_payload,
    xfer_digest_payload,
    xfer_done_payload,
    xfer_reserve_payload,
    xfer_send_payload,
)
from .layout import (
    ALIGN,
    ASSIGN_FIXED,
    FORWARD_FIXED,
    FWD_HAS_ROWS,
    GUARD_FIXED,
    HEADER,
    HEADER_SIZE,
    HEARTBEAT_FIXED,
    HELLO_FIXED,
    MAGIC,
    MAX_RECORD_BYTES,
    MAX_STRING_BYTES,
    NO_ROOM,
    PAGES_FIXED,
    PROBE_ERROR_FIXED,
    REJECT_FIXED,
    REQ_BEGIN_FIXED,
    REQ_END_FIXED,
    REQ_END_REPREFILLED,
    REQ_WARMUP,
    TIER1_FIXED,
    VERSION,
    XFER_DIGEST_FIXED,
    XFER_DONE_FIXED,
    XFER_RESERVE_FIXED,
    XFER_SEND_FIXED,
    DigestAlg,
    Finish,
    FreeKind,
    GuardAction,
    GuardRule,
    Kind,
    Phase,
    Role,
    Side,
    Tier1Tag,
    XferStatus,
    request_key,
)
from .recording import (
    CHUNK_CARRIED,
    CHUNK_FIXED,
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
    SEGMENT_FIXED,
    SEGMENT_HEADER_SIZE,
    SEGMENT_MAGIC,
    SIDECAR_EVENTS,
    RecordingError,
    SegmentHeader,
    decode_chunk,
    encode_chunk,
    encode_record,
    lost_record,
    sidecar_event_record,
)
from .types import (
    Assign,
    DecodeStats,
    Forward,
    Guard,
    Heartbeat,
    Hello,
    Pages,
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

# The contract: every public name of the submodules. A name added to one of them is
# added here too, so that ``wire.X`` stays the one way to reach it.
__all__ = [
    # layout.py
    "ALIGN",
    "ASSIGN_FIXED",
    "FORWARD_FIXED",
    "FWD_HAS_ROWS",
    "HEADER",
    "HEADER_SIZE",
    "HEARTBEAT_FIXED",
    "HELLO_FIXED",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "MAX_STRING_BYTES",
    "NO_ROOM",
    "PAGES_FIXED",
    "PROBE_ERROR_FIXED",
    "GUARD_FIXED",
    "REJECT_FIXED",
    "REQ_BEGIN_FIXED",
    "REQ_END_FIXED",
    "REQ_END_REPREFILLED",
    "REQ_WARMUP",
    "TIER1_FIXED",
    "VERSION",
    "XFER_DIGEST_FIXED",
    "XFER_DONE_FIXED",
    "XFER_RESERVE_FIXED",
    "XFER_SEND_FIXED",
    "DigestAlg",
    "Finish",
    "FreeKind",
    "Kind",
    "Phase",
    "Role",
    "Side",
    "Tier1Tag",
    "XferStatus",
    "request_key",
    # types.py
    "Assign",
    "DecodeStats",
    "Forward",
    "Heartbeat",
    "Hello",
    "Pages",
    "ProbeError",
    "Record",
    "Guard",
    "GuardAction",
    "GuardRule",
    "Reject",
    "ReqBegin",
    "ReqEnd",
    "SidecarEvent",
    "Tier1Violation",
    "XferDigest",
    "XferDone",
    "XferReserve",
    "XferSend",
    # encode.py
    "encode",
    "assign_payload",
    "forward_payload",
    "heartbeat_payload",
    "hello_payload",
    "pages_payload",
    "probe_error_payload",
    "guard_payload",
    "reject_payload",
    "req_begin_payload",
    "req_end_payload",
    "tier1_violation_payload",
    "xfer_digest_payload",
    "xfer_done_payload",
    "xfer_reserve_payload",
    "xfer_send_payload",
    # decode.py
    "DecodeError",
    "decode_stream",
    "read_header",
    # recording.py
    "CHUNK_CARRIED",
    "CHUNK_FIXED",
    "CHUNK_HEADER_SIZE",
    "CHUNK_MAGIC",
    "CHUNK_TARGET_BYTES",
    "FORMAT_VERSION",
    "KIND_ENGINE_GONE",
    "KIND_GAP",
    "KIND_TICK",
    "LOST_PAYLOAD",
    "LOST_RECORD_BYTES",
    "MAX_CHUNK_DATA",
    "SEGMENT_FIXED",
    "SEGMENT_HEADER_SIZE",
    "SEGMENT_MAGIC",
    "SIDECAR_EVENTS",
    "RecordingError",
    "SegmentHeader",
    "decode_chunk",
    "encode_chunk",
    "encode_record",
    "lost_record",
    "sidecar_event_record",
]

"""Record encoding: ``encode`` frames one record, the ``*_payload`` functions lay out each kind.

The engine's probes (``engine_hooks/probes.py``) call these once per hook, the FORWARD
encoder once per forward step: they stay plain module-level functions over the structs
of ``layout.py``, with no dispatch in between (``wire.forward_payload`` is this module's
function, re-exported). Decoding is ``decode.py``; the re-encoding of decoded records and
the recordings-only records are in ``recording.py``.
"""

from __future__ import annotations

import struct

import numpy as np

from .layout import (
    ALIGN,
    ASSIGN_FIXED,
    CONTENT_CHANGED_FIXED,
    COVERAGE_FIXED,
    COVERAGE_ITEM,
    ENGINE_PART_FIXED,
    FORWARD_FIXED,
    FWD_HAS_ROWS,
    GUARD_FIXED,
    HEADER,
    HEADER_SIZE,
    HEARTBEAT_FIXED,
    HELLO_FIXED,
    KV_DIGEST_FIXED,
    KV_LOAD_FIXED,
    KV_STORE_FIXED,
    MAGIC,
    MAX_COVERAGE_ITEMS,
    MAX_STRING_BYTES,
    PAGE_IDENTITY_FIXED,
    PAGES_FIXED,
    POOL_FIXED,
    POOL_SHARES_PAGES,
    PROBE_ERROR_FIXED,
    REJECT_FIXED,
    REQ_BEGIN_FIXED,
    REQ_END_FIXED,
    REQ_END_REPREFILLED,
    REQ_SCOPE_FIXED,
    REQ_WARMUP,
    TIER1_FIXED,
    VERSION,
    XFER_DIGEST_FIXED,
    XFER_DONE_FIXED,
    XFER_RESERVE_FIXED,
    XFER_SEND_FIXED,
    FreeKind,
)
from .types import (
    Assign,
    ContentChanged,
    Coverage,
    EnginePart,
    Forward,
    Guard,
    Heartbeat,
    Hello,
    KvDigest,
    KvLoad,
    KvStore,
    PageIdentity,
    PoolInfo,
    ProbeError,
    Reject,
    ReqBegin,
    ReqEnd,
    ReqScope,
    Tier1Violation,
    XferDigest,
    XferDone,
    XferReserve,
    XferSend,
)


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


def guard_payload(g: Guard) -> bytes:
    return GUARD_FIXED.pack(
        g.req_key, g.room, int(g.rule), int(g.action), g.prompt_tokens, g.send_tokens, g.reserved_pages
    ) + _str_bytes(g.reason)


def kv_store_payload(s: KvStore) -> bytes:
    pages = np.ascontiguousarray(s.pages, dtype="<i4")
    return KV_STORE_FIXED.pack(s.req_key, s.object_key, s.digest, s.scope, len(pages)) + pages.tobytes()


def kv_load_payload(x: KvLoad) -> bytes:
    pages = np.ascontiguousarray(x.pages, dtype="<i4")
    fixed = KV_LOAD_FIXED.pack(x.req_key, x.object_key, x.digest, x.scope, len(pages), int(x.phase))
    return fixed + pages.tobytes()


def kv_digest_payload(d: KvDigest) -> bytes:
    return KV_DIGEST_FIXED.pack(d.req_key, d.object_key, d.digest, int(d.side))


def content_changed_payload(c: ContentChanged) -> bytes:
    pages = np.ascontiguousarray(c.pages, dtype="<i4")
    return CONTENT_CHANGED_FIXED.pack(int(c.slots_changed), len(pages)) + pages.tobytes()


def req_scope_payload(r: ReqScope) -> bytes:
    return REQ_SCOPE_FIXED.pack(r.req_key, r.scope)


def engine_part_payload(p: EnginePart) -> bytes:
    return ENGINE_PART_FIXED.pack(int(p.primary_pid), int(p.rank), int(p.part))


def coverage_payload(c: Coverage) -> bytes:
    items = c.items
    if len(items) > MAX_COVERAGE_ITEMS:
        raise ValueError(f"{len(items)} coverage items, at most {MAX_COVERAGE_ITEMS}")
    parts = [COVERAGE_FIXED.pack(len(items))]
    for item in items:
        parts.append(COVERAGE_ITEM.pack(int(item.status), int(item.watched) & 0xFF, int(item.missing) & 0xFF))
        parts.append(_str_bytes(item.component))
        parts.append(_str_bytes(item.detail))
    return b"".join(parts)


def pool_payload(p: PoolInfo) -> bytes:
    flags = POOL_SHARES_PAGES if p.shares_pages else 0
    fixed = POOL_FIXED.pack(int(p.page_size), int(p.pool_pages), int(p.window_tokens), int(p.kind), flags)
    return fixed + _str_bytes(p.name)


def page_identity_payload(p: PageIdentity) -> bytes:
    ids = np.ascontiguousarray(p.ids, dtype="<u8")
    return PAGE_IDENTITY_FIXED.pack(p.req_key, int(p.first_row_page), len(ids), int(p.phase)) + ids.tobytes()


def heartbeat_payload(h: Heartbeat) -> bytes:
    return HEARTBEAT_FIXED.pack(h.records_written, h.records_dropped, h.probe_errors)


def probe_error_payload(p: ProbeError) -> bytes:
    return PROBE_ERROR_FIXED.pack(p.count) + _str_bytes(p.probe) + _str_bytes(p.error)

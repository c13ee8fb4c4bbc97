"""Record decoding: ``read_header`` validates one header, ``decode_stream`` decodes a run of records.

The ring reader (``engine_hooks/ring.py``, driven by the sidecar's ingest) decodes with
these, and so does ``recording.py``'s chunk decoder. ``decode_stream`` never raises on bad
bytes: it counts them in ``DecodeStats``. The payload decoders read through ``_Cursor``,
which bounds-checks every read against the record's declared length. The layouts are
``layout.py``'s; the decoded forms are ``types.py``'s.
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
    MAX_RECORD_BYTES,
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
    CoverageStatus,
    DigestAlg,
    Finish,
    FreeKind,
    GuardAction,
    GuardRule,
    IdentityPhase,
    Kind,
    LoadPhase,
    PartRole,
    Phase,
    PoolKind,
    Role,
    Side,
    Tier1Tag,
    TierSide,
    XferStatus,
)
from .types import (
    Assign,
    AssignRun,
    ContentChanged,
    Coverage,
    CoverageItem,
    DecodeStats,
    EnginePart,
    Forward,
    Guard,
    Heartbeat,
    Hello,
    KvDigest,
    KvLoad,
    KvStore,
    PageIdentity,
    Pages,
    PoolInfo,
    ProbeError,
    Record,
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


class DecodeError(ValueError):
    """A record whose payload does not fit its declared layout."""


# (a dict lookup: ``np.dtype(name)`` and calling an enum per record cost ~0.5 us each, and a
# decode step brings a few records per request batch)
_ITEMSIZE = {name: np.dtype(name).itemsize for name in ("<u1", "<u2", "<u4", "<u8", "<i4", "<i8", "<f4", "<f8", "u1")}


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
        itemsize = _ITEMSIZE[dtype]
        start = self.take(count * itemsize)
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).copy()

    def view(self, dtype: str, count: int) -> np.ndarray:
        """``array`` without the copy: a read-only view of the record's bytes, which it keeps
        alive (for the one field that is a whole batch's rows, compared and dropped)."""
        start = self.take(count * _ITEMSIZE[dtype])
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start)

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
    return Pages(c.array("<i4", count), _FREE_KINDS.get(free_kind) or FreeKind(free_kind))


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
        # (read-only: half a megabyte per decode step of batch 256 x 32k context, copied for nothing)
        read_pages = c.view("<i4", n_read)
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


def _decode_guard(c: _Cursor) -> Guard:
    key, room, rule, action, prompt_tokens, send_tokens, reserved_pages = c.fixed(GUARD_FIXED)
    try:
        rule, action = GuardRule(rule), GuardAction(action)
    except ValueError as exc:
        raise DecodeError(f"GUARD {exc}") from None
    return Guard(key, room, rule, action, prompt_tokens, send_tokens, reserved_pages, c.string())


def _decode_kv_store(c: _Cursor) -> KvStore:
    key, obj, digest, scope, count = c.fixed(KV_STORE_FIXED)
    return KvStore(key, obj, digest, scope, c.array("<i4", count))


def _decode_kv_load(c: _Cursor) -> KvLoad:
    key, obj, digest, scope, count, phase = c.fixed(KV_LOAD_FIXED)
    try:
        load_phase = LoadPhase(phase)
    except ValueError:
        raise DecodeError(f"KV_LOAD phase {phase} unknown") from None
    return KvLoad(key, obj, digest, scope, load_phase, c.array("<i4", count))


def _decode_kv_digest(c: _Cursor) -> KvDigest:
    key, obj, digest, side = c.fixed(KV_DIGEST_FIXED)
    try:
        tier_side = TierSide(side)
    except ValueError:
        raise DecodeError(f"KV_DIGEST side {side} unknown") from None
    return KvDigest(key, obj, digest, tier_side)


def _decode_content_changed(c: _Cursor) -> ContentChanged:
    slots_changed, count = c.fixed(CONTENT_CHANGED_FIXED)
    return ContentChanged(slots_changed, c.array("<i4", count))


def _decode_req_scope(c: _Cursor) -> ReqScope:
    return ReqScope(*c.fixed(REQ_SCOPE_FIXED))


def _decode_engine_part(c: _Cursor) -> EnginePart:
    primary_pid, rank, part = c.fixed(ENGINE_PART_FIXED)
    try:
        role = PartRole(part)
    except ValueError:
        raise DecodeError(f"ENGINE_PART part {part} unknown") from None
    return EnginePart(primary_pid, role, rank)


def _decode_coverage(c: _Cursor) -> Coverage:
    (count,) = c.fixed(COVERAGE_FIXED)
    if count > MAX_COVERAGE_ITEMS:
        raise DecodeError(f"COVERAGE of {count} items exceeds {MAX_COVERAGE_ITEMS}")
    items = []
    for _ in range(count):
        status, watched, missing = c.fixed(COVERAGE_ITEM)
        try:
            coverage_status = CoverageStatus(status)
        except ValueError:
            raise DecodeError(f"COVERAGE status {status} unknown") from None
        items.append(CoverageItem(c.string(), coverage_status, watched, missing, c.string()))
    return Coverage(items)


def _decode_pool(c: _Cursor) -> PoolInfo:
    page_size, pool_pages, window_tokens, kind, flags = c.fixed(POOL_FIXED)
    try:
        pool_kind = PoolKind(kind)
    except ValueError:
        raise DecodeError(f"POOL kind {kind} unknown") from None
    if page_size < 1:
        raise DecodeError(f"POOL page_size {page_size}")
    return PoolInfo(page_size, pool_pages, window_tokens, pool_kind, c.string(), bool(flags & POOL_SHARES_PAGES))


def _decode_page_identity(c: _Cursor) -> PageIdentity:
    key, first, count, phase = c.fixed(PAGE_IDENTITY_FIXED)
    try:
        identity_phase = IdentityPhase(phase)
    except ValueError:
        raise DecodeError(f"PAGE_IDENTITY phase {phase} unknown") from None
    if first + count > 1 << 32:
        raise DecodeError(f"PAGE_IDENTITY row pages [{first}, {first + count}) past 2**32")
    return PageIdentity(key, first, identity_phase, c.array("<u8", count))


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
    Kind.GUARD: _decode_guard,
    Kind.REQ_SCOPE: _decode_req_scope,
    Kind.CONTENT_CHANGED: _decode_content_changed,
    Kind.KV_STORE: _decode_kv_store,
    Kind.KV_LOAD: _decode_kv_load,
    Kind.ENGINE_PART: _decode_engine_part,
    Kind.KV_DIGEST: _decode_kv_digest,
    Kind.COVERAGE: _decode_coverage,
    Kind.POOL: _decode_pool,
    Kind.PAGE_IDENTITY: _decode_page_identity,
    Kind.HEARTBEAT: _decode_heartbeat,
    Kind.PROBE_ERROR: _decode_probe_error,
}


_KINDS = {k.value: k for k in Kind}
_FREE_KINDS = {k.value: k for k in FreeKind}


def read_header(buf, pos: int, end: int) -> tuple | None:
    """The header at ``pos`` if it is structurally valid (magic, length in bounds), else None."""
    if end - pos < HEADER_SIZE:
        return None
    head = HEADER.unpack_from(buf, pos)
    magic, _version, _kind, length = head[:4]
    if magic != MAGIC or length < HEADER_SIZE or length % ALIGN or length > end - pos or length > MAX_RECORD_BYTES:
        return None
    return head


# One-page ASSIGN records as a numpy structured row: header, ASSIGN_FIXED, the page, padding
# (60 bytes, padded to 64). ``decode_stream`` with ``runs`` decodes back-to-back ones as columns.
_ONE_PAGE_ASSIGN = np.dtype(
    [
        ("magic", "<u2"),
        ("version", "u1"),
        ("kind", "u1"),
        ("length", "<u4"),
        ("seq", "<u8"),
        ("ts_ns", "<u8"),
        ("engine_id", "<u4"),
        ("pool", "<u2"),
        ("flags", "<u2"),
        ("req_key", "<u8"),
        ("row_start", "<u4"),
        ("row_end", "<u4"),
        ("shared_until", "<u4"),
        ("count", "<u4"),
        ("page", "<i4"),
        ("pad", "<u4"),
    ]
)
_ONE_PAGE_ASSIGN_BYTES = _ONE_PAGE_ASSIGN.itemsize
assert _ONE_PAGE_ASSIGN_BYTES == (HEADER_SIZE + ASSIGN_FIXED.size + 4 + ALIGN - 1) & ~(ALIGN - 1) == 64
# word 0 of such a record (magic, version, kind, length), and the bits of word 3 that hold
# the engine id and pool (not the flags)
_ASSIGN_WORD0 = np.uint64(MAGIC | VERSION << 16 | int(Kind.ASSIGN) << 24 | _ONE_PAGE_ASSIGN_BYTES << 32)
_ENGINE_POOL_MASK = np.uint64((1 << 48) - 1)
assert _ONE_PAGE_ASSIGN.fields is not None and _ONE_PAGE_ASSIGN.fields["count"][1] == 52  # word 6's high half
# A run is worth its fixed cost (~20 numpy calls to decode, ~15 to apply) from about this many
# records on: a decode step's ASSIGN per request of a batch; the few ASSIGNs of requests that
# start a page come one by one
_RUN_MIN = 16
_RUN_MAX = 4096  # records at most in one run


def _assign_run(view: memoryview, pos: int, end: int, run_length=None) -> tuple[int, AssignRun] | None:
    """The run of back-to-back one-page ASSIGN records at ``pos`` (at least two), as columns,
    with the bytes it covers; None where there are fewer than ``_RUN_MIN``. A record joins the run only if it is
    exactly what ``_decode_assign`` would accept, of the same ring timeline (engine id, pool)
    and the next sequence number: anything else (a gap, another kind, a bad payload) ends the
    run and is decoded on its own, as without runs. ``run_length``: a compiled version of the
    length rules below (the sidecar's kernels, ``kvguard.sidecar.native``: the same probes and
    checks), called as ``run_length(view, pos, end, ASSIGN, word0, _RUN_MIN, _RUN_MAX)``."""
    if run_length is not None:
        n = run_length(view, pos, end, int(Kind.ASSIGN), int(_ASSIGN_WORD0), _RUN_MIN, _RUN_MAX)
        return None if n < _RUN_MIN else _run_columns(view, pos, n)
    avail = (end - pos) // _ONE_PAGE_ASSIGN_BYTES
    if avail < _RUN_MIN:
        return None
    # first, one header: is the record _RUN_MIN - 1 places on still one of them?
    last = pos + (_RUN_MIN - 1) * _ONE_PAGE_ASSIGN_BYTES
    head, probe = HEADER.unpack_from(view, pos), HEADER.unpack_from(view, last)
    if probe[2] != Kind.ASSIGN or probe[3] != _ONE_PAGE_ASSIGN_BYTES or probe[4] != head[4] + _RUN_MIN - 1:
        return None
    # then how far it may go: a header probe at 32, 64, 128, ... records on (one unpack each),
    # up to the first probe that is not the next record of the run; the records up to there are
    # checked as arrays (a decode step's run is followed by its FORWARD: checking 4096 records'
    # worth of the FORWARD's bytes cost more than the run)
    look = _RUN_MIN
    limit = min(avail, _RUN_MAX)
    while look < limit:
        nxt = min(2 * look, limit)
        probe = HEADER.unpack_from(view, pos + (nxt - 1) * _ONE_PAGE_ASSIGN_BYTES)
        look = nxt
        if probe[2] != Kind.ASSIGN or probe[3] != _ONE_PAGE_ASSIGN_BYTES or probe[4] != head[4] + nxt - 1:
            break  # the run ends before it
    first = np.frombuffer(view, "<u8", count=_ONE_PAGE_ASSIGN_BYTES // 8, offset=pos)
    a = np.frombuffer(view, _ONE_PAGE_ASSIGN, count=look, offset=pos)
    # the records as 8 words each: a few whole-word compares instead of one per field
    w = np.frombuffer(view, "<u8", count=look * (_ONE_PAGE_ASSIGN_BYTES // 8), offset=pos).reshape(look, -1)
    start, shared = a["row_start"], a["shared_until"]
    ok = (
        (w[:, 0] == _ASSIGN_WORD0)  # magic, version, kind, length
        & (w[:, 1] - first[1] == np.arange(look, dtype=np.uint64))  # the next sequence numbers
        & ((w[:, 3] ^ first[3]) & _ENGINE_POOL_MASK == 0)  # the same engine id and pool
        & (w[:, 6] >> np.uint64(32) == 1)  # one page
        & (start <= shared)
        & (shared <= a["row_end"])
    )
    n = look if ok.all() else int(np.argmin(ok))
    if n < _RUN_MIN:
        return None
    return _run_columns(view, pos, n)


def _run_columns(view: memoryview, pos: int, n: int) -> tuple[int, AssignRun]:
    """The run of ``n`` one-page ASSIGN records at ``pos`` as columns (copies), with its bytes."""
    a = np.frombuffer(view, _ONE_PAGE_ASSIGN, count=n, offset=pos)
    run = AssignRun(
        a["seq"].copy(),
        a["ts_ns"].copy(),
        a["req_key"].copy(),
        a["row_start"].copy(),
        a["row_end"].copy(),
        a["shared_until"].copy(),
        a["page"].copy(),
    )
    return n * _ONE_PAGE_ASSIGN_BYTES, run


def decode_stream(
    buf,
    stats: DecodeStats,
    start: int = 0,
    end: int | None = None,
    short_tail_ok: bool = False,
    runs: bool = False,
    run_length=None,
) -> list[Record]:
    """Decode back-to-back records from ``buf[start:end]``.

    Never raises on bad bytes. A record of another contract version or of an unknown
    kind is skipped by its length and counted; a record whose payload does not fit
    its layout is skipped and counted; bytes that do not start with a valid header
    are counted as corrupt and the rest of the buffer is skipped, because record
    boundaries can no longer be trusted. ``short_tail_ok``: the buffer ends at the end
    of a ring's data area, where fewer than 32 unused bytes are normal. ``runs``: 16 or
    more back-to-back one-page ASSIGN records come as one record with an ``AssignRun``
    body (the sidecar's ring reader; the same records, decoded as columns); ``run_length``, its
    compiled length rules (``_assign_run``).
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
        if runs and kind == Kind.ASSIGN and length == _ONE_PAGE_ASSIGN_BYTES:
            found = _assign_run(view, pos, end, run_length)
            if found is not None:
                size, run = found
                stats.records += len(run)
                out.append(Record(Kind.ASSIGN, seq, int(run.ts_ns[-1]), engine_id, pool, run))
                pos += size
                continue
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
                body = _DECODERS[kind](_Cursor(view, pos + HEADER_SIZE, record_end))
            except (DecodeError, ValueError, struct.error) as exc:
                stats.bad_payload += 1
                stats.last_error = f"{_KINDS[kind].name} seq {seq}: {exc}"
            else:
                stats.records += 1
                out.append(Record(_KINDS[kind], seq, ts_ns, engine_id, pool, body))
        pos = record_end
    return out

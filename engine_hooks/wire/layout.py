"""Record layouts of the wire contract: the header, the kinds, the enums and every payload struct.

This is the part of ``kvguard.engine_hooks.wire`` that both directions read: the encoders
(``encode.py``), the decoders (``decode.py``) and the recording format (``recording.py``)
all lay bytes out with the structs here, and ``ring.py`` frames records with ``HEADER``.
``docs/wire-format.md`` describes these bytes in prose.

Header (``HEADER``, 32 bytes)::

    off size field      meaning
      0   2  magic      0x4B47 ("GK" on the wire), constant
      2   1  version    contract version of the payload layout (1)
      3   1  kind       Kind below
      4   4  length     total record bytes, header + payload + padding, multiple of 8
      8   8  seq        per-ring sequence number; increments for every record the
                        producer *tried* to write, so dropped records leave a gap
     16   8  ts_ns      CLOCK_MONOTONIC nanoseconds when the probe fired
     24   4  engine_id  the producing ring's engine id (see ring.py)
     28   2  pool       KV pool index inside the engine (0 = the token KV pool)
     30   2  flags      kind-specific bits, 0 unless stated

Request ids are carried once, in REQ_BEGIN; every other record names the request by
its 64-bit key (``request_key(rid)``: xxh3-64 of the UTF-8 rid), so hot records
carry 8 bytes, not strings. The same rid gives the same key on prefill and decode.
"""

from __future__ import annotations

import enum
import struct

import xxhash

MAGIC = 0x4B47
VERSION = 1
# Kinds added since the payload layouts of version 1 were fixed, without changing any of them:
# a 1.0 reader skips them (counted in ``unknown_kind``), a 1.1 reader replays 1.0 streams as
# they were. 1: REQ_SCOPE, CONTENT_CHANGED, KV_STORE, KV_LOAD. 2: ENGINE_PART. 3: KV_DIGEST.
# 4: XFER_DIGEST alg 4 (block rows; a 1.3 reader counts such a record as one it cannot decode).
# 5: COVERAGE and POOL (an engine's model shape, what is watched, its pools besides pool 0).
# 6: PAGE_IDENTITY (the content identity of a request's full pages, KVGUARD_PAGE_IDENTITY).
# Carried in HELLO's kvguard_version string only for people, never needed to decode.
WIRE_MINOR = 6
HEADER = struct.Struct("<HBBIQQIHH")
HEADER_SIZE = HEADER.size
ALIGN = 8
NO_ROOM = (1 << 64) - 1  # bootstrap_room of a request that has none
MAX_STRING_BYTES = 256  # longer strings are truncated by the encoder
MAX_RECORD_BYTES = 1 << 26  # 64 MiB: anything longer is corrupt by definition

assert HEADER_SIZE == 32, HEADER_SIZE


class Kind(enum.IntEnum):
    PAD = 0  # ring filler up to the end of the data area; never decoded
    HELLO = 1
    REQ_BEGIN = 2
    REQ_END = 3
    ALLOC = 4
    ASSIGN = 5
    FORWARD = 6
    FREE = 7
    XFER_RESERVE = 8
    XFER_SEND = 9
    XFER_DONE = 10
    REJECT = 11
    HEARTBEAT = 12
    PROBE_ERROR = 13
    LOST = 14  # never on the wire: readers insert it at a sequence gap (body = records missing)
    XFER_DIGEST = 15  # digest of one end's KV for a transfer (sender: what it sent; receiver: what it reserved)
    TIER1_VIOLATION = 16  # the engine's own read check (engine_hooks/tier1.py) found a row page not the reader's
    GUARD = 17  # the guard (KVGUARD_GUARD, engine_hooks/sglang/guard.py) found a violation and what it did about it
    # contract 1.1 (WIRE_MINOR 1): a request's prefix-cache scope (cache salt / extra key), as a hash
    REQ_SCOPE = 18
    # contract 1.1: KV slots whose bytes changed with no hooked write (engine_hooks/content.py)
    CONTENT_CHANGED = 19
    # contract 1.1: KV copied from device pages to a host / storage object (HiCache, LMCache)
    KV_STORE = 20
    # contract 1.1: KV loaded from a host / storage object into device pages (issued, completed, failed)
    KV_LOAD = 21
    # contract 1.2 (WIRE_MINOR 2): this ring's process is one part of an engine whose bookkeeping
    # lives in another process (vLLM: the Worker's forwards, the EngineCore's pages); the sidecar
    # applies its records to that engine's timeline (docs/wire-format.md)
    ENGINE_PART = 22
    # contract 1.3 (WIRE_MINOR 3): the digest of a host / storage object's KV as stored from
    # or loaded into device pages, computed where the KV is (vLLM: the Worker) and joined to
    # the object's KV_STORE / KV_LOAD by object key
    KV_DIGEST = 23
    # contract 1.5 (WIRE_MINOR 5): what the adapter found in the engine (pools, KV cache groups,
    # state pools, draft models, KV dtype, parallel layout) and which of it it watches, item by
    # item; sent after HELLO (and kept sticky), so an unwatched part is said, never left silent
    COVERAGE = 24
    # contract 1.5: a KV pool of the engine besides pool 0 (a sliding-window pool, a second KV
    # cache group, a recurrent-state pool), whose index is the header's ``pool``; the records
    # of that pool (ALLOC, FREE, ASSIGN, FORWARD) carry the same index and form its own timeline
    POOL = 25
    # contract 1.6 (WIRE_MINOR 6): the content identity (engine_hooks/page_identity.py) of a
    # request's full row pages: those it wrote, or those the prefix cache handed it
    PAGE_IDENTITY = 26


class Role(enum.IntEnum):
    UNIFIED = 0
    PREFILL = 1
    DECODE = 2


class Finish(enum.IntEnum):
    UNKNOWN = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3
    REJECT = 4


class FreeKind(enum.IntEnum):
    FREE = 0  # allocator.free, immediate
    GROUP = 1  # flushed at free_group_end
    DEFERRED = 2  # deferred release (e.g. after a transfer drained)
    PAGE_IDS = 3  # free_page_ids


class Side(enum.IntEnum):
    SENDER = 1
    RECEIVER = 2


class PartRole(enum.IntEnum):
    WORKER = 1  # runs the forwards (vLLM's Worker): block tables and KV


class XferStatus(enum.IntEnum):
    SUCCESS = 1
    FAILED = 2
    ABORTED = 3


class DigestAlg(enum.IntEnum):
    """How an XFER_DIGEST was computed; digests of different algorithms are never compared.

    All are defined over (layer, kv head, token) units so that ends with different
    tensor-parallel sizes agree (docs/wire-format.md, "Transfer digests").
    """

    XXH3_UNIT_BYTES = 1  # host pools until alg 3 (no longer emitted; decoded for recordings): xxh3-64 over
    #                      each (layer, head)'s units, K then V bytes per token, in token order
    XXH3_DEVICE_REDUCED = 2  # device pools: units reduced to u64 on the device, then xxh3-64 on the host
    XXH3_HEAD_STREAMS = 3  # host pools: xxh3-64 over each (layer, head)'s K bytes, and over its V bytes, in token order
    XXH3_BLOCK_ROWS = 4  # host pools, contract 1.4 (vLLM): xxh3-64 over the transfer's blocks as the pool holds
    #                      them, each layer's rows in layer-name order (whole blocks: both ends' block layout
    #                      must match, as the connector that copies them requires)


class LoadPhase(enum.IntEnum):
    ISSUED = 1  # the destination pages are chosen and the copy is queued
    COMPLETED = 2  # the bytes are in the destination pages
    FAILED = 3  # the copy will not happen (or did not complete)


class TierSide(enum.IntEnum):
    STORED = 1  # the KV as it was copied out of the device pages
    LOADED = 2  # the KV as it landed in the device pages


class Phase(enum.IntEnum):
    ADMISSION = 0
    PREFILL = 1
    DECODE = 2
    TRANSFER = 3
    CLIENT_ABORT = 4  # the client (or an operator) aborted it: an AbortReq, not a refusal by the engine


class CoverageStatus(enum.IntEnum):
    """How much of one component of an engine (a pool, a KV cache group, a draft model, a
    transfer path) kvguard watches (COVERAGE)."""

    WATCHED = 1  # every capability that applies to it
    PARTIAL = 2  # some capabilities that apply are not provided (``missing`` says which)
    UNWATCHED = 3  # nothing: its pages or state are not followed at all


class Capability(enum.IntFlag):
    """What kvguard checks of a component (COVERAGE ``watched`` / ``missing`` bits)."""

    OWNERSHIP = 1  # allocations, rows, writes, reads and frees of its pages or state slots
    DIGESTS = 2  # transfer / tier digests of its KV bytes
    GUARD = 4  # the in-engine guard's rules (KVGUARD_GUARD)
    CONTENT = 8  # the in-engine content check (KVGUARD_CONTENT_CHECK)


class PoolKind(enum.IntEnum):
    """What a pool besides pool 0 holds (POOL)."""

    FULL_ATTENTION = 1  # per-token KV read whole by attention (a second full-attention group)
    SLIDING_WINDOW = (
        2  # per-token KV of sliding-window layers: pages behind the window are freed while the request lives
    )
    STATE = 3  # recurrent state (Mamba, linear attention, gated delta net): slots rewritten every step
    DRAFT = 4  # a speculative draft model's own KV


class IdentityPhase(enum.IntEnum):
    """Which of a request's pages a PAGE_IDENTITY names (contract 1.6)."""

    WRITTEN = 1  # full pages the request's own forwards filled: their identity from now on
    HIT = 2  # prefix-cache pages it was handed: the identity its own tokens give them


class Tier1Tag(enum.IntEnum):
    """What the engine's page tag said about a page a row named (TIER1_VIOLATION)."""

    FREE = 1  # in the allocator's free list: a use after free
    ALLOCATED = 2  # handed out but in no request's row yet
    OTHER_REQUEST = 3  # another live request's own page: a foreign read


class GuardRule(enum.IntEnum):
    """Which invariant a GUARD record says was about to be broken (docs/guard.md)."""

    REJECTED_SEND = 1  # prefill was about to send a rejected or aborted request's KV as if it were done
    # KVGUARD_GUARD=full, the engine's read check (Tier 1) on a forward's rows. For these two,
    # Guard.prompt_tokens is the reader's prompt, send_tokens 0, reserved_pages the refused pages
    READ_FOREIGN = 2  # a row page of another live request, or one handed out but in no row
    READ_FREED = 3  # a row page free in the allocator
    # prefill was about to send a number of KV pages other than the pages decode reserved
    # (Guard.send_tokens: the prompt tokens those pages hold; reserved_pages: decode's)
    SEND_SIZE = 4
    # decode's digest of the pages it received differs from the digest prefill's guard
    # carried in the transfer's metadata row (engine_hooks/wire/marker.py), before decode's
    # first step. Guard.send_tokens: the tokens compared; reserved_pages: their pages
    DIGEST_MISMATCH = 5


class GuardAction(enum.IntEnum):
    """What the guard did about it."""

    OBSERVED = 0  # reported only (the guard could not act, or acting is off for this rule)
    ABORTED = 1  # the request was failed through the engine's error path before its KV went out


# Fixed payload parts, after the header. Variable parts follow in the order given.
HELLO_FIXED = struct.Struct("<BBHIIIQQQ")
#   role, _, tp_rank, pid, page_size, pool_pages, pool_tokens, context_len, max_req_input_len;
#   then strings: engine_name, engine_version, model, kvguard_version
REQ_BEGIN_FIXED = struct.Struct("<QQIIB7x")  # req_key, room, prompt_tokens, cached_tokens, flags(bit0 warmup)
#   then strings: rid, tenant
REQ_END_FIXED = struct.Struct("<QQQIBB2x")  # req_key, ttft_ns, e2e_ns, output_tokens, finish, flags
#   then string: reason
PAGES_FIXED = struct.Struct("<IB3x")  # ALLOC/FREE: count, free_kind; then int32[count]
ASSIGN_FIXED = struct.Struct("<QIIII")  # req_key, row_start, row_end, shared_until, count; then int32[count]
FORWARD_FIXED = struct.Struct("<IIIBB2x")  # n_reqs, n_write_pages, n_read_pages, flags, mode
#   then u64 req_keys[n], u32 seq_lens[n], u32 write_counts[n], u32 read_counts[n] (if FWD_HAS_ROWS),
#   int32 write_pages[n_write_pages], int32 read_pages[n_read_pages]
XFER_RESERVE_FIXED = struct.Struct("<QQII")  # req_key, room, tokens, count; then int32 dst pages
XFER_SEND_FIXED = struct.Struct("<QQQIIIB3x")  # req_key, room, digest, token_start, token_end, count, is_last
XFER_DONE_FIXED = struct.Struct("<QQBB6x")  # req_key, room, side, status
XFER_DIGEST_FIXED = struct.Struct("<QQQIIHHHHBB6x")
#   req_key, room, digest, token_start, token_end, layers, head_start, head_count, total_heads, side, alg
REJECT_FIXED = struct.Struct("<QB7x")  # req_key, phase; then string reason
HEARTBEAT_FIXED = struct.Struct("<QQQ")  # records_written, records_dropped, probe_errors
TIER1_FIXED = struct.Struct("<QQII")  # reader req_key, violations so far in the engine, seq_len, count
#   then int32 pages[count], u32 row_page_index[count], u64 owner_keys[count], u8 tags[count] (Tier1Tag)
GUARD_FIXED = struct.Struct("<QQBB2xIII4x")
#   req_key, room, rule, action, prompt_tokens, send_tokens, reserved_pages (0: unknown); then string reason
KV_STORE_FIXED = struct.Struct("<QQQQI4x")  # req_key (0: a cache node's), object_key, digest, scope, count
#   then int32 device_pages[count] (the pages copied out, in object order)
KV_LOAD_FIXED = struct.Struct("<QQQQIB3x")  # req_key (0: a cache prefetch), object_key, digest, scope, count, phase
#   then int32 device_pages[count] (the destination pages, in object order)
CONTENT_CHANGED_FIXED = struct.Struct("<II")  # slots_changed, count; then int32 pages[count]
# primary_pid (the engine process whose HELLO this part's records belong to), rank, part (PartRole)
ENGINE_PART_FIXED = struct.Struct("<IHBx")
KV_DIGEST_FIXED = struct.Struct("<QQQB7x")  # req_key (0: not known where computed), object_key, digest, side
REQ_SCOPE_FIXED = struct.Struct("<QQ")  # req_key, scope (request_scope(extra_key, cache_salt); never 0)
PROBE_ERROR_FIXED = struct.Struct("<I4x")  # count of errors so far for this probe; then strings probe, error type
# COVERAGE: the count of items; then per item COVERAGE_ITEM and strings component, detail
COVERAGE_FIXED = struct.Struct("<H6x")
COVERAGE_ITEM = struct.Struct("<BBBx")  # status (CoverageStatus), watched, missing (Capability bits)
MAX_COVERAGE_ITEMS = 32
# POOL: page_size, pool_pages, window_tokens (0: none), kind (PoolKind), flags; then string name
POOL_FIXED = struct.Struct("<IIIBB2x")
# PAGE_IDENTITY: req_key, first_row_page, count, phase (IdentityPhase); then u64 ids[count]
PAGE_IDENTITY_FIXED = struct.Struct("<QIIB7x")
POOL_SHARES_PAGES = 1  # POOL flags: its page ids are pool 0's (one allocator, the same memory: vLLM's KV cache groups)

FWD_HAS_ROWS = 1  # FORWARD flags: read_counts/read_pages carry the engine's actual rows
REQ_WARMUP = 1  # REQ_BEGIN flags: warmup / health-check request, never alarmed
REQ_END_REPREFILLED = 1  # REQ_END flags: KV released and prefilled again before the first token (not comparable TTFT)


def request_key(rid: str) -> int:
    """64-bit key for a request id; identical on every engine that sees the rid."""
    return xxhash.xxh3_64_intdigest(rid.encode("utf-8", "replace"))


def request_scope(extra_key: str | None, cache_salt: str | None) -> int:
    """The 64-bit prefix-cache scope of a request: what an engine keys its prefix cache by
    besides the tokens (SGLang: ``extra_key`` and ``cache_salt``; vLLM: the salt). 0 when
    the request has neither (the default scope: no REQ_SCOPE record is written). A keyed
    hash of both, so that neither value crosses the contract; the two are length-prefixed
    so that ("ab", "c") and ("a", "bc") differ."""
    if not extra_key and not cache_salt:
        return 0
    parts = [(s or "").encode("utf-8", "replace") for s in (extra_key, cache_salt)]
    blob = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return xxhash.xxh3_64_intdigest(blob, seed=0x6B76675F73636F70) or 1  # ("kvg_scop"; 0 is "no scope")

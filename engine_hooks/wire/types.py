"""The decoded forms of wire records: what ``decode_stream`` yields and the payload encoders take.

Import them through ``kvguard.engine_hooks.wire`` (``wire.Hello``, ``wire.Record``, ...),
which re-exports every name here. The bytes these stand for are defined in ``layout.py``
(structs and enums), ``encode.py`` and ``decode.py``; this module needs only the enums of
``layout.py`` (``Pages``' default is a ``FreeKind``), so it never imports the codecs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .layout import (
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
    TierSide,
    XferStatus,
)


@dataclass(slots=True)
class Hello:
    role: Role
    tp_rank: int
    pid: int
    page_size: int
    pool_pages: int
    pool_tokens: int
    context_len: int
    max_req_input_len: int
    engine_name: str
    engine_version: str
    model: str
    kvguard_version: str


@dataclass(slots=True)
class ReqBegin:
    req_key: int
    room: int
    prompt_tokens: int
    cached_tokens: int
    warmup: bool
    rid: str
    tenant: str


@dataclass(slots=True)
class ReqEnd:
    req_key: int
    ttft_ns: int
    e2e_ns: int
    output_tokens: int
    finish: Finish
    reason: str
    reprefilled: bool = False  # its KV was released before it finished (optimistic PD retry, retraction)


@dataclass(slots=True)
class Pages:
    """ALLOC and FREE: a set of page ids (FREE also says which free path)."""

    pages: np.ndarray
    free_kind: FreeKind = FreeKind.FREE


@dataclass(slots=True)
class Assign:
    req_key: int
    row_start: int
    row_end: int
    shared_until: int
    pages: np.ndarray  # pages for row page-indices row_start//page_size onwards


@dataclass(slots=True)
class AssignRun:
    """Back-to-back one-page ASSIGN records of one ring, decoded as columns (``decode_stream``
    with ``runs``): what a decode step sends when the adapter reports an ASSIGN per request.
    Carried in one ``Record`` of kind ASSIGN whose ``seq`` is the first record's and
    ``ts_ns`` the last one's; ``record(i)`` and ``expand_runs`` give the records back one by one
    (the wire bytes are the same)."""

    seqs: np.ndarray  # uint64[n], consecutive
    ts_ns: np.ndarray  # uint64[n]
    req_keys: np.ndarray  # uint64[n]
    row_start: np.ndarray  # uint32[n]
    row_end: np.ndarray  # uint32[n]
    shared_until: np.ndarray  # uint32[n]
    pages: np.ndarray  # int32[n]: each record's one page

    def __len__(self) -> int:
        return len(self.seqs)

    def assign(self, i: int) -> Assign:
        return Assign(
            int(self.req_keys[i]),
            int(self.row_start[i]),
            int(self.row_end[i]),
            int(self.shared_until[i]),
            self.pages[i : i + 1].copy(),
        )


@dataclass(slots=True)
class Forward:
    req_keys: np.ndarray  # uint64[n]
    seq_lens: np.ndarray  # uint32[n]
    write_counts: np.ndarray  # uint32[n]
    write_pages: np.ndarray  # int32[sum(write_counts)]
    read_counts: np.ndarray | None  # uint32[n] when the engine sent its actual rows
    read_pages: np.ndarray | None  # int32[sum(read_counts)]; decoded, a read-only view of the record
    mode: int = 0


@dataclass(slots=True)
class XferReserve:
    req_key: int
    room: int
    tokens: int
    pages: np.ndarray


@dataclass(slots=True)
class XferSend:
    req_key: int
    room: int
    digest: int
    token_start: int
    token_end: int
    is_last: bool
    pages: np.ndarray


@dataclass(slots=True)
class XferDone:
    req_key: int
    room: int
    side: Side
    status: XferStatus


@dataclass(slots=True)
class XferDigest:
    """One end's digest of a transfer's KV over tokens [token_start, token_end).

    A rank holding kv heads [head_start, head_start + head_count) of total_heads
    contributes a partial digest; partial digests of one end add (mod 2**64) to the
    whole-transfer digest once every head is covered.
    """

    req_key: int
    room: int
    side: Side
    alg: DigestAlg
    digest: int
    token_start: int
    token_end: int
    layers: int
    head_start: int
    head_count: int
    total_heads: int


@dataclass(slots=True)
class Tier1Violation:
    """One reader's row pages that the engine's Tier-1 check refused in one forward."""

    reader_key: int
    violations_total: int  # violating pages seen by this engine so far, this record included
    seq_len: int
    pages: np.ndarray  # int32[n]
    row_indices: np.ndarray  # uint32[n]: position // page_size in the reader's row
    owner_keys: np.ndarray  # uint64[n]: the owning request's key for OTHER_REQUEST, else 0
    tags: np.ndarray  # uint8[n]: Tier1Tag


@dataclass(slots=True)
class Reject:
    req_key: int
    phase: Phase
    reason: str


@dataclass(slots=True)
class Guard:
    req_key: int
    room: int  # NO_ROOM when the request has none
    rule: GuardRule
    action: GuardAction
    prompt_tokens: int  # the prompt the client sent (before any placeholder replaced it)
    send_tokens: int  # tokens the engine was about to send
    reserved_pages: int  # pages the receiver reserved for it, as the sender knows them (0: unknown)
    reason: str


@dataclass(slots=True)
class KvStore:
    """Device pages copied out to a host / storage object (an offload, a backup)."""

    req_key: int  # 0: a prefix-cache node's, no request's
    object_key: int  # the adapter's 64-bit id of the host / storage object
    digest: int  # of the bytes stored (0: none)
    scope: int  # the prefix-cache scope the object is keyed by (REQ_SCOPE's hash; 0 default)
    pages: np.ndarray


@dataclass(slots=True)
class KvLoad:
    """A host / storage object loaded back into device pages."""

    req_key: int  # the request it is loaded for (0: a prefetch into the cache)
    object_key: int
    digest: int  # of the bytes loaded (0: none)
    scope: int  # the scope of the lookup that found the object
    phase: LoadPhase
    pages: np.ndarray  # destination pages


@dataclass(slots=True)
class KvDigest:
    """One side's digest of a host / storage object's KV (``TierSide``), for the object named
    by the KV_STORE / KV_LOAD of the same ``object_key``."""

    req_key: int  # 0: the process that computed it does not know the request
    object_key: int
    digest: int
    side: TierSide


@dataclass(slots=True)
class ContentChanged:
    """KV slots whose bytes changed since a hooked path last wrote them, and their pages."""

    slots_changed: int
    pages: np.ndarray


@dataclass(slots=True)
class ReqScope:
    """A request's prefix-cache scope (``request_scope``): requests of different scopes must
    never share prefix-cache pages."""

    req_key: int
    scope: int


@dataclass(slots=True)
class EnginePart:
    """This ring's process is one part (``part``, ``rank``) of the engine whose HELLO came from
    process ``primary_pid``: its records belong to that engine's timeline."""

    primary_pid: int
    part: PartRole
    rank: int


@dataclass(slots=True)
class CoverageItem:
    """One component the adapter found in the engine and how much of it kvguard watches.

    ``component`` is a short stable name (``kv_pool``, ``kv_group_1``, ``draft``,
    ``state_pool``, ``transfer``, ``parallel``, ...), ``detail`` says what it is and, when
    not everything is watched, why (for people: the sidecar shows it as given)."""

    component: str
    status: CoverageStatus
    watched: int  # Capability bits kvguard provides for it
    missing: int  # Capability bits that apply to it and are not provided
    detail: str


@dataclass(slots=True)
class Coverage:
    """What an engine holds and what of it is watched (contract 1.5), item by item."""

    items: list[CoverageItem]

    @property
    def gaps(self) -> list[CoverageItem]:
        """The items not fully watched."""
        return [item for item in self.items if item.status != CoverageStatus.WATCHED]


@dataclass(slots=True)
class PoolInfo:
    """A KV pool of the engine besides pool 0 (contract 1.5); its index is the record's ``pool``."""

    page_size: int
    pool_pages: int
    window_tokens: int  # a sliding-window pool's window (0: none)
    kind: PoolKind
    name: str
    # its page ids are pool 0's: one allocator hands them out and ALLOC / FREE come on pool 0 (vLLM's
    # KV cache groups share one block pool and alias its memory); only rows and forwards are its own
    shares_pages: bool = False


@dataclass(slots=True)
class PageIdentity:
    """The content identities of a request's full row pages ``first_row_page`` onwards
    (contract 1.6, engine_hooks/page_identity.py): pages it wrote (``WRITTEN``) or pages the
    prefix cache handed it (``HIT``). Never token ids: u64 ids keyed by the engine's secret salt."""

    req_key: int
    first_row_page: int
    phase: IdentityPhase
    ids: np.ndarray  # uint64[count], one per row page from first_row_page on


@dataclass(slots=True)
class Heartbeat:
    records_written: int
    records_dropped: int
    probe_errors: int


@dataclass(slots=True)
class ProbeError:
    count: int
    probe: str
    error: str


@dataclass(slots=True)
class Record:
    kind: Kind
    seq: int
    ts_ns: int
    engine_id: int
    pool: int
    # one of the payload classes above, chosen by ``kind`` (a tagged union the
    # type checker cannot narrow on an int; the pipeline's handlers take the concrete class)
    body: Any = field(default=None)


def records_in(rec: Record) -> int:
    """How many wire records ``rec`` stands for (an ``AssignRun`` is several)."""
    body = rec.body
    return len(body) if type(body) is AssignRun else 1


def expand_runs(records):
    """``records`` with every ``AssignRun`` given back as its one-page ASSIGN records."""
    for rec in records:
        body = getattr(rec, "body", None)  # (a recording's SidecarEvent has none)
        if type(body) is not AssignRun:
            yield rec
            continue
        for i in range(len(body)):
            yield Record(rec.kind, int(body.seqs[i]), int(body.ts_ns[i]), rec.engine_id, rec.pool, body.assign(i))


@dataclass(slots=True)
class DecodeStats:
    """What a reader saw besides good records. The sidecar exports these as metrics."""

    records: int = 0
    unknown_kind: int = 0
    bad_version: int = 0
    bad_payload: int = 0
    corrupt_bytes: int = 0  # bytes skipped because no valid header could be read
    foreign_engine: int = 0  # records stamped with another engine's id than their ring's header
    last_error: str = ""


@dataclass(slots=True, frozen=True)
class SidecarEvent:
    """A recordings-only event of the sidecar itself: ``kind`` is "engine_gone", "tick", "gap"
    (``count`` records the recorder could not record) or "options" (``options``: the live
    sidecar's settings that change verdicts, for replay)."""

    kind: str
    ts_ns: int
    engine_id: int = 0
    count: int = 0
    options: dict | None = None

"""The events the models hand to detectors: typed facts, no behaviour.

This module sits below both the models (the page model and its judge, the transfer ledger, the
stored-object model, the request directory) and the detectors: it imports neither, so a
detector and a model can both name an event without importing each other. The two ledger types
some events carry (``RoomState``, ``DigestVerdict``) are named for the type checker only (the
ledger imports nothing of the pipeline's, so there is no cycle to break at run time either).

Where they come from: the page model's write and read verdicts (:class:`WriteVerdict`,
:class:`ReadVerdict`, sidecar/judge.py), the transfer ledger's digest comparisons and orphaned
rooms, the stored-object model's loads, and the small records the pipeline itself observes (a
double free, a gap in the records, a request's end, an unreachable shared ledger).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .findings import Party
from .request_info import RequestInfo

if TYPE_CHECKING:
    from .ledger import DigestVerdict, RoomState


# ---------------------------------------------------------------- the page model's verdicts


@dataclass(slots=True)
class WriteVerdict:
    """KV writes that landed where they should not have."""

    writer: RequestInfo
    freed: np.ndarray  # pages free in the allocator when written (write after free)
    foreign: np.ndarray  # pages owned by another live request when written (late write)


@dataclass(slots=True)
class ReadVerdict:
    """The classification of one request's page reads in one forward (pages outside
    every category were fine)."""

    reader: RequestInfo
    unwritten: np.ndarray  # reserved for the reader, nothing wrote them for it
    foreign: np.ndarray  # not (or no longer) the reader's: another request owns or wrote them
    freed: np.ndarray  # free in the allocator while read
    unverified: int  # pages whose state is unknown (blind window)
    shared: np.ndarray | None = None  # legitimately shared prefix-cache pages read (for tenant isolation checks)
    unwritten_writers: np.ndarray | None = None  # a read judged late: the unwritten pages' last writers when read


# ---------------------------------------------------------------- what the pipeline observes


@dataclass(frozen=True, slots=True)
class PagesFreedTwice:
    """A FREE record named pages the model holds free already."""

    pages: np.ndarray
    free_kind: str  # the engine's free path (sidecar records' FreeKind, lower case)


@dataclass(frozen=True, slots=True)
class RecordsLost:
    """A LOST marker: a gap of ``count`` records in one engine's stream."""

    count: int
    first_missing_seq: int
    engine_total: int  # records lost on this engine since the sidecar first saw it


@dataclass(frozen=True, slots=True)
class RequestEnded:
    """A request's REQ_END, with what the model knows about it.

    ``prompt_pages``: (pages its own forwards wrote while within its prompt, pages its
    uncached prompt spans), kept by the tracker as the forwards came; None when the
    records cannot tell (its REQ_BEGIN unseen, or a gap since)."""

    info: RequestInfo
    prompt_pages: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class LedgerUnreachable:
    """The shared transfer ledger (Redis) cannot be reached."""

    display_url: str
    last_error: str
    waiting: int  # receivers waiting for facts that only the ledger carries


@dataclass(frozen=True, slots=True)
class DigestsCompared:
    """Both ends' digests of one transfer are complete (the ledger's verdict on them)."""

    state: RoomState
    verdict: DigestVerdict


@dataclass(frozen=True, slots=True)
class TransferOrphaned:
    """Decode reserved pages for a room whose sender will not send."""

    state: RoomState
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SourcePagesSent:
    """A sender shipped source pages its request does not hold written: an XFER_SEND judged
    as a read by the sending request (``Judge.classify_send``)."""

    verdict: ReadVerdict  # the sender, and its unwritten / foreign / freed pages
    room: int
    token_start: int
    token_end: int
    receiver: Party | None  # the decode request the pages went to, None when not known here
    via: str = "transfer_source"  # or "offload": a KV_STORE to a host / storage object
    object_key: int = 0  # (offload) the object the pages went to


@dataclass(frozen=True, slots=True)
class PagesChangedInFlight:
    """A transfer's pages were handed to another request while it was in flight: between the
    sender's ``XFER_SEND`` and its completion (sidecar/inflight.py).

    ``side`` "source": the sender's pages were allocated again before its transfer completed,
    so the transfer may have read another request's KV (``request`` is the sender,
    ``counterpart`` the receiver). "destination": the receiver's reserved pages went to
    another request before the completion landed in them (``request`` is the receiver,
    ``counterpart`` the sender)."""

    side: str
    request: RequestInfo
    pages: np.ndarray
    room: int
    token_start: int
    token_end: int
    sent_ns: int
    counterpart: Party | None


@dataclass(frozen=True, slots=True)
class PrefixSharedAcrossScopes:
    """Prefix-cache pages handed to a request (an ASSIGN's shared part) whose KV was written
    under another prefix-cache scope (REQ_SCOPE: cache salt / extra key)."""

    reader: RequestInfo
    pages: np.ndarray
    writer_scopes: np.ndarray  # u64 per page: the scope each page was written under


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """A request was handed prefix-cache pages as its row's first entries (an ASSIGN from
    position 0 whose first ``hit_tokens`` positions came from the cache): the pages that held
    KV then, and each one's last writer (request key; 0 unknown). The probing detector and
    the isolation report read who wrote what another request got."""

    reader: RequestInfo
    hit_tokens: int
    pages: np.ndarray
    writers: np.ndarray  # u64 per page


@dataclass(frozen=True, slots=True)
class PrefixContentMismatch:
    """Prefix-cache pages a request was handed (PAGE_IDENTITY ``hit``) whose content identity,
    recorded when their current allocation was written, differs from the identity the reader's
    own tokens give them (sidecar/page_identity.py): they hold another prefix or other positions."""

    reader: RequestInfo
    row_indices: np.ndarray  # the reader's row pages (position // page_size) that differ
    pages: np.ndarray  # the pages there
    writers: np.ndarray  # u64 per page: its last writer, whose KV it holds (0 unknown)
    judged: int  # the hit's pages whose identity was known (these included)


@dataclass(frozen=True, slots=True)
class ContentChangedAt:
    """The engine's content check found KV slots changed with no hooked write (CONTENT_CHANGED)."""

    pages: np.ndarray
    slots_changed: int


@dataclass(frozen=True, slots=True)
class LoadedObjectMismatch:
    """A completed KV_LOAD of an object that is not what the request may read: stored by an
    engine of another model, with another digest, or under another prefix-cache scope."""

    reader: RequestInfo | None  # None for a prefetch into the cache
    pages: np.ndarray  # the destination pages
    object_key: int
    stored_by: Party | None  # the request whose KV was stored, None if unknown
    problems: tuple[tuple[str, dict], ...]  # (kind, evidence) pairs
    # the stored object whose digest the loaded bytes have, when it is another one (the tier
    # served the wrong object): its key and the request whose KV it holds
    loaded_from_key: int = 0
    loaded_from: Party | None = None

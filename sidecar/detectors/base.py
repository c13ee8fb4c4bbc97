"""The detector contract, and the events the models hand to detectors.

A detector is one class that declares the finding kinds it may raise (``kinds``, each an
entry of sidecar/catalogue.py) and the event types it observes (``events``), and
implements one method, ``observe(event, at) -> list[Finding]``. The pipeline dispatches
each event to the detectors that declared its type (a table built once, no if/elif
chain), files what they return into incidents, and delivers it.

Events come from the models: the tracker's read and write verdicts
(:class:`~kvguard.sidecar.tracker.ReadVerdict`, ``WriteVerdict``), the transfer
ledger's pairings, digest comparisons and orphaned rooms, and the small records below
for what the pipeline itself observes (a double free, a gap in the records, a request's
end, an unreachable shared ledger). Detectors do no I/O and never call back into the
pipeline: what they need to judge comes in the event or in ``at.tracker``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import numpy as np

    from ..findings import EngineRef, Finding
    from ..tracker import EngineTracker, RequestInfo


@dataclass(frozen=True, slots=True)
class At:
    """Where and when an event happened: the engine's model, its identity, the record's time."""

    tracker: EngineTracker | None
    engine: EngineRef
    engine_id: int
    ts_ns: int


class Detector(Protocol):
    kinds: ClassVar[tuple[str, ...]]  # the catalogue kinds it may raise
    events: ClassVar[tuple[type, ...]]  # the event types it observes

    def observe(self, event: Any, at: At, /) -> list[Finding]: ...


# ---------------------------------------------------------------- events the pipeline makes


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

    state: Any  # sidecar.ledger RoomState
    verdict: Any  # sidecar.ledger DigestVerdict


@dataclass(frozen=True, slots=True)
class TransferOrphaned:
    """Decode reserved pages for a room whose sender will not send."""

    state: Any  # sidecar.ledger RoomState
    timeout_s: float


@dataclass(frozen=True, slots=True)
class SourcePagesSent:
    """A sender shipped source pages its request does not hold written: an XFER_SEND judged
    as a read by the sending request (``EngineTracker.classify_send``)."""

    verdict: Any  # sidecar.judge ReadVerdict: the sender, and its unwritten / foreign / freed pages
    room: int
    token_start: int
    token_end: int
    receiver: Any  # sidecar.findings Party: the decode request the pages went to, None when not known here
    via: str = "transfer_source"  # or "offload": a KV_STORE to a host / storage object
    object_key: int = 0  # (offload) the object the pages went to


@dataclass(frozen=True, slots=True)
class PrefixSharedAcrossScopes:
    """Prefix-cache pages handed to a request (an ASSIGN's shared part) whose KV was written
    under another prefix-cache scope (REQ_SCOPE: cache salt / extra key)."""

    reader: RequestInfo
    pages: np.ndarray
    writer_scopes: np.ndarray  # u64 per page: the scope each page was written under


@dataclass(frozen=True, slots=True)
class ContentChangedAt:
    """The engine's content check found KV slots changed with no hooked write (CONTENT_CHANGED)."""

    pages: np.ndarray
    slots_changed: int


@dataclass(frozen=True, slots=True)
class LoadedObjectMismatch:
    """A completed KV_LOAD of an object that is not what the request may read: stored by an
    engine of another model, with another digest, or under another prefix-cache scope."""

    reader: Any  # sidecar.request_directory RequestInfo, None for a prefetch into the cache
    pages: np.ndarray  # the destination pages
    object_key: int
    stored_by: Any  # sidecar.findings Party of the request whose KV was stored, None if unknown
    problems: tuple  # (kind, evidence) pairs

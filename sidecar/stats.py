"""What the sidecar's components publish about themselves: frozen values, no behaviour.

Readers of the sidecar's figures (the Prometheus collector in sidecar/metrics.py, the
``/v1/engines`` endpoint) get these instead of reaching into the pipeline's models.
Each component fills in its own part (``EngineTracker.stats``, ``TransferLedger.stats``,
``TTFTDetector.stats``, ``IncidentStore.stats``, ``MemoryBudget.stats``,
``QueuedSink.delivery_stats``) and ``Pipeline.stats`` composes them, so a model can
change its insides without breaking a reader, and a reader sees one consistent set of
numbers taken under the ingest lock. The shared ledger's link (``SharedLedger.stats``)
is the service's, read beside them.

A stats value is taken under the sidecar's lock and read after it is released, so it
must not share anything the ingest thread goes on changing: every mapping in it is a
fresh copy, sized by the engines attached and fixed label sets (record kinds, finding
kinds, page states, memory parts, transfer outcomes), never by pages or requests, so a
scrape copies a few hundred numbers however large the pools are. The frozen dataclasses
keep a reader from writing back; the ``Mapping`` types say the same of their contents.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

KindAndSeverity = tuple[str, str]  # (finding kind, severity), the label pair of findings and incidents


@dataclass(frozen=True, slots=True)
class CoverageEntry:
    """One component of an engine and how much of it kvguard watches (wire.CoverageItem)."""

    component: str
    status: str  # watched, partial, unwatched
    watched: tuple[str, ...]  # capabilities provided (ownership, digests, guard, content)
    missing: tuple[str, ...]  # capabilities that apply and are not provided
    detail: str


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One of an engine's pools besides pool 0 (a POOL record) and its page model."""

    index: int
    kind: str  # full_attention, sliding_window, state, draft
    name: str
    page_size: int
    pool_pages: int
    window_tokens: int
    pages_by_state: Mapping[str, int]
    pages_read: int
    pages_unverified: int
    pages_out_of_range: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One engine's page model (sidecar/tracker.py). The HELLO's figures (``pid``, ``rank``,
    ``pool_pages``, ``pool_tokens``, ``context_len``) are None until the engine said hello,
    and ``role`` is ``"unknown"`` until then."""

    engine_id: int
    role: str
    pid: int | None
    rank: int | None
    page_size: int
    pool_pages: int | None
    pool_tokens: int | None
    context_len: int | None
    pages_by_state: Mapping[str, int]  # every page state, zeros included (a count, not the pages)
    pages_read: int  # page reads judged
    pages_unverified: int  # page reads not judged (state unknown: a blind window)
    pages_out_of_range: int  # page ids past the pool the engine announced (skipped)
    live_requests: int  # requests holding a row
    # what the engine said it holds and what of it is watched (COVERAGE, contract 1.5): one entry per
    # component, (component, status, watched capabilities, missing capabilities, detail); () before it
    coverage: tuple[CoverageEntry, ...] = ()
    pools: tuple[PoolStats, ...] = ()  # the engine's pools besides pool 0 (POOL records)

    @property
    def coverage_gaps(self) -> int | None:
        """Components not fully watched; None when the engine sent no COVERAGE (an older adapter)."""
        if not self.coverage:
            return None
        return sum(1 for entry in self.coverage if entry.status != "watched")

    @property
    def announced(self) -> bool:
        """The engine's HELLO was applied (its identity and pool are known)."""
        return self.pid is not None


@dataclass(frozen=True, slots=True)
class InFlightStats:
    """Transfers in flight (sidecar/inflight.py): chunks sent whose sender has not completed."""

    rooms: int = 0  # rooms with chunks in flight now
    pages: int = 0  # page ids held for them (both ends)
    completed: int = 0  # rooms whose sender completed and whose pages were checked
    unjudged: int = 0  # the sender failed or ended without completing: nothing known to have landed
    dropped: int = 0  # dropped to stay within the bound, unchecked


@dataclass(frozen=True, slots=True)
class LedgerStats:
    """The transfer ledger (sidecar/ledger/memory.py)."""

    # receiving engine id -> outcome -> completed transfers, every outcome of every engine
    # asked for, zeros included (only decode engines receive)
    transfers_by_engine: Mapping[int, Mapping[str, int]]
    digests_compared: int
    digests_incomparable: int  # both ends complete, but with no algorithm in common
    rooms_evicted: int
    # receiving engine id -> (its reservations still waiting for their transfer, the oldest's
    # age in seconds); every engine asked for, (0, 0.0) included
    open_by_engine: Mapping[int, tuple[int, float]] = field(default_factory=dict)
    in_flight: InFlightStats = field(default_factory=InFlightStats)
    # end ("sender", "receiver") -> completed transfers where that end's ranks' partial digests
    # never covered every kv head (a rank missing, stuck or restarted): not compared
    digests_incomplete: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SharedLedgerStats:
    """The shared (Redis) transfer ledger's link (sidecar/ledger/shared.py). Not part of
    ``PipelineStats``: the sidecar service owns the link (starts and stops its thread) and
    hands it to the pipeline only to wait on the other pod's facts."""

    degraded: bool
    errors: int  # failed Redis round trips
    queue_dropped: int  # facts dropped: the hand-off queue to the ledger's thread was full
    outbox_dropped: int  # facts dropped: the outage buffer was full
    bad_facts: int  # values in ledger keys this version did not write (ignored)
    # rooms registered and facts written again after a failed round trip or a failover: what a
    # master that failed over may have lost (acknowledged, not yet replicated), sent again
    resynced: int = 0
    failovers: int = 0  # times a master serving the ledger's keys changed (Cluster, Sentinel)


@dataclass(frozen=True, slots=True)
class TTFTStats:
    """The ttft_anomaly detector's deferred verdicts (sidecar/detectors/ttft.py)."""

    suspects_waiting: int
    suspects_cleared: int
    suspects_explained: int


@dataclass(frozen=True, slots=True)
class IncidentStats:
    """The incident store (sidecar/incidents.py)."""

    firing: Mapping[KindAndSeverity, int]  # open incidents; only pairs with one at least
    evicted: int


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """The memory budget (sidecar/memory_budget.py) and what the state it bounds costs."""

    budget_bytes: int
    bytes_by_part: Mapping[str, int]  # estimated bytes by part
    ended_per_engine: int  # ended requests each engine's directory keeps


@dataclass(frozen=True, slots=True)
class SinkStats:
    """One queued alert sink's delivery (sidecar/sinks/delivery.py)."""

    name: str
    events: Mapping[tuple[str, str], int]  # (action, result) -> items, every pair, zeros included
    retries: int
    queue_depth: int
    queue_capacity: int
    last_success_s: float  # wall-clock time of the last delivery; 0 before the first


@dataclass(frozen=True, slots=True)
class PipelineStats:
    """Everything the pipeline publishes (``Pipeline.stats``), as of one moment."""

    records_by_kind: Mapping[str, int]  # records applied; kinds not seen yet are absent
    findings: Mapping[KindAndSeverity, int]  # findings raised; pairs not raised yet are absent
    incidents_opened: Mapping[KindAndSeverity, int]  # incidents opened; likewise
    # every (kind, severity) this configuration can raise (sidecar/finding_kinds.py), sorted
    possible_findings: tuple[KindAndSeverity, ...]
    apply_errors: int
    engines: tuple[EngineStats, ...]
    incidents: IncidentStats
    memory: MemoryStats
    ttft: TTFTStats
    ledger: LedgerStats
    sinks: tuple[SinkStats, ...]  # the queued alert sinks (PagerDuty, Alertmanager), in order
    # finding kind -> requests an engine's guard (KVGUARD_GUARD) failed; every kind a guard can raise, zeros included
    guard_aborts: Mapping[str, int] = field(default_factory=dict)
    # host / storage tiers (sidecar/offload.py): loads of objects never seen stored; objects forgotten at the bound
    loads_unverified: int = 0
    objects_forgotten: int = 0
    load_digests_compared: int = 0  # tier loads whose digest met the stored one's (in KV_LOAD or KV_DIGEST)
    # records of an engine part (vLLM's Worker, sidecar/engine_parts.py) whose engine had not said HELLO
    records_without_engine: int = 0
    records_undeclared_pool: int = 0  # records naming a pool their engine never declared (skipped)
    # PAGE_IDENTITY pages by result (recorded, matched, mismatched, unknown), every result, zeros included
    page_identity: Mapping[str, int] = field(default_factory=dict)

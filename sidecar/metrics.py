"""Prometheus metrics, rendered at scrape time from what the sidecar's parts publish.

The pipeline's figures come as one ``PipelineStats`` (sidecar/stats.py, taken under the
ingest lock by ``Sidecar.pipeline_stats``), the ingest figures from the ring set's stats,
and those of the service's own parts (the shared ledger's link, the recorder) from
theirs. This module only turns them into metric families, so that it does not depend on
how the trackers, the ledger, the detectors or the incident store keep their numbers.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvguard.engine_hooks import wire

from .http_server import closed_connections
from .stats import EngineStats, LedgerStats, SharedLedgerStats, SinkStats, TTFTStats

# Record kinds the pipeline applies, exported at 0 from the start (PAD is ring filler,
# never decoded; LOST is the gap marker the readers insert)
APPLIED_RECORD_KINDS = tuple(k.name for k in wire.Kind if k != wire.Kind.PAD)


def with_zeros(counts, keys) -> dict:
    """The counts, plus 0 for each key not counted yet: a counter's series exists from
    the start, so dashboards show 0 rather than "no data"."""
    out = dict.fromkeys(keys, 0)
    out.update(counts)
    return out


class KVGuardCollector(Collector):
    """Takes the pipeline's stats and the ingest figures under the ingest lock, but a scrape never waits
    for a busy ingest cycle (a saturated sidecar held it for seconds, longer than the
    probes' timeout): it takes the lock if it is free within ``LOCK_WAIT_S``, else it serves
    the last snapshot and asks the ingest thread to take a fresh one between two cycles
    (``refresh_if_wanted``), which the next scrape gets. ``kvguard_metrics_snapshot_age_seconds``
    says how old the figures are; the ingest loop's own age is read without the lock."""

    LOCK_WAIT_S = 0.05
    FIRST_LOCK_WAIT_S = 2.0  # nothing to serve yet: wait longer once

    def __init__(self, service):
        self.service = service  # sidecar.service.Sidecar: its pipeline_stats() and ring set, read under its lock
        self._snapshot: list = []
        self._snapshot_ns = 0
        self._wanted = False
        self.stale_scrapes = 0
        hooks = getattr(service, "between_cycles", None)
        if hooks is not None:
            hooks.append(self.refresh_if_wanted)

    def refresh_if_wanted(self) -> None:
        """Called by the ingest thread between two cycles (the lock is free, nothing waits)."""
        if self._wanted:
            self._wanted = False
            with self.service.lock:
                self._take_snapshot()

    def _take_snapshot(self) -> None:  # under the lock
        self._snapshot = list(self._families(self.service))
        self._snapshot_ns = time.monotonic_ns()

    def collect(self):
        svc = self.service
        if svc.lock.acquire(timeout=self.LOCK_WAIT_S if self._snapshot_ns else self.FIRST_LOCK_WAIT_S):
            try:
                self._take_snapshot()
            finally:
                svc.lock.release()
        else:
            self.stale_scrapes += 1
            self._wanted = True
        yield from self._snapshot
        now = time.monotonic_ns()
        age = GaugeMetricFamily(
            "kvguard_ingest_last_poll_age_seconds", "Seconds since the ingest loop last drained the rings"
        )
        age.add_metric([], (now - svc.last_poll_ns) / 1e9 if svc.last_poll_ns else float("inf"))
        yield age
        snap = GaugeMetricFamily(
            "kvguard_metrics_snapshot_age_seconds",
            "Age of the figures in this scrape (0 unless the ingest cycle was busy)",
        )
        snap.add_metric([], (now - self._snapshot_ns) / 1e9 if self._snapshot_ns else float("inf"))
        yield snap
        stale = CounterMetricFamily(
            "kvguard_metrics_stale_scrapes", "Scrapes served from the previous snapshot because ingest was busy"
        )
        stale.add_metric([], self.stale_scrapes)
        yield stale
        closed = CounterMetricFamily(
            "kvguard_http_connections_closed",
            "HTTP connections the sidecar closed: past --http-max-connections, or no "
            "complete request within --http-request-timeout-s",
            labels=["reason"],
        )
        for reason, n in sorted(closed_connections.items()):
            closed.add_metric([reason], n)
        yield closed
        frozen = GaugeMetricFamily(
            "kvguard_gc_frozen_objects",
            "Objects in the garbage collector's permanent "
            "generation (sidecar/gc_policy.py): long-lived state no collection walks",
        )
        frozen.add_metric([], gc.get_freeze_count())
        yield frozen
        policy = getattr(svc, "gc_freeze", None)
        pauses = CounterMetricFamily(
            "kvguard_gc_freeze_pause_seconds",
            "Seconds the periodic full collection and freeze held the process (sidecar/gc_policy.py)",
        )
        pauses.add_metric([], policy.pause_s_total if policy is not None else 0.0)
        yield pauses

    @staticmethod
    def _families(svc):
        # under the lock: the pipeline's figures as plain values (sidecar/stats.py), so that
        # nothing here depends on how the pipeline's models keep them
        stats, ingest = svc.pipeline_stats(), svc.rings.stats
        records = CounterMetricFamily("kvguard_records", "Records applied, by kind", labels=["kind"])
        for kind, n in sorted(with_zeros(stats.records_by_kind, APPLIED_RECORD_KINDS).items()):
            records.add_metric([kind], n)
        yield records
        lost = CounterMetricFamily("kvguard_records_lost", "Records the engines dropped (ring full)")
        lost.add_metric([], ingest.records_lost)
        yield lost
        bad = CounterMetricFamily("kvguard_records_invalid", "Records skipped as unreadable", labels=["reason"])
        totals = dict(ingest.retired_invalid)
        corrupt = ingest.retired_corrupt_bytes
        for reader in svc.rings.readers.values():
            for k in totals:
                totals[k] += getattr(reader.stats, k)
            corrupt += reader.stats.corrupt_bytes
        for k, v in totals.items():
            bad.add_metric([k], v)
        yield bad
        cb = CounterMetricFamily("kvguard_ring_corrupt_bytes", "Ring bytes skipped: no valid record header")
        cb.add_metric([], corrupt)
        yield cb
        errs = CounterMetricFamily("kvguard_ring_errors", "Ring files refused or unreadable")
        errs.add_metric([], ingest.ring_errors)
        yield errs
        disorder = CounterMetricFamily(
            "kvguard_records_out_of_order",
            "Records released after a newer record of another ring (their producer stalled mid-write for over 2 s)",
        )
        disorder.add_metric([], ingest.records_out_of_order)
        yield disorder
        rings = GaugeMetricFamily("kvguard_rings_attached", "Engine rings currently attached")
        rings.add_metric([], len(svc.rings.readers))
        yield rings
        findings = CounterMetricFamily("kvguard_findings", "Findings raised", labels=["kind", "severity"])
        # every pair this configuration can raise, at 0 until raised (sidecar/finding_kinds.py)
        possible = stats.possible_findings
        for (kind, severity), n in sorted(with_zeros(stats.findings, possible).items()):
            findings.add_metric([kind, severity], n)
        yield findings
        incidents = CounterMetricFamily(
            "kvguard_incidents",
            "Incidents opened (a finding's first occurrence for its kind, engine and reader)",
            labels=["kind", "severity"],
        )
        for (kind, severity), n in sorted(with_zeros(stats.incidents_opened, possible).items()):
            incidents.add_metric([kind, severity], n)
        yield incidents
        # per (kind, severity): KVGuardDoubleFree pages on this gauge, so it carries the
        # severity like kvguard_findings_total does
        firing = GaugeMetricFamily(
            "kvguard_incidents_firing", "Incidents not resolved yet", labels=["kind", "severity"]
        )
        for (kind, severity), n in sorted(stats.incidents.firing.items()):
            firing.add_metric([kind, severity], n)
        yield firing
        yield from engine_metrics(stats.engines)
        memory = stats.memory
        mem_budget = GaugeMetricFamily("kvguard_memory_budget_bytes", "--memory-budget")
        mem_budget.add_metric([], memory.budget_bytes)
        yield mem_budget
        mem = GaugeMetricFamily(
            "kvguard_memory_bytes", "Estimated bytes of the sidecar's state, by part", labels=["part"]
        )
        for part, n in memory.bytes_by_part.items():
            mem.add_metric([part], n)
        yield mem
        ended = GaugeMetricFamily(
            "kvguard_ended_requests_capacity",
            "Ended requests each engine's directory keeps (the memory budget's share)",
        )
        ended.add_metric([], memory.ended_per_engine)
        yield ended
        evicted = CounterMetricFamily(
            "kvguard_incidents_evicted",
            "Incidents dropped from the store to stay within "
            "its bounds (count, and the memory budget's share): oldest resolved first",
        )
        evicted.add_metric([], stats.incidents.evicted)
        yield evicted
        apply_errors = CounterMetricFamily("kvguard_apply_errors", "Records the sidecar failed to apply")
        apply_errors.add_metric([], stats.apply_errors)
        yield apply_errors
        orphaned = CounterMetricFamily(
            "kvguard_records_without_engine",
            "Records of an engine part (vLLM's Worker) whose engine (its EngineCore's HELLO) "
            "the sidecar had not seen: skipped, not judged",
        )
        orphaned.add_metric([], stats.records_without_engine)
        undeclared = CounterMetricFamily(
            "kvguard_records_undeclared_pool",
            "Records naming a pool their engine never declared with a POOL record (skipped)",
        )
        undeclared.add_metric([], stats.records_undeclared_pool)
        yield orphaned
        yield undeclared
        guard = CounterMetricFamily(
            "kvguard_guard_aborts",
            "Requests an engine's guard (KVGUARD_GUARD) failed before foreign KV reached the client, by finding kind",
            labels=["kind"],
        )
        for kind, n in sorted(stats.guard_aborts.items()):
            guard.add_metric([kind], n)
        yield guard
        tiers = CounterMetricFamily(
            "kvguard_kv_tier_unverified",
            "Host / storage tier facts the sidecar could not check: loads of objects it never saw stored, "
            "stored objects forgotten at its bound",
            labels=["reason"],
        )
        tiers.add_metric(["load_of_unknown_object"], stats.loads_unverified)
        tiers.add_metric(["object_forgotten"], stats.objects_forgotten)
        yield tiers
        yield CounterMetricFamily(
            "kvguard_kv_tier_digests_compared",
            "Host / storage tier loads whose KV digest was compared with the digest taken when the object was stored",
            value=stats.load_digests_compared,
        )
        identity = CounterMetricFamily(
            "kvguard_page_identity_pages",
            "Pages of the engines' content identity records (KVGUARD_PAGE_IDENTITY): recorded for the pages "
            "a request wrote; of prefix-cache hits, matched or mismatched when judged, unknown when not",
            labels=["result"],
        )
        for result, n in stats.page_identity.items():
            identity.add_metric([result], n)
        yield identity
        yield from ttft_metrics(stats.ttft)
        yield from recording_metrics(getattr(svc, "recorder", None))
        shared = getattr(svc, "shared_ledger", None)  # the service's link to Redis, not the pipeline's
        yield from ledger_metrics(stats.ledger, shared.stats() if shared is not None else None, stats.engines)
        yield from sink_metrics(stats.sinks)


def engine_labels(engine: EngineStats) -> list[str]:
    """``role`` and ``pid`` of an engine's series (``unknown`` and ``0`` before its HELLO)."""
    return [engine.role, str(engine.pid) if engine.pid is not None else "0"]


def engine_metrics(engines: Sequence[EngineStats]):
    """Each engine's page model: reads judged and not, page ids refused, pages by state,
    and (from its HELLO on) its pool and context sizes."""
    reads = CounterMetricFamily("kvguard_page_reads_checked", "Page reads judged", labels=["role", "pid"])
    unverified = CounterMetricFamily(
        "kvguard_page_reads_unverified",
        "Page reads not judged (state unknown: blind window)",
        labels=["role", "pid"],
    )
    pages = GaugeMetricFamily("kvguard_pages", "KV pages by ownership state", labels=["role", "pid", "state"])
    pool = GaugeMetricFamily("kvguard_kv_pool_tokens", "KV pool size in tokens", labels=["role", "pid"])
    ctx = GaugeMetricFamily("kvguard_context_length_tokens", "Engine context length", labels=["role", "pid"])
    out_of_range = CounterMetricFamily(
        "kvguard_page_ids_out_of_range",
        "Page ids in records past the pool the engine announced (skipped)",
        labels=["role", "pid"],
    )
    for engine in engines:
        role, pid = engine_labels(engine)
        reads.add_metric([role, pid], engine.pages_read)
        unverified.add_metric([role, pid], engine.pages_unverified)
        out_of_range.add_metric([role, pid], engine.pages_out_of_range)
        for state, n in engine.pages_by_state.items():
            pages.add_metric([role, pid, state], n)
        if engine.pool_tokens is not None:  # from its HELLO on (as is the context length)
            pool.add_metric([role, pid], engine.pool_tokens)
        if engine.context_len is not None:
            ctx.add_metric([role, pid], engine.context_len)
    yield from (reads, unverified, out_of_range, pages, pool, ctx)
    yield from coverage_metrics(engines)
    yield from pool_metrics(engines)


def coverage_metrics(engines: Sequence[EngineStats]):
    """What each engine holds that kvguard watches or not (its COVERAGE, contract 1.5): an
    engine with a part unwatched is never shown as a quiet, healthy one. No series for an
    engine whose adapter sent no COVERAGE (before 1.5)."""
    gaps = GaugeMetricFamily(
        "kvguard_engine_coverage_gaps",
        "Components of the engine (pools, KV cache groups, state, draft models, transfer paths) kvguard does "
        "not fully watch (0: all of it)",
        labels=["role", "pid"],
    )
    watched = GaugeMetricFamily(
        "kvguard_engine_component_watched",
        "1 if kvguard watches every capability that applies to this component of the engine, else 0",
        labels=["role", "pid", "component"],
    )
    for engine in engines:
        n = engine.coverage_gaps
        if n is None:
            continue
        labels = engine_labels(engine)
        gaps.add_metric(labels, n)
        for entry in engine.coverage:
            watched.add_metric([*labels, entry.component], 1 if entry.status == "watched" else 0)
    yield from (gaps, watched)


def pool_metrics(engines: Sequence[EngineStats]):
    """The page models of engines' pools besides pool 0 (a sliding-window pool, a second KV cache
    group, recurrent state): their own series, with the pool's index and kind."""
    labels = ["role", "pid", "pool", "pool_kind"]
    pages = GaugeMetricFamily(
        "kvguard_pool_pages", "Pages of an engine's other pools by ownership state", labels=[*labels, "state"]
    )
    reads = CounterMetricFamily(
        "kvguard_pool_page_reads_checked", "Page reads judged in an engine's other pools", labels=labels
    )
    unverified = CounterMetricFamily(
        "kvguard_pool_page_reads_unverified", "Page reads not judged in an engine's other pools", labels=labels
    )
    for engine in engines:
        for p in engine.pools:
            base = [*engine_labels(engine), str(p.index), p.kind]
            reads.add_metric(base, p.pages_read)
            unverified.add_metric(base, p.pages_unverified)
            for state, n in p.pages_by_state.items():
                pages.add_metric([*base, state], n)
    yield from (pages, reads, unverified)


def ledger_metrics(ledger: LedgerStats, shared: SharedLedgerStats | None, engines: Sequence[EngineStats]):
    """The transfer ledger (sidecar/ledger): pairing outcomes per receiving engine and the shared
    ledger's health. Every engine has all four outcome series from its HELLO on, zeros included
    (only decode engines receive; the others' stay at 0, as the zero series of every panel and
    alert expect), so an alert on ``unpaired`` sees the first one as an increase."""
    transfers = CounterMetricFamily(
        "kvguard_transfers",
        "Completed KV transfers by receiving engine and how they were judged (paired, unverified, unpaired, warmup)",
        labels=["role", "pid", "outcome"],
    )
    for engine in engines:
        if not engine.announced:
            continue
        for outcome, n in ledger.transfers_by_engine[engine.engine_id].items():
            transfers.add_metric([*engine_labels(engine), outcome], n)
    yield transfers
    waiting = GaugeMetricFamily(
        "kvguard_transfers_open",
        "Decode reservations still waiting for their KV transfer (pages held, no transfer end, the request live)",
        labels=["role", "pid"],
    )
    oldest = GaugeMetricFamily(
        "kvguard_transfer_oldest_open_seconds",
        "Age of the oldest decode reservation still waiting for its KV transfer (0 when none)",
        labels=["role", "pid"],
    )
    for engine in engines:
        if not engine.announced:
            continue
        n, age_s = ledger.open_by_engine.get(engine.engine_id, (0, 0.0))
        waiting.add_metric(engine_labels(engine), n)
        oldest.add_metric(engine_labels(engine), age_s)
    yield waiting
    yield oldest
    digests = CounterMetricFamily(
        "kvguard_transfer_digests",
        "Transfers by what became of their digests: compared, incomparable (no common algorithm), "
        "sender_incomplete / receiver_incomplete (some ranks' partials, never every kv head)",
        labels=["outcome"],
    )
    digests.add_metric(["compared"], ledger.digests_compared)
    digests.add_metric(["incomparable"], ledger.digests_incomparable)
    for end in ("sender", "receiver"):
        digests.add_metric([f"{end}_incomplete"], ledger.digests_incomplete.get(end, 0))
    yield digests
    evicted = CounterMetricFamily(
        "kvguard_transfer_rooms_evicted",
        "Transfer rooms dropped to stay within the "
        "ledger's bounds (its share of --memory-budget, 100,000 rooms): oldest first",
    )
    evicted.add_metric([], ledger.rooms_evicted)
    yield evicted
    in_flight = ledger.in_flight
    held = GaugeMetricFamily(
        "kvguard_transfers_in_flight",
        "Transfer rooms with chunks sent whose sender has not completed (their pages are checked at the completion)",
    )
    held.add_metric([], in_flight.rooms)
    yield held
    ended = CounterMetricFamily(
        "kvguard_transfers_in_flight_ended",
        "Rooms in flight that ended: checked (the sender completed), unchecked (it failed, or never "
        "reported a completion), or dropped unchecked to stay within the bound",
        labels=["outcome"],
    )
    ended.add_metric(["checked"], in_flight.completed)
    ended.add_metric(["unchecked"], in_flight.unjudged)
    ended.add_metric(["dropped"], in_flight.dropped)
    yield ended
    degraded = GaugeMetricFamily("kvguard_ledger_degraded", "1 while the shared transfer ledger is unreachable")
    degraded.add_metric([], 1 if shared is not None and shared.degraded else 0)
    yield degraded
    errors = CounterMetricFamily(
        "kvguard_ledger_errors", "Shared transfer ledger problems, by reason", labels=["reason"]
    )
    for reason, attr in (
        ("redis", "errors"),
        ("queue_full", "queue_dropped"),
        ("outbox_full", "outbox_dropped"),
        ("bad_fact", "bad_facts"),
    ):
        errors.add_metric([reason], getattr(shared, attr) if shared is not None else 0)
    yield errors
    resynced = CounterMetricFamily(
        "kvguard_ledger_resynced",
        "Rooms registered and facts written again to the shared transfer ledger after a failed round trip "
        "or a failover (what a failed-over master may have lost)",
    )
    resynced.add_metric([], shared.resynced if shared is not None else 0)
    yield resynced
    failovers = CounterMetricFamily(
        "kvguard_ledger_failovers",
        "Times a master serving the shared transfer ledger's keys changed (Cluster, Sentinel)",
    )
    failovers.add_metric([], shared.failovers if shared is not None else 0)
    yield failovers


def sink_metrics(sinks: Sequence[SinkStats]):
    """Alert delivery (sidecar/sinks/delivery.py): only queued sinks (PagerDuty, Alertmanager)
    have results; the log and JSON-lines sinks write synchronously and cannot fail quietly."""
    if not sinks:  # no alert sink configured: nothing to label these with
        return
    events = CounterMetricFamily(
        "kvguard_sink_events", "Alert events by sink, action and result", labels=["sink", "action", "result"]
    )
    retries = CounterMetricFamily(
        "kvguard_sink_retries", "Delivery attempts retried (429, 5xx, timeout, refused connection)", labels=["sink"]
    )
    depth = GaugeMetricFamily("kvguard_sink_queue_depth", "Alert events waiting or in delivery", labels=["sink"])
    capacity = GaugeMetricFamily(
        "kvguard_sink_queue_capacity", "Size of the delivery queue (full: events dropped)", labels=["sink"]
    )
    last = GaugeMetricFamily(
        "kvguard_sink_last_success_timestamp_seconds",
        "Unix time of the last delivered event (0: none yet)",
        labels=["sink"],
    )
    for sink in sinks:
        for (action, result), n in sorted(sink.events.items()):
            events.add_metric([sink.name, action, result], n)
        retries.add_metric([sink.name], sink.retries)
        depth.add_metric([sink.name], sink.queue_depth)
        capacity.add_metric([sink.name], sink.queue_capacity)
        last.add_metric([sink.name], sink.last_success_s)
    yield from (events, retries, depth, capacity, last)


def recording_metrics(recorder):
    """--record-dir (sidecar/recorder/): whether records are being recorded. A failing
    recording (a full disk) never stops detection and is logged once per streak, so these
    are what tells an operator that the recording has a hole. Always exported (0 with no
    --record-dir), so that an alert and the metrics doc see one fixed set of families."""
    stats = recorder.stats if recorder is not None else None
    enabled = GaugeMetricFamily(
        "kvguard_recording_enabled", "1 when the sidecar records the record stream (--record-dir)"
    )
    enabled.add_metric([], 1 if recorder is not None else 0)
    yield enabled
    failing = GaugeMetricFamily(
        "kvguard_recording_failing",
        "1 while the recording cannot be written (full disk, "
        "I/O error): records are not recorded until a write succeeds again",
    )
    failing.add_metric([], 1 if recorder is not None and recorder.failing else 0)
    yield failing
    errors = CounterMetricFamily(
        "kvguard_recording_write_errors", "Recording writes that failed (each streak is logged once)"
    )
    errors.add_metric([], stats.write_errors if stats is not None else 0)
    yield errors
    missing = CounterMetricFamily(
        "kvguard_recording_records_not_recorded",
        "Records applied but missing from the recording (write or encode errors; replay reports the gap)",
    )
    missing.add_metric([], stats.records_not_recorded if stats is not None else 0)
    yield missing


def ttft_metrics(ttft: TTFTStats):
    """ttft_anomaly's deferred verdicts: suspects waiting for later requests, and those the
    later requests cleared (the engine had sped up). Always exported (0 while the detector
    is off), so that dashboards and the metrics doc see one fixed set of families."""
    waiting = GaugeMetricFamily(
        "kvguard_ttft_suspects_waiting",
        "Requests too fast against the past, waiting for later requests to confirm (ttft_anomaly)",
    )
    waiting.add_metric([], ttft.suspects_waiting)
    yield waiting
    cleared = CounterMetricFamily(
        "kvguard_ttft_suspects_cleared",
        "Suspects that later requests showed to be an engine speed-up, learned instead of flagged (ttft_anomaly)",
    )
    cleared.add_metric([], ttft.suspects_cleared)
    yield cleared
    explained = CounterMetricFamily(
        "kvguard_ttft_suspects_explained",
        "Suspects whose own forwards wrote their "
        "whole uncached prompt: prefilled, just fast; learned, not flagged (ttft_anomaly)",
    )
    explained.add_metric([], ttft.suspects_explained)
    yield explained

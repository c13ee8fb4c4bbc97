"""Incidents: findings grouped by root cause and reader, deduplicated, with a lifecycle.

An incident is keyed by (kind, engine, reader) — for findings without a reader
(double_free, events_lost, pool_smaller_than_context) by (kind, engine). Its id is
stable (a hash of that key), so a restarted sidecar or an offline replay names the
same incident the same way. Repeats update ``count``, ``last_seen_ns`` and the union
of pages and exposed parties; they are not re-delivered, unless they name an exposed
party the incident had not (a second tenant's KV read by the same request is news for
whoever notifies customers). An events_lost incident also
adds up its gaps: ``evidence.records_lost`` is the total of every gap it grouped (its
summary says so), each finding keeps its own gap's size.

Resolution: a read/write incident resolves when its reader request ends (the
condition cannot recur for that request); a config incident when the engine says
hello again with a safe configuration or goes away, a coverage_gap when it goes away
(the catalogue's ``WITH_ENGINE``); events_lost after
``quiet_resolve_ns`` without new losses (also double_free and ttft_anomaly).
Exposure incidents resolve as their reader ends because the condition has cleared,
not because the harm is undone: the incident keeps its exposed parties, and sinks
that page humans decide whether a resolve closes the page. Resolved incidents are delivered once more
(``state == "resolved"``) so PagerDuty-style sinks can close them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import xxhash

from .catalogue import AFTER_QUIET, BY_FIRST_PAGE, BY_READER, KINDS, WITH_ENGINE, kinds_with
from .findings import CRITICAL, Finding
from .stats import IncidentStats, KindAndSeverity

FIRING, RESOLVED = "firing", "resolved"
# What the store's memory estimate charges (tracemalloc-measured and rounded up:
# tests/sidecar/test_incidents.py keeps them honest). A bug that fires for every request of a busy
# engine makes thousands of incidents, each keeping its first findings with their page
# lists: 10,000 x 20 findings of a 150-page read were ~1.5 GB before the store had a byte bound.
INCIDENT_BYTES = 4_000  # an Incident with its dicts and summary, no page ids
STORED_FINDING_BYTES = 3_000  # one finding kept as a dict (Finding.to_dict), no page ids
PAGE_ID_BYTES = 40  # a page id kept in a set (the incident's unions) or a list (a stored finding): ~35 B measured
DEFAULT_MAX_BYTES = 32 << 20
SEVERITY_RANK = {"info": 0, "warning": 1, CRITICAL: 2}
# from the catalogue (sidecar/catalogue.py): the kinds that resolve after a quiet period
# rather than with their reader (a ttft verdict is made as the request ends;
# ledger_degraded repeats while it lasts)
QUIET_KINDS = kinds_with(resolves=AFTER_QUIET)
# ... and the kinds whose incidents last as long as their engine (pool_smaller_than_context,
# coverage_gap): resolved when it exits
ENGINE_KINDS = kinds_with(resolves=WITH_ENGINE)


def incident_key(f: Finding) -> tuple:
    engine = (f.engine.role, f.engine.rank, f.engine.pid)
    spec = KINDS.get(f.kind)
    by = spec.incident_by if spec is not None else BY_READER
    if by == BY_READER and f.reader is not None:
        return (f.kind, engine, f.reader.rid)
    if by == BY_FIRST_PAGE:
        return (f.kind, engine, tuple(f.pages[:1]))
    return (f.kind, engine, "")


def incident_id(key: tuple) -> str:
    return "inc-" + xxhash.xxh3_64_hexdigest(repr(key).encode())[:16]


@dataclass
class Incident:
    id: str
    kind: str
    severity: str
    engine: dict
    reader: dict | None
    state: str
    first_seen_ns: int
    last_seen_ns: int
    count: int
    summary: str
    pages: set = field(default_factory=set)
    exposed: dict = field(default_factory=dict)  # rid -> {"rid", "tenant", "pages": set}
    evidence: dict = field(default_factory=dict)
    resolved_ns: int = 0
    resolution: str = ""
    findings: list = field(default_factory=list)  # the first few findings, as dicts
    nbytes: int = INCIDENT_BYTES  # the memory estimate (IncidentStore.max_bytes)
    # whether the finding absorbed last named a party this incident had not named: the
    # pipeline delivers such a repeat (someone else's KV was exposed: another tenant to tell)
    exposed_grew: bool = False

    def absorb(self, f: Finding, max_findings: int) -> None:
        self.count += 1
        self.exposed_grew = False
        if self.kind == "events_lost":
            self._add_gap(f)
        self.last_seen_ns = max(self.last_seen_ns, f.first_seen_ns)
        if SEVERITY_RANK.get(f.severity, 0) > SEVERITY_RANK.get(self.severity, 0):
            self.severity = f.severity
        ids = len(self.pages)
        self.pages.update(f.pages)
        ids = len(self.pages) - ids
        for party in f.exposed:
            entry = self.exposed.get(party.rid)
            if entry is None:
                entry = self.exposed[party.rid] = {"rid": party.rid, "tenant": party.tenant, "pages": set()}
                self.nbytes += STORED_FINDING_BYTES // 4  # the party's dict
                self.exposed_grew = self.count > 1
            before = len(entry["pages"])
            entry["pages"].update(party.pages)
            ids += len(entry["pages"]) - before
        if len(self.findings) < max_findings:
            self.findings.append(f.to_dict())
            ids += len(f.pages) + sum(len(p.pages) for p in f.exposed)
            self.nbytes += STORED_FINDING_BYTES
        self.nbytes += ids * PAGE_ID_BYTES

    def _add_gap(self, f: Finding) -> None:
        """events_lost: the incident is the engine's blind window, so its evidence and summary
        carry the total of every gap it grouped (each finding keeps its own gap's size)."""
        if self.count == 1:  # the evidence is the first finding's: its gap is counted already
            self.evidence["gaps"] = 1
        else:
            self.evidence["records_lost"] = self.evidence.get("records_lost", 0) + f.evidence.get("records_lost", 0)
            self.evidence["gaps"] = self.evidence.get("gaps", 1) + 1
            self.evidence["last_missing_seq"] = f.evidence.get("first_missing_seq")
            self.evidence["engine_records_lost_total"] = f.evidence.get("engine_records_lost_total")
        total, gaps = self.evidence.get("records_lost", 0), self.evidence["gaps"]
        self.summary = (
            f"{self.engine['role']} rank {self.engine['rank']}: {total} records lost in {gaps} "
            f"gap{'s' if gaps != 1 else ''} (ring full or unreadable); page ownership is unknown until "
            f"pages are reallocated: reads in these windows are not verified"
        )

    def tenants_exposed(self) -> list[str]:
        return sorted({e["tenant"] or "?" for e in self.exposed.values()})

    def to_dict(self, with_findings: bool = False) -> dict:
        d = {
            "id": self.id,
            "kind": self.kind,
            "severity": self.severity,
            "state": self.state,
            "engine": self.engine,
            "reader": self.reader,
            "first_seen_ns": self.first_seen_ns,
            "last_seen_ns": self.last_seen_ns,
            "count": self.count,
            "summary": self.summary,
            "pages": sorted(self.pages),
            "tenants_exposed": self.tenants_exposed(),
            "exposed": [
                {"rid": e["rid"], "tenant": e["tenant"], "pages": sorted(e["pages"])} for e in self.exposed.values()
            ],
            "evidence": self.evidence,
            "resolved_ns": self.resolved_ns,
            "resolution": self.resolution,
        }
        if with_findings:
            d["findings"] = self.findings
        return d


class IncidentStore:
    """Bounded store of incidents: at most ``max_incidents``, and at most ``max_bytes`` by its
    estimate (the memory budget's share: sidecar/memory_budget.py). Past either, the oldest
    resolved incident goes first, else the oldest firing one other than the incident just
    updated (``evicted`` counts them). No I/O."""

    def __init__(
        self,
        max_incidents: int = 10_000,
        max_findings_per_incident: int = 20,
        quiet_resolve_ns: int = 300 * 10**9,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.max_incidents = max_incidents
        self.max_findings = max_findings_per_incident
        self.max_bytes = max_bytes
        self.quiet_resolve_ns = quiet_resolve_ns
        self.incidents: OrderedDict[str, Incident] = OrderedDict()
        self._by_reader: dict[tuple, set[str]] = {}
        self.nbytes = 0  # the estimate of every incident kept
        self.evicted = 0

    def observe(self, f: Finding) -> tuple[Incident, bool]:
        """File a finding; returns (incident, is_new). A resolved incident that recurs fires again."""
        key = incident_key(f)
        iid = incident_id(key)
        inc = self.incidents.get(iid)
        is_new = inc is None or inc.state == RESOLVED
        if inc is None:
            reader = None
            if f.reader is not None:
                reader = {"rid": f.reader.rid, "tenant": f.reader.tenant, "bootstrap_room": f.reader.bootstrap_room}
                if f.kind not in QUIET_KINDS:
                    self._by_reader.setdefault((f.engine.pid, f.reader.rid), set()).add(iid)
            inc = Incident(
                iid,
                f.kind,
                f.severity,
                {"role": f.engine.role, "rank": f.engine.rank, "pid": f.engine.pid},
                reader,
                FIRING,
                f.first_seen_ns,
                f.first_seen_ns,
                0,
                f.summary,
                evidence=dict(f.evidence),
            )
            self.incidents[iid] = inc
            self.nbytes += inc.nbytes
        elif inc.state == RESOLVED:
            inc.state, inc.resolved_ns, inc.resolution = FIRING, 0, ""
        before = inc.nbytes
        inc.absorb(f, self.max_findings)
        self.nbytes += inc.nbytes - before
        self._evict(keep=iid)
        return inc, is_new

    def _evict(self, keep: str) -> None:
        while (len(self.incidents) > self.max_incidents or self.nbytes > self.max_bytes) and len(self.incidents) > 1:
            victim = next((i for i in self.incidents.values() if i.state == RESOLVED), None)
            victim = victim or next(i for i in self.incidents.values() if i.id != keep)
            del self.incidents[victim.id]
            self.nbytes -= victim.nbytes
            self.evicted += 1
            if victim.reader is not None:  # its reader's end has nothing left to resolve
                ids = self._by_reader.get((victim.engine["pid"], victim.reader["rid"]))
                if ids is not None:
                    ids.discard(victim.id)
                    if not ids:
                        del self._by_reader[(victim.engine["pid"], victim.reader["rid"])]

    def on_request_end(self, pid: int, rid: str, ts_ns: int) -> list[Incident]:
        resolved = []
        for iid in self._by_reader.pop((pid, rid), ()):
            inc = self.incidents.get(iid)
            if inc is not None and inc.state == FIRING:
                self._resolve(inc, ts_ns, "the reading request ended")
                resolved.append(inc)
        return resolved

    def on_engine_hello(self, pid: int, role: str | None, safe: bool, ts_ns: int) -> list[Incident]:
        if not safe:
            return []
        return self._resolve_where(
            lambda i: i.kind == "pool_smaller_than_context" and i.engine["role"] == role and i.engine["pid"] == pid,
            ts_ns,
            "the engine reports a pool >= context",
        )

    def on_engine_gone(self, pid: int, ts_ns: int) -> list[Incident]:
        return self._resolve_where(
            lambda i: i.kind in ENGINE_KINDS and i.engine["pid"] == pid, ts_ns, "the engine exited"
        )

    def tick(self, now_ns: int) -> list[Incident]:
        """Resolve quiet incidents (events_lost, double_free) after ``quiet_resolve_ns`` without repeats."""
        return self._resolve_where(
            lambda i: i.kind in QUIET_KINDS and now_ns - i.last_seen_ns >= self.quiet_resolve_ns,
            now_ns,
            "no recurrence",
        )

    def _resolve_where(self, pred, ts_ns: int, why: str) -> list[Incident]:
        out = [i for i in self.incidents.values() if i.state == FIRING and pred(i)]
        for inc in out:
            self._resolve(inc, ts_ns, why)
        return out

    @staticmethod
    def _resolve(inc: Incident, ts_ns: int, why: str) -> None:
        inc.state, inc.resolved_ns, inc.resolution = RESOLVED, ts_ns, why

    def firing_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for inc in self.incidents.values():
            if inc.state == FIRING:
                out[inc.kind] = out.get(inc.kind, 0) + 1
        return out

    def stats(self) -> IncidentStats:
        """The store's figures (sidecar/stats.py). Open incidents are counted per (kind,
        severity): KVGuardDoubleFree pages on that gauge, so it carries the severity like
        kvguard_findings_total does. One pass over the store (at most ``max_incidents``)."""
        firing: dict[KindAndSeverity, int] = {}
        for inc in self.incidents.values():
            if inc.state == FIRING:
                firing[(inc.kind, inc.severity)] = firing.get((inc.kind, inc.severity), 0) + 1
        return IncidentStats(firing=firing, evicted=self.evicted)

    def list(
        self, state: str | None = None, kind: str | None = None, tenant: str | None = None, limit: int = 100
    ) -> list[Incident]:
        out = []
        for inc in reversed(self.incidents.values()):
            if state and inc.state != state or kind and inc.kind != kind:
                continue
            if tenant and tenant not in inc.tenants_exposed() and (inc.reader or {}).get("tenant") != tenant:
                continue
            out.append(inc)
            if len(out) >= limit:
                break
        return out

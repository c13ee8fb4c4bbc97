"""The finding catalogue: every kind the sidecar can raise, as data.

One entry per kind says everything the rest of kvguard needs to know about it, in the
spirit of Falco's rules file:

- ``severities``: the severities its detector can give it;
- ``switch``: what enables its detector (``ALWAYS`` or a sidecar option);
- ``incident_by``: how the incident store groups its findings (per reader request, per
  first page, or per engine) and ``resolves``: what resolves the incident;
- ``alerts``: per severity, the Prometheus alert that covers it (alerts/kvguard.rules.yaml):
  a kind that pages when critical has an alert named after it, the rest fall to the
  grouped ``KVGuardCriticalFinding`` / ``KVGuardWarningFinding`` or to an alert on a
  metric of its own;
- ``meaning``: the one line the runbook index and docs/detectors.md open with.

Read from it: :mod:`.finding_kinds` (the zero series in /metrics and the check every test
makes on emitted findings), :mod:`.incidents` (grouping and resolution), the detectors'
``kinds`` declarations, and tests/test_catalogue.py, which checks the rule file, the
runbooks and the detectors against it. docs/extending.md walks through adding a kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .findings import CRITICAL, WARNING

# switches (Pipeline / `kvguard sidecar` options)
ALWAYS = "always"
TTFT = "ttft_anomaly"  # on by default; kvguard sidecar --no-ttft-anomaly (Pipeline(ttft_anomaly=False))
ISOLATION = "isolate_tenants"  # kvguard sidecar --isolate-tenants
SHARED_LEDGER = "shared_ledger"  # a shared transfer ledger (Redis) is configured

# how incidents group findings (sidecar/incidents.py incident_key)
BY_READER = "reader"  # (kind, engine, the reader request): one incident per affected request
BY_FIRST_PAGE = "first_page"  # (kind, engine, the first page): one per bad free
BY_ENGINE = "engine"  # (kind, engine)

# what resolves an incident
WITH_READER = "reader_end"  # its reader request ended
AFTER_QUIET = "quiet"  # nothing new for the store's quiet period (repeats keep it firing)
WITH_ENGINE = "engine"  # the engine restarted healthy, or exited

# the grouped alerts: severities of kinds without an alert of their own
CRITICAL_CATCH_ALL = "KVGuardCriticalFinding"
WARNING_GROUPED = "KVGuardWarningFinding"  # one runbook section per kind (#kind)

RUNBOOKS = "docs/runbooks"


@dataclass(frozen=True)
class KindSpec:
    kind: str
    severities: tuple[str, ...]
    switch: str
    incident_by: str
    resolves: str
    alerts: dict[str, str]  # severity -> alert name
    meaning: str
    # alerts on a metric of their own rather than kvguard_findings_total (the findings
    # counter's grouped rules exclude these kinds at these severities)
    own_metric: tuple[str, ...] = field(default=())

    @property
    def pages(self) -> bool:
        """Its critical findings page through an alert named after it."""
        return self.alerts.get(CRITICAL) == alert_name(self.kind)

    def runbook(self, severity: str) -> str:
        """The runbook path (with its section for the grouped warning alert)."""
        alert = self.alerts[severity]
        return f"{RUNBOOKS}/{alert}.md" + (f"#{self.kind}" if alert == WARNING_GROUPED else "")


def alert_name(kind: str) -> str:
    """The dedicated alert of a kind: KVGuard + its CamelCase name."""
    return "KVGuard" + "".join(part.capitalize() for part in kind.split("_"))


def _paging(kind: str, meaning: str, *, warning: bool = False, resolves: str = WITH_READER, **kw) -> KindSpec:
    alerts = {CRITICAL: alert_name(kind)}
    if warning:
        alerts[WARNING] = WARNING_GROUPED
    sevs = (CRITICAL, WARNING) if warning else (CRITICAL,)
    return KindSpec(kind, sevs, ALWAYS, kw.pop("incident_by", BY_READER), resolves, alerts, meaning, **kw)


CATALOGUE: tuple[KindSpec, ...] = (
    _paging(
        "unwritten_read",
        "a request read pages reserved for it that nothing wrote for it (the 2026 incident); "
        "a warning when no one else's data is there",
        warning=True,
    ),
    _paging("foreign_read", "a request read pages that belong to other requests (Tier 2, and the engine's Tier 1)"),
    _paging("use_after_free", "a request read or wrote pages that are free in the allocator"),
    _paging("late_write", "a write landed in pages that now belong to another request"),
    _paging(
        "double_free",
        "pages freed while already free: one page may go to two requests",
        incident_by=BY_FIRST_PAGE,
        resolves=AFTER_QUIET,
    ),
    _paging("transfer_size_mismatch", "decode took a transfer with fewer tokens than it reserved"),
    _paging(
        "unwritten_send",
        "a sender shipped KV pages its request never wrote (stale or another request's KV goes to decode); "
        "a warning when no one else's data is there",
        warning=True,
    ),
    _paging(
        "checksum_mismatch",
        "the KV decode received is not the KV prefill sent (digests differ), or KV at rest changed with no "
        "write kvguard saw (evidence.via content)",
    ),
    KindSpec(
        "pool_smaller_than_context",
        (CRITICAL, WARNING),
        ALWAYS,
        BY_ENGINE,
        WITH_ENGINE,
        {CRITICAL: "KVPoolSmallerThanContext", WARNING: "KVPoolSmallerThanContext"},
        "an engine's KV pool is smaller than its context length (critical on a prefill node)",
        own_metric=(CRITICAL, WARNING),
    ),
    KindSpec(
        "orphan_transfer",
        (WARNING,),
        ALWAYS,
        BY_READER,
        WITH_READER,
        {WARNING: WARNING_GROUPED},
        "decode reserved pages for a transfer whose sender never sent (or gave up)",
    ),
    KindSpec(
        "events_lost",
        (WARNING,),
        ALWAYS,
        BY_ENGINE,
        AFTER_QUIET,
        {WARNING: "KVGuardEventsLost"},
        "an engine's ring overflowed: reads in the gap are not verified",
        own_metric=(WARNING,),
    ),
    KindSpec(
        "ledger_degraded",
        (WARNING,),
        SHARED_LEDGER,
        BY_ENGINE,
        AFTER_QUIET,
        {WARNING: WARNING_GROUPED},
        "the shared transfer ledger (Redis) is unreachable: cross-pod transfers wait unchecked",
    ),
    KindSpec(
        "ttft_anomaly",
        (WARNING,),
        TTFT,
        BY_READER,
        AFTER_QUIET,
        {WARNING: WARNING_GROUPED},
        "a first token came implausibly fast for the uncached prompt: its KV may not have been computed",
    ),
    KindSpec(
        "cross_salt_prefix_share",
        (CRITICAL,),
        ALWAYS,
        BY_READER,
        WITH_READER,
        {CRITICAL: CRITICAL_CATCH_ALL},
        "a prefix-cache page written under one cache salt / extra key was handed to a request of another",
    ),
    KindSpec(
        "coverage_gap",
        (WARNING,),
        ALWAYS,
        BY_ENGINE,
        WITH_ENGINE,
        {WARNING: WARNING_GROUPED},
        "an engine holds KV or state kvguard does not watch (a model shape or path it cannot follow): said once, "
        "never guessed at",
    ),
    KindSpec(
        "cross_tenant_prefix_share",
        (WARNING,),
        ISOLATION,
        BY_READER,
        WITH_READER,
        {WARNING: WARNING_GROUPED},
        "a prefix-cache page written by one tenant was read by another, and tenants are declared isolated",
    ),
)

KINDS: dict[str, KindSpec] = {spec.kind: spec for spec in CATALOGUE}


def kinds_with(**match) -> set[str]:
    """Kinds whose entry has these field values, e.g. ``kinds_with(resolves=AFTER_QUIET)``."""
    return {s.kind for s in CATALOGUE if all(getattr(s, k) == v for k, v in match.items())}


def paging_kinds() -> set[str]:
    return {s.kind for s in CATALOGUE if s.pages}


def routed_elsewhere(severity: str, grouped_alert: str) -> set[str]:
    """Kinds whose findings of ``severity`` go to another alert than ``grouped_alert``: the
    ``kind!~`` the grouped rule on kvguard_findings_total must exclude."""
    return {s.kind for s in CATALOGUE if severity in s.alerts and s.alerts[severity] != grouped_alert}

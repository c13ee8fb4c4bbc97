"""The finding catalogue: every kind the sidecar can raise, as data.

One entry per kind says everything the rest of kvguard needs to know about it, in the
spirit of Falco's rules file:

- ``severities``: the severities its detector can give it;
- ``switch``: what enables its detector (``ALWAYS`` or a sidecar option);
- ``incident_by``: how the incident store groups its findings (per reader request, per
  first page, or per engine) and ``resolves``: what resolves the incident;
- ``alerts``: per severity, the Prometheus alert that covers it (alerts/kvguard.rules.yaml):
  a kind that pages when critical has an alert named after it, whose rule is written from
  its ``alert`` text (:class:`AlertText`); the rest fall to the grouped
  ``KVGuardCriticalFinding`` / ``KVGuardWarningFinding`` or to an alert on a metric of its own;
- ``meaning``: the one line the runbook index and docs/detectors.md open with;
- ``read_exposure``: a request read KV another request wrote (the integrity dashboard's
  exposure panel, the demo's read findings).

Generated from it by ``make generate`` (:mod:`.generate`; the outputs are committed and
tests/sidecar/test_generated.py fails when they drift): the ``kvguard-findings`` rule group of
alerts/kvguard.rules.yaml (the paging kinds' rules, the grouped rules' ``kind!~`` lists,
the routing table), the finding tables of docs/runbooks/README.md, and the dashboards'
JSON (dashboards/src reads its kind lists from here). Read from it at run time:
:mod:`.finding_kinds` (the zero series in /metrics and the check every test makes on
emitted findings), :mod:`.incidents` (grouping and resolution), the detectors' ``kinds``
declarations and the demo's checks. tests/sidecar/test_catalogue.py checks the rule file, the
runbooks and the detectors against it. docs/extending.md walks through adding a kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .findings import CRITICAL, WARNING

# switches (Pipeline / `kvguard sidecar` options)
ALWAYS = "always"
TTFT = "ttft_anomaly"  # on by default; kvguard sidecar --no-ttft-anomaly (Pipeline(ttft_anomaly=False))
ISOLATION = "isolate_tenants"  # kvguard sidecar --isolate-tenants
PROBING = "detect_prefix_probing"  # kvguard sidecar --detect-prefix-probing (and --isolate-tenants)
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
class AlertText:
    """A paging kind's own alert rule, as ``make generate`` writes it (sidecar/generate.py).

    ``description`` is what follows the generated opening: "kvguard <instance> raised <n>
    new critical <kind> finding(s) in the last 5 minutes: " for a kind whose incidents end
    with their reader (the rule reads the findings window), "kvguard <instance> has <n>
    open critical <kind> incident(s) " for one that resolves otherwise (the rule reads
    ``kvguard_incidents_firing``, so the alert resolves with the incident). ``note`` is the
    comment above the rule."""

    summary: str
    description: str
    note: str = ""


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
    # the text of its own alert rule: every kind that pages has one, no other kind does
    alert: AlertText | None = None
    # a request read (attended over) KV another request wrote, or nothing wrote for it
    read_exposure: bool = False

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


def _paging(
    kind: str, meaning: str, alert: AlertText, *, warning: bool = False, resolves: str = WITH_READER, **kw
) -> KindSpec:
    alerts = {CRITICAL: alert_name(kind)}
    if warning:
        alerts[WARNING] = WARNING_GROUPED
    sevs = (CRITICAL, WARNING) if warning else (CRITICAL,)
    by = kw.pop("incident_by", BY_READER)
    return KindSpec(kind, sevs, ALWAYS, by, resolves, alerts, meaning, alert=alert, **kw)


CATALOGUE: tuple[KindSpec, ...] = (
    _paging(
        "unwritten_read",
        "a request read pages reserved for it that nothing wrote for it (the 2026 incident); "
        "a warning when no one else's data is there",
        AlertText(
            "A request read KV pages nothing wrote for it; its response may contain other tenants' data.",
            "a request attended over KV pages reserved for it that neither its own forward nor the KV transfer "
            "wrote, so it read what earlier requests left there (the 2026 incident). The reader, its tenant, "
            "the pages and the exposed tenants are in the sidecar's JSON findings.",
        ),
        warning=True,
        read_exposure=True,
    ),
    _paging(
        "foreign_read",
        "a request read pages that belong to other requests (Tier 2, and the engine's Tier 1)",
        AlertText(
            "A request read KV pages that belong to other requests.",
            "a request attended over KV pages it does not own (never assigned to it, or freed and handed to "
            "another request since). The reader, its tenant, the pages and the owners whose data it read are "
            "in the sidecar's JSON findings.",
        ),
        read_exposure=True,
    ),
    _paging(
        "use_after_free",
        "a request read or wrote pages that are free in the allocator",
        AlertText(
            "A request read or wrote KV pages that are free in the allocator.",
            "a request read KV pages that are free (it sees their last writer's data) or wrote into them (the "
            "next owner starts from its data). The request, its tenant, the pages and the last writers are in "
            "the sidecar's JSON findings.",
        ),
        read_exposure=True,
    ),
    _paging(
        "double_free",
        "pages freed while already free: one page may go to two requests",
        AlertText(
            "KV pages were freed while already free; the allocator may hand one page to two requests.",
            "(one per first page freed twice; each resolves after 5 minutes without a repeat): KV pages were "
            "freed twice, so the free list may hold them twice and two live requests can be given the same "
            "page and read each other's KV. The pages, the free path and the pages' last writers are in the "
            "sidecar's JSON findings.",
            "On the open-incident gauge, not the findings window: a double free has no reader whose end "
            "clears it, so the sidecar resolves its incident after a quiet period (5 minutes without a "
            "repeat, the same span as the window above) and this alert resolves with it, as the sidecar's "
            "own PagerDuty sink does. A gauge has no first-sample problem. tests/integration/test_alert_chain_engine.py "
            "drives this one through Alertmanager to a PagerDuty receiver and back (trigger, then resolve).",
        ),
        incident_by=BY_FIRST_PAGE,
        resolves=AFTER_QUIET,
    ),
    _paging(
        "late_write",
        "a write landed in pages that now belong to another request",
        AlertText(
            "KV was written into pages that already belong to another live request.",
            "a write (typically one that outlived its request's abort) landed in KV pages reassigned to another "
            "live request, whose KV now holds the writer's data. The writer, its tenant, the pages and the "
            "requests whose KV was overwritten are in the sidecar's JSON findings.",
        ),
    ),
    _paging(
        "transfer_size_mismatch",
        "decode took a transfer with fewer tokens than it reserved",
        AlertText(
            "Decode accepted a KV transfer that carried fewer tokens than it reserved.",
            "prefill sent fewer tokens than decode reserved and decode took the transfer as complete, so it "
            "generates over pages nothing filled (the 2026 incident: 1 page sent into 8 reserved). The request, "
            "its bootstrap room and sent/reserved tokens are in the sidecar's JSON findings.",
        ),
    ),
    _paging(
        "unwritten_send",
        "a sender shipped KV pages its request never wrote (stale or another request's KV goes to decode); "
        "a warning when no one else's data is there",
        AlertText(
            "Prefill sent KV pages its request never wrote; decode took another request's KV as the prompt's.",
            "a prefill engine shipped KV pages to decode that its request's forward had not written (ahead of "
            "the forward, or after the pages changed hands), so decode generates over what earlier requests "
            "left there. The sender, the decode request, the pages and the exposed tenants are in the "
            "sidecar's JSON findings.",
        ),
        warning=True,
    ),
    _paging(
        "checksum_mismatch",
        "the KV decode received is not the KV prefill sent (digests differ), or KV at rest changed with no "
        "write kvguard saw (evidence.via content)",
        AlertText(
            "The KV decode received differs from the KV prefill sent.",
            "the digest of a transferred KV cache differs between the prefill and decode ends, so decode "
            "generates from KV that is not the prompt's (corrupted, or another request's). The request, its "
            "bootstrap room and both digests are in the sidecar's JSON findings.",
        ),
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
        "prefix_content_mismatch",
        (CRITICAL,),
        ALWAYS,
        BY_READER,
        WITH_READER,
        {CRITICAL: CRITICAL_CATCH_ALL},
        "a prefix-cache hit handed a request a page holding another prefix or other positions than its own "
        "(the page's content identity differs; KVGUARD_PAGE_IDENTITY)",
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
    KindSpec(
        "prefix_probing",
        (WARNING,),
        PROBING,
        BY_ENGINE,
        AFTER_QUIET,
        {WARNING: WARNING_GROUPED},
        "one tenant's requests kept hitting prefixes another tenant's requests wrote, each prompt only a few "
        "tokens past the hit, at growing lengths: the pattern of recovering a prompt through the prefix cache",
    ),
)

KINDS: dict[str, KindSpec] = {spec.kind: spec for spec in CATALOGUE}


class _Kinds:
    """Every catalogue kind as an attribute whose value is the kind (``KIND.late_write ==
    "late_write"``). Detectors name their kinds through it, never by a literal: a kind the
    catalogue lacks fails when the detector's module is imported (every test run), not when a
    finding is first raised."""

    def __init__(self, kinds) -> None:
        self.__dict__.update({kind: kind for kind in kinds})

    def __getattr__(self, name: str) -> str:
        raise AttributeError(f"{name!r} is not a finding kind of sidecar/catalogue.py")


KIND = _Kinds(KINDS)


def kinds_with(**match) -> set[str]:
    """Kinds whose entry has these field values, e.g. ``kinds_with(resolves=AFTER_QUIET)``."""
    return {s.kind for s in CATALOGUE if all(getattr(s, k) == v for k, v in match.items())}


def paging_kinds() -> set[str]:
    return {s.kind for s in CATALOGUE if s.pages}


def read_exposure_kinds() -> tuple[str, ...]:
    """The kinds where a request read KV another request wrote, in catalogue order."""
    return tuple(s.kind for s in CATALOGUE if s.read_exposure)


def routed_elsewhere(severity: str, grouped_alert: str) -> set[str]:
    """Kinds whose findings of ``severity`` go to another alert than ``grouped_alert``: the
    ``kind!~`` the grouped rule on kvguard_findings_total must exclude."""
    return {s.kind for s in CATALOGUE if severity in s.alerts and s.alerts[severity] != grouped_alert}

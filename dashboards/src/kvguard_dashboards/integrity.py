"""kvguard / KV integrity: is anyone reading KV that is not theirs, and can we tell?

Four rows: the headline numbers; findings and incidents by kind and severity (with
the exposure kinds apart); coverage (records lost, reads kvguard could not verify, pages of
unknown state); and the pool-vs-context precondition of the 2026 incident.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row

from kvguard.sidecar.catalogue import read_exposure_kinds

from .common import INSTANCE, bars, base, blind_share, graph, note, q, raised, rate, single

UID = "kvguard-integrity"
# the kinds where a request read KV another request wrote, from the finding catalogue
EXPOSURE_KINDS = "|".join(read_exposure_kinds())
FINDINGS = "kvguard_findings_total"
INCIDENTS = "kvguard_incidents_total"
INCIDENTS_FIRING = "kvguard_incidents_firing"
GUARD_ABORTS = "kvguard_guard_aborts_total"

WHO_WAS_EXPOSED = """
Tenants and request ids are **never metric labels** (they are unbounded and name
customers), so no panel here can list them. The exposure panel says *that* requests
read KV other requests wrote, how many and on which sidecar. *Who*:

- the alert: `KVGuard<Kind>` in Alertmanager / PagerDuty carries `reader` and
  `exposed_tenants` annotations;
- the sidecar's incidents: `curl -H "Authorization: Bearer TOKEN"
  http://SIDECAR:9464/v1/incidents?state=firing` (reader, exposed requests and
  tenants, evidence; `docs/api.md`);
- the trace: the reader's request span carries the finding as a `kvguard.finding`
  event with the exposed tenants (`docs/tracing.md`).

Runbooks: `docs/runbooks/`.
"""


def headline_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Now"))
        .with_panel(
            single(
                "Incidents firing",
                "Unresolved incidents: requests that read KV not theirs and are still running, "
                "unpaired transfers, loss windows, misconfigured engines. One incident per kind, engine and reader, "
                "however many findings it repeats.",
                q(f"sum({INCIDENTS_FIRING}{{{INSTANCE}}}) or vector(0)", instant=True),
                steps=((None, "green"), (1, "red")),
            )
        )
        .with_panel(
            single(
                "Critical findings",
                "Critical findings raised since each sidecar started (all kinds, repeats "
                "included). Every kind of them pages.",
                q(f'sum({FINDINGS}{{severity="critical", {INSTANCE}}}) or vector(0)', instant=True),
                steps=((None, "green"), (1, "red")),
            )
        )
        .with_panel(
            single(
                "Engine rings attached",
                "Engine processes the sidecars watch now. 0: kvguard sees nothing (KVGuardNoRingsAttached).",
                q(f"sum(kvguard_rings_attached{{{INSTANCE}}})", instant=True),
                steps=((None, "red"), (1, "green")),
            )
        )
        .with_panel(
            single(
                "Records lost",
                "Records the engines dropped because a ring was full, since each sidecar started. "
                "Page ownership is unknown after a gap; reads there are not verified (KVGuardEventsLost).",
                q(f"sum(kvguard_records_lost_total{{{INSTANCE}}})", instant=True),
                steps=((None, "green"), (1, "orange")),
            )
        )
        .with_panel(
            single(
                "Blind reads",
                "Share of KV page reads kvguard could not judge over the last rate interval "
                "(page state unknown, or the reader unknown). Above 10% for 15m: KVGuardBlindReads.",
                q(blind_share(), instant=True),
                unit="percentunit",
                steps=((None, "green"), (0.1, "orange")),
            )
        )
        .with_panel(
            single(
                "Ingest lag",
                "Seconds since the slowest sidecar last drained its rings; normally under 0.1 s. A "
                "sidecar whose ingest thread died still answers scrapes, and this grows.",
                q(f"max(kvguard_ingest_last_poll_age_seconds{{{INSTANCE}}})", instant=True),
                unit="s",
                steps=((None, "green"), (1, "orange"), (5, "red")),
            )
        )
    )


def findings_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Findings and incidents"))
        .with_panel(
            graph(
                "Findings raised, by kind and severity",
                "Findings per rate interval, repeats included (a leaking request raises one per decode step). A "
                "kind's first finding shows too.",
                q(raised(FINDINGS, INSTANCE, "kind, severity"), "{{kind}} ({{severity}})"),
                bars=True,
                stacked=True,
            )
        )
        .with_panel(
            graph(
                "Incidents opened, by kind and severity",
                "Incidents opened per rate interval: the first finding of each kind, engine and reader, so for the "
                "read kinds the number of affected requests.",
                q(raised(INCIDENTS, INSTANCE, "kind, severity"), "{{kind}} ({{severity}})"),
                bars=True,
                stacked=True,
            )
        )
        .with_panel(
            graph(
                "Exposure: requests that read KV another request wrote",
                f"Critical {EXPOSURE_KINDS.replace('|', ', ')} incidents opened per rate interval: a request attended "
                "over pages that held another request's KV (possibly another tenant's). Who: the panel on the right.",
                q(
                    raised(INCIDENTS, f'kind=~"{EXPOSURE_KINDS}", severity="critical", {INSTANCE}', "kind, instance"),
                    "{{kind}} on {{instance}}",
                ),
                bars=True,
                stacked=True,
                span=8,
            )
        )
        .with_panel(
            graph(
                "Incidents firing, by kind",
                "Unresolved incidents. Read incidents resolve when their reader ends; "
                "the incident stays listed in /v1/incidents.",
                q(f"sum by (kind) ({INCIDENTS_FIRING}{{{INSTANCE}}})", "{{kind}}"),
                stacked=True,
                span=8,
            )
        )
        .with_panel(note("Who was exposed?", WHO_WAS_EXPOSED, span=8))
        .with_panel(
            bars(
                "Findings since sidecar start",
                "Findings raised since each sidecar started, by kind and severity.",
                q(f"sum by (kind, severity) ({FINDINGS}{{{INSTANCE}}})", "{{kind}} ({{severity}})", instant=True),
                steps=((None, "orange"),),
            )
        )
        .with_panel(
            bars(
                "Incidents since sidecar start",
                "Incidents opened since each sidecar started, by kind and severity.",
                q(f"sum by (kind, severity) ({INCIDENTS}{{{INSTANCE}}})", "{{kind}} ({{severity}})", instant=True),
                steps=((None, "orange"),),
            )
        )
        .with_panel(
            graph(
                "Prevented by the guard: requests failed in the engine",
                "Requests the engines' guard (KVGUARD_GUARD, docs/guard.md) failed through the engine's error path "
                "instead of serving them over other tenants' KV, by the finding kind it raised (action: aborted). "
                "Nobody was exposed; the engine still has the bug. Flat at 0 with the guard off.",
                q(raised(GUARD_ABORTS, INSTANCE, "kind, instance"), "{{kind}} on {{instance}}"),
                bars=True,
                stacked=True,
                span=24,
            )
        )
    )


def coverage_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Coverage: what kvguard could not check"))
        .with_panel(
            graph(
                "Records lost (ring full)",
                "Records dropped by the engines per rate interval, by sidecar. Raise "
                "KVGUARD_RING_BYTES or find why the sidecar falls behind.",
                q(
                    f"sum by (instance) (increase(kvguard_records_lost_total{{{INSTANCE}}}[$__rate_interval]))",
                    "{{instance}}",
                ),
                bars=True,
                span=8,
            )
        )
        .with_panel(
            graph(
                "Blind reads, by engine role",
                "Share of page reads kvguard could not judge. High after a sidecar "
                "start or lost records, falling as pages are reallocated. The dashed line is the alert's 10%.",
                q(blind_share(by="role"), "{{role}}"),
                unit="percentunit",
                threshold=0.1,
                span=8,
            )
        )
        .with_panel(
            graph(
                "Pages of unknown state, by engine role",
                "Share of each role's KV pages whose ownership kvguard "
                "does not know (not seen since it attached, or forgotten at a gap in the records).",
                q(
                    f'sum by (role) (kvguard_pages{{state="unknown", {INSTANCE}}}) / '
                    f"clamp_min(sum by (role) (kvguard_pages{{{INSTANCE}}}), 1)",
                    "{{role}}",
                ),
                unit="percentunit",
                span=8,
            )
        )
        .with_panel(
            graph(
                "Page reads per second: checked and unverified",
                "Reads judged against the ownership model and "
                "reads that could not be, by engine role. A flat line while the engine serves: the read probes "
                "are not firing.",
                q(rate("kvguard_page_reads_checked_total", INSTANCE, "role"), "{{role}} checked"),
                q(rate("kvguard_page_reads_unverified_total", INSTANCE, "role"), "{{role}} unverified"),
                unit="reqps",
                span=24,
            )
        )
    )


def config_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Configuration: KV pool vs context length"))
        .with_panel(
            bars(
                "KV pool / context length, per engine",
                "Pool tokens over advertised context length, from each "
                "engine's HELLO. Below 100%: a request can be longer than the pool, the precondition of the 2026 "
                "incident (KVPoolSmallerThanContext).",
                q(
                    "kvguard_kv_pool_tokens{" + INSTANCE + "} / on (instance, role, pid) "
                    "kvguard_context_length_tokens{" + INSTANCE + "}",
                    "{{role}} pid {{pid}} on {{instance}}",
                    instant=True,
                ),
                unit="percentunit",
                span=12,
                steps=((None, "red"), (1, "green")),
            )
        )
        .with_panel(
            graph(
                "KV pool and context length (tokens), per engine",
                "The two sides of the ratio on the left.",
                q(f"kvguard_kv_pool_tokens{{{INSTANCE}}}", "{{role}} pid {{pid}} pool"),
                q(f"kvguard_context_length_tokens{{{INSTANCE}}}", "{{role}} pid {{pid}} context"),
                span=12,
            )
        )
    )


def dashboard() -> Dashboard:
    d = base(
        "kvguard / KV integrity",
        UID,
        "KV-cache integrity findings, exposure, coverage (lost records, blind reads) and the pool-vs-context "
        "precondition, from the kvguard sidecars' /metrics (docs/metrics.md, docs/dashboards.md).",
    )
    for row in (headline_row, findings_row, coverage_row, config_row):
        d = row(d)
    return d

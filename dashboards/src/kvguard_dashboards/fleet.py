"""kvguard / incidents across the fleet: which clusters and sidecars have incidents, of what kind.

For a Prometheus (or Thanos, Mimir) that holds many sidecars, possibly of many clusters. The
cluster is the ``cluster`` label, as multi-cluster setups add it (an external label seen
through Thanos or Mimir, or a scrape relabeling); where there is none, every query still
works and the fleet is one unnamed cluster. Engines appear as the sidecar watches them
(``role`` on the engine metrics): incident metrics are per sidecar (docs/metrics.md), so the
engines behind a sidecar with an incident are listed beside it, not blamed one by one.

Who was exposed is never a metric label: the text panel says where it is (the incident, its
bundle, the finding's log record).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row

from kvguard.sidecar.catalogue import read_exposure_kinds

from .common import INSTANCE, bars, base, graph, label_variable, note, q, raised, single

UID = "kvguard-fleet"
EXPOSURE_KINDS = "|".join(read_exposure_kinds())
# every selector: the chosen clusters and sidecars (All: .*, which a series without the label matches)
FLEET = f'cluster=~"$cluster", {INSTANCE}'
FIRING = f"kvguard_incidents_firing{{{FLEET}}}"
INCIDENTS = "kvguard_incidents_total"

EXPOSED = f'kvguard_incidents_total{{kind=~"{EXPOSURE_KINDS}", severity="critical", {FLEET}}}'


def opened_in_range(sel: str) -> str:
    """A counter's growth over the dashboard's time range: its increase for a series that existed
    at the range's start, its whole value for one born inside it (a sidecar started, or a kind's
    first incident: increase() alone misses the first sample's count)."""
    return f"(increase({sel}[$__range]) and {sel} offset $__range) or {sel}"


WHERE_THE_DETAIL_IS = """
Metrics say **where** and **what kind**; the incident says **who**. For one incident:

- the sidecar's incident list: `${kvguard_api}/v1/incidents/view` (the dashboard link);
- one file for the engine team: `kvguard bundle INCIDENT --api http://SIDECAR:9464`
  (the incident, its timeline, a replayable recording, both ends' transfer facts,
  versions and settings: `docs/operations.md`, "Handing an incident to the engine team");
- in your log backend: every finding is an OpenTelemetry log record (event name
  `kvguard.finding`, attributes `kind`, `severity`, `reader.rid`, `exposed.tenant`,
  `kvguard.incident.id`, linked to the reader's trace): `docs/tracing.md`, "Findings as logs".
"""


def now_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("The fleet now"))
        .with_panel(
            single(
                "Incidents firing",
                "Unresolved incidents on every chosen sidecar of every chosen cluster.",
                q(f"sum({FIRING}) or vector(0)", instant=True),
                steps=((None, "green"), (1, "red")),
                span=6,
            )
        )
        .with_panel(
            single(
                "Clusters with an incident firing",
                "Clusters (the cluster label; one unnamed cluster where there is none) where at least one "
                "sidecar has an unresolved incident.",
                q(f"count(sum by (cluster) ({FIRING}) > 0) or vector(0)", instant=True),
                steps=((None, "green"), (1, "red")),
                span=6,
            )
        )
        .with_panel(
            single(
                "Sidecars with an incident firing",
                "Sidecars (one per engine pod) with at least one unresolved incident.",
                q(f"count(sum by (cluster, instance) ({FIRING}) > 0) or vector(0)", instant=True),
                steps=((None, "green"), (1, "red")),
                span=6,
            )
        )
        .with_panel(
            single(
                "Exposure incidents opened in the time range",
                f"Critical {EXPOSURE_KINDS.replace('|', ', ')} incidents opened over the dashboard's time range: "
                "requests that read KV another request wrote, across the fleet.",
                q(f"sum({opened_in_range(EXPOSED)}) or vector(0)", instant=True),
                steps=((None, "green"), (1, "red")),
                span=6,
            )
        )
    )


def where_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Where"))
        .with_panel(
            bars(
                "Incidents firing, by cluster",
                "Unresolved incidents per cluster.",
                q(f"sum by (cluster) ({FIRING})", "{{cluster}}", instant=True),
                steps=((None, "green"), (1, "red")),
                span=8,
            )
        )
        .with_panel(
            bars(
                "Incidents firing, by sidecar and kind",
                "Unresolved incidents per sidecar and finding kind: which pods to look at, and for what.",
                q(
                    f"sum by (cluster, instance, kind) ({FIRING}) > 0",
                    "{{cluster}} {{instance}}: {{kind}}",
                    instant=True,
                ),
                steps=((None, "red"),),
                span=16,
            )
        )
        .with_panel(
            bars(
                "Engines behind the sidecars with incidents firing",
                "The engine processes (by role) each sidecar with an unresolved incident watches: the pods whose "
                "engines the incidents are about. `kvguard bundle` on the sidecar gives the engine's version and model.",
                q(
                    f"count by (cluster, instance, role) (kvguard_kv_pool_tokens{{{FLEET}}}) "
                    f"and on (cluster, instance) (sum by (cluster, instance) ({FIRING}) > 0)",
                    "{{cluster}} {{instance}} {{role}}",
                    instant=True,
                ),
                steps=((None, "orange"),),
                span=12,
            )
        )
        .with_panel(note("Who, and the detail", WHERE_THE_DETAIL_IS, span=12))
    )


def trend_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Over time"))
        .with_panel(
            graph(
                "Incidents opened, by cluster and kind",
                "Incidents opened per rate interval across the fleet (a kind's first one included).",
                q(raised(INCIDENTS, FLEET, "cluster, kind"), "{{cluster}}: {{kind}}"),
                bars=True,
                stacked=True,
            )
        )
        .with_panel(
            graph(
                "Exposure incidents opened, by cluster and sidecar",
                f"Critical {EXPOSURE_KINDS.replace('|', ', ')} incidents opened per rate interval, by cluster and sidecar.",
                q(
                    raised(INCIDENTS, f'kind=~"{EXPOSURE_KINDS}", severity="critical", {FLEET}', "cluster, instance"),
                    "{{cluster}} {{instance}}",
                ),
                bars=True,
                stacked=True,
            )
        )
        .with_panel(
            graph(
                "Incidents firing over time, by cluster",
                "Unresolved incidents per cluster over time.",
                q(f"sum by (cluster) ({FIRING})", "{{cluster}}"),
                stacked=True,
                span=24,
            )
        )
    )


def dashboard() -> Dashboard:
    d = base(
        "kvguard / incidents across the fleet",
        UID,
        "kvguard incidents across clusters, sidecars and their engines, from the sidecars' /metrics "
        "(docs/dashboards.md). The cluster is the `cluster` label where the Prometheus has one.",
    ).with_variable(label_variable("cluster", "Cluster", "kvguard_rings_attached"))
    for row in (now_row, where_row, trend_row):
        d = row(d)
    return d

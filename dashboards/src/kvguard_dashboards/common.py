"""What every kvguard dashboard shares: the variables, the query helpers, the panel kinds.

Queries are plain PromQL strings on the metrics of docs/metrics.md. Every selector
carries ``instance=~"$instance"`` (the sidecars to show, all by default), and rates use
``$__rate_interval``, which Grafana derives from the datasource's scrape interval
(``timeInterval`` in provisioning/datasources/kvguard-prometheus.yaml).

NOTE: tenants and request ids are never metric labels (docs/metrics.md, "Labels"). A
dashboard says *that* someone's KV was read and where; who was exposed is in the
finding and the incident (``GET /v1/incidents``, the alert's ``exposed_tenants``).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import bargauge, prometheus, stat, text, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders.dashboard import (
    AnnotationQuery,
    Dashboard,
    DashboardLink,
    DatasourceVariable,
    QueryVariable,
    TextBoxVariable,
    ThresholdsConfig,
)
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat
from grafana_foundation_sdk.models.text import TextMode

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# every selector narrows to the chosen sidecars; $instance is multi-value with All = .*
INSTANCE = 'instance=~"$instance"'
TAGS = ["kvguard"]
ALL = VariableOption(selected=True, text=["All"], value=["$__all"])


# an incident opened in the interval, per kind and severity: the dashboards' annotation
INCIDENTS_OPENED = (
    f"sum by (instance, kind, severity) (increase(kvguard_incidents_total{{{INSTANCE}}}[$__interval])) > 0"
)
# the sidecars' incident views (sidecar/incident_view.py), where the operator set where /v1 is
# reachable for Grafana users (behind its token: docs/operations.md, "The incident view")
INCIDENT_VIEWS_URL = "${kvguard_api}/v1/incidents/view"


def base(title: str, uid: str, description: str) -> Dashboard:
    """A dashboard with the Prometheus datasource and sidecar variables, last hour, 30 s refresh;
    every incident kvguard opens as an annotation, and a link to the sidecars' incident views."""
    return (
        Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
        .with_variable(label_variable("instance", "Sidecar", "kvguard_rings_attached"))
        .with_variable(
            TextBoxVariable("kvguard_api")
            .label("kvguard /v1 URL")
            .description(
                "where Grafana users reach a sidecar's /v1 (its token added by a proxy, or through "
                "kubectl port-forward): the incident-views link opens ${kvguard_api}/v1/incidents/view"
            )
        )
        .annotation(
            AnnotationQuery()
            .name("kvguard incidents")
            .datasource(DATASOURCE)
            .expr(INCIDENTS_OPENED)
            .enable(True)
            .icon_color("red")
        )
        .link(
            DashboardLink("kvguard incident views")
            .type("link")
            .url(INCIDENT_VIEWS_URL)
            .tooltip("the incident list of the sidecar at $kvguard_api (sidecar/incident_view.py)")
            .target_blank(True)
            .icon("external link")
        )
    )


def label_variable(name: str, label: str, metric: str) -> QueryVariable:
    """A multi-value variable over the values of ``name`` on ``metric``; All means ``.*``."""
    return (
        QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({metric}, {name})")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(ALL)
    )


# ---------------------------------------------------------------------- queries
def q(expr: str, legend: str = "", instant: bool = False, table: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto")
    if instant:
        query = query.instant()
    else:
        query = query.range()
    if table:
        query = query.format(PromQueryFormat.TABLE)
    return query


def raised(metric: str, matchers: str, by: str) -> str:
    """Counter growth per ``$__rate_interval``, including a series' first sample.

    The sidecar exports every finding it can raise at 0 from the start, so these
    panels show 0 rather than "no data", and its growth from 0 is what ``increase()``
    sees. A series can still appear already nonzero (a new sidecar whose first poll
    drains findings, a sidecar restart in a scrape gap: docs/metrics.md, "Counters and
    first samples"), and ``increase()`` needs two samples. The ``unless ... offset``
    clause shows the value of a series that did not exist one interval earlier, the
    same rule as the alerts use.
    """
    sel = f"{metric}{{{matchers}}}"
    return f"sum by ({by}) (increase({sel}[$__rate_interval]) or ({sel} unless {sel} offset $__rate_interval))"


def rate(metric: str, matchers: str, by: str = "") -> str:
    head = f"sum by ({by}) " if by else "sum"
    return f"{head}(rate({metric}{{{matchers}}}[$__rate_interval]))"


def blind_share(by: str = "", matchers: str = INSTANCE) -> str:
    """Unverified / (checked + unverified) page reads; 0 while nothing is read."""
    checked = rate("kvguard_page_reads_checked_total", matchers, by)
    unverified = rate("kvguard_page_reads_unverified_total", matchers, by)
    return f"{unverified} / clamp_min({checked} + {unverified}, 1e-9)"


# ---------------------------------------------------------------------- panels
def _thresholds(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(v, c) for v, c in steps])


def _with_targets(panel, targets):
    for i, target in enumerate(targets):
        panel = panel.with_target(target.ref_id(chr(ord("A") + i)))
    return panel


def graph(
    title: str,
    description: str,
    *targets: prometheus.Dataquery,
    unit: str = "short",
    span: int = 12,
    height: int = 8,
    bars: bool = False,
    stacked: bool = False,
    threshold: float | None = None,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .span(span)
        .height(height)
        .draw_style(common.GraphDrawStyle.BARS if bars else common.GraphDrawStyle.LINE)
        .fill_opacity(60 if bars or stacked else 10)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["max", "lastNotNull"])
        )
        .tooltip(
            common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    if threshold is not None:
        panel = panel.thresholds(_thresholds((None, "green"), (threshold, "red"))).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)
        )
    return _with_targets(panel, targets)


def single(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    unit: str = "short",
    span: int = 4,
    steps: tuple[tuple[float | None, str], ...] = ((None, "green"),),
) -> stat.Panel:
    panel = (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(span)
        .height(4)
        .thresholds(_thresholds(*steps))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    return _with_targets(panel, [target])


def bars(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    unit: str = "short",
    span: int = 12,
    height: int = 8,
    steps: tuple[tuple[float | None, str], ...] = ((None, "green"),),
) -> bargauge.Panel:
    panel = (
        bargauge.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .span(span)
        .height(height)
        .thresholds(_thresholds(*steps))
        .display_mode(common.BarGaugeDisplayMode.BASIC)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    return _with_targets(panel, [target])


def note(title: str, markdown: str, span: int = 12, height: int = 8) -> text.Panel:
    return text.Panel().title(title).mode(TextMode.MARKDOWN).content(markdown.strip() + "\n").span(span).height(height)


def number_panels(model) -> None:
    """Give panels stable ids 1..n in layout order (Grafana links panels by id: ``viewPanel=``)."""
    for i, panel in enumerate(model.panels, 1):
        panel.id_val = i

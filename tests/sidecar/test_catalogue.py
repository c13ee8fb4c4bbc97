"""The finding catalogue (sidecar/catalogue.py) against everything that depends on it.

Every kind in the catalogue has: a detector that declares it (and no detector declares
a kind the catalogue lacks), a zero series in /metrics once its switch is on, a runbook
(a section of its own in the grouped warning runbook), a row in the runbook index, and
for the kinds that page an alert named after it with promtool cases where it fires and
where it stays quiet. The grouped rules exclude exactly the kinds routed elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvguard.sidecar import catalogue
from kvguard.sidecar.catalogue import CATALOGUE, CRITICAL_CATCH_ALL, KINDS, WARNING_GROUPED, alert_name
from kvguard.sidecar.findings import CRITICAL, WARNING
from kvguard.sidecar.metrics import KVGuardCollector
from kvguard.sidecar.pipeline import Pipeline
from kvguard.sidecar.service import Sidecar

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "kvguard.rules.yaml"


def all_switches_on() -> Pipeline:
    """A pipeline with every detector switched on (a stand-in shared ledger: only its presence counts)."""
    return Pipeline(isolate_tenants=True, ttft_anomaly=True, shared_ledger=object())


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def alert_cases() -> list[dict]:
    files = sorted((REPO / "alerts" / "tests").glob("*.yaml"))
    return [c for f in files for t in yaml.safe_load(f.read_text())["tests"] for c in t.get("alert_rule_test", [])]


def kind_selector(alert: dict, op: str) -> set[str]:
    m = re.search(r'kind%s"([^"]*)"' % re.escape(op), alert["expr"])
    return set(m.group(1).split("|")) if m else set()


def test_every_entry_is_well_formed():
    assert len(KINDS) == len(CATALOGUE)
    for spec in CATALOGUE:
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", spec.kind), spec.kind
        assert spec.severities and set(spec.severities) <= {CRITICAL, WARNING}, spec.kind
        assert set(spec.alerts) == set(spec.severities), f"{spec.kind}: one alert per severity"
        assert spec.switch in {
            catalogue.ALWAYS,
            catalogue.TTFT,
            catalogue.ISOLATION,
            catalogue.PROBING,
            catalogue.SHARED_LEDGER,
        }
        assert spec.incident_by in {catalogue.BY_READER, catalogue.BY_FIRST_PAGE, catalogue.BY_ENGINE}
        assert spec.resolves in {catalogue.WITH_READER, catalogue.AFTER_QUIET, catalogue.WITH_ENGINE}
        assert set(spec.own_metric) <= set(spec.severities)
        assert spec.meaning.strip(), spec.kind


def test_every_kind_has_a_detector_that_declares_it_and_no_detector_raises_an_unknown_kind():
    declared: dict[str, list[str]] = {}
    for detector in all_switches_on().detectors:
        assert detector.kinds and detector.events, type(detector).__name__
        for kind in detector.kinds:
            declared.setdefault(kind, []).append(type(detector).__name__)
    assert sorted(set(KINDS) - set(declared)) == [], "catalogue kinds no detector declares"
    assert sorted(set(declared) - set(KINDS)) == [], "kinds detectors declare that the catalogue lacks"


def test_every_kind_and_severity_has_a_zero_series_once_its_switch_is_on(tmp_path):
    sidecar = Sidecar(str(tmp_path))
    sidecar.pipeline = all_switches_on()
    registry = CollectorRegistry()
    registry.register(KVGuardCollector(sidecar))
    for spec in CATALOGUE:
        for severity in spec.severities:
            labels = {"kind": spec.kind, "severity": severity}
            assert registry.get_sample_value("kvguard_findings_total", labels) == 0, labels
            assert registry.get_sample_value("kvguard_incidents_total", labels) == 0, labels


@pytest.mark.parametrize("spec", CATALOGUE, ids=lambda s: s.kind)
def test_every_kind_has_its_runbook(spec):
    for severity in spec.severities:
        path, _, section = spec.runbook(severity).partition("#")
        runbook = REPO / path
        assert runbook.is_file(), f"{spec.kind} ({severity}): no runbook {path}"
        if section:
            headings = set(re.findall(r"^## `(\w+)`", runbook.read_text(), re.M))
            assert section in headings, f"{path}: no section ## `{section}`"
    index = (REPO / "docs" / "runbooks" / "README.md").read_text()
    for alert in set(spec.alerts.values()):
        assert f"[{alert}]({alert}.md)" in index, f"docs/runbooks/README.md does not list {alert}"


@pytest.mark.parametrize("spec", [s for s in CATALOGUE if s.pages], ids=lambda s: s.kind)
def test_every_paging_kind_has_its_alert_with_cases_where_it_fires_and_where_it_is_quiet(spec):
    name = alert_name(spec.kind)
    (rule,) = [a for a in alerts() if a["alert"] == name]
    assert kind_selector(rule, "=") == {spec.kind}
    assert rule["labels"]["severity"] == "critical" and 'severity="critical"' in rule["expr"]
    cases = [c for c in alert_cases() if c["alertname"] == name]
    assert any(c.get("exp_alerts") for c in cases), f"{name}: no promtool case where it fires"
    assert any(not c.get("exp_alerts") for c in cases), f"{name}: no promtool case where it stays quiet"


def test_the_grouped_rules_exclude_exactly_the_kinds_routed_elsewhere():
    named = {a["alert"]: a for a in alerts() if "kvguard_findings" in a["expr"]}
    assert kind_selector(named[CRITICAL_CATCH_ALL], "!~") == catalogue.routed_elsewhere(CRITICAL, CRITICAL_CATCH_ALL)
    assert kind_selector(named[WARNING_GROUPED], "!~") == catalogue.routed_elsewhere(WARNING, WARNING_GROUPED)


def test_kinds_on_metrics_of_their_own_are_alerted_without_the_findings_counter():
    by_name: dict[str, list[dict]] = {}
    for a in alerts():
        by_name.setdefault(a["alert"], []).append(a)
    for spec in CATALOGUE:
        for severity in spec.own_metric:
            rules = [a for a in by_name[spec.alerts[severity]] if a["labels"]["severity"] == severity]
            assert rules and all("kvguard_findings" not in a["expr"] for a in rules), (spec.kind, severity)


def test_every_kind_is_defined_in_docs_detectors():
    headings = set(re.findall(r"^## (\w+) \(", (REPO / "docs" / "detectors.md").read_text(), re.M))
    assert sorted(set(KINDS) - headings) == [], "kinds without a '## kind (severity)' section in docs/detectors.md"


def test_the_extending_guide_quotes_the_code_as_it_is():
    """docs/extending.md walks through events_lost: its code blocks are the tree's code."""
    guide = (REPO / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert len(blocks) == 3
    sources = {
        0: REPO / "sidecar" / "detectors" / "gaps.py",
        1: REPO / "sidecar" / "page_records.py",
        2: REPO / "sidecar" / "catalogue.py",
    }
    for i, path in sources.items():
        assert blocks[i].strip() in path.read_text(), f"docs/extending.md block {i + 1} is not in {path.name}"

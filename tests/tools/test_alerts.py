"""alerts/kvguard.rules.yaml: loaded and unit-tested by the real promtool, loaded into a
real Prometheus that scrapes a real ``kvguard sidecar``, and held to the conventions
statically.

promtool and prometheus come from Debian's ``prometheus`` package (``make apt``; CI
installs it). Without them those tests are skipped with the reason; the static checks
run everywhere.

Conventions checked here (see the header of the rule file):
- every alert: CamelCase ``KV*`` name, ``severity`` critical (pages) or warning
  (tickets), ``summary``, ``description``, ``runbook_url`` pointing at an existing
  ``docs/runbooks/<alertname>.md`` with the five runbook sections;
- every (alert, severity) has a promtool case where it fires and every alert a case
  where it stays quiet; every recording rule has an expression test;
- each finding (kind, severity) is routed to exactly one alert;
- every kvguard metric a rule reads is documented in docs/metrics.md (which
  tests/sidecar/test_metrics_doc.py ties to what the sidecar exports).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from kvguard.demo.engine_env import free_port
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar import catalogue

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "kvguard.rules.yaml"
TESTS = sorted((REPO / "alerts" / "tests").glob("*.yaml"))
RUNBOOK_PREFIX = "https://github.com/kvguard/kvguard/blob/main/"
RUNBOOK_SECTIONS = [
    "## What it means",
    "## How bad",
    "## First 5 minutes",
    "## Whom to notify",
    "## Confirm it is fixed",
]
# from the catalogue (sidecar/catalogue.py): the kinds that page with an alert of their own,
# the kinds alerted through a metric of their own (kind -> (alert, severities)), and the
# warning kinds whose runbook is a section of the grouped warning runbook
PAGING_KINDS = catalogue.paging_kinds()
KINDS_WITH_OWN_METRIC = {
    s.kind: (s.alerts[s.own_metric[0]], set(s.own_metric)) for s in catalogue.CATALOGUE if s.own_metric
}
WARNING_KINDS = {s.kind for s in catalogue.CATALOGUE if s.alerts.get("warning") == catalogue.WARNING_GROUPED}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`: run `make apt`)")
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def alerts() -> list[dict]:
    return [r for r in rules() if "alert" in r]


def alert_cases() -> list[dict]:
    return [
        case for f in TESTS for t in yaml.safe_load(f.read_text())["tests"] for case in t.get("alert_rule_test", [])
    ]


def expr_tests() -> list[dict]:
    return [
        case for f in TESTS for t in yaml.safe_load(f.read_text())["tests"] for case in t.get("promql_expr_test", [])
    ]


def kind_selector(alert: dict, op: str) -> set[str]:
    """Kinds named by the alert's ``kind="x"`` (op "=") or ``kind!~"a|b"`` (op "!~") matcher."""
    m = re.search(r'kind%s"([^"]*)"' % re.escape(op), alert["expr"])
    return set(m.group(1).split("|")) if m else set()


def camel(kind: str) -> str:
    return "".join(part.capitalize() for part in kind.split("_"))


# ---------------------------------------------------------------------------- promtool
def test_promtool_check_rules_accepts_the_rule_file():
    result = run_promtool("check", "rules", str(RULES.relative_to(REPO)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_pass():
    assert TESTS, "no promtool test files under alerts/tests/"
    result = run_promtool("test", "rules", *(str(t.relative_to(REPO)) for t in TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------------------- conventions
@pytest.mark.parametrize("alert", alerts(), ids=lambda a: f"{a['alert']}-{a['labels'].get('severity')}")
def test_every_alert_has_severity_summary_description_and_an_existing_runbook(alert):
    name = alert["alert"]
    assert re.fullmatch(r"KV(Guard)?[A-Z][A-Za-z]+", name), f"{name}: not a CamelCase KVGuard* name"
    assert alert["labels"]["severity"] in {"critical", "warning"}
    annotations = alert["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    url = annotations["runbook_url"]
    assert url.startswith(RUNBOOK_PREFIX), url
    path = url[len(RUNBOOK_PREFIX) :].split("#", 1)[0]
    assert path == f"docs/runbooks/{name}.md", f"{name}: runbook_url must point at its own runbook, got {path}"
    runbook = (REPO / path).read_text()
    assert runbook.startswith(f"# {name}\n"), f"{path}: must start with '# {name}'"
    missing = [s for s in RUNBOOK_SECTIONS if f"\n{s}\n" not in runbook]
    assert missing == [], f"{path}: missing sections {missing}"


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_does_not():
    cases = alert_cases()
    fired = {(c["alertname"], a["exp_labels"]["severity"]) for c in cases for a in c.get("exp_alerts") or []}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    wanted = {(a["alert"], a["labels"]["severity"]) for a in alerts()}
    assert sorted(wanted - fired) == [], "(alert, severity) never seen firing in alerts/tests/"
    assert sorted({a for a, _ in wanted} - quiet) == [], "alerts never checked to stay quiet in alerts/tests/"
    assert sorted({c["alertname"] for c in cases} - {a for a, _ in wanted}) == [], "cases for unknown alerts"


def test_every_recording_rule_has_an_expression_test():
    recorded = {r["record"] for r in rules() if "record" in r}
    tested = {name for t in expr_tests() for name in recorded if name in t["expr"]}
    assert sorted(recorded - tested) == []


def test_every_paging_kind_has_its_own_critical_alert_named_after_it():
    by_kind = {}
    for alert in alerts():
        for kind in kind_selector(alert, "="):
            by_kind[kind] = alert
    for kind in sorted(PAGING_KINDS):
        alert = by_kind.get(kind)
        assert alert is not None, f"no alert for {kind}"
        assert alert["alert"] == "KVGuard" + camel(kind)
        assert alert["labels"]["severity"] == "critical" and 'severity="critical"' in alert["expr"]


def test_each_finding_kind_and_severity_is_routed_to_exactly_one_alert():
    named = {a["alert"]: a for a in alerts()}
    dedicated = set().union(*(kind_selector(a, "=") for a in alerts()))
    own = {sev: {k for k, (_, sevs) in KINDS_WITH_OWN_METRIC.items() if sev in sevs} for sev in ("critical", "warning")}
    # the catch-alls exclude exactly the kinds alerted elsewhere at their severity
    assert kind_selector(named["KVGuardCriticalFinding"], "!~") == dedicated | own["critical"]
    assert kind_selector(named["KVGuardWarningFinding"], "!~") == own["warning"]
    for kind, (alert, severities) in KINDS_WITH_OWN_METRIC.items():
        assert {a["labels"]["severity"] for a in alerts() if a["alert"] == alert} == severities, kind
        assert "kvguard_findings" not in named[alert]["expr"], kind


def test_the_grouped_warning_runbook_has_a_section_per_kind():
    url = next(a for a in alerts() if a["alert"] == "KVGuardWarningFinding")["annotations"]["runbook_url"]
    assert url.endswith("#{{ $labels.kind }}")
    runbook = (REPO / "docs/runbooks/KVGuardWarningFinding.md").read_text()
    headings = set(re.findall(r"^## `(\w+)`", runbook, re.M))
    assert sorted(WARNING_KINDS - headings) == []


def test_rules_read_only_documented_metrics():
    doc = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^### `(kvguard_\w+)`", doc, re.M))
    used = set()
    for rule in rules():
        used |= set(re.findall(r"(?<![\w:])(kvguard_[a-z0-9_]+)(?![\w:])", rule["expr"]))
    assert used and sorted(used - documented) == []


# ---------------------------------------------------------------------------- end to end


def wait_for(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s}s")


def leak(p: Probes) -> None:
    """acme writes pages 1 and 2 and ends; initech gets both, writes page 1, reads both."""
    p.request_begin("r-acme", "acme", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r-acme", 0, 8, 0, np.arange(4, 12))
    p.forward(["r-acme"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
    p.request_end("r-acme", "stop", 1, 2, 1, "")
    p.pages_freed(np.arange(4, 12))
    p.request_begin("r-initech", "initech", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r-initech", 0, 8, 0, np.arange(4, 12))
    p.forward(["r-initech"], [8], [np.arange(4, 8)], [np.arange(4, 12)])


def test_a_real_prometheus_scraping_a_real_sidecar_fires_exactly_the_expected_alerts(tmp_path):
    """The rules loaded into Prometheus itself, scraping `kvguard sidecar` over HTTP: a
    unified engine with a pool smaller than its context leaks one page; the first
    finding's counter appears already at 1 and must fire at once."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus is not installed (Debian package `prometheus`: run `make apt`)")
    ring_dir, port, prom_port = tmp_path / "rings", free_port(), free_port()
    ring_dir.mkdir()
    sidecar = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard.sidecar.cli",
            "sidecar",
            "--ring-dir",
            str(ring_dir),
            "--listen",
            f"127.0.0.1:{port}",
            "--json",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    procs = [sidecar]
    try:
        wait_for(f"http://127.0.0.1:{port}/healthz")
        p = Probes(RingWriter(str(ring_dir), 1 << 16))
        p.hello("unified", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.23", "tiny")
        leak(p)
        kinds = {json.loads(sidecar.stdout.readline())["kind"] for _ in range(2)}
        assert kinds == {"pool_smaller_than_context", "unwritten_read"}

        config = tmp_path / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [{"job_name": "kvguard", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
                }
            )
        )
        procs.append(
            subprocess.Popen(
                [
                    prometheus,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_for(f"http://127.0.0.1:{prom_port}/-/ready")
        wanted = {"KVGuardUnwrittenRead", "KVPoolSmallerThanContext"}
        deadline, firing = time.monotonic() + 60, {}
        while time.monotonic() < deadline and set(firing) != wanted:
            time.sleep(0.5)
            alerts_now = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/alerts").json()["data"]["alerts"]
            firing = {a["labels"]["alertname"]: a for a in alerts_now if a["state"] == "firing"}
        assert sorted(firing) == sorted(wanted)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=10)

    instance = f"127.0.0.1:{port}"
    read = firing["KVGuardUnwrittenRead"]
    assert read["labels"] == {
        "alertname": "KVGuardUnwrittenRead",
        "severity": "critical",
        "job": "kvguard",
        "instance": instance,
        "kind": "unwritten_read",
    }
    assert read["annotations"]["description"].startswith(
        f"kvguard {instance} raised 1 new critical unwritten_read finding(s) in the last 5 minutes:"
    )
    pool = firing["KVPoolSmallerThanContext"]
    assert pool["labels"] == {
        "alertname": "KVPoolSmallerThanContext",
        "severity": "warning",
        "job": "kvguard",
        "instance": instance,
        "role": "unified",
        "pid": str(os.getpid()),
    }
    assert pool["annotations"]["description"] == (
        f"unified engine pid {os.getpid()} on {instance} has a KV pool of 256 tokens but a context length of "
        "2048 tokens: prompts between the two take the engine's reject path."
    )

"""What the finding catalogue drives (sidecar/catalogue.py, sidecar/generate.py, `make generate`).

The committed outputs are what the generator writes from the catalogue: the
``kvguard-findings`` rule group, the runbook index's finding tables and the dashboards.
A change to either side without the other fails here, naming the file. The generator
keeps what is hand-kept around its marker comments, and a kind added to the catalogue
reaches the rules, the grouped rules' exclusions and the index. The lists kept in code
elsewhere (the dashboards', the demo's, the guard's, the incident store's) are read from
the catalogue or name only kinds it has.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvguard.sidecar import catalogue, generate
from kvguard.sidecar.catalogue import KINDS, AlertText, KindSpec, read_exposure_kinds
from kvguard.sidecar.findings import CRITICAL, WARNING

REPO = Path(__file__).resolve().parents[2]


def copy_sources(dest: Path) -> Path:
    """The files the generator reads and writes, copied into ``dest`` (a repository of their own)."""
    for rel in (generate.RULES, generate.RUNBOOK_INDEX):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest / rel)
    shutil.copytree(REPO / "dashboards", dest / "dashboards", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def outside(text: str, begin: str, end: str) -> str:
    """``text`` without its generated region: what is kept by hand."""
    return re.sub(re.escape(begin) + r".*?" + re.escape(end), "", text, flags=re.S)


# ------------------------------------------------------------------------------ drift
def test_the_committed_files_are_what_make_generate_writes():
    stale = [str(p) for p in generate.stale(REPO)]
    assert stale == [], f"{stale} differ from what sidecar/catalogue.py generates: run `make generate` and commit"


def test_check_names_the_drifted_files_and_generate_puts_them_back(tmp_path, capsys):
    repo = copy_sources(tmp_path)
    rules, index = repo / generate.RULES, repo / generate.RUNBOOK_INDEX
    before = {p: p.read_text() for p in (rules, index)}
    # a hand edit of a generated region: a kind dropped from the warning rule's exclusions, a row from the index
    rules.write_text(before[rules].replace('kind!~"events_lost|pool_smaller_than_context"', 'kind!~"events_lost"'))
    index.write_text(before[index].replace("| `coverage_gap` |", "| `coverage_gaps` |"))
    (repo / generate.DASHBOARDS_OUT / "kvguard-extra.json").write_text("{}\n")

    assert generate.main(["--check", "--repo", str(repo)]) == 1
    err = capsys.readouterr().err
    for rel in (generate.RULES, generate.RUNBOOK_INDEX, generate.DASHBOARDS_OUT / "kvguard-extra.json"):
        assert f"{rel}: not what the catalogue generates" in err
    assert "run `make generate`" in err

    assert generate.main(["--repo", str(repo)]) == 0
    assert {p: p.read_text() for p in (rules, index)} == before
    assert not (repo / generate.DASHBOARDS_OUT / "kvguard-extra.json").exists()
    assert generate.main(["--check", "--repo", str(repo)]) == 0


def test_the_hand_kept_parts_are_left_as_they_are(tmp_path):
    repo = copy_sources(tmp_path)
    rules, index = repo / generate.RULES, repo / generate.RUNBOOK_INDEX
    rules.write_text(
        rules.read_text().replace("  - name: kvguard-sidecar\n", "  # a note\n  - name: kvguard-sidecar\n")
    )
    index.write_text(index.read_text() + "\nA closing line.\n")
    kept = (
        outside(rules.read_text(), generate.YAML_BEGIN, generate.YAML_END),
        outside(index.read_text(), generate.MD_BEGIN, generate.MD_END),
    )
    generate.write(repo)
    assert outside(rules.read_text(), generate.YAML_BEGIN, generate.YAML_END) == kept[0]
    assert outside(index.read_text(), generate.MD_BEGIN, generate.MD_END) == kept[1]


def test_a_file_without_its_markers_is_refused(tmp_path, capsys):
    repo = copy_sources(tmp_path)
    index = repo / generate.RUNBOOK_INDEX
    index.write_text(index.read_text().replace(generate.MD_END, ""))
    assert generate.main(["--check", "--repo", str(repo)]) == 2
    assert "docs/runbooks/README.md: expected one" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the catalogue drives
@pytest.fixture
def with_a_new_kind(monkeypatch):
    """The catalogue with two more kinds: one that pages, one grouped warning."""
    new = (
        catalogue._paging(
            "stale_prefix_hit",
            "a prefix-cache hit served pages whose KV was overwritten since",
            AlertText("A prefix-cache hit served overwritten KV.", "a request reused prefix pages that changed."),
        ),
        KindSpec(
            "slow_free",
            (WARNING,),
            catalogue.ALWAYS,
            catalogue.BY_ENGINE,
            catalogue.AFTER_QUIET,
            {WARNING: catalogue.WARNING_GROUPED},
            "pages were freed long after their request ended",
        ),
    )
    extended = catalogue.CATALOGUE + new
    monkeypatch.setattr(catalogue, "CATALOGUE", extended)
    monkeypatch.setattr(generate, "CATALOGUE", extended)
    return new


def test_a_kind_added_to_the_catalogue_reaches_the_rules_and_the_index(with_a_new_kind):
    rules = {r.get("alert", r.get("record")): r for r in generate.findings_group()["rules"]}
    rule = rules["KVGuardStalePrefixHit"]
    assert rule["expr"] == 'instance:kvguard_findings:new_5m{kind="stale_prefix_hit",severity="critical"}'
    assert rule["annotations"]["summary"] == "A prefix-cache hit served overwritten KV."
    assert rule["annotations"]["description"].endswith(
        "in the last 5 minutes: a request reused prefix pages that changed."
    )
    assert rule["annotations"]["runbook_url"].endswith("docs/runbooks/KVGuardStalePrefixHit.md")
    assert "stale_prefix_hit" in rules["KVGuardCriticalFinding"]["expr"].split("kind!~")[1]
    assert "slow_free" not in rules["KVGuardWarningFinding"]["expr"]  # grouped: covered without a rule change
    text = generate.findings_group_text()
    assert "# stale_prefix_hit" in text and "# slow_free" in text  # the routing table
    tables = generate.runbook_tables()
    assert "| [KVGuardStalePrefixHit](KVGuardStalePrefixHit.md) | critical | `stale_prefix_hit` |" in tables
    assert "[KVGuardWarningFinding](KVGuardWarningFinding.md#slow_free)" in tables


def test_a_paging_kind_resolved_otherwise_than_by_its_reader_alerts_on_its_open_incidents():
    rule = generate.paging_rule(KINDS["double_free"])
    assert rule["expr"] == 'kvguard_incidents_firing{kind="double_free",severity="critical"} > 0'
    assert rule["annotations"]["description"].startswith("kvguard {{ $labels.instance }} has ")


def test_every_paging_kind_has_its_alert_text_and_no_other_kind_has_one():
    for spec in catalogue.CATALOGUE:
        assert (spec.alert is not None) == spec.pages, spec.kind
        if spec.alert is not None:
            assert spec.alert.summary.strip() and spec.alert.description.strip(), spec.kind


def test_the_generated_group_is_the_rule_files_findings_group():
    groups = yaml.safe_load((REPO / generate.RULES).read_text())["groups"]
    assert [g for g in groups if g["name"] == generate.FINDINGS_GROUP] == [generate.findings_group()]


def test_every_alert_of_the_rule_file_is_in_the_runbook_index():
    groups = yaml.safe_load((REPO / generate.RULES).read_text())["groups"]
    index = (REPO / generate.RUNBOOK_INDEX).read_text()
    for alert in {r["alert"] for g in groups for r in g["rules"] if "alert" in r}:
        assert f"[{alert}]({alert}.md)" in index, f"docs/runbooks/README.md does not list {alert}"


# ------------------------------------------------------------------------------ lists kept in code
def test_the_dashboards_name_only_catalogue_kinds_and_show_the_read_exposure_kinds():
    named: set[str] = set()
    for path in (REPO / generate.DASHBOARDS_OUT).glob("*.json"):
        for value in re.findall(r'kind=~?\\"([^\\]*)\\"', path.read_text()):
            named |= {k for k in value.split("|") if k.islower()}  # upper case: wire record kinds
    assert named and sorted(named - set(KINDS)) == []
    integrity = (REPO / generate.DASHBOARDS_OUT / "kvguard-integrity.json").read_text()
    assert f'kind=~\\"{"|".join(read_exposure_kinds())}\\"' in integrity


def test_the_demo_reads_the_exposure_kinds_from_the_catalogue_and_expects_only_catalogue_kinds():
    run = pytest.importorskip("kvguard.demo.run")
    assert tuple(run.READ_KINDS) == read_exposure_kinds() == ("unwritten_read", "foreign_read", "use_after_free")
    assert set(run.ARCH_LEAK_KINDS) <= set(KINDS)


def test_the_guard_counts_aborts_under_catalogue_kinds():
    from kvguard.sidecar.detectors.guard import CARRIED_RULES, GUARD_ABORT_KINDS, READ_RULES

    assert set(GUARD_ABORT_KINDS) <= set(KINDS) and set(CARRIED_RULES.values()) <= set(KINDS)
    assert set(READ_RULES.values()) <= set(read_exposure_kinds())
    assert all(CRITICAL in KINDS[k].severities for k in GUARD_ABORT_KINDS)


def test_the_incidents_of_every_kind_that_lasts_with_its_engine_resolve_when_it_exits():
    from kvguard.sidecar.findings import EngineRef, Finding
    from kvguard.sidecar.incidents import FIRING, IncidentStore

    store = IncidentStore()
    engine_kinds = catalogue.kinds_with(resolves=catalogue.WITH_ENGINE)
    assert engine_kinds == {"pool_smaller_than_context", "coverage_gap"}
    for kind in sorted(engine_kinds):
        store.observe(Finding(kind, KINDS[kind].severities[-1], EngineRef("decode", 0, 42), None, [], [], 1, kind))
    store.observe(Finding("coverage_gap", WARNING, EngineRef("decode", 0, 43), None, [], [], 1, "another engine"))
    resolved = store.on_engine_gone(42, 2)
    assert sorted(i.kind for i in resolved) == sorted(engine_kinds)
    assert [(i.kind, i.engine["pid"]) for i in store.incidents.values() if i.state == FIRING] == [("coverage_gap", 43)]

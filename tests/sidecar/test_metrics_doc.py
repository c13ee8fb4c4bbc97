"""docs/metrics.md documents exactly what a running sidecar exports.

A real Sidecar drains real rings written through the probe API, /metrics is served by
``create_app`` on a fresh ``CollectorRegistry``, and the scrape is compared with the
page: every exported metric has a section with the same type and labels, every
section names an exported metric, and every label is one of the bounded labels the
page lists. The page cannot rot silently.

The records are the incident in miniature, so findings, transfers and page reads all
have samples (decode pool pages 1..4, page_size 4):

    page:          1        2        3        4
    last writer:   acme     acme     -        -
    initech:       sent     stale    never    never   <- decode reads all four
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import KVGUARD_VERSION, Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.api import create_app
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.delivery import RetryPolicy
from kvguard.sidecar.sinks.pagerduty import pagerduty_sink

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
SECTION = re.compile(r"^### `(?P<name>[a-z_:]+)`\n(?P<body>(?:- .*\n(?:  .*\n)*)+)", re.M)
FIELD = re.compile(r"^- \*\*(?P<key>\w+)\*\*: (?P<value>.*)$", re.M)


def slots(pages):
    return np.concatenate([np.arange(p * 4, p * 4 + 4) for p in pages])


def pd_request(prefill, decode, rid, tenant, room, pages, tokens, sent_tokens):
    for p in (prefill, decode):
        p.request_begin(rid, tenant, room, tokens, 0, False)
    decode.pages_allocated(slots(pages))
    decode.rows_assigned(rid, 0, tokens, 0, slots(pages)[:tokens])
    decode.transfer_reserved(rid, room, tokens, slots(pages)[:tokens])
    prefill.pages_allocated(slots([50]))
    prefill.transfer_sent(rid, room, 0, sent_tokens, [50], True)
    prefill.transfer_done(rid, room, "sender", "success")
    decode.transfer_done(rid, room, "receiver", "success")
    decode.forward([rid], [tokens], [[]], [slots(pages)[:tokens]])


def scrape(sidecar: Sidecar) -> str:
    return TestClient(create_app(sidecar, CollectorRegistry())).get("/metrics").text


@pytest.fixture(scope="module")
def exposition(tmp_path_factory) -> str:
    ring_dir = str(tmp_path_factory.mktemp("rings"))
    prefill = Probes(RingWriter(ring_dir, 1 << 16))
    decode = Probes(RingWriter(ring_dir, 1 << 16))
    prefill.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.19", "tiny")  # pool < context
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    decode.request_end("r-acme", "length", 1000, 2000, 1, "")
    decode.pages_freed(slots([1, 2]))
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)
    # what decode holds (contract 1.5): a second pool, one component it does not watch
    decode.coverage(
        [
            wire.CoverageItem("kv_pool", wire.CoverageStatus.WATCHED, 1, 0, "MHATokenToKVPool bf16"),
            wire.CoverageItem("draft", wire.CoverageStatus.UNWATCHED, 0, 1, "a draft model: not hooked"),
        ]
    )
    decode.pool_declared(1, 4, 8, "sliding_window", "swa", window_tokens=8)
    decode.page_ids_allocated([2, 3], pool=1)
    decode.row_pages_assigned("r-initech", 0, 8, 0, [2, 3], pool=1)
    decode.forward(["r-initech"], [8], [[8]], pool=1)
    decode.forward(["r-initech"], [8], [[8]], pool=7)  # a pool never declared: counted
    # a PagerDuty sink for the kvguard_sink_* families; nothing listens on port 9: it gives up fast
    sink = pagerduty_sink(
        "R0UT1NGKEY0123456789abcdefABCDEF",
        "http://127.0.0.1:9/v2/enqueue",
        timeout_s=0.5,
        retry=RetryPolicy(initial_s=0.01, max_s=0.01, deadline_s=0.02),
    )
    sidecar = Sidecar(ring_dir, slack_ns=0, sinks=[sink])
    try:
        sidecar.run_once(flush=True)
        return scrape(sidecar)
    finally:
        sidecar.stop()


def exported(text: str) -> dict[str, tuple[str, set[str]]]:
    """Metric name as queried (``_total`` for counters) -> (type, label names)."""
    out = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = (family.type, {label for s in family.samples for label in s.labels})
    return out


def documented() -> dict[str, tuple[str, set[str]]]:
    """Metric name -> (type, label names) from the ``### `name``` sections of the page."""
    out = {}
    for m in SECTION.finditer(DOC.read_text()):
        fields = {f["key"]: f["value"] for f in FIELD.finditer(m["body"])}
        assert {"Type", "Labels", "Meaning", "Notes"} <= fields.keys(), f"{m['name']}: section lacks a field"
        labels = set() if fields["Labels"] == "none" else set(re.findall(r"`(\w+)`", fields["Labels"]))
        out[m["name"]] = (fields["Type"], labels)
    return out


def bounded_labels() -> set[str]:
    """The first column of the table under "## Labels"."""
    text = DOC.read_text()
    table = text[text.index("## Labels") : text.index("## Counters and first samples")]
    return set(re.findall(r"^\| `(\w+)`", table, re.M))


def test_the_scenario_exercises_every_family(exposition):
    findings = [line for line in exposition.splitlines() if line.startswith("kvguard_findings_total{")]
    assert any('kind="unwritten_read",severity="critical"' in line for line in findings)
    assert any('kind="pool_smaller_than_context",severity="critical"' in line for line in findings)
    families = list(text_string_to_metric_families(exposition))
    assert [f.name for f in families if not f.samples] == []


def test_every_exported_metric_is_documented_and_every_documented_one_exported(exposition):
    got, doc = exported(exposition), documented()
    assert sorted(set(got) - set(doc)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(doc) - set(got)) == [], "in docs/metrics.md but not exported"


def test_documented_type_and_labels_match_the_exposition(exposition):
    got, doc = exported(exposition), documented()
    for name in sorted(set(got) & set(doc)):
        assert doc[name] == got[name], f"{name}: docs say {doc[name]}, the sidecar exports {got[name]}"


def test_every_label_is_bounded_and_none_names_a_request(exposition):
    used = set().union(*(labels for _, labels in exported(exposition).values()))
    assert sorted(used - bounded_labels()) == [], "labels missing from the bounded-label table"
    assert not used & {"rid", "request", "request_id", "tenant", "bootstrap_room", "room", "page"}


def test_prose_names_only_exported_metrics(exposition):
    # recording-rule names (level:metric:operations) are not exported metrics
    names = set(re.findall(r"(?<![\w:])(kvguard_[a-z0-9_]+)(?![\w:])", DOC.read_text()))
    assert sorted(names - set(exported(exposition))) == []


def test_promtool_lints_the_exposition_clean(exposition):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`: run `make apt`)")
    result = subprocess.run(
        [promtool, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def hello_with_pid(writer: RingWriter, role: wire.Role, tp_rank: int, pid: int) -> None:
    h = wire.Hello(role, tp_rank, pid, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny", KVGUARD_VERSION)
    writer.write(wire.Kind.HELLO, wire.hello_payload(h))


def test_two_ranks_of_one_role_export_distinct_series(tmp_path):
    for rank, pid in ((0, 4101), (1, 4102)):
        hello_with_pid(RingWriter(str(tmp_path), 1 << 16), wire.Role.DECODE, rank, pid)
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    try:
        sidecar.run_once(flush=True)
        text = scrape(sidecar)
    finally:
        sidecar.stop()
    series = Counter(line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#"))
    assert [s for s, n in series.items() if n > 1] == []

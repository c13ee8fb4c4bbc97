"""Zero series on /metrics: every record kind, and every finding the configuration can raise.

A counter series that exists at 0 lets a dashboard say "checked, nothing found"
instead of "no data". A detector that is switched off must get no series, or the
0 would claim a check that never runs. tests/conftest.py checks, in every test,
that the findings the pipeline emits are the ones sidecar/finding_kinds.py lists.
"""

import numpy as np
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.finding_kinds import FINDING_KINDS, possible_findings, unlisted
from kvguard.sidecar.findings import CRITICAL, WARNING, EngineRef, Finding
from kvguard.sidecar.metrics import KVGuardCollector
from kvguard.sidecar.pipeline import Pipeline
from kvguard.sidecar.service import Sidecar

SWITCHED = {"cross_tenant_prefix_share", "prefix_probing", "ledger_degraded"}  # off by default (ttft_anomaly is on)


def scrape(sidecar: Sidecar) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(KVGuardCollector(sidecar))
    return registry


def finding(kind: str, severity: str) -> Finding:
    return Finding(kind, severity, EngineRef("unified", 0, 1), None, [], [], 0, "test")


def test_a_fresh_sidecar_exports_every_record_kind_and_every_enabled_finding_at_zero(tmp_path):
    reg = scrape(Sidecar(str(tmp_path)))
    for kind in (
        "HELLO",
        "FORWARD",
        "FREE",
        "XFER_RESERVE",
        "XFER_SEND",
        "XFER_DONE",
        "XFER_DIGEST",
        "LOST",
        "TIER1_VIOLATION",
    ):
        assert reg.get_sample_value("kvguard_records_total", {"kind": kind}) == 0, kind
    assert reg.get_sample_value("kvguard_records_total", {"kind": "PAD"}) is None  # ring filler, never applied
    for kind, (severities, _switch) in FINDING_KINDS.items():
        for severity in severities:
            labels = {"kind": kind, "severity": severity}
            want = None if kind in SWITCHED else 0  # off by default: no series, not a 0 that claims a check
            assert reg.get_sample_value("kvguard_findings_total", labels) == want, labels
            assert reg.get_sample_value("kvguard_incidents_total", labels) == want, labels
    # severities a kind never has get no series
    assert reg.get_sample_value("kvguard_findings_total", {"kind": "double_free", "severity": WARNING}) is None
    assert reg.get_sample_value("kvguard_findings_total", {"kind": "transfer_size_mismatch", "severity": CRITICAL}) == 0


def test_switching_a_detector_on_gives_its_finding_a_zero_series(tmp_path):
    assert (
        scrape(Sidecar(str(tmp_path), ttft_anomaly=False)).get_sample_value(
            "kvguard_findings_total", {"kind": "ttft_anomaly", "severity": WARNING}
        )
        is None
    )  # switched off: no series
    reg = scrape(Sidecar(str(tmp_path), ttft_anomaly=True, isolate_tenants=True))
    assert reg.get_sample_value("kvguard_findings_total", {"kind": "ttft_anomaly", "severity": WARNING}) == 0
    assert (
        reg.get_sample_value("kvguard_findings_total", {"kind": "cross_tenant_prefix_share", "severity": WARNING}) == 0
    )
    assert reg.get_sample_value("kvguard_findings_total", {"kind": "ledger_degraded", "severity": WARNING}) is None
    shared = Pipeline(shared_ledger=object())  # only its presence matters here
    assert ("ledger_degraded", WARNING) in possible_findings(shared)


def test_counts_replace_the_zeros(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 4096))
    p.hello("prefill", 0, 4, 64, 256, 2048, 250, "sglang", "0.5.23", "tiny")  # pool 256 < context 2048
    p.pages_allocated(np.arange(8))
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    sidecar.run_once(flush=True)
    reg = scrape(sidecar)
    assert reg.get_sample_value("kvguard_records_total", {"kind": "HELLO"}) == 1
    assert reg.get_sample_value("kvguard_records_total", {"kind": "ALLOC"}) == 1
    assert reg.get_sample_value("kvguard_records_total", {"kind": "FREE"}) == 0
    crit = {"kind": "pool_smaller_than_context", "severity": CRITICAL}
    assert reg.get_sample_value("kvguard_findings_total", crit) == 1
    assert reg.get_sample_value("kvguard_incidents_total", crit) == 1
    assert reg.get_sample_value("kvguard_findings_total", {**crit, "severity": WARNING}) == 0
    sidecar.stop()


def test_unlisted_flags_an_unknown_kind_a_wrong_severity_and_a_switched_off_detector():
    off, on = Pipeline(ttft_anomaly=False), Pipeline(ttft_anomaly=True, isolate_tenants=True)
    assert unlisted(off, finding("made_up_kind", CRITICAL))
    assert unlisted(off, finding("double_free", WARNING))
    assert unlisted(off, finding("ttft_anomaly", WARNING)) and not unlisted(on, finding("ttft_anomaly", WARNING))
    assert unlisted(off, finding("cross_tenant_prefix_share", WARNING))
    assert not unlisted(off, finding("unwritten_read", WARNING))
    assert not unlisted(off, finding("unwritten_read", CRITICAL))

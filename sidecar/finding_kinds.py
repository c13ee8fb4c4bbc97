"""Every finding kind the sidecar's pipeline can raise, at which severities, and when.

/metrics exports kvguard_findings_total and kvguard_incidents_total at 0 for each
(kind, severity) the sidecar can raise with its configuration, so dashboards show 0
("checked, nothing found") instead of "no data". A detector that is switched off
gets no series: a 0 there would claim a check that never runs. The alert rules do
not rely on these zeros (docs/metrics.md, "Counters and first samples").

tests/conftest.py checks every finding the pipeline emits in any test against this
table, so a detector that raises a kind or severity missing here fails its own tests.
"""

from __future__ import annotations

from .findings import CRITICAL, WARNING

ALWAYS = "always"
TTFT = "ttft_anomaly"  # on by default; kvguard sidecar --no-ttft-anomaly (Pipeline(ttft_anomaly=False))
ISOLATION = "isolate_tenants"  # kvguard sidecar --isolate-tenants
SHARED_LEDGER = "shared_ledger"  # a shared transfer ledger (Redis) is configured

# kind -> (severities it can have, the switch that enables its detector)
FINDING_KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    "unwritten_read": ((CRITICAL, WARNING), ALWAYS),  # warning when no one else's data is exposed
    "foreign_read": ((CRITICAL,), ALWAYS),  # Tier 2 (FORWARD) and Tier 1 (engine's own check)
    "use_after_free": ((CRITICAL,), ALWAYS),  # reads and writes
    "late_write": ((CRITICAL,), ALWAYS),
    "double_free": ((CRITICAL,), ALWAYS),
    "pool_smaller_than_context": ((CRITICAL, WARNING), ALWAYS),  # critical on a prefill node
    "transfer_size_mismatch": ((CRITICAL,), ALWAYS),
    "checksum_mismatch": ((CRITICAL,), ALWAYS),
    "orphan_transfer": ((WARNING,), ALWAYS),
    "events_lost": ((WARNING,), ALWAYS),
    "ledger_degraded": ((WARNING,), SHARED_LEDGER),
    "ttft_anomaly": ((WARNING,), TTFT),
    "cross_tenant_prefix_share": ((WARNING,), ISOLATION),
}


def switches(pipeline) -> set[str]:
    """The detector switches that are on in this pipeline (sidecar.pipeline.Pipeline)."""
    on = {ALWAYS}
    if pipeline.ttft_detector.enabled:
        on.add(TTFT)
    if pipeline.isolation_detector.enabled:
        on.add(ISOLATION)
    if pipeline.shared_ledger is not None:
        on.add(SHARED_LEDGER)
    return on


def possible_findings(pipeline) -> list[tuple[str, str]]:
    """(kind, severity) pairs this pipeline can raise with its configuration, sorted."""
    on = switches(pipeline)
    return sorted((kind, sev) for kind, (sevs, switch) in FINDING_KINDS.items() if switch in on for sev in sevs)


def unlisted(pipeline, finding) -> bool:
    """True when this pipeline, as configured, should not be able to raise ``finding``:
    its kind or severity is missing from FINDING_KINDS, or its detector is switched off."""
    return (finding.kind, finding.severity) not in possible_findings(pipeline)

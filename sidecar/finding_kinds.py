"""Every finding kind the sidecar's pipeline can raise, at which severities, and when.

/metrics exports kvguard_findings_total and kvguard_incidents_total at 0 for each
(kind, severity) the sidecar can raise with its configuration, so dashboards show 0
("checked, nothing found") instead of "no data". A detector that is switched off
gets no series: a 0 there would claim a check that never runs. The alert rules do
not rely on these zeros (docs/metrics.md, "Counters and first samples").

tests/conftest.py checks every finding the pipeline emits in any test against this
table, so a detector that raises a kind or severity missing from the catalogue
(sidecar/catalogue.py) fails its own tests.
"""

from __future__ import annotations

from .catalogue import ALWAYS, CATALOGUE, ISOLATION, SHARED_LEDGER, TTFT

__all__ = ["ALWAYS", "FINDING_KINDS", "ISOLATION", "SHARED_LEDGER", "TTFT", "possible_findings", "switches", "unlisted"]

# kind -> (severities it can have, the switch that enables its detector), from the
# catalogue (sidecar/catalogue.py), which says the rest (grouping, alerts, runbooks)
FINDING_KINDS: dict[str, tuple[tuple[str, ...], str]] = {
    spec.kind: (spec.severities, spec.switch) for spec in CATALOGUE
}


def switches(pipeline) -> set[str]:
    """The detector switches that are on in this pipeline (sidecar.pipeline.Pipeline)."""
    on = {ALWAYS} | pipeline.detectors.switches_on()
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

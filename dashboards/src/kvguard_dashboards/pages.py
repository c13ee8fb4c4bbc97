"""kvguard / pages, transfers, TTFT: what the engines do to their KV, as kvguard sees it.

Rows: KV pages by ownership state (one panel per engine role); records by kind and
page reads; prefill -> decode transfers; requests and TTFT anomalies; ring health.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row

from .common import INSTANCE, base, graph, label_variable, q, raised, rate

UID = "kvguard-pages"
ROLE = f'{INSTANCE}, role=~"$role"'
RECORDS = "kvguard_records_total"


def pages_row(d: Dashboard) -> Dashboard:
    return d.with_row(Row("KV pages")).with_panel(
        graph(
            "KV pages by ownership state: $role",
            "Pages of this role's pools (all engines of the role on the chosen sidecars): free, allocated (in no "
            "row yet), owned (in a live request's row), cached (kept by the prefix cache), unknown (not seen "
            "since the sidecar attached or forgotten at a gap in the records).",
            q(f"sum by (state) (kvguard_pages{{{ROLE}}})", "{{state}}"),
            stacked=True,
            span=12,
        )
        .repeat("role")
        .repeat_direction("h")
        .max_per_row(3)
    )


def records_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Records and reads"))
        .with_panel(
            graph(
                "Records applied per second, by kind",
                "Records taken from the engine rings, by wire record kind (docs/wire-format.md). LOST counts gaps, "
                "not records (those are in the integrity dashboard). A flat FORWARD while serving: the read probes "
                "are not firing.",
                q(rate(RECORDS, INSTANCE, "kind"), "{{kind}}"),
                unit="ops",
                span=12,
            )
        )
        .with_panel(
            graph(
                "Page reads checked per second, by role",
                "KV page reads judged against the ownership model, and those that could not be (unverified).",
                q(rate("kvguard_page_reads_checked_total", ROLE, "role"), "{{role}} checked"),
                q(rate("kvguard_page_reads_unverified_total", ROLE, "role"), "{{role}} unverified"),
                unit="reqps",
                span=12,
            )
        )
    )


def transfers_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Transfers: prefill -> decode"))
        .with_panel(
            graph(
                "Transfer records per second, by kind",
                "XFER_RESERVE (decode reserved pages for a room), XFER_SEND (prefill sent a chunk), XFER_DONE (either "
                "side finished). Reservations without matching sends: the incident's shape.",
                q(rate(RECORDS, f'kind=~"XFER_RESERVE|XFER_SEND|XFER_DONE", {INSTANCE}', "kind"), "{{kind}}"),
                unit="ops",
                span=8,
            )
        )
        .with_panel(
            graph(
                "Transfers completed per second, by outcome",
                "Transfers each engine received (only decode engines receive; others stay at 0), by how the "
                "transfer ledger judged them: paired (matched "
                "with the sender's chunks, sizes compared), unverified (no sender can be expected: a decode-only "
                "sidecar without a shared ledger), unpaired (a sender was expected and none matched: a pairing "
                "failure, KVGuardTransfersUnpaired; should stay 0), warmup (SGLang's warmups, no sender by design).",
                q(
                    f"sum by (instance, role, pid, outcome) (rate(kvguard_transfers_total{{{INSTANCE}}}[$__rate_interval]))",
                    "{{instance}} {{role}} pid {{pid}}: {{outcome}}",
                ),
                unit="ops",
                span=8,
            )
        )
        .with_panel(
            graph(
                "Transfer size mismatches",
                "Decode reserved more tokens than prefill sent for a room (transfer_size_mismatch, critical): the "
                "unfilled pages still hold earlier requests' KV.",
                q(
                    raised("kvguard_findings_total", f'kind="transfer_size_mismatch", {INSTANCE}', "instance"),
                    "{{instance}}",
                ),
                bars=True,
                span=8,
            )
        )
        .with_panel(
            graph(
                "Oldest decode wait for a transfer",
                "Per decode engine, how long its oldest reservation has waited for its KV transfer "
                "(kvguard_transfer_oldest_open_seconds; kvguard_transfers_open counts them). Seconds while prefill "
                "works; the engines give up by themselves after 300 s (SGLang) or 480 s (vLLM's Mooncake). Past 10 "
                "minutes the engine's timeout did not free the pages: KVGuardTransferStuck.",
                q(
                    f"max by (instance, role, pid) (kvguard_transfer_oldest_open_seconds{{{INSTANCE}}})",
                    "{{instance}} {{role}} pid {{pid}}",
                ),
                unit="s",
                span=24,
                threshold=600,
            )
        )
    )


def requests_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Requests and TTFT"))
        .with_panel(
            graph(
                "Requests begun, ended and rejected per second",
                "REQ_BEGIN, REQ_END and REJECT records, all engines. Prefill and decode each report a PD request.",
                q(rate(RECORDS, f'kind=~"REQ_BEGIN|REQ_END|REJECT", {INSTANCE}', "kind"), "{{kind}}"),
                unit="reqps",
                span=12,
            )
        )
        .with_panel(
            graph(
                "TTFT anomalies",
                "Requests whose first token came far faster than this engine has ever needed for their uncached "
                "prompt tokens (ttft_anomaly): was the prompt really prefilled? The sidecar exports no TTFT "
                "histogram; per-request TTFT is on the request spans (docs/tracing.md).",
                q(raised("kvguard_findings_total", f'kind="ttft_anomaly", {INSTANCE}', "instance"), "{{instance}}"),
                bars=True,
                span=12,
            )
        )
    )


def rings_row(d: Dashboard) -> Dashboard:
    return (
        d.with_row(Row("Ring health"))
        .with_panel(
            graph(
                "Ring errors, corruption and apply errors",
                "Per rate interval: ring files refused (KVGuardRingErrors), undecodable records by reason and "
                "corrupt bytes (KVGuardRingCorruption), records the model failed to apply (KVGuardApplyErrors), "
                "page ids past an engine's announced pool, skipped and unchecked (KVGuardPageIdsOutOfRange). "
                "All should stay 0.",
                q(f"sum(increase(kvguard_ring_errors_total{{{INSTANCE}}}[$__rate_interval]))", "ring files refused"),
                q(
                    f"sum by (reason) (increase(kvguard_records_invalid_total{{{INSTANCE}}}[$__rate_interval]))",
                    "invalid records: {{reason}}",
                ),
                q(f"sum(increase(kvguard_ring_corrupt_bytes_total{{{INSTANCE}}}[$__rate_interval]))", "corrupt bytes"),
                q(f"sum(increase(kvguard_apply_errors_total{{{INSTANCE}}}[$__rate_interval]))", "apply errors"),
                q(
                    f"sum by (role, pid) (increase(kvguard_page_ids_out_of_range_total{{{INSTANCE}}}[$__rate_interval]))",
                    "page ids out of range: {{role}} pid {{pid}}",
                ),
                bars=True,
                span=16,
            )
        )
        .with_panel(
            graph(
                "Rings attached",
                "Engine rings each sidecar watches (one per engine process).",
                q(f"sum by (instance) (kvguard_rings_attached{{{INSTANCE}}})", "{{instance}}"),
                span=8,
            )
        )
        .with_panel(
            graph(
                "Ingest lag",
                "Seconds since each sidecar last drained its rings (normally under 0.1 s; it grows "
                "when the ingest thread is stuck or dead, while /metrics still answers).",
                q(f"max by (instance) (kvguard_ingest_last_poll_age_seconds{{{INSTANCE}}})", "{{instance}}"),
                unit="s",
                span=24,
            )
        )
    )


def dashboard() -> Dashboard:
    d = base(
        "kvguard / pages, transfers, TTFT",
        UID,
        "KV pages by ownership state, records and page reads, prefill -> decode transfers, requests and TTFT "
        "anomalies, ring health, from the kvguard sidecars' /metrics (docs/metrics.md, docs/dashboards.md).",
    ).with_variable(label_variable("role", "Engine role", 'kvguard_pages{instance=~"$instance"}'))
    for row in (pages_row, records_row, transfers_row, requests_row, rings_row):
        d = row(d)
    return d

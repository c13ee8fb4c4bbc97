"""The guard (KVGUARD_GUARD=transfer) on the leaking SGLang 0.5.19 prefill/decode pair:
the demo's incident (demo/run.py capture_incident, the echo model, SGLang's router in
front, clients that send no rid) with the guard on in both engines. ~2 minutes.

Without the guard the over-long prompt of tenant initech is answered from 149 pages of
acme's and globex's KV (tests/integration/test_incident_engine.py). With it, prefill fails that
transfer through Mooncake's own failure channel before sending, decode finishes the
request with an error before any decode step, the eight normal requests are served
unchanged, and the sidecar reports what was prevented.
"""

import pytest

from kvguard.demo.echo_model import decode_text
from kvguard.demo.run import capture_incident, expected, guard_aborts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]


def test_the_guard_fails_the_rejected_request_instead_of_serving_foreign_kv(tmp_path, require_sglang):
    require_sglang("0.5.19")
    run = capture_incident("0.5.19", str(tmp_path), words=True, guard="transfer")
    long = run.scenario.long.result
    # the client gets an error, not other tenants' words: decode failed it (through the router)
    assert not long.ok and long.routed and long.decode_status == 500 and not long.output_ids, long.summary()
    assert "KVTransferError" in long.error or "Failed to get kvcache" in long.error, long.error
    # the normal requests are served as without the guard: HTTP 200, all their tokens
    for r in run.scenario.normal:
        assert r.result.ok and r.result.completion_tokens == len(r.result.output_ids) == 8, r.result.summary()
    assert "CFO approval code" not in "".join(decode_text(r.result.output_ids or []) for r in run.scenario.requests)

    # kvguard reports what the guard prevented, and nothing was read that should not have been
    (prevented,) = guard_aborts(run.findings)
    assert (prevented.kind, prevented.severity, prevented.engine.role) == (
        "transfer_size_mismatch",
        "critical",
        "prefill",
    )
    assert prevented.reader.tenant == "initech" and prevented.reader.bootstrap_room == long.room
    assert prevented.evidence["prompt_tokens"] == 600 and prevented.evidence["sent_tokens"] == 1
    assert prevented.evidence["reserved_pages"] == 150 and prevented.exposed == []
    kinds = sorted(f.kind for f in run.findings)
    assert not {"unwritten_read", "foreign_read", "checksum_mismatch"} & set(kinds), [f.to_dict() for f in run.findings]
    assert [k for k in kinds if k != "orphan_transfer"] == [
        "pool_smaller_than_context",
        "pool_smaller_than_context",
        "transfer_size_mismatch",
    ], [f.to_dict() for f in run.findings]
    assert expected("0.5.19", run.scenario, run.findings, "transfer") == (True, "")
    assert run.records_lost == 0

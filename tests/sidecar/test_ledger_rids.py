"""Pairing by bootstrap_room when prefill and decode drew different rids (issue 20).

Behind SGLang's router a client that sends no rid gets one rid from the prefill worker
and another from the decode worker; the room is the one thing both ends share. Real
probes, rings and Sidecar (tests/sidecar/test_ledger.py's layout: one sidecar sees both ends).
"""

import time

from kvguard.engine_hooks.probes import Probes  # noqa: F401 - the engines() helper builds them
from kvguard.sidecar.metrics import KVGuardCollector
from tests.sidecar.test_ledger import HALF_A, HALF_B, WHOLE, engines, kinds, run, slots

PREFILL_RID, DECODE_RID = "p-4c1d", "d-9e02"  # what each worker drew for one routed request


def routed_begin(prefill, decode, room, tokens, pages, tenant="acme", p_rid=PREFILL_RID, d_rid=DECODE_RID):
    prefill.request_begin(p_rid, tenant, room, tokens, 0, False)
    decode.request_begin(d_rid, tenant, room, tokens, 0, False)
    decode.pages_allocated(slots(pages))
    decode.rows_assigned(d_rid, 0, tokens, 0, slots(pages)[:tokens])
    decode.transfer_reserved(d_rid, room, tokens, slots(pages)[:tokens])


def routed_send(prefill, room, tokens, p_rid=PREFILL_RID, digest=True):
    prefill.transfer_sent(p_rid, room, 0, tokens, [50], True)
    if digest:
        for i, half in enumerate((HALF_A, HALF_B)):
            prefill.transfer_digest(p_rid, room, "sender", half, 0, tokens, 2, 4 * i, 4, 8)


def routed_receive(decode, room, tokens, d_rid=DECODE_RID, digest=WHOLE):
    if digest is not None:
        decode.transfer_digest(d_rid, room, "receiver", digest, 0, tokens, 2, 0, 8, 8, alg="unit_bytes")
    decode.transfer_done(d_rid, room, "receiver", "success")


def read_and_end(decode, pages, tokens, d_rid=DECODE_RID):
    decode.forward([d_rid], [tokens], [[]], [slots(pages)[:tokens]])
    decode.request_end(d_rid, "length", 1000, 2000, 1, "")
    decode.pages_freed(slots(pages))


def transfers_metric(sidecar) -> dict[str, float]:
    (family,) = [m for m in KVGuardCollector(sidecar).collect() if m.name == "kvguard_transfers"]
    samples = [s for s in family.samples if s.name.endswith("_total")]
    assert {s.labels["outcome"] for s in samples if s.labels["role"] == "prefill"} == {
        "paired",
        "unverified",
        "unpaired",
        "warmup",
    }  # zero series on the engine that only sends
    assert all(s.value == 0 for s in samples if s.labels["role"] == "prefill")
    return {s.labels["outcome"]: s.value for s in samples if s.labels["role"] == "decode"}


def test_a_clean_transfer_pairs_by_room_although_the_two_rids_differ(tmp_path):
    prefill, decode = engines(tmp_path)
    routed_begin(prefill, decode, 7001, 8, [1, 2])
    routed_send(prefill, 7001, 8)
    routed_receive(decode, 7001, 8)
    read_and_end(decode, [1, 2], 8)
    sidecar, sink = run(tmp_path)
    ledger = sidecar.pipeline.ledger
    assert sink.findings == []
    assert (ledger.paired, ledger.unpaired, ledger.unverified, ledger.digests_compared) == (1, 0, 0, 1)
    assert ledger.rooms_reused == 0  # the two keys did not split the room into two stories
    assert transfers_metric(sidecar) == {"paired": 1, "unverified": 0, "unpaired": 0, "warmup": 0}
    sidecar.stop()


def test_the_incident_through_the_router_names_both_rids(tmp_path):
    prefill, decode = engines(tmp_path)
    routed_begin(prefill, decode, 7002, 16, [3, 4, 5, 6], tenant="initech")
    routed_send(prefill, 7002, 1, digest=False)  # the 1-token placeholder into 16 reserved tokens
    routed_receive(decode, 7002, 16, digest=None)
    decode.forward([DECODE_RID], [16], [[]], [slots([3, 4, 5, 6])[:16]])
    sidecar, sink = run(tmp_path)
    assert kinds(sink) == ["transfer_size_mismatch", "unwritten_read"]
    for f in sink.findings:
        assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == (DECODE_RID, "initech", 7002)
        assert (f.evidence["sender_rid"], f.evidence["sender_tenant"]) == (PREFILL_RID, "initech")
        assert f.to_dict()["evidence"]["sender_rid"] == PREFILL_RID  # in the JSON lines and the API
    assert sidecar.pipeline.ledger.paired == 1
    sidecar.stop()


def test_one_rid_on_both_ends_adds_no_sender_rid(tmp_path):
    """The explicit-rid path: findings stay as they were (the sender's rid is the reader's)."""
    prefill, decode = engines(tmp_path)
    routed_begin(prefill, decode, 7003, 16, [3, 4, 5, 6], p_rid="r-same", d_rid="r-same")
    routed_send(prefill, 7003, 1, p_rid="r-same", digest=False)
    routed_receive(decode, 7003, 16, d_rid="r-same", digest=None)
    decode.forward(["r-same"], [16], [[]], [slots([3, 4, 5, 6])[:16]])
    sidecar, sink = run(tmp_path)
    assert kinds(sink) == ["transfer_size_mismatch", "unwritten_read"]
    assert all("sender_rid" not in f.evidence for f in sink.findings)
    sidecar.stop()


def test_a_room_reused_by_another_routed_attempt_starts_a_new_story(tmp_path):
    prefill, decode = engines(tmp_path)
    routed_begin(prefill, decode, 7004, 8, [1, 2], p_rid="p-1", d_rid="d-1")
    routed_send(prefill, 7004, 8, p_rid="p-1")
    routed_receive(decode, 7004, 8, d_rid="d-1")
    read_and_end(decode, [1, 2], 8, d_rid="d-1")
    routed_begin(prefill, decode, 7004, 16, [3, 4, 5, 6], p_rid="p-2", d_rid="d-2")
    routed_send(prefill, 7004, 1, p_rid="p-2", digest=False)  # the second attempt is short
    routed_receive(decode, 7004, 16, d_rid="d-2", digest=None)
    decode.forward(["d-2"], [16], [[]], [slots([3, 4, 5, 6])[:16]])
    sidecar, sink = run(tmp_path)
    assert kinds(sink) == ["transfer_size_mismatch", "unwritten_read"]
    assert {(f.reader.rid, f.evidence["sender_rid"]) for f in sink.findings} == {("d-2", "p-2")}
    assert (sidecar.pipeline.ledger.paired, sidecar.pipeline.ledger.digests_compared) == (2, 1)
    sidecar.stop()


def test_a_transfer_no_sender_matched_is_counted_unpaired_not_paired(tmp_path):
    """A prefill engine is watched, decode completes a room nothing sent for: a pairing failure
    (here: the sender is elsewhere) is visible on its own in the accounting, not only as reads."""
    prefill, decode = engines(tmp_path)
    routed_begin(prefill, decode, 7005, 8, [1, 2])
    routed_send(prefill, 7005, 8)
    routed_receive(decode, 7005, 8)
    decode.request_begin("d-lonely", "globex", 7006, 8, 0, False)
    decode.pages_allocated(slots([9, 10]))
    decode.rows_assigned("d-lonely", 0, 8, 0, slots([9, 10]))
    decode.transfer_reserved("d-lonely", 7006, 8, slots([9, 10]))
    decode.transfer_done("d-lonely", 7006, "receiver", "success")
    sidecar, _sink = run(tmp_path)
    ledger = sidecar.pipeline.ledger
    assert list(ledger.pending) == [7006] and ledger.unpaired == 0  # waits for its sender first
    sidecar.pipeline.tick(time.monotonic_ns() + 10 * 10**9)
    assert (ledger.paired, ledger.unpaired) == (1, 1)
    assert transfers_metric(sidecar) == {"paired": 1, "unverified": 0, "unpaired": 1, "warmup": 0}
    sidecar.stop()


def test_a_request_timeline_includes_the_other_end_found_by_room(tmp_path):
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from kvguard.sidecar.api import create_app

    prefill, decode = engines(tmp_path)
    routed_begin(prefill, decode, 7007, 8, [1, 2])
    routed_send(prefill, 7007, 8)
    routed_receive(decode, 7007, 8)
    read_and_end(decode, [1, 2], 8)
    sidecar, _sink = run(tmp_path)
    c = TestClient(create_app(sidecar, CollectorRegistry(), api_token="t"))
    for asked, other in ((DECODE_RID, PREFILL_RID), (PREFILL_RID, DECODE_RID)):
        body = c.get(f"/v1/requests/{asked}/timeline", headers={"Authorization": "Bearer t"}).json()
        assert body["rid"] == asked
        by_role = {e["role"]: e for e in body["engines"]}
        assert set(by_role) == {"prefill", "decode"}
        assert by_role["decode"]["rid"] == DECODE_RID and by_role["prefill"]["rid"] == PREFILL_RID
        assert {e["event"] for e in by_role["decode"]["events"]} >= {"req_begin", "read", "req_end"}
        assert other in {e["rid"] for e in body["engines"]}
    sidecar.stop()

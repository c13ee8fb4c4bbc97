"""The incident's record sequence through the real probes, rings and sidecar pipeline.

Decode pool: pages 1..8 (page_size 4). Earlier requests of tenants acme and globex
filled pages 1..4 through normal transfers and finished. Then initech's 16-token
prompt was rejected by prefill, which still sent 1 token; decode had reserved 4 pages:

    page:          1        2        3        4
    last writer:   acme     acme     globex   globex
    initech:       sent     stale    stale    stale   <- decode reads all four
"""

import time

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.pd_records import finish, pd_request, slots


def engines(tmp_path, prefill_pool_tokens=4096):
    prefill = Probes(RingWriter(str(tmp_path), 1 << 16))
    decode = Probes(RingWriter(str(tmp_path), 1 << 16))
    prefill.hello(
        "prefill", 0, 4, prefill_pool_tokens // 4, prefill_pool_tokens, 2048, 2048, "sglang", "0.5.19", "tiny"
    )
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    return prefill, decode


def run(tmp_path):
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    sidecar.run_once(flush=True)
    return sidecar, sink.findings


def test_the_incident_is_an_unwritten_read_naming_the_exposed_tenants(tmp_path):
    prefill, decode = engines(tmp_path, prefill_pool_tokens=256)  # the incident: pool < context
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    last = pd_request(prefill, decode, "r-globex", "globex", 12, [3, 4], 8, 8)
    finish(decode, "r-globex", [3, 4, last])
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)

    sidecar, findings = run(tmp_path)
    kinds = sorted(f.kind for f in findings)
    assert kinds == ["pool_smaller_than_context", "transfer_size_mismatch", "unwritten_read"]
    (pool,) = [f for f in findings if f.kind == "pool_smaller_than_context"]
    assert (pool.severity, pool.engine.role) == ("critical", "prefill")
    assert pool.evidence["pool_tokens"] == 256 and pool.evidence["context_len"] == 2048
    (read,) = [f for f in findings if f.kind == "unwritten_read"]
    d = read.to_dict()
    assert d["severity"] == "critical"
    assert d["engine"]["role"] == "decode"
    assert d["reader"] == {"rid": "r-initech", "tenant": "initech", "bootstrap_room": 13}
    assert d["pages"] == [2, 3, 4]
    assert sorted((e["rid"], e["tenant"], tuple(e["pages"])) for e in d["exposed"]) == [
        ("r-acme", "acme", (2,)),
        ("r-globex", "globex", (3, 4)),
    ]
    (size,) = [f for f in findings if f.kind == "transfer_size_mismatch"]
    assert size.evidence == {
        "direction": "fewer_sent",
        "sent_tokens": 1,
        "reserved_tokens": 16,
        "sent_pages": 1,
        "reserved_pages": 4,
    }
    sidecar.stop()


def test_full_transfers_raise_nothing(tmp_path):
    prefill, decode = engines(tmp_path)
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 16)
    sidecar, findings = run(tmp_path)
    assert findings == []
    assert sidecar.pipeline.engines and all(
        t.judge.pages_read for t in sidecar.pipeline.engines.values() if t.hello.role == 2
    )
    sidecar.stop()


def test_a_repeated_bad_read_is_delivered_once(tmp_path):
    prefill, decode = engines(tmp_path)
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    last = pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2], 8, 1)
    for _ in range(5):
        decode.forward(["r-initech"], [9], [[last * 4 + 1]], [slots([1, 2, last])[:9]])
    sidecar, findings = run(tmp_path)
    assert [f.kind for f in findings].count("unwritten_read") == 1
    assert sidecar.pipeline.findings_suppressed == 5
    sidecar.stop()


def test_warmup_requests_are_never_alarmed(tmp_path):
    """SGLang's warmup uses the fake bootstrap host: decode reserves, nothing is sent."""
    prefill, decode = engines(tmp_path)
    decode.request_begin("warm", "", 99, 8, 0, True)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("warm", 0, 8, 0, slots([1, 2]))
    decode.transfer_reserved("warm", 99, 8, slots([1, 2]))
    decode.transfer_done("warm", 99, "receiver", "success")
    decode.forward(["warm"], [9], [[12]], [slots([1, 2, 3])[:9]])
    _, findings = run(tmp_path)
    assert findings == []


def test_a_decode_only_sidecar_cannot_pair_and_stays_quiet(tmp_path):
    decode = Probes(RingWriter(str(tmp_path), 1 << 16))
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    decode.request_begin("r", "acme", 5, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("r", 0, 8, 0, slots([1, 2]))
    decode.transfer_reserved("r", 5, 8, slots([1, 2]))
    decode.transfer_done("r", 5, "receiver", "success")
    decode.forward(["r"], [8], [[]], [slots([1, 2])[:8]])
    sidecar, findings = run(tmp_path)
    assert findings == [] and sidecar.pipeline.ledger.unverified == 1
    sidecar.stop()


def test_pool_smaller_than_context_is_a_warning_off_prefill_and_silent_when_safe(tmp_path):
    unified = Probes(RingWriter(str(tmp_path), 1 << 16))
    unified.hello("unified", 0, 4, 64, 256, 2048, 250, "sglang", "0.5.23", "tiny")
    safe = Probes(RingWriter(str(tmp_path), 1 << 16))
    safe.hello("decode", 1, 4, 1024, 4096, 2048, 2048, "sglang", "0.5.23", "tiny")
    _, findings = run(tmp_path)
    (f,) = findings
    assert (f.kind, f.severity, f.engine.role) == ("pool_smaller_than_context", "warning", "unified")
    assert "256 tokens but the context length is 2048" in f.summary


def test_a_chunk_sent_after_decode_gave_up_lands_in_another_requests_pages(tmp_path):
    """The cross-node race: decode's receiver fails and frees the reservation at once,
    the pages go to another request, then the prefill's already-posted write arrives."""
    prefill, decode = engines(tmp_path)
    for p in (prefill, decode):
        p.request_begin("r-slow", "acme", 21, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("r-slow", 0, 8, 0, slots([1, 2]))
    decode.transfer_reserved("r-slow", 21, 8, slots([1, 2]))
    decode.transfer_done("r-slow", 21, "receiver", "failed")
    decode.request_end("r-slow", "abort", 0, 0, 0, "transfer timed out")
    decode.pages_freed(slots([1, 2]))
    decode.request_begin("r-next", "globex", 22, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("r-next", 0, 8, 0, slots([1, 2]))
    prefill.transfer_sent("r-slow", 21, 0, 8, [50, 51], True)  # the late write
    sidecar, findings = run(tmp_path)
    (late,) = findings
    assert (late.kind, late.reader.rid, late.pages) == ("late_write", "r-slow", [1, 2])
    assert [(e.rid, e.tenant) for e in late.exposed] == [("r-next", "globex")]
    assert late.evidence["via"] == "transfer" and late.evidence["bootstrap_room"] == 21
    sidecar.stop()


def test_deferred_release_keeps_a_late_chunk_harmless(tmp_path):
    """With deferred release decode holds the pages until the sender drained: no finding."""
    prefill, decode = engines(tmp_path)
    for p in (prefill, decode):
        p.request_begin("r-slow", "acme", 21, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("r-slow", 0, 8, 0, slots([1, 2]))
    decode.transfer_reserved("r-slow", 21, 8, slots([1, 2]))
    decode.transfer_done("r-slow", 21, "receiver", "failed")
    prefill.transfer_sent("r-slow", 21, 0, 8, [50, 51], True)
    decode.request_end("r-slow", "abort", 0, 0, 0, "transfer timed out")
    decode.pages_freed(slots([1, 2]), "deferred")
    _, findings = run(tmp_path)
    assert findings == []


def _reserve_and_complete(prefill, decode, rid, room, tokens, pages):
    for p in (prefill, decode):
        p.request_begin(rid, "initech", room, tokens, 0, False)
    decode.pages_allocated(slots(pages))
    decode.rows_assigned(rid, 0, tokens, 0, slots(pages)[:tokens])
    decode.transfer_reserved(rid, room, tokens, slots(pages)[:tokens])
    decode.transfer_done(rid, room, "receiver", "success")  # before the sender's record
    decode.forward([rid], [tokens + 1], [[]], None)


def _sender_after_the_reader_ended(tmp_path, sent_tokens: int):
    """r-x (8 tokens on decode pages 1-2, which acme wrote before) completes, reads, ends
    and frees its pages; only then does prefill's record of what it sent arrive."""
    prefill, decode = engines(tmp_path)
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    _reserve_and_complete(prefill, decode, "r-x", 12, 8, [1, 2])
    decode.request_end("r-x", "length", 1, 1, 1, "")
    decode.pages_freed(slots([1, 2]))
    prefill.transfer_sent("r-x", 12, 0, sent_tokens, [50, 51][: -(-sent_tokens // 4)], True)
    return run(tmp_path)


def test_a_sender_record_trailing_the_receivers_success_is_no_false_alarm(tmp_path):
    """Mooncake's transfer thread can finish (and decode poll success, and read, and even
    free the pages) before the prefill adapter emits XFER_SEND for the chunk."""
    sidecar, findings = _sender_after_the_reader_ended(tmp_path, 8)
    assert findings == [] and sidecar.pipeline.ledger.pending == {}
    sidecar.stop()


def test_a_trailing_short_send_is_still_caught_with_the_exposed_parties(tmp_path):
    prefill, decode = engines(tmp_path)
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    _reserve_and_complete(prefill, decode, "r-x", 12, 8, [1, 2])
    prefill.transfer_sent("r-x", 12, 0, 1, [50], True)  # 1 token, after decode already read
    sidecar, findings = run(tmp_path)
    assert sorted(f.kind for f in findings) == ["transfer_size_mismatch", "unwritten_read"]
    (read,) = [f for f in findings if f.kind == "unwritten_read"]
    assert read.pages == [2] and [(e.rid, e.tenant) for e in read.exposed] == [("r-acme", "acme")]
    sidecar.stop()


def test_a_send_that_never_comes_is_decided_after_the_grace_period(tmp_path):
    prefill, decode = engines(tmp_path)
    prefill.transfer_sent("r-other", 99, 0, 4, [50], True)  # a sender is known here, so one is expected
    _reserve_and_complete(prefill, decode, "r-x", 12, 8, [1, 2])
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    sidecar.run_once(flush=True)
    assert sink.findings == [] and list(sidecar.pipeline.ledger.pending) == [12]
    sidecar.pipeline.tick(time.monotonic_ns() + 3_000_000_000)
    (size,) = [f for f in sink.findings if f.kind == "transfer_size_mismatch"]
    assert size.evidence["sent_tokens"] == 0
    sidecar.stop()


def test_page_ids_past_the_pool_are_counted_and_skipped_not_an_apply_error(tmp_path):
    """An ALLOC naming a page far past the pool the engine announced (a resized pool,
    an adapter bug): the valid pages are tracked and recorded, the bad id is counted
    once, exported, and nothing raises."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvguard.engine_hooks import wire
    from kvguard.sidecar.history import Event
    from kvguard.sidecar.metrics import KVGuardCollector

    _, decode = engines(tmp_path)
    decode.pages_allocated(np.concatenate([slots([2]), slots([5000])]))  # limit: 8 + 1 + 1024 pages
    sidecar, findings = run(tmp_path)
    p = sidecar.pipeline
    (tracker,) = [t for t in p.engines.values() if t.hello.role == wire.Role.DECODE]
    assert findings == [] and p.apply_errors == 0
    assert tracker.pool.pages_out_of_range == 1
    allocs = p.history.page_events(tracker.engine_id, 2)
    assert [int(e["event"]) for e in allocs] == [int(Event.ALLOC)]
    assert len(p.history.page_events(tracker.engine_id, 5000)) == 0
    registry = CollectorRegistry()
    registry.register(KVGuardCollector(sidecar))
    text = generate_latest(registry).decode()
    assert 'kvguard_page_ids_out_of_range_total{pid="' in text
    assert any(
        line.startswith("kvguard_page_ids_out_of_range_total") and line.endswith(" 1.0") for line in text.splitlines()
    ), text


def test_a_trailing_short_send_after_the_reader_ended_is_still_caught(tmp_path):
    """Under load the sender's facts can arrive after decode's request already finished
    and freed its pages (seen on a real two-pod pair with the Redis ledger, whose
    pairing waits on the prefill pod's publish): the read decode made while waiting is
    still judged, from what was saved when its pages were taken as written."""
    sidecar, findings = _sender_after_the_reader_ended(tmp_path, 1)  # 1 token of 8
    assert sorted(f.kind for f in findings) == ["transfer_size_mismatch", "unwritten_read"]
    (read,) = [f for f in findings if f.kind == "unwritten_read"]
    assert read.pages == [2] and [(e.rid, e.tenant) for e in read.exposed] == [("r-acme", "acme")]
    assert read.reader.rid == "r-x"
    sidecar.stop()


def test_a_sender_that_sends_more_than_decode_reserved_is_a_size_mismatch_the_other_way(tmp_path):
    prefill, decode = engines(tmp_path)
    last = pd_request(prefill, decode, "r-over", "acme", 21, [1, 2], 8, 16, src_page=50)  # 16 tokens into 8
    finish(decode, "r-over", [1, 2, last])
    _, findings = run(tmp_path)
    (size,) = [f for f in findings if f.kind == "transfer_size_mismatch"]
    assert size.severity == "critical" and size.engine.role == "decode" and size.reader.rid == "r-over"
    assert size.evidence == {
        "direction": "more_sent",
        "sent_tokens": 16,
        "reserved_tokens": 8,
        "sent_pages": 1,
        "reserved_pages": 2,
    }
    assert "8 more than decode made room for" in size.summary and sorted(size.pages) == [1, 2]
    assert size.exposed == []


def test_a_sender_that_starts_after_decodes_cached_prefix_is_not_an_oversend(tmp_path):
    """Decode holds the first 8 tokens (its radix cache) and reserves the next 8; prefill
    sends positions [8, 16): 16 is where its chunks end, 8 what they carried."""
    prefill, decode = engines(tmp_path)
    for p in (prefill, decode):
        p.request_begin("r-pre", "acme", 22, 16, 8, False)
    decode.pages_allocated(slots([1, 2, 3, 4]))
    decode.rows_assigned("r-pre", 0, 8, 8, slots([1, 2]))
    decode.rows_assigned("r-pre", 8, 16, 8, slots([3, 4]))
    decode.transfer_reserved("r-pre", 22, 8, slots([3, 4]))
    prefill.pages_allocated(slots([50, 51]))
    prefill.transfer_sent("r-pre", 22, 8, 16, [50, 51], True)
    prefill.transfer_done("r-pre", 22, "sender", "success")
    decode.transfer_done("r-pre", 22, "receiver", "success")
    _, findings = run(tmp_path)
    assert [f for f in findings if f.kind == "transfer_size_mismatch"] == [], [f.to_dict() for f in findings]


def _prefix_transfer(tmp_path, sent_end):
    """Decode holds the first 8 tokens (pages 1, 2, written by an earlier request and kept by
    its radix cache) and reserves positions [8, 16) in pages 3, 4; prefill sends [8, sent_end);
    decode's first step reads the whole row."""
    prefill, decode = engines(tmp_path)
    for p in (prefill, decode):
        p.request_begin("r-pre", "acme", 22, 16, 8, False)
    decode.request_begin("r-old", "acme", None, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("r-old", 0, 8, 0, slots([1, 2]))
    decode.forward(["r-old"], [8], [slots([1, 2])], [slots([1, 2])])
    decode.request_end("r-old", "length", 1, 2, 1, "")
    decode.pages_allocated(slots([3, 4, 5]))
    decode.rows_assigned("r-pre", 0, 8, 8, slots([1, 2]))
    decode.rows_assigned("r-pre", 8, 16, 8, slots([3, 4]))
    decode.transfer_reserved("r-pre", 22, 8, slots([3, 4]))
    prefill.pages_allocated(slots([50, 51]))
    prefill.transfer_sent("r-pre", 22, 8, sent_end, [50, 51][: -(-(sent_end - 8) // 4)], True)
    prefill.transfer_done("r-pre", 22, "sender", "success")
    decode.transfer_done("r-pre", 22, "receiver", "success")
    decode.rows_assigned("r-pre", 16, 17, 16, [20])
    decode.forward(["r-pre"], [17], [[20]], [list(slots([1, 2, 3, 4])) + [20]])
    _, findings = run(tmp_path)
    return findings


def test_a_transfer_after_decodes_cached_prefix_fills_the_pages_it_was_reserved(tmp_path):
    """The sender's rows start at decode's prefix (row page 2), not at 0: its pages count as
    written, and decode's read of its row raises nothing."""
    assert _prefix_transfer(tmp_path, 16) == []


def test_a_short_transfer_after_decodes_cached_prefix_leaves_its_last_page_unwritten(tmp_path):
    findings = _prefix_transfer(tmp_path, 12)
    (read,) = [f for f in findings if f.kind == "unwritten_read"]
    assert read.reader.rid == "r-pre" and read.pages == [4]
    # 4 tokens into the 8 reserved after the prefix (position 12 is not "12 tokens sent")
    (size,) = [f for f in findings if f.kind == "transfer_size_mismatch"]
    assert size.evidence["direction"] == "fewer_sent" and size.pages == [4]
    assert (size.evidence["sent_tokens"], size.evidence["reserved_tokens"]) == (4, 8)


def test_a_transfer_that_starts_past_the_reservation_leaves_its_first_pages_unfilled(tmp_path):
    """Decode holds no prefix and reserves [0, 16) in pages 1-4; the sender ships only
    [8, 16) (decode asked for fewer blocks than it reserved; vLLM's Mooncake then sends its
    last ones): the front of the reservation is unfilled, a size mismatch before decode's
    read of it is an unwritten one. The clean twin, a sender starting at decode's own cached
    prefix, is test_a_transfer_after_decodes_cached_prefix_fills_the_pages_it_was_reserved."""
    prefill, decode = engines(tmp_path)
    for p in (prefill, decode):
        p.request_begin("r-gap", "acme", 23, 16, 0, False)
    decode.pages_allocated(slots([1, 2, 3, 4]))
    decode.rows_assigned("r-gap", 0, 16, 0, slots([1, 2, 3, 4]))
    decode.transfer_reserved("r-gap", 23, 16, [1, 2, 3, 4], unit="pages")
    prefill.pages_allocated(slots([50, 51, 52, 53]))
    prefill.forward(["r-gap"], [16], [slots([50, 51, 52, 53])], [slots([50, 51, 52, 53])])
    prefill.transfer_sent("r-gap", 23, 8, 16, [52, 53], True)
    prefill.transfer_done("r-gap", 23, "sender", "success")
    decode.transfer_done("r-gap", 23, "receiver", "success")
    decode.rows_assigned("r-gap", 16, 17, 16, [20])
    decode.forward(["r-gap"], [17], [[20]], [list(slots([1, 2, 3, 4])) + [20]])
    _, findings = run(tmp_path)
    (size,) = [f for f in findings if f.kind == "transfer_size_mismatch"]
    assert size.evidence["direction"] == "fewer_sent" and size.pages == [1, 2]
    assert (size.evidence["sent_tokens"], size.evidence["reserved_tokens"]) == (8, 16)
    (read,) = [f for f in findings if f.kind == "unwritten_read"]
    assert read.reader.rid == "r-gap" and read.pages == [1, 2]

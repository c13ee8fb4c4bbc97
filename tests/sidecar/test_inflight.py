"""Transfers in flight (sidecar/inflight.py): a chunk's pages must not change hands between the
sender's XFER_SEND and its completion. Both ends through the real probes, rings and sidecar.

Prefill pool: pages 1..1023; decode pool: pages 1..8 (page size 4)."""

import numpy as np
import pytest

from kvguard.sidecar.inflight import InFlightChunk, InFlightSends
from tests.sidecar.test_pipeline import engines, run
from tests.support.pd_records import slots


def _prefilled(prefill, rid, tenant, room, pages, tokens=8):
    """A prefill request that computed its prompt into ``pages``."""
    prefill.request_begin(rid, tenant, room, tokens, 0, False)
    prefill.pages_allocated(slots(pages))
    prefill.rows_assigned(rid, 0, tokens, 0, slots(pages)[:tokens])
    prefill.forward([rid], [tokens], [slots(pages)[:tokens]], None)


def _reserved(decode, rid, tenant, room, pages, tokens=8):
    decode.request_begin(rid, tenant, room, tokens, 0, False)
    decode.pages_allocated(slots(pages))
    decode.rows_assigned(rid, 0, tokens, 0, slots(pages)[:tokens])
    decode.transfer_reserved(rid, room, tokens, slots(pages)[:tokens])


def _source_scene(tmp_path, early_release: bool):
    """r-f (initech) sends pages 50-51 to decode; r-v (acme) is then handed 50-51 and computes
    its own prompt in them. With ``early_release`` prefill gave r-f's pages back while its
    transfer was in flight (before its completion); without, after it (SGLang's own order:
    the poll that sees success frees the pages, then reports the completion)."""
    prefill, decode = engines(tmp_path)
    _prefilled(prefill, "r-f", "initech", 31, [50, 51])
    _reserved(decode, "r-f", "initech", 31, [1, 2])
    prefill.transfer_sent("r-f", 31, 0, 8, [50, 51], True)
    if early_release:
        prefill.pages_freed(slots([50, 51]))
        _prefilled(prefill, "r-v", "acme", 32, [50, 51])
        prefill.transfer_done("r-f", 31, "sender", "success")
    else:
        prefill.request_end("r-f", "length", 1000, 1000, 0, "")
        prefill.pages_freed(slots([50, 51]))
        prefill.transfer_done("r-f", 31, "sender", "success")
        _prefilled(prefill, "r-v", "acme", 32, [50, 51])
    decode.transfer_done("r-f", 31, "receiver", "success")
    decode.forward(["r-f"], [9], [[]], [slots([1, 2])[:8]])
    return run(tmp_path)


def test_source_pages_handed_on_before_the_completion_name_the_new_owner(tmp_path):
    sidecar, findings = _source_scene(tmp_path, early_release=True)
    (uaf,) = findings
    assert (uaf.kind, uaf.severity, uaf.engine.role) == ("use_after_free", "critical", "prefill")
    assert (uaf.reader.rid, uaf.reader.tenant, uaf.pages) == ("r-f", "initech", [50, 51])
    assert [(e.rid, e.tenant) for e in uaf.exposed] == [("r-v", "acme")]
    assert uaf.evidence["access"] == "send" and uaf.evidence["via"] == "transfer"
    assert uaf.evidence["bootstrap_room"] == 31 and uaf.evidence["receiver"] == {"rid": "r-f", "tenant": "initech"}
    assert (uaf.evidence["token_start"], uaf.evidence["token_end"]) == (0, 8)
    in_flight = sidecar.pipeline.stats().ledger.in_flight
    assert (in_flight.rooms, in_flight.completed, in_flight.unjudged) == (0, 1, 0)
    sidecar.stop()


def test_source_pages_freed_in_the_poll_that_saw_success_are_no_finding(tmp_path):
    sidecar, findings = _source_scene(tmp_path, early_release=False)
    assert findings == []
    sidecar.stop()


def test_source_pages_freed_but_not_handed_on_still_hold_the_senders_kv(tmp_path):
    prefill, decode = engines(tmp_path)
    _prefilled(prefill, "r-f", "initech", 31, [50, 51])
    _reserved(decode, "r-f", "initech", 31, [1, 2])
    prefill.transfer_sent("r-f", 31, 0, 8, [50, 51], True)
    prefill.pages_freed(slots([50, 51]))
    prefill.transfer_done("r-f", 31, "sender", "success")
    decode.transfer_done("r-f", 31, "receiver", "success")
    sidecar, findings = run(tmp_path)
    assert findings == []
    sidecar.stop()


def _receiver_gives_up(decode):
    """r-slow's receiver fails and frees decode pages 1-2 at once (no deferred release)."""
    decode.transfer_done("r-slow", 21, "receiver", "failed")
    decode.request_end("r-slow", "abort", 0, 0, 0, "transfer timed out")
    decode.pages_freed(slots([1, 2]))


def _next_takes_the_pages(decode):
    """r-next (globex) is handed decode pages 1-2."""
    decode.request_begin("r-next", "globex", 22, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.rows_assigned("r-next", 0, 8, 0, slots([1, 2]))


def _destination_scene(tmp_path, receiver_gave_up_first: bool, sender_status: str = "success"):
    """r-slow's chunk is sent into decode pages 1-2; decode's receiver then gives up (fails,
    frees the pages at once) and r-next (globex) is handed them, before the sender's
    completion (``receiver_gave_up_first``) or after it."""
    prefill, decode = engines(tmp_path)
    _prefilled(prefill, "r-slow", "acme", 21, [50, 51])
    _reserved(decode, "r-slow", "acme", 21, [1, 2])
    prefill.transfer_sent("r-slow", 21, 0, 8, [50, 51], True)

    def give_up():
        _receiver_gives_up(decode)
        _next_takes_the_pages(decode)

    if receiver_gave_up_first:
        give_up()
        prefill.transfer_done("r-slow", 21, "sender", sender_status)
    else:
        prefill.transfer_done("r-slow", 21, "sender", sender_status)
        give_up()
    return run(tmp_path)


def test_a_completion_after_the_receiver_gave_its_pages_away_is_a_late_write(tmp_path):
    sidecar, findings = _destination_scene(tmp_path, receiver_gave_up_first=True)
    (late,) = findings
    assert (late.kind, late.engine.role, late.reader.rid, late.pages) == ("late_write", "decode", "r-slow", [1, 2])
    assert [(e.rid, e.tenant) for e in late.exposed] == [("r-next", "globex")]
    assert late.evidence["access"] == "completion" and late.evidence["via"] == "transfer"
    assert late.evidence["bootstrap_room"] == 21 and late.evidence["sender_rid"] == "r-slow"
    sidecar.stop()


def test_a_completion_before_the_receiver_gave_up_is_no_finding(tmp_path):
    sidecar, findings = _destination_scene(tmp_path, receiver_gave_up_first=False)
    assert findings == []
    sidecar.stop()


def test_a_chunk_sent_after_the_receiver_gave_up_names_who_got_the_pages_before_it_completed(tmp_path):
    """Decode gave up and freed the pages before the send: the send lands in free pages
    (use_after_free at the send); r-next is then handed them before the completion, which
    overwrote its KV: a late_write naming r-next as well."""
    prefill, decode = engines(tmp_path)
    _prefilled(prefill, "r-slow", "acme", 21, [50, 51])
    _reserved(decode, "r-slow", "acme", 21, [1, 2])
    _receiver_gives_up(decode)
    prefill.transfer_sent("r-slow", 21, 0, 8, [50, 51], True)
    _next_takes_the_pages(decode)
    prefill.transfer_done("r-slow", 21, "sender", "success")
    sidecar, findings = run(tmp_path)
    assert [(f.kind, f.evidence.get("access")) for f in findings] == [
        ("use_after_free", "write"),
        ("late_write", "completion"),
    ]
    assert [(e.rid, e.tenant) for e in findings[1].exposed] == [("r-next", "globex")]
    sidecar.stop()


def test_a_new_owner_that_came_and_went_before_the_completion_is_not_named(tmp_path):
    """r-next was handed the pages, decoded, ended and freed them, all before prefill reported
    the completion: the bytes may have landed after it left (the spec lands them at the
    completion), so nobody is named: no false alarm on a completion reported late."""
    prefill, decode = engines(tmp_path)
    _prefilled(prefill, "r-slow", "acme", 21, [50, 51])
    _reserved(decode, "r-slow", "acme", 21, [1, 2])
    prefill.transfer_sent("r-slow", 21, 0, 8, [50, 51], True)
    _receiver_gives_up(decode)
    _next_takes_the_pages(decode)
    decode.forward(["r-next"], [8], [slots([1, 2])], None)
    decode.request_end("r-next", "length", 1, 1, 1, "")
    decode.pages_freed(slots([1, 2]))
    prefill.transfer_done("r-slow", 21, "sender", "success")
    sidecar, findings = run(tmp_path)
    assert findings == []
    sidecar.stop()


def test_a_failed_transfer_is_not_judged_and_is_counted(tmp_path):
    sidecar, findings = _destination_scene(tmp_path, receiver_gave_up_first=True, sender_status="failed")
    assert findings == []
    in_flight = sidecar.pipeline.stats().ledger.in_flight
    assert (in_flight.completed, in_flight.unjudged, in_flight.rooms) == (0, 1, 0)
    sidecar.stop()


def test_a_receiver_that_reported_success_had_every_byte(tmp_path):
    """Decode succeeded, decoded, ended and freed its pages, which went to r-next, all before
    the sender's completion record: nothing could land late."""
    prefill, decode = engines(tmp_path)
    _prefilled(prefill, "r-x", "acme", 21, [50, 51])
    _reserved(decode, "r-x", "acme", 21, [1, 2])
    prefill.transfer_sent("r-x", 21, 0, 8, [50, 51], True)
    decode.transfer_done("r-x", 21, "receiver", "success")
    decode.forward(["r-x"], [9], [[]], [slots([1, 2])[:8]])
    decode.request_end("r-x", "length", 1, 1, 1, "")
    decode.pages_freed(slots([1, 2]))
    _next_takes_the_pages(decode)
    prefill.transfer_done("r-x", 21, "sender", "success")
    sidecar, findings = run(tmp_path)
    assert findings == []
    sidecar.stop()


def test_warmup_transfers_are_never_alarmed(tmp_path):
    prefill, decode = engines(tmp_path)
    prefill.request_begin("warm", "", 41, 8, 0, True)
    prefill.pages_allocated(slots([50, 51]))
    prefill.rows_assigned("warm", 0, 8, 0, slots([50, 51]))
    prefill.forward(["warm"], [8], [slots([50, 51])], None)
    prefill.transfer_sent("warm", 41, 0, 8, [50, 51], True)
    prefill.pages_freed(slots([50, 51]))
    _prefilled(prefill, "r-v", "acme", 42, [50, 51])
    prefill.transfer_done("warm", 41, "sender", "success")
    sidecar, findings = run(tmp_path)
    assert findings == []
    sidecar.stop()


# ---------------------------------------------------------------- the bounded store itself
def _chunk(n, sent_ns=0):
    pages = np.arange(1, n + 1, dtype=np.int32)
    return InFlightChunk(0, 4 * n, sent_ns, pages, np.ones(n, np.uint32), np.zeros(0, np.int32), np.zeros(0, np.uint32))


def test_the_store_drops_the_oldest_room_past_its_bound_and_counts_it():
    store = InFlightSends(max_pages=10)
    store.on_send(1, 0xA, 1, None, 0, _chunk(6))
    store.on_send(1, 0xB, 2, None, 0, _chunk(3))
    store.on_send(1, 0xA, 1, None, 0, _chunk(0))  # a chunk moves its room to the end
    store.on_send(1, 0xC, 3, None, 0, _chunk(4))  # 13 > 10: the oldest (room 2) goes
    assert store.stats().dropped == 1 and store.complete(1, 0xB, 2) is None
    assert store.complete(1, 0xA, 1) is not None and store.stats().pages == 4


def test_the_store_expires_rooms_that_never_complete():
    store = InFlightSends(max_pages=100)
    store.on_send(1, 0xA, 1, None, 0, _chunk(2, sent_ns=10))
    store.on_send(1, 0xB, 2, None, 0, _chunk(2, sent_ns=50))
    store.expire(before_ns=20)
    assert (len(store), store.stats().unjudged) == (1, 1)
    store.forget_engine(1)
    assert len(store) == 0 and store.stats().pages == 0
    with pytest.raises(ValueError, match="max_pages"):
        InFlightSends(0)

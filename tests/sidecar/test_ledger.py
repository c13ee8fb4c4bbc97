"""The embedded (in-memory) transfer ledger: digests, orphans and bad input, both ways.

Records go through the real probes and rings into a real Sidecar, one ring directory
holding a prefill and a decode engine (the demo layout: one sidecar sees both ends).
Decode: page_size 4, pool pages 1..40. Digests are per-rank partials
(docs/wire-format.md, "Transfer digests"): here prefill runs 2 ranks' worth of heads
(0-3 and 4-7 of 8) and decode one rank with all 8, so the sum must be taken.
"""

import time

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

MASK = (1 << 64) - 1
HALF_A, HALF_B = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F  # two ranks' partial digests
WHOLE = (HALF_A + HALF_B) & MASK


def engines(tmp_path):
    prefill = Probes(RingWriter(str(tmp_path), 1 << 18))
    decode = Probes(RingWriter(str(tmp_path), 1 << 18))
    prefill.hello("prefill", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    decode.hello("decode", 0, 4, 40, 160, 160, 160, "sglang", "0.5.23", "tiny")
    return prefill, decode


def slots(pages):
    return np.concatenate([np.arange(p * 4, p * 4 + 4) for p in pages])


def begin(prefill, decode, rid, room, tokens, pages, warmup=False, tenant="acme"):
    for p in (prefill, decode):
        p.request_begin(rid, tenant, room, tokens, 0, warmup)
    decode.pages_allocated(slots(pages))
    decode.rows_assigned(rid, 0, tokens, 0, slots(pages)[:tokens])
    decode.transfer_reserved(rid, room, tokens, slots(pages)[:tokens])


def send(prefill, rid, room, tokens, sender_halves=(HALF_A, HALF_B), end=None):
    end = tokens if end is None else end
    prefill.transfer_sent(rid, room, 0, end, [50], True)
    for i, half in enumerate(sender_halves):
        if half is not None:
            prefill.transfer_digest(rid, room, "sender", half, 0, end, 2, 4 * i, 4, 8)


def receive(decode, rid, room, tokens, digest=WHOLE, alg="unit_bytes"):
    if digest is not None:
        decode.transfer_digest(rid, room, "receiver", digest, 0, tokens, 2, 0, 8, 8, alg=alg)
    decode.transfer_done(rid, room, "receiver", "success")


def finish(decode, rid, pages, tokens):
    decode.forward([rid], [tokens], [[]], [slots(pages)[:tokens]])
    decode.request_end(rid, "length", 1000, 2000, 1, "")
    decode.pages_freed(slots(pages))


def run(tmp_path, **kwargs):
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0, **kwargs)
    sidecar.run_once(flush=True)
    return sidecar, sink


def kinds(sink):
    return sorted(f.kind for f in sink.findings)


# ---------------------------------------------------------------------------------- digests
def test_matching_digests_summed_over_ranks_raise_nothing(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 101, 8, [1, 2])
    send(prefill, "r-1", 101, 8)
    receive(decode, "r-1", 101, 8)
    finish(decode, "r-1", [1, 2], 8)
    sidecar, sink = run(tmp_path)
    assert sink.findings == []
    assert (sidecar.pipeline.ledger.paired, sidecar.pipeline.ledger.digests_compared) == (1, 1)
    sidecar.stop()


def test_a_differing_digest_is_a_checksum_mismatch_naming_request_pages_and_both_digests(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 101, 8, [1, 2], tenant="initech")
    send(prefill, "r-1", 101, 8)
    receive(decode, "r-1", 101, 8, digest=WHOLE ^ 0x10)  # one flipped bit in what decode holds
    decode.forward(["r-1"], [8], [[]], [slots([1, 2])[:8]])
    decode.forward(["r-1"], [8], [[]], [slots([1, 2])[:8]])
    sidecar, sink = run(tmp_path)
    (f,) = sink.findings
    assert (f.kind, f.severity, f.engine.role) == ("checksum_mismatch", "critical", "decode")
    assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == ("r-1", "initech", 101)
    assert f.pages == [1, 2]
    assert f.evidence["sender_digest"] == f"{WHOLE:016x}"
    assert f.evidence["receiver_digest"] == f"{WHOLE ^ 0x10:016x}"
    assert f.evidence["sender_tokens"] == [0, 8] and f.evidence["receiver_tokens"] == [0, 8]
    assert sidecar.pipeline.findings_by_kind[("checksum_mismatch", "critical")] == 1  # judged once
    sidecar.stop()


def test_a_sender_digest_trailing_the_receivers_completion_is_still_compared(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 101, 8, [1, 2])
    prefill.transfer_sent("r-1", 101, 0, 8, [50], True)
    receive(decode, "r-1", 101, 8, digest=1234)
    decode.request_end("r-1", "length", 1, 1, 1, "")
    for i, half in enumerate((HALF_A, HALF_B)):
        prefill.transfer_digest("r-1", 101, "sender", half, 0, 8, 2, 4 * i, 4, 8)
    sidecar, sink = run(tmp_path)
    assert kinds(sink) == ["checksum_mismatch"]
    sidecar.stop()


def test_incomplete_heads_other_algorithms_and_warmups_are_never_compared(tmp_path):
    prefill, decode = engines(tmp_path)
    # one of two sender ranks reported: the sum is not the transfer's digest yet
    begin(prefill, decode, "r-half", 101, 8, [1, 2])
    send(prefill, "r-half", 101, 8, sender_halves=(HALF_A, None))
    receive(decode, "r-half", 101, 8, digest=999)
    finish(decode, "r-half", [1, 2], 8)
    # the receiver hashed with the device algorithm: digests of different algorithms differ by design
    begin(prefill, decode, "r-alg", 102, 8, [3, 4])
    send(prefill, "r-alg", 102, 8)
    receive(decode, "r-alg", 102, 8, digest=999, alg="device_reduced")
    finish(decode, "r-alg", [3, 4], 8)
    # a warmup request (SGLang's fake bootstrap host) is never alarmed
    begin(prefill, decode, "r-warm", 103, 8, [5, 6], warmup=True)
    send(prefill, "r-warm", 103, 8)
    receive(decode, "r-warm", 103, 8, digest=999)
    finish(decode, "r-warm", [5, 6], 8)
    sidecar, sink = run(tmp_path)
    assert sink.findings == []
    ledger = sidecar.pipeline.ledger
    assert ledger.digests_incomparable == 1 and ledger.digests_compared == 1  # the warmup's
    sidecar.stop()


def test_a_retried_digest_replaces_its_first_copy(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 101, 8, [1, 2])
    prefill.transfer_sent("r-1", 101, 0, 8, [50], True)
    prefill.transfer_digest("r-1", 101, "sender", HALF_A, 0, 8, 2, 0, 4, 8)
    prefill.transfer_digest("r-1", 101, "sender", HALF_A, 0, 8, 2, 0, 4, 8)  # the same rank again
    prefill.transfer_digest("r-1", 101, "sender", HALF_B, 0, 8, 2, 4, 4, 8)
    receive(decode, "r-1", 101, 8)
    finish(decode, "r-1", [1, 2], 8)
    sidecar, sink = run(tmp_path)
    assert sink.findings == [] and sidecar.pipeline.ledger.digests_compared == 1
    sidecar.stop()


# ---------------------------------------------------------------------------------- orphans
def test_decode_holding_pages_for_a_prompt_prefill_rejected_is_an_orphan_at_once(tmp_path):
    """SGLang 0.5.23: prefill rejects the long prompt; decode reserved its pages and holds them
    until its waiting timeout (300 s by default)."""
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-long", 201, 16, [1, 2, 3, 4], tenant="initech")
    prefill.rejected("r-long", "admission", "Input length (16 tokens) exceeds the maximum allowed length")
    prefill.request_end("r-long", "reject", 0, 0, 0, "too long")
    sidecar, sink = run(tmp_path)
    (f,) = sink.findings
    assert (f.kind, f.severity, f.engine.role) == ("orphan_transfer", "warning", "decode")
    assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == ("r-long", "initech", 201)
    assert f.pages == [1, 2, 3, 4] and f.evidence["sender"] == "reject"
    # decode finally gives up: the incident resolves with its request; nothing else is raised
    decode.transfer_done("r-long", 201, "receiver", "failed")
    decode.request_end("r-long", "abort", 0, 0, 0, "timeout")
    decode.pages_freed(slots([1, 2, 3, 4]), "deferred")
    sidecar.run_once(flush=True)
    assert len(sink.findings) == 1 and [i.state for i in sidecar.pipeline.incidents.incidents.values()] == ["resolved"]
    sidecar.stop()


def test_a_reject_seen_before_decode_reserves_is_reported_once_nothing_was_sent(tmp_path):
    """Without prefill's REQ_END, a rejected sender gets a grace period: it may still send."""
    prefill, decode = engines(tmp_path)
    prefill.request_begin("r-long", "initech", 201, 16, 0, False)
    prefill.rejected("r-long", "admission", "too long")
    decode.request_begin("r-long", "initech", 201, 16, 0, False)
    decode.pages_allocated(slots([1, 2, 3, 4]))
    decode.transfer_reserved("r-long", 201, 16, slots([1, 2, 3, 4]))
    sidecar, sink = run(tmp_path)
    assert sink.findings == []
    sidecar.pipeline.tick(time.monotonic_ns() + 6 * 10**9)
    assert kinds(sink) == ["orphan_transfer"]
    sidecar.stop()


def test_sglang_0_5_19_rejects_and_still_sends_a_placeholder_no_orphan_but_the_short_send(tmp_path):
    """The incident's order: REJECT, then the 1-token placeholder is prefilled and sent."""
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-long", 201, 16, [1, 2, 3, 4], tenant="initech")
    prefill.rejected("r-long", "admission", "too long")
    prefill.transfer_sent("r-long", 201, 0, 1, [50], True)
    prefill.transfer_done("r-long", 201, "sender", "success")
    prefill.request_end("r-long", "reject", 0, 0, 0, "too long")
    decode.transfer_done("r-long", 201, "receiver", "success")
    sidecar, sink = run(tmp_path)
    sidecar.pipeline.tick(time.monotonic_ns() + 200 * 10**9)
    assert kinds(sink) == ["transfer_size_mismatch"]
    sidecar.stop()


def test_a_sender_that_never_shows_up_is_an_orphan_after_the_timeout(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-ok", 100, 8, [5, 6])  # a prefill engine is known here: a sender is expected
    send(prefill, "r-ok", 100, 8)
    receive(decode, "r-ok", 100, 8)
    decode.request_begin("r-lost", "acme", 202, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.transfer_reserved("r-lost", 202, 8, slots([1, 2]))
    sidecar, sink = run(tmp_path, orphan_timeout_s=30)
    assert sink.findings == []  # within the timeout: prefill may just be slow
    sidecar.pipeline.tick(time.monotonic_ns() + 31 * 10**9)
    (f,) = sink.findings
    assert f.kind == "orphan_transfer" and f.pages == [1, 2] and f.evidence["sender"] == "never reported"
    sidecar.pipeline.tick(time.monotonic_ns() + 62 * 10**9)
    assert len(sink.findings) == 1  # once
    sidecar.stop()


def test_no_orphan_for_client_aborts_slow_prefills_warmups_or_without_a_prefill_in_view(tmp_path):
    prefill, decode = engines(tmp_path)
    # aborted at decode while waiting for the transfer: decode released its pages
    begin(prefill, decode, "r-abort-d", 301, 8, [1, 2])
    decode.request_end("r-abort-d", "abort", 0, 0, 0, "client")
    decode.pages_freed(slots([1, 2]))
    # aborted at both ends, prefill first (the client's two calls): decode follows within the timeout
    begin(prefill, decode, "r-abort-pd", 302, 8, [3, 4])
    prefill.request_end("r-abort-pd", "abort", 0, 0, 0, "client")
    decode.transfer_done("r-abort-pd", 302, "receiver", "failed")
    decode.request_end("r-abort-pd", "abort", 0, 0, 0, "client")
    # prefill began but is slow (queued): it reported, so this is no orphan however long it takes
    begin(prefill, decode, "r-slow", 303, 8, [5, 6])
    # a warmup with SGLang's fake bootstrap host: no sender ever
    decode.request_begin("r-warm", "", 304, 8, 0, True)
    decode.pages_allocated(slots([7, 8]))
    decode.transfer_reserved("r-warm", 304, 8, slots([7, 8]))
    sidecar, sink = run(tmp_path, orphan_timeout_s=30)
    sidecar.pipeline.tick(time.monotonic_ns() + 120 * 10**9)
    assert sink.findings == []
    sidecar.stop()


def test_a_prefill_abort_that_decode_never_follows_is_an_orphan_after_the_timeout(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 301, 8, [1, 2])
    prefill.request_end("r-1", "abort", 0, 0, 0, "client")
    sidecar, sink = run(tmp_path, orphan_timeout_s=30)
    assert sink.findings == []
    sidecar.pipeline.tick(time.monotonic_ns() + 31 * 10**9)
    assert kinds(sink) == ["orphan_transfer"] and sink.findings[0].evidence["sender"] == "abort"
    sidecar.stop()


def test_decode_only_sidecar_never_expects_a_sender(tmp_path):
    decode = Probes(RingWriter(str(tmp_path), 1 << 16))
    decode.hello("decode", 0, 4, 40, 160, 160, 160, "sglang", "0.5.23", "tiny")
    decode.request_begin("r-1", "acme", 401, 8, 0, False)
    decode.pages_allocated(slots([1, 2]))
    decode.transfer_reserved("r-1", 401, 8, slots([1, 2]))
    sidecar, sink = run(tmp_path, orphan_timeout_s=1)
    sidecar.pipeline.tick(time.monotonic_ns() + 10 * 10**9)
    assert sink.findings == []
    sidecar.stop()


# ---------------------------------------------------------------------------------- open transfers
def open_transfers(sidecar):
    (decode,) = [e for e in sidecar.pipeline.stats().engines if e.role == "decode"]
    (prefill,) = [e for e in sidecar.pipeline.stats().engines if e.role == "prefill"]
    opened = sidecar.pipeline.stats().ledger.open_by_engine
    assert opened[prefill.engine_id] == (0, 0.0)  # an engine that only sends: its zero series
    return opened[decode.engine_id]


def test_open_transfers_are_counted_and_aged_until_they_end_and_nothing_else_is(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-done", 501, 8, [1, 2])  # transferred and finished
    send(prefill, "r-done", 501, 8)
    receive(decode, "r-done", 501, 8)
    finish(decode, "r-done", [1, 2], 8)
    begin(prefill, decode, "r-abort", 502, 8, [3, 4])  # the client went away while decode waited
    decode.request_end("r-abort", "abort", 0, 0, 0, "client")
    decode.pages_freed(slots([3, 4]))
    begin(prefill, decode, "r-failed", 503, 8, [5, 6])  # the pull failed: the engine ended the wait
    decode.transfer_done("r-failed", 503, "receiver", "failed")
    decode.request_begin("r-warm", "", 504, 8, 0, True)  # SGLang's warmup: no sender ever
    decode.pages_allocated(slots([7, 8]))
    decode.transfer_reserved("r-warm", 504, 8, slots([7, 8]))
    begin(prefill, decode, "r-stuck", 505, 8, [9, 10])  # prefill began and sent; decode never heard back
    send(prefill, "r-stuck", 505, 8)
    begin(prefill, decode, "r-waiting", 506, 8, [11, 12])  # prefill still working on it
    sidecar, sink = run(tmp_path)
    now = time.monotonic_ns()
    sidecar.pipeline.tick(now)
    n, oldest_s = open_transfers(sidecar)
    assert n == 2 and 0 <= oldest_s < 60, (n, oldest_s)
    sidecar.pipeline.tick(now + 700 * 10**9)  # ages run on the records' clock, as of the last tick
    n, oldest_s = open_transfers(sidecar)
    assert n == 2 and 700 <= oldest_s < 760, (n, oldest_s)
    receive(decode, "r-waiting", 506, 8, digest=None)  # ends one wait
    decode.request_end("r-stuck", "abort", 0, 0, 0, "engine timeout")  # the engine gave up on the other
    sidecar.run_once(flush=True)
    assert open_transfers(sidecar) == (0, 0.0)
    assert "orphan_transfer" not in kinds(sink)  # both senders had reported
    sidecar.stop()


def test_a_waiting_request_the_sidecar_retired_is_no_open_transfer(tmp_path):
    """Records lost: the sidecar retires a request it cannot follow any more; its wait is no
    longer a wait kvguard can age (KVGuardEventsLost says why)."""
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 601, 8, [1, 2])
    sidecar, sink = run(tmp_path)
    sidecar.pipeline.tick(time.monotonic_ns())
    assert open_transfers(sidecar)[0] == 1
    (decode_stats,) = [e for e in sidecar.pipeline.stats().engines if e.role == "decode"]
    tracker = sidecar.pipeline.engines[decode_stats.engine_id]
    (key,) = list(tracker.requests.live)
    tracker.requests.end(key)
    assert open_transfers(sidecar) == (0, 0.0)
    sidecar.stop()


# ---------------------------------------------------------------------------------- rooms seen twice
def test_a_room_reused_by_another_request_and_a_retried_chunk_raise_nothing(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 500, 8, [1, 2])
    send(prefill, "r-1", 500, 8)
    receive(decode, "r-1", 500, 8)
    finish(decode, "r-1", [1, 2], 8)
    begin(prefill, decode, "r-2", 500, 12, [3, 4, 5])  # the same room number, another request
    prefill.transfer_sent("r-2", 500, 0, 12, [51, 52, 53], True)
    prefill.transfer_sent("r-2", 500, 0, 12, [51, 52, 53], True)  # retried: not 6 pages sent
    for i, half in enumerate((HALF_A, HALF_B)):
        prefill.transfer_digest("r-2", 500, "sender", half, 0, 12, 2, 4 * i, 4, 8)
    receive(decode, "r-2", 500, 12)
    finish(decode, "r-2", [3, 4, 5], 12)
    sidecar, sink = run(tmp_path)
    assert sink.findings == []
    ledger = sidecar.pipeline.ledger
    assert (ledger.paired, ledger.digests_compared) == (2, 2)
    sidecar.stop()


def test_a_reused_room_still_catches_a_short_send(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 500, 8, [1, 2])
    send(prefill, "r-1", 500, 8)
    receive(decode, "r-1", 500, 8)
    finish(decode, "r-1", [1, 2], 8)
    begin(prefill, decode, "r-2", 500, 16, [3, 4, 5, 6])
    send(prefill, "r-2", 500, 1)  # 1 token into 16 reserved
    receive(decode, "r-2", 500, 16, digest=None)
    decode.forward(["r-2"], [16], [[]], [slots([3, 4, 5, 6])[:16]])
    sidecar, sink = run(tmp_path)
    assert kinds(sink) == ["transfer_size_mismatch", "unwritten_read"]
    assert {f.reader.rid for f in sink.findings} == {"r-2"}
    sidecar.stop()


# ---------------------------------------------------------------------------------- digest sums
def test_an_end_is_complete_only_when_its_ranks_tile_every_head_exactly():
    from kvguard.sidecar.ledger.digests import DigestSum, Partial

    def part(count, digest, total=8):
        return Partial(count, digest, 0, 8, 2, total)

    tp2 = DigestSum()
    tp2.add(1, 0, part(4, HALF_A))
    assert not tp2.complete(1)  # half the heads
    tp2.add(1, 4, part(4, HALF_B))
    assert tp2.complete(1) and tp2.value(1) == WHOLE
    overlap = DigestSum()
    overlap.add(1, 0, part(4, 1))
    overlap.add(1, 2, part(6, 2))  # two splits mixed (a rank restarted with another TP size)
    assert not overlap.complete(1)
    totals = DigestSum()
    totals.add(1, 0, part(4, 1, total=8))
    totals.add(1, 4, part(4, 2, total=16))
    assert not totals.complete(1) and not DigestSum().complete(1)


def test_a_warmup_transfer_with_no_sender_is_not_waited_for_nor_judged(tmp_path):
    """SGLang's decode warmup uses a fake bootstrap host: its transfer 'succeeds' with no sender."""
    prefill, decode = engines(tmp_path)
    decode.request_begin("r-warm", "", 104, 8, 0, True)
    decode.pages_allocated(slots([7, 8]))
    decode.rows_assigned("r-warm", 0, 8, 0, slots([7, 8]))
    decode.transfer_reserved("r-warm", 104, 8, slots([7, 8]))
    decode.transfer_done("r-warm", 104, "receiver", "success")
    decode.forward(["r-warm"], [8], [[]], [slots([7, 8])])
    sidecar, sink = run(tmp_path)
    sidecar.pipeline.tick(time.monotonic_ns() + 300 * 10**9)
    ledger = sidecar.pipeline.ledger
    assert sink.findings == [] and ledger.pending == {}
    assert (ledger.warmups, ledger.unverified, ledger.paired) == (1, 0, 0)
    sidecar.stop()


def test_a_sender_flooding_one_room_with_chunks_is_bounded_and_not_judged():
    """Issue 14: a ring sending ever new token ranges for one room grew its chunk list (and the
    scan each chunk costs) without bound. Past MAX_CHUNKS_PER_ROOM the room keeps nothing
    more, and its receiver is counted unverified, never judged on a part of the chunks; a
    digest with more partial ranges than any engine has heads never completes."""
    from kvguard.engine_hooks import wire
    from kvguard.sidecar.ledger.digests import MAX_PARTS, DigestSum, Partial
    from kvguard.sidecar.ledger.memory import MAX_CHUNKS_PER_ROOM, TransferLedger

    ledger = TransferLedger()
    ledger.on_reserve(2, wire.XferReserve(22, 7, 64, np.arange(1, 17)), 0)
    for i in range(MAX_CHUNKS_PER_ROOM + 500):
        ledger.on_send(1, wire.XferSend(11, 7, 0, i, i + 1, False, np.zeros(1, np.int64)), 4)
    state = ledger.find(7)
    assert len(state.chunks) == MAX_CHUNKS_PER_ROOM and state.overflowed
    ledger.on_send(1, wire.XferSend(11, 7, 0, 0, 64, True, np.zeros(16, np.int64)), 4)  # the last chunk, dropped too
    pairing = ledger.on_receiver_done(wire.XferDone(22, 7, wire.Side.RECEIVER, wire.XferStatus.SUCCESS), 4, 10)
    if pairing is None or pairing.provisional:  # the last chunk was not kept: the room waits, then is decided
        (pairing,) = ledger.expire(10 + 10 * ledger.grace_ns, lambda _: 4)
    assert not pairing.verified and ledger.unverified == 1 and ledger.paired == ledger.unpaired == 0
    # a room within the bound is judged as before
    ledger.on_reserve(2, wire.XferReserve(23, 8, 8, np.arange(20, 22)), 0)
    ledger.on_send(1, wire.XferSend(12, 8, 0, 0, 8, True, np.zeros(2, np.int64)), 4)
    pairing = ledger.on_receiver_done(wire.XferDone(23, 8, wire.Side.RECEIVER, wire.XferStatus.SUCCESS), 4, 20)
    assert pairing.verified and ledger.paired == 1

    digest = DigestSum()
    for start in range(MAX_PARTS + 100):
        digest.add(1, start, Partial(1, 5, 0, 8, 2, 10**6))  # one head of a million, again and again
    assert len(digest.by_alg[1]) == MAX_PARTS and not digest.complete(1)


def test_rooms_stay_within_the_byte_bound_and_an_evicted_receivers_pages_are_never_judged_unwritten(tmp_path):
    """Issue 14: the ledger's rooms are bounded by its share of the memory budget. A room
    dropped while its receiver waited is remembered, so that the receiver's result takes its
    pages as written (counted unverified) rather than leaving them unwritten: its first read
    would otherwise be a critical unwritten_read about a healthy transfer."""
    from kvguard.sidecar.ledger.memory import ROOM_BYTES

    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 101, 8, [1, 2])  # the oldest room
    for i in range(60):  # later transfers reserve rooms (and never finish here)
        rid = f"x-{i:02d}"
        for p in (prefill, decode):
            p.request_begin(rid, "acme", 300 + i, 8, 0, False)
        decode.transfer_reserved(rid, 300 + i, 8, slots([20 + i % 10, 30 + i % 10]))
    send(prefill, "r-1", 101, 8)
    receive(decode, "r-1", 101, 8)
    finish(decode, "r-1", [1, 2], 8)
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    ledger = sidecar.pipeline.ledger
    ledger.max_bytes = 12 * ROOM_BYTES
    sidecar.run_once(flush=True)
    assert ledger.rooms_evicted > 0 and ledger.nbytes <= ledger.max_bytes
    # the running charge is refunded only at a recount: it never understates what is held
    assert sum(s.nbytes for s in ledger._held().values()) <= ledger.nbytes
    assert 101 not in ledger.rooms
    assert sink.findings == [], [f.to_dict() for f in sink.findings]  # r-1 read its pages: not unwritten
    assert ledger.unverified == 1 and ledger.paired == 0
    sidecar.stop()


def test_the_room_estimate_is_not_below_what_rooms_cost():
    """ROOM_BYTES, CHUNK_BYTES and PART_BYTES are measured (tracemalloc) and rounded up."""
    import tracemalloc

    from kvguard.engine_hooks import wire
    from kvguard.sidecar.ledger.memory import TransferLedger

    ledger = TransferLedger(max_rooms=10**9, max_bytes=1 << 40)
    n = 2_000
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for room in range(n):  # a 600-token prompt at page size 4: 150 pages, 4 chunks, 2 ranks' digests a side
            ledger.on_reserve(2, wire.XferReserve(room + 1, room, 600, np.arange(150, dtype=np.int64)), 0)
            for c in range(4):
                ledger.on_send(
                    1, wire.XferSend(room + 7, room, 0, 150 * c, 150 * (c + 1), c == 3, np.zeros(38, np.int64)), 4
                )
            for side in (wire.Side.SENDER, wire.Side.RECEIVER):
                for rank in range(2):
                    ledger.on_digest(
                        1,
                        wire.XferDigest(
                            room + 7 if side == wire.Side.SENDER else room + 1,
                            room,
                            side,
                            wire.DigestAlg(2),
                            rank,
                            0,
                            600,
                            2,
                            4 * rank,
                            4,
                            8,
                        ),
                    )
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"{(after - before) / n:.0f} B per room measured, {ledger.nbytes / n:.0f} charged")
    assert after - before <= ledger.nbytes < 3 * (after - before)

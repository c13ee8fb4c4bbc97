"""Tensor parallelism 2 on both ends of a prefill/decode pair, as SGLang runs it: every
scheduler rank its own process, ring, allocator and pool; prefill rank i sends its kv heads
to decode rank i under the one room the router gave the request (sidecar/ledger/lanes.py).

Each rank's side of a room is its own story, paired with the same rank across the pair; the
ranks' partial digests add up on the room itself. Seen on a real engine first: with one
story per room, decode rank 1's reservation was taken for a retry of rank 0's and its pages
were never written, so clean requests raised unwritten_read (tests/integration/
test_parallel_engines.py runs the real pair)."""

from __future__ import annotations

import time

import pytest

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.ledger.lanes import lane_key, rank_of, room_of
from kvguard.sidecar.ledger.memory import DIGEST_WAIT_NS
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.pd_records import pd_request

ROOM = (1 << 63) + 12345  # a room as SGLang draws them (up to 2^63), top bit set to test the mask
TOKENS = 8


@pytest.fixture
def tp2(tmp_path):
    """Prefill ranks 0 and 1, decode ranks 0 and 1 (each its own engine pid, as its own process)."""
    memory = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[memory], slack_ns=0)
    ranks = {}
    for role, base_pid in (("prefill", 1000), ("decode", 2000)):
        for rank in (0, 1):
            p = Probes(RingWriter(str(tmp_path), 1 << 16))
            p.hello(role, rank, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny-llama", pid=base_pid + rank)
            ranks[role, rank] = p
    yield sidecar, memory, ranks
    sidecar.stop()


def _request(ranks, sent_tokens: int, digests: dict | None = None) -> None:
    """The same request on every rank (the ranks make the same decisions on the same inputs)."""
    for rank in (0, 1):
        prefill, decode = ranks["prefill", rank], ranks["decode", rank]
        pd_request(prefill, decode, "r-acme", "acme", ROOM, [1, 2], TOKENS, sent_tokens)
        for side, engine in (("sender", prefill), ("receiver", decode)):
            if digests is not None:  # this rank's partial: its one kv head of two
                engine.transfer_digest(
                    "r-acme", ROOM, side, digests[side, rank], 0, TOKENS, 2, rank, 1, 2, alg="head_streams"
                )


def test_lane_keys_keep_the_room_and_the_rank():
    assert lane_key(ROOM, 0) == ROOM
    key = lane_key(ROOM, 3)
    assert key != ROOM and room_of(key) == ROOM and rank_of(key) == 3


def test_a_clean_transfer_on_every_rank_pairs_per_rank_and_raises_nothing(tp2):
    sidecar, memory, ranks = tp2
    _request(ranks, TOKENS, {("sender", 0): 11, ("sender", 1): 22, ("receiver", 0): 11, ("receiver", 1): 22})
    sidecar.run_once(flush=True)
    assert memory.findings == [], [f.summary for f in memory.findings]
    ledger = sidecar.pipeline.ledger
    decode_engines = {e.engine_id for e in sidecar.pipeline.engines.values() if e.hello.role.name == "DECODE"}
    paired = {eid: n for (eid, outcome), n in ledger.outcomes.items() if outcome == "paired"}
    assert paired == dict.fromkeys(decode_engines, 1)  # one pairing on each decode rank
    assert ledger.rooms_reused == 0
    assert ledger.digests_compared == 1  # the ranks' partials, summed on the room, compared once


def test_a_short_send_is_caught_on_each_rank_under_the_real_room(tp2):
    """The incident on both ranks: each decode rank reserved 8 tokens, each prefill rank sent 1."""
    sidecar, memory, ranks = tp2
    _request(ranks, 1)
    sidecar.run_once(flush=True)
    sizes = [f for f in memory.findings if f.kind == "transfer_size_mismatch"]
    assert sorted(f.engine.rank for f in sizes) == [0, 1], [f.summary for f in memory.findings]
    assert all(f"room {ROOM})" in f.summary for f in sizes), [f.summary for f in sizes]
    reads = [f for f in memory.findings if f.kind == "unwritten_read"]
    assert sorted(f.engine.rank for f in reads) == [0, 1]
    assert all(f.reader.bootstrap_room == ROOM for f in reads)


def test_one_ranks_partial_digest_differs_one_mismatch_on_the_room(tp2):
    sidecar, memory, ranks = tp2
    _request(ranks, TOKENS, {("sender", 0): 11, ("sender", 1): 22, ("receiver", 0): 11, ("receiver", 1): 23})
    sidecar.run_once(flush=True)
    (found,) = memory.findings
    assert found.kind == "checksum_mismatch" and found.evidence["bootstrap_room"] == ROOM, found.to_dict()


def test_a_rank_that_never_reports_its_digest_leaves_the_pair_uncompared_and_counted(tp2):
    """Decode rank 1's partial is missing (a rank restarted, or its hooks failed): the receiver's
    sum never completes, so nothing is compared and nothing is raised; once the wait after the
    receiver's success is over, the incomplete end is counted (kvguard_transfer_digests_total
    {outcome="receiver_incomplete"}), once."""
    sidecar, memory, ranks = tp2
    _request(ranks, TOKENS)
    for side, rank, digest in (("sender", 0, 11), ("sender", 1, 22), ("receiver", 0, 11)):
        engine = ranks["prefill" if side == "sender" else "decode", rank]
        engine.transfer_digest("r-acme", ROOM, side, digest, 0, TOKENS, 2, rank, 1, 2, alg="head_streams")
    sidecar.run_once(flush=True)
    assert memory.findings == []
    ledger = sidecar.pipeline.ledger
    assert ledger.digests_compared == 0
    assert ledger.stats([]).digests_incomplete == {"sender": 0, "receiver": 0}  # still waiting for it
    later = time.monotonic_ns() + DIGEST_WAIT_NS + 1_000_000_000
    for now in (later, later + 1):
        sidecar.pipeline.tick(now)
    assert memory.findings == []
    assert ledger.stats([]).digests_incomplete == {"sender": 0, "receiver": 1}


def test_complete_digests_are_not_counted_incomplete_after_the_wait(tp2):
    sidecar, memory, ranks = tp2
    _request(ranks, TOKENS, {("sender", 0): 11, ("sender", 1): 22, ("receiver", 0): 11, ("receiver", 1): 22})
    sidecar.run_once(flush=True)
    sidecar.pipeline.tick(time.monotonic_ns() + DIGEST_WAIT_NS + 1_000_000_000)
    assert sidecar.pipeline.ledger.stats([]).digests_incomplete == {"sender": 0, "receiver": 0}


def _block_rows(ranks, side: str, parts: list[tuple[int, int, int]]) -> None:
    """vLLM's alg 4: each (rank, digest, tp size) is one worker rank's hash of its slice of the blocks."""
    for rank, digest, tp_size in parts:
        engine = ranks["prefill" if side == "sender" else "decode", rank]
        engine.transfer_digest("r-acme", ROOM, side, digest, 0, TOKENS, 2, rank, 1, tp_size, alg="block_rows")


def test_block_row_digests_split_alike_are_summed_and_compared(tp2):
    sidecar, memory, ranks = tp2
    _request(ranks, TOKENS)
    _block_rows(ranks, "sender", [(0, 5, 2), (1, 6, 2)])
    _block_rows(ranks, "receiver", [(0, 5, 2), (1, 7, 2)])  # rank 1's slice arrived changed
    sidecar.run_once(flush=True)
    (found,) = memory.findings
    assert found.kind == "checksum_mismatch" and found.evidence["alg"] == "xxh3_block_rows", found.to_dict()


def test_block_row_digests_of_ends_split_differently_are_never_compared(tp2):
    """Prefill at TP 2, decode at TP 1: each end's sum is complete, but a block split in two
    slices hashes differently from the whole block: incomparable, not a mismatch."""
    sidecar, memory, ranks = tp2
    _request(ranks, TOKENS)
    _block_rows(ranks, "sender", [(0, 5, 2), (1, 6, 2)])
    _block_rows(ranks, "receiver", [(0, 99, 1)])
    sidecar.run_once(flush=True)
    assert memory.findings == []
    ledger = sidecar.pipeline.ledger
    assert (ledger.digests_compared, ledger.digests_incomparable) == (0, 1)


def test_decode_at_a_larger_tp_size_than_prefill_pairs_its_extra_rank_with_rank_0s_chunks(tp2):
    """Prefill at TP 1 (rank 0 only), decode at TP 2: decode rank 1's lane has no sender of its
    own; it takes rank 0's chunks (every sending rank sends the same token ranges), so its reads
    are of written pages. A short send is still caught on both decode ranks."""
    from tests.support.pd_records import slots

    sidecar, memory, ranks = tp2
    prefill = ranks["prefill", 0]
    for rid, sent in (("r-clean", TOKENS), ("r-short", 1)):
        room = ROOM + sent
        prefill.request_begin(rid, "acme", room, TOKENS, 0, False)
        for rank in (0, 1):
            decode = ranks["decode", rank]
            decode.request_begin(rid, "acme", room, TOKENS, 0, False)
            decode.pages_allocated(slots([1, 2]))
            decode.rows_assigned(rid, 0, TOKENS, 0, slots([1, 2])[:TOKENS])
            decode.transfer_reserved(rid, room, TOKENS, slots([1, 2])[:TOKENS])
        prefill.pages_allocated(slots([50]))
        prefill.transfer_sent(rid, room, 0, sent, [50], True)
        prefill.transfer_done(rid, room, "sender", "success")
        for rank in (0, 1):
            decode = ranks["decode", rank]
            decode.transfer_done(rid, room, "receiver", "success")
            decode.pages_allocated(slots([3]))
            decode.rows_assigned(rid, TOKENS, TOKENS + 1, TOKENS, [12])
            decode.forward([rid], [TOKENS + 1], [[12]], [slots([1, 2, 3])[: TOKENS + 1]])
            decode.request_end(rid, "length", 1000, 2000, 1, "")
            decode.pages_freed(slots([1, 2, 3]))
        sidecar.run_once(flush=True)
        if rid == "r-clean":  # (past the wait for a sender's last chunk, too)
            sidecar.pipeline.tick(time.monotonic_ns() + 10_000_000_000)
            assert memory.findings == [], [f.summary for f in memory.findings]
    sizes = [f for f in memory.findings if f.kind == "transfer_size_mismatch"]
    assert sorted(f.engine.rank for f in sizes) == [0, 1], [f.summary for f in memory.findings]
    assert sidecar.pipeline.ledger.lanes_borrowed == 2


def test_an_incidents_bundle_holds_every_rank_pairs_story_of_its_room(tp2):
    from kvguard.sidecar import bundle

    sidecar, memory, ranks = tp2
    _request(ranks, 1)
    sidecar.run_once(flush=True)
    read = next(f for f in memory.findings if f.kind == "unwritten_read")
    no_picture = type("NoPicture", (), {"transfer": lambda self: None})()
    facts = bundle._transfers(sidecar.pipeline, {"reader": {"bootstrap_room": read.reader.bootstrap_room}}, no_picture)
    stories = [(r["room"], r["rank"], r["receiver"]["reserved_tokens"]) for r in facts["rooms"]]
    assert stories == [(ROOM, 0, TOKENS), (ROOM, 1, TOKENS)], facts["rooms"]

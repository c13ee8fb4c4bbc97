"""The ownership model, step by step (page_size 4; page ids shown, slots = page*4 + offset)."""

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.sidecar.tracker import ALLOCATED, CACHED, FREE, OWNED, UNKNOWN, EngineTracker, RequestDirectory

A, B = wire.request_key("A"), wire.request_key("B")


def tracker():
    t = EngineTracker(1, RequestDirectory())
    t.on_hello(wire.Hello(wire.Role.DECODE, 0, 1, 4, 16, 64, 2048, 250, "sglang", "x", "m", "0"))
    return t


def begin(t, rid, tenant="acme"):
    t.on_request_begin(wire.ReqBegin(wire.request_key(rid), wire.NO_ROOM, 8, 0, False, rid, tenant), 0)


def test_alloc_assign_write_read_free_cycle():
    t = tracker()
    begin(t, "A")
    assert t.pool.state[1] == UNKNOWN  # nothing seen yet: never judged
    t.on_alloc(np.array([1, 2]))
    assert t.pool.state[1] == ALLOCATED and t.pool.gen[1] == 1
    t.on_assign(wire.Assign(A, 0, 8, 0, np.array([1, 2])))
    assert t.pool.state[1] == OWNED and t.pool.owner[1] == A
    t.mark_written(A, np.array([1, 2]), 5)
    v = t.judge.classify_read(A, 8, None)
    assert (len(v.unwritten), len(v.foreign), len(v.freed)) == (0, 0, 0)
    t.on_free(np.array([1, 2]))
    assert t.pool.state[1] == FREE and t.pool.last_writer[1] == A  # the data stays: pages are not zeroed


def test_reserved_but_unwritten_page_is_an_unwritten_read_exposing_the_last_writer():
    #   page:      1      2
    #   A wrote:   x      x      then freed both
    #   B gets:    1      2      writes only page 1, reads both -> page 2 still holds A's data
    t = tracker()
    begin(t, "A")
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(A, 0, 8, 0, np.array([1, 2])))
    t.mark_written(A, np.array([1, 2]), 1)
    t.on_request_end(wire.ReqEnd(A, 0, 0, 0, wire.Finish.STOP, ""), 2)
    t.on_free(np.array([1, 2]))
    begin(t, "B", "globex")
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(B, 0, 8, 0, np.array([1, 2])))
    t.mark_written(B, np.array([1]), 3)
    v = t.judge.classify_read(B, 8, None)
    assert v.unwritten.tolist() == [2] and v.foreign.tolist() == []
    assert t.pool.last_writer[2] == A and t.requests.get(A).tenant == "acme"


def test_a_row_entry_naming_another_requests_page_is_foreign():
    t = tracker()
    begin(t, "A")
    begin(t, "B")
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(A, 0, 4, 0, np.array([1])))
    t.on_assign(wire.Assign(B, 0, 4, 0, np.array([2])))
    t.mark_written(A, np.array([1]), 1)
    t.mark_written(B, np.array([2]), 1)
    v = t.judge.classify_read(B, 4, np.array([1]))  # the engine's actual row says page 1
    assert v.foreign.tolist() == [1] and v.unwritten.tolist() == []


def test_freed_and_reallocated_page_is_foreign_for_the_old_holder():
    t = tracker()
    begin(t, "A")
    begin(t, "B")
    t.on_alloc(np.array([1]))
    t.on_assign(wire.Assign(A, 0, 4, 0, np.array([1])))
    t.mark_written(A, np.array([1]), 1)
    t.on_free(np.array([1]))
    v = t.judge.classify_read(A, 4, None)
    assert v.freed.tolist() == [1]
    t.on_alloc(np.array([1]))
    t.on_assign(wire.Assign(B, 0, 4, 0, np.array([1])))
    v = t.judge.classify_read(A, 4, None)
    assert v.foreign.tolist() == [1]


def test_prefix_cache_pages_are_shared_reads_not_foreign():
    t = tracker()
    begin(t, "A")
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(A, 0, 8, 0, np.array([1, 2])))
    t.mark_written(A, np.array([1, 2]), 1)
    t.on_request_end(wire.ReqEnd(A, 0, 0, 0, wire.Finish.STOP, ""), 2)
    assert t.pool.state[1] == CACHED  # kept by the radix cache, not freed
    begin(t, "B")
    t.on_alloc(np.array([3]))
    t.on_assign(wire.Assign(B, 0, 12, 8, np.array([1, 2, 3])))  # 8 tokens from the cache, 4 new
    t.mark_written(B, np.array([3]), 3)
    v = t.judge.classify_read(B, 12, np.array([1, 2, 3]))
    assert (len(v.unwritten), len(v.foreign), len(v.freed)) == (0, 0, 0)


def test_decode_appends_into_the_last_page_without_a_new_page():
    t = tracker()
    begin(t, "A")
    t.on_alloc(np.array([5]))
    t.on_assign(wire.Assign(A, 0, 3, 0, np.array([5])))
    t.mark_written(A, np.array([5]), 1)
    t.on_assign(wire.Assign(A, 3, 4, 0, np.array([5])))  # position 3 still lives in page 5
    v = t.judge.classify_read(A, 4, np.array([5]))
    assert (len(v.unwritten), len(v.foreign)) == (0, 0)


def test_padding_page_and_unknown_pages_are_never_judged():
    t = tracker()
    begin(t, "A")
    t.on_assign(wire.Assign(A, 0, 8, 0, np.array([0, 7])))  # page 7 never seen allocated
    v = t.judge.classify_read(A, 8, np.array([0, 7]))
    assert (len(v.unwritten), len(v.foreign), len(v.freed), v.unverified) == (0, 0, 0, 1)


def test_requests_seen_only_mid_flight_are_not_judged():
    t = tracker()
    t.on_alloc(np.array([1]))
    t.on_assign(wire.Assign(A, 4, 8, 4, np.array([1])))  # no REQ_BEGIN: attached after it started
    assert t.judge.classify_read(A, 8, np.array([9, 1])) is None


def test_double_free_is_reported_by_on_free():
    t = tracker()
    t.on_alloc(np.array([1]))
    assert t.on_free(np.array([1])).tolist() == []
    assert t.on_free(np.array([1])).tolist() == [1]


def test_lost_events_forget_everything_until_reallocated():
    t = tracker()
    begin(t, "A")
    t.on_alloc(np.array([1]))
    t.on_assign(wire.Assign(A, 0, 4, 0, np.array([1])))
    t.on_lost()
    v = t.judge.classify_read(A, 4, None)
    assert v.unverified == 1 and len(v.unwritten) == 0


def test_page_ids_beyond_the_pool_are_refused_and_counted_not_allocated():
    t = tracker()  # pool of 16 pages
    t.on_alloc(np.array([1, 2**31 - 1, 5000]))
    assert t.pool.num_pages <= 16 + 1 + 1024 and t.pool.pages_out_of_range == 2
    assert t.pool.state[1] == ALLOCATED


def test_a_read_row_naming_an_impossible_page_is_counted_not_misaligned():
    t = tracker()
    begin(t, "A")
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(A, 0, 12, 0, np.array([1, 2])))
    t.mark_written(A, np.array([1, 2]), 1)
    v = t.judge.classify_read(A, 12, np.array([1, 2**30, 2]))
    assert t.pool.pages_out_of_range == 1
    # the row is corrupt: row page 2 names page 2, which the model has at row page 1
    assert (v.unwritten.tolist(), v.foreign.tolist(), v.freed.tolist()) == ([], [2], [])


def test_requests_that_never_end_and_hold_nothing_leave_the_live_directory():
    """SGLang sends no REQ_END for a request refused or aborted before it held KV:
    such requests are retired to the ended LRU after IDLE_REQUEST_NS (still findable);
    a request holding a row, or a stub, is judged by the same rule, never sooner."""
    from kvguard.sidecar.tracker import IDLE_REQUEST_NS, RETIRE_SCAN_NS

    t = tracker()
    t.on_request_begin(wire.ReqBegin(A, 77, 900, 0, False, "A", "acme"), 1_000)
    t.on_reject(wire.Reject(A, wire.Phase.ADMISSION, "too long"))
    t.on_request_begin(wire.ReqBegin(B, 78, 8, 0, False, "B", "globex"), 1_000)
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(B, 0, 8, 0, np.array([1, 2])))
    stub = t.requests.get_or_stub(wire.request_key("C"))
    assert t.retire_idle_requests(1_000 + IDLE_REQUEST_NS) == 0  # not idle long enough (and the stub is first seen)
    now = 1_000 + IDLE_REQUEST_NS + RETIRE_SCAN_NS + 1
    assert t.retire_idle_requests(now) == 1  # A only: B holds pages, the stub's clock started at the last scan
    assert A not in t.requests.live and t.requests.get(A).rid == "A" and B in t.requests.live
    assert t.retire_idle_requests(now + 1) == 0  # at most one scan per RETIRE_SCAN_NS
    assert t.retire_idle_requests(1_000 + 2 * IDLE_REQUEST_NS + 2 * RETIRE_SCAN_NS) == 1  # the stub
    assert stub.key not in t.requests.live and t.requests_retired_idle == 2


def test_whole_batch_judge_matches_one_request_at_a_time():
    # a batch mixing a clean reader, an unwritten page, a foreign page, a freed page, padding and an
    # out-of-range page, an unknown reader and a reader without a row: judged at once it gives the
    # same verdicts and blind-window counts as judged one request at a time
    def build():
        t = tracker()
        for rid in "ABCD":
            begin(t, rid)
        t.on_alloc(np.arange(1, 13))
        for n, rid in enumerate("ABC"):
            pages = np.arange(1 + 4 * n, 5 + 4 * n)
            t.on_assign(wire.Assign(wire.request_key(rid), 0, 16, 0, pages))
            t.mark_written(wire.request_key(rid), pages[:3] if rid == "B" else pages, 1)
        t.on_free(np.array([12]))
        return t

    keys = np.array([wire.request_key(r) for r in "ABCDE"], np.uint64)
    seq = np.array([16, 16, 16, 8, 8], np.uint32)
    rows = [
        np.array([1, 2, 3, 4]),
        np.array([5, 6, 7, 8]),
        np.array([9, 10, 11, 12, 3, 0, 2**30, 13]),
        np.array([1]),
        np.array([2, 3]),
    ]
    counts = np.array([len(r) for r in rows], np.uint32)
    for actual in (True, False):
        one, batch = build(), build()
        singles = [one.judge.classify_read(int(k), int(s), r if actual else None) for k, s, r in zip(keys, seq, rows)]
        got = dict(
            batch.judge.classify_reads(
                keys, seq, counts if actual else None, np.concatenate(rows) if actual else None, want_shared=True
            )
        )
        every = dict(
            build().judge.classify_reads(
                keys, seq, counts if actual else None, np.concatenate(rows) if actual else None, every=True
            )
        )
        for i, v in enumerate(singles):
            assert (v is None) == (i not in every)
            if v is None:
                continue
            b = got.get(i) or every[i]
            assert [x.tolist() for x in (v.unwritten, v.foreign, v.freed, v.shared)] == [
                x.tolist() for x in (b.unwritten, b.foreign, b.freed, b.shared)
            ] and v.unverified == b.unverified
            clean = not (len(v.unwritten) or len(v.foreign) or len(v.freed) or v.unverified or len(v.shared))
            assert (i in got) == (not clean)  # clean readers get no verdict object
        assert (one.judge.pages_read, one.judge.pages_unverified, one.pool.pages_out_of_range) == (
            batch.judge.pages_read,
            batch.judge.pages_unverified,
            batch.pool.pages_out_of_range,
        )
        # B read an unwritten page, C a freed one (with the engine's rows also a foreign and an unknown
        # one); D holds no row and E never began: neither is judged, their pages count as unverified
        assert sorted(got) == [1, 2]


def test_whole_batch_writes_match_one_request_at_a_time():
    # A writes its own page, B a freed page and one of A's, C (no REQ_BEGIN seen: not judged) a freed
    # page, D padding and an out-of-range page: the same verdicts, marks and counts either way
    def build():
        t = tracker()
        for rid in "ABD":
            begin(t, rid)
        t.on_alloc(np.arange(1, 9))
        t.on_assign(wire.Assign(A, 0, 8, 0, np.array([1, 2])))
        t.on_assign(wire.Assign(B, 0, 8, 0, np.array([3, 4])))
        t.on_free(np.array([5, 6]))
        return t

    keys = np.array([wire.request_key(r) for r in "ABCD"], np.uint64)
    writes = [np.array([1]), np.array([3, 5, 2]), np.array([6]), np.array([0, 2**30, 7])]
    counts = np.array([len(w) for w in writes], np.uint32)
    one, batch = build(), build()
    singles = []
    for k, w in zip(keys.tolist(), writes):
        singles.append(one.judge.check_write(k, w.astype(np.int64)))
        one.mark_written(k, w.astype(np.int64), 7)
    assert not batch.judge.writes_overlap(np.concatenate(writes))
    got = dict(batch.judge.check_writes(keys, counts, np.concatenate(writes)))
    batch.mark_writes(keys, counts, np.concatenate(writes), 7)
    assert sorted(got) == [1] and singles[1] is not None and all(v is None for i, v in enumerate(singles) if i != 1)
    assert (
        (got[1].freed.tolist(), got[1].foreign.tolist())
        == (singles[1].freed.tolist(), [2])
        == ([5], singles[1].foreign.tolist())
    )
    for name in ("state", "gen", "written_gen", "owner", "last_writer", "last_write_ns"):
        assert np.array_equal(getattr(one.pool, name), getattr(batch.pool, name)), name
    assert (
        one.pool.pages_out_of_range == batch.pool.pages_out_of_range == 2
    )  # judged writer D: counted twice, as before
    assert batch.judge.writes_overlap(np.array([3, 5, 3]))


def test_a_decode_steps_writes_are_marked_at_once_and_anything_to_report_takes_the_general_path():
    # one page per request, each its writer's own: marked by decode_writes exactly as mark_writes
    # marks them; a page named twice, a freed page, another request's page, or not one page per
    # request: nothing done there (the general path judges and marks them)
    c_key = wire.request_key("C")

    def build():
        t = tracker()
        for rid in "ABC":
            begin(t, rid)
        t.on_alloc(np.arange(1, 9))
        for key, pages in ((A, [1, 2]), (B, [3, 4]), (c_key, [5])):
            t.on_assign(wire.Assign(key, 0, 8, 0, np.array(pages)))
        t.on_free(np.array([5]))
        return t

    keys = np.array([A, B], np.uint64)
    ones = np.ones(2, np.uint32)
    fast, general = build(), build()
    assert fast.decode_writes(keys, ones, np.array([2, 4]), 7)
    general.mark_writes(keys, ones, np.array([2, 4]), 7)
    for name in ("state", "gen", "written_gen", "owner", "last_writer", "last_write_ns"):
        assert np.array_equal(getattr(fast.pool, name), getattr(general.pool, name)), name
    assert fast.pool.written_gen[2] == fast.pool.gen[2] and fast.pool.last_writer[4] == B
    empty = np.zeros(0, np.uint64)  # a forward of no request (found by the fuzz harness: max() of nothing)
    assert not fast.decode_writes(empty, np.zeros(0, np.uint32), np.zeros(0, np.int32), 8)
    for counts, pages in ((ones, [2, 2]), (ones, [2, 5]), (ones, [4, 3]), (np.array([2, 0], np.uint32), [1, 2])):
        t = build()
        before = t.pool.written_gen.copy()
        assert not t.decode_writes(keys, counts, np.array(pages), 7), pages
        assert np.array_equal(t.pool.written_gen, before), pages  # nothing marked


def test_per_token_assign_repeating_the_row_changes_nothing_and_a_new_one_still_applies():
    t = tracker()
    begin(t, "A")
    begin(t, "B")
    t.on_alloc(np.array([1, 2]))
    t.on_assign(wire.Assign(A, 0, 4, 0, np.array([1])))
    t.on_assign(wire.Assign(A, 5, 6, 0, np.array([1])))  # token 5 is on row page 1: a new entry
    assert t.rows[A].pages.tolist() == [1, 1] and t.pool.owner[1] == A
    t.on_assign(wire.Assign(A, 6, 7, 0, np.array([1])))  # same entry again: nothing changes
    assert t.rows[A].pages.tolist() == [1, 1]
    t.on_assign(wire.Assign(A, 7, 8, 8, np.array([1])))  # now said to come from the prefix cache
    assert t.rows[A].shared.tolist() == [False, True]
    t.on_assign(wire.Assign(B, 0, 1, 0, np.array([2])))
    t.on_free(np.array([2]))
    t.on_alloc(np.array([2]))  # reallocated: B's repeat names a new generation and claims it again
    t.on_assign(wire.Assign(B, 1, 2, 0, np.array([2])))
    assert t.rows[B].gens.tolist() == [2] and t.pool.state[2] == OWNED and t.pool.owner[2] == B


def test_requests_whose_end_fell_in_a_gap_are_retired_with_their_rows():
    """Issue 14: a request live when records were lost, and named by no record for
    LOST_UNSEEN_NS since, ended in the gap (its REQ_END was lost): it leaves the live directory
    and its row is dropped. One named after the gap (a forward, an ASSIGN), or waiting for its
    transfer, is kept; without a gap nothing is retired however long a request lives."""
    from kvguard.sidecar.tracker import LOST_UNSEEN_NS, RETIRE_SCAN_NS

    t = tracker()
    C, D = wire.request_key("C"), wire.request_key("D")
    for n, rid in enumerate("ABCD"):
        begin(t, rid)
        t.on_alloc(np.array([1 + n]))
        t.on_assign(wire.Assign(wire.request_key(rid), 0, 4, 0, np.array([1 + n])))
    assert t.retire_idle_requests(10 * LOST_UNSEEN_NS) == 0  # no gap: live as long as they like
    t.on_lost(100)
    assert set(t.unseen_since_loss) == {A, B, C, D}
    t.on_named(
        wire.Forward(
            np.array([B], np.uint64),
            np.array([4], np.uint32),
            np.zeros(1, np.uint32),
            np.zeros(0, np.int32),
            None,
            None,
        )
    )
    t.on_named(wire.Assign(C, 4, 8, 0, np.array([9])))
    t.transfer_hold.add(D)
    t._next_retire_ns = 0
    assert t.retire_idle_requests(100 + LOST_UNSEEN_NS) == 0  # not unseen long enough
    t._next_retire_ns = 0
    assert t.retire_idle_requests(101 + LOST_UNSEEN_NS + RETIRE_SCAN_NS) == 1  # A only
    assert A not in t.requests.live and A not in t.rows and t.requests.get(A).rid == "A"  # still findable
    assert {B, C, D} <= set(t.requests.live) and {B, C, D} <= set(t.rows)
    assert t.requests_retired_after_loss == 1 and set(t.unseen_since_loss) == {D}  # held: asked again later
    # a request retired wrongly that reads again is not judged against a model it no longer has
    v = t.judge.classify_read(A, 4, np.array([1]))
    assert v is None


@pytest.mark.parametrize("seed", range(6))
def test_a_decode_steps_writes_one_page_each_match_one_request_at_a_time(seed):
    """``check_writes`` / ``mark_writes`` take a shortcut for a decode step (one page per request,
    every id in the pool): the same verdicts, marks and counts as one request at a time, with
    writes into freed pages, into other requests' pages, into pages nobody holds or never seen,
    and (in some batches) padding or an id past the pool, which take the general path."""
    rng = np.random.default_rng(seed)
    rids = [f"r{i}" for i in range(12)]
    keys = np.array([wire.request_key(r) for r in rids], np.uint64)

    def build():
        t = tracker()
        for rid in rids[:10]:  # the last two never began: not judged
            begin(t, rid)
        t.on_alloc(np.arange(1, 36))
        t.pool.ensure(np.array([39]))  # pages 36-39 in the pool but never seen: UNKNOWN
        for i, k in enumerate(keys.tolist()):
            t.on_assign(wire.Assign(k, 0, 8, 0, np.array([1 + 2 * i, 2 + 2 * i])))
        t.on_free(np.array([3, 4, 30, 31, 32]))  # r1's pages and free ones nobody holds
        return t

    for trial in range(4):
        # each request its own first page, or (distinct ones) its second, a freed page (r1's, or
        # one nobody held), another request's page, allocated pages nobody holds, or unseen ones
        odd = list(rng.permutation([30, 31, 32, 33, 34, 36, 37, 38]))
        writes = np.array([2 + 2 * i if rng.random() < 0.5 else 1 + 2 * i for i in range(12)], np.int64)
        for i in rng.choice(12, 5, replace=False).tolist():
            writes[i] = odd.pop()
        if trial == 1:  # two requests' first pages swapped (each writes the other's), nothing freed
            writes = np.array([1 + 2 * i for i in range(12)], np.int64)
            writes[1] = 35  # (r1's own pages were freed)
            writes[5], writes[6] = 1 + 2 * 6, 1 + 2 * 5
        if trial == 3:
            writes[rng.integers(12)] = rng.choice([0, 2**30])
        assert len(np.unique(writes)) == len(writes)  # (a page written twice takes the one-by-one path)
        counts = np.ones(12, np.uint32)
        one, batch = build(), build()
        singles = {}
        for i, (k, w) in enumerate(zip(keys.tolist(), writes.tolist())):
            v = one.judge.check_write(k, np.array([w], np.int64))
            if v is not None:
                singles[i] = (v.freed.tolist(), v.foreign.tolist())
            one.mark_written(k, np.array([w], np.int64), 7)
        got = {
            i: (v.freed.tolist(), v.foreign.tolist())
            for i, v in batch.judge.check_writes(keys, counts, writes.astype(np.int32))
        }
        batch.mark_writes(keys, counts, writes.astype(np.int32), 7)
        assert got == singles, (seed, trial, writes.tolist())
        for name in ("state", "gen", "written_gen", "owner", "last_writer", "last_write_ns"):
            assert np.array_equal(getattr(one.pool, name), getattr(batch.pool, name)), (name, seed, trial)
        assert one.pool.pages_out_of_range == batch.pool.pages_out_of_range

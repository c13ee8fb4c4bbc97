"""The narrowed page columns (sidecar/tracker.py, ``KeyTable`` and ``PagePool``): ``owner`` and
``last_writer`` are u32 slots of a per-pool request-key table, the last write time u32
milliseconds; a row entry is an int32 page and a u32 holding its gen and prefix-cache flag.
Keys read back exactly whatever the table went through (lookups past its sorted index, several
slots per key, compaction at any point), the table stays bounded, and gens wrap at 2**31 on
both sides of the comparison."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bench.workload import capture
from kvguard.engine_hooks import wire
from kvguard.sidecar.tracker import (
    GEN_MASK,
    KEYS_COMPACT_MIN,
    NO_SLOT,
    SHARED_BIT,
    EngineTracker,
    KeyTable,
    RequestDirectory,
    RequestInfo,
)
from tests.sidecar.test_judge_incremental import TINY, Replay, corrupt, decode


def test_key_table_finds_every_key_in_and_past_its_sorted_index_and_after_keep():
    rng = np.random.default_rng(3)
    keys = rng.integers(1, 2**63, 300, dtype=np.int64).astype(np.uint64) * np.uint64(2)  # some >= 2**63
    t = KeyTable()
    slots = np.concatenate([t.intern(keys[i : i + n]) for i, n in ((0, 100), (100, 169), (269, 1), (270, 30))])
    assert t._indexed < len(t)  # the newest keys sit past the sorted index, and are found there
    assert np.array_equal(t.keys[slots], keys) and len(set(slots.tolist())) == 300
    assert np.array_equal(t.find(keys[::-1]), slots[::-1]) and np.array_equal(t.intern(keys), slots)
    assert [t.find_one(int(k)) for k in keys[:5]] == slots[:5].tolist()
    assert t.find(np.array([0, 5], np.uint64)).tolist() == [0, NO_SLOT] and t.find_one(5) == NO_SLOT
    dup = t.append_one(int(keys[7]))  # a new row's own slot for a key the table holds already
    assert dup == 301 and t.keys[dup] == keys[7] and t.keys[t.find_one(int(keys[7]))] == keys[7]
    kept = np.array([0, 5, 200, 301], np.uint32)
    before = t.keys.copy()
    remap = t.keep(kept)
    assert len(t) == 4 and remap[kept].tolist() == [0, 1, 2, 3] and remap[6] == NO_SLOT
    assert t.keys.tolist() == before[kept].tolist() and t.keys[3] == keys[7]
    assert t.find(before[[5, 200, 301, 6]]).tolist() == [1, 2, 3, NO_SLOT]


def test_compacting_the_key_table_anywhere_changes_no_finding_and_no_column(monkeypatch):
    compactions = 0
    for rows_every, seed in ((0, 21), (16, 22), (1, 23)):
        stream = capture(replace(TINY, rows_every=rows_every, assign="page"), steps=90)
        records = corrupt(decode(stream.setup + [i for step in stream.steps for i in step]), seed, 0.04, True)
        plain = Replay(True, False, monkeypatch).run(records)
        squeezed = Replay(True, False, monkeypatch)
        pool = squeezed.tracker.pool
        for n, rec in enumerate(records):
            squeezed.pipe.apply(rec)
            if n % 7 == 3:
                before = len(pool.keys)
                pool.compact_keys()
                compactions += len(pool.keys) < before
        a, b = plain.state(), squeezed.state()
        assert a["findings"] and a["apply_errors"] == 0
        for key in a:
            assert a[key] == b[key], (rows_every, seed, key)
        pool.compact_keys()  # once more at the end: only the keys pages still name are left
        assert len(pool.keys) < len(plain.tracker.pool.keys)
    assert compactions > 10  # keys were dropped and the survivors renumbered, again and again


def hello(pool_pages: int) -> wire.Hello:
    return wire.Hello(wire.Role.DECODE, 0, 1, 16, pool_pages, pool_pages * 16, 2048, 250, "sglang", "x", "m", "0")


def test_the_key_table_stays_bounded_under_request_churn():
    t = EngineTracker(0, RequestDirectory())
    t.on_hello(hello(64))
    pages = np.arange(1, 65, dtype=np.int64)
    n = 5 * KEYS_COMPACT_MIN
    for i in range(n):  # each request takes a page, writes it, ends; its page is freed and reused
        key = 10_000 + i
        p = pages[i % 64 : i % 64 + 1]
        t.on_alloc(p)
        t.on_assign(wire.Assign(key, 0, 16, 0, p))
        t.mark_written(key, p, 1_000_000 * i)
        t.on_free(p)
        t.on_request_end(wire.ReqEnd(key, 0, 0, 1, wire.Finish.STOP, ""), 1_000_000 * i)
    # at most the keys 64 pages name (twice: owner, last writer) plus one compaction interval
    assert len(t.pool.keys) <= 1 + 2 * 64 + KEYS_COMPACT_MIN < n
    assert t.pool.keys_epoch >= 3
    last = np.uint64(10_000 + n - 1)
    assert t.pool.last_writer[pages[(n - 1) % 64]] == last and t.pool.owner[pages[(n - 1) % 64]] == 0


def test_last_write_time_keeps_milliseconds_and_survives_49_days():
    t = EngineTracker(0, RequestDirectory())
    t.on_hello(hello(8))
    t0 = 1_700_000_000_123_456_789
    t.mark_written(1, np.array([1]), t0)
    t.mark_written(1, np.array([2]), t0 + 2_500_000)  # 2.5 ms later: kept to the millisecond
    assert t.pool.last_write_ns[[1, 2, 3]].tolist() == [t0, t0 + 2_000_000, 0]  # 3: never written
    later = t0 + 60 * 86_400 * 10**9 + 7_000_000  # past u32 milliseconds: the epoch moves forward
    t.mark_written(2, np.array([3]), later)
    assert int(t.pool.last_write_ns[3]) == later  # (whole ms from the first write: exact here)
    assert t0 < int(t.pool.last_write_ns[1]) <= int(t.pool.last_write_ns[2]) < later  # older writes: clamped
    assert t.pool.last_writer[[1, 2, 3]].tolist() == [1, 1, 2]


def test_a_row_entry_packs_gen_and_prefix_flag_and_gens_wrap_at_2_31():
    a, b = 101, 102
    t = EngineTracker(0, RequestDirectory())
    t.on_hello(hello(8))
    t.requests.begin(RequestInfo(a, "r-a"))
    t.requests.begin(RequestInfo(b, "r-b"))
    t.on_alloc(np.array([2]))
    t.on_assign(wire.Assign(b, 0, 16, 0, np.array([2])))
    t.mark_written(b, np.array([2]), 5)
    t.on_request_end(wire.ReqEnd(b, 0, 0, 1, wire.Finish.STOP, ""), 6)  # page 2 stays, CACHED
    t.pool.gen[3] = GEN_MASK  # the last gen before the wrap
    t.on_alloc(np.array([3]))
    assert t.pool.gen[3] == 0
    t.on_assign(wire.Assign(a, 0, 32, 16, np.array([2, 3])))  # page 2 from the prefix cache, 3 its own
    row = t.rows[a]
    assert row.pages.dtype == np.int32 and row.gen_shared.dtype == np.uint32 and row.pages.nbytes == 8
    assert row.gens.tolist() == [1, 0] and row.shared.tolist() == [True, False]
    assert row.gen_shared.tolist() == [int(SHARED_BIT) | 1, 0]
    t.mark_written(a, np.array([3]), 7)
    v = t.judge.classify_read(a, 32, None)
    assert (v.unwritten.tolist(), v.foreign.tolist(), v.freed.tolist(), v.shared.tolist()) == ([], [], [], [2])
    t.on_alloc(np.array([3]))  # reallocated under the reader: its entry's gen no longer matches
    v = t.judge.classify_read(a, 32, None)
    assert v.foreign.tolist() == [3] and v.shared.tolist() == [2]

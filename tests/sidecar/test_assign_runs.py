"""Back-to-back one-page ASSIGN records decoded as columns (``wire.AssignRun``, what the
sidecar's ring reader asks for) and applied as a batch (``EngineTracker.on_assign_run``) give
exactly what the same records give one by one: the same findings, counters, page state,
rows and history, on the judge's corrupted streams (ASSIGNs of random pages inside runs, a
request twice in a batch, frees and stray allocations between steps, lost records) with an
ASSIGN per request per step; and the run decoder takes into a run only what the one-record
decoder would accept, in sequence.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bench/ is a folder of the repo, not part of the installed distribution
    sys.path.insert(0, str(REPO))

from bench.workload import capture  # noqa: E402
from kvguard.engine_hooks import wire  # noqa: E402
from kvguard.engine_hooks.ring import RingReader, RingWriter  # noqa: E402
from kvguard.engine_hooks.wire.recording import encode_record  # noqa: E402
from tests.sidecar.test_judge_incremental import ENGINE, TINY, Replay, corrupt, decode  # noqa: E402


def encoded(records: list[wire.Record]) -> bytes:
    return b"".join(encode_record(r) for r in records)


def assign(key: int, start: int, page: int, seq: int = 0, engine: int = ENGINE) -> bytes:
    body = wire.Assign(key, start, start + 1, start, np.array([page], np.int32))  # (nothing shared)
    return wire.encode(wire.Kind.ASSIGN, seq, 1_000 + seq, engine, wire.assign_payload(body))


def fields(rec: wire.Record) -> tuple:
    body = rec.body
    if isinstance(body, wire.Assign):
        body = (body.req_key, body.row_start, body.row_end, body.shared_until, body.pages.tolist())
    return (rec.kind, rec.seq, rec.ts_ns, rec.engine_id, rec.pool, repr(body))


# (rows_every, seed, lost records)
CASES = [(0, 11, False), (1, 12, False), (16, 13, True), (0, 14, True), (3, 15, False)]


@pytest.mark.parametrize("isolate", [False, True])
def test_runs_give_what_the_records_give_one_by_one(isolate, monkeypatch):
    runs_seen = 0
    for rows_every, seed, lost in CASES:
        stream = capture(replace(TINY, batch=24, rows_every=rows_every, assign="token"), steps=90)
        raw = encoded(corrupt(decode(stream.setup + [i for step in stream.steps for i in step]), seed, 0.04, lost))
        one_by_one = wire.decode_stream(raw, wire.DecodeStats())
        batched = wire.decode_stream(raw, wire.DecodeStats(), runs=True)
        runs = [r for r in batched if type(r.body) is wire.AssignRun]
        assert runs and len(batched) < len(one_by_one)
        runs_seen += sum(len(r.body) for r in runs)
        # the columns are the records
        assert [fields(r) for r in wire.expand_runs(batched)] == [fields(r) for r in one_by_one]
        a = Replay(True, isolate, monkeypatch).run(one_by_one)
        b = Replay(True, isolate, monkeypatch).run(batched)
        sa, sb = a.state(), b.state()
        for key in sa:
            assert sa[key] == sb[key], (rows_every, seed, key)
        assert sa["findings"] and sa["apply_errors"] == 0
        pa, pb = a.pipe, b.pipe
        assert pa.records_by_kind == pb.records_by_kind
        assert pa.history.total == pb.history.total
        assert np.array_equal(pa.history.events, pb.history.events)
    assert runs_seen > 1000


def test_a_run_takes_only_consecutive_well_formed_one_page_assigns_of_one_engine():
    k = wire.request_key("A")
    parts = [assign(k, 64 * i, 3, seq=i) for i in range(20)]  # a run of 20
    parts += [assign(k, 64 * i, 3, seq=i) for i in range(21, 37)]  # after a gap in sequence numbers: 16
    parts += [assign(k, 64 * i, 3, seq=i) for i in range(38, 53)]  # after another gap, 15: too few for a run
    bad = bytearray(assign(k, 10, 3, seq=53))  # shared_until past the row: a bad payload, on its own
    bad[32 + 16 : 32 + 20] = (99).to_bytes(4, "little")
    parts.append(bytes(bad))
    tail = [assign(k, 64 * i, 3, seq=i) for i in range(54, 74)]
    tail[17] = assign(k, 64 * 71, 3, seq=71, engine=ENGINE + 1)  # another engine id: ends the run (17)
    parts += tail
    multi = wire.Assign(k, 0, 128, 0, np.array([4, 5], np.int32))
    parts.append(wire.encode(wire.Kind.ASSIGN, 74, 2_000, ENGINE, wire.assign_payload(multi)))
    raw = b"".join(parts)
    plain, batched = wire.DecodeStats(), wire.DecodeStats()
    one = wire.decode_stream(raw, plain)
    got = wire.decode_stream(raw, batched, runs=True)
    assert [wire.records_in(r) for r in got] == [20, 16] + [1] * 15 + [17, 1, 1, 1, 1]
    assert [r.seq for r in got[:3]] == [0, 21, 38] and got[-5].seq == 54
    assert got[0].ts_ns == 1_019  # a run's record carries its last record's time (the merge releases it whole)
    assert (batched.records, batched.bad_payload) == (plain.records, plain.bad_payload) == (72, 1)
    assert [fields(r) for r in wire.expand_runs(got)] == [fields(r) for r in one]


def test_the_ring_reader_counts_a_run_as_its_records_and_sees_a_gap_after_it(tmp_path):
    w = RingWriter(str(tmp_path), 4096, engine_id=ENGINE)
    k = wire.request_key("A")
    for i in range(20):
        w.write(
            wire.Kind.ASSIGN, wire.assign_payload(wire.Assign(k, 64 * i, 64 * i + 1, 64 * i, np.array([3], np.int32)))
        )
    for _ in range(2):  # two records too big for the ring: dropped, their sequence numbers used
        assert not w.write(wire.Kind.ALLOC, wire.pages_payload(np.arange(2000, dtype=np.int32)))
    w.write(
        wire.Kind.ASSIGN, wire.assign_payload(wire.Assign(k, 64 * 20, 64 * 20 + 1, 64 * 20, np.array([3], np.int32)))
    )
    r = RingReader(w.path, runs=True)
    result = r.poll()
    kinds = [(rec.kind, wire.records_in(rec)) for rec in result.records]
    assert kinds == [(wire.Kind.ASSIGN, 20), (wire.Kind.LOST, 1), (wire.Kind.ASSIGN, 1)]
    assert result.lost == 2 and result.records[1].body == 2 and r.next_seq == 23
    w.close(unlink=True)


def test_a_later_assign_of_a_request_an_earlier_one_changed_is_applied_after_it(monkeypatch):
    # judged against the state before the run, the second ASSIGN repeats the row's last entry;
    # after the first (which names another page there) it changes the row back
    k = wire.request_key("A")
    hello = wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 2048, 250, "sglang", "x", "m", "0")
    begin = wire.ReqBegin(k, wire.NO_ROOM, 8, 0, False, "A", "t")
    one = np.ones(1, np.uint32)
    write = wire.Forward(np.array([k], np.uint64), one, one, np.array([5], np.int32), None, None)
    setup = [
        wire.encode(wire.Kind.HELLO, 0, 1_000, ENGINE, wire.hello_payload(hello)),
        wire.encode(wire.Kind.REQ_BEGIN, 1, 1_001, ENGINE, wire.req_begin_payload(begin)),
        wire.encode(wire.Kind.ALLOC, 2, 1_002, ENGINE, wire.pages_payload(np.array([5, 6], np.int32))),
        assign(k, 0, 5, seq=3),
        wire.encode(wire.Kind.FORWARD, 4, 1_004, ENGINE, wire.forward_payload(write)),
    ]
    # (a run needs 16: the rest repeat the entry)
    raw = b"".join(setup + [assign(k, 0, 6, seq=5)] + [assign(k, i % 4, 5, seq=6 + i) for i in range(15)])
    batched = wire.decode_stream(raw, wire.DecodeStats(), runs=True)
    assert [wire.records_in(r) for r in batched] == [1, 1, 1, 1, 1, 16]
    a = Replay(True, False, monkeypatch).run(wire.decode_stream(raw, wire.DecodeStats()))
    b = Replay(True, False, monkeypatch).run(batched)
    assert a.tracker.rows[k].pages.tolist() == [5]
    assert a.state() == b.state()


def test_an_assign_to_an_earlier_entry_naming_the_last_entrys_page_changes_the_row(monkeypatch):
    k = wire.request_key("A")
    hello = wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 2048, 250, "sglang", "x", "m", "0")
    both = wire.Assign(k, 0, 8, 0, np.array([5, 6], np.int32))  # (page size 4)
    raw = b"".join(
        [
            wire.encode(wire.Kind.HELLO, 0, 1_000, ENGINE, wire.hello_payload(hello)),
            wire.encode(
                wire.Kind.REQ_BEGIN,
                1,
                1_001,
                ENGINE,
                wire.req_begin_payload(wire.ReqBegin(k, 0, 8, 0, False, "A", "t")),
            ),
            wire.encode(wire.Kind.ALLOC, 2, 1_002, ENGINE, wire.pages_payload(np.array([5, 6], np.int32))),
            wire.encode(wire.Kind.ASSIGN, 3, 1_003, ENGINE, wire.assign_payload(both)),
            assign(k, 0, 6, seq=4),  # entry 0 now names the page of entry 1 (the row's last)
        ]
        + [assign(k, 4, 6, seq=5 + i) for i in range(15)]  # (a run needs 16: these repeat entry 1)
    )
    batched = wire.decode_stream(raw, wire.DecodeStats(), runs=True)
    assert [wire.records_in(r) for r in batched] == [1, 1, 1, 1, 16]
    a = Replay(True, False, monkeypatch).run(wire.decode_stream(raw, wire.DecodeStats()))
    b = Replay(True, False, monkeypatch).run(batched)
    assert a.tracker.rows[k].pages.tolist() == [6, 6]
    assert a.state() == b.state()


def test_an_assign_of_the_same_page_at_a_new_generation_changes_the_row(monkeypatch):
    # the page was freed, allocated again (a new generation) and freed: naming it again is news
    k = wire.request_key("A")
    hello = wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 2048, 250, "sglang", "x", "m", "0")
    five = np.array([5], np.int32)
    records = [
        (wire.Kind.HELLO, wire.hello_payload(hello)),
        (wire.Kind.REQ_BEGIN, wire.req_begin_payload(wire.ReqBegin(k, 0, 8, 0, False, "A", "t"))),
        (wire.Kind.ALLOC, wire.pages_payload(five)),
        (wire.Kind.ASSIGN, wire.assign_payload(wire.Assign(k, 0, 1, 0, five))),
        (wire.Kind.FREE, wire.pages_payload(five)),
        (wire.Kind.ALLOC, wire.pages_payload(five)),
        (wire.Kind.FREE, wire.pages_payload(five)),
    ]
    raw = b"".join(wire.encode(kind, seq, 1_000 + seq, ENGINE, payload) for seq, (kind, payload) in enumerate(records))
    raw += b"".join(assign(k, i % 4, 5, seq=len(records) + i) for i in range(16))
    batched = wire.decode_stream(raw, wire.DecodeStats(), runs=True)
    assert [wire.records_in(r) for r in batched][-1] == 16
    a = Replay(True, False, monkeypatch).run(wire.decode_stream(raw, wire.DecodeStats()))
    b = Replay(True, False, monkeypatch).run(batched)
    assert a.tracker.rows[k].gens.tolist() == [int(a.tracker.pool.gen[5])]
    assert a.state() == b.state()


@pytest.mark.parametrize("isolate", [False, True])
def test_the_scalar_append_path_gives_what_the_array_path_gives(isolate, monkeypatch):
    # EngineTracker._assign_appends_one (a decode step's new page, by scalars) against on_assign's
    # general path for the same ASSIGNs, on the corrupted streams of both ASSIGN shapes
    taken = 0
    for assign_mode, (rows_every, seed, lost) in zip(("page", "token", "page", "token", "page"), CASES):
        stream = capture(replace(TINY, batch=24, rows_every=rows_every, assign=assign_mode), steps=90)
        records = corrupt(decode(stream.setup + [i for step in stream.steps for i in step]), seed, 0.04, lost)
        fast = Replay(True, isolate, monkeypatch)
        appends = fast.tracker._assign_appends_one

        def counted(*args, appends=appends):
            nonlocal taken
            done = appends(*args)
            taken += done
            return done

        fast.tracker._assign_appends_one = counted
        fast.run(records)
        general = Replay(True, isolate, monkeypatch)
        general.tracker._assign_appends_one = lambda *args: False
        general.run(records)
        a, b = fast.state(), general.state()
        for key in a:
            assert a[key] == b[key], (assign_mode, seed, key)
        assert np.array_equal(fast.pipe.history.events, general.pipe.history.events)
    assert taken > 500


@pytest.mark.parametrize(
    "field, offset, value",
    [
        ("version", 2, (2).to_bytes(1, "little")),
        ("kind", 3, bytes([int(wire.Kind.XFER_DONE)])),
        ("pool", 28, (1).to_bytes(2, "little")),
    ],
)
def test_a_record_of_another_version_kind_or_pool_in_the_middle_ends_a_run(field, offset, value):
    """The run's header check is made of whole words (decode.py): each field in them still ends
    a run where it differs, and the odd record decodes (or is skipped) as on its own."""
    k = wire.request_key("A")
    parts = [bytearray(assign(k, 64 * i, 3, seq=i)) for i in range(40)]
    parts[20][offset : offset + len(value)] = value
    raw = b"".join(map(bytes, parts))
    plain, batched = wire.DecodeStats(), wire.DecodeStats()
    one = wire.decode_stream(raw, plain)
    got = wire.decode_stream(raw, batched, runs=True)
    assert wire.records_in(got[0]) == 20, field  # the run stops before the odd record
    assert [fields(r) for r in wire.expand_runs(got)] == [fields(r) for r in one]
    assert (batched.records, batched.bad_payload, batched.bad_version, batched.unknown_kind) == (
        plain.records,
        plain.bad_payload,
        plain.bad_version,
        plain.unknown_kind,
    )


@pytest.mark.parametrize("length", [16, 17, 31, 32, 33, 255, 256, 257, 300, 4096, 5000])
def test_a_run_of_any_length_before_a_forward_decodes_to_its_records(length):
    """A run's end is found by header probes at doubling distances, then checked as arrays: at
    every length (around the probes, and past the most records one run takes) the run stands
    for exactly the records it covers, and the FORWARD after it decodes whole."""
    k = wire.request_key("A")
    parts = [assign(k, 64 * i, 3, seq=i) for i in range(length)]
    keys = np.array([k], np.uint64)
    big = wire.Forward(keys, np.array([64], np.uint32), np.array([0], np.uint32), np.zeros(0, np.int32), None, None)
    parts.append(wire.encode(wire.Kind.FORWARD, length, 9_000, ENGINE, wire.forward_payload(big)))
    raw = b"".join(parts)
    plain, batched = wire.DecodeStats(), wire.DecodeStats()
    one = wire.decode_stream(raw, plain)
    got = wire.decode_stream(raw, batched, runs=True)
    assert sum(map(wire.records_in, got)) == length + 1 and got[-1].kind == wire.Kind.FORWARD
    assert [wire.records_in(r) for r in got[:-1]] == [min(4096, length - i) for i in range(0, length, 4096)]
    assert [fields(r) for r in wire.expand_runs(got)] == [fields(r) for r in one]
    assert batched.records == plain.records == length + 1

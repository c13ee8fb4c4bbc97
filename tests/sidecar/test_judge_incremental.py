"""Judging only what changed (``Judge._classify_changed``) gives exactly what the full
judge gives: corrupted record streams replayed through a pipeline with each judge must
produce identical findings (every one, suppressed repeats included), counters, incidents,
page state and rows.

The streams are the bench's reference workload at tiny sizes (bench/workload.py: prefix
sharing, requests ending and arriving, sampled engine rows), corrupted at random: writes
to random pages, engine rows naming other pages, ASSIGNs of random pages, pages freed
under live requests (use after free), double frees, pages stolen by a stray ALLOC, a
request twice in a batch, an unknown reader, a REQ_BEGIN that comes after the request's
rows and forwards (a stub reader with a row), seq_lens past the row or shorter, lost
records and a repeated HELLO; with tenant isolation off and on.
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

from bench.workload import WorkloadParams, capture  # noqa: E402
from kvguard.engine_hooks import wire  # noqa: E402
from kvguard.sidecar import tracker as tracker_mod  # noqa: E402
from kvguard.sidecar.pipeline import Pipeline  # noqa: E402
from kvguard.sidecar.sinks.basic import MemorySink  # noqa: E402
from kvguard.sidecar.tracker import EngineTracker  # noqa: E402

TINY = WorkloadParams(
    page_size=16, pool_tokens=1024 * 16, batch=6, prefix_groups=2, prefix_tokens=128, prompt_tokens=40, output_tokens=40
)
ENGINE = 7


def decode(items) -> list[wire.Record]:
    out = []
    for seq, (kind, payload, _flags) in enumerate(items):
        raw = wire.encode(wire.Kind(kind), seq, 1_000 + seq, ENGINE, payload)
        out.extend(wire.decode_stream(raw, wire.DecodeStats()))
    return out


def corrupt(records: list[wire.Record], seed: int, rate: float, lost: bool) -> list[wire.Record]:
    rng = np.random.default_rng(seed)
    pool_pages = TINY.pool_pages
    hello = records[0]
    seen_frees: list[wire.Record] = []
    out: list[wire.Record] = []

    def rnd_pages(n, beyond=True):  # mostly real pages, sometimes padding or past the pool's limit
        p = rng.integers(1, pool_pages, n)
        p[rng.random(n) < 0.05] = 0
        if beyond:  # (not for ALLOC: the pipeline's ALLOC history entry cannot take an id past the limit)
            p[rng.random(n) < 0.03] = pool_pages + 5000
        return p.astype(np.int64)

    def extra(kind, body):
        return wire.Record(kind, 0, 0, ENGINE, 0, body)

    late: list[tuple[int, wire.Record]] = []  # REQ_BEGINs held back: (records until delivered, record)
    for rec in records[1:]:
        for held in [h for h in late if h[0] <= len(out)]:  # a begin seen after the request's rows
            late.remove(held)
            out.append(held[1])
        if rec.kind == wire.Kind.REQ_BEGIN and rng.random() < 3 * rate:
            late.append((len(out) + int(rng.integers(5, 60)), rec))  # its ASSIGNs and forwards come first
            continue
        if rec.kind == wire.Kind.FORWARD:
            f = rec.body
            if rng.random() < rate:  # stray pages freed (and maybe stolen) right before a forward
                pages = rnd_pages(int(rng.integers(1, 4)), beyond=False)
                fr = extra(wire.Kind.FREE, wire.Pages(pages))
                out.append(fr)
                seen_frees.append(fr)
                if rng.random() < 0.5:
                    out.append(extra(wire.Kind.ALLOC, wire.Pages(pages[:1])))
            if rng.random() < rate:  # an ALLOC of pages someone holds
                out.append(extra(wire.Kind.ALLOC, wire.Pages(rnd_pages(1, beyond=False))))
            f = wire.Forward(
                f.req_keys.copy(),
                f.seq_lens.copy(),
                f.write_counts.copy(),
                f.write_pages.copy(),
                None if f.read_counts is None else f.read_counts.copy(),
                None if f.read_pages is None else f.read_pages.copy(),
                f.mode,
            )
            if len(f.write_pages) and rng.random() < rate:
                f.write_pages[rng.integers(len(f.write_pages))] = rnd_pages(1)[0]
            if f.read_pages is not None and len(f.read_pages) and rng.random() < 3 * rate:
                f.read_pages[rng.integers(len(f.read_pages))] = rnd_pages(1)[0]
            if len(f.seq_lens) and rng.random() < rate:  # a seq_len past the row, or shorter than judged before
                i = rng.integers(len(f.seq_lens))
                f.seq_lens[i] = max(0, int(f.seq_lens[i]) + int(rng.choice([-40, -17, -1, 1, 17, 40])))
                if f.read_counts is not None:  # keep the engine rows consistent with the record
                    f = wire.Forward(f.req_keys, f.seq_lens, f.write_counts, f.write_pages, None, None, f.mode)
            if rng.random() < rate:  # the same request twice, and a reader nobody began
                extra_keys = [f.req_keys[0], np.uint64(wire.request_key(f"ghost-{seed}"))]
                f = wire.Forward(
                    np.concatenate((f.req_keys, np.array(extra_keys, np.uint64))),
                    np.concatenate((f.seq_lens, f.seq_lens[:1], np.array([32], np.uint32))),
                    np.concatenate((f.write_counts, np.zeros(2, np.uint32))),
                    f.write_pages,
                    None,
                    None,
                    f.mode,
                )
            rec = wire.Record(rec.kind, rec.seq, rec.ts_ns, rec.engine_id, rec.pool, f)
        elif rec.kind == wire.Kind.ASSIGN and rng.random() < rate:
            a = rec.body
            pages = a.pages.copy()
            if len(pages):
                pages[rng.integers(len(pages))] = rnd_pages(1)[0]
            rec = wire.Record(
                rec.kind,
                rec.seq,
                rec.ts_ns,
                rec.engine_id,
                rec.pool,
                wire.Assign(a.req_key, a.row_start, a.row_end, a.shared_until, pages),
            )
        elif rec.kind == wire.Kind.FREE and rng.random() < rate:
            out.append(rec)  # a double free
        out.append(rec)
        if seen_frees and rng.random() < rate / 4:
            out.append(seen_frees[int(rng.integers(len(seen_frees)))])  # an old free again
        if lost and rng.random() < rate / 10:
            out.append(extra(wire.Kind.LOST, 3))
        if rng.random() < rate / 10:
            out.append(hello)
    out.extend(h[1] for h in late)
    out.insert(0, hello)
    return [wire.Record(r.kind, seq, 1_000 + seq, r.engine_id, r.pool, r.body) for seq, r in enumerate(out)]


class Replay:
    """A pipeline whose tracker judges incrementally or fully, keeping every finding it files."""

    def __init__(self, incremental: bool, isolate: bool, monkeypatch):
        monkeypatch.setattr(tracker_mod, "INCREMENTAL_JUDGE", incremental)
        self.pipe = Pipeline([MemorySink()], isolate_tenants=isolate)
        self.tracker = self.pipe.tracker(ENGINE)
        assert self.tracker.judge.incremental is incremental
        self.findings: list[dict] = []
        self.judged = 0
        emit, judge = self.pipe.out.emit, self.tracker.judge._judge_pages

        def keep(found):
            self.findings += [f.to_dict() for f in found]
            return emit(found)

        def count(pages, *args):
            self.judged += len(pages)
            return judge(pages, *args)

        self.pipe.out.emit = keep
        self.tracker.judge._judge_pages = count

    def run(self, records) -> Replay:
        for rec in records:
            self.pipe.apply(rec)
        return self

    def state(self) -> dict:
        t, p = self.tracker, self.pipe
        pool = t.pool
        return {
            "findings": self.findings,
            "delivered": [f.to_dict() for f in p.sinks[0].findings],
            "findings_by_kind": dict(p.findings_by_kind),
            "incidents_by_kind": dict(p.incidents_by_kind),
            "suppressed": p.findings_suppressed,
            "apply_errors": p.apply_errors,
            "lost": p.records_lost,
            "pages_read": t.judge.pages_read,
            "pages_unverified": t.judge.pages_unverified,
            "out_of_range": pool.pages_out_of_range,
            "pool": {
                name: getattr(pool, name).tolist()
                for name in ("state", "gen", "written_gen", "owner", "last_writer", "last_write_ns")
            },
            "rows": {k: (r.pages.tolist(), r.gens.tolist(), r.shared.tolist()) for k, r in t.rows.items()},
        }


# (rows_every, seed, lost records): after a loss most pages stay unknown (never judged, counted
# unverified on every read) until reallocated, so those streams are judged almost in full
CASES = [
    (0, 1, False),
    (0, 2, True),
    (3, 3, False),
    (16, 4, False),
    (0, 5, False),
    (5, 6, True),
    (1, 7, False),
    (16, 8, True),
    (0, 9, False),
    (2, 10, False),
]


@pytest.mark.parametrize("isolate", [False, True])
def test_corrupted_streams_give_identical_findings_counters_and_state(isolate, monkeypatch):
    kinds = set()
    for rows_every, seed, lost in CASES:
        stream = capture(replace(TINY, rows_every=rows_every, assign="page"), steps=90)
        records = corrupt(decode(stream.setup + [i for step in stream.steps for i in step]), seed, 0.04, lost)
        full = Replay(False, isolate, monkeypatch).run(records)
        incr = Replay(True, isolate, monkeypatch).run(records)
        a, b = full.state(), incr.state()
        assert a["apply_errors"] == 0
        for key in a:
            assert a[key] == b[key], (rows_every, seed, key)
        assert a["findings"] and a["pages_read"] > 0
        kinds |= {k for k, _sev in a["findings_by_kind"]}
        if isolate:  # isolation checks take the full judge
            assert incr.judged == full.judged
        elif rows_every == 1:  # so do engine rows (the corruption drops some)
            assert incr.judged <= full.judged
        elif not lost:  # the incremental judge did judge less (all of every FORWARD with rows)
            share = 0.5 if rows_every == 0 or rows_every >= 5 else 0.8
            assert incr.judged < share * full.judged, (rows_every, seed, incr.judged, full.judged)
    # the corruption shows: bad reads and writes of every kind were caught (and judged alike)
    assert {"unwritten_read", "foreign_read", "use_after_free", "double_free", "events_lost"} <= kinds, kinds
    assert len(kinds) >= 6, kinds


def test_clean_stream_judges_each_page_once_and_counts_every_read(monkeypatch):
    stream = capture(replace(TINY, rows_every=0, assign="page"), steps=60)
    records = decode(stream.setup + [i for step in stream.steps for i in step])
    full = Replay(False, False, monkeypatch).run(records)
    incr = Replay(True, False, monkeypatch).run(records)
    assert full.state() == incr.state()
    assert incr.findings == [] and incr.tracker.judge.pages_read == stream.page_reads
    # steady state: a decode step judges only the pages its requests started (plus prefills)
    assert incr.judged < stream.page_reads / 10 < full.judged


def test_a_page_freed_under_a_clean_row_is_judged_again(monkeypatch):
    monkeypatch.setattr(tracker_mod, "INCREMENTAL_JUDGE", True)
    t = EngineTracker(1, tracker_mod.RequestDirectory())
    t.on_hello(wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 2048, 250, "sglang", "x", "m", "0"))
    a, b = wire.request_key("A"), wire.request_key("B")
    for rid in "AB":
        t.on_request_begin(wire.ReqBegin(wire.request_key(rid), wire.NO_ROOM, 8, 0, False, rid, "t"), 0)
    t.on_alloc(np.arange(1, 9))
    t.on_assign(wire.Assign(a, 0, 16, 0, np.array([1, 2, 3, 4])))
    t.on_assign(wire.Assign(b, 0, 16, 8, np.array([1, 2, 5, 6])))  # B shares A's first two pages
    t.mark_writes(np.array([a, b], np.uint64), np.array([4, 2], np.uint32), np.array([1, 2, 3, 4, 5, 6]), 1)
    keys, seq = np.array([a, b], np.uint64), np.array([16, 16], np.uint32)
    assert t.judge.classify_reads(keys, seq) == [] and (t.rows[a].clean_n, t.rows[b].clean_n) == (4, 4)
    assert t.judge.classify_reads(keys, seq) == [] and t.judge.pages_read == 16
    t.on_free(np.array([3]))  # A's private page: only A's row is judged again, from that entry
    assert t.rows[a].clean_n == 4
    ((i, v),) = t.judge.classify_reads(keys, seq)
    assert i == 0 and v.freed.tolist() == [3] and t.rows[a].clean_n == 2 and t.rows[b].clean_n == 4
    epoch = t.judge.judge_epoch
    t.on_free(np.array([1]))  # a page B judged clean as shared: every row is judged again
    found = dict(t.judge.classify_reads(keys, seq))
    assert t.judge.judge_epoch == epoch + 1
    assert found[0].freed.tolist() == [1, 3] and found[1].freed.tolist() == [1]
    assert t.judge.pages_read == 4 * 8  # four forwards of two 4-page reads, every page counted each time


class _Tap:
    """A ``RingWriter`` look-alike: records of several engines in one list, in call order."""

    def __init__(self, items: list, engine_id: int):
        self.items, self.engine_id = items, engine_id
        self.records_written = self.dropped_records = 0

    def write(self, kind, payload: bytes, pool: int = 0, flags: int = 0) -> bool:
        self.items.append((self.engine_id, int(kind), payload))
        self.records_written += 1
        return True

    def write_sticky(self, kind, payload, pool=0, append=False):  # RingWriter's: a copy kept (not here)
        return self.write(kind, payload, pool)


def test_a_provisional_transfer_undone_by_a_trailing_short_send_is_judged_again(monkeypatch):
    """Decode reads pages a transfer was provisionally taken to have written (the sender's record
    trails); the sender then says it sent 1 token of 8: those pages are unwritten again, and the
    next decode step's read must say so with the incremental judge as with the full one."""
    from kvguard.engine_hooks.probes import Probes

    def slots(pages):
        return np.concatenate([np.arange(p * 4, p * 4 + 4) for p in pages])

    items: list = []
    prefill, decode = Probes(_Tap(items, 1)), Probes(_Tap(items, 2))
    prefill.hello("prefill", 0, 4, 1024, 4096, 2048, 2048, "sglang", "0.5.19", "tiny")
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    for p in (prefill, decode):
        p.request_begin("r-x", "initech", 12, 8, 0, False)
    decode.pages_allocated(slots([1, 2, 3]))
    decode.rows_assigned("r-x", 0, 8, 0, slots([1, 2]))
    decode.transfer_reserved("r-x", 12, 8, slots([1, 2]))
    decode.transfer_done("r-x", 12, "receiver", "success")  # before the sender's record: provisional
    decode.rows_assigned("r-x", 8, 9, 8, slots([3])[:1])
    for n in (9, 10):  # decode steps judged clean on the provisional marks
        decode.forward(["r-x"], [n], [slots([3])[n - 9 : n - 8]], None)
    prefill.transfer_sent("r-x", 12, 0, 1, [50], True)  # 1 token after all: page 2 was never written
    decode.forward(["r-x"], [11], [slots([3])[2:3]], None)
    records = []
    for seq, (eid, kind, payload) in enumerate(items):
        raw = wire.encode(wire.Kind(kind), seq, 1_000 + seq, eid, payload)
        records.extend(wire.decode_stream(raw, wire.DecodeStats()))

    def replay(incremental):
        monkeypatch.setattr(tracker_mod, "INCREMENTAL_JUDGE", incremental)
        pipe = Pipeline([MemorySink()])
        seen = []
        emit = pipe.out.emit
        pipe.out.emit = lambda found: (seen.extend(f.to_dict() for f in found), emit(found))[1]
        for rec in records:
            pipe.apply(rec)
        return seen, pipe.engines[2].judge.pages_read

    full, incr = replay(False), replay(True)
    assert full == incr
    kinds = [f["kind"] for f in full[0]]
    # the trailing send's own re-judge (transfer path), then the next decode step's read finds it again
    assert kinds.count("unwritten_read") == 2 and "transfer_size_mismatch" in kinds
    assert all(f["pages"] == [2] for f in full[0] if f["kind"] == "unwritten_read")


def _tracker_with(monkeypatch, *rids: str) -> EngineTracker:
    monkeypatch.setattr(tracker_mod, "INCREMENTAL_JUDGE", True)
    t = EngineTracker(1, tracker_mod.RequestDirectory())
    t.on_hello(wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 2048, 250, "sglang", "x", "m", "0"))
    for rid in rids:
        t.on_request_begin(wire.ReqBegin(wire.request_key(rid), wire.NO_ROOM, 8, 0, False, rid, "t"), 0)
    return t


def _end(t: EngineTracker, rid: str) -> None:
    t.on_request_end(wire.ReqEnd(wire.request_key(rid), 0, 0, 0, wire.Finish.STOP, ""), 0)


def test_a_new_row_starts_unjudged_even_where_an_ended_row_was_clean(monkeypatch):
    # the judge's per-row scalars are reused by index: a new row must not inherit a clean prefix
    t = _tracker_with(monkeypatch, "A")
    a, c = wire.request_key("A"), wire.request_key("C")
    t.on_alloc(np.arange(1, 5))
    t.on_assign(wire.Assign(a, 0, 16, 0, np.array([1, 2, 3, 4])))
    t.mark_writes(np.array([a], np.uint64), np.array([4], np.uint32), np.array([1, 2, 3, 4]), 1)
    assert t.judge.classify_reads(np.array([a], np.uint64), np.array([16], np.uint32)) == []
    index = t.rows[a].index
    assert t.rows[a].clean_n == 4
    _end(t, "A")
    t.on_request_begin(wire.ReqBegin(c, wire.NO_ROOM, 8, 0, False, "C", "t"), 0)
    t.on_alloc(np.arange(5, 9))
    t.on_assign(wire.Assign(c, 0, 16, 0, np.array([5, 6, 7, 8])))  # never written
    assert t.rows[c].index == index and t.rows[c].clean_n == 0
    ((i, v),) = t.judge.classify_reads(np.array([c], np.uint64), np.array([16], np.uint32))
    assert i == 0 and v.unwritten.tolist() == [5, 6, 7, 8]


def test_a_batch_of_the_same_keys_after_its_rows_were_replaced_reads_the_new_rows(monkeypatch):
    # the forward-to-forward memo of row indexes must not outlive the rows it names
    t = _tracker_with(monkeypatch, "A", "B")
    a, b = wire.request_key("A"), wire.request_key("B")
    keys, seq = np.array([a, b], np.uint64), np.array([16, 16], np.uint32)
    t.on_alloc(np.arange(1, 9))
    t.on_assign(wire.Assign(a, 0, 16, 0, np.array([1, 2, 3, 4])))
    t.on_assign(wire.Assign(b, 0, 16, 0, np.array([5, 6, 7, 8])))
    t.mark_writes(keys, np.array([4, 4], np.uint32), np.arange(1, 9), 1)
    assert t.judge.classify_reads(keys, seq) == []
    old = (t.rows[a].index, t.rows[b].index)
    _end(t, "B")
    _end(t, "A")
    for rid in "AB":
        t.on_request_begin(wire.ReqBegin(wire.request_key(rid), wire.NO_ROOM, 8, 0, False, rid, "t"), 0)
    t.on_alloc(np.arange(9, 17))
    t.on_assign(wire.Assign(b, 0, 16, 0, np.array([9, 10, 11, 12])))  # B now holds A's old index
    t.on_assign(wire.Assign(a, 0, 16, 0, np.array([13, 14, 15, 16])))
    assert (t.rows[b].index, t.rows[a].index) == old  # (so a stale memo would read the wrong rows)
    t.mark_writes(np.array([a], np.uint64), np.array([4], np.uint32), np.arange(13, 17), 2)
    t.on_free(np.array([10]))  # freed under B, which never wrote its pages either
    for _ in range(2):  # the second time A's row is clean, B's is not: each read by its own index
        found = dict(t.judge.classify_reads(keys, seq))
        assert list(found) == [1]
        assert found[1].freed.tolist() == [10] and found[1].unwritten.tolist() == [9, 11, 12]


def _row_reads(t: EngineTracker, keys: np.ndarray, rows: list[list[int]], seq: np.ndarray) -> dict:
    """One forward whose record carried the engine's rows: {request index: (foreign, unwritten, freed)}."""
    counts = np.array([len(r) for r in rows], np.uint32)
    pages = np.array([p for r in rows for p in r], np.int32)
    pages.flags.writeable = False  # (as decoded: a view of the record)
    return {
        i: (v.foreign.tolist(), v.unwritten.tolist(), v.freed.tolist())
        for i, v in t.judge.classify_reads(keys, seq, counts, pages)
    }


def _four_written_rows() -> tuple[EngineTracker, np.ndarray, list[list[int]], np.ndarray]:
    """A decode engine's tracker with requests A-D, each owning a row of 3 written pages (page
    size 4: 12 tokens); their keys, rows and seq_lens."""
    t = EngineTracker(2, tracker_mod.RequestDirectory())
    t.on_hello(wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 2048, 250, "sglang", "x", "m", "0"))
    rids = "ABCD"
    keys = np.array([wire.request_key(r) for r in rids], np.uint64)
    for rid in rids:
        t.on_request_begin(wire.ReqBegin(wire.request_key(rid), wire.NO_ROOM, 8, 0, False, rid, "t"), 0)
    t.on_alloc(np.arange(1, 21))
    rows = [[1 + 4 * i, 2 + 4 * i, 3 + 4 * i] for i in range(4)]
    for k, r in zip(keys.tolist(), rows):
        t.on_assign(wire.Assign(k, 0, 12, 0, np.array(r)))
    t.mark_writes(keys, np.full(4, 3, np.uint32), np.array([p for r in rows for p in r]), 1)
    seq = np.full(4, 12, np.uint32)
    return t, keys, rows, seq


@pytest.mark.parametrize("incremental", [True, False])
def test_rows_compared_with_the_last_forwards_still_catch_a_row_that_differs(monkeypatch, incremental):
    """Consecutive forwards with rows (``Judge._rows_as_seen``): an engine row that no longer
    matches while its model row did not change, and a model row that changed (a page appended)
    while the engine's did not follow, are both judged as read; each case gives the full judge's verdicts."""
    monkeypatch.setattr(tracker_mod, "INCREMENTAL_JUDGE", incremental)
    t, keys, rows, seq = _four_written_rows()
    for _ in range(2):  # the second forward compares with the first
        assert _row_reads(t, keys, rows, seq) == {}
    # 1. B's engine row names C's page while B's model row is unchanged
    bad = [r[:] for r in rows]
    bad[1][2] = 9
    assert _row_reads(t, keys, bad, seq) == {1: ([9], [], [])}
    assert _row_reads(t, keys, rows, seq) == {}
    assert _row_reads(t, keys, rows, seq) == {}
    # 2. D's model row gains a page (its token 12 starts one); the engine's row does not follow: D
    # reads 4 pages of a row that has 4, the 4th named page is A's
    t.on_assign(wire.Assign(keys[3].item(), 12, 13, 12, np.array([17])))
    t.mark_writes(keys[3:], np.ones(1, np.uint32), np.array([17]), 2)
    seq = np.array([12, 12, 12, 13], np.uint32)
    grown = [r[:] for r in rows]
    grown[3] = rows[3] + [1]
    assert _row_reads(t, keys, grown, seq) == {3: ([1], [], [])}
    grown[3] = rows[3] + [17]
    assert _row_reads(t, keys, grown, seq) == {}
    assert _row_reads(t, keys, grown, seq) == {}
    # 3. A's and C's engine rows swap their last pages while D's row grows again: three rows differ
    t.on_assign(wire.Assign(keys[3].item(), 16, 17, 16, np.array([18])))
    t.mark_writes(keys[3:], np.ones(1, np.uint32), np.array([18]), 3)
    seq = np.array([12, 12, 12, 17], np.uint32)
    swapped = [r[:] for r in grown]
    swapped[0][2], swapped[2][2] = swapped[2][2], swapped[0][2]
    swapped[3] = grown[3] + [18]
    assert _row_reads(t, keys, swapped, seq) == {0: ([11], [], []), 2: ([3], [], [])}
    # 4. B's model row has its middle page replaced (the same length); the engine's row still
    # names the old one: read where the model no longer has it
    assert _row_reads(t, keys, swapped[:2] + [rows[2]] + swapped[3:], seq) == {0: ([11], [], [])}
    rows_now = [rows[0], rows[1], rows[2], swapped[3]]
    assert _row_reads(t, keys, rows_now, seq) == {}
    t.on_assign(wire.Assign(keys[1].item(), 4, 8, 4, np.array([19])))
    t.mark_writes(keys[1:2], np.ones(1, np.uint32), np.array([19]), 4)
    assert _row_reads(t, keys, rows_now, seq) == {1: ([6], [], [])}


def test_engine_rows_are_compared_with_this_forwards_model_not_an_earlier_ones(monkeypatch):
    """``Judge._rows_as_modelled`` gathers a batch's model rows into a buffer it keeps between
    forwards: a batch whose engine rows are what an earlier forward's model was, after its model
    changed, must still be found to differ (and be judged as read), whatever the buffer held."""
    monkeypatch.setattr(tracker_mod, "INCREMENTAL_JUDGE", True)
    t, keys, rows, seq = _four_written_rows()
    # A and B, then batches of the same size and a smaller one: the forwards remembered for
    # ``_rows_as_seen`` are no longer A and B's
    assert _row_reads(t, keys[:2], rows[:2], seq[:2]) == {}
    assert _row_reads(t, keys[2:], rows[2:], seq[2:]) == {}
    assert _row_reads(t, keys[:1], rows[:1], seq[:1]) == {}
    # B's model row has its middle page replaced; the engine still names the old one
    t.on_assign(wire.Assign(keys[1].item(), 4, 8, 4, np.array([19])))
    t.mark_writes(keys[1:2], np.ones(1, np.uint32), np.array([19]), 2)
    assert _row_reads(t, keys[:2], rows[:2], seq[:2]) == {1: ([6], [], [])}
    assert _row_reads(t, keys[:2], [rows[0], [5, 19, 7]], seq[:2]) == {}

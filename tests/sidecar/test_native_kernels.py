"""The sidecar's compiled kernels (sidecar/native) against the numpy paths they replace.

`make test` builds them (`make native`), so they must be loaded here. Each kernel is
checked two ways: on its own, over random inputs that take every branch (the kernel's
answer and everything it stores compared with the numpy path's), and in the pipeline:
the corrupted record streams of test_judge_incremental replayed with the kernels and
without them give identical findings, counters, page model, rows and history.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.sidecar import history as history_mod
from kvguard.sidecar import native
from kvguard.sidecar.history import EVENT_DTYPE, Event, History
from kvguard.sidecar.judge import Judge, _RowsSeen
from kvguard.sidecar.tracker import EngineTracker, RequestDirectory

from .test_assign_runs import ENGINE, encoded
from .test_judge_incremental import TINY, Replay, capture, corrupt, decode

KEYS = [wire.request_key(f"r{i}") for i in range(12)]


def test_the_kernels_are_built_and_loaded():
    # `make test` runs `make native` first: a missing or refused module here is a build problem
    assert native.KERNELS is not None, native.status()
    assert native.status().startswith("compiled"), native.status()
    assert history_mod._KERNEL_LAYOUT


def test_switched_off_by_the_environment_and_refused_when_it_marks_wrongly():
    code = "from kvguard.sidecar import native; print(native.KERNELS is None, native.status())"
    env = {**os.environ, native.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("True off (KVGUARD_SIDECAR_NATIVE=0)"), out

    class MarksNothing:  # says "marked" but stores nothing: the self-test refuses it
        @staticmethod
        def decode_writes(*args):
            return 1 if len(args[0]) == 2 and args[2].tolist() != [2, 2] and args[0][0] == 7 else 0

    assert native._self_test(MarksNothing) == "self-test: a clean decode step was marked wrongly"
    assert native._self_test(native.KERNELS) is None


# ---------------------------------------------------------------------------- decode_writes
def _random_tracker(rng) -> EngineTracker:
    """A pool of 48 pages in every state: owned by one of 12 requests (written or not), freed,
    allocated and unclaimed, never seen; page 0 the padding page."""
    t = EngineTracker(1, RequestDirectory())
    t.on_hello(wire.Hello(wire.Role.DECODE, 0, 1, 4, 64, 256, 4096, 250, "sglang", "x", "m", "0"))
    for i, key in enumerate(KEYS[:10]):  # the last two keys never begin: no row, no slot
        t.on_request_begin(wire.ReqBegin(key, wire.NO_ROOM, 8, 0, False, f"r{i}", "acme"), 0)
    t.on_alloc(np.arange(1, 40))
    owned = rng.permutation(np.arange(1, 40))[:30]
    for i, key in enumerate(KEYS[:10]):
        t.on_assign(wire.Assign(key, 0, 12, 0, owned[3 * i : 3 * i + 3]))
    t.mark_written(KEYS[0], owned[rng.random(30) < 0.5], 1_000_000)
    t.on_free(owned[rng.random(30) < 0.15])
    return t


def _random_step(rng, t: EngineTracker):
    """A decode step's (req_keys, write_counts, write_pages): mostly each request's own page,
    sometimes a foreign, freed, unknown, padding or out-of-pool page, a page twice, a count
    other than 1, a request without a slot, or arrays not as the wire decodes them."""
    n = int(rng.integers(1, 9))
    who = rng.choice(10, n, replace=bool(rng.random() < 0.2))
    keys = np.array([KEYS[i] for i in who], np.uint64)
    pages = np.array([t.rows[KEYS[i]].pages[int(rng.integers(3))] for i in who], np.int64)
    counts = np.ones(n, np.uint32)
    for _ in range(int(rng.integers(0, 3))):
        j = int(rng.integers(n))
        what = rng.integers(8)
        if what == 0:
            pages[j] = rng.integers(1, 40)  # anyone's page
        elif what == 1:
            pages[j] = rng.integers(40, 64)  # never seen (unknown)
        elif what == 2:
            pages[j] = rng.choice([0, 64, 5000])  # padding, past the pool, past the limit
        elif what == 3 and n > 1:
            pages[j] = pages[(j + 1) % n]  # twice
        elif what == 4:
            counts[j] = rng.choice([0, 2])
        elif what == 5:
            keys[j] = KEYS[10 + int(rng.integers(2))]  # a writer with no slot yet
    if rng.random() < 0.1:  # (a strided view of the keys: the numpy path)
        return np.repeat(keys, 2)[::2], counts, pages.astype(np.int32)
    return keys, counts, pages.astype(np.int32) if rng.random() < 0.9 else pages  # (int64 pages: the numpy path)


def _pool_state(t: EngineTracker) -> dict:
    p = t.pool
    return {
        "state": p.state.tolist(),
        "gen": p.gen.tolist(),
        "written_gen": p.written_gen.tolist(),
        "owner": np.asarray(p.owner).tolist(),
        "last_writer": np.asarray(p.last_writer).tolist(),
        "last_write_ms": p.last_write_ms.tolist(),
        "out_of_range": p.pages_out_of_range,
    }


class _Counting:
    """The kernels, counting the calls of each (and decode_writes' answers): a differential test
    that ran the numpy path twice would pass without them."""

    def __init__(self):
        self.kernels = native.KERNELS
        assert self.kernels is not None, native.status()
        self.calls: dict[str, int] = {}
        self.answers: dict[int, int] = {}

    def __getattr__(self, name):
        kernel = getattr(self.kernels, name)

        def call(*args):
            got = kernel(*args)
            self.calls[name] = self.calls.get(name, 0) + 1
            if name == "decode_writes":
                self.answers[got] = self.answers.get(got, 0) + 1
            return got

        return call


def _on_both_paths(monkeypatch, kernels: _Counting, seeds: int, run) -> list:
    """``run(seed, rng)`` with the kernels and on the numpy paths, each from a tracker state drawn
    from the same seed: the same result (returned, one per seed, for the branch counts)."""
    results = []
    for seed in range(seeds):
        out = []
        for use in (kernels, None):
            monkeypatch.setattr(native, "KERNELS", use)
            out.append(run(seed, np.random.default_rng(seed)))
        assert out[0] == out[1], seed
        results.append(out[0])
    return results


def test_decode_writes_judges_and_marks_exactly_as_the_numpy_path(monkeypatch):
    counting = _Counting()

    def run(seed, rng):
        t = _random_tracker(rng)
        answers = []
        for k in range(3):
            keys, counts, pages = _random_step(np.random.default_rng((seed, k)), t)
            done = t.decode_writes(keys, counts, pages, 2_000_000 + 1_000_000 * k)
            if not done and len(pages) == int(counts.sum()):  # the general path, as on_forward takes it
                t.mark_writes(keys, counts, pages, 2_000_000 + 1_000_000 * k)
            answers.append(done)
        return answers, _pool_state(t)

    _on_both_paths(monkeypatch, counting, 300, run)
    # every answer of the kernel came up: marked, not a decode step's, and the numpy path's to decide
    assert set(counting.answers) == {1, 0, -1} and min(counting.answers.values()) > 20, counting.answers


def test_decode_writes_refuses_pool_columns_of_the_wrong_type():
    t = _random_tracker(np.random.default_rng(0))
    pool = t.pool
    step = (np.array([KEYS[0]], np.uint64), np.ones(1, np.uint32), np.array([int(t.rows[KEYS[0]].pages[0])], np.int32))
    args = list(t.decode_writes_args(*step, 5))
    assert native.KERNELS.decode_writes(*args) in (0, 1)
    bad = list(args)
    bad[6] = pool.gen.astype(np.int64)
    with pytest.raises(ValueError, match="gen: items of format"):
        native.KERNELS.decode_writes(*bad)
    bad = list(args)
    bad[7] = pool.written_gen[:-1]
    with pytest.raises(ValueError, match="differ in length"):
        native.KERNELS.decode_writes(*bad)
    bad = list(args)
    bad[7] = pool.written_gen.copy()
    bad[7].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):  # (numpy's word for a column it may not write)
        native.KERNELS.decode_writes(*bad)


# ---------------------------------------------------------------------------- assign_run
def _random_run(rng, t: EngineTracker) -> wire.AssignRun:
    """A run of one-page ASSIGNs: mostly a request repeating its row's last entry, sometimes a
    new entry, another page or generation, a prefix-cache flag, a request without a row, a
    page or a position out of range, a request twice."""
    n = int(rng.integers(1, 64))
    odd = rng.choice([0.0, 0.1, 0.75])  # how many are not repeats: none, some, or most (> 32 of them)
    who = rng.integers(0, 12 if odd else 10, n)  # (KEYS[10:] have no row)
    keys, starts, ends, shared, pages = [], [], [], [], []
    for i in who.tolist():
        key = KEYS[i]
        row = t.rows.get(key)
        last = len(row.pages) - 1 if row is not None else 0
        entry, page = last, int(row.pages[last]) if row is not None else int(rng.integers(1, 48))
        what = rng.integers(3) if rng.random() < odd else 3
        if what == 0:
            entry += 1  # a token starting a page
        elif what == 1:
            page = int(rng.integers(-2, 70))  # another page, maybe none the pool holds
        elif what == 2:
            entry = int(rng.choice([0, 1 << 12, 1 << 20]))  # elsewhere in the row, or past any row
        start = entry * 4 + int(rng.integers(4))
        keys.append(key)
        starts.append(start)
        ends.append(start + 1 if rng.random() < 0.95 else 1 << 30)
        shared.append(start + (1 if rng.random() < 0.2 else 0))
        pages.append(page)
    return wire.AssignRun(
        np.arange(n, dtype=np.uint64),
        np.arange(n, dtype=np.uint64),
        np.array(keys, np.uint64),
        np.array(starts, np.uint32),
        np.array(ends, np.uint32),
        np.array(shared, np.uint32),
        np.array(pages, np.int32),
    )


def test_assign_run_settles_and_orders_exactly_as_the_numpy_path(monkeypatch):
    kernels = _Counting()

    def run(_seed, rng):
        t = _random_tracker(rng)
        if rng.random() < 0.5:  # the table's rows in other states: allocated pages, another gen
            t.on_alloc(rng.integers(1, 40, 5))
        if rng.random() < 0.3:  # a row whose request the directory no longer holds (another pool's): a stub
            t.requests.live.pop(KEYS[int(rng.integers(10))])
        if rng.random() < 0.2:  # rows at their limit: their last entry is the last a row may have
            t.row_limit = 3
        run = _random_run(rng, t)
        return t.on_assign_run(run).tolist(), len(run), sorted(t.requests.live), sorted(t.requests.stubs)

    shapes = {"none": 0, "some": 0, "from the first on": 0, "all": 0}
    stubbed = 0
    for positions, n, _live, stubs in _on_both_paths(monkeypatch, kernels, 600, run):
        stubbed += bool(stubs)
        if not positions or len(positions) == n:
            shapes["none" if not positions else "all"] += 1
        elif len(positions) > 32 and positions == list(range(positions[0], n)):
            shapes["from the first on"] += 1
        else:
            shapes["some"] += 1
    assert min(shapes.values()) >= 5, shapes  # every branch of the rules was taken
    assert kernels.calls["assign_run"] == 600 and stubbed > 40


def test_assign_run_leaves_runs_of_other_column_types_to_the_numpy_path():
    t = _random_tracker(np.random.default_rng(1))
    run = _random_run(np.random.default_rng(2), t)
    table, n = t.rows.scalars, len(run)
    args = [t.rows.indexes(run.req_keys), run.req_keys, run.row_start, run.row_end, run.shared_until, run.pages]
    pool_args = [table.length, table.tail_page, table.tail_gen_shared, t.pool.gen, t.pool.state]
    out = [np.empty(n, bool), np.empty(n, bool)]
    assert native.KERNELS.assign_run(*args, *pool_args, *out, 4, t.row_limit) >= 0
    wide = list(args)
    wide[5] = run.pages.astype(np.int64)
    assert native.KERNELS.assign_run(*wide, *pool_args, *out, 4, t.row_limit) == -1
    bad = list(pool_args)
    bad[0] = table.length.astype(np.int32)
    with pytest.raises(ValueError, match="length: items of format"):
        native.KERNELS.assign_run(*args, *bad, *out, 4, t.row_limit)


# ---------------------------------------------------------------------------- rows_as_seen
def test_rows_as_seen_compares_exactly_as_the_numpy_path():
    kernels = native.KERNELS
    answers = {0: 0, 1: 0}
    for seed in range(2000):
        rng = np.random.default_rng(seed)
        n_rows = int(rng.integers(0, 9))
        then_n = rng.integers(0, 6, n_rows).astype(np.int64)
        before = rng.integers(0, 50, int(then_n.sum())).astype(np.int32)
        changed = np.flatnonzero(rng.random(n_rows) < 0.3)
        now_n = then_n.copy()
        now_n[changed] = np.maximum(now_n[changed] + rng.integers(-1, 3, len(changed)), 0)
        parts, models = [], {}
        off = np.concatenate(([0], np.cumsum(then_n)))
        for i in range(n_rows):
            if i in changed:
                model = rng.integers(0, 50, int(now_n[i]) + int(rng.integers(0, 3))).astype(np.int32)
                if rng.random() < 0.2:
                    model = model[: max(int(now_n[i]) - 1, 0)]  # a model row shorter than read
                models[i] = model
                parts.append(model[: int(now_n[i])])
            else:
                parts.append(before[off[i] : off[i + 1]])
        actual = np.concatenate(parts or [np.zeros(0, np.int32)]).astype(np.int32)
        if len(actual) and rng.random() < 0.4:
            actual[int(rng.integers(len(actual)))] ^= 1 << int(rng.integers(31))  # one bit of one entry differs
        if rng.random() < 0.1:
            actual = actual[:-1]  # the record's rows shorter than counted
        keys = np.array(KEYS[:n_rows], np.uint64)
        rows = {KEYS[i]: SimpleNamespace(pages=models.get(i, np.zeros(0, np.int32))) for i in range(n_rows)}
        judge = SimpleNamespace(rows=SimpleNamespace(row_of=rows.__getitem__))
        seen = _RowsSeen(keys, then_n, np.zeros(n_rows, np.int64), before)
        want = Judge._rows_equal(judge, actual, seen, now_n, changed, keys)
        model_rows = tuple(rows[k].pages for k in keys[changed].tolist())
        got = kernels.rows_as_seen(actual, before, now_n, then_n, changed, model_rows)
        assert got == int(want), seed
        answers[got] += 1
    assert min(answers.values()) > 300, answers


# ---------------------------------------------------------------------------- alloc
def test_alloc_marks_and_logs_exactly_as_the_numpy_path(monkeypatch):
    kernels = _Counting()

    def run(_seed, rng):
        t = _random_tracker(rng)
        t.pool.gen[rng.integers(0, 48, 8)] = 0x7FFFFFFF  # the last generation a row entry holds: wraps to 0
        pages = rng.integers(0, 48, int(rng.integers(0, 12)))  # (some named twice)
        if len(pages) and rng.random() < 0.2:
            pages[0] = rng.choice([-1, 70, 1 << 23])  # past the pool (it grows), or past any pool
        dtype = np.int32 if rng.random() < 0.9 else np.int64  # (int64: the numpy path)
        got, gens = t.on_alloc_gens(pages.astype(dtype))
        changes = [(np.asarray(p, np.int64).tolist(), np.asarray(o, np.uint64).tolist()) for p, o in t.pool.changes]
        return got.tolist(), gens.tolist(), _pool_state(t), changes, t.pool.changes_len

    _on_both_paths(monkeypatch, kernels, 300, run)
    assert kernels.calls["alloc"] > 200


# ---------------------------------------------------------------------------- batch_rows, clean_rows
def test_a_batch_is_split_into_clean_shorter_and_dirty_reads_exactly_as_the_numpy_path(monkeypatch):
    kernels = _Counting()

    def run(_seed, rng):
        t = _random_tracker(rng)
        table, epoch = t.rows.scalars, int(rng.integers(0, 3))
        for key in KEYS[:10]:  # clean prefixes of any length, of this epoch or another
            i = t.rows[key].index
            table.clean_n[i] = rng.integers(0, 5)
            table.clean_epoch[i] = rng.integers(-1, 3)
            table.clean_reads[i] = rng.integers(0, 5)
        m = int(rng.integers(1, 12))
        keys = np.array([KEYS[i] for i in rng.integers(0, 12 if rng.random() < 0.5 else 10, m)], np.uint64)
        seq_lens = rng.integers(0, 20, m).astype(np.uint32 if rng.random() < 0.9 else np.int64)
        batch = t.judge._batch(keys, seq_lens)
        split = t.judge._clean_split(batch, epoch)
        return (
            [batch.idx.tolist(), batch.has.tolist(), batch.every, batch.at.tolist(), batch.n.tolist()],
            (split[0], split[1], [list(d) for d in split[2]]),
        )

    _on_both_paths(monkeypatch, kernels, 300, run)
    assert kernels.calls["batch_rows"] > 200 and kernels.calls["clean_rows"] == 300


# ---------------------------------------------------------------------------- changes_scan
def test_the_change_log_is_scanned_as_the_numpy_path_reads_it():
    answers = {0: 0, 1: 0, 2: 0, -1: 0}
    for seed in range(1000):
        rng = np.random.default_rng(seed)
        clean_shared = rng.random(64) < rng.choice([0.0, 0.02, 0.3])
        log, odd = [], False
        for _ in range(int(rng.integers(1, 6))):
            n = int(rng.integers(0, 5))
            pages = rng.integers(0, 66 if rng.random() < 0.1 else 64, n)  # (sometimes past clean_shared)
            held = rng.random(n) < rng.choice([0.0, 0.5])
            owners = np.where(held, rng.choice([1, 2, 1 << 40], n), 0).astype(np.uint64)  # (keys 1 and 2 too)
            if n and rng.random() < 0.1:
                owners[0] = (1 << 64) - 5  # a key past int64
            if n == 1 and rng.random() < 0.5:  # PagePool.changed_one's lists
                log.append(([int(pages[0])], [int(owners[0])]))
            elif rng.random() < 0.03:  # owners not as the pool keeps them: the numpy path's to read
                log.append((pages, owners.astype(np.int64)))
                odd = True
            else:
                log.append((pages.astype(rng.choice([np.int32, np.int64])), owners))
        # the numpy path's reading (judge.py, Judge._absorb_changes)
        all_pages = np.concatenate([np.asarray(p, np.int64) for p, _o in log])
        all_owners = np.concatenate([np.asarray(o, np.uint64) for _p, o in log])
        if odd or (all_pages >= len(clean_shared)).any():
            want = -1  # (the numpy path takes it; past clean_shared it raises)
        elif clean_shared[all_pages].any():
            want = 1
        else:
            want = 2 if (all_owners != 0).any() else 0
        got = native.KERNELS.changes_scan(log, clean_shared)
        assert got == want, (seed, got, want)
        answers[got] += 1
    assert min(answers.values()) > 20, answers


# ---------------------------------------------------------------------------- assign_run_length
def _decoded(records) -> list:
    out = []
    for r in records:
        body = r.body
        if isinstance(body, wire.AssignRun):
            body = [
                getattr(body, f).tolist()
                for f in ("seqs", "ts_ns", "req_keys", "row_start", "row_end", "shared_until", "pages")
            ]
        elif isinstance(body, wire.Assign):
            body = (body.req_key, body.row_start, body.row_end, body.shared_until, body.pages.tolist())
        out.append((r.kind, r.seq, r.ts_ns, r.engine_id, r.pool, repr(body)))
    return out


def test_runs_are_cut_where_the_numpy_decoder_cuts_them():
    k = wire.request_key("A")
    lengths, wrapped = {}, 0
    for seed in range(400):
        rng = np.random.default_rng(seed)
        # (near 2**64: sequence numbers that wrap inside a run, where a probe and the checks disagree)
        first = [0, 1000, (1 << 64) - int(rng.integers(16, 300))][int(rng.integers(3))]
        odd = rng.choice([0, 60, 300])  # records in 60 (in 300) not a clean next one of the run; or none
        parts = []
        for i in range(int(rng.integers(0, 300))):
            seq = (first + i) % (1 << 64)
            one = wire.Assign(k, 64 * i, 64 * i + 1, 64 * i, np.array([int(rng.integers(1, 9))], np.int32))
            rec = bytearray(wire.encode(wire.Kind.ASSIGN, seq, 1_000 + i, ENGINE, wire.assign_payload(one)))
            what = rng.integers(odd) if odd else 99
            if what == 0:
                rec[8:16] = ((seq + 1) % (1 << 64)).to_bytes(8, "little")  # a gap in sequence numbers
            elif what == 1:
                rec = bytearray(wire.encode(wire.Kind.ASSIGN, seq, 1_000 + i, ENGINE + 1, wire.assign_payload(one)))
            elif what == 2:
                rec[32 + 16 : 32 + 20] = (1 << 20).to_bytes(4, "little")  # shared_until past the row
            elif what == 3:
                multi = wire.Assign(k, 0, 128, 0, np.array([4, 5], np.int32))  # two pages: not a run's
                rec = bytearray(wire.encode(wire.Kind.ASSIGN, seq, 2_000, ENGINE, wire.assign_payload(multi)))
            elif what == 4:
                rec = bytearray(
                    wire.encode(wire.Kind.FREE, seq, 2_000, ENGINE, wire.pages_payload(np.array([7], np.int32)))
                )
            elif what == 5:
                rec[2] = 99  # another contract version
            elif what == 6:
                rec[32 + 16 : 32 + 20] = (64 * i + 2).to_bytes(4, "little")  # shared_until one past the row
            parts.append(bytes(rec))
        raw = b"".join(parts)
        plain = wire.decode_stream(raw, wire.DecodeStats(), runs=True)
        compiled = wire.decode_stream(raw, wire.DecodeStats(), runs=True, run_length=native.KERNELS.assign_run_length)
        assert _decoded(compiled) == _decoded(plain), seed
        for r in plain:
            if isinstance(r.body, wire.AssignRun):
                lengths[len(r.body)] = lengths.get(len(r.body), 0) + 1
                wrapped += int(r.body.seqs[-1]) < int(r.body.seqs[0])
    assert len(lengths) > 30 and max(lengths) > 64, lengths  # runs of many lengths, past several probes
    assert wrapped > 20  # (runs cut where their sequence numbers wrap: the probes decide there)


def test_rows_changed_finds_the_rows_numpy_finds():
    for seed in range(500):
        rng = np.random.default_rng(seed)
        m = int(rng.integers(0, 20))
        stamp = rng.integers(-1, 50, 64)
        at = rng.integers(0, 64, m)
        seen_stamps = np.where(rng.random(m) < 0.2, rng.integers(-1, 50, m), stamp[at])
        n = rng.integers(0, 9, m)
        seen_n = np.where(rng.random(m) < 0.2, rng.integers(0, 9, m), n)
        stamps, changed = np.empty(m, np.int64), np.empty(m, np.int64)
        count = native.KERNELS.rows_changed(at, stamp, seen_stamps, n, seen_n, stamps, changed)
        assert stamps.tolist() == stamp[at].tolist(), seed
        assert changed[:count].tolist() == np.flatnonzero((stamp[at] != seen_stamps) | (n != seen_n)).tolist(), seed


# ---------------------------------------------------------------------------- same_values
def test_array_equal_answers_as_numpy_does():
    dtypes = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
    answers = {-1: 0, 0: 0, 1: 0}
    for seed in range(3000):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(0, 6))
        values = rng.integers(0, 120, n)
        a = values.astype(rng.choice(dtypes))
        b = values.astype(rng.choice(dtypes))
        what = rng.integers(6)
        if what == 0 and n:
            b[int(rng.integers(n))] += 1  # one value differs
        elif what == 1:
            b = b[: max(n - 1, 0)]  # shorter
        elif what == 2 and n:
            a = a.astype(np.int64)
            a[0] = -1  # a negative against an unsigned value (wraps there): not equal as integers
            b = b.astype(np.uint32)
        elif what == 3:
            a = np.repeat(a, 2)[::2]  # a strided view: numpy's
        elif what == 4:
            a, b = a.reshape(1, -1), b.reshape(1, -1)  # 2-D: numpy's
        answers[native.KERNELS.same_values(a, b)] += 1
        assert native.array_equal(a, b) == np.array_equal(a, b), seed
    assert min(answers.values()) > 200, answers


# ---------------------------------------------------------------------------- history_append
def _random_value(rng, n: int, dtype: str, lo: int, hi: int):
    what = rng.integers(4)
    if what == 0:
        return int(rng.integers(lo, hi))  # a Python int
    if what == 1:
        return np.dtype(dtype).type(rng.integers(lo, hi))  # a numpy scalar
    arr = rng.integers(lo, hi, n).astype(dtype)
    return arr if what == 2 or n < 2 else arr[::-1]  # (a reversed view: not contiguous)


def test_history_append_stores_every_value_as_the_numpy_writes_do(monkeypatch):
    kernels = native.KERNELS
    dtypes = ["int64", "uint64", "int32", "uint32", "int16", "uint8", "bool"]
    for seed in range(60):
        rng = np.random.default_rng(seed)
        calls = []
        for _ in range(40):
            n = int(rng.integers(1, 12))
            pages = None if rng.random() < 0.3 else rng.integers(-1, 1 << 20, n).astype(rng.choice(dtypes[:4]))
            key = _random_value(rng, n, str(rng.choice(["uint64", "int64", "uint32"])), 0, 1 << 62)
            if pages is None:  # one event, or one per request (keys, no pages): as History counts them
                if rng.random() < 0.5:
                    key = rng.integers(0, 1 << 62, n).astype(np.uint64)
                elif isinstance(key, np.ndarray) and key.ndim:
                    key = key[0]
                n = len(key) if isinstance(key, np.ndarray) and key.ndim else 1
            gens = None if rng.random() < 0.3 else _random_value(rng, n, str(rng.choice(dtypes)), 0, 2)
            aux = _random_value(rng, n, str(rng.choice(dtypes)), 0, 100)
            ts = _random_value(rng, n, "int64", 0, 1 << 50)
            calls.append((ts, int(rng.integers(0, 9)), Event(int(rng.integers(1, 10))), key, pages, gens, aux, 3))
        out = {}
        for path in ("kernel", "numpy"):
            monkeypatch.setattr(native, "KERNELS", None if path == "numpy" else kernels)
            h = History(capacity=int(rng.integers(5, 40)) if path == "kernel" else out["kernel"][2])
            for ts, engine, event, key, pages, gens, aux, pool in calls:
                h.append(ts, engine, event, key, pages, gens, aux, pool)
            out[path] = (h.events.tobytes(), h.total, h.capacity)
        assert out["kernel"] == out["numpy"], seed


def test_history_append_refuses_a_python_int_out_of_range_as_numpy_does_and_stores_nothing(monkeypatch):
    kernels = native.KERNELS
    for path in ("kernel", "numpy"):
        monkeypatch.setattr(native, "KERNELS", None if path == "numpy" else kernels)
        h = History(capacity=8)
        h.append(5, 1, Event.ALLOC, 0, np.array([3, 4]))
        before = h.events.tobytes()
        for bad in ({"aux": -1}, {"req_key": -2}, {"pool": 1 << 16}, {"aux": 1 << 32}):
            args = {"req_key": 9, "pages": np.array([1, 2]), "aux": 0, "pool": 0, **bad}
            with pytest.raises(OverflowError, match="out of bounds for"):
                h.append(6, 1, Event.WRITE, **args)
        assert h.total == 2
        if path == "kernel":  # (the numpy writes may have stored the columns before the bad one)
            assert h.events.tobytes() == before


def test_history_layout_is_the_kernels():
    fields, itemsize = native.KERNELS.history_layout()
    assert itemsize == EVENT_DTYPE.itemsize
    assert {name: off for name, off in fields} == {
        name: EVENT_DTYPE.fields[name][1] for name in EVENT_DTYPE.names if not name.startswith("_")
    }


# ---------------------------------------------------------------------------- the pipeline
def _replayed_both_ways(monkeypatch, kernels: _Counting, isolate: bool, decoded) -> None:
    """The records ``decoded(run_length)`` gives, replayed with the kernels and on the numpy paths
    (the run decoding as the ring reader is handed it): identical findings, counters, page model,
    rows and history."""
    states = []
    for use in (kernels, None):
        monkeypatch.setattr(native, "KERNELS", use)
        replay = Replay(True, isolate, monkeypatch).run(decoded(None if use is None else use.assign_run_length))
        states.append({**replay.state(), "history": replay.pipe.out.history.events.tobytes()})
    a, b = states
    assert a["apply_errors"] == 0 and a["findings"]
    for key in a:
        assert a[key] == b[key], key


@pytest.mark.parametrize("isolate", [False, True])
def test_corrupted_streams_give_identical_results_with_and_without_the_kernels(isolate, monkeypatch):
    counting = _Counting()  # (KERNELS patched with it: the same kernels, counted)
    for rows_every, seed, lost in [(0, 11, False), (16, 12, True), (1, 13, False), (3, 14, False)]:
        stream = capture(replace(TINY, rows_every=rows_every, assign="page"), steps=60)
        records = corrupt(decode(stream.setup + [i for step in stream.steps for i in step]), seed, 0.04, lost)
        _replayed_both_ways(monkeypatch, counting, isolate, lambda _run_length, records=records: records)
    assert counting.answers.get(1, 0) > 100, counting.answers  # the decode steps were the kernel's
    # (isolating tenants takes the full read judge: no clean prefixes to split by)
    names = ("alloc",) if isolate else ("alloc", "batch_rows", "clean_rows", "changes_scan")
    assert min(counting.calls.get(name, 0) for name in names) > 100, counting.calls


@pytest.mark.parametrize("rows_every", [1, 16])
def test_streams_of_runs_and_rows_give_identical_results_with_and_without_the_kernels(rows_every, monkeypatch):
    kernels = _Counting()
    # an ASSIGN per request per step, as the ring reader decodes them (runs), with the engine's rows;
    # long outputs and little corruption, so that a batch stays the same for a while (rows compared
    # with the last forward's)
    stream = capture(replace(TINY, batch=24, output_tokens=200, rows_every=rows_every, assign="token"), steps=60)
    raw = encoded(corrupt(decode(stream.setup + [i for step in stream.steps for i in step]), 21, 0.01, False))

    def decoded(run_length):
        records = wire.decode_stream(raw, wire.DecodeStats(), runs=True, run_length=run_length)
        assert any(type(r.body) is wire.AssignRun for r in records)
        return records

    _replayed_both_ways(monkeypatch, kernels, False, decoded)
    names = ("decode_writes", "history_append", "assign_run", "alloc", "batch_rows", "clean_rows", "assign_run_length")
    assert min(kernels.calls.get(name, 0) for name in names) > 50, kernels.calls
    if rows_every == 1:
        assert min(kernels.calls.get(name, 0) for name in ("rows_as_seen", "rows_changed")) > 20, kernels.calls

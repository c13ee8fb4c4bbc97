"""Recordings: the segment format, the writers, rotation, retention, failures, the CLI flags.

What these prove: a recording holds the engine's wire bytes exactly (plus the LOST
markers the reader inserted, where it inserted them); a RecordingWriter is a drop-in
RingWriter for the real Probes; the sidecar's Recorder rotates by size and by age, keeps
the directory inside its budget, carries every engine's HELLO into each new segment,
and never raises (a failed write becomes a reported gap, not a crash); bad files are
refused with a reason; the documented example runs as written.
"""

import errno
import os
import re
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import HEADER_BYTES, RingReader, RingWriter
from kvguard.engine_hooks.tier1 import Violation
from kvguard.sidecar import recorder as rmod
from kvguard.sidecar.recorder import (
    CHUNK_CARRIED,
    Recorder,
    RecordingError,
    RecordingWriter,
    SegmentHeader,
    SegmentReader,
    encode_record,
    parse_bytes,
    parse_seconds,
)
from kvguard.sidecar.replay import replay
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def slots(pages, page_size=4):
    return np.concatenate([np.arange(p * page_size, (p + 1) * page_size) for p in pages])


def every_kind(p: Probes, rid="r-1"):
    """One call per probe: every wire kind an engine emits."""
    p.hello("decode", 1, 4, 64, 256, 512, 512, "sglang", "0.5.23", "tiny")
    p.request_begin(rid, "acme", 42, 16, 4, False, cache_salt="s")  # + REQ_SCOPE
    p.pages_allocated(slots([1, 2, 3]))
    p.rows_assigned(rid, 0, 12, 4, slots([1, 2, 3]))
    p.transfer_reserved(rid, 42, 12, slots([1, 2, 3]))
    p.transfer_sent(rid, 42, 0, 12, [7, 8, 9], True, digest=0xDEADBEEF)
    p.transfer_digest(rid, 42, "receiver", 0xFEEDFACE, 0, 12, 2, 0, 4, 4)
    p.transfer_done(rid, 42, "receiver", "success")
    p.forward([rid], [13], [slots([4])[:1]], [slots([1, 2, 3, 4])[:13]])  # rows present (+ first HEARTBEAT)
    p.forward([rid, "other"], [14, 3], [[17], []])  # no rows
    p.content_changed(slots([2])[:2])
    p.kv_stored(None, 0xABC, [1, 2], digest=7)
    p.kv_loaded(rid, 0xABC, [5, 6], "completed", digest=7, cache_salt="s")
    p.kv_digest(None, 0xABC, 7, "stored")
    p.rejected(rid, "decode", "out of memory \u2603")
    p.guard_acted(rid, 42, "rejected_send", "aborted", prompt_tokens=16, send_tokens=1, reserved_pages=3, reason="g")
    p.request_end(rid, "length", 1000, 2000, 3, "done")
    p.pages_freed(slots([1, 2]), "group")
    p.pages_freed([3], "page_ids")
    p.report_probe_error("forward", RuntimeError("x"))
    p._tier1_violation(Violation("r-1", 13, [4], [3], ["r-2"], [3]), 1)
    p.coverage([wire.CoverageItem("kv_pool", wire.CoverageStatus.PARTIAL, 1, 2, "MLATokenToKVPool: no digests")])
    p.pool_declared(1, 4, 64, "state", "mamba")
    p.page_identity(rid, 1, "written", [7, 8])
    p.forward([rid], [14], [[0]], pool=1)  # a record of that pool: the header's pool survives the recording
    p.engine_part(os.getpid() + 1, "worker", 0, 4)  # (last: a part's later records go to another engine)


def records_of(path):
    with SegmentReader(path) as r:
        return [(rec, carried) for rec, carried in r]


def recording_records(paths, carried=False, events=False):
    """Wire records (and LOST markers) of these segments; SidecarEvents only if ``events``."""
    out = []
    for path in paths:
        out += [
            rec for rec, c in records_of(path) if c == carried and (events or not isinstance(rec, rmod.SidecarEvent))
        ]
    return out


def as_bytes(records):
    return [encode_record(r) for r in records]


class FakeClock:
    def __init__(self, ns=10**12):
        self.ns = ns

    def __call__(self):
        return self.ns

    def advance(self, seconds):
        self.ns += int(seconds * 1e9)


# --------------------------------------------------------------------------- the bytes
def test_a_recording_holds_the_engines_wire_bytes_exactly(tmp_path):
    ring = RingWriter(str(tmp_path / "rings"), 1 << 16)
    every_kind(Probes(ring))
    with open(ring.path, "rb") as f:
        f.seek(HEADER_BYTES)
        wire_bytes = f.read(ring._write_pos)  # no wrap: the ring is far from full
    reader = RingReader(ring.path)
    records = reader.poll().records
    assert {r.kind for r in records} == set(wire.Kind) - {wire.Kind.PAD, wire.Kind.LOST}

    with RecordingWriter(tmp_path / "seg.kvgrec") as rec:
        rec.record_batch(records)
    with SegmentReader(tmp_path / "seg.kvgrec") as seg:
        chunks = list(seg.chunks())
    assert b"".join(data for _flags, data in chunks) == wire_bytes
    assert [as_bytes([r]) for r, _ in records_of(tmp_path / "seg.kvgrec")] == [as_bytes([r]) for r in records]


def test_lost_markers_are_recorded_where_the_reader_put_them(tmp_path):
    p = Probes(RingWriter(str(tmp_path / "rings"), 4096))
    p.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.23", "tiny")
    reader = RingReader(p.writer.path)
    live = reader.poll().records
    for i in range(300):  # nobody drains: most of these are dropped
        p.pages_allocated([4 * (i % 8)])
    live += reader.poll().records
    p.pages_freed([4])
    live += reader.poll().records
    lost = [r for r in live if r.kind == wire.Kind.LOST]
    assert lost and sum(r.body for r in lost) == p.writer.dropped_records

    with RecordingWriter(tmp_path / "seg.kvgrec") as rec:
        rec.record_batch(live)
    back = recording_records([tmp_path / "seg.kvgrec"])
    assert as_bytes(back) == as_bytes(live)
    assert [(r.seq, r.body, r.engine_id) for r in back if r.kind == wire.Kind.LOST] == [
        (r.seq, r.body, r.engine_id) for r in lost
    ]


def test_probes_write_straight_into_a_recording(tmp_path):
    clock = FakeClock()
    rec = RecordingWriter(tmp_path / "p.kvgrec", clock_ns=clock)
    engine = rec.engine(engine_id=7)
    p = Probes(engine)
    every_kind(p)
    assert not p.disabled_probes and p.probe_errors == 1  # the one every_kind reports on purpose
    engine.drop(3)  # a full ring, as a ring reader would have marked it
    assert p.writer.write(wire.Kind.ALLOC, wire.pages_payload(np.array([5])))
    rec.close()
    assert not engine.write(wire.Kind.ALLOC, wire.pages_payload(np.array([6])))  # closed: dropped, no raise
    assert engine.dropped_records == 4

    back = recording_records([tmp_path / "p.kvgrec"])
    assert {r.engine_id for r in back} == {7}
    assert [r.seq for r in back if r.kind != wire.Kind.LOST] == list(range(engine.records_written - 1)) + [
        engine.records_written - 1 + 3
    ]
    (lost,) = [r for r in back if r.kind == wire.Kind.LOST]
    assert (lost.seq, lost.body) == (engine.records_written - 1, 3)
    assert all(r.ts_ns == clock.ns for r in back)


def test_the_raw_api_takes_explicit_identity(tmp_path):
    with RecordingWriter(tmp_path / "raw.kvgrec") as rec:
        rec.write_record(wire.Kind.ALLOC, wire.pages_payload(np.array([1, 2])), engine_id=3, seq=10, ts_ns=5, pool=1)
        rec.write_record(wire.Kind.FREE, wire.pages_payload(np.array([1])), engine_id=3, ts_ns=6)
        rec.write_lost(4, 2, seq=0, ts_ns=7)
        with pytest.raises(ValueError):
            rec.write_record(wire.Kind.LOST, b"", engine_id=3)
    a, f, lost = recording_records([tmp_path / "raw.kvgrec"])
    assert (a.kind, a.seq, a.ts_ns, a.engine_id, a.pool) == (wire.Kind.ALLOC, 10, 5, 3, 1)
    assert a.body.pages.tolist() == [1, 2]
    assert (f.kind, f.seq) == (wire.Kind.FREE, 11)
    assert (lost.kind, lost.engine_id, lost.seq, lost.body) == (wire.Kind.LOST, 4, 0, 2)
    with pytest.raises(FileExistsError):
        RecordingWriter(tmp_path / "raw.kvgrec")


# --------------------------------------------------------------------------- headers
def test_unreadable_files_are_refused_with_the_reason(tmp_path):
    good = tmp_path / "good.kvgrec"
    RecordingWriter(good).close()
    raw = good.read_bytes()

    def header_with(**changes):
        h = SegmentHeader.unpack(raw)
        fields = {
            f: getattr(h, f)
            for f in (
                "format_version",
                "wire_version",
                "created_realtime_ns",
                "created_monotonic_ns",
                "recording_id",
                "segment_index",
            )
        }
        fields.update(changes)
        return SegmentHeader(**fields).pack()

    cases = {
        "missing.kvgrec": (None, "no such file"),
        "empty.kvgrec": (b"", "empty file"),
        "text.kvgrec": (b"hello, world\n" * 10, "not a kvguard recording"),
        "short.kvgrec": (raw[:20], "shorter than a recording header"),
        "flipped.kvgrec": (raw[:20] + bytes([raw[20] ^ 1]) + raw[21:], "header is corrupt"),
        "newer.kvgrec": (header_with(format_version=wire.FORMAT_VERSION + 1), "newer than this kvguard reads"),
        "wire2.kvgrec": (header_with(wire_version=2), "wire contract version 2"),
    }
    for name, (content, reason) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(RecordingError, match=reason) as exc:
            SegmentReader(tmp_path / name)
        assert name in str(exc.value)
    with pytest.raises(RecordingError, match="is a directory"):
        SegmentReader(tmp_path)


# --------------------------------------------------------------------------- rotation
def feed(recorder, engines, batches, per_batch=20, start=0):
    """Batches of decoded records from ``engines`` (each with a HELLO first)."""
    sent = []
    for b in range(batches):
        batch = []
        for eid in engines:
            seq0 = start + b * per_batch
            if seq0 == 0:
                h = wire.Hello(wire.Role.DECODE, 0, 100 + eid, 4, 64, 256, 256, 256, "sglang", "0.5.23", "m", "0.1")
                batch.append(wire.Record(wire.Kind.HELLO, 0, 1, eid, 0, h))
            for i in range(max(seq0, 1), seq0 + per_batch):
                pages = wire.Pages(np.arange(i % 50, i % 50 + 8))
                batch.append(wire.Record(wire.Kind.ALLOC, i, 1000 + i, eid, 0, pages))
        recorder.record_batch(batch)
        sent += batch
    return sent


def test_segments_rotate_by_size_and_each_carries_every_engines_hello(tmp_path):
    rec = Recorder(tmp_path, segment_bytes=8192, max_bytes=1 << 20)
    sent = feed(rec, [1, 2], batches=30)
    rec.close()
    segs = rec.segments
    assert len(segs) >= 5 and rec.stats.segments_opened == len(segs)
    assert all(p.endswith(".kvgrec") for p in segs) and not list(tmp_path.glob("*.open"))
    assert all(os.path.getsize(p) <= 8192 for p in segs)
    assert as_bytes(recording_records(segs)) == as_bytes(sent)  # nothing lost, nothing doubled, in order
    assert records_of(segs[0])[0][1] is False  # the first segment carries nothing
    for path in segs[1:]:
        with SegmentReader(path) as r:
            flags, _ = next(r.chunks())
        assert flags & CHUNK_CARRIED
        carried = [rec for rec, c in records_of(path) if c]
        assert sorted((r.kind, r.engine_id) for r in carried) == [(wire.Kind.HELLO, 1), (wire.Kind.HELLO, 2)]
    headers = [SegmentReader(p).header for p in segs]
    assert [h.segment_index for h in headers] == list(range(len(segs)))
    assert len({h.recording_id for h in headers}) == 1
    assert segs == sorted(segs)  # names sort in recording order


def test_segments_rotate_by_age_but_idle_time_makes_no_files(tmp_path):
    clock = FakeClock()
    rec = Recorder(tmp_path, segment_age_s=10, clock_ns=clock)
    feed(rec, [1], batches=1)
    assert len(list(tmp_path.glob("*.kvgrec.open"))) == 1
    clock.advance(5)
    rec.record_batch([])
    assert len(list(tmp_path.glob("*.kvgrec.open"))) == 1
    clock.advance(6)
    rec.record_batch([])  # the sidecar's poll: age rotation needs no new record
    assert not list(tmp_path.glob("*.open")) and len(list(tmp_path.glob("*.kvgrec"))) == 1
    for _ in range(10):  # an idle hour: no new segments
        clock.advance(360)
        rec.record_batch([])
    assert len(list(tmp_path.glob("kvguard-*"))) == 1
    feed(rec, [1], batches=1, start=20)
    assert len(list(tmp_path.glob("*.kvgrec.open"))) == 1 and rec.stats.segments_opened == 2
    rec.close()


def test_retention_keeps_the_newest_segments_within_count_bytes_and_age(tmp_path):
    # count: keep at most 3 files, the open one included
    rec = Recorder(tmp_path / "n", segment_bytes=4096, max_bytes=1 << 20, max_segments=3)
    feed(rec, [1], batches=40)
    assert len(os.listdir(tmp_path / "n")) == 3
    kept = [SegmentReader(p).header.segment_index for p in rec.segments]
    assert kept == list(range(rec.stats.segments_opened - 3, rec.stats.segments_opened))
    rec.close()

    # bytes: the directory never exceeds the budget, checked after every batch
    d = tmp_path / "b"
    rec = Recorder(d, segment_bytes=4096, max_bytes=16384)
    for b in range(60):
        feed(rec, [1, 2], batches=1, start=b * 20)
        assert sum(f.stat().st_size for f in d.iterdir()) <= 16384
    assert rec.stats.segments_deleted > 5
    rec.close()

    # age: closed segments older than max_age go, whatever the budget
    wall, mono = FakeClock(time.time_ns()), FakeClock()
    d = tmp_path / "a"
    rec = Recorder(d, max_age_s=3600, segment_age_s=60, clock_ns=mono, wall_clock_ns=wall)
    feed(rec, [1], batches=1)
    mono.advance(61)
    rec.record_batch([])
    (old,) = list(d.glob("*.kvgrec"))
    (d / "notes.txt").write_text("not ours")
    wall.advance(3000)
    mono.advance(6)
    rec.record_batch([])
    assert old.exists()  # 50 minutes old: kept
    wall.advance(601)
    mono.advance(6)
    rec.record_batch([])
    assert sorted(f.name for f in d.iterdir()) == ["notes.txt"]
    rec.close()


def test_an_earlier_runs_segments_count_and_a_crashed_open_segment_is_closed(tmp_path):
    first = Recorder(tmp_path, segment_bytes=4096, max_bytes=1 << 20)
    feed(first, [1], batches=10)
    first.flush()  # ... and the sidecar dies without closing: an .open file stays behind
    (leftover,) = list(tmp_path.glob("*.kvgrec.open"))
    size_before = sum(f.stat().st_size for f in tmp_path.iterdir())

    second = Recorder(tmp_path, segment_bytes=4096, max_bytes=size_before + 4096)
    assert not list(tmp_path.glob("*.open")) and (tmp_path / leftover.name[: -len(".open")]).exists()
    assert second.disk_bytes() == size_before
    feed(second, [1], batches=10)
    assert second.stats.segments_deleted >= 1  # the earlier run's oldest went first
    assert second.disk_bytes() <= size_before + 4096
    second.close()


def test_write_errors_never_raise_and_recording_resumes_in_a_new_segment(tmp_path, monkeypatch, caplog):
    clock = FakeClock()
    rec = Recorder(tmp_path, segment_bytes=1 << 20, clock_ns=clock)
    feed(rec, [1], batches=2)

    real = rmod._Segment.add_chunk

    def disk_full(self, records, flags=0):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rmod._Segment, "add_chunk", disk_full)
    feed(rec, [1], batches=3, start=40)  # must not raise
    assert rec.stats.write_errors >= 1 and rec.stats.records_not_recorded == 60
    assert "No space left" in rec.stats.last_error
    assert sum("detection goes on" in r.message for r in caplog.records) == 1  # logged once per streak

    monkeypatch.setattr(rmod._Segment, "add_chunk", real)
    feed(rec, [1], batches=1, start=100)  # within a second of the failure: not retried yet
    assert rec.stats.records_not_recorded == 80
    clock.advance(1.5)
    feed(rec, [1], batches=1, start=120)
    rec.close()
    assert rec.stats.segments_opened == 2
    findings, run = replay([tmp_path])
    s = run.summary()
    assert s["records_missing"] == 80 and s["problems"] >= 1  # the hole is reported, not hidden
    assert run.stats.engines[1]["records"] == 40 + 20


def test_a_vanished_directory_is_an_error_not_a_crash(tmp_path):
    d = tmp_path / "rec"
    clock = FakeClock()
    rec = Recorder(d, segment_bytes=4096, max_bytes=1 << 20, clock_ns=clock)
    feed(rec, [1], batches=2)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    feed(rec, [1], batches=10, start=40)  # rotation needs a new file: cannot be opened
    assert rec.stats.write_errors >= 1 and rec.stats.records_not_recorded > 0
    d.mkdir()
    clock.advance(2)
    feed(rec, [1], batches=1, start=300)
    rec.close()
    assert list(d.glob("*.kvgrec"))


def test_bad_limits_and_unwritable_directories_are_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="smaller than one segment"):
        Recorder(tmp_path, max_bytes=1000)
    with pytest.raises(ValueError, match="max_segments"):
        Recorder(tmp_path, max_segments=0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RecordingError, match="not writable"):
        Recorder(tmp_path / "file")


# --------------------------------------------------------------------------- the sidecar
def test_the_sidecar_records_every_batch_it_applies(tmp_path):
    p = Probes(RingWriter(str(tmp_path / "rings"), 1 << 16))
    rec = Recorder(tmp_path / "rec", segment_bytes=4096, max_bytes=1 << 20)
    sidecar = Sidecar(str(tmp_path / "rings"), sinks=[MemorySink()], slack_ns=0, recorder=rec)
    for round_ in range(5):
        every_kind(p, rid=f"r-{round_}")
        sidecar.run_once(flush=True)
    sidecar.stop()
    assert rec.segments and not list((tmp_path / "rec").glob("*.open"))  # stop() closed the recorder
    recorded = recording_records(rec.segments)
    by_kind = {}
    for r in recorded:
        by_kind[r.kind.name] = by_kind.get(r.kind.name, 0) + 1
    assert by_kind == dict(sidecar.pipeline.records_by_kind)
    events = [e for e in recording_records(rec.segments, events=True) if isinstance(e, rmod.SidecarEvent)]
    assert events and {e.kind for e in events} == {"tick"}  # one (coalesced) tick per batch, at most
    assert len(events) <= 5


# --------------------------------------------------------------------------- CLI and docs
def test_cli_flags(tmp_path, capsys):
    from kvguard.sidecar.cli import build_parser, main

    args = build_parser().parse_args(
        ["sidecar", "--record-dir", str(tmp_path), "--record-max-bytes", "64M", "--record-max-age", "2h"]
    )
    assert (args.record_dir, args.record_max_bytes, args.record_max_age) == (str(tmp_path), 64 << 20, 7200)
    args = build_parser().parse_args(["sidecar"])
    assert args.record_dir is None and args.record_max_bytes == 1 << 30 and args.record_max_age is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar", "--record-max-bytes", "lots"])
    assert "not a size: 'lots'" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["sidecar", "--record-dir", str(tmp_path / "file")]) == 2
    assert "not writable" in capsys.readouterr().err


def test_size_and_duration_values():
    assert parse_bytes("1073741824") == parse_bytes("1G") == parse_bytes("1 GiB") == 1 << 30
    assert parse_bytes("512m") == 512 << 20 and parse_bytes("1.5K") == 1536
    assert parse_seconds("90") == 90 and parse_seconds("30m") == 1800 and parse_seconds("7d") == 7 * 86400
    for bad in ("", "-1", "1Q", "G"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    for bad in ("0", "soon", "5y"):
        with pytest.raises(ValueError):
            parse_seconds(bad)


def doc_example(marker: str) -> str:
    """The Python block of docs/recording-api.md that contains ``marker`` and calls replay()."""
    with open(os.path.join(ROOT, "docs", "recording-api.md")) as f:
        doc = f.read()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    return next(b for b in blocks if marker in b and "replay(" in b)


def run_python(cwd, *args: str) -> list[str]:
    """``python ARGS`` in ``cwd`` with this checkout importable; its stdout lines (it must succeed)."""
    out = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_documented_example_runs_as_written(tmp_path):
    example = doc_example("RecordingWriter(")
    lines = run_python(tmp_path, "-c", example)
    assert lines == ["unwritten_read warning [1, 2]", "events_lost warning []", "4"]
    assert all(f"# {line}" in example for line in lines)  # what the page promises is what it prints
    cli = "\n".join(run_python(tmp_path, "-m", "kvguard.sidecar.cli", "replay", "example.kvgrec"))
    assert "unwritten_read" in cli and "findings: 2 (events_lost 1, unwritten_read 1)" in cli


def test_chunk_checksums_cover_the_chunk_header(tmp_path):
    with RecordingWriter(tmp_path / "c.kvgrec") as rec:
        rec.write_record(wire.Kind.ALLOC, wire.pages_payload(np.array([1])), engine_id=1)
    raw = bytearray((tmp_path / "c.kvgrec").read_bytes())
    off = rmod.SEGMENT_HEADER_SIZE + 12  # chunk flags: setting CARRIED must not go unnoticed
    struct.pack_into("<H", raw, off, CHUNK_CARRIED)
    (tmp_path / "c.kvgrec").write_bytes(bytes(raw))
    with SegmentReader(tmp_path / "c.kvgrec") as r:
        assert list(r) == [] and r.stats.corrupt_chunks == 1


def test_a_recording_can_be_read_and_written_back(tmp_path):
    """What SegmentReader yields (LOST markers and sidecar events included) goes back through record_batch."""
    with RecordingWriter(tmp_path / "a.kvgrec") as rec:
        every_kind(Probes(rec.engine(5)))
        rec.write_lost(5, 3)
        rec.record_tick(10**12)
        rec.record_engine_gone(5, 10**12 + 1)
        rec.write_record(wire.Kind.ALLOC, wire.pages_payload(np.array([9])), engine_id=6)
    items = [item for item, _ in records_of(tmp_path / "a.kvgrec")]
    assert {type(i).__name__ for i in items} == {"Record", "SidecarEvent"}
    with RecordingWriter(tmp_path / "b.kvgrec") as copy:
        copy.record_batch(iter(items))  # any iterable
    assert as_bytes([i for i, _ in records_of(tmp_path / "b.kvgrec")]) == as_bytes(items)
    first, run_a = replay([tmp_path / "a.kvgrec"])
    second, run_b = replay([tmp_path / "b.kvgrec"])
    assert [f.to_dict() for f in first] == [f.to_dict() for f in second] and first
    assert run_a.summary()["sidecar_events"] == run_b.summary()["sidecar_events"] == 2


def test_the_every_engine_event_example_runs_clean_and_its_one_line_changes_raise_what_the_page_says(tmp_path):
    example = doc_example("decode_rows_assigned")
    report = 'findings, run = replay(["events.kvgrec"])\nprint(sorted((f.kind, f.pages) for f in findings))\n'

    def run(code):
        return run_python(tmp_path, "-c", code)

    assert run(example)[-1] == "0 43 3" and "# 0 43 3" in example
    short = example.replace("0, 8, [9, 10], True)", "0, 4, [9], True)")
    assert short != example
    assert run(short + report)[-1] == "[('transfer_size_mismatch', [6]), ('unwritten_read', [6])]"
    twice = 'eng.pages_freed([1], "page_ids")'
    line = next(x for x in example.splitlines() if twice in x)
    assert run(example.replace(line, line + "\n" + "    " + twice) + report)[-1] == "[('double_free', [1])]"
    unsent = next(x for x in example.splitlines() if 'pre.forward(["p-7"]' in x)
    assert run(example.replace(unsent + "\n", "") + report)[-1] == "[('unwritten_send', [9, 10])]"

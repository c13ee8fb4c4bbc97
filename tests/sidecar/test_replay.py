"""``kvguard replay``: offline detection over recordings gives what the live sidecar gave.

The live run is the incident of tests/sidecar/test_pipeline.py through real Probes, rings and a
Sidecar with a Recorder, plus a third engine whose ring overflows (LOST markers), an
engine process that exits (its ring is retired: ``engine_gone``), repeated bad reads
(suppressed repeats) and small segments (several rotations). Replaying the segments
must give the same finding dicts, field for field, and the same incident state.
Damaged or partial recordings must replay what they can and report the rest.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.cli import main
from kvguard.sidecar.recorder import Recorder, RecordingError, RecordingWriter, SegmentHeader, SegmentReader
from kvguard.sidecar.replay import Replay, replay
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.pd_records import finish, pd_request, slots

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def short_lived_engine(ring_dir):
    """A real engine process that says hello (pool < context) and exits: its ring is retired."""
    code = (
        "from kvguard.engine_hooks.probes import Probes; from kvguard.engine_hooks.ring import RingWriter; "
        f"p = Probes(RingWriter({str(ring_dir)!r}, 4096)); "
        "p.hello('prefill', 1, 4, 16, 64, 4096, 4096, 'sglang', '0.5.19', 'tiny')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def incidents_of(pipeline):
    return [i.to_dict(with_findings=True) for i in pipeline.incidents.incidents.values()]


def live_run(base, segment_bytes=4096, restart=False):
    """The live sidecar over the incident; returns (sidecars, findings, recording dir)."""
    ring_dir, rec_dir = base / "rings", base / "rec"
    sink = MemorySink()

    def sidecar():
        rec = Recorder(rec_dir, segment_bytes=segment_bytes, max_bytes=1 << 22)
        return Sidecar(str(ring_dir), sinks=[sink], slack_ns=0, recorder=rec)

    sc = sidecar()
    sidecars = [sc]
    prefill = Probes(RingWriter(str(ring_dir), 1 << 16))
    decode = Probes(RingWriter(str(ring_dir), 1 << 16))
    noisy = Probes(RingWriter(str(ring_dir), 4096))
    prefill.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.19", "tiny")  # the incident: pool < context
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    noisy.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    sc.run_once(flush=True)
    for i in range(200):  # nobody drains the noisy engine: its ring overflows
        noisy.pages_allocated([4 * (i % 60 + 1)])
    sc.run_once(flush=True)
    noisy.pages_freed([4])  # the record after the gap: the reader inserts LOST before it
    short_lived_engine(ring_dir)
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    sc.run_once(flush=True)
    sc.run_once(flush=True)  # the exited engine's ring was drained: now it is retired
    if restart:  # the sidecar restarts: a new recording run; it resumes the rings where it stopped
        sc.stop()
        sc = sidecar()
        sidecars.append(sc)
    last = pd_request(prefill, decode, "r-globex", "globex", 12, [3, 4], 8, 8)
    finish(decode, "r-globex", [3, 4, last])
    sc.run_once(flush=True)
    last = pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)
    for _ in range(5):  # the same bad read on every decode step: delivered once
        decode.forward(["r-initech"], [17], [[last * 4 + 1]], [slots([1, 2, 3, 4, last])[:17]])
    sc.run_once(flush=True)
    sc.stop()
    return sidecars, sink.findings, rec_dir


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    sidecars, findings, rec_dir = live_run(tmp_path_factory.mktemp("live"))
    return sidecars[0], findings, sorted(str(p) for p in rec_dir.glob("*.kvgrec"))


def dicts(findings):
    return [f.to_dict() for f in findings]


def test_replay_gives_the_same_findings_and_incidents_as_live(live):
    sidecar, findings, segs = live
    kinds = {f.kind for f in findings}
    assert {"pool_smaller_than_context", "events_lost", "transfer_size_mismatch", "unwritten_read"} <= kinds
    assert len(segs) >= 3  # the stream crossed segment boundaries
    assert sidecar.pipeline.findings_suppressed >= 5 and sidecar.pipeline.records_lost > 0
    gone = [i for i in sidecar.pipeline.incidents.incidents.values() if i.resolution == "the engine exited"]
    assert gone  # the retired engine's incident was resolved live ...

    replayed, run = replay(segs)
    assert dicts(replayed) == dicts(findings)
    assert incidents_of(run.pipeline) == incidents_of(sidecar.pipeline)  # ... and at the same point in replay
    assert run.pipeline.findings_suppressed == sidecar.pipeline.findings_suppressed
    assert dict(run.pipeline.records_by_kind) == dict(sidecar.pipeline.records_by_kind)
    assert run.pipeline.records_lost == sidecar.pipeline.records_lost
    s = run.summary()
    assert (s["records_missing"], s["problems"], s["corrupt_chunks"], s["apply_errors"]) == (0, 0, 0, 0)
    assert s["records_lost"] == sidecar.pipeline.records_lost and s["carried_skipped"] > 0
    assert s["findings"] == len(findings) and sum(s["findings_by_kind"].values()) == len(findings)


def test_a_restarted_sidecar_is_a_new_recording_run_and_replays_the_same(tmp_path):
    sidecars, findings, rec_dir = live_run(tmp_path, restart=True)
    assert len({SegmentReader(p).header.recording_id for p in rec_dir.glob("*.kvgrec")}) == 2
    replayed, run = replay([rec_dir])
    assert dicts(replayed) == dicts(findings)
    assert len(run.pipelines) == 2
    for live_sc, replay_pipeline in zip(sidecars, run.pipelines):
        assert incidents_of(replay_pipeline) == incidents_of(live_sc.pipeline)
    assert run.summary()["records_missing"] == 0 and run.summary()["problems"] == 0


def test_each_segment_replays_alone_and_invents_nothing(live):
    _, findings, segs = live
    known = {(f.kind, f.reader.rid if f.reader else None) for f in findings}
    for k in range(1, len(segs)):
        replayed, run = replay(segs[k:])
        assert {(f.kind, f.reader.rid if f.reader else None) for f in replayed} <= known
        assert run.summary()["carried_applied"] >= 2  # the engines' HELLOs came with the segment
        assert all(t.hello is not None for t in run.pipeline.engines.values() if t.engine_id in run._seen)


def test_input_order_does_not_matter_and_duplicates_replay_once(live):
    _, findings, segs = live
    replayed, run = replay(list(reversed(segs)) + [segs[0]])
    assert dicts(replayed) == dicts(findings)
    assert run.stats.duplicate_segments == 1


def test_a_missing_middle_segment_is_reported_and_state_resyncs(live):
    _, findings, segs = live
    problems = []
    run = Replay(on_problem=problems.append)
    replayed = run.run(segs[:1] + segs[2:])
    s = run.summary()
    assert s["missing_segments"] == 1 and s["blind_resets"] == 1
    assert any("not among the inputs" in p for p in problems)
    assert any("segments before it are missing: page state of every engine reset" in p for p in problems)
    known = {(f.kind, f.reader.rid if f.reader else None) for f in findings}
    assert {(f.kind, f.reader.rid if f.reader else None) for f in replayed} <= known


def test_a_truncated_last_segment_keeps_everything_before_the_cut(live, tmp_path):
    _, _, segs = live
    for p in segs:
        shutil.copy(p, tmp_path)
    last = tmp_path / os.path.basename(segs[-1])
    with SegmentReader(last) as r:
        whole = list(r)
    size = last.stat().st_size
    os.truncate(last, size - 13)  # the writer died mid-chunk
    with SegmentReader(last) as r:
        cut = list(r)
        assert r.stats.truncated_bytes > 0 and r.stats.corrupt_chunks == 0
    assert 0 < len(cut) < len(whole)
    _, run = replay([tmp_path])
    assert run.summary()["truncated_bytes"] > 0


def write_chunks(path, n_chunks=5, per_chunk=10):
    """One engine, one chunk per flush: chunk k holds seqs [k*per_chunk, (k+1)*per_chunk)."""
    with RecordingWriter(path) as rec:
        for k in range(n_chunks):
            for i in range(per_chunk):
                rec.write_record(
                    wire.Kind.ALLOC,
                    wire.pages_payload(np.array([k * per_chunk + i])),
                    engine_id=9,
                    ts_ns=10**9 + k * per_chunk + i,
                )
            rec.flush()


def test_a_corrupt_chunk_is_skipped_and_reading_resumes_at_the_next(tmp_path):
    path = tmp_path / "c.kvgrec"
    write_chunks(path)
    with SegmentReader(path) as r:
        offsets, pos = [], r.header.header_size
        for _flags, data in r.chunks():
            offsets.append(pos)
            pos += 24 + len(data)
    raw = bytearray(path.read_bytes())
    raw[offsets[2] + 24 + 37] ^= 0x10  # one bit in a page id of chunk 2
    path.write_bytes(bytes(raw))
    problems = []
    run = Replay(on_problem=problems.append)
    run.run([path])
    s = run.summary()
    assert (s["corrupt_chunks"], s["records"], s["records_missing"]) == (1, 40, 10)
    assert any(f"resumed at byte {offsets[3]}" in p for p in problems)
    assert any("records 20..29 (10) are not in the recording" in p for p in problems)


def test_a_resumed_rings_hello_before_a_sequence_jump_is_not_a_gap(tmp_path):
    """A restarted sidecar applies the ring's saved HELLO (old seq), then records from where it resumed."""
    h = wire.hello_payload(wire.Hello(wire.Role.DECODE, 0, 1, 4, 8, 32, 32, 32, "sglang", "0.5.23", "m", "0.1"))
    with RecordingWriter(tmp_path / "a.kvgrec") as rec:
        rec.write_record(wire.Kind.HELLO, h, engine_id=1, seq=0)
        rec.write_record(wire.Kind.ALLOC, wire.pages_payload(np.array([1])), engine_id=1, seq=50)
        rec.write_record(wire.Kind.ALLOC, wire.pages_payload(np.array([1])), engine_id=2, seq=0)
        rec.write_record(wire.Kind.ALLOC, wire.pages_payload(np.array([1])), engine_id=2, seq=50)
    _, run = replay([tmp_path / "a.kvgrec"])
    assert run.summary()["records_missing"] == 49  # engine 2's jump is a gap; engine 1's is not


def test_recorded_ticks_resolve_incidents_at_the_same_point(tmp_path):
    """An events_lost incident resolves after 5 quiet minutes; a later loss fires again only then."""

    def recording(path, tick):
        with RecordingWriter(path) as rec:
            e = rec.engine(engine_id=4)
            e.write(wire.Kind.ALLOC, wire.pages_payload(np.array([1])))
            rec.write_lost(4, 2, ts_ns=1 * 10**9)
            if tick:
                rec.record_tick(302 * 10**9)
            rec.write_lost(4, 3, ts_ns=303 * 10**9)

    recording(tmp_path / "tick.kvgrec", tick=True)
    recording(tmp_path / "none.kvgrec", tick=False)
    with_tick, _ = replay([tmp_path / "tick.kvgrec"])
    without, run = replay([tmp_path / "none.kvgrec"])
    assert [f.kind for f in with_tick] == ["events_lost", "events_lost"]
    assert [f.kind for f in without] == ["events_lost"] and run.pipeline.findings_suppressed == 1


# --------------------------------------------------------------------------- the command
def test_the_command_prints_findings_and_a_summary(live, capsys):
    _, findings, segs = live
    assert main(["replay", os.path.dirname(segs[0])]) == 0
    out = capsys.readouterr().out.splitlines()
    finding_lines = [line for line in out if " CRITICAL " in line or " WARNING " in line]
    assert len(finding_lines) == len(findings)
    assert any(
        "unwritten_read" in line and "r-initech" in line and "exposed r-acme (acme)" in line for line in finding_lines
    )
    assert any(line.startswith(f"replayed {len(segs)} segment(s) of 1 recording(s)") for line in out)
    assert any(line.startswith("findings: ") and "unwritten_read 1" in line for line in out)
    assert any(line.startswith("lost records: ") and "0 missing from the recording" in line for line in out)
    assert "recording problems: none" in out
    assert out[-1] == (
        "options: isolate_tenants=off (recording), ttft_anomaly=on (recording), orphan_timeout_s=120 (recording), "
        "detect_prefix_probing=off (recording)"
    )


def test_the_command_with_json_prints_the_live_finding_objects(live, capsys):
    _, findings, segs = live
    assert main(["replay", "--json", *segs]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[:-1] == [json.loads(f.to_json()) for f in findings]
    summary = lines[-1]["summary"]
    assert summary["findings"] == len(findings) and summary["records_missing"] == 0


def test_unreadable_input_exits_1_before_printing_anything(live, tmp_path, capsys):
    _, _, segs = live
    (tmp_path / "notes.txt").write_text("not a recording\n")
    good = segs[0]
    raw = open(good, "rb").read()
    h = SegmentHeader.unpack(raw)
    newer = (
        SegmentHeader(
            wire.FORMAT_VERSION + 1,
            h.wire_version,
            h.created_realtime_ns,
            h.created_monotonic_ns,
            h.recording_id,
            h.segment_index,
        ).pack()
        + raw[64:]
    )
    (tmp_path / "newer.kvgrec").write_bytes(newer)
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "missing.kvgrec")], "missing.kvgrec: no such file"),
        ([str(tmp_path / "notes.txt")], "not a kvguard recording"),
        ([str(tmp_path / "newer.kvgrec")], "newer than this kvguard reads"),
        ([str(tmp_path / "empty")], "holds no kvguard recording segments"),
        ([good, str(tmp_path / "notes.txt")], "notes.txt"),
    ]
    for args, reason in cases:
        assert main(["replay", *args]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and reason in captured.err and captured.err.startswith("kvguard replay: error:")
    with pytest.raises(RecordingError):
        replay([str(tmp_path / "notes.txt")])


def test_a_damaged_recording_still_exits_0_and_says_what_is_wrong(tmp_path, capsys):
    path = tmp_path / "d.kvgrec"
    write_chunks(path)
    raw = bytearray(path.read_bytes())
    raw[200] ^= 0xFF
    path.write_bytes(bytes(raw[:-5]))
    assert main(["replay", str(path)]) == 0
    captured = capsys.readouterr()
    assert "kvguard replay: warning:" in captured.err and "corrupt chunk" in captured.err
    assert "recording problems: 1 corrupt chunks" in captured.out and "truncated bytes" in captured.out


# --------------------------------------------------------------------------- the live sidecar's settings
def _isolated_live_run(base):
    """A live sidecar with --isolate-tenants and a recorder, over a prefix page shared across tenants."""
    from tests.sidecar.test_isolation import shared_prefix_stream

    ring_dir, rec_dir = base / "rings", base / "rec"
    ring_dir.mkdir()
    sink = MemorySink()
    shared_prefix_stream(ring_dir, "globex")
    sc = Sidecar(
        str(ring_dir), sinks=[sink], slack_ns=0, isolate_tenants=True, recorder=Recorder(rec_dir, max_bytes=1 << 22)
    )
    sc.run_once(flush=True)
    sc.stop()
    return sink.findings, sorted(str(p) for p in rec_dir.glob("*.kvgrec"))


def test_replay_judges_with_the_recorded_settings_and_a_flag_overrides_them(tmp_path, capsys):
    live_findings, segs = _isolated_live_run(tmp_path)
    assert [f.kind for f in live_findings] == ["cross_tenant_prefix_share"]
    # no flag: the recording's --isolate-tenants, so the same finding, field for field
    assert main(["replay", "--json", *segs]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[:-1] == [json.loads(f.to_json()) for f in live_findings]
    summary = lines[-1]["summary"]
    # (the live sidecar's probing detector was on: --isolate-tenants implies it)
    assert summary["options"] == {
        "isolate_tenants": True,
        "ttft_anomaly": True,
        "orphan_timeout_s": 120.0,
        "detect_prefix_probing": True,
    }
    assert set(summary["options_source"].values()) == {"recording"}
    assert summary["recorded_with_shared_ledger"] is False
    # a flag wins over the recording
    assert main(["replay", "--json", "--no-isolate-tenants", *segs]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[:-1] == []
    summary = lines[-1]["summary"]
    assert summary["options"]["isolate_tenants"] is False and summary["options_source"]["isolate_tenants"] == "flag"


def test_every_segment_carries_the_settings_so_each_replays_alone(tmp_path):
    rec_dir = tmp_path / "rec"
    rec = Recorder(rec_dir, segment_bytes=4096, max_bytes=1 << 22)
    rec.set_options({"isolate_tenants": True, "ttft_anomaly": False, "orphan_timeout_s": 30.0, "shared_ledger": True})
    e = rec.engine(1)
    p = Probes(e)
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    for i in range(300):  # several segments
        p.pages_allocated([4 * (i % 60 + 1)])
    rec.close()
    segs = sorted(str(x) for x in rec_dir.glob("*.kvgrec"))
    assert len(segs) >= 3
    _, run = replay([segs[-1]])  # the last segment alone
    s = run.summary()
    # (a recording from before the probing switch: its default, which --isolate-tenants still implies)
    assert s["options"] == {
        "isolate_tenants": True,
        "ttft_anomaly": False,
        "orphan_timeout_s": 30.0,
        "detect_prefix_probing": False,
    }
    assert s["options_source"]["detect_prefix_probing"] == "default"
    assert {v for k, v in s["options_source"].items() if k != "detect_prefix_probing"} == {"recording"}
    assert s["recorded_with_shared_ledger"] is True
    assert run.pipeline.detectors.settings() == {
        "isolate_tenants": True,
        "ttft_anomaly": False,
        "detect_prefix_probing": True,
    }
    assert run.pipeline.orphan_timeout_s == 30.0


def test_a_recording_without_settings_uses_the_flags_then_the_defaults(tmp_path):
    path = tmp_path / "third-party.kvgrec"
    with RecordingWriter(path) as rec:  # a third party's writer sets no options
        Probes(rec.engine(1)).hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    r = Replay(overrides={"orphan_timeout_s": 5.0, "isolate_tenants": None})
    r.run([path])
    s = r.summary()
    assert s["options"] == {
        "isolate_tenants": False,
        "ttft_anomaly": True,
        "orphan_timeout_s": 5.0,
        "detect_prefix_probing": False,
    }
    assert s["options_source"] == {
        "isolate_tenants": "default",
        "ttft_anomaly": "default",
        "orphan_timeout_s": "flag",
        "detect_prefix_probing": "default",
    }
    with pytest.raises(ValueError, match="not a replay option: shared_ledger"):
        Replay(overrides={"shared_ledger": True})


def test_settings_changed_within_a_run_are_reported_and_the_first_kept(tmp_path):
    path = tmp_path / "changed.kvgrec"
    with RecordingWriter(path) as rec:
        rec.set_options({"isolate_tenants": True})
        Probes(rec.engine(1)).hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
        rec.set_options({"isolate_tenants": False})
    _, run = replay([path])
    s = run.summary()
    assert s["options"]["isolate_tenants"] is True
    assert any("recorded options changed within a run" in m for m in s["problem_messages"])


def test_a_recorded_probe_error_or_a_pipeline_error_makes_the_exit_status_3(tmp_path, capsys):
    path = tmp_path / "probe-error.kvgrec"
    with RecordingWriter(path) as rec:
        p = Probes(rec.engine(1))
        p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
        p.report_probe_error("sglang.rows", RuntimeError("hook broke"))
    assert main(["replay", str(path)]) == 3
    out = capsys.readouterr().out
    assert "probe errors: 1 recorded by the engines" in out
    assert main(["replay", "--json", str(path)]) == 3
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    assert summary["probe_errors"] == 1 and summary["apply_errors"] == 0


def test_a_bad_orphan_timeout_flag_exits_2(live, capsys):
    _, _, segs = live
    assert main(["replay", "--orphan-timeout-s", "0", *segs]) == 2
    assert "--orphan-timeout-s: expected seconds > 0, got 0.0" in capsys.readouterr().err


def test_a_recording_takes_every_probe_the_ring_takes_and_each_engines_pid(tmp_path):
    """The recording writer has the ring writer's batch write: a probe that writes in
    batches (decode_rows_assigned) records, instead of disabling itself with a PROBE_ERROR;
    and each engine's HELLO carries the pid given, not the writer's."""
    path = tmp_path / "batch.kvgrec"
    with RecordingWriter(path) as rec:
        p = Probes(rec.engine(1))
        p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny", pid=4242)
        p.request_begin("r-1", "acme", None, 4, 0, False)
        p.request_begin("r-2", "acme", None, 4, 0, False)
        p.pages_allocated(np.arange(4, 12))
        p.rows_assigned("r-1", 0, 4, 0, np.arange(4, 8))
        p.rows_assigned("r-2", 0, 4, 0, np.arange(8, 12))
        p.decode_rows_assigned(["r-1", "r-2"], [4, 4], [12, 16])
    assert "decode_rows_assigned" not in p.disabled_probes
    with SegmentReader(path) as reader:
        recs = [r for r, _carried in reader]
    (hello,) = [r for r in recs if r.kind == wire.Kind.HELLO]
    assert hello.body.pid == 4242
    assign = [r for r in recs if r.kind == wire.Kind.ASSIGN]
    assert [(r.body.row_start, r.body.pages.tolist()) for r in assign[-2:]] == [(4, [3]), (4, [4])]
    assert assign[-1].ts_ns == assign[-2].ts_ns and assign[-1].seq == assign[-2].seq + 1  # one batch
    _, run = replay([path])
    s = run.summary()
    assert s["probe_errors"] == 0 and s["problems"] == 0 and s["records_missing"] == 0


def test_a_recorder_like_object_without_settings_still_records(tmp_path):
    """``Sidecar(recorder=...)`` takes any object with the recorder's record methods (the
    soak keeps records in memory that way); ``set_options`` is used only where it exists."""

    class Keeper:
        def __init__(self):
            self.records = []

        def record_batch(self, records):
            self.records += list(records)

        def record_tick(self, now_ns):
            pass

        def record_engine_gone(self, engine_id, ts_ns):
            pass

        def close(self):
            pass

    keeper = Keeper()
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    sc = Sidecar(str(tmp_path), slack_ns=0, recorder=keeper)
    sc.run_once(flush=True)
    sc.stop()
    assert [r.kind for r in keeper.records] == [wire.Kind.HELLO]

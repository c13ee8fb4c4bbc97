"""Engines whose records come from two processes (vLLM: EngineCore + Worker): the Worker's ring
opens with ENGINE_PART naming the EngineCore's pid, and its records join that engine's timeline
(sidecar/engine_parts.py). And the merge of rings never lets a record that was still being
written be passed by a newer one of another ring (sidecar/ingest.py, the writer's stamp)."""

from __future__ import annotations

import time

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import _WRITING_SINCE, RingWriter
from kvguard.sidecar.ingest import MAX_WRITER_HOLD_NS, RingSet
from kvguard.sidecar.pipeline import Pipeline
from tests.support.recording_probes import CaptureWriter

PAGE = 4


def _feed(pipeline: Pipeline, *writers: CaptureWriter) -> list:
    """Decode each writer's records, interleave them in the order given by ``order`` (a list of
    writer indices per record, via ``_take``) and apply them; returns the findings."""
    found = []
    for engine_id, kind, payload, pool in _take(writers):
        rec = wire.decode_stream(
            wire.encode(kind, 0, time.monotonic_ns(), engine_id, payload, pool), wire.DecodeStats()
        )
        for r in rec:
            found += pipeline.apply(r)
    return found


def _take(writers):
    for w in writers:
        for kind, payload, pool in w.records:
            yield w.engine_id, kind, payload, pool
        w.records.clear()


def _core_and_worker():
    core, worker = CaptureWriter(1), CaptureWriter(2)
    pc, pw = Probes(core), Probes(worker)
    pc.hello("unified", 0, PAGE, 64, 64 * PAGE, 128, 128, "vllm", "0.32.0", "tiny", pid=4242)
    pw.engine_part(4242, "worker", 0, PAGE)
    return core, worker, pc, pw


def test_a_workers_forwards_are_judged_against_its_engines_blocks():
    core, worker, pc, pw = _core_and_worker()
    pipeline = Pipeline()
    assert _feed(pipeline, core, worker) == []
    pc.request_begin("a", "acme", None, 8, 0, False)
    pc.pages_allocated(np.array([3, 5]) * PAGE)
    pc.row_pages_assigned("a", 0, 8, 0, [3, 5])
    pw.forward(["a"], [8], np.array([3, 5]) * PAGE, written_counts=[2])
    assert _feed(pipeline, core, worker) == []
    (engine,) = pipeline.engine_stats()  # one engine: the part made no tracker of its own
    assert engine.pid == 4242 and engine.pages_read == 2 and engine.pages_unverified == 0
    # the worker reads a block the EngineCore already freed: use_after_free on that engine
    pc.pages_freed([5], kind="page_ids")
    pw.forward(["a"], [8], np.zeros(0, np.int64), written_counts=[0], read_pages=[3, 5], read_counts=[2])
    found = _feed(pipeline, core, worker)
    assert [f.kind for f in found] == ["use_after_free"] and found[0].pages == [5]
    assert found[0].engine.pid == 4242 and found[0].reader.tenant == "acme"


def test_a_parts_records_before_its_engine_said_hello_are_counted_and_skipped():
    core, worker, pc, pw = _core_and_worker()
    pipeline = Pipeline()
    pw.forward(["a"], [8], np.array([3]) * PAGE, written_counts=[1])
    assert _feed(pipeline, worker) == []  # ENGINE_PART, then a forward of an engine not seen yet
    # (the forward and the heartbeat after it)
    assert pipeline.stats().records_without_engine == 2 and pipeline.engine_stats() == ()
    assert _feed(pipeline, core) == []  # the HELLO: the part resolves to it
    pw.forward(["a"], [8], np.array([3]) * PAGE, written_counts=[1])
    _feed(pipeline, worker)
    assert pipeline.stats().records_without_engine == 2 and len(pipeline.engine_stats()) == 1


def test_a_part_leaving_ends_nothing_and_its_engine_leaving_unresolves_it():
    core, worker, pc, pw = _core_and_worker()
    pipeline = Pipeline()
    _feed(pipeline, core, worker)
    assert pipeline.on_engine_gone(2, time.monotonic_ns()) == [] and len(pipeline.engines) == 1
    assert not pipeline.parts.is_part(2)
    core2, worker2, pc2, pw2 = _core_and_worker()
    _feed(pipeline, worker2)  # the worker of engine 1, again
    pipeline.on_engine_gone(1, time.monotonic_ns())
    assert pipeline.engines == {} and pipeline.parts.route(2) is None


def test_a_record_being_written_holds_newer_records_of_other_rings_back(tmp_path):
    """Engine A stamps a record and stalls before publishing it (a GC pause, a descheduled
    thread); engine B publishes a newer one meanwhile. B's record must wait for A's."""
    a = RingWriter(str(tmp_path), 4096)
    b = RingWriter(str(tmp_path), 4096)
    rings = RingSet(str(tmp_path), slack_ns=0)
    rings.poll()
    stamp = a._u64[_WRITING_SINCE] = time.monotonic_ns()  # A is inside write(), stamped, not published
    b.write(wire.Kind.FREE, wire.pages_payload(np.array([7])))
    rings.poll()
    assert rings.ready() == [] and rings.stats.polls_held == 1  # B's FREE waits
    a._u64[_WRITING_SINCE] = 0
    a._publish(wire.encode(wire.Kind.ALLOC, 0, stamp, a.engine_id, wire.pages_payload(np.array([7]))))
    a._seq = 1
    rings.poll()
    assert [r.kind for r in rings.ready()] == [wire.Kind.ALLOC, wire.Kind.FREE]
    assert rings.stats.records_out_of_order == 0


def test_a_writer_stuck_mid_record_holds_nothing_back_for_long(tmp_path):
    a = RingWriter(str(tmp_path), 4096)
    b = RingWriter(str(tmp_path), 4096)
    rings = RingSet(str(tmp_path), slack_ns=0)
    a._u64[_WRITING_SINCE] = time.monotonic_ns() - MAX_WRITER_HOLD_NS - 1  # stopped long ago
    b.write(wire.Kind.FREE, wire.pages_payload(np.array([7])))
    rings.poll()
    assert len(rings.ready()) == 1


def test_a_writer_shows_no_record_in_progress_between_writes(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    w.write(wire.Kind.ALLOC, wire.pages_payload(np.array([1])))
    w.write_batch(wire.Kind.ALLOC, [wire.pages_payload(np.array([2]))])
    w.write_sticky(
        wire.Kind.HELLO, wire.hello_payload(wire.Hello(wire.Role.UNIFIED, 0, 1, 1, 8, 8, 8, 8, "e", "v", "m", "k"))
    )
    assert int(w._u64[_WRITING_SINCE]) == 0

"""Ingest: rings appear and disappear; bad files and a missing directory never crash it."""

import logging
import os
import subprocess
import sys

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.ingest import RingSet
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_directory_is_waited_for_then_rings_are_picked_up(tmp_path, caplog):
    rings = RingSet(str(tmp_path / "later"), slack_ns=0)
    with caplog.at_level(logging.WARNING):
        rings.poll()
        rings.poll()
    assert sum("does not exist yet" in r.message for r in caplog.records) == 1  # said once, not every poll
    w = RingWriter(str(tmp_path / "later"), 4096)
    w.write(wire.Kind.ALLOC, wire.pages_payload(np.array([1])))
    rings.poll()
    assert len(rings.ready(flush=True)) == 1 and rings.stats.rings_attached == 1


def test_a_dead_engines_ring_is_drained_then_removed(tmp_path):
    code = (
        "from kvguard.engine_hooks.probes import Probes; from kvguard.engine_hooks.ring import RingWriter; "
        f"p = Probes(RingWriter({str(tmp_path)!r}, 4096)); p.pages_allocated([4, 8])"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    rings = RingSet(str(tmp_path), slack_ns=0)
    rings.poll()
    (rec,) = rings.ready(flush=True)
    assert rec.body.pages.tolist() == [4, 8]  # page_size 1 until a HELLO says otherwise
    assert list(tmp_path.glob("*.ring")) == [] and rings.stats.rings_detached == 1


def test_a_bad_ring_file_is_refused_once_and_good_rings_still_flow(tmp_path, caplog):
    (tmp_path / "kvguard-1-2.ring").write_bytes(b"garbage" * 1000)
    w = RingWriter(str(tmp_path), 4096)
    w.write(wire.Kind.ALLOC, wire.pages_payload(np.array([1])))
    rings = RingSet(str(tmp_path), slack_ns=0)
    with caplog.at_level(logging.ERROR):
        rings.poll()
        rings.poll()
    assert rings.stats.ring_errors == 1 and "bad magic" in rings.stats.last_error
    assert len(rings.ready(flush=True)) == 1


def test_records_of_two_engines_are_merged_in_time_order(tmp_path):
    a = Probes(RingWriter(str(tmp_path), 4096))
    b = Probes(RingWriter(str(tmp_path), 4096))
    for i in range(3):
        a.pages_allocated([4 * i])
        b.pages_freed([4 * i])
    rings = RingSet(str(tmp_path), slack_ns=0)
    rings.poll()
    recs = rings.ready(flush=True)
    assert [r.ts_ns for r in recs] == sorted(r.ts_ns for r in recs)
    assert [r.kind for r in recs] == [wire.Kind.ALLOC, wire.Kind.FREE] * 3


def test_overflow_is_a_blind_window_finding_not_a_false_read(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 4096))
    p.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    p.request_begin("r", "acme", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r", 0, 8, 0, np.arange(4, 12))
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    sidecar.run_once(flush=True)
    for _ in range(200):  # nobody drains: the ring fills and drops, including the KV writes
        p.forward(["r"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
    sidecar.run_once(flush=True)
    p.forward(["r"], [8], [[]], [np.arange(4, 12)])  # a read after the gap: pages unknown, not "unwritten"
    sidecar.run_once(flush=True)
    kinds = [f.kind for f in sink.findings]
    assert kinds == ["events_lost"], kinds
    assert sink.findings[0].evidence["records_lost"] > 0
    sidecar.stop()


def test_a_retired_ring_kept_on_disk_is_not_read_again(tmp_path):
    code = (
        "from kvguard.engine_hooks.probes import Probes; from kvguard.engine_hooks.ring import RingWriter; "
        f"p = Probes(RingWriter({str(tmp_path)!r}, 4096)); "
        "p.hello('prefill', 0, 4, 64, 256, 2048, 250, 'sglang', '0.5.19', 'tiny')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0, remove_dead_rings=False)
    for _ in range(5):
        sidecar.run_once(flush=True)
    assert len(list(tmp_path.glob("*.ring"))) == 1 and sidecar.rings.stats.rings_attached == 1
    assert [f.kind for f in sink.findings] == ["pool_smaller_than_context"]
    sidecar.stop()


def test_a_ring_being_created_is_never_seen_without_its_header(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(w.path)]
    rings = RingSet(str(tmp_path), slack_ns=0)
    rings.poll()
    assert rings.stats.ring_errors == 0 and len(rings.readers) == 1

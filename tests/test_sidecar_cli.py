"""`kvguard sidecar` as a process, and the start-order / restart cases of the spine."""

import json
import os
import socket
import struct
import subprocess
import sys
import time

import httpx
import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leak(p: Probes, reader="r-initech"):
    """Two requests on one engine; the second reads a page only the first ever wrote."""
    p.request_begin("r-acme", "acme", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r-acme", 0, 8, 0, np.arange(4, 12))
    p.forward(["r-acme"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
    p.request_end("r-acme", "stop", 1, 2, 1, "")
    p.pages_freed(np.arange(4, 12))
    p.request_begin(reader, "initech", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned(reader, 0, 8, 0, np.arange(4, 12))
    p.forward([reader], [8], [np.arange(4, 8)], [np.arange(4, 12)])  # wrote page 1 only, read pages 1 and 2


def test_the_sidecar_command_prints_findings_as_json_and_serves_metrics(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard.sidecar.cli",
            "sidecar",
            "--ring-dir",
            str(tmp_path),
            "--listen",
            f"127.0.0.1:{port}",
            "--json",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(100):  # started before the engine: it waits
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        p = Probes(RingWriter(str(tmp_path), 1 << 16))
        p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
        leak(p)
        line = proc.stdout.readline()
        finding = json.loads(line)
        assert set(finding) >= {"kind", "severity", "engine", "reader", "pages", "exposed", "first_seen_ns", "summary"}
        assert finding["kind"] == "unwritten_read"
        assert finding["engine"] == {"role": "unified", "rank": 0, "pid": os.getpid()}
        assert finding["reader"] == {"rid": "r-initech", "tenant": "initech", "bootstrap_room": None}
        assert finding["pages"] == [2]
        assert finding["exposed"] == [{"rid": "r-acme", "tenant": "acme", "pages": [2]}]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'kvguard_findings_total{kind="unwritten_read",severity="critical"} 1.0' in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert proc.returncode in (0, 130), proc.stderr.read()


def test_a_sidecar_started_after_the_engine_reads_the_whole_history(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    leak(p)
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    sidecar.run_once(flush=True)
    assert [f.kind for f in sink.findings] == ["unwritten_read"] and sidecar.rings.stats.records_lost == 0
    sidecar.stop()


def test_a_restarted_sidecar_resumes_and_does_not_judge_what_it_did_not_see(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    p.request_begin("r", "acme", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r", 0, 8, 0, np.arange(4, 12))
    first = Sidecar(str(tmp_path), slack_ns=0)
    first.run_once(flush=True)
    first.stop()  # the old sidecar goes away mid-request
    # the request writes its KV while no sidecar runs, then keeps decoding
    p.forward(["r"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
    sink = MemorySink()
    second = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    second.run_once(flush=True)  # resumes at the ring's read_pos: the forward above is seen
    p.pages_allocated(np.arange(12, 16))
    p.rows_assigned("r", 8, 9, 8, [12])
    p.forward(["r"], [9], [[12]], [np.arange(4, 16)[:9]])
    second.run_once(flush=True)
    assert sink.findings == []
    # the HELLO was consumed by the first sidecar; the second learned it from the ring header
    tracker = next(iter(second.pipeline.engines.values()))
    assert tracker.page_size == 4 and tracker.hello.engine_version == "0.5.23"
    # and judges requests that start after it attached
    leak(p)
    second.run_once(flush=True)
    assert [f.kind for f in sink.findings] == ["unwritten_read"]
    second.stop()


def test_a_ring_whose_pid_now_belongs_to_another_process_is_retired(tmp_path):
    """The engine died; its pid now names a live process (here: this test). Liveness is the
    producer's lock on the file, not the pid, so the ring is still retired."""
    code = (
        "from kvguard.engine_hooks.probes import Probes; from kvguard.engine_hooks.ring import RingWriter; "
        f"Probes(RingWriter({str(tmp_path)!r}, 4096)).pages_allocated([4])"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    (path,) = tmp_path.glob("*.ring")
    with open(path, "r+b") as f:
        f.seek(24)
        f.write(struct.pack("<I", os.getpid()))
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    sidecar.run_once(flush=True)
    assert sidecar.rings.stats.rings_detached == 1 and not path.exists()
    assert sidecar.pipeline.records_by_kind["ALLOC"] == 1  # drained before it was retired
    sidecar.stop()


def test_a_live_engine_in_another_pid_namespace_is_not_retired(tmp_path):
    """The sidecar cannot see the engine's pid (separate pid namespaces): still alive."""
    w = RingWriter(str(tmp_path), 4096)
    Probes(w).pages_allocated([4])
    with open(w.path, "r+b") as f:
        f.seek(24)
        f.write(struct.pack("<I", 2**31 - 2))  # a pid that does not exist here
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    sidecar.run_once(flush=True)
    assert sidecar.rings.stats.rings_detached == 0 and os.path.exists(w.path)
    sidecar.stop()


def test_ring_files_are_group_writable_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        w = RingWriter(str(tmp_path), 4096)
    finally:
        os.umask(old)
    assert os.stat(w.path).st_mode & 0o777 == 0o660

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
import pytest

from kvguard.demo.engine_env import free_port
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def kvguard(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "kvguard.sidecar.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


class RunningSidecar:
    """``kvguard sidecar ARGS`` as a process, healthy on ``health_port`` (its --health-listen, else
    --listen) before the block runs; stopped with SIGTERM after it (``returncode``, ``stderr``)."""

    def __init__(self, args: list[str], health_port: int, env: dict | None = None):
        self.args, self.health_port, self.env = args, health_port, env
        self.healthy, self.returncode, self.stderr = False, None, ""

    def __enter__(self) -> "RunningSidecar":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvguard.sidecar.cli", "sidecar", *self.args],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        deadline = time.time() + 60
        while time.time() < deadline and self.proc.poll() is None and not self.healthy:
            try:
                self.healthy = httpx.get(f"http://127.0.0.1:{self.health_port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            _out, self.stderr = self.proc.communicate(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.returncode = self.proc.returncode


def test_kvguard_version_prints_the_installed_packages_version():
    from importlib import metadata

    r = kvguard("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvguard {metadata.version('kvguard')}"


def test_every_listen_form_works_or_is_refused_at_parse_time_with_the_reason():
    import argparse

    import pytest

    from kvguard.sidecar.cli import parse_listen

    assert parse_listen("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_listen("localhost:9464") == ("localhost", 9464)
    assert parse_listen(":9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:9464") == ("::1", 9464)
    assert parse_listen("[::]:9464") == ("::", 9464)
    for value, why in [
        ("::1:9464", "an IPv6 address goes in brackets: [::1]:9464"),
        (":0", "port 0 (any free port) is refused"),
        ("127.0.0.1:65536", "port 65536 is outside 1-65535"),
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:http", "expected HOST:PORT"),
        ("[]:9464", "brackets hold an IPv6 address"),
        ("[10.0.0.1]:9464", "brackets hold an IPv6 address"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError) as refused:
            parse_listen(value)
        assert str(refused.value).startswith(why) and repr(value) in str(refused.value), (value, refused.value)
    r = kvguard("sidecar", "--listen", "::1:9464")  # refused by the parser: a bad setting, exit 2
    assert r.returncode == 2 and "an IPv6 address goes in brackets: [::1]:9464" in r.stderr


def test_a_taken_port_a_busy_ring_dir_and_bad_settings_have_their_own_exit_codes(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = kvguard("sidecar", "--ring-dir", str(tmp_path / "a"), "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 4, r.stderr
    assert f"--listen 127.0.0.1:{port}: the port is already in use" in r.stderr
    r = kvguard("sidecar", "--ring-dir", str(tmp_path / "e"), "--api-token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "--api-token-file" in r.stderr and "No such file" in r.stderr
    r = kvguard("sidecar", "--ring-dir", str(tmp_path / "b"), "--listen", "192.0.2.1:9464")  # not this host's address
    assert r.returncode == 2 and "--listen 192.0.2.1:9464: cannot listen there" in r.stderr
    r = kvguard(
        "sidecar", "--ring-dir", str(tmp_path / "c"), "--orphan-timeout-s", "0", "--listen", f"127.0.0.1:{port}"
    )
    assert r.returncode == 2 and "--orphan-timeout-s" in r.stderr
    from kvguard.sidecar.lockfile import lock_ring_dir

    held = lock_ring_dir(str(tmp_path / "d"))  # another sidecar's
    try:
        r = kvguard("sidecar", "--ring-dir", str(tmp_path / "d"), "--listen", f"127.0.0.1:{free_port()}")
    finally:
        os.close(held)
    assert r.returncode == 3, r.stderr
    r = kvguard("sidecar", "--help")
    assert r.returncode == 0
    for documented in (
        "exit codes:",
        "4    --listen or --health-listen: the port is already in use",
        "KVGUARD_RING_DIR",
    ):
        assert documented in r.stdout


def test_verbose_is_accepted_after_every_subcommand():
    for command in ("preflight", "replay", "dashboards", "canary", "sidecar"):
        r = kvguard(command, "-v", "--help")
        assert r.returncode == 0 and "-v, --verbose" in r.stdout, command


def test_log_format_json_makes_every_log_line_one_json_object(tmp_path):
    port = free_port()
    args = ["--log-format", "json", "--ring-dir", str(tmp_path), "--listen", f"127.0.0.1:{port}"]
    with RunningSidecar(args, port, env=dict(os.environ, KVGUARD_API_TOKEN="")) as sidecar:
        assert sidecar.healthy
    assert sidecar.returncode == 0, sidecar.stderr
    err = sidecar.stderr
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert lines and all({"time", "level", "logger", "message"} <= set(rec) for rec in lines)
    assert any("serving http://127.0.0.1" in rec["message"] for rec in lines)
    assert any(rec["message"] == "kvguard sidecar: stopped cleanly" for rec in lines)
    assert any(rec["level"] == "WARNING" and "no API token" in rec["message"] for rec in lines)


def test_ledger_required_fails_fast_when_the_shared_ledger_does_not_answer(tmp_path):
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    r = kvguard("sidecar", "--ring-dir", str(tmp_path / "a"), "--ledger", nobody, "--ledger-required")
    assert r.returncode == 5, r.stderr
    assert f"--ledger-required: the shared ledger cannot be reached: {nobody}: ConnectionError" in r.stderr
    assert time.monotonic() - t0 < 30
    r = kvguard("sidecar", "--ring-dir", str(tmp_path / "b"), "--ledger-required")  # the in-memory ledger
    assert r.returncode == 2 and "--ledger-required: the ledger is 'memory', not a shared one" in r.stderr


def test_ledger_required_starts_when_the_shared_ledger_answers(tmp_path, redis_server):
    port = free_port()
    args = ["--ring-dir", str(tmp_path / "rings"), "--listen", f"127.0.0.1:{port}"]
    with RunningSidecar(args + ["--ledger", redis_server.url, "--ledger-required"], port) as sidecar:
        assert sidecar.healthy, sidecar.proc.poll()
    assert sidecar.returncode == 0, sidecar.stderr


def test_the_probes_own_listener_answers_while_the_api_port_is_flooded(tmp_path):
    api, health = free_port(), free_port()
    args = ["--ring-dir", str(tmp_path), "--listen", f"127.0.0.1:{api}", "--health-listen", f"127.0.0.1:{health}"]
    flood: list[socket.socket] = []
    with RunningSidecar(args + ["--http-max-connections", "8"], health) as sidecar:
        assert sidecar.healthy
        try:
            for _ in range(40):  # connections that never send a request: the API port's cap is 8
                flood.append(socket.create_connection(("127.0.0.1", api), timeout=5))
            time.sleep(0.5)
            with pytest.raises(httpx.HTTPError):  # the API port closes new connections
                httpx.get(f"http://127.0.0.1:{api}/healthz", timeout=2)
            for _ in range(5):  # the probes' port answers, as the API would
                t0 = time.monotonic()
                live = httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=2)
                ready = httpx.get(f"http://127.0.0.1:{health}/readyz", timeout=2)
                assert time.monotonic() - t0 < 2
                assert live.status_code == 200 and live.json()["ingest_alive"] is True
                assert ready.status_code == 200 and ready.json()["ready"] is True
            assert httpx.get(f"http://127.0.0.1:{health}/metrics", timeout=2).status_code == 404  # probes only
            with socket.create_connection(("127.0.0.1", health), timeout=5) as s:  # not HTTP: 400, closed
                s.sendall(b"HELLO\r\n\r\n")
                assert s.recv(100).startswith(b"HTTP/1.1 400")
        finally:
            for s in flood:
                s.close()
    assert sidecar.returncode == 0, sidecar.stderr
    assert f"probes on http://127.0.0.1:{health}" in sidecar.stderr


def test_main_in_another_process_keeps_that_processs_logging(monkeypatch):
    # a test runner or a tool calling kvguard's main() in-process: its handlers stay (replacing
    # them bound the root logger to one test's captured stderr, and later log lines failed)
    import io
    import logging

    from kvguard.sidecar import cli

    root = logging.getLogger()
    host = logging.StreamHandler(io.StringIO())
    monkeypatch.setattr(root, "handlers", [host])
    cli.configure_logging(False, "json")
    assert root.handlers == [host]

"""Issue 14, item 7: the probes answer while the sidecar is saturated, and no client can hold
its connections open.

- A synthetic engine floods its ring (request cycles as fast as a core allows) beside a
  healthy one: the real ``kvguard sidecar`` cannot keep up, so its ingest cycles run back to
  back. ``/healthz`` and ``/metrics`` used to wait on the ingest lock for a whole cycle (8 MiB
  from each ring): up to 6.9 s, against the manifests' 5 s probe timeout. Now the probes take
  no lock, a scrape serves the last snapshot when a cycle is busy (its age exported), and a
  cycle reads about 1 MiB in all.
- 200 connections that send nothing or half a request head: all stayed open (one fd each,
  for as long as the client liked). Now past ``--http-max-connections`` they are closed at
  once and the rest after ``--http-request-timeout-s``; both counted.

The latency bounds here are far above what the sidecar does (a few ms idle, ~0.2 s on an
overloaded 2-core machine) and far below the failure (seconds): they tell the two apart
without timing the machine.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time

import httpx
import pytest

from tests.sidecar.reliability.sidecar_under_test import counter, healthy_setup, start_engine, stop_all

HEALTHZ_BOUND_S = 0.1  # issue 14: /healthz answers within 100 ms while the sidecar is saturated
PROBE_BOUND_S = 1.0  # against the 5 s probe timeout of the manifests; the old sidecar took up to 6.9 s


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    stop_all(started)


def timed_get(url: str) -> tuple[float, httpx.Response]:
    t = time.monotonic()
    reply = httpx.get(url, timeout=30)
    return time.monotonic() - t, reply


def probe(port: int, path: str = "/healthz") -> tuple[float, int, dict]:
    """One HTTP probe as the kubelet sends it: a fresh connection, one GET, read to the end.
    (httpx.get itself spends ~50 ms building a client: it is not what is measured.)"""
    t = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    took = time.monotonic() - t
    head, _, body = data.partition(b"\r\n\r\n")
    return took, int(head.split()[1]), json.loads(body)


@pytest.mark.timeout(120)
def test_probes_and_scrapes_answer_while_ingest_is_saturated(tmp_path, procs):
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    start_engine(ring_dir, procs, mode="flood", ring_bytes=16 << 20)  # one is more than the sidecar keeps up with
    base = f"http://127.0.0.1:{sidecar.port}"
    # saturated: a cycle is running whenever we look, or scrapes are served from a snapshot
    sidecar.wait_for(
        "the sidecar to be saturated",
        lambda: (
            counter(sidecar.metrics(), "kvguard_records_lost_total") > 0
            or json.loads(httpx.get(base + "/healthz", timeout=30).text).get("cycle_running_s")
        ),
        60,
    )
    health, scrapes, mid_cycle = [], [], 0
    t_end = time.monotonic() + 12
    while time.monotonic() < t_end:
        for _ in range(4):
            took, status, detail = probe(sidecar.port)
            assert status == 200, detail  # a long cycle under load is progress, not a failure
            health.append(took)
            mid_cycle += detail["cycle_running_s"] is not None
            time.sleep(0.02)
        took, reply = timed_get(base + "/metrics")
        assert reply.status_code == 200
        scrapes.append(took)
    text = sidecar.metrics()
    health.sort()
    p95 = health[int(len(health) * 0.95)]
    print(
        f"/healthz: {len(health)} answers, p50 {health[len(health) // 2] * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
        f"max {health[-1] * 1000:.0f} ms; /metrics: max {max(scrapes) * 1000:.0f} ms; {mid_cycle} probes answered "
        f"mid-cycle; stale scrapes {counter(text, 'kvguard_metrics_stale_scrapes_total'):.0f}; frozen objects "
        f"{counter(text, 'kvguard_gc_frozen_objects'):.0f}"
    )
    assert mid_cycle > 0  # the probes were answered while a cycle held the ingest lock
    # issue 14: every probe within 100 ms while saturated. Full garbage collections held the
    # process 100-600 ms (sidecar/gc_policy.py); the slowest probe here is now ~20 ms
    assert health[-1] < HEALTHZ_BOUND_S, health
    assert max(scrapes) < 2 * PROBE_BOUND_S, scrapes
    assert counter(text, "kvguard_metrics_snapshot_age_seconds") < 30
    sidecar.reads_keep_being_checked(engine.pid, timeout=30)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def closed_by_peer(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.timeout(90)
def test_half_open_connections_are_capped_and_timed_out(tmp_path, procs):
    ring_dir, engine, sidecar = healthy_setup(
        tmp_path, procs, extra=("--http-max-connections", "32", "--http-request-timeout-s", "2")
    )
    pid = sidecar.proc.pid
    fds_before = open_fds(pid)
    socks = []
    try:
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", sidecar.port), timeout=5)
            if i % 2:  # half a request head, never finished
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n")
            socks.append(s)
        time.sleep(0.5)
        assert open_fds(pid) < fds_before + 40  # past the cap they were closed at once
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(closed_by_peer(s) for s in socks):
            time.sleep(0.2)
        still_open = sum(not closed_by_peer(s) for s in socks)
        assert still_open == 0, f"{still_open} of 200 idle connections still open after 10 s"
    finally:
        for s in socks:
            s.close()
    reply = httpx.get(f"http://127.0.0.1:{sidecar.port}/healthz", timeout=5)
    assert reply.status_code == 200
    text = sidecar.metrics()
    over = counter(text, 'kvguard_http_connections_closed_total{reason="over_limit"}')
    timed_out = counter(text, 'kvguard_http_connections_closed_total{reason="request_timeout"}')
    assert over >= 150 and timed_out >= 1 and over + timed_out >= 200, text
    assert open_fds(pid) <= fds_before + 2
    sidecar.reads_keep_being_checked(engine.pid)
    # a client that asks properly is answered, on a kept-alive connection too
    with httpx.Client(base_url=f"http://127.0.0.1:{sidecar.port}", timeout=5) as client:
        assert [client.get("/healthz").status_code for _ in range(3)] == [200] * 3

"""The real `kvguard sidecar` process: what it reports about its own blind spots, and how it
starts and stops (issue 14, item 8).

Engines are synthetic: the project's own RingWriter/Probes in this test process. The
sidecar is a subprocess, observed only through /metrics, /v1/incidents, its exit code and
its stderr, as an operator would.
"""

from __future__ import annotations

import resource
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.demo.engine_env import free_port
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import HEADER_BYTES, RingWriter
from tests.sidecar.reliability.sidecar_under_test import freeze

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "reliability-test-token"
WRITE_POS_OFFSET, READ_POS_OFFSET = 64, 128  # ring header fields (engine_hooks/ring.py)


class SidecarProc:
    """`python -m sidecar.cli sidecar` on a ring directory, with a bearer token for /v1."""

    def __init__(self, tmp_path: Path, ring_dir: Path, *extra: str, preexec_fn=None, wait: bool = True):
        self.port = free_port()
        token_file = tmp_path / f"token-{self.port}"
        token_file.write_text(TOKEN)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvguard.sidecar.cli",
                "sidecar",
                "--ring-dir",
                str(ring_dir),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--api-token-file",
                str(token_file),
                *extra,
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=preexec_fn,
        )
        if wait:
            self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError("sidecar not healthy in time")

    def metrics(self) -> dict[str, float]:
        """Sample name with labels (as exposed, e.g. ``kvguard_records_lost_total``) -> value."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def incidents(self, kind: str) -> list[dict]:
        resp = httpx.get(
            f"{self.url}/v1/incidents", params={"kind": kind}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
        )
        resp.raise_for_status()
        return resp.json()["incidents"]

    def wait_for(self, pred, what: str, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = self.metrics()
            if pred(last):
                return last
            time.sleep(0.05)
        raise AssertionError(
            f"timed out waiting for {what}; last scrape: "
            f"{ {k: v for k, v in (last or {}).items() if 'lost' in k or 'corrupt' in k or 'recording' in k} }"
        )

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 20.0) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return self.proc.returncode, self.proc.stderr.read()


@pytest.fixture
def sidecars():
    started: list[SidecarProc] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def engine(ring_dir: Path, capacity: int = 1 << 16) -> Probes:
    p = Probes(RingWriter(str(ring_dir), capacity))
    p.hello("unified", 0, 4, 4096, 16384, 4096, 4096, "sglang", "0.5.23", "tiny")
    return p


def ring_drained(path: str) -> bool:
    with open(path, "rb") as f:
        raw = f.read(READ_POS_OFFSET + 8)
    (write_pos,) = struct.unpack_from("<Q", raw, WRITE_POS_OFFSET)
    (read_pos,) = struct.unpack_from("<Q", raw, READ_POS_OFFSET)
    return write_pos == read_pos


def wait_drained(path: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ring_drained(path):
        assert time.monotonic() < deadline, "the sidecar did not drain the ring"
        time.sleep(0.02)


def overflow_while_stopped(sc: SidecarProc, p: Probes, extra_drops: int) -> int:
    """Freeze the sidecar, fill the ring until it drops ``extra_drops`` records, thaw it, let it
    drain, then write one record after the gap (a gap shows when the next record arrives).
    Returns the number of records dropped."""
    writer = p.writer
    before = writer.dropped_records
    freeze(sc.proc)  # every thread stopped: one gap, not several
    try:
        page = 1
        while writer.dropped_records - before < extra_drops:
            p.pages_allocated([page * 4])
            page = page % 4000 + 1
    finally:
        sc.proc.send_signal(signal.SIGCONT)
    wait_drained(writer.path)
    p.pages_freed([4])  # the record after the gap
    return writer.dropped_records - before


# --------------------------------------------------------------------------- blind window
def test_events_lost_incident_reports_the_blind_windows_total_not_its_first_gap(tmp_path, sidecars):
    """Two overflows, the first of 1 record and the second of 5,000: the incident that groups
    them must say 5,001 records, as kvguard_records_lost_total does (before: "1 records lost")."""
    ring_dir = tmp_path / "rings"
    sc = SidecarProc(tmp_path, ring_dir)
    sidecars.append(sc)
    p = engine(ring_dir, capacity=1 << 14)
    first = overflow_while_stopped(sc, p, 1)
    second = overflow_while_stopped(sc, p, 5000)
    assert first == 1 and second == 5000
    sc.wait_for(lambda m: m.get("kvguard_records_lost_total") == first + second, "the lost-records counter")
    deadline = time.monotonic() + 10
    while True:  # the finding trails the counter by the merge slack
        (inc,) = sc.incidents("events_lost")
        if inc["count"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert inc["count"] == 2
    assert inc["evidence"]["records_lost"] == first + second, inc
    assert inc["evidence"]["gaps"] == 2
    assert f"{first + second} records lost" in inc["summary"], inc["summary"]
    # each gap keeps its own size, and the engine's running total
    detail = httpx.get(f"{sc.url}/v1/incidents/{inc['id']}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    findings = detail.get("findings") or detail.get("incident", {}).get("findings")
    assert [f["evidence"]["records_lost"] for f in findings] == [first, second]
    assert [f["evidence"]["engine_records_lost_total"] for f in findings] == [first, first + second]
    code, err = sc.stop()
    assert code == 0, err


# --------------------------------------------------------------------------- corrupt bytes
def test_a_garbage_write_position_counts_at_most_the_rings_capacity_as_corrupt(tmp_path, sidecars):
    """An engine (or a stray writer) stores nonsense into write_pos: the reader resynchronises,
    and what it counts as skipped is bounded by what the ring can hold (before: 1.8e19)."""
    ring_dir = tmp_path / "rings"
    sc = SidecarProc(tmp_path, ring_dir)
    sidecars.append(sc)
    capacity = 1 << 14
    p = engine(ring_dir, capacity=capacity)
    p.pages_allocated([4])
    wait_drained(p.writer.path)
    with open(p.writer.path, "r+b") as f:  # what a wild store into the shared header looks like
        f.seek(WRITE_POS_OFFSET)
        f.write(struct.pack("<Q", 0xFFFF_FFFF_FFFF_0000))
    m = sc.wait_for(lambda m: m.get("kvguard_ring_corrupt_bytes_total", 0) > 0, "the resynchronisation")
    p.pages_allocated([8])  # the producer stores its own write_pos again: a second resynchronisation
    time.sleep(0.5)
    m = sc.metrics()
    assert 0 < m["kvguard_ring_corrupt_bytes_total"] <= 2 * capacity, m["kvguard_ring_corrupt_bytes_total"]
    p.pages_allocated([12])  # and the ring is read again after it
    sc.wait_for(lambda m: m.get('kvguard_records_total{kind="ALLOC"}', 0) >= 2, "reading after the resync")
    code, err = sc.stop()
    assert code == 0, err


# --------------------------------------------------------------------------- recording failures
def _small_file_limit():
    # no file this process writes may reach past 4 KiB: a recording segment fails (EFBIG) as
    # soon as it gets there, exactly as on a full disk (ENOSPC), through the same OSError path.
    # (The sidecar writes its read position into the ring's 4 KiB header: that still works.)
    resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER_BYTES, HEADER_BYTES))


def test_a_recording_that_cannot_be_written_is_exported_as_failing(tmp_path, sidecars):
    ring_dir, record_dir = tmp_path / "rings", tmp_path / "rec"
    sc = SidecarProc(tmp_path, ring_dir, "--record-dir", str(record_dir), preexec_fn=_small_file_limit)
    sidecars.append(sc)
    p = engine(ring_dir)
    for page in range(1, 400):  # more than 4 KiB of records
        p.pages_allocated([page * 4])
    m = sc.wait_for(lambda m: m.get("kvguard_recording_failing") == 1, "the recording to be reported failing")
    assert m["kvguard_recording_enabled"] == 1
    assert m["kvguard_recording_write_errors_total"] >= 1
    for page in range(400, 460):  # records that come while the recording is failing
        p.pages_allocated([page * 4])
    m = sc.wait_for(
        lambda m: m.get("kvguard_recording_records_not_recorded_total", 0) >= 50,
        "the records not recorded to be counted",
    )
    code, err = sc.stop()
    assert code == 0, err


def test_a_working_recording_is_exported_as_enabled_and_not_failing(tmp_path, sidecars):
    ring_dir, record_dir = tmp_path / "rings", tmp_path / "rec"
    sc = SidecarProc(tmp_path, ring_dir, "--record-dir", str(record_dir))
    sidecars.append(sc)
    p = engine(ring_dir)
    p.pages_allocated([4])
    wait_drained(p.writer.path)
    m = sc.wait_for(lambda m: m.get('kvguard_records_total{kind="ALLOC"}') == 1, "the record")
    assert (m["kvguard_recording_enabled"], m["kvguard_recording_failing"]) == (1, 0)
    assert m["kvguard_recording_write_errors_total"] == 0
    code, err = sc.stop()
    assert code == 0, err
    assert list(record_dir.glob("*.kvgrec")), "SIGTERM must finish the open segment (flush, close)"


# --------------------------------------------------------------------------- one sidecar per ring dir
def test_a_second_sidecar_on_the_same_ring_dir_exits_at_once_naming_the_holder(tmp_path, sidecars):
    ring_dir = tmp_path / "rings"
    first = SidecarProc(tmp_path, ring_dir)
    sidecars.append(first)
    second = SidecarProc(tmp_path, ring_dir, wait=False)
    sidecars.append(second)
    try:
        code = second.proc.wait(timeout=8)  # it must exit "at once": the start-up alone takes ~2 s here
    except subprocess.TimeoutExpired:
        pytest.fail("a second sidecar on the same ring directory kept running")
    err = second.proc.stderr.read()
    assert code != 0
    assert str(ring_dir) in err and f"pid {first.proc.pid}" in err, err
    # the first one is untouched, and once it is gone the directory can be taken again
    assert first.proc.poll() is None
    first.proc.kill()  # kill -9: the kernel releases the lock, no stale file blocks a restart
    first.proc.wait()
    third = SidecarProc(tmp_path, ring_dir)
    sidecars.append(third)
    code, err = third.stop()
    assert code == 0, err


# --------------------------------------------------------------------------- SIGTERM
def test_sigterm_shuts_down_cleanly_and_exits_0(tmp_path, sidecars):
    ring_dir = tmp_path / "rings"
    sc = SidecarProc(tmp_path, ring_dir)
    sidecars.append(sc)
    p = engine(ring_dir)
    p.pages_allocated([4])
    wait_drained(p.writer.path)
    code, err = sc.stop(signal.SIGTERM)
    assert code == 0, err
    assert "Traceback" not in err, err
    # the clean shutdown closed the ring: the consumer pid in the header is cleared
    with open(p.writer.path, "rb") as f:
        raw = f.read(144)
    assert struct.unpack_from("<Q", raw, 136)[0] == 0

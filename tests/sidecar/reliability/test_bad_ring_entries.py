"""Issue 14, item 3: no ``*.ring`` entry can stop the sidecar's ingestion of the others.

The real ``kvguard sidecar`` process watches a healthy synthetic engine; a bad entry is
put in its ring directory. It used to catch only permission errors: a directory, a
symbolic link to a busy binary or to a sysfs file that fails to read, or more rings than
the fd limit allows raised out of the directory scan, so no ring was drained any more
(checked reads stopped, ~90 tracebacks a second, ``kvguard_ring_errors_total`` 0); a
symbolic link out of the directory was followed. Now each entry is handled on its own:
refused once (one log line, one ring error, not looked at again until it changes), and
the healthy engine's reads keep being checked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sidecar.reliability.sidecar_under_test import counter, cpu_seconds, healthy_setup, start_engine, stop_all

# a sysfs attribute whose read fails (EIO) although open(O_RDWR) works: present wherever there is a loopback
SYSFS_EIO = "/sys/class/net/lo/power/autosuspend_delay_ms"


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    stop_all(started)


def _sysfs_read_fails() -> bool:
    try:
        fd = os.open(SYSFS_EIO, os.O_RDWR)
    except OSError:
        return False
    try:
        os.pread(fd, 56, 0)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def make_directory(ring_dir: Path, tmp_path: Path, procs: list) -> str:
    (ring_dir / "kvguard-1-1.ring").mkdir()
    return "a directory"


def make_link_to_busy_binary(ring_dir: Path, tmp_path: Path, procs: list) -> str:
    # the running interpreter's binary: opening it for writing is ETXTBSY
    (ring_dir / "kvguard-2-2.ring").symlink_to(os.path.realpath(sys.executable))
    return "a symbolic link"


def make_link_to_sysfs(ring_dir: Path, tmp_path: Path, procs: list) -> str:
    if not _sysfs_read_fails():
        pytest.skip(f"{SYSFS_EIO} is not a sysfs file whose read fails here")
    (ring_dir / "kvguard-3-3.ring").symlink_to(SYSFS_EIO)
    return "a symbolic link"


def make_link_out_of_the_directory(ring_dir: Path, tmp_path: Path, procs: list) -> str:
    # a live engine's real ring elsewhere: following the link would attach a ring that is not ours to read
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _, ring = start_engine(elsewhere, procs)
    (ring_dir / "kvguard-4-4.ring").symlink_to(ring)
    return "a symbolic link"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "make",
    [make_directory, make_link_to_busy_binary, make_link_to_sysfs, make_link_out_of_the_directory],
    ids=["directory", "symlink-to-busy-binary", "symlink-to-sysfs", "symlink-out-of-dir"],
)
def test_a_bad_entry_is_refused_once_and_the_healthy_engine_is_still_checked(tmp_path, procs, make):
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    kind = make(ring_dir, tmp_path, procs)

    sidecar.wait_for(
        "the bad entry to be refused and counted",
        lambda: counter(sidecar.metrics(), "kvguard_ring_errors_total") >= 1,
        10,
    )
    sidecar.reads_keep_being_checked(engine.pid)
    time.sleep(2.5)  # past two full rescans of the directory (once a second): still one refusal
    final = sidecar.metrics()
    assert counter(final, "kvguard_ring_errors_total") == 1, sidecar.log_text()[-3000:]
    assert counter(final, "kvguard_rings_attached") == 1  # only the healthy engine
    lines = [ln for ln in sidecar.log_text().splitlines() if "refusing ring" in ln]
    assert len(lines) == 1 and kind in lines[0] and "ERROR" in lines[0], lines
    assert "Traceback" not in sidecar.log_text(), sidecar.log_text()[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["fd-limit", "max-rings"])
def test_more_rings_than_it_may_attach_are_counted_once_and_never_stop_the_others(tmp_path, procs, how):
    # 192 descriptors: (192 - 128 reserved) / 1 per ring = 64 rings, however many --max-rings allows
    extra, nofile, cap = ((), 192, 64) if how == "fd-limit" else (("--max-rings", "8"), None, 8)
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs, extra=extra, nofile=nofile)
    n = 100
    # one process holds 100 live rings (each alive: its writer holds the ring's lock)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from kvguard.engine_hooks.ring import RingWriter; "
            f"ws = [RingWriter({str(ring_dir)!r}, 4096, engine_id=1000 + i) for i in range({n})]; "
            "print('ready', flush=True); time.sleep(300)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    procs.append(holder)
    assert holder.stdout.readline().strip() == "ready"

    sidecar.wait_for(f"{cap} rings attached", lambda: counter(sidecar.metrics(), "kvguard_rings_attached") == cap, 10)
    sidecar.wait_for(
        "the rings it cannot attach counted",
        lambda: counter(sidecar.metrics(), "kvguard_ring_errors_total") == n + 1 - cap,
        10,
    )
    sidecar.reads_keep_being_checked(engine.pid)
    time.sleep(2.5)  # past two rescans: each waiting ring was counted once, not once per scan
    final = sidecar.metrics()
    assert counter(final, "kvguard_ring_errors_total") == n + 1 - cap
    assert counter(final, "kvguard_rings_attached") == cap
    text = sidecar.log_text()
    assert sum("not attaching ring" in ln for ln in text.splitlines()) == n + 1 - cap
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.timeout(60)
def test_thousands_of_junk_entries_are_refused_once_and_cost_no_cpu_afterwards(tmp_path, procs):
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    pid = sidecar.proc.pid

    def cpu_share(seconds: float) -> float:
        """The sidecar's CPU use over ``seconds``, as a share of one core, with the engine paused
        (its records would dominate, and vary with the machine's load)."""
        engine.send_signal(signal.SIGSTOP)
        try:
            time.sleep(0.5)  # what was published is drained
            t0, c0 = time.monotonic(), cpu_seconds(pid)
            time.sleep(seconds)
            return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
        finally:
            engine.send_signal(signal.SIGCONT)

    baseline = cpu_share(1.5)
    n = 5000
    for i in range(n):  # each whole when it appears: a file changed after its refusal is looked at (and counted) again
        (ring_dir / f"junk-{i}.tmp").write_bytes(b"not a ring")
        os.rename(ring_dir / f"junk-{i}.tmp", ring_dir / f"junk-{i}.ring")
    sidecar.wait_for(
        "every junk entry refused", lambda: counter(sidecar.metrics(), "kvguard_ring_errors_total") == n, 15
    )
    with_junk = cpu_share(2)
    sidecar.reads_keep_being_checked(engine.pid)
    assert counter(sidecar.metrics(), "kvguard_ring_errors_total") == n  # refused once each, never again
    assert sum("refusing ring" in ln for ln in sidecar.log_text().splitlines()) == n
    # before the fix every poll (100 a second) stat()ed every entry: 64% of a core for 5,000
    assert with_junk - baseline < 0.1, f"{with_junk:.0%} of a core with {n} junk entries, {baseline:.0%} without"


def test_an_unlimited_fd_limit_leaves_the_cap_at_max_rings(monkeypatch):
    import resource

    from kvguard.sidecar.ingest import RingSet

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert RingSet("/nonexistent", max_rings=1024).ring_cap == 1024  # RLIM_INFINITY is -1: not a cap of 1
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (256, 256))
    assert RingSet("/nonexistent", max_rings=1024).ring_cap == 128  # (256 - 128 reserved) / 1 per ring

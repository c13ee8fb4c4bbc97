"""Issue 14, item 1: an engine whose ring directory's filesystem is full must not die.

The shipped manifests put the ring directory on a memory emptyDir capped at 256Mi; the
undrained rings of restarted engines fill it. Rings used to be sized with ``ftruncate``
only, so the first store to a page tmpfs could not back killed the engine with SIGBUS
(returncode -7). The ring's space is now reserved up front (``posix_fallocate``); when it
cannot be, the engine gets no ring, one error line, a drop counter, and no-op probes.

Real processes on a real tmpfs (``mount -t tmpfs -o size=1m``): needs root / CAP_SYS_ADMIN,
skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "synthetic_engine.py"
RING_BYTES = 512 << 10  # 128 + 1 pages each: one ring fits in 1 MiB (256 pages), two do not


@pytest.fixture
def tiny_tmpfs(tmp_path):
    mnt = tmp_path / "rings"
    mnt.mkdir()
    try:
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0777", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount(8) for a 1 MiB tmpfs: {exc}")
    if res.returncode != 0:
        pytest.skip(
            f"mounting a 1 MiB tmpfs is not permitted here (needs root or CAP_SYS_ADMIN): "
            f"{res.stderr.strip() or res.returncode}"
        )
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def run_engine(ring_dir: Path, cycles: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, KVGUARD_RING_DIR=str(ring_dir), KVGUARD_RING_BYTES=str(RING_BYTES))
    env.pop("KVGUARD_DISABLE", None)
    return subprocess.run(
        [sys.executable, str(ENGINE), "fill", str(cycles)], env=env, capture_output=True, text=True, timeout=60
    )


def died_of(res: subprocess.CompletedProcess) -> str:
    if res.returncode < 0:
        return f"killed by {signal.Signals(-res.returncode).name} (returncode {res.returncode})"
    return f"exit {res.returncode}"


def test_an_engine_on_a_full_ring_volume_keeps_running_and_counts_its_drops(tiny_tmpfs):
    # the first engine's ring fits; it exits without removing it (an undrained ring of a
    # restarted engine: no sidecar runs here), and fills its whole ring (then drops, ring full)
    first = run_engine(tiny_tmpfs, 1200)
    assert first.returncode == 0, f"first engine: {died_of(first)}\n{first.stderr[-2000:]}"
    a = json.loads(first.stdout)
    assert a["ring"] and a["records_written"] > 0 and a["dropped_ring_full"] > 0, a
    assert os.path.getsize(a["ring"]) == 4096 + RING_BYTES

    # the restarted engine: 127 pages left, its ring needs 129. It must not be killed
    second = run_engine(tiny_tmpfs, 1200)
    assert second.returncode == 0, (
        f"the engine died on a full ring volume: {died_of(second)}\nstderr:\n{second.stderr[-2000:]}"
    )
    b = json.loads(second.stdout)
    assert b["ring"] is None, f"a ring was made on a volume without room for it: {b}"
    assert b["dropped_no_ring"] == b["probe_calls"] > 1000, b
    # one clear error line naming the directory, the size and the errno; not one per probe
    # call: after it only the running total now and then (at 1,000, then 1,000,000, ...)
    lines = second.stderr.splitlines()
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 1 and "cannot reserve" in errors[0], second.stderr[-3000:]
    assert str(tiny_tmpfs) in errors[0] and str(4096 + RING_BYTES) in errors[0], errors[0]
    assert errno.errorcode[errno.ENOSPC] in errors[0], errors[0]
    notes = [line for line in lines if "probe records dropped so far: no ring" in line]
    assert len(notes) == 1 and "1000 probe records" in notes[0], second.stderr[-3000:]
    # nothing left behind on the full volume: only the first engine's ring
    assert sorted(os.listdir(tiny_tmpfs)) == [os.path.basename(a["ring"])]

"""Issue 14, item 2: a ring truncated while the sidecar is attached must not kill it.

The real ``kvguard sidecar`` process watches two synthetic engines (the project's own
probes and ring writer). One ring is truncated under it, to 4 KiB (header intact, data
area gone) or to 0 (header gone). A read of a mapped page past the end of the file is
SIGBUS: the sidecar used to die at its next poll with nothing in its log. Now it checks
the file's size before touching the mapping, retires that ring with an error line and
``kvguard_ring_errors_total``, and keeps checking the healthy engine's reads.

The truncation is made deterministic: the sidecar is stopped (SIGSTOP) while the victim
writes a backlog, the victim is stopped (it still holds its ring, so it is alive to the
sidecar), the ring is truncated, and only then does the sidecar go on (SIGCONT).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import httpx
import pytest

from kvguard.engine_hooks.ring import _CONSUMER_NEXT_SEQ
from tests.sidecar.reliability.sidecar_under_test import (
    KVGUARD,
    checked_reads,
    counter,
    free_port,
    freeze,
    start_engine,
    stop_all,
    wait_for,
)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    stop_all(started)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [4096, 0], ids=["to-4KiB", "to-0"])
def test_the_sidecar_survives_a_ring_truncated_under_it(tmp_path, procs, size):
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir()
    healthy, _ = start_engine(ring_dir, procs)
    victim, victim_ring = start_engine(ring_dir, procs)
    port = free_port()
    log = tmp_path / "sidecar.log"
    with open(log, "w") as out:
        sidecar = subprocess.Popen(
            [str(KVGUARD), "sidecar", "--ring-dir", str(ring_dir), "--listen", f"127.0.0.1:{port}"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    procs.append(sidecar)
    url = f"http://127.0.0.1:{port}/metrics"

    def metrics() -> str:
        return httpx.get(url, timeout=2).text

    wait_for(
        "both engines' reads checked",
        lambda: all(checked_reads(m, p.pid) > 0 for m in [metrics()] for p in (healthy, victim)),
        20,
        sidecar,
        log,
    )

    freeze(sidecar)  # the victim writes a backlog the sidecar has not read
    time.sleep(0.3)
    freeze(victim)  # still holds its ring: alive to the sidecar
    os.truncate(victim_ring, size)
    sidecar.send_signal(signal.SIGCONT)

    first = wait_for("a scrape after the truncation", metrics, 10, sidecar, log)
    before = checked_reads(first, healthy.pid)
    wait_for(
        "the truncated ring to be retired and counted",
        lambda: counter(metrics(), "kvguard_ring_errors_total") >= 1,
        10,
        sidecar,
        log,
    )
    # the healthy engine's reads keep being checked
    wait_for(
        "the healthy engine's reads to keep being checked",
        lambda: checked_reads(metrics(), healthy.pid) > before + 50,
        10,
        sidecar,
        log,
    )
    text = log.read_text()
    line = next((ln for ln in text.splitlines() if victim_ring in ln and "truncated to" in ln), None)
    assert line is not None and "ERROR" in line, text[-3000:]
    # the size it saw: the cut one, or up to the end of the reader's own counters in the header
    # where the sidecar (frozen between its size check and its counter write, RingReader._set)
    # wrote one after the cut: the file grows back by that much, never more (CI saw 152 bytes)
    seen = int(re.search(r"truncated to (\d+) bytes", line).group(1))
    assert size <= seen <= max(size, (_CONSUMER_NEXT_SEQ + 1) * 8), line
    final = metrics()
    # refused once, not retried every scan: the file has not changed since
    assert counter(final, "kvguard_ring_errors_total") == 1 and counter(final, "kvguard_rings_attached") == 1
    assert sum("retiring ring" in ln for ln in text.splitlines()) == 1
    assert sidecar.poll() is None

"""Issue 14, item 4: no size a record or a ring header claims can make the sidecar's memory grow.

The real ``kvguard sidecar`` process watches a healthy synthetic engine while a hostile
ring appears beside it (made by this test, which holds the ring's liveness lock):

- one 40-byte ASSIGN placing a page at row position 2^26 (after a HELLO announcing a
  1,024-token context and pool, or before any HELLO): the sidecar grew that request's
  row to 2^26 entries, 512 MB retained (2^28 retained 2 GB). Now it is skipped and its
  page counted in ``kvguard_page_ids_out_of_range_total``;
- a ring header claiming a 2 GiB data area in a sparse file, fully published: the sidecar
  mapped it and copied the whole span in one read (4 GB peak). Now a capacity past 1 GiB
  is refused (a ring error);
- a 1 GiB ring (the largest allowed) whose whole data area is published garbage: it was
  copied at once (1 GB). Now a poll copies at most 8 MiB at a time: the garbage is
  counted in ``kvguard_ring_corrupt_bytes_total``.

Each time the sidecar's peak RSS (VmHWM) stays under 300 MB and the healthy engine's
reads keep being checked.
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import HEADER_BYTES, RING_MAGIC, RING_VERSION, RingWriter
from tests.sidecar.reliability.sidecar_under_test import counter, healthy_setup, stop_all, vm_hwm_mb

PEAK_MB = 300
ROW_START = 1 << 26  # 2^26 row entries of 8 bytes: 512 MB if the row were grown to reach it


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    stop_all(started)


def assign_far_out(ring_dir: Path, with_hello: bool) -> RingWriter:
    """A ring (held open by this process: a live engine to the sidecar) with one ASSIGN at ROW_START."""
    w = RingWriter(str(ring_dir), 4096, engine_id=0xBAD)
    if with_hello:  # page size 1, 1,024-token pool and context
        w.write_sticky(
            wire.Kind.HELLO,
            wire.hello_payload(
                wire.Hello(wire.Role.DECODE, 0, os.getpid(), 1, 1024, 1024, 1024, 1024, "hostile", "0", "m", "0")
            ),
        )
    payload = wire.assign_payload(wire.Assign(0x1234, ROW_START, ROW_START + 1, ROW_START, np.array([7], np.int32)))
    w.write(wire.Kind.ASSIGN, payload)
    return w


def sparse_ring(ring_dir: Path, capacity: int, published: int) -> int:
    """A ring file whose header claims ``capacity`` data bytes, ``published`` of them written
    (all zeros: a sparse file), appearing whole (renamed into place); returns the fd holding
    its liveness lock (the sidecar sees a live engine)."""
    path = ring_dir / f"kvguard-{os.getpid()}-{time.time_ns()}.ring"
    tmp = path.with_suffix(".init")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    os.ftruncate(fd, HEADER_BYTES + capacity)
    os.pwrite(
        fd,
        struct.pack(
            "<8sIIQIIQQ", RING_MAGIC, RING_VERSION, HEADER_BYTES, capacity, os.getpid(), 0xB16, time.time_ns(), 0
        ),
        0,
    )
    os.pwrite(fd, struct.pack("<QQ", published, published // 64), 64)  # write_pos, next_seq
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(tmp, path)
    return fd


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_hello", [True, False], ids=["after-hello", "before-any-hello"])
def test_an_assign_far_past_the_context_is_skipped_not_allocated(tmp_path, procs, with_hello):
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    pid = sidecar.proc.pid
    writer = assign_far_out(ring_dir, with_hello)
    try:
        sidecar.wait_for(
            "the ASSIGN to be applied (counted, or the row grown)",
            lambda: counter(sidecar.metrics(), "kvguard_page_ids_out_of_range_total") >= 1 or vm_hwm_mb(pid) > PEAK_MB,
            15,
        )
        sidecar.reads_keep_being_checked(engine.pid)
        peak = vm_hwm_mb(pid)
        print(f"sidecar peak RSS {peak:.0f} MB")
        assert peak < PEAK_MB, f"the sidecar's peak RSS reached {peak:.0f} MB from one ASSIGN"
        final = sidecar.metrics()
        assert counter(final, "kvguard_page_ids_out_of_range_total") == 1
        assert counter(final, "kvguard_apply_errors_total") == 0  # skipped, never an apply error
        lines = [ln for ln in sidecar.log_text().splitlines() if "ASSIGN" in ln and str(ROW_START) in ln]
        assert len(lines) == 1 and "WARNING" in lines[0], sidecar.log_text()[-3000:]
    finally:
        writer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [2 << 30, 1 << 30], ids=["header-claims-2GiB", "1GiB-all-published"])
def test_a_huge_ring_header_never_becomes_resident_memory(tmp_path, procs, capacity):
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    pid = sidecar.proc.pid
    fd = sparse_ring(ring_dir, capacity, published=capacity)
    try:
        if capacity > 1 << 30:  # more than a ring may have: refused before it is mapped
            sidecar.wait_for(
                "the ring refused (or copied)",
                lambda: counter(sidecar.metrics(), "kvguard_ring_errors_total") >= 1 or vm_hwm_mb(pid) > PEAK_MB,
                15,
            )
        else:  # a ring it reads: the published garbage is counted, 8 MiB at a time
            sidecar.wait_for(
                "the garbage counted",
                lambda: (
                    counter(sidecar.metrics(), "kvguard_ring_corrupt_bytes_total") >= capacity
                    or vm_hwm_mb(pid) > PEAK_MB
                ),
                15,
            )
        sidecar.reads_keep_being_checked(engine.pid)
        peak = vm_hwm_mb(pid)
        print(f"sidecar peak RSS {peak:.0f} MB")
        assert peak < PEAK_MB, f"the sidecar's peak RSS reached {peak:.0f} MB from one ring header"
        final = sidecar.metrics()
        if capacity > 1 << 30:
            assert counter(final, "kvguard_ring_errors_total") == 1
            assert counter(final, "kvguard_rings_attached") == 1
            assert any("refusing ring" in ln and "capacity" in ln for ln in sidecar.log_text().splitlines())
        else:
            assert counter(final, "kvguard_ring_corrupt_bytes_total") == capacity  # at most one ring's worth
            assert counter(final, "kvguard_rings_attached") == 2
    finally:
        os.close(fd)


def test_a_backlog_larger_than_one_copy_is_read_whole_records_at_a_time(tmp_path):
    """The bounded copy (8 MiB at a time) never cuts a record: a 32 MiB ring holding 12 MiB of
    small records and one 10 MB record reads back every record, in order, with nothing corrupt."""
    from kvguard.engine_hooks.ring import READ_CHUNK_BYTES, RingReader

    w = RingWriter(str(tmp_path), 32 << 20, engine_id=7)
    small = np.arange(1000, dtype=np.int64)
    sizes = []
    for i in range(3000):  # ~4 KB each
        sizes.append(1000)
        assert w.write(wire.Kind.ALLOC, wire.pages_payload(small + i))
        if i == 1500:
            big = np.arange(2_500_000, dtype=np.int64)  # one record longer than a copy
            assert len(wire.pages_payload(big)) > READ_CHUNK_BYTES
            sizes.append(len(big))
            assert w.write(wire.Kind.ALLOC, wire.pages_payload(big))
    r = RingReader(w.path)
    got = []
    while r.backlog_bytes:
        got += [rec for rec in r.poll(max_bytes=64 << 20).records]
    assert [len(rec.body.pages) for rec in got] == sizes
    assert [rec.seq for rec in got] == list(range(len(sizes)))
    assert r.stats.corrupt_bytes == 0 and r.stats.bad_payload == 0 and r.records_lost == 0
    r.close()
    w.close(unlink=True)

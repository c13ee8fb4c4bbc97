"""The ring: wrap-around, a full ring, torn writes, a producer dying mid-record, bad files."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import HEADER_BYTES, RingError, RingReader, RingWriter

ROOT = Path(__file__).resolve().parents[2]  # the repository


def _alloc(n):
    return wire.pages_payload(np.arange(n))


def test_records_come_out_in_order(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    for i in range(5):
        assert w.write(wire.Kind.ALLOC, _alloc(i + 1))
    r = RingReader(w.path)
    res = r.poll()
    assert [len(x.body.pages) for x in res.records] == [1, 2, 3, 4, 5]
    assert [x.seq for x in res.records] == [0, 1, 2, 3, 4] and res.lost == 0


def test_a_new_reader_resumes_where_the_last_poll_left_and_sees_a_later_gap(tmp_path):
    """The read position and the next expected sequence are stored together after each poll:
    the next consumer (a restarted sidecar) starts there, and a record dropped after it
    shows as a gap of exactly one."""
    w = RingWriter(str(tmp_path), 4096)
    for i in range(3):
        assert w.write(wire.Kind.ALLOC, _alloc(i + 1))
    first = RingReader(w.path)
    assert [x.seq for x in first.poll().records] == [0, 1, 2]
    assert first.last_backlog == 0
    assert first.poll().records == []  # nothing new: nothing copied, nothing stored
    first.close()
    w._seq += 1  # as a dropped record does: its sequence number is used, its bytes never land
    assert w.write(wire.Kind.ALLOC, _alloc(4))
    second = RingReader(w.path)
    assert second.resumed and second.read_pos > 0
    res = second.poll()
    assert [x.kind for x in res.records] == [wire.Kind.LOST, wire.Kind.ALLOC] and res.lost == 1
    assert res.records[1].seq == 4


def test_wrap_around_many_times_loses_nothing(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    r = RingReader(w.path)
    seen = []
    for i in range(2000):  # ~100 bytes each: the 4 KiB ring wraps ~50 times
        assert w.write(wire.Kind.ALLOC, _alloc(1 + i % 30))
        if i % 7 == 0:
            seen += r.poll().records
    seen += r.poll().records
    assert [x.seq for x in seen] == list(range(2000))
    assert [len(x.body.pages) for x in seen] == [1 + i % 30 for i in range(2000)]
    assert r.records_lost == 0 and r.stats.corrupt_bytes == 0


def test_a_batch_write_is_records_in_order_wrapping_and_dropping_like_single_writes(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    r = RingReader(w.path)
    seen = []
    for i in range(300):  # batches of 1-5 records of ~80 bytes: wraps the 4 KiB ring several times
        assert w.write_batch(wire.Kind.ALLOC, [_alloc(1 + (i + k) % 10) for k in range(1 + i % 5)]) == 1 + i % 5
        seen += r.poll().records
    assert [x.seq for x in seen] == list(range(len(seen))) and len(seen) == sum(1 + i % 5 for i in range(300))
    assert r.records_lost == 0 and r.stats.corrupt_bytes == 0
    # no reader: a batch larger than the room left keeps what fits and counts the rest as dropped
    full = RingWriter(str(tmp_path / "full"), 4096)
    kept = full.write_batch(wire.Kind.ALLOC, [_alloc(20)] * 100)
    assert 0 < kept < 100 and full.dropped_records == 100 - kept
    assert len(RingReader(full.path).poll().records) == kept


def test_full_ring_drops_counts_and_never_blocks(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    results = [w.write(wire.Kind.ALLOC, _alloc(20)) for _ in range(100)]  # 120-byte records, no reader
    kept = results.count(True)
    assert 0 < kept < 100 and w.dropped_records == 100 - kept
    r = RingReader(w.path)
    res = r.poll()
    assert len(res.records) == kept
    # the drops come after the kept records: the next published record reveals the gap
    assert w.write(wire.Kind.FREE, _alloc(1))
    res = r.poll()
    assert res.lost == 100 - kept
    assert res.records[0].kind == wire.Kind.LOST and res.records[0].body == 100 - kept
    assert res.records[1].kind == wire.Kind.FREE


def test_a_record_is_invisible_until_write_pos_moves(tmp_path):
    """A torn write: bytes copied but write_pos not yet published are never read."""
    w = RingWriter(str(tmp_path), 4096)
    w.write(wire.Kind.ALLOC, _alloc(1))
    r = RingReader(w.path)
    assert len(r.poll().records) == 1
    rec = wire.encode(wire.Kind.ALLOC, 1, 0, w.engine_id, _alloc(2))
    w._mm[HEADER_BYTES + w._write_pos : HEADER_BYTES + w._write_pos + len(rec) // 2] = rec[: len(rec) // 2]
    assert r.poll().records == []
    w._seq = 1
    assert w.write(wire.Kind.ALLOC, _alloc(3))  # the next real record overwrites the torn bytes
    (got,) = r.poll().records
    assert len(got.body.pages) == 3


def test_producer_dying_mid_record_leaves_no_half_record(tmp_path):
    code = f"""
import os, numpy as np
from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import RingWriter
w = RingWriter({str(tmp_path)!r}, 4096)
w.write(wire.Kind.ALLOC, wire.pages_payload(np.arange(3)))
rec = wire.encode(wire.Kind.ALLOC, 1, 0, w.engine_id, wire.pages_payload(np.arange(9)))
w._mm[4096 + w._write_pos: 4096 + w._write_pos + 20] = rec[:20]   # die half way through the copy
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    (path,) = tmp_path.glob("*.ring")
    r = RingReader(str(path))
    assert not r.producer_alive()
    res = r.poll()
    assert [len(x.body.pages) for x in res.records] == [3]
    assert r.stats.corrupt_bytes == 0 and r.backlog_bytes == 0


def test_corrupt_data_is_counted_and_reading_resumes_after_it(tmp_path):
    w = RingWriter(str(tmp_path), 4096)
    w.write(wire.Kind.ALLOC, _alloc(1))
    w._mm[HEADER_BYTES : HEADER_BYTES + 8] = b"\xff" * 8  # scribble over the first record's header
    r = RingReader(w.path)
    assert r.poll().records == [] and r.stats.corrupt_bytes > 0
    w.write(wire.Kind.FREE, _alloc(2))
    res = r.poll()
    # the scribbled record is gone: the reader marks the gap so state resyncs there
    assert [x.kind for x in res.records] == [wire.Kind.LOST, wire.Kind.FREE]


def test_bad_ring_files_are_refused_with_the_reason(tmp_path):
    junk = tmp_path / "kvguard-1-1.ring"
    junk.write_bytes(b"x" * 10)
    with pytest.raises(RingError, match="shorter than a ring header"):
        RingReader(str(junk))
    junk.write_bytes(b"NOTARING" + b"\0" * 8192)
    with pytest.raises(RingError, match="bad magic"):
        RingReader(str(junk))
    w = RingWriter(str(tmp_path), 4096)
    with open(w.path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 2))
    with pytest.raises(RingError, match="layout version 2.*upgrade the sidecar"):
        RingReader(w.path)


def test_capacity_must_be_a_power_of_two(tmp_path):
    with pytest.raises(ValueError, match="KVGUARD_RING_BYTES.*5000"):
        RingWriter(str(tmp_path), 5000)


def test_a_ring_cut_right_after_the_readers_size_check_is_an_error_not_sigbus(tmp_path):
    """The size check and the access cannot be atomic (a thread may be stopped between them,
    as the truncation test once caught): the reader must not fault even then. It maps
    nothing, so a read past the new end returns short and becomes RingTruncated. Run in a
    child process: a SIGBUS there kills only the child, and the test reads its exit."""
    code = f"""
import os, numpy as np
from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import RingReader, RingTruncated, RingWriter
w = RingWriter({str(tmp_path)!r}, 4096)
w.write(wire.Kind.ALLOC, wire.pages_payload(np.arange(3)))
r = RingReader(w.path)
r._check = lambda: None  # as if each check ran just before the file was cut
os.truncate(w.path, 0)
outcomes = []
for what in ("backlog_bytes", "writing_since_ns", "dropped_records", "poll"):
    try:
        getattr(r, what)() if what == "poll" else getattr(r, what)
        outcomes.append(what + ": read")
    except RingTruncated:
        outcomes.append(what + ": truncated")
r.close()
print(";".join(outcomes))
"""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"the reader died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.strip().split(";") == [
        "backlog_bytes: truncated",
        "writing_since_ns: truncated",
        "dropped_records: truncated",
        "poll: truncated",
    ]

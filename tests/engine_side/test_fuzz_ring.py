"""Fuzzing the ring reader (issue 14): a ring file whose header fields and data area are
arbitrary never makes ``RingReader`` raise anything but ``RingError``, copy more than it
may, apply a record of another engine, or loop without progress.

The corpus is built by the project's own ``RingWriter`` (deterministic, no binary files
committed): an empty ring, a ring holding every record kind, a ring that wrapped around
its end (PAD at the tail), one with a sequence gap (records dropped while full), one a
previous consumer left half-read, one with a sticky HELLO, and one with a record stamped
with another engine's id. Hypothesis picks a corpus ring and mutates it: header fields
(positions, sequence numbers, capacity, version, magic, sticky length) set to arbitrary or
edge values, and bit flips, byte runs and copied spans in the data area. Bounded for CI
(``max_examples``, no deadline, no example database, derandomized).

File truncation under the reader is not fuzzed here: a SIGBUS would kill the test process
itself; tests/sidecar/reliability/test_ring_truncated.py runs it against a sidecar process.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import HEADER_BYTES, READ_CHUNK_BYTES, RingError, RingReader, RingWriter

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CAPACITY = 8192
SCRATCH = tempfile.mkdtemp(prefix="kvguard-ring-fuzz-")
# u64 header words and the fields they hold (engine_hooks/ring.py)
FIELDS = {"write_pos": 8, "next_seq": 9, "dropped_records": 10, "read_pos": 16, "consumer_next_seq": 18}


def _requests(p: Probes, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        slots = np.arange((i % 30) * 4, (i % 30) * 4 + 8)
        p.request_begin(f"r-{i}", "acme", None, 8, 0, False)
        p.pages_allocated(slots)
        p.rows_assigned(f"r-{i}", 0, 8, 0, slots)
        p.forward([f"r-{i}"], [8], [slots], [slots])
        p.request_end(f"r-{i}", "stop", 1000, 2000, 1, "")
        p.pages_freed(slots)


def _ring(name: str, build) -> bytes:
    d = os.path.join(SCRATCH, "corpus-" + name)
    os.makedirs(d, exist_ok=True)
    w = RingWriter(d, CAPACITY, engine_id=77)
    build(w)
    data = open(w.path, "rb").read()
    w.close(unlink=True)
    return data


def _hello(w: RingWriter) -> Probes:
    p = Probes(w, page_size=4)
    p.hello("decode", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "m")
    return p


def _half_read(w: RingWriter) -> None:
    _requests(_hello(w), 6)
    r = RingReader(w.path)
    r.poll(max_bytes=600)  # a consumer that stopped part way: read_pos and consumer_next_seq set
    r.close()


def _foreign(w: RingWriter) -> None:
    _requests(_hello(w), 2)
    own, w.engine_id = w.engine_id, 78
    w.write(wire.Kind.FREE, wire.pages_payload(np.arange(8, dtype=np.int64), wire.FreeKind.PAGE_IDS))
    w.engine_id = own


def _gap(w: RingWriter) -> None:
    p = _hello(w)
    _requests(p, 40)  # more than 8 KiB: the writer drops what does not fit, seq numbers jump
    r = RingReader(w.path)
    while r.backlog_bytes:
        r.poll()
    r.close()
    _requests(p, 3, first=40)


CORPUS = {
    "empty": _ring("empty", lambda w: None),
    "requests": _ring("requests", lambda w: _requests(_hello(w), 3)),
    "wrapped": _ring("wrapped", lambda w: (_gap(w), _requests(Probes(w, page_size=4), 5, first=50))),
    "gap": _ring("gap", _gap),
    "half-read": _ring("half-read", _half_read),
    "foreign-record": _ring("foreign", _foreign),
}
NAMES = sorted(CORPUS)

edge_u64 = st.one_of(
    st.sampled_from(
        [0, 1, 7, 8, CAPACITY - 1, CAPACITY, CAPACITY + 8, 2 * CAPACITY, 1 << 31, (1 << 63), (1 << 64) - 1]
    ),
    st.integers(0, (1 << 64) - 1),
)
header_edit = st.one_of(
    st.tuples(st.just("field"), st.sampled_from(sorted(FIELDS)), edge_u64),
    st.tuples(
        st.just("capacity"), st.sampled_from([0, 4096, CAPACITY // 2, CAPACITY * 2, (1 << 31), 12345]), st.just(0)
    ),
    st.tuples(st.just("version"), st.integers(0, 3), st.just(0)),
    st.tuples(st.just("magic"), st.binary(min_size=8, max_size=8), st.just(0)),
    st.tuples(st.just("sticky_len"), st.sampled_from([0, 1, 31, 32, 200, 3576, 3577, 1 << 31]), st.just(0)),
)
data_edit = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, CAPACITY * 8 - 1), st.just(b"")),
    st.tuples(st.just("bytes"), st.integers(0, CAPACITY - 1), st.binary(min_size=1, max_size=64)),
    st.tuples(
        st.just("copy"),
        st.integers(0, CAPACITY - 1),
        st.integers(0, CAPACITY - 1).map(lambda v: v.to_bytes(2, "little")),
    ),
)


def mutate(raw: bytes, header_edits, data_edits) -> bytearray:
    buf = bytearray(raw)
    for what, a, b in header_edits:
        if what == "field":
            struct.pack_into("<Q", buf, FIELDS[a] * 8, b)
        elif what == "capacity":
            struct.pack_into("<Q", buf, 16, a)
        elif what == "version":
            struct.pack_into("<I", buf, 8, a)
        elif what == "magic":
            buf[0:8] = a
        else:
            struct.pack_into("<I", buf, 512, a)
    for what, a, b in data_edits:
        if what == "flip":
            buf[HEADER_BYTES + a // 8] ^= 1 << (a % 8)
        elif what == "bytes":
            end = min(HEADER_BYTES + a + len(b), len(buf))
            buf[HEADER_BYTES + a : end] = b[: end - HEADER_BYTES - a]
        else:  # a span of the data area copied over another (a stale record where a new one was)
            src = int.from_bytes(b, "little") % CAPACITY
            n = min(256, CAPACITY - max(a, src))
            buf[HEADER_BYTES + a : HEADER_BYTES + a + n] = buf[HEADER_BYTES + src : HEADER_BYTES + src + n]
    return buf


@SETTINGS
@given(
    name=st.sampled_from(NAMES),
    header_edits=st.lists(header_edit, max_size=3),
    data_edits=st.lists(data_edit, max_size=4),
    max_bytes=st.sampled_from([64, 600, 4096, 8 << 20]),
)
@example(name="requests", header_edits=[], data_edits=[], max_bytes=8 << 20)
@example(name="foreign-record", header_edits=[], data_edits=[], max_bytes=8 << 20)
@example(name="requests", header_edits=[("field", "write_pos", (1 << 64) - 1)], data_edits=[], max_bytes=4096)
@example(name="half-read", header_edits=[("field", "read_pos", CAPACITY * 3 + 5)], data_edits=[], max_bytes=600)
@example(name="wrapped", header_edits=[("sticky_len", 3577, 0)], data_edits=[("flip", 5, b"")], max_bytes=64)
def test_a_mutated_ring_is_read_or_refused_never_crashes(name, header_edits, data_edits, max_bytes):
    d = tempfile.mkdtemp(dir=SCRATCH)
    path = os.path.join(d, "fuzz.ring")
    with open(path, "wb") as f:
        f.write(mutate(CORPUS[name], header_edits, data_edits))
    try:
        try:
            reader = RingReader(path)
        except RingError:
            return  # refused with a reason: fine
        try:
            sticky = reader.sticky_records()
            assert all(r.engine_id == reader.engine_id for r in sticky)
            for _ in range(64):  # a bounded number of polls drains (or resynchronises) the ring
                before, corrupt = reader.read_pos, reader.stats.corrupt_bytes
                backlog = reader.backlog_bytes
                result = reader.poll(max_bytes=max_bytes)
                # never applies another engine's record; LOST markers are the reader's own
                assert all(r.engine_id == reader.engine_id for r in result.records)
                assert all(isinstance(r.kind, wire.Kind) for r in result.records)
                if not 0 <= backlog <= CAPACITY:  # positions that cannot both be right: resynchronised,
                    assert result.records == [] and reader.backlog_bytes == 0  # counted, nothing read
                    assert reader.stats.corrupt_bytes - corrupt <= CAPACITY
                    continue
                # progress or nothing to read; never more than a poll may copy (one record past it)
                assert reader.read_pos >= before
                assert reader.read_pos - before <= max(max_bytes, READ_CHUNK_BYTES) + wire.MAX_RECORD_BYTES
                assert reader.stats.corrupt_bytes <= 64 * CAPACITY
                if backlog == 0 and reader.backlog_bytes == 0:
                    break
            assert reader.backlog_bytes == 0
        except RingError:
            pass  # e.g. refused mid-way: a clean error, the caller retires the ring
        finally:
            reader.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_corpus_reads_back_clean():
    """The unmutated corpus is what the writer wrote: every ring decodes without a counted problem
    (the foreign record is skipped and counted, the gap is a LOST marker)."""
    for name in NAMES:
        d = tempfile.mkdtemp(dir=SCRATCH)
        path = os.path.join(d, "corpus.ring")
        with open(path, "wb") as f:
            f.write(CORPUS[name])
        r = RingReader(path)
        while r.backlog_bytes:
            r.poll()
        assert r.stats.corrupt_bytes == 0 and r.stats.bad_payload == 0, name
        assert r.stats.foreign_engine == (1 if name == "foreign-record" else 0), name
        r.close()

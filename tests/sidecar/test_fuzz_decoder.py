"""Fuzzing the decoders: wire.decode_stream, recorded chunks, and the replay path.

Properties (hypothesis; fast and deterministic enough for CI: no example database,
no deadline, bounded example counts):

* ``wire.decode_stream`` never raises, on arbitrary bytes or on records with valid
  headers and arbitrary payloads of every kind, and it accounts for every byte: each
  structurally valid record is decoded or counted (unknown kind, bad version, bad
  payload), and what follows the first invalid header is counted as corrupt bytes.
* Mutated valid streams (bit flips, truncation, splicing): the good records before
  the damage decode exactly as before it; a flip inside a payload costs at most that
  one record.
* Recorded chunks with arbitrary records inside a valid checksum: ``decode_chunk``
  never raises and counts every bad record.
* Mutated segment files (bit flips, truncation, splicing, inserted and duplicated
  bytes) replay without crashing: a damaged header is a clean ``RecordingError``, and
  otherwise every chunk before the damage is replayed and the damage is counted;
  ``kvguard replay`` exits 0 or 1, never with a traceback.

The replay fuzz mutates whole files, so chunk checksums keep mutated records out of
the pipeline; the crafted-chunk fuzz stops at the decoder. That is deliberate: the
tracker grows its page arrays to the largest page id a record names, so one corrupt
page id near 2**31 costs gigabytes (reported to the lead; not a decoder property).
"""

import os
import struct
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.tier1 import Violation
from kvguard.sidecar import recorder as rmod
from kvguard.sidecar.cli import main
from kvguard.sidecar.recorder import RecordingError, RecordingWriter, SegmentReader, decode_chunk, encode_record
from kvguard.sidecar.replay import Replay

FAST = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FEW = settings(FAST, max_examples=40)
SCRATCH = tempfile.mkdtemp(prefix="kvguard-fuzz-")  # one directory for every example's files


class Capture:
    """A RingWriter stand-in that keeps (kind, payload) pairs."""

    def __init__(self):
        self.records = []
        self.records_written = self.dropped_records = 0

    def write(self, kind, payload, pool=0, flags=0):
        self.records.append((wire.Kind(kind), bytes(payload)))
        self.records_written += 1
        return True

    def write_sticky(self, kind, payload, pool=0, append=False):  # RingWriter's: a copy kept (not here)
        return self.write(kind, payload, pool)


def _corpus():
    p = Probes(Capture())
    s = lambda pages: np.concatenate([np.arange(q * 4, q * 4 + 4) for q in pages])
    p.hello("decode", 1, 4, 64, 256, 512, 512, "sglang", "0.5.23", "tiny")
    p.request_begin("r-1", "acme", 42, 16, 4, False, extra_key="lora-a", cache_salt="s")
    p.request_begin("warm", "", None, 2, 0, True)
    p.pages_allocated(s([1, 2, 3]))
    p.rows_assigned("r-1", 0, 12, 4, s([1, 2, 3]))
    p.transfer_reserved("r-1", 42, 12, s([1, 2, 3]))
    p.transfer_sent("r-1", 42, 0, 12, [7, 8, 9], True, digest=0xDEADBEEF)
    p.transfer_digest("r-1", 42, "receiver", 0xFEEDFACE, 0, 12, 2, 0, 4, 4)
    p.transfer_done("r-1", 42, "receiver", "success")
    p.forward(["r-1"], [13], [s([4])[:1]], [s([1, 2, 3, 4])[:13]])
    p.forward(["r-1", "warm"], [14, 3], [[17], []])
    p.content_changed(s([2])[:2])
    p.kv_stored("r-1", 0xABC, s([1, 2]), digest=7, unit="slots")
    p.kv_loaded(None, 0xABC, [5, 6], "issued")
    p.rejected("r-1", "decode", "out of memory \u2603")
    p.guard_acted("r-1", 42, "rejected_send", "observed", prompt_tokens=16, send_tokens=1, reserved_pages=0, reason="")
    p.request_end("r-1", "length", 1000, 2000, 3, "done")
    p.pages_freed(s([1, 2]), "group")
    p.pages_freed([3], "page_ids")
    p.report_probe_error("forward", RuntimeError("x"))
    p._tier1_violation(Violation("r-1", 13, [4, 2], [3, 1], ["warm", None], [3, 1]), 2)
    p.engine_part(4242, "worker", 0, 4)
    p.kv_digest(None, 0xABC, 0xFEED, "loaded")
    p.coverage(
        [
            wire.CoverageItem("kv_pool", wire.CoverageStatus.WATCHED, 3, 0, "MHATokenToKVPool bf16"),
            wire.CoverageItem("draft", wire.CoverageStatus.UNWATCHED, 0, 1, "EAGLE draft worker: not hooked"),
        ]
    )
    p.pool_declared(1, 4, 64, "sliding_window", "swa", window_tokens=128)
    p.page_identity("r-1", 0, "hit", [1, 2**64 - 1])
    return p.writer.records


CORPUS = _corpus()
assert {k for k, _ in CORPUS} == set(wire.Kind) - {wire.Kind.PAD, wire.Kind.LOST}


def build_stream(picks):
    """Valid records (unique seq each): the bytes and each record's start offset."""
    parts, starts, pos = [], [], 0
    for seq, (index, engine) in enumerate(picks):
        kind, payload = CORPUS[index]
        raw = wire.encode(kind, seq, 1000 + seq, engine, payload)
        parts.append(raw)
        starts.append(pos)
        pos += len(raw)
    return b"".join(parts), starts


def account(buf):
    """Independent walk: (record slots with a valid header, PAD slots, bytes after the first invalid header)."""
    view, pos, slots, pads = memoryview(buf), 0, 0, 0
    while pos < len(buf):
        head = wire.read_header(view, pos, len(buf))
        if head is None:
            return slots, pads, len(buf) - pos
        if head[1] == wire.VERSION and head[2] == wire.Kind.PAD:
            pads += 1
        else:
            slots += 1
        pos += head[3]
    return slots, pads, 0


def decode_checked(buf):
    stats = wire.DecodeStats()
    out = wire.decode_stream(buf, stats)
    slots, _pads, corrupt = account(buf)
    assert all(isinstance(r, wire.Record) for r in out) and stats.records == len(out)
    assert stats.records + stats.unknown_kind + stats.bad_version + stats.bad_payload == slots
    assert stats.corrupt_bytes == corrupt
    return out, stats


def by_seq(records):
    return {r.seq: encode_record(r) for r in records}


picks = st.lists(st.tuples(st.integers(0, len(CORPUS) - 1), st.integers(0, 3)), min_size=1, max_size=25)


# --------------------------------------------------------------------------- wire.decode_stream
@FAST
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_never_raise_and_are_accounted_for(data):
    decode_checked(data)


@st.composite
def headed_garbage(draw):
    """Records whose headers are structurally valid but whose kind, version and payload are anything."""
    parts = []
    for _ in range(draw(st.integers(1, 12))):
        payload = draw(st.binary(max_size=160))
        if draw(st.booleans()):  # a real layout's fixed part, randomised: reaches deeper into decoders
            kind = draw(st.sampled_from(sorted(set(wire.Kind) - {wire.Kind.PAD, wire.Kind.LOST})))
            template = next(p for k, p in CORPUS if k == kind)
            cut = draw(st.integers(0, len(template)))
            payload = template[:cut] + payload[: len(template) - cut] if draw(st.booleans()) else payload
        else:
            kind = draw(st.integers(0, 255))
        version = draw(st.sampled_from([wire.VERSION, wire.VERSION, wire.VERSION, 0, 2, 255]))
        length = wire.HEADER_SIZE + len(payload)
        padded = (length + 7) & ~7
        parts.append(
            wire.HEADER.pack(
                wire.MAGIC,
                version,
                kind,
                padded,
                draw(st.integers(0, 2**64 - 1)),
                draw(st.integers(0, 2**64 - 1)),
                draw(st.integers(0, 2**32 - 1)),
                draw(st.integers(0, 2**16 - 1)),
                draw(st.integers(0, 2**16 - 1)),
            )
            + payload
            + b"\0" * (padded - length)
        )
    return b"".join(parts), len(parts)


@FAST
@given(headed_garbage())
def test_any_payload_of_any_kind_is_decoded_or_counted_never_raised(case):
    data, n = case
    out, stats = decode_checked(data)
    slots, pads, corrupt = account(data)
    assert corrupt == 0 and slots + pads == n


@FAST
@given(picks, st.data())
def test_a_bit_flip_costs_at_most_the_record_it_hits(picks_, data):
    buf, starts = build_stream(picks_)
    original = by_seq(wire.decode_stream(buf, wire.DecodeStats()))
    assert len(original) == len(picks_)
    bit = data.draw(st.integers(0, len(buf) * 8 - 1))
    mutated = bytearray(buf)
    mutated[bit // 8] ^= 1 << (bit % 8)
    out, stats = decode_checked(bytes(mutated))
    hit = max(i for i, s in enumerate(starts) if s <= bit // 8)
    got = [encode_record(r) for r in out]
    assert got[:hit] == [original[i] for i in range(hit)]  # everything before the damage, unchanged
    if bit // 8 - starts[hit] >= wire.HEADER_SIZE:  # in a payload: boundaries hold, only that record may differ
        assert stats.corrupt_bytes == 0
        others = {r.seq: encode_record(r) for r in out if r.seq != hit}
        assert others == {s: b for s, b in original.items() if s != hit}


@FAST
@given(picks, st.data())
def test_truncation_keeps_every_whole_record_before_the_cut(picks_, data):
    buf, starts = build_stream(picks_)
    original = by_seq(wire.decode_stream(buf, wire.DecodeStats()))
    cut = data.draw(st.integers(0, len(buf)))
    out, stats = decode_checked(buf[:cut])
    whole = [i for i, s in enumerate(starts) if s + len(original[i]) <= cut]
    assert [encode_record(r) for r in out] == [original[i] for i in whole]
    last_end = starts[whole[-1]] + len(original[whole[-1]]) if whole else 0
    assert stats.corrupt_bytes == cut - last_end


@FAST
@given(picks, picks, st.data())
def test_splicing_keeps_the_first_streams_records(a, b, data):
    buf_a, starts_a = build_stream(a)
    buf_b, _ = build_stream(b)
    keep = data.draw(st.integers(0, len(a)))
    boundary = starts_a[keep] if keep < len(a) else len(buf_a)
    tail = data.draw(st.integers(0, len(buf_b)))
    out, _stats = decode_checked(buf_a[:boundary] + buf_b[tail:])
    original = by_seq(wire.decode_stream(buf_a, wire.DecodeStats()))
    assert [encode_record(r) for r in out[:keep]] == [original[i] for i in range(keep)]


# --------------------------------------------------------------------------- recorded chunks
@FAST
@given(
    headed_garbage(), st.lists(st.tuples(st.sampled_from([14, 0xF0, 0xF1, 0xF2]), st.binary(max_size=24)), max_size=4)
)
def test_any_records_inside_a_valid_chunk_are_decoded_or_counted(case, extra):
    data, _ = case
    for kind, payload in extra:  # recording-only kinds, with right and wrong sizes
        data += wire.encode(kind, 1, 2, 3, payload)
    stats = wire.DecodeStats()
    out = decode_chunk(data, stats)
    slots, _pads, corrupt = account(data)
    assert stats.records == len(out)
    assert stats.records + stats.unknown_kind + stats.bad_version + stats.bad_payload == slots
    assert stats.corrupt_bytes == corrupt
    path = os.path.join(SCRATCH, "s.kvgrec")  # the same through a segment file and the reader
    RecordingWriter(path, overwrite=True).close()
    with open(path, "ab") as f:
        f.write(rmod._chunk(data, slots))
    with SegmentReader(path) as r:
        assert len(list(r)) == len(out) and r.stats.corrupt_chunks == 0


# --------------------------------------------------------------------------- the replay path
def _segment_bytes():
    """A real segment: probes through a RecordingWriter, several chunks, LOST markers, sidecar events."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seg.kvgrec")
        clock = iter(range(10**9, 10**12, 1000))
        with RecordingWriter(path, clock_ns=lambda: next(clock)) as rec:
            for e in (1, 2):
                w = rec.engine(e)
                for kind, payload in CORPUS:
                    w.write(kind, payload)
                    if kind == wire.Kind.FORWARD:
                        rec.flush()  # end the chunk here: several chunks per segment
                w.drop(2)
                rec.record_tick(next(clock))
                rec.record_engine_gone(e, next(clock))
                rec.flush()
        with open(path, "rb") as f:
            raw = f.read()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seg.kvgrec")
        with open(path, "wb") as f:
            f.write(raw)
        with SegmentReader(path) as r:
            ends, pos, counts = [], r.header.header_size, []
            for _flags, chunk in r.chunks():
                pos += rmod.CHUNK_HEADER_SIZE + len(chunk)
                ends.append(pos)
                counts.append(len(decode_chunk(chunk, wire.DecodeStats())))
    return raw, ends, counts


SEGMENT, CHUNK_ENDS, CHUNK_RECORDS = _segment_bytes()
assert len(CHUNK_ENDS) >= 6


@st.composite
def mutated_segment(draw):
    raw = bytearray(SEGMENT)
    how = draw(st.sampled_from(["flip", "flips", "truncate", "splice", "insert", "duplicate"]))
    first = None  # the first byte offset that differs from the original
    if how in ("flip", "flips"):
        for _ in range(1 if how == "flip" else draw(st.integers(2, 6))):
            at = draw(st.integers(0, len(raw) - 1))
            raw[at] ^= 1 << draw(st.integers(0, 7))
            first = at if first is None else min(first, at)
    elif how == "truncate":
        first = draw(st.integers(0, len(raw)))
        del raw[first:]
    elif how == "splice":
        first = draw(st.integers(0, len(raw)))
        raw = raw[:first] + SEGMENT[draw(st.integers(0, len(SEGMENT))) :]
    elif how == "insert":
        first = draw(st.integers(0, len(raw)))
        raw[first:first] = draw(st.binary(min_size=1, max_size=64))
    else:
        a = draw(st.integers(0, len(raw) - 1))
        b = draw(st.integers(a, min(len(raw), a + 512)))
        first = draw(st.integers(0, len(raw)))
        raw[first:first] = SEGMENT[a:b]
    return bytes(raw), first


@FAST
@given(mutated_segment())
def test_a_mutated_segment_replays_what_it_can_and_never_crashes(case):
    raw, first = case
    path = os.path.join(SCRATCH, "m.kvgrec")
    with open(path, "wb") as f:
        f.write(raw)
    run = Replay()
    try:
        run.run([path])
    except RecordingError:
        assert first is not None and first < rmod.SEGMENT_HEADER_SIZE  # only a damaged header refuses
        return
    s = run.summary()
    intact = sum(n for end, n in zip(CHUNK_ENDS, CHUNK_RECORDS) if first is None or end <= first)
    assert s["records"] + s["sidecar_events"] >= intact  # every chunk before the damage was replayed
    assert s["apply_errors"] == 0  # checksums kept damaged records out of the pipeline
    if len(raw) < len(SEGMENT):  # something is missing: the replay must say so or show it
        assert s["corrupt_chunks"] or s["truncated_bytes"] or s["records"] + s["sidecar_events"] < sum(CHUNK_RECORDS)


@FEW
@given(mutated_segment(), st.booleans())
def test_the_replay_command_exits_0_1_or_3_and_never_raises(case, as_json):
    raw, _ = case
    path = os.path.join(SCRATCH, "c.kvgrec")
    with open(path, "wb") as f:
        f.write(raw)
    # 3: it ran, and the garbage held a PROBE_ERROR record or made the pipeline raise
    assert main(["replay", path] + (["--json"] if as_json else [])) in (0, 1, 3)


def test_the_fuzzed_segment_itself_replays_cleanly():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "seg.kvgrec")
        with open(path, "wb") as f:
            f.write(SEGMENT)
        run = Replay()
        run.run([path])
        s = run.summary()
    assert (s["records_lost"], s["records_missing"], s["problems"], s["apply_errors"]) == (4, 0, 0, 0)
    assert s["sidecar_events"] == 4 and s["records"] + s["sidecar_events"] == sum(CHUNK_RECORDS)
    assert struct.unpack_from("<8s", SEGMENT)[0] == rmod.SEGMENT_MAGIC

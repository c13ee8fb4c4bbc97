"""The wire contract: round trips, and bad bytes counted without crashing the reader."""

import struct

import numpy as np
import pytest

from kvguard.engine_hooks import wire


def _rec(kind, payload, seq=0):
    return wire.encode(kind, seq, 123, 7, payload)


ROUND_TRIPS = [
    (
        wire.Kind.HELLO,
        wire.hello_payload(
            wire.Hello(wire.Role.DECODE, 1, 42, 4, 256, 1024, 2048, 250, "sglang", "0.5.19", "tiny", "0.1.0")
        ),
    ),
    (wire.Kind.REQ_BEGIN, wire.req_begin_payload(wire.ReqBegin(9, wire.NO_ROOM, 600, 0, True, "rid-1", "acme"))),
    (wire.Kind.REQ_END, wire.req_end_payload(wire.ReqEnd(9, 10, 20, 8, wire.Finish.LENGTH, "done"))),
    (wire.Kind.ALLOC, wire.pages_payload(np.array([1, 2, 3]))),
    (wire.Kind.FREE, wire.pages_payload(np.array([5]), wire.FreeKind.GROUP)),
    (wire.Kind.ASSIGN, wire.assign_payload(wire.Assign(9, 0, 10, 4, np.array([1, 2, 3])))),
    (wire.Kind.XFER_RESERVE, wire.xfer_reserve_payload(wire.XferReserve(9, 77, 600, np.arange(1, 151)))),
    (wire.Kind.XFER_SEND, wire.xfer_send_payload(wire.XferSend(9, 77, 0xABC, 0, 1, True, np.array([51])))),
    (wire.Kind.XFER_DONE, wire.xfer_done_payload(wire.XferDone(9, 77, wire.Side.RECEIVER, wire.XferStatus.SUCCESS))),
    (
        wire.Kind.XFER_DIGEST,
        wire.xfer_digest_payload(
            wire.XferDigest(9, 77, wire.Side.SENDER, wire.DigestAlg.XXH3_UNIT_BYTES, 2**64 - 1, 0, 600, 12, 0, 4, 8)
        ),
    ),
    (wire.Kind.REJECT, wire.reject_payload(wire.Reject(9, wire.Phase.ADMISSION, "too long"))),
    (
        wire.Kind.GUARD,
        wire.guard_payload(
            wire.Guard(9, 77, wire.GuardRule.REJECTED_SEND, wire.GuardAction.ABORTED, 600, 1, 150, "rejected")
        ),
    ),
    (
        wire.Kind.PAGE_IDENTITY,
        wire.page_identity_payload(
            wire.PageIdentity(9, 2, wire.IdentityPhase.HIT, np.array([1, 2**64 - 1], np.uint64))
        ),
    ),
    (wire.Kind.HEARTBEAT, wire.heartbeat_payload(wire.Heartbeat(1, 2, 3))),
    (wire.Kind.PROBE_ERROR, wire.probe_error_payload(wire.ProbeError(1, "forward", "TypeError"))),
]


@pytest.mark.parametrize("kind,payload", ROUND_TRIPS, ids=[k.name for k, _ in ROUND_TRIPS])
def test_every_kind_round_trips(kind, payload):
    raw = _rec(kind, payload, seq=5)
    assert len(raw) % 8 == 0
    stats = wire.DecodeStats()
    (rec,) = wire.decode_stream(raw, stats)
    assert (rec.kind, rec.seq, rec.ts_ns, rec.engine_id) == (kind, 5, 123, 7)
    assert stats.records == 1 and stats.bad_payload == 0


def test_forward_round_trip_keeps_rows_per_request():
    f = wire.Forward(
        np.array([1, 2], np.uint64),
        np.array([10, 601], np.uint32),
        np.array([1, 1], np.uint32),
        np.array([3, 151]),
        np.array([3, 151], np.uint32),
        np.arange(154),
    )
    (rec,) = wire.decode_stream(_rec(wire.Kind.FORWARD, wire.forward_payload(f)), wire.DecodeStats())
    body = rec.body
    assert body.req_keys.tolist() == [1, 2] and body.seq_lens.tolist() == [10, 601]
    assert body.read_counts.tolist() == [3, 151] and body.read_pages.tolist() == list(range(154))


def test_header_is_32_bytes_little_endian():
    raw = _rec(wire.Kind.ALLOC, wire.pages_payload(np.array([1])), seq=1)
    magic, version, kind, length = struct.unpack_from("<HBBI", raw)
    assert (magic, version, kind, length) == (0x4B47, 1, 4, len(raw))


def test_unknown_kind_is_skipped_and_counted_and_the_next_record_survives():
    unknown = wire.encode(99, 0, 0, 0, b"\1" * 12)
    good = _rec(wire.Kind.ALLOC, wire.pages_payload(np.array([4])), seq=1)
    stats = wire.DecodeStats()
    recs = wire.decode_stream(unknown + good, stats)
    assert [r.kind for r in recs] == [wire.Kind.ALLOC] and stats.unknown_kind == 1


def test_newer_version_is_refused_with_a_clear_reason():
    raw = bytearray(_rec(wire.Kind.ALLOC, wire.pages_payload(np.array([4]))))
    raw[2] = 2
    stats = wire.DecodeStats()
    assert wire.decode_stream(bytes(raw), stats) == []
    assert stats.bad_version == 1 and "version 2" in stats.last_error


def test_truncated_payload_is_counted_and_neighbours_survive():
    # an ALLOC claiming 1000 pages inside a 48-byte record
    bad = wire.encode(wire.Kind.ALLOC, 0, 0, 0, struct.pack("<IB3x", 1000, 0) + b"\0" * 8)
    good = _rec(wire.Kind.FREE, wire.pages_payload(np.array([4])), seq=1)
    stats = wire.DecodeStats()
    recs = wire.decode_stream(good + bad + good, stats)
    assert [r.kind for r in recs] == [wire.Kind.FREE, wire.Kind.FREE]
    assert stats.bad_payload == 1 and "truncated" in stats.last_error


def test_garbage_is_counted_as_corrupt_bytes_not_raised():
    stats = wire.DecodeStats()
    good = _rec(wire.Kind.FREE, wire.pages_payload(np.array([4])))
    recs = wire.decode_stream(good + b"\xff" * 40, stats)
    assert len(recs) == 1 and stats.corrupt_bytes == 40


def test_request_key_is_stable_across_processes():
    assert wire.request_key("abc") == wire.request_key("abc") != wire.request_key("abd")
    assert wire.request_key("abc") == 0x78AF5F94892F3950


def test_xfer_digest_with_heads_beyond_the_total_is_refused():
    bad = wire.XferDigest(9, 77, wire.Side.RECEIVER, wire.DigestAlg.XXH3_UNIT_BYTES, 5, 0, 10, 2, 4, 8, 8)
    stats = wire.DecodeStats()
    assert wire.decode_stream(_rec(wire.Kind.XFER_DIGEST, wire.xfer_digest_payload(bad)), stats) == []
    assert stats.bad_payload == 1 and "exceed total" in stats.last_error


def test_req_end_carries_the_reprefilled_flag_and_old_zero_padding_reads_as_not():
    end = wire.ReqEnd(9, 10, 20, 8, wire.Finish.STOP, "", reprefilled=True)
    (rec,) = wire.decode_stream(_rec(wire.Kind.REQ_END, wire.req_end_payload(end)), wire.DecodeStats())
    assert rec.body.reprefilled is True
    (rec,) = wire.decode_stream(
        _rec(wire.Kind.REQ_END, wire.req_end_payload(wire.ReqEnd(9, 10, 20, 8, wire.Finish.STOP, ""))),
        wire.DecodeStats(),
    )
    assert rec.body.reprefilled is False


def test_the_package_re_exports_every_public_name_of_its_modules():
    """engine_hooks/wire/ is one contract split by concern: a name added to a submodule but not
    to wire/__init__.py would be reachable only by its file's path."""
    import importlib
    import inspect

    for part in ("layout", "types", "encode", "decode", "recording"):
        module = importlib.import_module(f"kvguard.engine_hooks.wire.{part}")
        defined_here = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and not inspect.ismodule(value)
            and getattr(value, "__module__", module.__name__) == module.__name__
        ]
        missing = [
            name
            for name in defined_here
            if name not in wire.__all__ or getattr(wire, name) is not getattr(module, name)
        ]
        assert not missing, (part, missing)


def test_guard_record_keeps_every_field_and_refuses_an_unknown_rule():
    g = wire.Guard(9, wire.NO_ROOM, wire.GuardRule.REJECTED_SEND, wire.GuardAction.OBSERVED, 600, 1, 0, "why")
    (rec,) = wire.decode_stream(_rec(wire.Kind.GUARD, wire.guard_payload(g)), wire.DecodeStats())
    assert rec.body == g
    raw = bytearray(_rec(wire.Kind.GUARD, wire.guard_payload(g)))
    raw[wire.HEADER_SIZE + 16] = 99  # the rule byte
    stats = wire.DecodeStats()
    assert wire.decode_stream(bytes(raw), stats) == [] and stats.bad_payload == 1


def test_page_identity_keeps_every_id_whole_and_refuses_an_unknown_phase_or_a_short_payload():
    ids = np.array([0, 1, 2**63, 2**64 - 1], np.uint64)
    p = wire.PageIdentity(wire.request_key("r"), 7, wire.IdentityPhase.WRITTEN, ids)
    raw = _rec(wire.Kind.PAGE_IDENTITY, wire.page_identity_payload(p))
    (rec,) = wire.decode_stream(raw, wire.DecodeStats())
    assert (rec.body.req_key, rec.body.first_row_page, rec.body.phase) == (p.req_key, 7, wire.IdentityPhase.WRITTEN)
    assert rec.body.ids.dtype == np.uint64 and rec.body.ids.tolist() == ids.tolist()  # u64, nothing truncated
    assert wire.encode_record(rec) == raw  # recordings keep it byte for byte
    bad_phase = bytearray(raw)
    bad_phase[wire.HEADER_SIZE + 16] = 9  # the phase byte
    # a count claiming more ids than the record holds
    too_many = bytearray(raw)
    struct.pack_into("<I", too_many, wire.HEADER_SIZE + 12, 1000)
    for bad in (bad_phase, too_many):
        stats = wire.DecodeStats()
        assert wire.decode_stream(bytes(bad), stats) == [] and stats.bad_payload == 1

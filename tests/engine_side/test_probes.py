"""The probe layer: slots become pages, and a failing probe never reaches the engine."""

import logging

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes, get_probes, reset_probes_for_tests
from kvguard.engine_hooks.ring import RingReader, RingWriter


def probes(tmp_path, page_size=4):
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("decode", 0, page_size, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    return p


def records(p):
    return RingReader(p.writer.path).poll().records


def test_row_pages_take_one_page_per_page_aligned_position(tmp_path):
    p = probes(tmp_path)
    # positions 2..9 of a row: 2,3 in page 5 (slots 22,23), 4..7 in page 9, 8,9 in page 3
    assert p.row_pages(2, [22, 23, 36, 37, 38, 39, 12, 13]).tolist() == [5, 9, 3]
    assert p.row_pages(0, np.arange(8, 16)).tolist() == [2, 3]
    assert p.slots_to_pages([9, 8, 4, 40]).tolist() == [1, 2, 10]
    # the small-array path (sets) and np.unique agree, duplicates and order included
    big = np.random.default_rng(1).integers(0, 400, 300)
    assert p.slots_to_pages(big).tolist() == np.unique(big // 4).tolist()
    assert p.slots_to_pages(big[:40]).tolist() == np.unique(big[:40] // 4).tolist()
    assert p.slots_to_pages([]).dtype == np.int64 and len(p.slots_to_pages([])) == 0


def test_decode_rows_assigned_sends_the_records_rows_assigned_would(tmp_path):
    torch = __import__("torch")
    one, batched = probes(tmp_path / "one"), probes(tmp_path / "batched")
    rids, positions, slots = ["a", "b", "c"], [8, 12, 0], [36, 4, 61]
    for rid, pos, slot in zip(rids, positions, slots):
        one.rows_assigned(rid, pos, pos + 1, pos, [slot])
    batched.decode_rows_assigned(rids, np.array(positions), torch.tensor(slots))
    a, b = records(one)[1:], records(batched)[1:]
    assert [r.kind for r in b] == [wire.Kind.ASSIGN] * 3 and [r.seq for r in b] == [1, 2, 3]
    # the same bodies, byte for byte on the wire (only the timestamps differ)
    assert [wire.assign_payload(r.body) for r in a] == [wire.assign_payload(r.body) for r in b]
    assert [r.body.pages.tolist() for r in b] == [[9], [1], [15]]
    assert [(r.body.row_start, r.body.row_end, r.body.shared_until) for r in b] == [(8, 9, 8), (12, 13, 12), (0, 1, 0)]
    assert one.calls == batched.calls


def test_page_ids_allocated_sends_the_records_pages_allocated_would(tmp_path):
    by_slot, by_id = probes(tmp_path / "slots"), probes(tmp_path / "ids")
    for ids in ([7], [9, 3, 9], []):
        by_slot.pages_allocated(np.asarray(ids, np.int64) * 4)
        by_id.page_ids_allocated(ids)
    a, b = records(by_slot)[1:], records(by_id)[1:]
    assert [r.kind for r in b] == [wire.Kind.ALLOC] * 2
    # one page without numpy, several through np.unique: the same bytes on the wire
    assert [wire.pages_payload(r.body.pages) for r in a] == [wire.pages_payload(r.body.pages) for r in b]
    assert [r.body.pages.tolist() for r in b] == [[7], [3, 9]]


def test_decode_rows_assigned_with_mismatched_lengths_is_a_probe_error(tmp_path):
    p = probes(tmp_path)
    p.decode_rows_assigned(["a", "b"], [8], [36, 4])  # never raises into the engine
    assert p.probe_errors == 1 and "decode_rows_assigned" in p.disabled_probes
    assert [r.kind for r in records(p)] == [wire.Kind.HELLO, wire.Kind.PROBE_ERROR]


def test_request_keys_of_a_repeated_batch_are_the_keys_of_that_batch(tmp_path):
    p = probes(tmp_path)
    batch = ["a", "b", "c"]
    want = [wire.request_key(r) for r in batch]
    assert p.request_keys(batch).tolist() == want
    assert p.request_keys(list(batch)).tolist() == want  # an equal list: the cached keys
    batch.append("d")  # the caller's list changed since: recomputed, not the stale keys
    assert p.request_keys(batch).tolist() == want + [wire.request_key("d")]
    assert p.request_keys(["c", "a"]).tolist() == [want[2], want[0]]
    assert p.request_keys(("a",)).tolist() == [want[0]]  # not a list: looked up each time


def test_a_probe_that_raises_is_counted_reported_disabled_and_never_raises(tmp_path, caplog):
    p = probes(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvguard.probes"):
        assert p.pages_freed([4], kind="no-such-kind") is None  # KeyError inside: swallowed
        assert p.pages_freed([4], kind="free") is None  # disabled now: not even tried
    assert p.probe_errors == 1 and "pages_freed" in p.disabled_probes
    assert sum("pages_freed failed and is disabled" in r.message for r in caplog.records) == 1
    kinds = [r.kind for r in records(p)]
    assert kinds == [wire.Kind.HELLO, wire.Kind.PROBE_ERROR]
    p.pages_allocated([8])  # other probes keep working
    assert records(p)[-1].kind == wire.Kind.ALLOC


def test_torch_tensors_are_accepted(tmp_path):
    torch = __import__("torch")
    p = probes(tmp_path)
    p.pages_allocated(torch.tensor([4, 5, 8], dtype=torch.int64))
    assert records(p)[-1].body.pages.tolist() == [1, 2]


def test_an_unusable_ring_dir_gives_disabled_probes_not_an_error(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("KVGUARD_RING_DIR", str(blocker / "rings"))
    reset_probes_for_tests(None)
    try:
        with caplog.at_level(logging.ERROR, logger="kvguard.probes"):
            p = get_probes()
        assert not p.enabled and "probes disabled" in caplog.text
        p.pages_allocated([1])  # a no-op
    finally:
        reset_probes_for_tests(None)


def test_bad_ring_size_setting_names_the_key_and_value(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVGUARD_RING_DIR", str(tmp_path))
    monkeypatch.setenv("KVGUARD_RING_BYTES", "1000")
    reset_probes_for_tests(None)
    try:
        with caplog.at_level(logging.ERROR, logger="kvguard.probes"):
            assert not get_probes().enabled
        assert "KVGUARD_RING_BYTES" in caplog.text and "1000" in caplog.text
    finally:
        reset_probes_for_tests(None)

"""The content check (engine_hooks/content.py): fingerprints of KV slots at rest, on a real
torch KV buffer laid out as SGLang's host pools are ([slots, heads, dim], bf16)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import content as ct  # noqa: E402


def pool(slots=64, heads=2, dim=8):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(slots, heads, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(slots, heads, dim, generator=g).to(torch.bfloat16)
    return k, v


def test_a_write_outside_any_hooked_path_is_found_once():
    k, v = pool()
    check = ct.ContentCheck(k, v, budget=None)
    check.written(np.arange(1, 33))
    assert len(check.verify(np.arange(1, 33))) == 0
    k[7, 0, 3] = 42.0  # one element of head 0
    v[9] = 0.0  # a whole slot, every head: what a stray write does
    k[11, 1] = 5.0  # head 1 only: not fingerprinted (head 0 of layer 0 is; engine_hooks/content.py)
    assert check.verify(np.arange(1, 33)).tolist() == [7, 9]
    assert len(check.verify(np.arange(1, 33))) == 0  # reported once: its new bytes are the fingerprint now
    assert check.slots_changed == 2


def test_hooked_writes_and_unwritten_slots_are_quiet():
    k, v = pool()
    check = ct.ContentCheck(k, v, budget=None)
    check.written([5, 6])
    k[5] = 1.0  # the next hooked write of slot 5 ...
    check.written([5])  # ... is recorded before anyone reads it
    k[40] = 3.0  # slot 40 was never written by a hooked path: nothing to compare with
    assert len(check.verify([5, 6, 40])) == 0
    assert check.slots_checked == 2
    check.written([0])  # slot 0 is SGLang's padding slot: never fingerprinted
    assert check.fp[0] == 0


def test_a_budget_draws_runs_of_positions_inside_each_readers_length():
    k, v = pool()
    check = ct.ContentCheck(k, v, budget=3 * ct.RUN)
    for _ in range(20):
        which, positions = check.pick_index(np.array([4, 100]))
        rows = np.array([3, 8])[which]
        assert len(rows) <= 3 * ct.RUN
        assert all((r == 3 and 0 <= p < 4) or (r == 8 and 0 <= p < 100) for r, p in zip(rows, positions))
        starts = positions[rows == 8]
        assert len(starts) % ct.RUN in (0, 100 % ct.RUN)  # whole runs (the last one cut at the row's end)
    every = ct.ContentCheck(k, v, budget=None)
    which, positions = every.pick_index(np.array([2, 3]))
    rows = np.array([3, 8])[which]
    assert rows.tolist() == [3, 3, 8, 8, 8] and positions.tolist() == [0, 1, 0, 1, 2]


def test_the_setting_is_checked_at_start_up():
    assert ct.budget_from_env("off") is False and ct.budget_from_env("") is False
    assert ct.budget_from_env("all") is None and ct.budget_from_env("512") == 512
    for bad in ("-3", "lots", "0.5"):
        with pytest.raises(ValueError, match="KVGUARD_CONTENT_CHECK='"):
            ct.budget_from_env(bad)


def test_pools_it_cannot_read_are_refused_with_the_reason():
    k, v = pool()
    with pytest.raises(ct.ContentUnsupported, match="contiguous"):
        ct.ContentCheck(k.transpose(0, 1), v, budget=None)
    with pytest.raises(ct.ContentUnsupported, match="expected a contiguous"):
        ct.ContentCheck(k[:, 0, :], v[:, 0, :], budget=None)


def test_the_sidecar_names_the_request_whose_kv_changed(tmp_path):
    from kvguard.engine_hooks.probes import Probes
    from kvguard.sidecar.recorder import RecordingWriter
    from kvguard.sidecar.replay import replay

    ps = 4
    with RecordingWriter(tmp_path / "c.kvgrec", overwrite=True) as rec:
        eng = Probes(rec.engine(engine_id=1))
        eng.hello("unified", 0, ps, 64, 64 * ps, 256, 256, "sglang", "0.5.23", "tiny", pid=1001)
        eng.request_begin("r-y", "globex", None, 8, 0, False)
        eng.pages_allocated(np.arange(4, 12))
        eng.rows_assigned("r-y", 0, 8, 0, np.arange(4, 12))
        eng.forward(["r-y"], [8], [np.arange(4, 12)])
        eng.content_changed([8, 9, 10, 11])  # page 2's slots changed under it
        eng.content_changed([40])  # page 10: nobody's
    findings, _ = replay([tmp_path / "c.kvgrec"])
    owned, loose = sorted(findings, key=lambda f: f.reader is None)
    assert (owned.kind, owned.severity, owned.reader.rid, owned.pages) == ("checksum_mismatch", "critical", "r-y", [2])
    assert owned.evidence["via"] == "content" and owned.evidence["slots_changed"] == 4 and owned.exposed == []
    assert "writer is unknown" in owned.summary
    assert (loose.kind, loose.reader, loose.pages) == ("checksum_mismatch", None, [10])


# ---------------------------------------------------------------- the device path (engine_hooks/content_device.py)
# The same code a GPU pool runs, on host tensors; a stand-in event plays the device that
# has not finished yet. The `gpu` test runs it on CUDA.


class SlowDevice:
    """Events that complete only when the test says the device got there."""

    def __init__(self):
        self.done = 0
        self.issued = 0

    def __call__(self):
        self.issued += 1
        return _Event(self, self.issued)


class _Event:
    def __init__(self, device, n):
        self.device, self.n = device, n

    def query(self):
        return self.device.done >= self.n

    def synchronize(self):
        self.device.done = max(self.device.done, self.n)


def device_check(k, v, budget=None, **kw):
    from kvguard.engine_hooks.content_device import DeviceContentCheck

    return DeviceContentCheck(k, v, budget, **kw)


def test_device_fingerprints_are_the_host_fingerprints_bit_for_bit():
    k, v = pool(slots=256, heads=4, dim=16)
    g = torch.Generator().manual_seed(3)
    k.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, k.shape, generator=g, dtype=torch.int16))
    host, dev = ct.ContentCheck(k, v, None), device_check(k, v)
    slots = np.arange(1, 256)
    assert (
        dev.fingerprint_device(torch.from_numpy(slots)).numpy().view(np.uint64).tolist()
        == host.fingerprint(slots).tolist()
    )
    host.written(slots)
    dev.written(slots)
    assert (dev.fp == host.fp).all() and (dev.fp[1:] != 0).all()


def test_the_device_path_finds_a_stray_write_once_and_keeps_issue_order():
    k, v = pool()
    slow = SlowDevice()
    check = device_check(k, v)
    check.event_factory = slow
    assert len(check.written(np.arange(1, 33))) == 0  # in flight: nothing known yet
    assert (check.fp == 0).all()
    v[9] = 0.0  # a stray write, after the hooked write was issued
    assert len(check.verify(np.arange(1, 33))) == 0  # issued; the device has not got there
    k[12] = 7.0  # and the next hooked write of slot 12, issued after that verify
    check.written([12])
    assert check.in_flight == 3
    slow.done = 1  # the write completed: the table has its fingerprints, nothing compared yet
    assert len(check.verify([40])) == 0 and (check.fp[1:33] != 0).all()
    slow.done = 3  # the verify (and the write after it) completed
    changed = check.verify([])
    assert changed.tolist() == [9]  # slot 12's change was a hooked write issued after the verify
    assert check.slots_changed == 1
    assert check.flush().tolist() == []  # the last verify ([40]: never written) finds nothing
    assert check.in_flight == 0
    assert len(check.verify(np.arange(1, 33))) == 0  # reported once; 12's new bytes are its fingerprint


def test_the_device_path_waits_only_past_its_bound_and_never_faults_on_a_bad_slot():
    k, v = pool()
    slow = SlowDevice()
    check = device_check(k, v, max_pending=4)
    check.event_factory = slow
    check.written(np.arange(1, 33))
    for _ in range(3):
        check.verify(np.arange(1, 33))
    assert check.waits == 0 and check.in_flight == 4
    check.verify([5, 10**9, -3, 0])  # out of the pool: mapped to the padding slot on the device
    assert check.waits == 1 and check.in_flight == 4  # the oldest was waited for
    k[5] = 9.0
    check.verify(torch.tensor([5, 6], dtype=torch.int32))  # a tensor of the engine's dtype
    assert check.flush().tolist() == [5]
    assert check.slots_checked == 3 * 32 + 1 + 2


def test_slots_a_side_stream_copy_filled_are_forgotten_in_issue_order():
    """A HiCache load-back on a GPU lands on another stream: its slots lose their
    fingerprint (in order with the writes and verifies around it) and are not compared
    until a hooked write fingerprints them again."""
    k, v = pool()
    slow = SlowDevice()
    check = device_check(k, v)
    check.event_factory = slow
    check.written(np.arange(1, 9))
    check.forget([3, 4])  # the copy into slots 3, 4
    k[3] = 5.0
    k[6] = 5.0  # a stray write into a slot still fingerprinted
    check.verify(np.arange(1, 9))
    slow.done = 10
    assert check.flush().tolist() == [6]
    assert check.fp[3] == 0 and check.fp[4] == 0 and check.fp[5] != 0


def test_the_content_path_is_chosen_by_where_the_pool_lives_and_the_setting():
    from kvguard.engine_hooks.content_device import DeviceContentCheck

    k, v = pool()
    assert type(ct.for_pool(k, v, None)) is ct.ContentCheck
    assert type(ct.for_pool(k, v, None, "device")) is DeviceContentCheck
    assert ct.path_from_env("") == "auto" and ct.path_from_env("Device") == "device"
    with pytest.raises(ValueError, match="KVGUARD_CONTENT_PATH='gpu'"):
        ct.path_from_env("gpu")


def test_verify_reads_gathers_the_same_slots_on_both_paths():
    from kvguard.engine_hooks.sglang import _runtime as rt
    from kvguard.engine_hooks.sglang import content_hooks

    k, v = pool(slots=128)
    req_to_token = torch.arange(128, dtype=torch.int32).flip(0).reshape(4, 32).contiguous()
    rpi = torch.tensor([2, 0], dtype=torch.int64)
    seen = []
    saved = rt.probes
    rt.probes = lambda: type("P", (), {"content_changed": staticmethod(lambda s: seen.append(list(s)))})
    try:
        for check in (ct.ContentCheck(k, v, None), device_check(k, v)):
            check.written(np.arange(1, 128))
            k[req_to_token[2, 3]] = 11.0  # reader 0 (row 2), position 3
            k[req_to_token[0, 20]] = 11.0  # reader 1 (row 0), position 20: past its length
            content_hooks.verify_reads(check, req_to_token, rpi, np.array([8, 16]))
            k.zero_()
        assert seen == [[int(req_to_token[2, 3])]] * 2
    finally:
        rt.probes = saved


@pytest.mark.gpu
def test_the_device_path_on_cuda_matches_the_host_and_finds_a_stray_write():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    k, v = pool(slots=4096, heads=8, dim=128)
    host = ct.ContentCheck(k, v, None)
    kd, vd = k.cuda(), v.cuda()
    dev = device_check(kd, vd)
    slots = np.arange(1, 4096)
    host.written(slots)
    dev.written(torch.from_numpy(slots).cuda())
    dev.flush()
    assert (dev.fp == host.fp).all()
    vd[77] = 0.0
    dev.verify(torch.from_numpy(slots).cuda())
    assert dev.flush().tolist() == [77]

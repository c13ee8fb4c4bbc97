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
        rows, positions = check.pick(np.array([3, 8]), np.array([4, 100]))
        assert len(rows) <= 3 * ct.RUN
        assert all((r == 3 and 0 <= p < 4) or (r == 8 and 0 <= p < 100) for r, p in zip(rows, positions))
        starts = positions[rows == 8]
        assert len(starts) % ct.RUN in (0, 100 % ct.RUN)  # whole runs (the last one cut at the row's end)
    every = ct.ContentCheck(k, v, budget=None)
    rows, positions = every.pick(np.array([3, 8]), np.array([2, 3]))
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

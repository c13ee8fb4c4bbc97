"""The test-only CPU kernel shims (demo/arch_shims.py): the one stand-in that computes cache
locations returns exactly what SGLang's kernel computes, and the pre-import placeholder is
present only while the module it precedes is imported."""

from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from kvguard.demo import arch_shims  # noqa: E402


def test_gather_row_slots_is_the_rows_entries_over_each_window_back_to_back():
    req_to_token = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    got = arch_shims.gather_row_slots(torch.tensor([2, 0]), req_to_token, torch.tensor([3, 7]), torch.tensor([6, 9]))
    assert got.dtype == torch.int64 and got.tolist() == [23, 24, 25, 7, 8]
    assert req_to_token.tolist() == torch.arange(40).reshape(4, 10).tolist()  # read only
    empty = arch_shims.gather_row_slots(
        torch.tensor([], dtype=torch.int64), req_to_token, torch.tensor([]), torch.tensor([])
    )
    assert empty.numel() == 0


def test_unknown_shim_names_are_refused():
    with pytest.raises(ValueError, match="nope"):
        arch_shims.parse("rope,nope")


def test_a_pre_import_hook_runs_before_the_module_and_its_undo_after(tmp_path, monkeypatch):
    (tmp_path / "kvg_shim_probe.py").write_text("import kvg_placeholder\nSEEN = kvg_placeholder.VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def placeholder():
        sys.modules["kvg_placeholder"] = types.SimpleNamespace(VALUE=7)
        return lambda: sys.modules.pop("kvg_placeholder", None)

    arch_shims._before_import("kvg_shim_probe", placeholder)
    monkeypatch.setattr(sys, "meta_path", [arch_shims._finder, *sys.meta_path])
    try:
        import kvg_shim_probe

        assert kvg_shim_probe.SEEN == 7 and "kvg_placeholder" not in sys.modules
    finally:
        sys.modules.pop("kvg_shim_probe", None)
        arch_shims._PRE_IMPORT.pop("kvg_shim_probe", None)

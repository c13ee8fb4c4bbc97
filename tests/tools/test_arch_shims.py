"""The test-only CPU kernel shims (demo/arch_shims.py): the one stand-in that computes cache
locations returns exactly what SGLang's kernel computes, the torch gated delta rule (Qwen3-Next)
works on the state rows SGLang chose and no others, bfloat16 arithmetic in the Triton
interpreter computes on values, and the pre-import placeholder is present only while the module
it precedes is imported."""

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


def _gdn_inputs(tokens: int, heads: int = 2, v_heads: int = 4, k_dim: int = 8, v_dim: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads, k_dim, generator=gen)
    k = torch.randn(1, tokens, heads, k_dim, generator=gen)
    v = torch.randn(1, tokens, v_heads, v_dim, generator=gen)
    g = -torch.rand(1, tokens, v_heads, generator=gen)  # log decay <= 0
    beta = torch.rand(1, tokens, v_heads, generator=gen)
    return q, k, v, g, beta


def test_a_gdn_decode_step_updates_its_slot_in_place_and_no_other():
    q, k, v, g, beta = _gdn_inputs(tokens=2)
    states = torch.randn(5, 4, 4, 8)  # [slots, HV, V, K], MambaPool's temporal layout
    before, storage = states.clone(), states.data_ptr()
    out = arch_shims.gated_delta_rule(
        q, k, v, g, beta, ssm_states=states, cache_indices=torch.tensor([3, -1]),
        cu_seqlens=torch.tensor([0, 1, 2]), scale=8**-0.5,
    )  # fmt: skip
    assert out.shape == (1, 2, 4, 4) and states.data_ptr() == storage
    # untouched: every other slot, and nothing written for the padding sentinel -1
    assert all(torch.equal(states[s], before[s]) for s in (0, 1, 2, 4))
    # slot 3 holds one step of the rule from its old state; value head h reads key head h // 2
    kn = torch.nn.functional.normalize(k[0, 0], dim=-1).repeat_interleave(2, 0)  # [HV, K]
    qn = torch.nn.functional.normalize(q[0, 0], dim=-1).repeat_interleave(2, 0) * 8**-0.5
    decayed = before[3] * torch.exp(g[0, 0])[:, None, None]
    delta = beta[0, 0][:, None] * (v[0, 0] - torch.einsum("hvk,hk->hv", decayed, kn))
    want = decayed + delta[:, :, None] * kn[:, None, :]
    torch.testing.assert_close(states[3], want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[0, 0], torch.einsum("hvk,hk->hv", want, qn), rtol=1e-4, atol=1e-5)
    # the padded row started from zeros: its output is the one-step state from zero times q
    kn1 = torch.nn.functional.normalize(k[0, 1], dim=-1).repeat_interleave(2, 0)
    qn1 = torch.nn.functional.normalize(q[0, 1], dim=-1).repeat_interleave(2, 0) * 8**-0.5
    fresh = (beta[0, 1][:, None] * v[0, 1])[:, :, None] * kn1[:, None, :]
    torch.testing.assert_close(out[0, 1], torch.einsum("hvk,hk->hv", fresh, qn1), rtol=1e-4, atol=1e-5)


def test_a_gdn_prefill_equals_its_tokens_decoded_one_by_one_through_the_slot():
    q, k, v, g, beta = _gdn_inputs(tokens=5, seed=1)
    start = torch.randn(3, 4, 4, 8)
    whole, stepped = start.clone(), start.clone()
    out = arch_shims.gated_delta_rule(
        q, k, v, g, beta, ssm_states=whole, cache_indices=torch.tensor([2]),
        cu_seqlens=torch.tensor([0, 5]), scale=0.3,
    )  # fmt: skip
    steps = [
        arch_shims.gated_delta_rule(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            ssm_states=stepped,
            cache_indices=torch.tensor([2]),
            cu_seqlens=torch.tensor([0, 1]),
            scale=0.3,
        )
        for t in range(5)
    ]
    torch.testing.assert_close(out, torch.cat(steps, dim=1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole, stepped, rtol=1e-5, atol=1e-6)
    assert torch.equal(whole[:2], start[:2])
    # without write-back (SGLang's multi-item scoring) the pool is left as it was
    untouched = start.clone()
    arch_shims.gated_delta_rule(
        q, k, v, g, beta, ssm_states=untouched, cache_indices=torch.tensor([2]),
        cu_seqlens=torch.tensor([0, 5]), scale=0.3, write_back=False,
    )  # fmt: skip
    assert torch.equal(untouched, start)


def test_bf16_bits_round_trip_and_round_to_nearest_even():
    np = pytest.importorskip("numpy")
    values = torch.tensor([1.0, -2.5, 3.140625, 1e30, float("inf")], dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    assert arch_shims.bf16_bits_to_float32(bits).tolist() == values.float().tolist()
    wide = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -7.3, float("nan")], dtype=np.float32)
    got = torch.from_numpy(arch_shims.float32_to_bf16_bits(wide).view(np.int16)).view(torch.bfloat16)
    want = torch.from_numpy(wide).to(torch.bfloat16)  # torch rounds to nearest even
    assert got[:3].tolist() == want[:3].tolist() and got[3].isnan()


def test_triton_interpreter_bf16_arithmetic_computes_on_values(monkeypatch):
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    np = pytest.importorskip("numpy")
    tl = interpreter.tl
    builder_cls = interpreter.InterpreterBuilder
    for name in arch_shims._BF16_OPS:  # undone after the test
        monkeypatch.setattr(builder_cls, name, getattr(builder_cls, name))

    def bf16(*xs):
        bits = torch.tensor(xs, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return interpreter.TensorHandle(bits, tl.bfloat16)

    def values(handle):
        return torch.from_numpy(handle.data.view(np.int16).copy()).view(torch.bfloat16).tolist()

    builder = builder_cls()
    a, b = bf16(2.5, -5.0), bf16(2.0, -2.0)
    arch_shims.shim_triton_interp_bf16()  # triton.runtime.interpreter is imported: applied now
    assert values(builder.create_fadd(a, b)) == [4.5, -7.0]
    assert values(builder.create_fmul(a, b)) == [5.0, 10.0]
    assert values(builder.create_exp(bf16(0.0, 1.0))) == [1.0, torch.tensor(2.71875).item()]
    less = builder.create_fcmpOLT(a, b)
    assert less.data.dtype == np.bool_ and less.data.tolist() == [False, True]
    f32 = interpreter.TensorHandle(np.array([1.0, 2.0], dtype=np.float32), tl.float32)
    assert builder.create_fadd(f32, f32).data.tolist() == [2.0, 4.0]  # other types as before


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

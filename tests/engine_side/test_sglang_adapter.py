"""Unit tests of the SGLang adapter: version table, target checks, guards, hook mapping.

Fast and engine-free: SGLang itself is not imported in this process (engine tests are
in test_sglang_adapter_engine.py). Hooks are applied to small stand-in classes with
the same wrapping semantics as SGLang's HookRegistry (AFTER / AROUND).
"""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import probes as probes_mod  # noqa: E402
from kvguard.engine_hooks.row_sampler import RowSampler, from_env  # noqa: E402
from kvguard.engine_hooks.sglang import _runtime as rt  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_allocator as ha  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_requests as hq  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_rows as hr  # noqa: E402
from kvguard.engine_hooks.sglang import plugin  # noqa: E402
from tests.support.recording_probes import RecordingProbes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SGLANG_DIRS = {v: REPO / ".venv" / "sglang" / v for v in ("0.5.19", "0.5.23")}


# --------------------------------------------------------------------------- helpers
@pytest.fixture
def probes():
    stub = RecordingProbes()
    probes_mod.reset_probes_for_tests(stub)
    rt.State.reset()
    rt.State.hello_done = True
    yield stub
    probes_mod.reset_probes_for_tests(None)
    rt.State.reset()


def wrap(cls, attr, hook, kind):
    """Apply a hook the way sglang.srt.plugins.hook_registry._wrap_fn does."""
    original = cls.__dict__[attr]
    if kind == "after":

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            modified = hook(result, *args, **kwargs)
            return modified if modified is not None else result
    else:

        def wrapper(*args, **kwargs):
            return hook(original, *args, **kwargs)

    setattr(cls, attr, wrapper)


def arr(x):
    return np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x).reshape(-1).tolist()


# --------------------------------------------------------------------------- versions
@pytest.mark.parametrize(
    "raw,base",
    [
        ("0.5.19", "0.5.19"),
        ("0.5.23", "0.5.23"),
        ("0.5.19.post1", "0.5.19"),
        ("0.5.23rc0", "0.5.23"),
        ("v0.5.20", "0.5.20"),
        ("", None),
        ("garbage", None),
    ],
)
def test_base_version(raw, base):
    assert plugin.base_version(raw) == base


def test_version_table():
    assert set(plugin.SUPPORTED) == {"0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"}
    assert all(verified for verified, _specs in plugin.SUPPORTED.values())  # each runs the engine tests
    assert plugin.specs_for("0.4.9") is None and plugin.specs_for("0.5.24") is None
    t19 = {s.target for s in plugin.SUPPORTED["0.5.19"][1]}
    t23 = {s.target for s in plugin.SUPPORTED["0.5.23"][1]}
    hicache = {s.target for s in plugin.SUPPORTED["0.5.23"][1] if s.area == "hicache"}
    retraction = {t for t in hicache if t.endswith(("backup_kv_cache", "restore_kv_cache"))}
    assert not any(t.endswith("free_page_ids") for t in t19)
    assert t23 - t19 == {t for t in t23 if t.endswith("free_page_ids")} | hicache
    assert all({s.target for s in plugin.SUPPORTED[v][1]} == t23 for v in ("0.5.21", "0.5.22"))
    assert {s.target for s in plugin.SUPPORTED["0.5.20"][1]} == t23 - retraction  # (from 0.5.21)
    # every probe area is covered (HiCache's from 0.5.20: 0.5.19 lays its cache out otherwise),
    # every spec has a known hook kind
    for v, (_ok, specs) in plugin.SUPPORTED.items():
        areas = {"allocator", "rows", "requests", "disagg", "state"} | ({"hicache"} if v != "0.5.19" else set())
        assert {s.area for s in specs} == areas
        assert all(s.kind in ("after", "around") for s in specs)
        assert len({s.target for s in specs}) == len(specs)
    must = (
        "PagedTokenToKVPoolAllocator.alloc_extend",
        "PagedTokenToKVPoolAllocator.alloc_decode",
        "ReqToTokenPool.write",
        "DecodeReqToTokenPool.write",
        "alloc_for_extend",
        "alloc_for_decode",
        "ModelRunner.forward",
        "release_kv_cache",
        "Req.set_finish_with_abort",
        "_pre_alloc",
        "send_kv_chunk",
        "pop_transferred",
        "Scheduler.__init__",
    )
    for name in must:
        assert any(t.endswith(name) for t in t19), name


# --------------------------------------------------------------------------- target checks
@pytest.fixture
def fake_targets(monkeypatch):
    mod = types.ModuleType("kvg_fake_targets")

    class Base:
        def inherited(self, x):
            return x

    class Pool(Base):
        def write(self, indices, values):
            return None

        def wrong(self, values, indices):
            return None

        @staticmethod
        def static(batch):
            return batch

    def release_kv_cache(req, tree_cache, *, checkpoint):
        return None

    mod.Pool, mod.release_kv_cache = Pool, release_kv_cache
    monkeypatch.setitem(sys.modules, "kvg_fake_targets", mod)
    return mod


def spec(target, params):
    return plugin.HookSpec(target, "after", lambda name: None, params, "rows")


def test_resolve_accepts_matching_targets(fake_targets):
    assert plugin.resolve(spec("kvg_fake_targets.Pool.write", ("indices", "values")))[0] is not None
    assert plugin.resolve(spec("kvg_fake_targets.Pool.static", ("batch",)))[0] is not None
    assert plugin.resolve(spec("kvg_fake_targets.release_kv_cache", ("req", "tree_cache")))[0] is not None


@pytest.mark.parametrize(
    "target,params,why",
    [
        ("kvg_fake_targets.Pool.inherited", ("x",), "does not define"),
        ("kvg_fake_targets.Pool.wrong", ("indices", "values"), "parameters"),
        ("kvg_fake_targets.Pool.missing", (), "does not define"),
        ("kvg_fake_targets.nothing", (), "has no"),
        ("kvg_no_such_module.Pool.write", (), "cannot import"),
    ],
)
def test_resolve_refuses_mismatches(fake_targets, target, params, why):
    fn, reason = plugin.resolve(spec(target, params))
    assert fn is None and why in reason


def test_unknown_version_registers_nothing(monkeypatch, caplog):
    monkeypatch.setattr(plugin, "_loaded", False)
    monkeypatch.setattr(plugin, "registered", [])
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.4.0")
    with caplog.at_level(logging.WARNING, logger="kvguard.sglang"):
        plugin.load()
    assert plugin.registered == []
    lines = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert len(lines) == 1 and "0.4.0" in lines[0]


def _fake_hook_registry(monkeypatch):
    import enum

    registered = []

    class HookType(enum.Enum):
        BEFORE, AFTER, AROUND, REPLACE = "before", "after", "around", "replace"

    class HookRegistry:
        @classmethod
        def register(cls, target, hook, hook_type=HookType.AFTER):
            registered.append((target, hook, hook_type))

    names = ["sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.plugins.hook_registry"]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    sys.modules["sglang.srt.plugins.hook_registry"].HookRegistry = HookRegistry
    sys.modules["sglang.srt.plugins.hook_registry"].HookType = HookType
    return registered, HookType


def test_load_registers_only_resolved_targets(monkeypatch, fake_targets):
    registered, HookType = _fake_hook_registry(monkeypatch)
    good = plugin.HookSpec("kvg_fake_targets.Pool.write", "after", hr.write_hook, ("indices", "values"), "rows")
    bad = plugin.HookSpec("kvg_fake_targets.Pool.wrong", "around", hr.write_hook, ("indices", "values"), "rows")
    monkeypatch.setitem(plugin.SUPPORTED, "9.9.9", (True, (good, bad)))
    monkeypatch.setattr(plugin, "_loaded", False)
    monkeypatch.setattr(plugin, "registered", [])
    monkeypatch.setattr(plugin, "sglang_version", lambda: "9.9.9")
    plugin.load()
    assert [(t, ht) for t, _h, ht in registered] == [("kvg_fake_targets.Pool.write", HookType.AFTER)]
    assert plugin.registered == ["kvg_fake_targets.Pool.write"]
    plugin.load()  # idempotent
    assert len(registered) == 1


def test_disable_env_registers_nothing(monkeypatch):
    registered, _ = _fake_hook_registry(monkeypatch)
    monkeypatch.setenv("KVGUARD_DISABLE", "1")
    monkeypatch.setattr(plugin, "_loaded", False)
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.23")
    plugin.load()
    assert registered == []


def test_cpu_compat(monkeypatch, caplog):
    called = []
    stub = types.ModuleType("kvguard.demo.cpu_compat")
    stub.apply = lambda: called.append(1) or {}
    monkeypatch.setitem(sys.modules, "kvguard.demo.cpu_compat", stub)
    import kvguard.demo as pkg

    monkeypatch.setattr(pkg, "cpu_compat", stub, raising=False)
    monkeypatch.delenv(plugin.CPU_COMPAT_ENV, raising=False)
    plugin._apply_cpu_compat()
    assert called == []
    monkeypatch.setenv(plugin.CPU_COMPAT_ENV, "1")
    plugin._apply_cpu_compat()
    assert called == [1]

    def boom():
        raise RuntimeError("no mooncake")

    stub.apply = boom
    with caplog.at_level(logging.WARNING, logger="kvguard.sglang"):
        plugin._apply_cpu_compat()  # logged, never raised
    assert any("cpu_compat" in r.getMessage() for r in caplog.records)


TORCHVISION_SHIM = """
try:
    import torch
    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:
    pass
"""


# --------------------------------------------------------------------------- guards
def test_around_guard_keeps_engine_behaviour(probes):
    calls = []

    def original(x):
        calls.append(x)
        return x * 2

    def bad_pre(x):
        raise ValueError("extraction bug")

    hook = rt.around("t.bad", bad_pre, None)
    assert hook(original, 3) == 6 and calls == [3]
    assert not rt.is_enabled("t.bad")
    assert [c[1][0] for c in probes.named("report_probe_error")] == ["sglang.t.bad"]
    assert hook(original, 4) == 8 and calls == [3, 4]  # disabled: original only
    assert len(probes.named("report_probe_error")) == 1  # reported once


def test_around_propagates_engine_errors_and_restores_depth(probes):
    def original():
        assert rt.depth("free") == 1
        raise KeyError("engine")

    hook = rt.around("t.engine", None, lambda *a: None, cats=("free",), free_kind="deferred")
    with pytest.raises(KeyError):
        hook(original)
    assert rt.depth("free") == 0 and rt.free_kind_override() is None
    assert rt.is_enabled("t.engine")


def test_after_guard_returns_none(probes):
    def post(result, *a):
        raise RuntimeError("x")

    hook = rt.after("t.after", post)
    assert hook("result", 1) is None  # HookRegistry then keeps the engine's result
    assert not rt.is_enabled("t.after")


# --------------------------------------------------------------------------- allocator
class FakePaged:
    """The parts of SGLang's PagedTokenToKVPoolAllocator the hooks rely on."""

    def __init__(self, page_size=4):
        self.page_size, self.size, self.num_pages = page_size, 64, 16
        self.free_group = None
        self.free_page_ids_group = []
        self.free_pages = torch.arange(1, 17)
        self.returned = []

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        return self.next_result

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self.next_result

    def free(self, free_index):
        if self.free_group is None:
            self.returned.append(torch.unique(free_index // self.page_size))
        else:
            self.free_group.append(free_index.clone())

    def free_page_ids(self, page_ids):
        if self.free_group is None:
            self.returned.append(page_ids)
        else:
            self.free_page_ids_group.append(page_ids.clone())

    def free_group_begin(self):
        self.free_group = []
        self.free_page_ids_group = []

    def free_group_end(self):
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(torch.cat(pending))
        if self.free_page_ids_group:
            self.returned.append(torch.cat(self.free_page_ids_group))
            self.free_page_ids_group = []

    def clear(self):
        self.free_pages = torch.arange(1, 17)


class FakeToken(FakePaged):
    def __init__(self):
        super().__init__(page_size=1)

    def free_page_ids(self, page_ids):  # SGLang 0.5.23: page_size 1 -> plain free()
        self.free(page_ids)


@pytest.fixture
def paged(probes):
    cls = type("Paged", (FakePaged,), {k: v for k, v in FakePaged.__dict__.items() if callable(v)})
    for attr in ("alloc_extend", "alloc_decode"):
        wrap(cls, attr, ha.alloc_hook(attr), "around")
    wrap(cls, "free", ha.free_hook("free"), "around")
    wrap(cls, "free_page_ids", ha.free_page_ids_hook("free_page_ids"), "around")
    wrap(cls, "free_group_end", ha.free_group_end_hook("free_group_end"), "around")
    wrap(cls, "clear", ha.clear_hook("clear"), "around")
    return cls()


def test_alloc_reports_only_new_pages(paged, probes):
    # prefix ends mid page 3 (slots 12..14 used): extend writes 15 (page 3) and 16..21 (pages 4, 5)
    paged.next_result = torch.tensor([15, 16, 17, 18, 19, 20, 21])
    paged.alloc_extend(None, None, None, None, None, 7)
    # decode into an existing page: nothing new; at a page boundary: one new page
    paged.next_result = torch.tensor([22])
    paged.alloc_decode(None, None, None)
    paged.next_result = torch.tensor([24])
    paged.alloc_decode(None, None, None)
    calls = probes.named("pages_allocated")
    assert [arr(c[1][0]) for c in calls] == [[16, 20], [24]]


def test_alloc_none_and_before_hello(paged, probes):
    paged.next_result = None
    assert paged.alloc_decode(None, None, None) is None
    rt.State.hello_done = False
    paged.next_result = torch.tensor([4, 5, 6, 7])
    assert arr(paged.alloc_decode(None, None, None)) == [4, 5, 6, 7]
    assert probes.named("pages_allocated") == []


def test_free_immediate_and_grouped(paged, probes):
    paged.free(torch.tensor([8, 9, 10]))
    paged.free_group_begin()
    paged.free(torch.tensor([12, 13]))
    paged.free_page_ids(torch.tensor([7]))
    assert len(probes.named("pages_freed")) == 1  # queued, not returned yet
    paged.free_group_end()
    frees = [(arr(c[1][0]), c[1][1]) for c in probes.named("pages_freed")]
    assert frees[0] == ([8, 9, 10], "free")
    # one "group" record with the queued slots and the page ids as slots (7 * 4)
    assert frees[1][1] == "group" and sorted(frees[1][0]) == [12, 13, 28]
    assert len(frees) == 2  # the flush's internal free() is not reported again


def test_token_free_page_ids_not_doubled(probes):
    cls = type("Token", (FakeToken,), {k: v for k, v in FakeToken.__dict__.items() if callable(v)})
    cls.free = FakePaged.free
    wrap(cls, "free", ha.free_hook("free"), "around")
    wrap(cls, "free_page_ids", ha.free_page_ids_hook("free_page_ids"), "around")
    tok = cls()
    tok.free_page_ids(torch.tensor([5, 6]))
    assert [(arr(c[1][0]), c[1][1]) for c in probes.named("pages_freed")] == [([5, 6], "page_ids")]


def test_deferred_kind_and_clear(paged, probes):
    deferred = rt.around("do_release", None, None, free_kind="deferred")
    deferred(lambda: paged.free_page_ids(torch.tensor([3])))
    assert [(arr(c[1][0]), c[1][1]) for c in probes.named("pages_freed")] == [([12], "deferred")]
    paged.free_pages = torch.tensor([1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])
    paged.clear()
    assert (arr(probes.named("pages_freed")[-1][1][0]), probes.named("pages_freed")[-1][1][1]) == ([3, 4], "page_ids")


# --------------------------------------------------------------------------- rows
class FakePool:
    def __init__(self):
        self.req_to_token = torch.zeros((4, 32), dtype=torch.int32)

    def write(self, indices, values):
        self.req_to_token[indices] = values


def test_write_hook_rows_and_radix_share(probes):
    cls = type("Pool", (FakePool,), {"write": FakePool.write})
    wrap(cls, "write", hr.write_hook("write"), "after")
    pool = cls()
    rt.State.row_rid[1] = "r1"
    rt.State.row_rid[2] = "r2"
    pool.write((1, slice(0, 3)), torch.tensor([4, 5, 6], dtype=torch.int32))
    pool.write((3, slice(0, 2)), torch.tensor([9, 9], dtype=torch.int32))  # row nobody owns: ignored
    pool.write((torch.tensor([1, 2]), torch.tensor([3, 0])), torch.tensor([7, 12], dtype=torch.int32))
    src = "def checkpoint(pool, vals):\n    pool.write((2, slice(0, len(vals))), vals)\n"
    ns = {}
    exec(compile(src, "/x/sglang/srt/mem_cache/radix_cache.py", "exec"), ns)
    ns["checkpoint"](pool, torch.tensor([12, 13], dtype=torch.int32))
    got = [(c[1][0], c[1][1], c[1][2], c[1][3], arr(c[1][4])) for c in probes.named("rows_assigned")]
    assert got == [("r1", 0, 3, 0, [4, 5, 6]), ("r1", 3, 4, 3, [7]), ("r2", 0, 1, 0, [12]), ("r2", 0, 2, 2, [12, 13])]
    # inside alloc_for_extend/decode the pool writes are reported by those hooks instead
    rt.enter("rows")
    try:
        pool.write((1, slice(0, 1)), torch.tensor([1], dtype=torch.int32))
    finally:
        rt.leave("rows")
    assert len(probes.named("rows_assigned")) == 4


def _req(rid, **kw):
    kv = types.SimpleNamespace(req_pool_idx=kw.pop("row", None), holds_kv=kw.pop("holds_kv", False))
    base = dict(
        rid=rid,
        kv=kv,
        origin_input_ids=[1] * kw.pop("prompt", 8),
        bootstrap_room=None,
        bootstrap_host=None,
        routing_key=None,
        output_ids=[],
        finished_reason=None,
    )
    base.update(kw)
    r = types.SimpleNamespace(**base)
    r.finished = lambda: r.finished_reason is not None
    return r


def test_alloc_for_extend_rows_and_prefix(probes):
    pool = FakePool()
    a, b = _req("a", row=1, prompt=6), _req("b", row=2, holds_kv=True)
    pool.req_to_token[1, :6] = torch.tensor([40, 41, 8, 9, 10, 11])  # 2 prefix slots from the cache
    pool.req_to_token[2, :10] = torch.arange(20, 30)  # later chunk: rows 4..9 are new
    batch = types.SimpleNamespace(
        reqs=[a, b], prefix_lens=[2, 4], seq_lens_cpu=torch.tensor([6, 10]), req_to_token_pool=pool
    )
    hook = hr.alloc_for_extend_hook("alloc_for_extend")
    hook(lambda batch: ("out", None, None), batch)
    begins = {c[1][0]: c[1] for c in probes.named("request_begin")}
    assert begins["a"][4] == 2 and begins["b"][4] == 0  # cached_tokens
    got = [(c[1][0], c[1][1], c[1][2], c[1][3], arr(c[1][4])) for c in probes.named("rows_assigned")]
    assert got == [("a", 0, 6, 2, [40, 41, 8, 9, 10, 11]), ("b", 4, 10, 4, [24, 25, 26, 27, 28, 29])]


def test_rows_are_sampled_every_nth_forward_and_gather_page_starts_only(probes):
    pool = FakePool()
    pool.req_to_token[1, :9] = torch.tensor([20, 21, 22, 23, 40, 41, 42, 43, 8])
    runner = types.SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
    fb = types.SimpleNamespace(
        forward_mode=_Mode(False),
        rids=["a"],
        seq_lens_cpu=torch.tensor([9]),
        seq_lens=None,
        out_cache_loc=torch.tensor([8]),
        extend_seq_lens_cpu=None,
        req_pool_indices=torch.tensor([1]),
    )
    rt.State.page_size, rt.State.row_sampler = 4, RowSampler(every=3)
    hook = hr.forward_hook("forward")
    for _ in range(6):
        hook(lambda self, fb: None, runner, fb)
    rows = [(c[2]["read_pages"], c[2]["read_counts"]) for c in probes.named("forward")]
    assert [r[0] is not None for r in rows] == [False, False, True, False, False, True]
    assert arr(rows[2][0]) == [5, 10, 2] and arr(rows[2][1]) == [3]  # positions 0, 4, 8: one page each


def _decode_assigns(probes):
    """The decode hook's ASSIGNs as rows_assigned arguments: (rid, start, end, shared_until, slots);
    Probes.decode_rows_assigned(rids, positions, slots) sends rows_assigned(rid, pos, pos + 1, pos, [slot])."""
    out = []
    for _name, (rids, positions, slots), _kw in probes.named("decode_rows_assigned"):
        assert len(rids) == len(arr(positions)) == len(arr(slots))
        out += [(r, p, p + 1, p, [s]) for r, p, s in zip(rids, arr(positions), arr(slots))]
    return out


def _decode_batch(seq_lens):
    """A ScheduleBatch-shaped namespace of requests a and b (rows 1 and 2) for alloc_for_decode."""
    return types.SimpleNamespace(
        reqs=[_req("a", row=1), _req("b", row=2)],
        seq_lens_cpu=torch.tensor(seq_lens),
        model_config=types.SimpleNamespace(is_encoder_decoder=False),
    )


def test_decode_assigns_only_when_a_token_starts_a_page(probes):
    batch = _decode_batch([8, 9])
    rt.State.page_size = 4
    hook = hr.alloc_for_decode_hook("alloc_for_decode")
    hook(lambda batch, token_per_req: torch.tensor([33, 50]), batch, token_per_req=1)
    got = [(c[0], c[1]) for c in _decode_assigns(probes)]
    assert got == [("a", 8)] and probes.named("rows_assigned") == []  # b's position 9 lives in its current page


def test_alloc_for_decode_rows(probes):
    batch = _decode_batch([6, 9])
    hook = hr.alloc_for_decode_hook("alloc_for_decode")
    hook(lambda batch, token_per_req: torch.tensor([33, 50]), batch, token_per_req=1)
    assert _decode_assigns(probes) == [("a", 6, 7, 6, [33]), ("b", 9, 10, 9, [50])]


def test_alloc_for_decode_several_tokens_per_request_assigns_every_request(probes):
    batch = _decode_batch([6, 9])
    rt.State.page_size = 4
    hook = hr.alloc_for_decode_hook("alloc_for_decode")
    hook(lambda batch, token_per_req: torch.tensor([26, 27, 37, 38]), batch, token_per_req=2)
    got = [(c[1][0], c[1][1], c[1][2], c[1][3], arr(c[1][4])) for c in probes.named("rows_assigned")]
    assert got == [("a", 6, 8, 6, [26, 27]), ("b", 9, 11, 9, [37, 38])]
    assert probes.named("decode_rows_assigned") == []


class _Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_idle(self):
        return False

    def is_extend(self):
        return self.extend


def test_forward_split_and_rows(probes):
    pool = FakePool()
    pool.req_to_token[1, :5] = torch.tensor([4, 5, 6, 7, 8])
    pool.req_to_token[2, :3] = torch.tensor([12, 13, 14])
    runner = types.SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
    fb = types.SimpleNamespace(
        forward_mode=_Mode(True),
        rids=["a", "b"],
        seq_lens_cpu=torch.tensor([5, 3]),
        seq_lens=None,
        out_cache_loc=torch.tensor([6, 7, 8, 14]),
        extend_seq_lens_cpu=[3, 1],
        req_pool_indices=torch.tensor([1, 2]),
    )
    hook = hr.forward_hook("forward")
    rt.State.row_sampler = RowSampler(every=1)  # rows with every forward (page size 1: every position starts a page)
    assert hook(lambda self, fb: "ran", runner, fb) == "ran"
    ((_, args, kwargs),) = probes.named("forward")
    rids, seq_lens, written = args
    assert rids == ["a", "b"] and arr(seq_lens) == [5, 3]
    assert arr(written) == [6, 7, 8, 14] and arr(kwargs["written_counts"]) == [3, 1]
    # the actual rows, flat (page size 1: every position is its own page), requests back to back
    assert arr(kwargs["read_pages"]) == [4, 5, 6, 7, 8, 12, 13, 14] and arr(kwargs["read_counts"]) == [5, 3]
    # decode: one slot each; a draft model's runner (its own pool at the target's slots) reported alike
    fb2 = types.SimpleNamespace(
        forward_mode=_Mode(False),
        rids=["a", "b"],
        seq_lens_cpu=torch.tensor([5, 3]),
        seq_lens=None,
        out_cache_loc=torch.tensor([8, 14]),
        extend_seq_lens_cpu=None,
        req_pool_indices=torch.tensor([1, 2]),
    )
    hook(lambda self, fb: None, runner, fb2)
    assert arr(probes.named("forward")[-1][1][2]) == [8, 14]
    assert arr(probes.named("forward")[-1][2]["written_counts"]) == [1, 1]
    runner.is_draft_worker = True
    hook(lambda self, fb: None, runner, fb2)
    assert len(probes.named("forward")) == 3 and arr(probes.named("forward")[-1][1][2]) == [8, 14]


class _VerifyMode(_Mode):
    def __init__(self):
        super().__init__(False)

    def is_target_verify(self):
        return True


def _verify_batch(out_cache_loc, draft_token_num):
    return types.SimpleNamespace(
        forward_mode=_VerifyMode(),
        rids=["a", "b"],
        seq_lens_cpu=torch.tensor([5, 3]),
        seq_lens=None,
        out_cache_loc=torch.tensor(out_cache_loc),
        extend_seq_lens_cpu=None,
        req_pool_indices=torch.tensor([1, 2]),
        spec_info=types.SimpleNamespace(draft_token_num=draft_token_num),
    )


def test_a_verify_forward_writes_its_draft_window_and_reads_prefix_and_window(probes):
    """TARGET_VERIFY: seq_lens are the cached prefix; each request writes draft_token_num slots
    (its row's next positions) and attends over the prefix and those tokens."""
    pool = FakePool()
    pool.req_to_token[1, :7] = torch.tensor([4, 5, 6, 7, 8, 9, 10])
    pool.req_to_token[2, :5] = torch.tensor([12, 13, 14, 15, 16])
    runner = types.SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
    rt.State.row_sampler = RowSampler(every=1)
    hook = hr.forward_hook("forward")
    hook(lambda self, fb: None, runner, _verify_batch([9, 10, 15, 16], 2))
    ((_, (rids, seq_lens, written), kwargs),) = probes.named("forward")
    assert arr(seq_lens) == [7, 5] and arr(written) == [9, 10, 15, 16]
    assert arr(kwargs["written_counts"]) == [2, 2]
    assert arr(kwargs["read_pages"]) == [4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16]
    # a layout that does not split by the draft width: no writes, reads of the cached prefix only
    hook(lambda self, fb: None, runner, _verify_batch([9, 10, 15], 2))
    (_, (_, seq_lens, written), kwargs) = probes.named("forward")[-1]
    assert arr(seq_lens) == [5, 3] and arr(written) == [] and arr(kwargs["written_counts"]) == [0, 0]


def test_alloc_for_spec_decode_assigns_the_rows_allocated_ahead(probes):
    """alloc_for_spec_decode writes req_to_token[row, cur:nxt] with a kernel: read back after the
    call, per request that grew; a request that did not grow and a call that allocated nothing
    report nothing."""
    pool = FakePool()
    pool.req_to_token[1, 6:12] = torch.arange(30, 36)
    pool.req_to_token[2, 9:12] = torch.tensor([50, 51, 52])
    reqs = [_req("a", row=1), _req("b", row=2), _req("c", row=3)]
    hook = hr.alloc_for_spec_decode_hook("alloc_for_spec_decode")
    kwargs = dict(
        reqs=reqs,
        req_pool_indices=torch.tensor([1, 2, 3]),
        cur_kv_lens_cpu=torch.tensor([6, 9, 12]),
        nxt_kv_lens_cpu=torch.tensor([12, 12, 12]),
    )
    hook(lambda tc, rtp, **kw: None, None, pool, num_needed_tokens=9, **kwargs)
    got = [(c[1][0], c[1][1], c[1][2], c[1][3], arr(c[1][4])) for c in probes.named("rows_assigned")]
    assert got == [("a", 6, 12, 6, [30, 31, 32, 33, 34, 35]), ("b", 9, 12, 9, [50, 51, 52])]
    hook(lambda tc, rtp, **kw: None, None, pool, num_needed_tokens=0, **kwargs)
    assert len(probes.named("rows_assigned")) == 2


# --------------------------------------------------------------------------- requests
def test_reject_phase():
    assert hq.reject_phase([("/s/managers/scheduler.py", "handle_generate_request")]) == "admission"
    assert hq.reject_phase([("/s/disaggregation/prefill.py", "add")]) == "admission"
    assert hq.reject_phase([("/s/disaggregation/decode.py", "pop_transferred")]) == "transfer"
    assert hq.reject_phase([("/s/disaggregation/prefill.py", "handle_bootstrap_failure")]) == "transfer"
    assert hq.reject_phase([("/s/disaggregation/decode.py", "process_decode_queue")]) == "decode"
    assert hq.reject_phase([("/s/managers/x.py", "f"), ("/s/managers/y.py", "retract_decode")]) == "decode"
    # a client's AbortReq goes through the same set_finish_with_abort / prepare_abort: not a refusal
    assert (
        hq.reject_phase(
            [("/s/managers/schedule_batch.py", "set_finish_with_abort"), ("/s/managers/scheduler.py", "abort_request")]
        )
        == "client_abort"
    )
    assert (
        hq.reject_phase(
            [
                ("/s/disaggregation/utils.py", "prepare_abort"),
                ("/s/managers/scheduler.py", "process_pending_chunked_abort"),
            ]
        )
        == "client_abort"
    )


def test_reject_and_release(probes):
    r = _req("long", prompt=300, routing_key="tenant-x", bootstrap_host="2.2.2.2", bootstrap_room=7)

    def set_finish_with_abort(self, error_msg):
        self.origin_input_ids = [0]
        self.to_finish = "abort"

    hook = hq.set_finish_with_abort_hook("set_finish_with_abort")
    src = "def handle_generate_request(hook, orig, req):\n    hook(orig, req, 'too long')\n"
    ns = {}
    exec(compile(src, "/x/sglang/srt/managers/scheduler.py", "exec"), ns)
    ns["handle_generate_request"](hook, set_finish_with_abort, r)
    ((_, begin, _),) = probes.named("request_begin")
    assert begin == ("long", "tenant-x", 7, 300, 0, True)  # prompt length before the placeholder
    ((_, rej, _),) = probes.named("rejected")
    assert rej == ("long", "admission", "too long")
    release = hq.release_kv_cache_hook("release_kv_cache")
    release(None, r, None, checkpoint=False)  # not finished (e.g. retraction): no end
    assert probes.named("request_end") == []
    r.finished_reason = types.SimpleNamespace(to_json=lambda: {"type": "abort", "message": "too long"})
    r.output_ids = [5]
    release(None, r, None, checkpoint=False)
    release(None, r, None, checkpoint=False)  # once per rid
    ((_, end, _),) = probes.named("request_end")
    assert end[0] == "long" and end[1] == "reject" and end[4] == 1 and end[5] == "too long"
    assert len(probes.named("request_begin")) == 1


def test_tenant_fields(monkeypatch, probes):
    r = _req("x", routing_key=None, extra_key="ek")
    monkeypatch.delenv(rt.TENANT_FIELDS_ENV, raising=False)
    rt.State.tenant_fields = rt.tenant_fields_from_env()
    assert rt.tenant_of(r) == "ek"  # the default reads extra_key after routing_key (what the router forwards)
    assert rt.tenant_of(_req("y", routing_key="rk", extra_key="ek")) == "rk"
    monkeypatch.setenv(rt.TENANT_FIELDS_ENV, "routing_key")
    rt.State.tenant_fields = rt.tenant_fields_from_env()
    assert rt.tenant_of(r) == ""
    rt.State.tenant_fields = rt.DEFAULT_TENANT_FIELDS  # as the rest of the module expects
    assert rt.is_warmup(_req("HEALTH_CHECK_123")) and not rt.is_warmup(_req("abc"))


# --------------------------------------------------------------------------- disaggregation
def test_pop_transferred_classifies(probes):
    from kvguard.engine_hooks.sglang import hooks_disagg as hd

    ok, bad, waiting = _req("ok", bootstrap_room=1), _req("bad", bootstrap_room=2), _req("wait", bootstrap_room=3)
    queue = types.SimpleNamespace(queue=[types.SimpleNamespace(req=r) for r in (ok, bad, waiting)])

    def pop_transferred(self, rids_to_check=None):
        self.queue = [dr for dr in self.queue if dr.req is waiting]
        return [ok]

    hook = hd.pop_transferred_hook("pop_transferred")
    assert hook(pop_transferred, queue) == [ok]
    got = [c[1] for c in probes.named("transfer_done")]
    assert got == [("ok", 1, "receiver", "success"), ("bad", 2, "receiver", "failed")]


def test_send_kv_chunk_range(probes):
    from kvguard.engine_hooks.sglang import hooks_disagg as hd

    pool = FakePool()
    pool.req_to_token[1, :10] = torch.arange(40, 50)
    sched = types.SimpleNamespace(req_to_token_pool=pool)
    r = _req("p", row=1, bootstrap_room=9)
    r.start_send_idx = 0

    def send_kv_chunk(self, req, last_chunk=False, end_idx=None):
        req.start_send_idx = end_idx if end_idx is not None else 10

    hook = hd.send_kv_chunk_hook("send_kv_chunk")
    hook(send_kv_chunk, sched, r, last_chunk=False, end_idx=8)
    hook(send_kv_chunk, sched, r, last_chunk=False, end_idx=8)  # nothing new: not reported
    hook(send_kv_chunk, sched, r, True)
    got = [(c[1][0], c[1][1], c[1][2], c[1][3], arr(c[1][4]), c[1][5], c[2]) for c in probes.named("transfer_sent")]
    assert got == [
        ("p", 9, 0, 8, list(range(40, 48)), False, {"unit": "slots"}),
        ("p", 9, 8, 10, [48, 49], True, {"unit": "slots"}),
    ]


def test_row_sampler_fixed_interval_and_budget():
    fixed = RowSampler(every=3)
    assert [fixed.due() for _ in range(6)] == [False, False, True, False, False, True]
    assert not any(RowSampler(every=0).due() for _ in range(100))
    # a budget of 10 us per forward: a 45 us gather is affordable every 5th forward on average
    budget = RowSampler(budget_ns=10_000)
    taken = []
    for i in range(1000):
        if budget.due():
            budget.spent(45_000)
            taken.append(i)
    assert taken[0] == 0 and 190 <= len(taken) <= 230  # about 1000 * 10 / 45
    # a cheap gather (batch 1) goes out with every forward
    cheap = RowSampler(budget_ns=10_000)
    assert all(cheap.due() and cheap.spent(2_000) is None for _ in range(50))
    # however expensive, rows go out at least every max_interval forwards
    costly = RowSampler(budget_ns=10_000, max_interval=8)
    hits = [i for i in range(64) if costly.due() and costly.spent(10_000_000) is None]
    assert [b - a for a, b in zip(hits, hits[1:])] == [8] * (len(hits) - 1)


def test_row_sampler_from_env(caplog):
    assert from_env({}).budget_ns == 30_000  # default: the budget
    only_every = from_env({"KVGUARD_ROW_SAMPLE_EVERY": "1"})
    assert (only_every.every, only_every.budget_ns) == (1, 0)  # explicit interval: fixed, as before
    both = from_env({"KVGUARD_ROW_SAMPLE_EVERY": "32", "KVGUARD_ROW_SAMPLE_BUDGET_US": "50"})
    assert (both.budget_ns, both.max_interval) == (50_000, 32)
    off = from_env({"KVGUARD_ROW_SAMPLE_BUDGET_US": "0"})
    assert (off.every, off.budget_ns) == (16, 0)
    with caplog.at_level("ERROR", logger="kvguard.sglang"):
        bad = from_env({"KVGUARD_ROW_SAMPLE_BUDGET_US": "-3"})
    assert bad.budget_ns == 30_000 and "KVGUARD_ROW_SAMPLE_BUDGET_US='-3'" in caplog.text


# --------------------------------------------------------------------------- page identity
def _identity_calls(probes):
    return [(c[1][0], c[1][1], c[1][2], [int(x) for x in c[1][3]]) for c in probes.named("page_identity")]


def test_page_identity_reports_hit_then_written_pages_chunks_and_decode_pages(probes, monkeypatch):
    """KVGUARD_PAGE_IDENTITY=1, page size 2: a first extend with a 2-page radix hit, a later chunk
    continuing the chain, then the release of the finished request: the pages its decode
    completed, up to its committed length, before REQ_END; every id the definition's."""
    from array import array

    from kvguard.engine_hooks.page_identity import PageIdentity

    monkeypatch.setenv("KVGUARD_PAGE_IDENTITY", "1")
    rt.State.page_size = 2
    pool = FakePool()
    prompt = array("q", range(100, 111))  # 11 tokens
    r = _req("a", row=1, origin_input_ids=prompt)
    hook = hr.alloc_for_extend_hook("alloc_for_extend")
    first = types.SimpleNamespace(reqs=[r], prefix_lens=[4], seq_lens_cpu=torch.tensor([7]), req_to_token_pool=pool)
    hook(lambda batch: ("out", None, None), first)
    r.kv.holds_kv = True
    later = types.SimpleNamespace(reqs=[r], prefix_lens=[7], seq_lens_cpu=torch.tensor([11]), req_to_token_pool=pool)
    hook(lambda batch: ("out", None, None), later)
    r.output_ids = array("q", [7, 8, 9, 10])
    r.kv.kv_committed_len = 14  # the last output token's KV is not written
    r.finished_reason = types.SimpleNamespace(to_json=lambda: {"type": "length"})
    hq.release_kv_cache_hook("release_kv_cache")(None, r, None, checkpoint=True)

    from kvguard.engine_hooks.sglang.identity_hooks import Identity

    assert Identity.chain is not None
    salt = Identity.chain._salt
    want = PageIdentity(2, salt).chain(np.array(list(prompt) + [7, 8, 9, 10]), 0, 7).tolist()
    assert (
        _identity_calls(probes)
        == [
            ("a", 0, "hit", want[0:2]),  # the radix cache's 4 tokens
            ("a", 2, "written", want[2:3]),  # positions 4-5 (6 is half a page)
            ("a", 3, "written", want[3:5]),  # the chunk completes pages 3 (6-7) and 4 (8-9)
            ("a", 5, "written", want[5:7]),  # decode completed 10-11 and 12-13 (committed 14)
        ]
    )
    names = [c[0] for c in probes.calls]
    assert names.index("page_identity", names.index("rows_assigned")) > names.index("rows_assigned")
    assert names[-1] == "request_end"  # after the release's identities: the sidecar's row is still there
    assert "a" not in Identity.tips


def test_page_identity_is_off_by_default_and_a_failure_switches_it_off_not_the_engine(probes, monkeypatch):
    pool = FakePool()
    hook = hr.alloc_for_extend_hook("alloc_for_extend")
    batch = types.SimpleNamespace(
        reqs=[_req("a", row=1, prompt=8)], prefix_lens=[0], seq_lens_cpu=torch.tensor([8]), req_to_token_pool=pool
    )
    assert hook(lambda batch: "out", batch) == "out"
    assert probes.named("page_identity") == []  # not asked for
    rt.State.reset()
    rt.State.hello_done = True
    monkeypatch.setenv("KVGUARD_PAGE_IDENTITY", "on")
    broken = _req("b", row=1, origin_input_ids=["x"] * 8)  # token ids it cannot read
    batch.reqs = [broken]
    assert hook(lambda batch: "out", batch) == "out"  # the engine's result, whatever identity did
    ((_, (name, exc), _),) = probes.named("report_probe_error")
    assert name == "page_identity" and isinstance(exc, Exception)
    batch.reqs = [_req("c", row=1, prompt=8)]
    hook(lambda batch: "out", batch)
    assert probes.named("page_identity") == [] and probes.named("rows_assigned")  # off; the rows still go

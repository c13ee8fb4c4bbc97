"""Mamba / linear-attention state slots on SGLang (engine_hooks/sglang/hooks_state.py), on the
engine's real slot allocator: ``MambaSlotAllocator`` loaded from each installed SGLang's own
source file (it needs only torch), with kvguard's hooks wrapped around it as SGLang's
HookRegistry does, the real Probes, and the sidecar's real pipeline judging what they wrote.

Both ways: a clean life of several requests (group pre-allocation and its return, a radix-tree
hand-over at finish, the tree's later eviction, a retraction that gets the same slot number
back, a flush) raises nothing; a slot freed under its request and handed to another is reported
with the reader and the exposed tenant named, on the state pool. The engine-level proof is
tests/integration/test_state_sglang_engines.py (Qwen3-Next on a real engine).
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import coverage as cv  # noqa: E402
from kvguard.engine_hooks import probes as probes_mod  # noqa: E402
from kvguard.engine_hooks import wire  # noqa: E402
from kvguard.engine_hooks.probes import Probes  # noqa: E402
from kvguard.engine_hooks.sglang import _runtime as rt  # noqa: E402
from kvguard.engine_hooks.sglang import coverage as cv_sglang  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_requests as hq  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_state as hs  # noqa: E402
from kvguard.engine_hooks.sglang import plugin  # noqa: E402
from kvguard.sidecar.pipeline import Pipeline  # noqa: E402
from tests.engine_side.test_sglang_adapter import wrap  # noqa: E402  (HookRegistry's wrapping, as the adapter tests apply it)
from tests.support.recording_probes import CaptureWriter, judged  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.5.19", "0.5.23")
SLOTS = 6


def real_allocator_class(version: str):
    """``MambaSlotAllocator`` from SGLang ``version``'s own file, as a fresh module (the hooks
    wrapped on it here touch no other test)."""
    path = REPO / ".venv" / "sglang" / version / "sglang" / "srt" / "mem_cache" / "allocator" / "mamba.py"
    if not path.exists():
        pytest.skip(f"SGLang {version} is not unpacked under .venv/sglang (make sglang-versions)")
    spec = importlib.util.spec_from_file_location(f"kvg_mamba_{version.replace('.', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.MambaSlotAllocator


def hooked(cls):
    """The class with every state hook of plugin.py on it (the specs' own factories)."""
    for spec in plugin._STATE:
        attr = spec.target.rsplit(".", 1)[1]
        wrap(cls, attr, spec.factory(f"MambaSlotAllocator.{attr}"), spec.kind)
    return cls


class Engine:
    """The adapter's half of a hybrid engine: HELLO, the state pool declared by the same code
    the scheduler hook runs, and the sidecar's pipeline behind a capturing ring."""

    def __init__(self, allocator_cls):
        self.cap = CaptureWriter()
        self.p = Probes(self.cap, page_size=1)
        probes_mod.reset_probes_for_tests(self.p)
        rt.State.reset()
        self.alloc = hooked(allocator_cls)(SLOTS, "cpu")  # clear() at construction: before HELLO, silent
        self.mapping = torch.zeros(8, dtype=torch.int32)  # req_index_to_mamba_index_mapping: row -> slot
        self.rtt = types.SimpleNamespace(
            mamba_allocator=self.alloc, mamba_pool=None, req_index_to_mamba_index_mapping=self.mapping
        )
        self.p.hello("unified", 0, 1, 1024, 1024, 1024, 1024, "sglang", "0.5.23", "tiny-qwen3-next")
        items = [cv.item("kv_pool", cv.OWNERSHIP, 0, "MHA"), cv.item("state_pool", cv.OWNERSHIP, 0, "mamba")]
        self.p.coverage(items)
        hq._declare_pools(types.SimpleNamespace(req_to_token_pool=self.rtt), items)
        rt.State.hello_done = True
        self.runner = types.SimpleNamespace(req_to_token_pool=self.rtt)
        self.pipeline = Pipeline()
        self.reqs: dict[str, types.SimpleNamespace] = {}
        assert self.judge() == []

    def close(self):
        probes_mod.reset_probes_for_tests(None)
        rt.State.reset()

    def judge(self) -> list:
        return judged(self.pipeline, self.cap)

    def admit(self, rid: str, tenant: str, row: int, held: bool = False):
        """alloc_for_extend for one request: HybridReqToTokenPool.alloc takes a slot unless the
        request holds one; the hook sends the request's state row."""
        req = self.reqs.get(rid) or types.SimpleNamespace(rid=rid, kv=types.SimpleNamespace(mamba_pool_idx=None))
        self.reqs[rid] = req
        if req.kv.mamba_pool_idx is None:
            req.kv.mamba_pool_idx = self.alloc.alloc(1)[0]
        self.mapping[row] = int(req.kv.mamba_pool_idx)
        req.row = row
        if rid not in rt.State.begun:
            rt.State.begun[rid] = True
            self.p.request_begin(rid, tenant, None, 16, 0, False)
        hs.assign([req], [held])
        return req

    def forward(self, *rids: str, sampled: bool = True):
        fb = types.SimpleNamespace(req_pool_indices=torch.tensor([self.reqs[r].row for r in rids]))
        hs.forward(self.runner, fb, list(rids), sampled)

    def release(self, rid: str, to_tree: bool):
        """The request finishes: its slot goes to the radix tree (no free) or back to the allocator."""
        req = self.reqs.pop(rid)
        if not to_tree:
            self.alloc.free(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_pool_idx = None
        self.p.request_end(rid, "stop", 1, 2, 1, "")
        rt.State.ended[rid] = True
        hs.forget(rid)


@pytest.fixture(params=VERSIONS)
def engine(request):
    e = Engine(real_allocator_class(request.param))
    yield e
    e.close()


def kinds(found) -> list[str]:
    return [f.kind for f in found]


def records(cap_records, pool=1) -> list:
    return [(r.kind.name, r) for r in cap_records if r.pool == pool]


# --------------------------------------------------------------------------- the records
def test_the_group_pre_allocation_is_allocated_once_and_its_rest_returned(engine):
    engine.alloc.alloc_group_begin(4)  # the scheduler's pre-allocation for matching
    a = engine.alloc.alloc(1)  # drawn from the group: no second ALLOC
    engine.alloc.alloc_group_end()  # the three unused come back through free()
    recs = engine.cap.take()
    assert [(r.kind, r.pool) for r in recs] == [(wire.Kind.ALLOC, 1), (wire.Kind.FREE, 1)]
    assert recs[0].body.pages.tolist() == [1, 2, 3, 4]
    assert sorted(recs[1].body.pages.tolist()) == [2, 3, 4] and int(a[0]) == 1
    # another allocator instance (a draft's clone, a checkpoint pool's) reports nothing
    other = type(engine.alloc)(SLOTS, "cpu")
    other.alloc(2)
    other.free(torch.tensor([1]))
    assert engine.cap.take() == []


def test_the_padding_slot_is_never_reported_and_clear_frees_what_was_taken(engine):
    engine.alloc.alloc(3)
    engine.alloc.free(torch.tensor([0, 2]))  # slot 0: padding, never handed out
    engine.alloc.clear()  # flush_cache: 1 and 3 were still taken
    frees = [r.body.pages.tolist() for r in engine.cap.take() if r.kind == wire.Kind.FREE]
    assert frees == [[2], [1, 3]]


def test_nothing_before_hello_or_when_no_state_pool_was_declared(engine):
    rt.State.hello_done = False
    engine.alloc.alloc(1)
    rt.State.hello_done, rt.State.state_pool = True, 0
    engine.alloc.alloc(1)
    assert engine.cap.take() == []


def test_a_request_row_is_sent_on_admission_and_when_its_slot_changes_only(engine):
    engine.admit("a", "acme", row=1)
    engine.admit("a", "acme", row=1, held=True)  # a later chunk: the same slot, nothing new
    assigns = [r for r in engine.cap.take() if r.kind == wire.Kind.ASSIGN]
    assert len(assigns) == 1 and assigns[0].pool == 1
    assert (assigns[0].body.row_start, assigns[0].body.row_end, assigns[0].body.pages.tolist()) == (0, 1, [1])


# --------------------------------------------------------------------------- judged: clean
def test_a_clean_life_of_requests_raises_nothing(engine):
    e = engine
    e.alloc.alloc_group_begin(2)
    e.admit("a", "acme", row=1)
    e.admit("b", "globex", row=2)
    e.alloc.alloc_group_end()
    for _ in range(3):
        e.forward("a", "b")
        e.forward("a", "b", sampled=False)  # the model's rows
    e.release("a", to_tree=True)  # its slot is the tree's now: cached, not free
    e.forward("b")
    # the tree evicts a's state (no request attached), then c gets that slot
    e.alloc.free(torch.tensor([1]))
    e.admit("c", "initech", row=1)
    e.forward("b", "c")
    # b is retracted (slot freed) and re-admitted; it may get its old slot number back
    slot_b = int(e.reqs["b"].kv.mamba_pool_idx)
    e.alloc.free(e.reqs["b"].kv.mamba_pool_idx.unsqueeze(0))
    e.reqs["b"].kv.mamba_pool_idx = None
    e.alloc.free_slots = torch.cat((torch.tensor([slot_b]), e.alloc.free_slots[e.alloc.free_slots != slot_b]))
    e.admit("b", "globex", row=2)
    assert int(e.reqs["b"].kv.mamba_pool_idx) == slot_b
    e.forward("b", "c")
    e.release("b", to_tree=False)
    e.release("c", to_tree=True)
    e.alloc.clear()
    assert e.judge() == []
    (stats,) = e.pipeline.engine_stats()
    (pool,) = stats.pools
    assert (pool.index, pool.kind) == (1, "state") and pool.pages_read > 0 and stats.pages_unverified == 0


# --------------------------------------------------------------------------- judged: the leak
def test_a_slot_freed_under_its_request_and_handed_to_another_is_reported_with_both_named(engine):
    e = engine
    e.admit("victim", "acme", row=1)
    e.forward("victim")
    assert e.judge() == []
    # the bug: the victim's slot goes back to the allocator while it still decodes, and the
    # next admission gets it
    slot = e.reqs["victim"].kv.mamba_pool_idx
    e.alloc.free(slot.unsqueeze(0))
    e.alloc.free_slots = torch.cat((slot.unsqueeze(0), e.alloc.free_slots[:-1]))
    e.admit("other", "globex", row=2)
    assert int(e.reqs["other"].kv.mamba_pool_idx) == int(slot)
    e.forward("other")
    e.forward("victim", "other")
    found = e.judge()
    assert found, "a state slot handed to another request while its owner still reads it went unseen"
    reads = [f for f in found if f.reader is not None and f.reader.rid == "victim"]
    assert reads, [(f.kind, f.reader) for f in found]
    f = reads[0]
    assert f.evidence["pool"] == 1 and f.evidence["pool_kind"] == "state", f.evidence
    assert int(slot) in f.pages and any(x.tenant == "globex" for x in f.exposed), f
    assert set(kinds(found)) <= {"foreign_read", "late_write", "use_after_free"}, kinds(found)


def test_the_engine_mapping_pointing_at_another_requests_slot_is_caught_on_a_sampled_read(engine):
    """The adapter's model says the right slot; the engine's own mapping (what the kernels
    use) points the victim at another request's slot: the sampled read shows it."""
    e = engine
    e.admit("victim", "acme", row=1)
    e.admit("other", "globex", row=2)
    e.forward("victim", "other")
    assert e.judge() == []
    e.mapping[1] = e.mapping[2]  # corrupted: victim's row -> other's slot
    e.forward("victim", "other", sampled=False)  # the model's rows: nothing to see
    assert e.judge() == []
    e.forward("victim", "other")
    found = e.judge()
    assert kinds(found) == ["foreign_read"], kinds(found)
    assert found[0].reader.rid == "victim" and [x.tenant for x in found[0].exposed] == ["globex"]


# --------------------------------------------------------------------------- coverage
def _sched(rtt_name="HybridReqToTokenPool", alloc_name="MambaSlotAllocator", **rtt_fields):
    alloc = type(alloc_name, (), {"size": 16})()
    rtt = type(rtt_name, (), {})()
    rtt.mamba_allocator, rtt.mamba_pool = alloc, None
    for k, v in rtt_fields.items():
        setattr(rtt, k, v)
    return types.SimpleNamespace(req_to_token_pool=rtt)


@pytest.mark.parametrize(
    "sched_kwargs,args,why",
    [
        ({"rtt_name": "SomeOtherStatePool"}, {}, "not a state pool layout"),
        ({"alloc_name": "ByteCoordinatedAllocator"}, {}, "ByteCoordinatedAllocator is not hooked"),
        ({"enable_mamba_extra_buffer": True}, {}, "extra_buffer"),
        ({"mamba_ckpt_pool": object()}, {}, "int8 checkpoint pool"),
        ({}, {"spec": True}, "speculative decoding"),
        ({}, {"hicache": True}, "HiCache"),
        ({}, {"role": "decode"}, "decode engine"),
        ({}, {"version": "0.5.19"}, "not verified on SGLang 0.5.19"),
        ({}, {"registered": False}, "not hooked"),
    ],
)
def test_state_engines_kvguard_does_not_follow_are_declared_with_the_reason(monkeypatch, sched_kwargs, args, why):
    registered = args.pop("registered", True)
    monkeypatch.setattr(plugin, "registered", list(plugin.STATE_TARGETS) if registered else [])
    call = {"version": "0.5.23", "role": "unified", "spec": False, "hicache": False, **args}
    item = cv_sglang.state_item(_sched(**sched_kwargs), **call)
    assert item.component == "state_pool" and not item.watched & cv.OWNERSHIP
    assert why in item.detail, item.detail


def test_the_verified_layout_is_watched(monkeypatch):
    monkeypatch.setattr(plugin, "registered", list(plugin.STATE_TARGETS))
    item = cv_sglang.state_item(_sched(), "0.5.23", "unified", False, False)
    assert item.watched & cv.OWNERSHIP and item.status == wire.CoverageStatus.WATCHED
    assert "16 slots" in item.detail and "prefix hit is not" in item.detail


def test_the_hybrid_token_pool_is_judged_by_its_full_attention_pool():
    mha = type("MHATokenToKVPool", (), {"layer_num": 1})()
    hybrid = type("HybridLinearKVPool", (), {"full_kv_pool": mha})()
    alloc = type("TokenToKVPoolAllocator", (), {"page_size": 1})()
    item = cv_sglang._kv_pool_item(None, alloc, hybrid, "unified", False)
    assert item.watched & cv.OWNERSHIP, item.detail
    assert "HybridLinearKVPool, full-attention layers in MHATokenToKVPool" in item.detail
    odd = type("HybridLinearKVPool", (), {"full_kv_pool": type("NSATokenToKVPool", (), {})()})()
    assert not cv_sglang._kv_pool_item(None, alloc, odd, "unified", False).watched & cv.OWNERSHIP


def test_the_forward_writes_then_reads_each_requests_slot_in_batch_order(engine):
    engine.admit("a", "acme", row=1)
    engine.admit("b", "globex", row=2)
    engine.cap.take()
    engine.forward("b", "a")
    (rec,) = [r for r in engine.cap.take() if r.kind == wire.Kind.FORWARD]
    assert rec.pool == 1
    body = rec.body
    assert np.asarray(body.write_pages).tolist() == [2, 1] and np.asarray(body.read_pages).tolist() == [2, 1]

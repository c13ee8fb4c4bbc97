"""The hybrid sliding-window adapter (engine_hooks/sglang/hooks_swa.py) without an engine: the
hooks' own functions driven the way the SGLang hooks call them, the real Probes, and the
sidecar's real pipeline judging what they wrote. The engine-level proof is
tests/integration/test_swa_sglang_engines.py (GPT-OSS on a real SGLang 0.5.23).

Both ways: a request decoding past its window while SGLang frees the SWA pages behind it, and
another request getting those pages, raises nothing (the row is nulled below the window before
any free); a SWA page freed inside the window and handed to another request is reported on the
SWA pool, with the reader and the other tenant named, whether the forward reads the adapter's
model of the row or the engine's own row.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import coverage as cv  # noqa: E402
from kvguard.engine_hooks import probes as probes_mod  # noqa: E402
from kvguard.engine_hooks import wire  # noqa: E402
from kvguard.engine_hooks.probes import Probes  # noqa: E402
from kvguard.engine_hooks.sglang import _runtime as rt  # noqa: E402
from kvguard.engine_hooks.sglang import coverage as cv_sglang  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_allocator as ha  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_requests as hq  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_swa as swa  # noqa: E402
from kvguard.engine_hooks.sglang import plugin  # noqa: E402
from kvguard.sidecar.pipeline import Pipeline  # noqa: E402
from tests.support.recording_probes import CaptureWriter, judged  # noqa: E402

PS = 4  # page size of both halves
WINDOW = 8  # tokens the window layers read back
FULL_PAGES, SWA_PAGES = 64, 32


def named(cls_name, **fields):
    obj = type(cls_name, (), {})()
    for k, v in fields.items():
        setattr(obj, k, v)
    return obj


class Engine:
    """A hybrid sliding-window engine as the adapter sees it: two allocator halves, a full-to-SWA
    mapping, the SWA pool declared by the same code the scheduler hook runs, each request's
    full row; the sidecar's pipeline behind a capturing ring."""

    def __init__(self):
        self.cap = CaptureWriter()
        self.p = Probes(self.cap, page_size=PS)
        probes_mod.reset_probes_for_tests(self.p)
        rt.State.reset()
        rt.State.page_size = PS
        self.full = named("PagedTokenToKVPoolAllocator", page_size=PS, size=FULL_PAGES * PS, free_group=None)
        self.swa_half = named("PagedTokenToKVPoolAllocator", page_size=PS, size=SWA_PAGES * PS, free_group=None)
        self.mapping = torch.zeros(FULL_PAGES * PS + PS, dtype=torch.int64)
        kvcache = named("SWAKVPool", swa_kv_pool=named("MHATokenToKVPool"), full_kv_pool=named("MHATokenToKVPool"))
        self.alloc = named(
            "SWATokenToKVPoolAllocator",
            page_size=PS,
            full_attn_allocator=self.full,
            swa_attn_allocator=self.swa_half,
            full_to_swa_index_mapping=self.mapping,
            get_kvcache=lambda: kvcache,
        )
        sched = types.SimpleNamespace(token_to_kv_pool_allocator=self.alloc, sliding_window_size=WINDOW)
        self.p.hello("unified", 0, PS, FULL_PAGES, FULL_PAGES * PS, 128, 128, "sglang", "0.5.23", "tiny-gpt-oss")
        items = [cv.item("kv_pool", cv.OWNERSHIP, 0, "SWAKVPool"), cv.item("swa_pool", cv.OWNERSHIP, 0, "window")]
        self.p.coverage(items)
        hq._declare_pools(sched, items)
        rt.State.hello_done = True
        self.pipeline = Pipeline()
        self.rows: dict[str, list[int]] = {}  # rid -> full slots by position
        self.free_full = list(range(1, FULL_PAGES))
        self.free_swa = list(range(1, SWA_PAGES))
        assert self.judge() == []

    def close(self):
        probes_mod.reset_probes_for_tests(None)
        rt.State.reset()

    def judge(self) -> list:
        return judged(self.pipeline, self.cap)

    # -- the allocator halves (hooks_allocator's post hooks, as the class hooks call them)
    def _alloc_pages(self, n: int, swa_page: int | None = None):
        full_pages = [self.free_full.pop(0) for _ in range(n)]
        swa_pages = [self.free_swa.pop(0) for _ in range(n)]
        if swa_page is not None:  # the one the fault handed over
            self.free_swa.remove(swa_page) if swa_page in self.free_swa else None
            swa_pages[0] = swa_page
        full_slots = torch.tensor([p * PS + o for p in full_pages for o in range(PS)])
        swa_slots = torch.tensor([p * PS + o for p in swa_pages for o in range(PS)])
        ha._alloc_post(True, full_slots, self.full)
        ha._alloc_post(True, swa_slots, self.swa_half)
        self.mapping[full_slots] = swa_slots
        return full_slots.tolist()

    def free_swa_pages(self, pages: list[int]):
        """SGLang freeing SWA pages (its eviction, the tree): FREE on the SWA half."""
        ha._free_page_ids_post(True, None, self.swa_half, torch.tensor(pages))
        self.free_swa.extend(pages)

    # -- requests
    def admit(self, rid: str, tenant: str, tokens: int, swa_page: int | None = None):
        self.p.request_begin(rid, tenant, None, tokens, 0, False)
        slots = self._alloc_pages(-(-tokens // PS), swa_page)[:tokens]
        self.rows[rid] = slots
        self.p.rows_assigned(rid, 0, tokens, 0, slots)  # hooks_rows' pool-0 ASSIGN
        block = torch.tensor([slots])
        swa.extend_twins([types.SimpleNamespace(rid=rid)], [False], [0], [tokens], block)
        self.forward([rid], [tokens], [tokens])

    def decode(self, rid: str, sampled: bool = False):
        """One decode step: the window moves (nulled before SGLang's eviction), a page opens
        when the position starts one, then the forward."""
        q0 = len(self.rows[rid])
        swa.null_below_window([rid], [q0])
        if q0 % PS == 0:
            (slot,) = self._alloc_pages(1)[:1]
            self.p.decode_rows_assigned([rid], [q0], [slot])
            swa.decode_twins([rid], np.array([q0]), np.array([slot]))
        else:
            slot = self.rows[rid][-1] + 1
        self.rows[rid].append(slot)
        self.forward([rid], [q0 + 1], [1], sampled)

    def forward(self, rids, seq_lens, counts, sampled: bool = False):
        seq_lens, counts = np.array(seq_lens), np.array(counts)
        out = np.concatenate([self.rows[r][s - c : s] for r, s, c in zip(rids, seq_lens, counts)]).astype(np.int64)
        read_pages = read_counts = None
        if sampled:  # the engine's rows: the page at each page-start position
            read_pages = np.concatenate([np.array(self.rows[r][:s:PS]) // PS for r, s in zip(rids, seq_lens)])
            read_counts = -(-seq_lens // PS)
        self.p.forward(rids, seq_lens, out, written_counts=counts, read_pages=read_pages, read_counts=read_counts)
        swa.forward(rids, seq_lens, counts, out, read_pages, read_counts)

    def swa_page_at(self, rid: str, position: int) -> int:
        return int(self.mapping[self.rows[rid][position]]) // PS


@pytest.fixture
def engine():
    e = Engine()
    yield e
    e.close()


def test_the_swa_pool_is_declared_and_each_halfs_pages_go_to_their_pool(engine):
    recs = engine.cap.take()
    assert recs == []  # (HELLO, COVERAGE, POOL were judged at start)
    assert (rt.State.swa_pool, rt.State.swa_window) == (1, WINDOW)
    assert rt.pool_of(engine.swa_half) == 1 and rt.pool_of(engine.full) == 0 and rt.pool_of(object()) == 0
    engine._alloc_pages(1)
    engine.free_swa_pages([1])
    got = [(r.kind, r.pool, r.body.pages.tolist()) for r in engine.cap.take()]
    assert got == [(wire.Kind.ALLOC, 0, [1]), (wire.Kind.ALLOC, 1, [1]), (wire.Kind.FREE, 1, [1])]
    (stats,) = engine.pipeline.engine_stats() or [None]
    assert stats is None or all(p.kind == "sliding_window" for p in stats.pools)


@pytest.mark.parametrize("sampled", [False, True], ids=["model-rows", "engine-rows"])
def test_decoding_past_the_window_while_its_pages_are_freed_and_reused_raises_nothing(engine, sampled):
    e = engine
    e.admit("a", "acme", 14)
    for _ in range(20):  # a's window slides over 5 pages
        e.decode("a", sampled)
        # SGLang's eviction: every SWA page wholly below a's window goes (as maybe_evict_swa does)
        q0 = len(e.rows["a"])
        behind = {e.swa_page_at("a", pos) for pos in range(0, max(q0 - WINDOW, 0) // PS * PS)}
        gone = sorted(p for p in behind if p not in e.free_swa and p)
        if gone:
            e.free_swa_pages(gone)
    assert e.judge() == []
    # another tenant's request gets the pages a left behind its window, and both decode on
    e.free_swa.sort()
    e.admit("b", "globex", 12)
    for _ in range(4):
        e.decode("a", sampled)
        e.decode("b", sampled)
    assert e.judge() == []
    (stats,) = e.pipeline.engine_stats()
    (pool,) = stats.pools
    assert pool.kind == "sliding_window" and pool.pages_read > 0 and stats.pages_unverified == 0


@pytest.mark.parametrize("sampled", [False, True], ids=["model-rows", "engine-rows"])
def test_a_swa_page_freed_inside_the_window_and_handed_over_is_reported(engine, sampled):
    e = engine
    e.admit("victim", "initech", 30)
    e.decode("victim", sampled)
    assert e.judge() == []
    inside = e.swa_page_at("victim", len(e.rows["victim"]) - 6)  # in the window, not the page it writes
    e.free_swa_pages([inside])
    e.admit("other", "acme", 4, swa_page=inside)
    e.decode("victim", sampled)
    found = e.judge()
    assert [f.kind for f in found] == ["foreign_read"], [(f.kind, f.pages) for f in found]
    f = found[0]
    assert f.reader.rid == "victim" and f.pages == [inside] and f.evidence["pool_kind"] == "sliding_window"
    assert [(p.rid, p.tenant) for p in f.exposed] == [("other", "acme")]


def test_a_free_below_the_window_before_the_bound_moved_would_be_a_false_alarm_without_the_nulling(engine, monkeypatch):
    """The nulling is what keeps SGLang's own evictions quiet: without it, the same run reads
    freed pages (the test above would then fail with use_after_free)."""
    monkeypatch.setattr(swa, "null_below_window", lambda rids, q0s, **kw: None)
    e = engine
    e.admit("a", "acme", 14)
    for _ in range(12):
        e.decode("a")
        q0 = len(e.rows["a"])
        behind = {e.swa_page_at("a", pos) for pos in range(0, max(q0 - WINDOW, 0) // PS * PS)}
        gone = sorted(p for p in behind if p not in e.free_swa and p)
        if gone:
            e.free_swa_pages(gone)
    assert "use_after_free" in [f.kind for f in e.judge()]


def test_a_rebind_below_the_window_is_sent_as_page_0(engine):
    e = engine
    e.admit("a", "acme", 14)
    for _ in range(10):
        e.decode("a")
    e.cap.take()
    bound = rt.State.swa_nulled["a"]
    assert bound == (len(e.rows["a"]) - WINDOW) // PS * PS  # the next forward's window
    swa.write_twin("a", 0, len(e.rows["a"]), len(e.rows["a"]), torch.tensor(e.rows["a"]))  # a radix rebind
    (rec,) = e.cap.take()
    assert rec.pool == 1 and rec.body.pages.tolist()[: bound // PS] == [0] * (bound // PS)
    assert all(p > 0 for p in rec.body.pages.tolist()[bound // PS :])


# --------------------------------------------------------------------------- coverage
def _swa_sched(**alloc_fields):
    full = named("PagedTokenToKVPoolAllocator")
    half = named("PagedTokenToKVPoolAllocator")
    pool = named("SWAKVPool", full_kv_pool=named("MHATokenToKVPool"), swa_kv_pool=named("MHATokenToKVPool"))
    fields = {"page_size": PS, "full_attn_allocator": full, "swa_attn_allocator": half, **alloc_fields}
    alloc = named("SWATokenToKVPoolAllocator", **fields)
    return types.SimpleNamespace(sliding_window_size=WINDOW), alloc, pool


@pytest.mark.parametrize(
    "fields,call,why",
    [
        ({"swa_req_ring": True}, {}, "per-request SWA ring"),
        ({"swa_attn_allocator": named("NPUPagedTokenToKVPoolAllocator")}, {}, "not hooked"),
        ({}, {"spec": True}, "draft window"),
        ({}, {"hicache": True}, "HiCache"),
        ({}, {"role": "decode"}, "decode engine"),
        ({}, {"version": "0.5.19"}, "not verified on SGLang 0.5.19"),
    ],
)
def test_sliding_window_engines_kvguard_does_not_follow_are_declared(fields, call, why):
    sched, alloc, pool = _swa_sched(**fields)
    args = {"role": "unified", "hicache": False, "version": "0.5.23", "spec": False, **call}
    item = cv_sglang._kv_pool_item(sched, alloc, pool, args["role"], args["hicache"], args["version"], args["spec"])
    assert not item.watched & cv.OWNERSHIP and why in item.detail, item.detail
    assert "SWATokenToKVPoolAllocator not followed" in item.detail


def test_the_verified_layout_is_watched_with_its_window():
    sched, alloc, pool = _swa_sched()
    item = cv_sglang._kv_pool_item(sched, alloc, pool, "unified", False, "0.5.23", False)
    assert item.watched & cv.OWNERSHIP and "SWAKVPool, full-attention layers in MHATokenToKVPool" in item.detail
    swa_item = cv_sglang.swa_item(sched, pool)
    assert swa_item.watched & cv.OWNERSHIP and f"window {WINDOW} tokens" in swa_item.detail
    assert plugin.SUPPORTED["0.5.23"]  # (the class hooks that fire for both halves are the common ones)

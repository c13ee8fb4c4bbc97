"""The vLLM adapter's hooks on stand-ins for vLLM's objects (no vLLM needed): what each hook
emits, and that the version gate installs nothing for an unsupported release. The same hooks
on the real engine: tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import logging
import sys
import time
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvguard.engine_hooks import probes as probes_mod
from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.vllm import _runtime as rt
from kvguard.engine_hooks.vllm import hooks_core as hc
from kvguard.engine_hooks.vllm import hooks_worker as hw
from kvguard.engine_hooks.vllm import plugin
from tests.support.recording_probes import CaptureWriter

PAGE = 32


@pytest.fixture
def captured():
    cap = CaptureWriter()
    probes_mod.reset_probes_for_tests(Probes(cap, page_size=PAGE))
    rt.State.reset()
    yield cap
    probes_mod.reset_probes_for_tests(None)
    rt.State.reset()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 1
    block_hash: object = None
    is_null: bool = False
    pool: object = None


@dataclass(eq=False)
class Pool:
    blocks: list = field(default_factory=list)
    cached_block_hashes_by_block: dict = field(default_factory=dict)


def _free(pool, blocks):  # what BlockPool.free_blocks does to the counts
    for b in blocks:
        b.ref_cnt -= 1


def _pool(n=8):
    pool = Pool()
    pool.blocks = [Block(i, 0, pool=pool, is_null=i == 0) for i in range(n)]
    rt.State.block_pool, rt.State.page_size, rt.State.hello_done = pool, PAGE, True
    return pool


def test_a_free_is_reported_only_when_nothing_can_read_the_block_again(captured):
    pool = _pool()
    b = pool.blocks
    b[1].ref_cnt, b[2].ref_cnt, b[3].ref_cnt, b[4].ref_cnt = 1, 1, 2, 0
    b[2].block_hash = "h"  # a prefix-cache block: readable at 0 until evicted
    wrapper = hc.free_blocks(_free, "BlockPool.free_blocks")
    wrapper(pool, reversed([b[1], b[2], b[3], b[4]]))  # (an iterator, as vLLM passes it)
    assert [b[i].ref_cnt for i in (1, 2, 3, 4)] == [0, 0, 1, -1]  # the engine saw every block
    (rec,) = captured.take()
    # 1: unhashed at 0; 4: freed more often than handed out; not 2 (cached), not 3 (still held)
    assert rec.kind == wire.Kind.FREE and sorted(rec.body.pages.tolist()) == [1, 4]


def test_an_eviction_outside_an_allocation_frees_the_block(captured):
    pool = _pool()
    hc.evict_post(None, True, pool, pool.blocks[5])
    assert [r.body.pages.tolist() for r in captured.take()] == [[5]]
    hc.get_new_blocks_pre(pool, 1)  # inside get_new_blocks: the allocation says it
    hc.evict_post(None, True, pool, pool.blocks[6])
    hc.get_new_blocks_post(None, [pool.blocks[6]], pool, 1)
    (rec,) = captured.take()
    assert rec.kind == wire.Kind.ALLOC and rec.body.pages.tolist() == [6]


def test_a_prefix_cache_reset_frees_only_the_cached_blocks_nobody_holds(captured):
    """Blocks at 0 without a hash were reported free when they reached 0: saying it again at
    a reset was a false double_free (found with /reset_prefix_cache on the real engine)."""
    pool = _pool()
    b = pool.blocks
    b[2].block_hash = b[3].block_hash = "h"
    b[3].ref_cnt = 1  # cached and held: still readable after the reset
    cached_idle = hc.reset_prefix_cache_pre(pool)
    for block in b:
        block.block_hash = None  # what the reset does
    hc.reset_prefix_cache_post(cached_idle, True, pool)
    (rec,) = captured.take()
    assert rec.kind == wire.Kind.FREE and rec.body.pages.tolist() == [2]
    hc.reset_prefix_cache_post(hc.reset_prefix_cache_pre(pool), False, pool)  # a refused reset frees nothing
    assert captured.take() == []


def _step(new=(), cached=(), resumed=()):
    """The fields of a SchedulerOutput the hook reads: ``new`` (rid, block ids, computed),
    ``cached`` (rid, block ids gained or None, computed)."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[
            types.SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c in new
        ],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[None if ids is None else (ids,) for _, ids, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(resumed),
        ),
    )


def test_a_steps_rows_become_a_begin_and_the_blocks_each_row_gained(captured):
    _pool()
    request = types.SimpleNamespace(
        num_prompt_tokens=70,
        cache_salt="s",
        sampling_params=types.SimpleNamespace(extra_args={"kvguard_tenant": "acme"}),
    )
    scheduler = types.SimpleNamespace(requests={"r": request})
    hc.schedule_post(None, _step(new=[("r", [3, 4, 5], 32)]), scheduler)  # a 32-token prefix hit
    begin, scope, assign = captured.take()
    assert begin.kind == wire.Kind.REQ_BEGIN and (begin.body.tenant, begin.body.cached_tokens) == ("acme", 32)
    assert scope.kind == wire.Kind.REQ_SCOPE
    assert (assign.body.row_start, assign.body.shared_until, assign.body.pages.tolist()) == (0, 32, [3, 4, 5])
    hc.schedule_post(None, _step(cached=[("r", None, 70)]), scheduler)
    assert captured.take() == []  # a decode token inside the last block: nothing new
    hc.schedule_post(None, _step(cached=[("r", [6], 96)]), scheduler)
    (assign,) = captured.take()
    assert (assign.body.row_start, assign.body.shared_until, assign.body.pages.tolist()) == (96, 96, [6])
    # preempted, then resumed: a whole new row, its own cached block shared
    hc.schedule_post(None, _step(cached=[("r", [3, 7], 32)], resumed=["r"]), scheduler)
    (assign,) = captured.take()  # (no second REQ_BEGIN)
    assert (assign.body.row_start, assign.body.shared_until, assign.body.pages.tolist()) == (0, 32, [3, 7])
    hc.schedule_post(None, _step(cached=[("unseen", [9], 400)]), scheduler)
    assert captured.take() == []  # a row never seen begin (attached mid-run): not placed anywhere


def _free_request(scheduler, request) -> None:
    """``Scheduler._free_request`` as the plugin wraps it: pre, the engine (blocks freed: the
    request leaves ``requests``), post."""
    end_args = hc.free_request_pre(scheduler, request)
    scheduler.requests.pop(request.request_id, None)
    hc.free_request_post(end_args, None, scheduler, request)


def test_a_finished_request_ends_once_and_one_never_scheduled_not_at_all(captured):
    rt.State.hello_done = True
    rt.State.begun["r"] = True
    scheduler = types.SimpleNamespace(requests={})
    req = types.SimpleNamespace(request_id="r", num_output_tokens=5, stop_reason=None, get_finished_reason=lambda: 1)
    _free_request(scheduler, req)
    _free_request(scheduler, req)
    _free_request(scheduler, types.SimpleNamespace(request_id="never", get_finished_reason=lambda: 2))
    (end,) = captured.take()
    assert end.kind == wire.Kind.REQ_END and end.body.finish == wire.Finish.LENGTH and end.body.output_tokens == 5


def test_ttft_runs_from_the_first_forward_to_the_first_token_and_a_preempted_request_says_so(captured):
    _pool()
    a = types.SimpleNamespace(num_prompt_tokens=40, num_output_tokens=0, cache_salt=None, sampling_params=None)
    b = types.SimpleNamespace(num_prompt_tokens=40, num_output_tokens=0, cache_salt=None, sampling_params=None)
    scheduler = types.SimpleNamespace(requests={"a": a, "b": b})
    step = _step(new=[("a", [3, 4], 0), ("b", [5, 6], 0)])
    hc.schedule_post(None, step, scheduler)
    captured.take()
    time.sleep(0.01)
    a.num_output_tokens = 1  # a got its first token in this step; b is still prefilling (chunked)
    hc.update_from_output_post(None, None, scheduler, step)
    assert set(rt.State.prefilling) == {"b"}
    time.sleep(0.01)
    b.num_output_tokens = 1
    hc.update_from_output_post(None, None, scheduler, step)
    for rid, request, preemptions in (("a", a, 0), ("b", b, 1)):
        request.request_id, request.stop_reason, request.num_preemptions = rid, None, preemptions
        request.get_finished_reason, request.arrival_time = (lambda: 0), time.time() - 0.5
        _free_request(scheduler, request)
    end_a, end_b = captured.take()
    assert 10e6 <= end_a.body.ttft_ns < end_b.body.ttft_ns < 5e9  # b's first token came a step later
    assert end_a.body.e2e_ns >= 0.5e9 and not end_a.body.reprefilled and end_b.body.reprefilled
    assert not rt.State.ttft_ns and not rt.State.prefilling


def _runner(req_ids, computed, table, block_size=PAGE):
    bt = types.SimpleNamespace(block_size=block_size, block_table=types.SimpleNamespace(np=np.asarray(table, np.int32)))
    batch = types.SimpleNamespace(
        num_reqs=len(req_ids),
        req_ids=list(req_ids),
        num_computed_tokens_cpu=np.asarray(computed, np.int32),
        block_table=types.SimpleNamespace(block_tables=[bt]),
    )
    return types.SimpleNamespace(
        input_batch=batch, cache_config=types.SimpleNamespace(block_size=PAGE), speculative_config=None
    )


def test_a_workers_forward_names_the_pages_written_and_the_lengths_read(captured, monkeypatch):
    monkeypatch.setattr(hw.os, "getppid", lambda: 777)
    rt.State.row_sampler.every, rt.State.row_sampler.budget_ns = 1, 0  # rows with every forward
    runner = _runner(["a", "b"], [0, 40], [[3, 4, 0], [5, 6, 9]])
    hw.prepare_inputs_pre(runner, None, np.array([40, 1]))  # a's prefill of 40, b's decode token
    part, coverage, fwd = captured.take()[:3]
    assert part.kind == wire.Kind.ENGINE_PART and (part.body.primary_pid, part.body.rank) == (777, 0)
    assert coverage.kind == wire.Kind.COVERAGE and coverage.body.gaps == []
    assert fwd.kind == wire.Kind.FORWARD
    assert fwd.body.seq_lens.tolist() == [40, 41] and fwd.body.write_counts.tolist() == [2, 1]
    assert fwd.body.write_pages.tolist() == [3, 4, 6]
    assert fwd.body.read_counts.tolist() == [2, 2] and fwd.body.read_pages.tolist() == [3, 4, 5, 6]


def test_a_tensor_parallel_rank_above_0_joins_its_engine_and_reports_no_forwards(captured, monkeypatch):
    """Rank 0 speaks for the block tables every rank holds alike; rank 1 routes to the same
    EngineCore (ENGINE_PART with its rank) so that its part of each transfer digest meets the
    engine's transfers, and reports no forward and no coverage gap (its silence is by design)."""
    monkeypatch.setattr(hw.os, "getppid", lambda: 777)
    monkeypatch.setattr(hw, "_tp_rank", lambda: 1)
    monkeypatch.setattr(hw, "_tp_size", lambda: 2)
    runner = _runner(["a"], [0], [[3, 4]])
    hw.prepare_inputs_pre(runner, None, np.array([8]))
    hw.prepare_inputs_pre(runner, None, np.array([1]))
    (part,) = captured.take()
    assert part.kind == wire.Kind.ENGINE_PART and (part.body.primary_pid, part.body.rank) == (777, 1)
    assert (rt.State.tp_rank, rt.State.tp_size) == (1, 2) and rt.State.worker_silent


def test_a_later_pipeline_stage_sends_nothing(captured, monkeypatch):
    """Pipeline stage 1 runs the same batch on the same block tables for its own layers: stage
    0's rank 0 speaks for it. It sends no forward, no ENGINE_PART, no digest part (its slice is
    layers, not heads)."""
    monkeypatch.setattr(hw, "_pp_rank", lambda: 1)
    monkeypatch.setattr(hw, "_tp_rank", lambda: 0)
    runner = _runner(["a"], [0], [[3, 4]])
    hw.prepare_inputs_pre(runner, None, np.array([8]))
    hw.prepare_inputs_pre(runner, None, np.array([1]))
    assert captured.take() == []
    assert rt.State.worker_silent == "pipeline stage 1" and rt.State.tp_rank == 0


def test_a_worker_whose_layout_is_not_modelled_says_so_and_reports_no_forwards(captured, caplog):
    runner = _runner(["a"], [0], [[3]], block_size=16)  # kernel blocks split the cache's
    with caplog.at_level(logging.INFO, logger="kvguard.vllm"):
        hw.prepare_inputs_pre(runner, None, np.array([8]))
        hw.prepare_inputs_pre(runner, None, np.array([8]))
    part, coverage = captured.take()  # its engine's timeline learns the worker is there and unwatched
    assert part.kind == wire.Kind.ENGINE_PART and "kernel block size 16" in rt.State.worker_silent
    (gap,) = coverage.body.gaps
    assert gap.component == "worker" and "kernel block size 16" in gap.detail
    assert sum("reports no forwards" in r.message for r in caplog.records) == 1


def test_an_unsupported_vllm_gets_one_line_and_no_hooks(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.29.1"))
    called = []
    monkeypatch.setattr(plugin, "install", lambda version: called.append(version))
    with caplog.at_level(logging.WARNING, logger="kvguard.vllm"):
        plugin.load()
    assert called == [] and any("0.29.1 is not a supported release" in r.message for r in caplog.records)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0+cpu"))
    monkeypatch.setattr(plugin, "install", lambda version: called.append(version) or [])
    plugin.load()
    assert called == ["0.32.0+cpu"]


def test_a_target_that_moved_is_skipped_with_its_reason():
    cls, why = plugin._check(plugin.Target("kvguard_no_such_module", "X", "y", ()))
    assert cls is None and "cannot import kvguard_no_such_module" in why
    cls, why = plugin._check(plugin.Target("kvguard.engine_hooks.vllm.plugin", "Target", "__init__", ("nope",)))
    assert cls is None and "does not start with ('nope',)" in why


def test_requests_crossing_into_a_new_block_are_assigned_together_and_the_rest_one_by_one(captured):
    """A decode step where two requests cross into a new block (one batch of ASSIGNs, each for
    the token written first in it) and a chunked prefill gains two blocks (its own ASSIGN)."""
    _pool()
    request = types.SimpleNamespace(num_prompt_tokens=64, cache_salt=None, sampling_params=None)
    scheduler = types.SimpleNamespace(requests={r: request for r in ("a", "b", "c")})
    hc.schedule_post(None, _step(new=[("a", [3, 4], 0), ("b", [5, 6], 0), ("c", [7], 0)]), scheduler)
    captured.take()
    hc.schedule_post(None, _step(cached=[("a", [8], 64), ("c", [9, 10], 32), ("b", [11], 64)]), scheduler)
    got = {r.body.req_key: r.body for r in captured.take()}
    assert set(got) == {wire.request_key(r) for r in "abc"}
    for rid, page in (("a", 8), ("b", 11)):  # positions 64: the first slot of their third block
        a = got[wire.request_key(rid)]
        assert (a.row_start, a.row_end, a.shared_until, a.pages.tolist()) == (64, 65, 64, [page])
    c = got[wire.request_key("c")]
    assert (c.row_start, c.row_end, c.shared_until, c.pages.tolist()) == (32, 96, 32, [9, 10])
    hc.schedule_post(None, _step(cached=[("a", [12], 96), ("c", [13], 96)]), scheduler)
    assert [r.body.row_start for r in captured.take()] == [96, 96]  # the rows went on where they were


# --------------------------------------------------------------------------- several KV cache groups
def _spec(name: str, block_size: int, **kw):
    return type(name, (), {})() if False else type(name, (), {"block_size": block_size, **kw})()


def _hybrid_scheduler(pool):
    """A Gemma-3-shaped scheduler: group 0 a sliding window of 64, group 1 full attention."""
    groups = [
        types.SimpleNamespace(kv_cache_spec=_spec("SlidingWindowSpec", PAGE, sliding_window=64), layer_names=["l0"]),
        types.SimpleNamespace(kv_cache_spec=_spec("FullAttentionSpec", PAGE), layer_names=["l1"]),
    ]
    cfg = types.SimpleNamespace(kv_cache_groups=groups, num_blocks=len(pool.blocks))
    vllm_config = types.SimpleNamespace(
        kv_transfer_config=None,
        speculative_config=None,
        model_config=types.SimpleNamespace(served_model_name="tiny", hf_config=None),
        cache_config=types.SimpleNamespace(cache_dtype="auto", enable_prefix_caching=True),
        parallel_config=types.SimpleNamespace(),
    )
    return types.SimpleNamespace(
        kv_cache_config=cfg,
        kv_cache_manager=types.SimpleNamespace(block_pool=pool),
        max_model_len=512,
        vllm_config=vllm_config,
        requests={"a": types.SimpleNamespace(num_prompt_tokens=100, cache_salt=None, sampling_params=None)},
        connector=None,
    )


def test_an_engine_of_two_groups_declares_its_second_pool_and_rows_go_per_group(captured):
    pool = _pool(16)
    rt.State.hello_done = False
    sched = _hybrid_scheduler(pool)
    hc.scheduler_init_post(None, None, sched)
    hello, pool_rec, coverage = captured.take()
    assert (hello.kind, pool_rec.kind, coverage.kind) == (wire.Kind.HELLO, wire.Kind.POOL, wire.Kind.COVERAGE)
    assert pool_rec.pool == 1 and pool_rec.body.shares_pages and pool_rec.body.kind == wire.PoolKind.FULL_ATTENTION
    assert coverage.body.gaps == [] and rt.State.hello_done and len(rt.State.group_rows) == 2
    new = types.SimpleNamespace(req_id="a", block_ids=([1, 2, 3, 4], [5, 6, 7, 8]), num_computed_tokens=0)
    step = types.SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=["a"], new_block_ids=[([9], None)], num_computed_tokens=[100], resumed_req_ids=set()
        ),
    )
    # (one new request and, for the test, the same request gaining a block in group 0 only)
    hc.schedule_post(None, step, sched)
    begin, a0, a1, gained = captured.take()
    assert begin.kind == wire.Kind.REQ_BEGIN
    assert (a0.pool, a0.body.pages.tolist()) == (0, [1, 2, 3, 4]) and (a1.pool, a1.body.pages.tolist()) == (
        1,
        [5, 6, 7, 8],
    )
    assert (gained.pool, gained.body.row_start, gained.body.pages.tolist()) == (0, 4 * PAGE, [9])


def test_blocks_released_behind_the_window_leave_the_row_before_they_are_freed(captured):
    """``remove_skipped_blocks``: the frees inside it are held; the row positions they leave
    point at page 0 (the null block) first, then the frees go out."""
    from kvguard.engine_hooks.vllm import hooks_groups as hg

    pool = _pool(16)
    rt.State.hello_done = False
    hc.scheduler_init_post(None, None, _hybrid_scheduler(pool))
    captured.take()
    rt.State.group_rows[0]["a"] = [1, 2, 3, 4]
    rt.State.group_rows[1]["a"] = [5, 6, 7, 8]
    free = hc.free_blocks(_free, "BlockPool.free_blocks")
    for b in pool.blocks[1:9]:
        b.ref_cnt = 1
    pool.blocks[2].block_hash = "cached"  # a prefix-cache block leaves the row but is not freed for good

    def engine_call(self, request_id, processed):  # what the sliding-window manager does
        free(pool, [pool.blocks[2], pool.blocks[1]])

    hg.remove_skipped_blocks(engine_call, hg.HOOK_NAME)(None, "a", 100)
    assign, freed = captured.take()
    assert (assign.kind, assign.pool, assign.body.row_start, assign.body.row_end) == (wire.Kind.ASSIGN, 0, 0, 2 * PAGE)
    assert assign.body.pages.tolist() == [0, 0]
    assert (freed.kind, freed.body.pages.tolist()) == (wire.Kind.FREE, [1])  # block 2 stays cached
    assert rt.State.group_rows[0]["a"] == [0, 0, 3, 4] and rt.State.group_rows[1]["a"] == [5, 6, 7, 8]
    assert rt.State.skipping is None

    def failing_call(self, request_id, processed):  # the engine raises after a free: still let out
        free(pool, [pool.blocks[3]])
        raise RuntimeError("engine error")

    pool.blocks[3].ref_cnt = 1
    with pytest.raises(RuntimeError, match="engine error"):
        hg.remove_skipped_blocks(failing_call, hg.HOOK_NAME)(None, "a", 160)
    assign, freed = captured.take()
    assert assign.body.pages.tolist() == [0] and freed.body.pages.tolist() == [3] and rt.State.skipping is None


def test_a_worker_of_two_groups_masks_what_the_window_no_longer_reads(captured, monkeypatch):
    monkeypatch.setattr(hw.os, "getppid", lambda: 777)
    rt.State.row_sampler.every, rt.State.row_sampler.budget_ns = 1, 0
    swa = types.SimpleNamespace(
        block_size=PAGE, block_table=types.SimpleNamespace(np=np.array([[1, 2, 3, 4]], np.int32))
    )
    full = types.SimpleNamespace(
        block_size=PAGE, block_table=types.SimpleNamespace(np=np.array([[5, 6, 7, 8]], np.int32))
    )
    batch = types.SimpleNamespace(
        num_reqs=1,
        req_ids=["a"],
        num_computed_tokens_cpu=np.array([100], np.int32),
        block_table=types.SimpleNamespace(block_tables=[swa, full]),
    )
    groups = [
        types.SimpleNamespace(kv_cache_spec=_spec("SlidingWindowSpec", PAGE, sliding_window=64)),
        types.SimpleNamespace(kv_cache_spec=_spec("FullAttentionSpec", PAGE)),
    ]
    runner = types.SimpleNamespace(
        input_batch=batch,
        cache_config=types.SimpleNamespace(block_size=PAGE),
        speculative_config=None,
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=groups),
    )
    hw.prepare_inputs_pre(runner, None, np.array([1]))
    part, coverage, *rest = captured.take()
    f0, f1 = [r for r in rest if r.kind == wire.Kind.FORWARD]
    assert coverage.body.gaps == [] and "window 64" in coverage.body.items[0].detail
    # token 100 reads from 37 on (window 64): blocks 0 (tokens 0-31) are behind it, pointed at page 0
    assert (f0.pool, f0.body.read_pages.tolist(), f0.body.write_pages.tolist()) == (0, [0, 2, 3, 4], [4])
    assert (f1.pool, f1.body.read_pages.tolist(), f1.body.write_pages.tolist()) == (1, [5, 6, 7, 8], [8])


@pytest.mark.parametrize(
    "parallel, says",
    [
        ({}, "tp 1, pp 1, dp 1: "),
        # a dense model's data-parallel server: vLLM runs each core as an independent engine of dp 1
        ({"data_parallel_size": 1, "data_parallel_index": 1}, "dp 1 (engine core 1 of a data-parallel server"),
        # a MoE model's: the cores keep the server's size and their rank
        ({"data_parallel_size": 2, "data_parallel_rank": 1, "data_parallel_index": 1}, "dp 2 (engine core 1): "),
    ],
)
def test_the_parallel_layout_says_which_data_parallel_engine_core_this_is(captured, parallel, says):
    pool = _pool(16)
    rt.State.hello_done = False
    sched = _hybrid_scheduler(pool)
    sched.vllm_config.parallel_config = types.SimpleNamespace(**parallel)
    hc.scheduler_init_post(None, None, sched)
    coverage = next(r for r in captured.take() if r.kind == wire.Kind.COVERAGE)
    (layout,) = [i for i in coverage.body.items if i.component == "parallel"]
    assert layout.status == wire.CoverageStatus.WATCHED and says in layout.detail, layout.detail


def test_pipeline_parallelism_is_declared_unwatched(captured):
    """Not verified: vLLM 0.32's CPU build fails at pipeline stage 1 (its model runner has no
    intermediate tensors: an AssertionError in sync_and_gather_intermediate_tensors, with or
    without kvguard), so no real engine could show a stage-0 speaker right."""
    pool = _pool(16)
    rt.State.hello_done = False
    sched = _hybrid_scheduler(pool)
    sched.vllm_config.parallel_config = types.SimpleNamespace(pipeline_parallel_size=2)
    hc.scheduler_init_post(None, None, sched)
    coverage = next(r for r in captured.take() if r.kind == wire.Kind.COVERAGE)
    (layout,) = [i for i in coverage.body.items if i.component == "parallel"]
    assert layout.status != wire.CoverageStatus.WATCHED and "pipeline parallelism is not verified" in layout.detail

"""The SGLang adapter's account of what it watches (engine_hooks/sglang/coverage.py): the
decisions by class, and what the scheduler hook sends for an engine it can and cannot follow.

Stand-ins carry the real classes' names (the adapter decides by the class it hooks, never by
a model name); the real pools are exercised by the engine tests (tests/integration/test_arch_engines.py).
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import probes as probes_mod  # noqa: E402
from kvguard.engine_hooks import wire  # noqa: E402
from kvguard.engine_hooks.probes import Probes  # noqa: E402
from kvguard.engine_hooks.sglang import _runtime as rt  # noqa: E402
from kvguard.engine_hooks.sglang import coverage as cov  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_requests as hq  # noqa: E402
from tests.support.recording_probes import CaptureWriter  # noqa: E402


def _named(name: str, **attrs):
    return type(name, (), {})() if not attrs else type(name, (), dict(attrs))()


def _mha_pool(layers=2, slots=64, heads=2, dim=32):
    pool = _named("MHATokenToKVPool")
    pool.k_buffer = [torch.zeros(slots, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
    pool.v_buffer = [torch.zeros(slots, heads, dim, dtype=torch.bfloat16) for _ in range(layers)]
    pool.page_size, pool.dtype, pool.layer_num = 4, torch.bfloat16, layers
    return pool


def _mla_pool(name="MLATokenToKVPool", layers=2, slots=64, latent=576):
    pool = _named(name)
    pool.kv_buffer = [torch.zeros(slots, 1, latent, dtype=torch.bfloat16) for _ in range(layers)]
    pool.page_size, pool.dtype, pool.layer_num = 4, torch.bfloat16, layers
    return pool


def _sched(pool, allocator="PagedTokenToKVPoolAllocator", rtt="ReqToTokenPool", role="null", **args):
    alloc = _named(allocator)
    alloc.page_size, alloc.size = 4, 64
    alloc.get_kvcache = lambda: pool
    server_args = types.SimpleNamespace(
        kv_cache_dtype="auto",
        tp_size=1,
        dp_size=1,
        pp_size=1,
        enable_dp_attention=False,
        enable_hierarchical_cache=False,
        speculative_algorithm=None,
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        model_path="/models/tiny",
    )
    vars(server_args).update(args)
    return types.SimpleNamespace(
        server_args=server_args,
        token_to_kv_pool_allocator=alloc,
        req_to_token_pool=_named(rtt),
        model_config=types.SimpleNamespace(
            hf_config=types.SimpleNamespace(architectures=["DeepseekV2ForCausalLM"]), context_len=512
        ),
        max_total_num_tokens=256,
        page_size=4,
        max_req_input_len=250,
    )


def _by_component(items):
    return {i.component: i for i in items}


def test_an_mha_pool_on_a_hooked_allocator_is_watched_with_digests_on_a_pd_role():
    items = _by_component(cov.inspect(_sched(_mha_pool(), role="decode"), "0.5.23", "decode"))
    kv = items["kv_pool"]
    assert kv.status == wire.CoverageStatus.WATCHED
    assert kv.watched == wire.Capability.OWNERSHIP | wire.Capability.DIGESTS
    assert "MHATokenToKVPool, bfloat16, 2 layers of K/V [64x2x32]" in kv.detail
    assert items["transfer"].status == wire.CoverageStatus.WATCHED
    assert cov.cv.ownership_followed(list(items.values()))


def test_an_unhooked_allocator_a_state_pool_or_speculation_leaves_ownership_unfollowed():
    for sched, component, words in (
        (
            _sched(_mha_pool(), allocator="SWATokenToKVPoolAllocator"),
            "kv_pool",
            "SWATokenToKVPoolAllocator not followed: MHATokenToKVPool is not a SWA pool layout",
        ),
        (_sched(_mha_pool(), rtt="HybridReqToTokenPool"), "state_pool", "recurrent state"),
        (_sched(_mha_pool(), speculative_algorithm="EAGLE"), "draft", "not a speculative path kvguard follows"),
        (_sched(_named("SWAKVPool")), "kv_pool", "SWAKVPool is not a pool layout kvguard follows"),
        (_sched(_mha_pool(), pp_size=2), "parallel", "pipeline parallelism not verified on SGLang 0.5.22"),
    ):
        items = cov.inspect(sched, "0.5.22", "unified")
        item = _by_component(items)[component]
        assert item.status == wire.CoverageStatus.UNWATCHED, (component, item)
        assert words in item.detail
        assert not cov.cv.ownership_followed(items)


def test_pipeline_stages_of_a_unified_engine_are_watched_each_as_its_own_timeline():
    """At ``--pp-size 2`` each stage is a scheduler process over its own layers' pool (verified on
    a real 0.5.23 engine and pair, tests/integration/test_parallel_engines.py): watched, the stage
    named; on another release declared."""
    sched = _sched(_mha_pool(), pp_size=2)
    sched.pp_rank = 1
    items = cov.inspect(sched, "0.5.23", "unified")
    layout = _by_component(items)["parallel"]
    assert layout.status == wire.CoverageStatus.WATCHED and "pp 2 (stage 1)" in layout.detail, layout
    assert "its own timeline" in layout.detail and cov.cv.ownership_followed(items)
    sched = _sched(_mha_pool(), pp_size=2, role="decode")
    items = cov.inspect(sched, "0.5.23", "decode")
    layout = _by_component(items)["parallel"]
    assert layout.status == wire.CoverageStatus.WATCHED and "transfers pair stage to stage" in layout.detail, layout
    items = cov.inspect(sched, "0.5.22", "decode")
    layout = _by_component(items)["parallel"]
    assert layout.status == wire.CoverageStatus.UNWATCHED and "not verified on SGLang 0.5.22" in layout.detail
    assert not cov.cv.ownership_followed(items)


def test_a_stages_hello_rank_counts_across_the_stages_so_that_transfer_lanes_pair_stage_to_stage():
    from kvguard.engine_hooks.sglang import hooks_requests

    ranks = []
    for pp_rank in range(2):
        for tp_rank in range(2):
            sched = _sched(_mha_pool(), pp_size=2, tp_size=2)
            sched.pp_rank, sched.tp_rank = pp_rank, tp_rank
            ranks.append(hooks_requests._tp_rank(sched))
    assert ranks == [0, 1, 2, 3]  # as SGLang numbers its scheduler processes
    sched = _sched(_mha_pool(), tp_size=2)
    sched.tp_rank = 1
    assert hooks_requests._tp_rank(sched) == 1  # no pipeline: the TP rank


def test_tensor_parallel_transfers_are_watched_and_data_parallel_attention_ones_declared():
    """TP 2 pairs rank to rank (verified on a real pair); under DP attention the pairing rank
    would be the attention-TP rank, never run here (SGLang's CPU path has no DP attention):
    declared unwatched, so that no page record can describe a pairing kvguard cannot make."""
    tp = _by_component(cov.inspect(_sched(_mha_pool(), role="decode", tp_size=2), "0.5.23", "decode"))
    assert tp["transfer"].status == wire.CoverageStatus.WATCHED and "tp 2, dp 1" in tp["parallel"].detail
    items = cov.inspect(
        _sched(_mha_pool(), role="decode", tp_size=2, dp_size=2, enable_dp_attention=True), "0.5.23", "decode"
    )
    transfer = _by_component(items)["transfer"]
    assert transfer.status == wire.CoverageStatus.UNWATCHED and "data-parallel attention" in transfer.detail
    assert not cov.cv.ownership_followed(items)
    unified = cov.inspect(_sched(_mha_pool(), tp_size=2, dp_size=2, enable_dp_attention=True), "0.5.23", "unified")
    assert cov.cv.ownership_followed(unified)  # no transfers: each DP rank's pool is its own timeline


def test_the_digest_gap_of_a_pool_is_partial_on_a_transfer_role_only(monkeypatch):
    def no_digest(pool):
        raise cov.dg.Unsupported("a layout with no digest")

    monkeypatch.setattr(cov.dg, "pool_view", no_digest)
    unified = _by_component(cov.inspect(_sched(_mla_pool()), "0.5.23", "unified"))["kv_pool"]
    assert unified.status == wire.CoverageStatus.WATCHED  # no transfers: digests do not apply
    prefill = _by_component(cov.inspect(_sched(_mla_pool(), role="prefill"), "0.5.23", "prefill"))["kv_pool"]
    assert prefill.status == wire.CoverageStatus.PARTIAL and prefill.missing == wire.Capability.DIGESTS
    assert "no digests: a layout with no digest" in prefill.detail
    monkeypatch.setenv("KVGUARD_GUARD", "transfer")
    guarded = _by_component(cov.inspect(_sched(_mla_pool(), role="prefill"), "0.5.23", "prefill"))["kv_pool"]
    assert guarded.missing == wire.Capability.DIGESTS | wire.Capability.GUARD


def test_the_content_check_reads_a_latent_pool_as_its_one_head(monkeypatch):
    monkeypatch.setenv("KVGUARD_CONTENT_CHECK", "all")
    item = _by_component(cov.inspect(_sched(_mla_pool()), "0.5.23", "unified"))["kv_pool"]
    assert item.watched & wire.Capability.CONTENT, item
    k, v = cov.content_buffers(_mla_pool())
    assert k is v and tuple(k.shape) == (64, 1, 576)


def _hello(sched):
    cap = CaptureWriter()
    probes_mod.reset_probes_for_tests(Probes(cap))
    rt.State.reset()
    rt.State.engine_version = "0.5.23"
    try:
        hq._scheduler_init_post(None, sched)
        return cap.take(), rt.State.hello_done
    finally:
        probes_mod.reset_probes_for_tests(None)
        rt.State.reset()


def test_the_scheduler_hook_sends_hello_then_coverage_and_watches_a_followed_engine():
    records, watching = _hello(_sched(_mha_pool()))
    assert [r.kind for r in records] == [wire.Kind.HELLO, wire.Kind.COVERAGE]
    assert watching
    assert {i.component for i in records[1].body.items} >= {"model", "kv_pool", "parallel"}


def test_an_engine_it_cannot_follow_says_so_and_sends_no_page_records():
    records, watching = _hello(_sched(_mha_pool(), speculative_algorithm="NEXTN"))
    assert [r.kind for r in records] == [wire.Kind.HELLO, wire.Kind.COVERAGE]
    assert not watching  # every page hook checks this before it emits anything
    assert [g.component for g in records[1].body.gaps] == ["draft"]


def _spec_sched(algorithm="NEXTN", worker="EAGLEWorkerV2", draft_on_target=True, **args):
    """A scheduler with a speculative worker; EAGLE-family workers get a draft runner whose
    own pool sits on the target's allocator and rows (as SGLang builds it) or on others."""
    sched = _sched(_mha_pool(), speculative_algorithm=algorithm, **args)
    spec = _named(worker)
    if worker != "NGRAMWorker":
        alloc = sched.token_to_kv_pool_allocator if draft_on_target else _named("PagedTokenToKVPoolAllocator")
        runner = types.SimpleNamespace(
            token_to_kv_pool=_mha_pool(layers=1),
            token_to_kv_pool_allocator=alloc,
            req_to_token_pool=sched.req_to_token_pool,
        )
        spec.draft_worker = types.SimpleNamespace(draft_runner=runner)
    sched.draft_worker = spec
    return sched


@pytest.fixture
def spec_hook_registered(monkeypatch):
    from kvguard.engine_hooks.sglang import plugin

    monkeypatch.setattr(plugin, "registered", [plugin.SPEC_DECODE_TARGET])


def test_a_chain_draft_on_the_targets_allocator_is_watched(spec_hook_registered):
    for sched, words in (
        (_spec_sched(speculative_eagle_topk=1, speculative_num_draft_tokens=2), "NEXTN via EAGLEWorkerV2"),
        (
            _spec_sched("NGRAM", "NGRAMWorker", speculative_ngram_max_bfs_breadth=1, speculative_num_draft_tokens=4),
            "no draft model",
        ),
    ):
        items = cov.inspect(sched, "0.5.23", "unified")
        draft = _by_component(items)["draft"]
        assert draft.status == wire.CoverageStatus.WATCHED and draft.watched == wire.Capability.OWNERSHIP, draft
        assert words in draft.detail and "verify writes and reads followed" in draft.detail
        assert cov.cv.ownership_followed(items)


def test_a_draft_path_not_verified_is_declared_unwatched(spec_hook_registered, monkeypatch):
    chain = {"speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2}
    for sched, version, role, words in (
        (_spec_sched(speculative_eagle_topk=4), "0.5.23", "unified", "a draft tree (topk 4"),
        (_spec_sched(**chain, enable_multi_layer_eagle=True), "0.5.23", "unified", "multi-layer EAGLE"),
        (_spec_sched("NGRAM", "NGRAMWorker", speculative_ngram_max_bfs_breadth=3), "0.5.23", "unified", "n-gram tree"),
        (_spec_sched("STANDALONE", "StandaloneWorkerV2", **chain), "0.5.23", "unified", "not a speculative path"),
        (_spec_sched("EAGLE3", **chain), "0.5.23", "unified", "not a speculative path"),
        (_spec_sched(**chain), "0.5.19", "unified", "not verified on SGLang 0.5.19"),
        (_spec_sched(**chain), "0.5.23", "decode", "not verified on a decode engine"),
        (_spec_sched(**chain, draft_on_target=False), "0.5.23", "unified", "not on the target's allocator"),
    ):
        items = cov.inspect(sched, version, role)
        draft = _by_component(items)["draft"]
        assert draft.status == wire.CoverageStatus.UNWATCHED and words in draft.detail, (words, draft)
        assert not cov.cv.ownership_followed(items)
    from kvguard.engine_hooks.sglang import plugin

    monkeypatch.setattr(plugin, "registered", [])  # the row hook did not resolve on this engine
    draft = _by_component(cov.inspect(_spec_sched(**chain), "0.5.23", "unified"))["draft"]
    assert draft.status == wire.CoverageStatus.UNWATCHED and "alloc_for_spec_decode not hooked" in draft.detail


def _dsa_pool(index_kpool=1):
    pool = _mla_pool("DSATokenToKVPool")
    pool.index_key_cache = types.SimpleNamespace(
        buffer=[torch.zeros(17, 64 * 132, dtype=torch.uint8) for _ in range(2)]
    )
    pool.index_kpool = index_kpool
    return pool


def test_a_dsa_indexer_cache_is_digested_on_a_transfer_role_where_alg_3_defines_it():
    unified = _by_component(cov.inspect(_sched(_dsa_pool()), "0.5.23", "unified"))["indexer_cache"]
    assert unified.status == wire.CoverageStatus.WATCHED and unified.watched == wire.Capability.OWNERSHIP
    prefill = _by_component(cov.inspect(_sched(_dsa_pool(), role="prefill"), "0.5.23", "prefill"))["indexer_cache"]
    assert prefill.status == wire.CoverageStatus.WATCHED
    assert (
        prefill.watched == wire.Capability.OWNERSHIP | wire.Capability.DIGESTS and "transfer digest" in prefill.detail
    )
    pooled = _by_component(cov.inspect(_sched(_dsa_pool(2), role="decode"), "0.5.23", "decode"))["indexer_cache"]
    assert pooled.status == wire.CoverageStatus.PARTIAL and pooled.missing == wire.Capability.DIGESTS
    assert "not digested (pooled index keys" in pooled.detail

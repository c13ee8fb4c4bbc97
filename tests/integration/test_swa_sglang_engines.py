"""A hybrid sliding-window model on a real SGLang engine (CPU): a tiny GPT-OSS
(``GptOssForCausalLM``: one sliding-window layer, window 16, and one full-attention layer; dummy
weights, demo/arch_models.py ``sglang_gpt_oss``) on SGLang 0.5.23, Triton backend under the
Triton interpreter. SGLang keeps the window layer's KV in a pool of its own
(``SWAKVPool.swa_kv_pool`` on ``SWATokenToKVPoolAllocator``'s SWA half, reached through a
full-to-SWA slot mapping) and frees its pages behind the window while requests decode. kvguard's
plugin follows the full-attention pages as pool 0 and the SWA pages as pool 1,
``kind=sliding_window`` (engine_hooks/sglang/hooks_swa.py).

One engine, started once, with the test-only fault plugin (tests/faults), SGLang's SWA eviction
every 4 decode steps (``SGLANG_SWA_EVICTION_INTERVAL``; 128 by default) so that window pages are
freed inside every request here:

* clean traffic: concurrent prompts of two tenants well past the window, a conversation whose
  later turns are handed the cached prefix (full pages and the live window's SWA pages), more
  prompt tokens than the SWA pool holds in a row, client aborts: nothing raised, both pools'
  reads judged, COVERAGE says the SWA pool is watched;
* ``swa_freed_under_reader``: a SWA page inside a decoding request's window is freed under it
  (the mapping still names it) and handed to the next request: ``foreign_read`` on pool 1
  naming the other tenant (``use_after_free`` before it when the victim read it while it was
  free); nothing on the full pool (last: it breaks the engine's accounting).

tests/integration/test_coverage_engine.py keeps the same model on SGLang 0.5.19, where the SWA path is not
verified: declared unwatched, one ``coverage_gap`` and nothing else.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvguard.demo.engines import repo_root
from kvguard.demo.model import write_tiny_model
from tests.integration.test_faults_engine import fault_env
from tests.support.engine_watch import describe, generate, prompt, short_requests_and_aborts, watched_sglang
from tests.support.fault_plugin import FAULTS_DIR, make_rid

pytestmark = [pytest.mark.engine, pytest.mark.timeout(480)]

FIXED = "0.5.23"
CONTEXT = 1024
PAGE = 4
CLIENTS = 3


def gpt_oss_model():
    return write_tiny_model(
        repo_root() / ".kvguard-cache" / "models" / "tiny-sglang_gpt_oss-1024", CONTEXT, "sglang_gpt_oss"
    )


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, require_sglang):
    require_sglang(FIXED)
    work = tmp_path_factory.mktemp("gpt-oss")
    kwargs = {
        "model_dir": gpt_oss_model(),
        "context_length": CONTEXT,
        "max_total_tokens": CONTEXT,  # the SWA half holds 0.8 of it: 816 tokens
        # GPT-OSS needs SGLang's Triton backend (run by the Triton interpreter here); one batch at
        # a time (run_batch -> process_batch_result): the fault lands between known steps
        "extra_args": [
            "--attention-backend", "triton",
            "--page-size", str(PAGE),
            "--disable-overlap-schedule",
            "--max-running-requests", "6",
        ],
        "extra_env": {
            "KVGUARD_CPU_ARCH_SHIMS": "rope",
            "TRITON_INTERPRET": "1",
            **fault_env(work / "events", "swa_freed_under_reader"),
            "SGLANG_SWA_EVICTION_INTERVAL": "4",  # window pages freed while requests decode
            "KVGUARD_ROW_SAMPLE_EVERY": "2",  # the engine's rows every other forward, the model's between
            # the fault leaves a SWA page free and in use: SGLang's strict idle check would raise on it
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",
        },
    }  # fmt: skip
    with watched_sglang(work, FIXED, "GPT-OSS unified engine", extra_pythonpath=[FAULTS_DIR], **kwargs) as served:
        yield served


def test_clean_traffic_on_a_hybrid_sliding_window_engine_raises_nothing(gpt_oss):
    engine, watch = gpt_oss
    assert watch.since(0) == [], describe(watch.memory.findings)  # start-up: no gap
    stats = watch.engine_stats()
    coverage = {c.component: c for c in stats.coverage}
    assert coverage["swa_pool"].status == "watched" and "window" in coverage["swa_pool"].detail, coverage
    assert coverage["kv_pool"].status == "watched" and "SWAKVPool" in coverage["kv_pool"].detail, coverage
    assert all(c.status == "watched" for c in coverage.values()), coverage
    (pool,) = stats.pools
    assert (pool.index, pool.kind, pool.page_size) == (1, "sliding_window", PAGE) and pool.window_tokens > 0, pool

    mark = watch.mark()
    rng = random.Random(16)
    tenants = ("acme", "globex")
    # concurrent prompts well past the window, decoding past it again
    prompts = [prompt(rng, 60 + 40 * i) for i in range(4)]
    with ThreadPoolExecutor(CLIENTS) as pool_:
        list(pool_.map(lambda i: generate(engine.url, f"oss-c{i}", prompts[i], 20, tenants[i % 2]), range(4)))
    # a conversation, the third turn from another tenant: each turn is handed the cached prefix
    # (a SWA radix tree matches where the window before the match point is still live: at the
    # end of the previous turn, not inside it)
    history = prompt(rng, 70)
    for turn in range(3):
        out = generate(engine.url, f"oss-turn-{turn}", history, 8, tenants[turn // 2])
        if turn:
            assert out["meta_info"].get("cached_tokens", 0) >= 64, out["meta_info"]
        history = history + out["output_ids"] + prompt(rng, 10)
    # more prompt tokens in a row than the SWA half holds (816): the tree gives SWA pages back
    with ThreadPoolExecutor(CLIENTS) as pool_:
        list(pool_.map(lambda i: generate(engine.url, f"oss-r{i}", prompt(rng, 140), 6, tenants[i % 2]), range(8)))
    # client aborts among short requests
    aborts = short_requests_and_aborts(engine, 8, 4, "oss", CONTEXT, CLIENTS)
    watch.settle()
    assert watch.since(mark) == [], describe(watch.since(mark))

    after = watch.engine_stats()
    (swa,) = after.pools
    assert swa.pages_read > 0 and after.pages_read > 0 and after.pages_unverified == 0, after
    print(
        f"  SWA pool: {swa.pages_read} page reads judged, by state {dict(swa.pages_by_state)}; "
        f"full pool: {after.pages_read} page reads; aborts {aborts}"
    )


def test_a_swa_page_freed_inside_a_readers_window_is_reported(gpt_oss):
    engine, watch = gpt_oss
    rng = random.Random(9)
    mark = watch.mark()
    victim = make_rid("swa_freed_under_reader", "victim", "oss")
    other = make_rid("swa_freed_under_reader", "other", "oss")
    with ThreadPoolExecutor(2) as pool:
        fv = pool.submit(generate, engine.url, victim, prompt(rng, 40), 48, "initech")
        watch.wait_event("swa_freed_under_reader", "victim_ready")  # decoding past its window
        # shorter than the window: every page of its prompt stays in its window, its own
        fo = pool.submit(generate, engine.url, other, prompt(rng, 12), 6, "acme")
        fo.result()
        fv.result()
    freed = watch.wait_event("swa_freed_under_reader", "freed")
    admitted = watch.wait_event("swa_freed_under_reader", "other_admitted")
    assert freed["page"] in {slot // PAGE for slot in admitted["swa"]}, (freed, admitted)  # the other got it
    watch.settle()
    found = watch.since(mark)
    page = freed["page"]
    assert found, "a SWA page freed inside its reader's window went unseen"
    assert all(f.evidence.get("pool") == 1 for f in found), describe(found)  # the full pool was never touched
    by_kind = {f.kind: f for f in found}
    # the victim reads the page while it is another request's (and, if a decode step of it came
    # between the free and the other's prefill, while it was free: use_after_free first)
    assert "foreign_read" in by_kind and set(by_kind) <= {"use_after_free", "foreign_read"}, describe(found)
    foreign = by_kind["foreign_read"]
    for f in found:
        assert f.severity == "critical" and (f.reader.rid, f.reader.tenant) == (victim, "initech")
        assert f.pages == [page] and f.evidence["pool_kind"] == "sliding_window", f.evidence
    assert [(p.rid, p.tenant) for p in foreign.exposed] == [(other, "acme")]
    if "use_after_free" in by_kind:
        assert by_kind["use_after_free"].first_seen_ns < foreign.first_seen_ns

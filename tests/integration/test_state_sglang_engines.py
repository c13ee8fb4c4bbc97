"""Mamba / linear-attention state on a real SGLang engine (CPU): a tiny Qwen3-Next
(``Qwen3NextForCausalLM``: a gated-delta-net layer and a full-attention layer; dummy weights)
on SGLang 0.5.23 with ``--mamba-radix-cache-strategy no_buffer``, served with the CPU kernel
shims of demo/arch_shims.py (demo/engines.py ``sglang_arch("qwen3_next")``). kvguard's plugin,
loaded by SGLang itself, follows the token KV pages of the full-attention layer as pool 0 and
the per-request recurrent state slots (``MambaSlotAllocator``) as pool 1, ``kind=state``
(engine_hooks/sglang/hooks_state.py).

One engine, started once, with the test-only fault plugin (tests/faults):

* clean traffic: concurrent prompts of two tenants, a conversation's second turn (a prefix
  hit: its slot gets a copy of the state cached at the end of the first), more requests in a row than the pool
  has slots (the radix tree evicts cached states while others run), client aborts: nothing
  raised, the state pool's pages read and judged, COVERAGE says both pools are watched;
* ``state_slot_freed``: a decoding request's state slot is returned to the allocator and handed
  to the next request, while both keep reading and overwriting it in place: reported on the
  state pool with the reader and the other tenant named (last: it breaks the engine's
  accounting).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvguard.demo.engines import sglang_arch
from tests.integration.test_faults_engine import fault_env
from tests.support.engine_watch import describe, generate, prompt, short_requests_and_aborts, watched_sglang
from tests.support.fault_plugin import FAULTS_DIR, make_rid

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

QWEN3_NEXT = sglang_arch("qwen3_next")
FIXED = "0.5.23"
CONTEXT = 1024
POOL = 1024
STATE_SLOTS = 16  # --max-mamba-cache-size: fewer than the requests sent in a row below
CLIENTS = 4


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, require_sglang):
    require_sglang(FIXED)
    work = tmp_path_factory.mktemp("qwen3-next")
    kwargs = QWEN3_NEXT.engine_kwargs(
        CONTEXT,
        max_total_tokens=POOL,
        extra_args=["--max-running-requests", "8"],
        extra_env={
            **fault_env(work / "events", "state_slot_freed"),
            "KVGUARD_ROW_SAMPLE_EVERY": "2",  # the engine's own rows on every other forward, the model's between
            # state_slot_freed leaves two requests on one slot: SGLang's strict idle check would raise on it
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",
        },
    )
    with watched_sglang(work, FIXED, "Qwen3-Next unified engine", extra_pythonpath=[FAULTS_DIR], **kwargs) as served:
        yield served


def test_clean_traffic_on_a_hybrid_linear_attention_engine_raises_nothing(qwen3_next):
    engine, watch = qwen3_next
    assert watch.since(0) == [], describe(watch.memory.findings)  # start-up: no gap
    stats = watch.engine_stats()
    coverage = {c.component: c for c in stats.coverage}
    assert coverage["state_pool"].status == "watched", coverage["state_pool"]
    assert coverage["kv_pool"].status == "watched" and QWEN3_NEXT.kv_pool in coverage["kv_pool"].detail
    assert all(c.status == "watched" for c in coverage.values()), coverage
    (pool,) = stats.pools
    assert (pool.index, pool.kind, pool.page_size) == (1, "state", 1), pool

    mark = watch.mark()
    rng = random.Random(17)
    tenants = ("acme", "globex")
    # concurrent prompts of two tenants
    prompts = [prompt(rng, 40 + 30 * i) for i in range(4)]
    with ThreadPoolExecutor(CLIENTS) as pool_:
        list(pool_.map(lambda i: generate(engine.url, f"q3n-c{i}", prompts[i], 12, tenants[i % 2]), range(4)))
    # a conversation's next turn: it matches the first turn's cached prefix, whose state the
    # radix tree kept at the end of the finished request (no_buffer keeps states there only)
    first_turn = prompt(rng, 90)
    answer = generate(engine.url, "q3n-turn-1", first_turn, 6, "acme")["output_ids"]
    second = generate(engine.url, "q3n-turn-2", first_turn + answer + prompt(rng, 12), 6, "acme")
    assert second["meta_info"].get("cached_tokens", 0) > 0, second["meta_info"]
    # more requests in a row than there are state slots: the tree gives cached states back
    with ThreadPoolExecutor(CLIENTS) as pool_:
        list(
            pool_.map(
                lambda i: generate(engine.url, f"q3n-row-{i}", prompt(rng, 24), 3, tenants[i % 2]),
                range(STATE_SLOTS + 4),
            )
        )
    # client aborts among short requests
    aborts = short_requests_and_aborts(engine, 10, 3, "q3n", CONTEXT, CLIENTS)
    watch.settle()
    assert watch.since(mark) == [], describe(watch.since(mark))

    after = watch.engine_stats()
    (state,) = after.pools
    assert state.pages_read > 0 and after.pages_read > 0 and after.pages_unverified == 0, after
    print(
        f"  state pool: {state.pages_read} slot reads judged, by state {dict(state.pages_by_state)}; "
        f"KV pool: {after.pages_read} page reads; aborts {aborts}"
    )


def test_a_state_slot_handed_to_another_request_while_its_owner_decodes_is_reported(qwen3_next):
    engine, watch = qwen3_next
    rng = random.Random(8)
    mark = watch.mark()
    victim = make_rid("state_slot_freed", "victim", "q3n")
    other = make_rid("state_slot_freed", "other", "q3n")
    with ThreadPoolExecutor(2) as pool:
        fv = pool.submit(generate, engine.url, victim, prompt(rng, 60), 40, "initech")
        freed = watch.wait_event("state_slot_freed", "freed")
        fo = pool.submit(generate, engine.url, other, prompt(rng, 50), 12, "acme")
        fo.result()
        fv.result()
    got = watch.wait_event("state_slot_freed", "other_got_slot")
    assert got["slot"] == freed["slot"], (freed, got)
    watch.settle()
    found = watch.since(mark)
    assert found, "a state slot shared by two requests went unseen"
    assert {f.kind for f in found} <= {"foreign_read", "late_write", "use_after_free"}, describe(found)
    reads = [f for f in found if f.kind == "foreign_read" and f.reader.rid == victim]
    assert reads, describe(found)
    f = reads[0]
    assert f.severity == "critical" and f.reader.tenant == "initech"
    assert f.evidence["pool"] == 1 and f.evidence["pool_kind"] == "state", f.evidence
    assert f.pages == [freed["slot"]] and [(p.rid, p.tenant) for p in f.exposed] == [(other, "acme")]
    # the token KV pages of the full-attention layer were never shared: nothing on pool 0
    assert all(x.evidence.get("pool", 0) == 1 for x in found), describe(found)

"""Speculative decoding on real SGLang 0.5.23 engines (CPU, ``--attention-backend triton`` under
the Triton interpreter, the CPU kernel shims of demo/arch_shims.py ``spec``): kvguard follows the
rows ``alloc_for_spec_decode`` allocates ahead, and the target's ``TARGET_VERIFY`` forwards (the
drafted tokens' KV written into those slots, the prefix and the drafted tokens read).

Two engine set-ups, each started once:

* n-gram speculation on the tiny Llama (``sglang_arch("llama_ngram")``: no draft model, four
  draft tokens per verify, 4-token pages; ``make test``): clean traffic (a prefix shared by three
  tenants, concurrent clients, client aborts) raises nothing, with every page read judged and the
  engine's COVERAGE saying the draft path is watched; rejected drafts' slots are written again by
  the next verify and freed with the request, never a ``late_write`` or ``unwritten_read``. Then
  the test-only fault ``spec_draft_foreign`` (tests/faults): a writer's verify slots name another
  tenant's prompt slots for one step, so its drafted tokens' KV lands in that tenant's page and
  its verify attends over it: kvguard names the writer and the exposed tenant;
* the incident's own stack, GLM-5 with its MTP layer (``sglang_arch("glm5_mtp")``: NEXTN, one
  draft step, DSA pool with 64-token pages; ``make test-arch``): the same both ways. The draft
  model's own forwards (its own one-layer DSA pool at the target's slots) are not reported: the
  COVERAGE detail says so.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvguard.demo.engines import sglang_arch
from tests.integration.test_faults_engine import fault_env, one, parties
from tests.support.engine_watch import Watch, describe, generate, prompt, watched_sglang
from tests.support.fault_plugin import FAULTS_DIR, make_rid
from tests.support.soak.workload import ABORT_KINDS, Limits, Planned, make_plan, outcome_summary, run_plan, send_unified

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

VERSION = "0.5.23"  # the version the draft path is verified on (engine_hooks/sglang/coverage.py)
CONTEXT = 1024
POOL = 2048  # at least the context: pool_smaller_than_context never fires
CLEAN_MIX = {
    "short": 0.3,
    "prefix": 0.3,
    "medium": 0.1,
    "abort_api": 0.1,
    "abort_close": 0.1,
    "abort_queued": 0.1,
}
CLEAN_REQUESTS = 20
CLIENTS = 4
SOAK_ROUNDS = int(os.environ.get("KVGUARD_ARCH_SOAK_ROUNDS", "1"))


def _served(arch_name: str, tmp_path_factory):
    """The arch's engine (SGLang 0.5.23, one batch at a time so that the fault lands between
    known steps, the test-only fault plugin loaded), watched; yields ``(arch, engine, watch)``."""
    arch = sglang_arch(arch_name)
    work = tmp_path_factory.mktemp(arch_name)
    kwargs = arch.engine_kwargs(
        CONTEXT,
        max_total_tokens=POOL,
        extra_args=["--disable-overlap-schedule", "--max-running-requests", "8"],
        extra_env=fault_env(work / "events", "spec_draft_foreign"),
    )
    with watched_sglang(work, VERSION, arch.title, extra_pythonpath=[FAULTS_DIR], **kwargs) as (engine, watch):
        yield arch, engine, watch


@pytest.fixture(scope="module")
def llama_ngram(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    yield from _served("llama_ngram", tmp_path_factory)


@pytest.fixture(scope="module")
def glm5_mtp(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    yield from _served("glm5_mtp", tmp_path_factory)


def _engine_stats(watch: Watch):
    with watch.sidecar.lock:
        (stats,) = watch.sidecar.pipeline.engine_stats()
    return stats


def _clean_traffic_raises_nothing(arch, engine, watch: Watch, seed: int) -> dict:
    assert watch.since(0) == [], describe(watch.memory.findings)  # start-up: no gap
    mark = watch.mark()
    rng = random.Random(seed)
    page = arch.page_size
    # one system prompt shared by three tenants (two whole pages), then each tenant's question
    system = prompt(rng, 2 * page + page // 2)
    tenants = ("acme", "globex", "initech")
    shared = [
        Planned(
            i, "system", f"spec-sys-{i:04d}-{rng.getrandbits(48):012x}", tenants[i % 3], system + prompt(rng, 9), 24
        )
        for i in range(7)
    ]
    send = send_unified(engine.url)
    first = send(shared[0])
    shared_out = [first, *run_plan(shared[1:], send, concurrency=CLIENTS)]
    assert all(o.ok for o in shared_out), outcome_summary(shared_out)
    assert all((o.cached_tokens or 0) >= 2 * page for o in shared_out[1:]), [o.cached_tokens for o in shared_out]
    limit = int(engine.server_info()["max_req_input_len"])
    for round_ in range(SOAK_ROUNDS):  # ``make soak-arch``: the mix again with new prompts
        plan = make_plan(CLEAN_REQUESTS, Limits(CONTEXT, limit), mix=CLEAN_MIX, seed=seed + round_, phase=f"sp{round_}")
        outcomes = run_plan(plan, send, concurrency=CLIENTS)
        print(f"  round {round_}: cached {[o.cached_tokens for o in shared_out]}; mix {outcome_summary(outcomes)}")
        for o in outcomes:
            if o.req.kind in ABORT_KINDS:
                assert o.status == 200 and o.error is None and o.finish in ("abort", "closed", "length", "stop"), o
            else:
                assert o.ok, (o, outcome_summary(outcomes))
    time.sleep(3.0)  # a closed stream is aborted by SGLang ~2 s later: let its frees reach the sidecar
    assert watch.since(mark) == [], describe(watch.since(mark))

    stats = _engine_stats(watch)
    assert stats.pages_read > 0 and stats.pages_unverified == 0, stats
    coverage = {c.component: c for c in stats.coverage}
    assert all(c.status == "watched" for c in coverage.values()), coverage
    draft = coverage["draft"].detail
    assert "verify writes and reads followed" in draft, draft
    return coverage


def _verify_steps(engine) -> int:
    """How many verify steps the engine ran for one request (SGLang's meta_info)."""
    rng = random.Random(99)
    out = generate(engine.url, f"spec-probe-{rng.getrandbits(32):08x}", prompt(rng, 40), 16, "acme")
    return int(out["meta_info"].get("spec_verify_ct") or 0)


def _draft_writes_into_a_foreign_page(arch, engine, watch: Watch, tag: str) -> None:
    """``spec_draft_foreign``: the writer's next verify writes its drafted tokens into the owner's
    prompt page and attends over them; kvguard names the writer and the owner's tenant."""
    rng = random.Random(7)
    page = arch.page_size
    mark = watch.mark()
    owner = make_rid("spec_draft_foreign", "owner", tag)
    writer = make_rid("spec_draft_foreign", "writer", tag)
    with ThreadPoolExecutor(2) as pool:
        # the writer decodes across a page boundary (where the fault injects) while the owner lives
        fo = pool.submit(generate, engine.url, owner, prompt(rng, 3 * page + 3), 64, "initech")
        fw = pool.submit(generate, engine.url, writer, prompt(rng, max(page + 5, 2 * page - 24)), 48, "acme")
        redirected = watch.wait_event("spec_draft_foreign", "verify_slots_redirected")
        fw.result()
        fo.result()
    watch.wait_event("spec_draft_foreign", "row_restored")
    assert redirected["writer"] == writer and redirected["owner"] == owner, redirected
    found = watch.since(mark)
    kinds = sorted({f.kind for f in found})
    assert "late_write" in kinds and "foreign_read" in kinds, describe(found)
    late, foreign = one(found, "late_write"), one(found, "foreign_read")
    for f in (late, foreign):
        assert f.severity == "critical" and f.engine.role == "unified"
        assert (f.reader.rid, f.reader.tenant) == (writer, "acme")
    # the drafted tokens' KV went into the owner's page; the verify read it: initech exposed
    assert sorted(late.pages) == redirected["owner_pages"], (late.pages, redirected)
    assert parties(late) == [(owner, "initech", redirected["owner_pages"])]
    assert parties(foreign) == [(owner, "initech", redirected["owner_pages"])]
    # nothing else: no finding names anyone but the writer and the owner
    assert {f.reader.rid for f in found if f.reader} <= {writer, owner}, describe(found)


# --------------------------------------------------------------------------- n-gram (make test)
def test_ngram_clean_traffic_raises_nothing(llama_ngram):
    arch, engine, watch = llama_ngram
    coverage = _clean_traffic_raises_nothing(arch, engine, watch, seed=31)
    assert "NGRAM via NGRAMWorker" in coverage["draft"].detail
    mark = watch.mark()
    assert _verify_steps(engine) > 0  # the engine really speculated
    assert watch.since(mark) == [], describe(watch.since(mark))


def test_ngram_draft_writes_into_a_foreign_page(llama_ngram):
    arch, engine, watch = llama_ngram
    _draft_writes_into_a_foreign_page(arch, engine, watch, "ng")


# --------------------------------------------------------------------------- GLM-5 + MTP (make test-arch)
@pytest.mark.sweep
def test_glm5_mtp_clean_traffic_raises_nothing(glm5_mtp):
    arch, engine, watch = glm5_mtp
    coverage = _clean_traffic_raises_nothing(arch, engine, watch, seed=32)
    assert "NEXTN via EAGLEWorkerV2" in coverage["draft"].detail
    assert "DSATokenToKVPool" in coverage["draft"].detail  # the draft's own pool, its forwards followed too
    assert coverage["indexer_cache"].status == "watched"
    mark = watch.mark()
    assert _verify_steps(engine) > 0
    assert watch.since(mark) == [], describe(watch.since(mark))


@pytest.mark.sweep
def test_glm5_mtp_draft_writes_into_a_foreign_page(glm5_mtp):
    arch, engine, watch = glm5_mtp
    _draft_writes_into_a_foreign_page(arch, engine, watch, "g5")

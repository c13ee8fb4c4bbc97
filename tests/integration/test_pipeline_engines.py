"""Pipeline parallelism on real SGLang 0.5.23 engines on CPU (`--pp-size 2`, the tiny Llama with
one layer per stage; demo/engines.py ``llama_pp2``).

Each stage is a scheduler process running the whole scheduler (the same requests, the same
allocation decisions) over its own layers' pool, with its own kvguard ring: the sidecar judges
each stage as its own engine and timeline. On a prefill/decode pair SGLang sends stage s's
layers to decode stage s: the HELLO's rank counts across the stages, so the transfer lanes pair
stage to stage (sidecar/ledger/lanes.py), and each stage's digest partial covers its own layers,
the room's sum complete only with both (docs/wire-format.md, "Transfer digests").

Every test here runs in `make test-parallel` (the `sweep` marker: over make test's budget):
* a prefill/decode pair at PP 2: clean requests pair on both stages with their summed digests
  equal, and a truncated send (the send_truncated fault in both prefill stages) is caught on
  both decode stages with the victims named;
* a use-after-free on a unified PP 2 engine (caught on both
  stages) and the unified soak's workload on a PP 2 engine (the guard, content check and page
  identity on): zero findings, every read of both stages judged.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from kvguard.demo.engines import sglang_arch, start_engine
from tests.integration.test_parallel_engines import (
    fault_pair,
    routed_pair_soak,
    truncated_send_caught_on_both_decode_ranks,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

PP_ARCH = sglang_arch("llama_pp2")


@pytest.fixture(scope="module")
def pp_soak(tmp_path_factory, require_sglang):
    """A unified SGLang 0.5.23 engine at ``--pp-size 2`` (the tiny Llama, one layer per stage)
    under the unified soak's workload and settings (the guard, content check and page identity
    on; chunked prefill; a pool that retracts), watched by one sidecar: two rings, two timelines."""
    from tests.integration import test_soak_engine as soak
    from tests.support.soak.watch import Watch
    from tests.support.soak.workload import UNIFIED_MIX, Limits, make_plan, run_plan, send_unified

    if len(os.sched_getaffinity(0)) < PP_ARCH.ranks:
        pytest.skip(f"pipeline parallelism {PP_ARCH.pp_size} needs {PP_ARCH.ranks} CPU cores (one per stage)")
    require_sglang(soak.VERSION)
    requests = int(os.environ.get("KVGUARD_PP_SOAK_REQUESTS", "240"))
    work = tmp_path_factory.mktemp("soak-pp2")
    ring_dir, log_dir = work / "rings", work / "logs"
    ring_dir.mkdir()
    t0 = time.monotonic()
    with Watch(ring_dir) as watch:
        engine = start_engine(
            soak.VERSION,
            log_dir,
            ring_dir=ring_dir,
            **PP_ARCH.engine_kwargs(
                soak.CONTEXT_LEN,
                max_total_tokens=soak.POOL_TOKENS,
                extra_env=soak.RETRACTION_ENV,
                extra_args=["--chunked-prefill-size", str(soak.CHUNKED_PREFILL)],
            ),
        )
        try:
            t1 = time.monotonic()
            limits = Limits(soak.CONTEXT_LEN, int(engine.server_info()["max_req_input_len"]))
            plan = make_plan(requests, limits, mix=UNIFIED_MIX, seed=soak.SEED + 3, phase="pp-", burst=soak.CONCURRENCY)
            outcomes = run_plan(plan, send_unified(engine.url), soak.CONCURRENCY)
            run = soak._finish(
                "unified-pp2",
                watch,
                plan,
                outcomes,
                {"engine_startup": t1 - t0, "requests": time.monotonic() - t1},
                [str(engine.log_path)],
            )
            run.content_path = "host"
        finally:
            engine.stop()
    soak._report(run)
    return run


@pytest.mark.sweep  # make test-parallel
def test_a_pipeline_parallel_engine_is_watched_stage_by_stage_and_raises_nothing(pp_soak):
    """Each stage is a scheduler process of its own, over its own layer's pool: two timelines,
    both watched (COVERAGE), every read judged on both, nothing reported on clean traffic."""
    from tests.integration import test_soak_engine as soak

    engines = pp_soak.snapshot["engines"]
    assert len(engines) == 2, engines.keys()
    assert all(e["pages_read"] > 0 for e in engines.values()), engines
    soak.check_clients(pp_soak, pd=False)
    soak.check_sidecar_health(pp_soak)
    soak.check_probes_fired(pp_soak, soak.EXPECTED_KINDS)
    soak.check_reads_judged(pp_soak)
    soak.check_no_findings(pp_soak)


@pytest.mark.sweep  # make test-parallel
def test_pages_freed_under_a_reader_at_pp2_are_caught_on_both_stages_with_the_victim(tmp_path, require_sglang):
    """The use_after_free fault (tests/faults) in both stages of a ``--pp-size 2`` engine: two of
    a decoding request's prompt pages are freed under it and handed to another tenant's
    request. Each stage's pool is its own timeline: each raises use_after_free (read while
    free) and foreign_read naming the other tenant, with that stage's pages."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.integration.test_faults_engine import CONTEXT, UNIFIED_POOL, VERSION, fault_env, parties
    from tests.support.engine_watch import describe, generate, prompt, watched_sglang
    from tests.support.fault_plugin import FAULTS_DIR, make_rid

    if len(os.sched_getaffinity(0)) < PP_ARCH.ranks:
        pytest.skip(f"pipeline parallelism {PP_ARCH.pp_size} needs {PP_ARCH.ranks} CPU cores (one per stage)")
    require_sglang(VERSION)
    env = {**fault_env(tmp_path / "events", "use_after_free"), "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}
    kwargs = PP_ARCH.engine_kwargs(
        CONTEXT,
        max_total_tokens=UNIFIED_POOL,
        extra_env=env,
        extra_args=["--disable-overlap-schedule", "--max-running-requests", "8"],
    )
    kwargs["extra_pythonpath"] = [FAULTS_DIR]
    with watched_sglang(tmp_path, VERSION, "pp2 engine", **kwargs) as (engine, watch):
        rng = random.Random(6)
        victim, other = make_rid("use_after_free", "victim", "1"), make_rid("use_after_free", "other", "1")
        with ThreadPoolExecutor(2) as pool:
            fv = pool.submit(generate, engine.url, victim, prompt(rng, 21), 40, "initech")
            watch.wait_event("use_after_free", "victim_read_freed")
            fo = pool.submit(generate, engine.url, other, prompt(rng, 120), 4, "acme")
            fo.result()
            fv.result()
        watch.wait_event("use_after_free", "other_got_pages")
        time.sleep(1.0)  # (the later stage logs its own events a step behind)
        freed = {e["pid"]: e["pages"] for e in watch.events("use_after_free", "freed")}
        got = {e["pid"]: e["pages"] for e in watch.events("use_after_free", "other_got_pages")}
        assert len(freed) == 2 and freed == got, (freed, got)  # both stages, the same fault
        found = watch.since(0)
        by_engine: dict[int, list] = {}
        for f in found:
            by_engine.setdefault(f.engine.pid, []).append(f)
        assert sorted(by_engine) == sorted(freed), describe(found)
        for pid, fs in by_engine.items():
            assert sorted(f.kind for f in fs) == ["foreign_read", "use_after_free"], describe(fs)
            uaf = next(f for f in fs if f.kind == "use_after_free")
            foreign = next(f for f in fs if f.kind == "foreign_read")
            assert all((f.reader.rid, f.reader.tenant) == (victim, "initech") for f in fs), describe(fs)
            assert sorted(uaf.pages) == sorted(freed[pid]) and uaf.exposed == []
            assert parties(foreign) == [(other, "acme", sorted(got[pid]))]


@pytest.fixture(scope="module")
def pp2_fault_pair(tmp_path_factory, require_sglang):
    """A 0.5.23 prefill/decode pair, both at ``--pp-size 2`` (four scheduler processes), with
    the fault plugin in every stage and one sidecar on all four rings."""
    require_sglang("0.5.23")
    yield from fault_pair(tmp_path_factory, PP_ARCH, "send_truncated", "pp2-faults")


@pytest.mark.sweep  # make test-parallel
def test_transfers_at_pp2_pair_stage_to_stage_and_a_truncated_send_is_caught_on_both_decode_stages(pp2_fault_pair):
    """Each prefill stage sends its own layers' KV to the same decode stage: clean requests pair
    on both stages with the stages' digests added up on the room and compared equal; then
    send_truncated on both prefill stages (each sends its decode stage the first page of 50)
    is caught on each decode stage, the victims named, and the room's summed digests differ."""
    from tests.integration.test_faults_engine import _earlier_requests
    from tests.support.engine_watch import describe

    pair, watch = pp2_fault_pair
    rng = random.Random(9)
    compared = watch.sidecar.pipeline.ledger.digests_compared
    earlier = _earlier_requests(pair, rng, "pp2")
    watch.settle()
    assert watch.since(0) == [], describe(watch.memory.findings)
    ledger = watch.sidecar.pipeline.ledger
    assert ledger.digests_compared - compared >= len(earlier), (ledger.digests_compared, earlier)
    ranks = sorted(
        (e.role, e.rank)
        for e in (watch.sidecar.pipeline.engine_ref(t) for t in watch.sidecar.pipeline.engines.values())
    )
    assert ranks == [("decode", 0), ("decode", 1), ("prefill", 0), ("prefill", 1)], ranks
    truncated_send_caught_on_both_decode_ranks(pair, watch, rng, earlier)


@pytest.mark.sweep  # make test-parallel
def test_a_routed_soak_on_a_pp2_pair_raises_nothing(tmp_path, require_sglang):
    """The routed prefill/decode soak (clients that send no rid; the guard, content check and page
    identity on) on a pair whose engines both run two pipeline stages: four timelines, every
    transfer paired stage to stage and its stages' digests compared, nothing reported."""
    from tests.integration import test_soak_engine as soak

    require_sglang(soak.VERSION)
    requests = int(os.environ.get("KVGUARD_PP_SOAK_REQUESTS", "240")) // 2
    run = routed_pair_soak(tmp_path, PP_ARCH, requests, 4, "pp-pd-", "pd-pp2")
    transfers = run.snapshot["transfers"]
    assert transfers["paired"] > 0 and transfers["digests_compared"] > 0, transfers

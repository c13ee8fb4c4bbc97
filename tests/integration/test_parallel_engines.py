"""Tensor parallelism on a real SGLang prefill/decode pair on CPU (`--tp-size 2` on both
engines, the tiny Llama: 2 kv heads, one per rank; demo/engines.py ``llama_tp2``).

SGLang runs one scheduler process per rank, each with its own allocator, pool and kvguard
ring: the sidecar keeps one timeline per rank, pairs prefill rank i's sends with decode rank
i's reservation under the room the router chose (sidecar/ledger/lanes.py), and adds each
end's per-rank partial digests up on the room (docs/wire-format.md, "Transfer digests").

Every test here runs in `make test-parallel` (the `sweep` marker: an engine pair at TP 2 takes
2.5 minutes of a 2-core CI machine, over make test's budget):
* the 2026 leak (SGLang 0.5.19) on the TP 2 pair: caught on each decode rank with the same
  victims named, the digests compared once across both ranks, nothing else;
* four injected transfer faults on a TP 2 pair of 0.5.23 (the
  test-only fault plugin in every rank): a truncated send caught on both decode ranks, a
  send of a page the request never wrote caught on both prefill ranks, source pages handed to
  another request while their send was in flight (a use_after_free on both prefill ranks), and
  a completion into pages decode had given away (a late_write on both decode ranks), the
  victims named;
  prefill and decode at different TP sizes (1 and 2, both ways), every transfer paired and
  digested; the routed prefill/decode soak on a TP 2 pair of 0.5.23
  (clients that send no rid, the guard, content check and page identity on): zero findings;
  and a vLLM server with data parallelism 2 (two EngineCores, two timelines) on clean traffic.

Pipeline parallelism: tests/integration/test_pipeline_engines.py.

SGLang's data-parallel attention does not run on its CPU path (0.5.23): with torch_native the
DP padding asks the backend for ``get_cuda_graph_seq_len_fill_value`` (NotImplementedError),
with Triton ``prepare_mlp_sync_batch`` pins memory (no pinned allocator on CPU).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter

import pytest

from kvguard.demo.engines import PDPair, sglang_arch
from kvguard.demo.run import capture_incident

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

ARCH = sglang_arch("llama_tp2")


@pytest.fixture
def two_cores():
    if len(os.sched_getaffinity(0)) < ARCH.tp_size:
        pytest.skip(f"tensor parallelism {ARCH.tp_size} needs {ARCH.tp_size} CPU cores (one per rank)")


@pytest.mark.sweep  # make test-parallel (2.5 minutes each on a 2-core CI machine: over make test's budget)
@pytest.mark.parametrize(
    "model",
    [
        "llama_tp2",
        # pipeline parallelism 2 (tests/integration/test_pipeline_engines.py): each stage its own
        # timeline, the HELLO's rank counting across the stages; `kvguard demo --model llama_pp2`
        "llama_pp2",
    ],
)
def test_the_0_5_19_leak_on_a_tp2_pair_is_caught_on_every_rank_with_the_same_victims(
    tmp_path, require_sglang, two_cores, model
):
    require_sglang("0.5.19")
    run = capture_incident("0.5.19", str(tmp_path), progress=None, model=model)
    assert run.records_by_kind["HELLO"] == 4 and run.records_lost == 0  # two ranks (stages) on each engine
    long = run.scenario.long.result
    assert long.ok and long.prompt_tokens == 600  # what a status-code check sees
    normal_rids = {r.result.rid: r.result.tenant for r in run.scenario.normal}
    by_kind = Counter((f.kind, f.engine.role, f.engine.rank) for f in run.findings)
    assert by_kind == Counter(
        {
            ("pool_smaller_than_context", "prefill", 0): 1,
            ("pool_smaller_than_context", "prefill", 1): 1,
            ("pool_smaller_than_context", "decode", 0): 1,
            ("pool_smaller_than_context", "decode", 1): 1,
            # each decode rank reserved 150 pages for the 600-token prompt; each prefill rank sent 1 token
            ("transfer_size_mismatch", "decode", 0): 1,
            ("transfer_size_mismatch", "decode", 1): 1,
            ("unwritten_read", "decode", 0): 1,
            ("unwritten_read", "decode", 1): 1,
            # the two ranks' partial digests (one kv head each) summed on the room: compared once
            ("checksum_mismatch", "decode", 0): 1,
        }
    ), [(f.kind, f.engine.role, f.engine.rank, f.summary) for f in run.findings]
    reads = {f.engine.rank: f for f in run.findings if f.kind == "unwritten_read"}
    room = reads[0].reader.bootstrap_room
    for read in reads.values():
        assert read.severity == "critical" and (read.reader.rid, read.reader.tenant) == (long.rid, "initech")
        assert read.reader.bootstrap_room == room and len(read.pages) == 149
        assert read.evidence["sender_tenant"] == "initech"
        assert read.exposed and all(normal_rids.get(p.rid) == p.tenant for p in read.exposed), read.exposed
    # the ranks make the same decisions on the same inputs: the same pages, the same victims
    assert reads[0].pages == reads[1].pages
    assert {(p.rid, tuple(p.pages)) for p in reads[0].exposed} == {(p.rid, tuple(p.pages)) for p in reads[1].exposed}
    (digest,) = [f for f in run.findings if f.kind == "checksum_mismatch"]
    assert digest.evidence["bootstrap_room"] == room
    assert digest.evidence["sender_tokens"] == [0, 1] and digest.evidence["receiver_tokens"] == [0, 600]
    # every transfer paired on each decode rank with its own prefill rank; each room's digests once
    outcomes = [dict(o) for o in run.stats.ledger.transfers_by_engine.values() if sum(o.values())]
    assert len(outcomes) == 2 and outcomes[0] == outcomes[1], outcomes
    assert outcomes[0]["paired"] >= 9 and outcomes[0]["unpaired"] == 0, outcomes
    # both ends' sums completed, from both ranks' partials, for (at least) the scenario's nine rooms
    assert run.stats.ledger.digests_compared >= len(run.scenario.requests) == 9, run.stats.ledger


def routed_pair_soak(tmp_path, arch, requests: int, seed_offset: int, phase: str, name: str):
    """The routed prefill/decode soak (clients that send no rid; the guard, content check and
    page identity on: the PD soak's settings) on a pair of ``arch`` (each engine two scheduler
    processes: four timelines), with the checks every such soak ends with: every client served
    as asked, nothing lost, every probe fired, every read judged, no finding."""
    from tests.integration import test_soak_engine as soak
    from tests.support.soak.watch import Watch
    from tests.support.soak.workload import ROUTED_MIX, Limits, make_plan, run_plan, send_routed

    ring_dir, log_dir = tmp_path / "rings", tmp_path / "logs"
    ring_dir.mkdir()
    t0 = time.monotonic()
    kwargs = arch.pair_kwargs(soak.CONTEXT_LEN, extra_env=soak.PD_ENV)
    kwargs.update(prefill_pool_tokens=soak.PD_PREFILL_POOL, decode_pool_tokens=soak.PD_DECODE_POOL)
    with Watch(ring_dir) as watch:
        with PDPair(soak.VERSION, ring_dir, log_dir, **kwargs) as pair:
            t1 = time.monotonic()
            limits = Limits(soak.CONTEXT_LEN, int(pair.prefill.server_info()["max_req_input_len"]))
            plan = make_plan(requests, limits, mix=ROUTED_MIX, seed=soak.SEED + seed_offset, phase=phase)
            outcomes = run_plan(plan, send_routed(pair.router.url, pair.decode.url), soak.PD_CONCURRENCY)
            logs = [str(pair.prefill.log_path), str(pair.decode.log_path), str(pair.router.log_path)]
            run = soak._finish(
                name, watch, plan, outcomes, {"engine_startup": t1 - t0, "requests": time.monotonic() - t1}, logs
            )
            run.content_path = soak.PD_ENV["KVGUARD_CONTENT_PATH"]
    soak._report(run)
    assert sum(1 for e in run.snapshot["engines"].values()) == 4, run.snapshot["engines"].keys()
    soak.check_clients(run, pd=True, routed=True)
    soak.check_sidecar_health(run)
    soak.check_probes_fired(run, (*soak.EXPECTED_KINDS, *soak.PD_KINDS, "XFER_DIGEST"))
    soak.check_reads_judged(run)
    soak.check_no_findings(run)
    return run


@pytest.mark.sweep  # make test-parallel
def test_a_routed_soak_on_a_tp2_pair_raises_nothing(tmp_path, require_sglang, two_cores):
    from tests.integration import test_soak_engine as soak

    require_sglang(soak.VERSION)
    requests = int(os.environ.get("KVGUARD_TP_SOAK_REQUESTS", "120"))
    routed_pair_soak(tmp_path, ARCH, requests, 2, "tp-", "pd-tp2")


# ---------------------------------------------------------------------- injected transfer faults at TP 2
# the test-only fault plugin (tests/faults) loads in every scheduler rank and acts by rid, so both
# ranks of an engine do the same wrong thing, as a real bug in the shared scheduler code would


def fault_pair(tmp_path_factory, arch, faults: str, label: str):
    """A 0.5.23 prefill/decode pair of ``arch`` with the fault plugin (``faults``) in every
    scheduler process and one sidecar on every ring, no router (the faults act by rid): yields
    ``(pair, watch)``, both stopped after."""
    from tests.integration.test_faults_engine import CONTEXT, DECODE_POOL, PREFILL_POOL, VERSION, fault_env
    from tests.support.engine_watch import Watch
    from tests.support.fault_plugin import FAULTS_DIR

    if len(os.sched_getaffinity(0)) < arch.ranks:
        pytest.skip(f"{arch.title} needs {arch.ranks} CPU cores (one per scheduler process)")
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda) not installed")
    work = tmp_path_factory.mktemp(label)
    ring_dir, events_dir = work / "rings", work / "events"
    ring_dir.mkdir()
    events_dir.mkdir()
    watch = Watch(ring_dir, events_dir)
    kwargs = arch.pair_kwargs(CONTEXT, extra_env=fault_env(events_dir, faults))
    kwargs.update(prefill_pool_tokens=PREFILL_POOL, decode_pool_tokens=DECODE_POOL)
    pair = PDPair(VERSION, ring_dir, work / "logs", extra_pythonpath=[FAULTS_DIR], router=False, **kwargs)
    try:
        pair.start()
        watch.settle()
        yield pair, watch
    finally:
        pair.stop()
        watch.stop()


def truncated_send_caught_on_both_decode_ranks(pair, watch, rng, earlier: dict) -> list:
    """send_truncated on both sending ranks (stages): each sends its decode rank the first page of
    50. Caught on each decode rank, the victims (``earlier``'s tenants) named, the room's summed
    digests compared once and different. Returns the two unwritten_read findings."""
    from tests.support.engine_watch import describe, prompt
    from tests.support.fault_plugin import make_rid

    watch.settle()
    mark = watch.mark()
    rid = make_rid("send_truncated", "f", "1")
    r = pair.generate(prompt(rng, 200), tenant="initech", max_new_tokens=8, rid=rid)
    assert r.ok and r.prompt_tokens == 200, r.summary()
    watch.wait_event("send_truncated", "truncated")
    found = watch.since(mark)
    assert Counter((f.kind, f.engine.role, f.engine.rank) for f in found) == Counter(
        {
            ("transfer_size_mismatch", "decode", 0): 1,
            ("transfer_size_mismatch", "decode", 1): 1,
            ("unwritten_read", "decode", 0): 1,
            ("unwritten_read", "decode", 1): 1,
            ("checksum_mismatch", "decode", 0): 1,  # the ranks' (stages') partials summed on the room
        }
    ), describe(found)
    reads = [f for f in found if f.kind == "unwritten_read"]
    for read in reads:
        assert (read.reader.rid, read.reader.tenant, read.reader.bootstrap_room) == (rid, "initech", r.room)
        assert len(read.pages) == 49 and read.exposed
        assert all(earlier.get(p.rid) == p.tenant for p in read.exposed), (read.exposed, earlier)
    return reads


@pytest.fixture(scope="module")
def tp2_fault_pair(tmp_path_factory, require_sglang):
    require_sglang("0.5.23")
    faults = "send_truncated,send_foreign_page,send_source_released,completion_after_release"
    yield from fault_pair(tmp_path_factory, ARCH, faults, "tp2-faults")


@pytest.mark.sweep  # make test-parallel
def test_a_truncated_send_at_tp2_is_caught_on_both_decode_ranks_with_the_victims(tp2_fault_pair):
    """send_truncated on both prefill ranks: each sends decode's rank its first page of 50."""
    from tests.integration.test_faults_engine import _earlier_requests

    pair, watch = tp2_fault_pair
    rng = random.Random(7)
    earlier = _earlier_requests(pair, rng, "tp2")
    reads = truncated_send_caught_on_both_decode_ranks(pair, watch, rng, earlier)
    assert reads[0].pages == reads[1].pages


@pytest.mark.sweep  # make test-parallel
def test_a_send_of_a_page_the_request_never_wrote_at_tp2_names_the_victim_on_both_prefill_ranks(tp2_fault_pair):
    from tests.integration.test_faults_engine import send_foreign_page_scene
    from tests.support.engine_watch import describe

    pair, watch = tp2_fault_pair
    mark = watch.mark()
    victim, victim_page, rid, r, ev = send_foreign_page_scene(pair, watch)
    found = watch.since(mark)
    assert sorted((f.kind, f.engine.role, f.engine.rank) for f in found) == [
        ("unwritten_send", "prefill", 0),
        ("unwritten_send", "prefill", 1),
    ], describe(found)
    for f in found:
        assert f.severity == "critical" and f.pages == [victim_page]
        assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == (rid, "initech", r.room)
        if victim_page != ev["own_page"]:
            assert victim.rid in [p.rid for p in f.exposed], describe(found)


@pytest.mark.sweep  # make test-parallel
def test_source_pages_changing_hands_in_flight_at_tp2_are_caught_on_both_prefill_ranks(tp2_fault_pair):
    """send_source_released on both prefill ranks: each gives f's pages to the victim while its
    own transfer of them is in flight; each rank's send is judged at its own completion."""
    from tests.integration.test_faults_engine import (
        _in_flight_ended,
        _wait_sender_completions,
        send_source_released_scene,
    )
    from tests.support.engine_watch import describe

    pair, watch = tp2_fault_pair
    mark, ended_before = watch.mark(), _in_flight_ended(watch)
    rid, r, victim, released, got = send_source_released_scene(pair, watch, random.Random(10))
    _wait_sender_completions(watch, ended_before, n=4)  # f's and v's, on each prefill rank
    found = watch.since(mark)
    assert Counter((f.kind, f.engine.role, f.engine.rank) for f in found) == Counter(
        {
            ("use_after_free", "prefill", 0): 1,
            ("use_after_free", "prefill", 1): 1,
            ("checksum_mismatch", "decode", 0): 1,  # the ranks' partials summed on the room
        }
    ), describe(found)
    for uaf in (f for f in found if f.kind == "use_after_free"):
        assert uaf.severity == "critical" and uaf.evidence["access"] == "send"
        assert (uaf.reader.rid, uaf.reader.tenant, uaf.reader.bootstrap_room) == (rid, "initech", r.room)
        assert set(got) <= set(uaf.pages) <= set(released["pages"])
        assert (victim.rid, "acme") in [(p.rid, p.tenant) for p in uaf.exposed], describe(found)


@pytest.mark.sweep  # make test-parallel
def test_a_completion_after_decode_gave_its_pages_away_at_tp2_is_a_late_write_on_both_decode_ranks(tp2_fault_pair):
    """completion_after_release on both decode ranks: each gives f's reservation to the victim,
    then its prefill rank's transfer into it completes."""
    from tests.integration.test_faults_engine import (
        _in_flight_ended,
        _wait_sender_completions,
        completion_after_release_scene,
    )
    from tests.support.engine_watch import describe

    pair, watch = tp2_fault_pair
    mark, ended_before = watch.mark(), _in_flight_ended(watch)
    rid, v_rid, r, released, got = completion_after_release_scene(pair, watch, random.Random(11))
    _wait_sender_completions(watch, ended_before, n=2)  # f's on each prefill rank
    found = watch.since(mark)
    lates = [f for f in found if f.kind == "late_write"]
    assert sorted((f.engine.role, f.engine.rank) for f in lates) == [("decode", 0), ("decode", 1)], describe(found)
    # v's own transfer may land before or after f's: its digest sees f's KV only if f's came last
    assert {f.kind for f in found} <= {"late_write", "checksum_mismatch"}, describe(found)
    for late in lates:
        assert late.severity == "critical" and late.evidence["access"] == "completion"
        assert (late.reader.rid, late.reader.tenant, late.reader.bootstrap_room) == (rid, "initech", r.room)
        assert set(got) <= set(late.pages) <= set(released["pages"])
        assert [(p.rid, p.tenant) for p in late.exposed] == [(v_rid, "acme")], describe(found)


@pytest.mark.sweep  # make test-parallel
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_prefill_and_decode_at_different_tp_sizes_pair_and_compare_every_transfer(
    tmp_path, require_sglang, two_cores, prefill_tp, decode_tp
):
    """Mooncake moves heads between unequal splits: decode at TP 2 from prefill at TP 1 (decode
    rank 1's lane has no sender of its own: it takes rank 0's chunks), and decode at TP 1 from
    prefill at TP 2 (prefill rank 1's story has no receiver). Every transfer paired on every
    decode rank, every room's head-stream digests (alg 3) compared across the split, nothing
    reported."""
    from kvguard.sidecar.service import Sidecar
    from kvguard.sidecar.sinks.basic import MemorySink
    from tests.support.sidecar_settle import wait_until_applied

    require_sglang("0.5.23")
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir()
    kwargs = ARCH.pair_kwargs(512)
    plain = [a for a in kwargs["prefill_args"] if a not in ("--tp-size", str(ARCH.tp_size))]
    kwargs.update(
        prefill_args=plain + (["--tp-size", str(prefill_tp)] if prefill_tp > 1 else []),
        decode_args=plain + (["--tp-size", str(decode_tp)] if decode_tp > 1 else []),
        prefill_pool_tokens=512,
        decode_pool_tokens=1024,
    )
    memory = MemorySink()
    sidecar = Sidecar(str(ring_dir), sinks=[memory], remove_dead_rings=False).start()
    try:
        with PDPair("0.5.23", ring_dir, tmp_path / "logs", **kwargs) as pair:
            rng = random.Random(5)
            for i in range(10):
                prompt = [rng.randint(3, 255) for _ in range(rng.randint(20, 200))]
                r = pair.generate(prompt, tenant=("acme", "globex")[i % 2], max_new_tokens=8)
                assert r.ok, r.summary()
            wait_until_applied(sidecar, 1.0, 20.0)
            with sidecar.lock:
                ledger = sidecar.pipeline_stats().ledger
                borrowed = sidecar.pipeline.ledger.lanes_borrowed
    finally:
        sidecar.stop()
    assert memory.findings == [], [f.summary for f in memory.findings]
    decode_ranks = [dict(o) for o in ledger.transfers_by_engine.values() if sum(o.values())]
    assert len(decode_ranks) == decode_tp, decode_ranks
    assert all(o["paired"] >= 10 and o["unpaired"] == 0 for o in decode_ranks), decode_ranks
    assert ledger.digests_compared >= 10 and ledger.digests_incomparable == 0, ledger
    assert borrowed >= 10 if decode_tp > prefill_tp else borrowed == 0, borrowed

"""The 2026 incident's own model class on real SGLang engines (CPU): a tiny GLM-5
(``GlmMoeDsaForCausalLM``: MLA latent KV + the DSA sparse-attention indexer cache, KV pool
``DSATokenToKVPool`` with 64-token pages) with dummy weights, served with the CPU kernel shims
of demo/arch_shims.py (demo/engines.py ``sglang_arch("glm5")``). kvguard's plugin, loaded by
SGLang itself, and an in-process sidecar watch as they would in production.

Three engine set-ups, each started once (about 4-5 minutes in all on 2 cores):

* the demo's incident on a SGLang 0.5.19 prefill/decode pair (Mooncake over TCP, SGLang's router
  in front, clients that send no rid; demo/run.py ``capture_incident(model="glm5")``, what
  ``kvguard demo --model glm5`` runs): decode reserves 10 pages for initech's 600-token prompt,
  prefill rejects it and still sends one page; kvguard names the tenants whose latent KV decode
  read (``unwritten_read``), the short transfer (``transfer_size_mismatch``), the two ends'
  digests over the latent pool (``checksum_mismatch``) and the pools smaller than the context;
  nothing about the eight normal requests, whose digests matched. The indexer cache is followed
  with the latent's pages and is in both ends' digests (alg 3 on host pools): no coverage gap;
* the same pair with the guard on (``KVGUARD_GUARD=transfer``): the request fails in the engine
  before decode reads anything, and kvguard reports what was prevented (``make test-arch``: the
  guard's path is the GPT-2 pair's, which ``make test`` runs);
* one SGLang 0.5.23 unified engine with the test-only fault plugin (tests/faults): clean traffic
  (a prefix shared by three tenants, concurrent clients, client aborts) raises nothing, every page
  read is judged and the engine's COVERAGE says the DSA pool and its indexer cache are watched;
  then ``use_after_free`` (pages freed under a decoding request and handed to another) is caught
  with the reader and the exposed tenant named (last: it breaks the engine's accounting).

The DeepSeek-V2 (plain MLA) pair runs the same way (``kvguard demo --model deepseek_v2``); it is
not repeated here to keep the module short.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvguard.demo.engines import sglang_arch
from kvguard.demo.run import capture_incident, expected, guard_aborts
from tests.integration.test_faults_engine import fault_env, one, parties
from tests.support.engine_watch import Watch, describe, generate, prompt, watched_sglang
from tests.support.fault_plugin import FAULTS_DIR, make_rid
from tests.support.soak.workload import ABORT_KINDS, Limits, Planned, make_plan, outcome_summary, run_plan, send_unified

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

GLM5 = sglang_arch("glm5")
LEAKING, FIXED = "0.5.19", "0.5.23"
PAGE = GLM5.page_size  # 64: DSA's index pages
LONG_PROMPT = 600  # the demo's over-long prompt: ceil(600 / 64) = 10 pages reserved by decode


def _watched(run_or_stats, role: str) -> None:
    """The engine judged page reads, none unverified, on a DSA pool kvguard watches."""
    engine = run_or_stats.engine(role)
    assert engine is not None and engine.pages_read > 0 and engine.pages_unverified == 0, engine
    assert GLM5.kv_pool in run_or_stats.kv_pool(role), run_or_stats.kv_pool(role)
    assert run_or_stats.coverage(role)["kv_pool"] == "watched"


# --------------------------------------------------------------------------- (a) 0.5.19 PD, the incident
def test_glm5_pd_0_5_19_leak_is_caught_with_the_exposed_tenants(tmp_path, require_sglang):
    require_sglang(LEAKING)
    run = capture_incident(LEAKING, str(tmp_path), model="glm5")
    long = run.scenario.long.result
    normal_rids = {r.result.rid: r.result.tenant for r in run.scenario.normal}
    # what a status-code check sees: success, for every request
    assert all(r.result.ok for r in run.scenario.normal), [r.result.summary() for r in run.scenario.normal]
    assert long.ok and long.routed and long.prompt_tokens == LONG_PROMPT, long.summary()
    assert expected(LEAKING, run.scenario, run.findings, model="glm5") == (True, "")

    assert sorted(f.kind for f in run.findings) == [
        "checksum_mismatch",
        "pool_smaller_than_context",
        "pool_smaller_than_context",
        "transfer_size_mismatch",
        "unwritten_read",
    ], describe(run.findings)
    pools = {f.engine.role: f for f in run.findings if f.kind == "pool_smaller_than_context"}
    assert pools["prefill"].severity == "critical" and pools["prefill"].evidence["pool_tokens"] == 512
    assert pools["decode"].severity == "warning" and pools["decode"].evidence["context_len"] == 2048
    # both ends digest the indexer K cache with the latent (the pair's normal transfers matched)
    for role in ("prefill", "decode"):
        assert run.coverage(role)["indexer_cache"] == "watched", run.coverage(role)

    (read,) = [f for f in run.findings if f.kind == "unwritten_read"]
    (size,) = [f for f in run.findings if f.kind == "transfer_size_mismatch"]
    (digest,) = [f for f in run.findings if f.kind == "checksum_mismatch"]
    for f in (read, size, digest):
        assert f.severity == "critical" and f.engine.role == "decode"
        assert (f.reader.rid, f.reader.tenant) == (long.rid, "initech") and f.reader.bootstrap_room
        assert f.evidence["sender_rid"] not in (None, long.rid) and f.evidence["sender_tenant"] == "initech"
    assert size.evidence == {
        "direction": "fewer_sent",
        "sent_tokens": 1,
        "reserved_tokens": LONG_PROMPT,
        "sent_pages": 1,
        "reserved_pages": 10,
        "sender_rid": read.evidence["sender_rid"],
        "sender_tenant": "initech",
    }
    # 9 of the 10 reserved pages were never written for it. Page granularity: the last one
    # (positions 576-639) takes decode's own first write (position 600) before that forward reads
    # it, so kvguard counts it written; the other 8 are read unwritten
    assert len(size.pages) == 9 and len(read.pages) == 8 and set(read.pages) < set(size.pages)
    assert read.exposed, "the stale pages must name whose KV they held"
    for party in read.exposed:
        assert normal_rids.get(party.rid) == party.tenant, (party, normal_rids)
    assert {p.tenant for p in read.exposed} <= {"acme", "globex"}
    exposed_pages = sorted(p for party in read.exposed for p in party.pages)
    assert len(exposed_pages) == len(set(exposed_pages)) and set(exposed_pages) <= set(read.pages)
    # the transfer digests over the latent pool (engine_hooks/digest.py latent_view): prefill
    # hashed the 1 token it sent, decode the 600 it reserved; the 8 normal transfers matched
    assert digest.evidence["sender_tokens"] == [0, 1] and digest.evidence["receiver_tokens"] == [0, LONG_PROMPT]
    assert digest.evidence["sender_digest"] != digest.evidence["receiver_digest"]
    assert len(digest.pages) == 10 and set(read.pages) < set(digest.pages)
    assert run.records_by_kind.get("XFER_DIGEST") == 2 * len(run.scenario.requests), run.records_by_kind
    assert run.stats.ledger.digests_compared == len(run.scenario.requests), run.stats.ledger

    # both engines: the DSA pool watched (ownership + latent digests), the indexer cache followed
    # and in the digest (the 8 normal transfers' digests matched with it included)
    for role in ("prefill", "decode"):
        _watched(run, role)
    assert run.records_lost == 0


@pytest.mark.sweep  # (make test-arch: the guard's path is the GPT-2 pair's, tests/integration/test_guard_engine.py, in make test)
def test_glm5_pd_0_5_19_guard_fails_the_request_instead(tmp_path, require_sglang):
    require_sglang(LEAKING)
    run = capture_incident(LEAKING, str(tmp_path), model="glm5", guard="transfer")
    long = run.scenario.long.result
    # the client gets decode's error (through the router), not a completion over other tenants' KV
    assert not long.ok and long.routed and long.decode_status == 500 and not long.output_ids, long.summary()
    assert "KVTransferError" in long.error or "Failed to get kvcache" in long.error, long.error
    for r in run.scenario.normal:
        assert r.result.ok and r.result.completion_tokens == 8, r.result.summary()
    assert expected(LEAKING, run.scenario, run.findings, "transfer", model="glm5") == (True, "")

    (prevented,) = guard_aborts(run.findings)
    assert (prevented.kind, prevented.severity, prevented.engine.role) == (
        "transfer_size_mismatch",
        "critical",
        "prefill",
    )
    assert prevented.reader.tenant == "initech" and prevented.reader.bootstrap_room == long.room
    assert prevented.evidence["prompt_tokens"] == LONG_PROMPT and prevented.evidence["sent_tokens"] == 1
    assert prevented.evidence["reserved_pages"] == 10 and prevented.exposed == []
    kinds = sorted(f.kind for f in run.findings if f.kind != "orphan_transfer")
    assert kinds == [
        "pool_smaller_than_context",
        "pool_smaller_than_context",
        "transfer_size_mismatch",
    ], describe(run.findings)
    # nothing was read or received that should not have been
    for role in ("prefill", "decode"):
        _watched(run, role)
    assert run.records_lost == 0


# --------------------------------------------------------------------------- (b), (c) a 0.5.23 unified engine
CONTEXT = 1024
POOL = 2048  # 32 pages of 64, at least the context: pool_smaller_than_context never fires
SYSTEM_PREFIX = 160  # shared by every tenant: 2 whole pages the radix cache can hand out
# the clean mix (tests/support/soak/workload.py kinds); short and medium prompts, per-tenant prefixes, aborts
CLEAN_MIX = {
    "short": 0.3,
    "prefix": 0.2,
    "medium": 0.2,
    "abort_api": 0.1,
    "abort_close": 0.1,
    "abort_queued": 0.1,
}
CLEAN_REQUESTS = 24
CLIENTS = 4


@pytest.fixture(scope="module")
def glm5_unified(tmp_path_factory, require_sglang):
    require_sglang(FIXED)
    work = tmp_path_factory.mktemp("glm5-unified")
    kwargs = GLM5.engine_kwargs(
        CONTEXT,
        max_total_tokens=POOL,
        # one batch at a time (run_batch -> process_batch_result): the fault lands between known steps
        extra_args=["--disable-overlap-schedule", "--max-running-requests", "8"],
        extra_env={
            **fault_env(work / "events", "use_after_free"),
            # the victim decodes inside its partial last page (64 tokens): the freed pages
            # need only sit one page deep in the free list for the other request to get them
            "KVGUARD_FAULT_UAF_DEPTH": "1",
            # use_after_free leaves the radix tree and the free list sharing two pages
            # (tests/integration/test_faults_engine.py): SGLang's strict idle check would raise on it
            "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",
        },
    )
    with watched_sglang(work, FIXED, "GLM-5 unified engine", extra_pythonpath=[FAULTS_DIR], **kwargs) as served:
        yield served


class _Stats:
    """The sidecar's view of the one engine (the same reads as demo/run.py DemoRun's)."""

    def __init__(self, watch: Watch):
        with watch.sidecar.lock:
            (self._engine,) = watch.sidecar.pipeline.engine_stats()

    def engine(self, role: str):
        return self._engine if self._engine.role == role else None

    def coverage(self, role: str) -> dict[str, str]:
        return {c.component: c.status for c in self._engine.coverage}

    def kv_pool(self, role: str) -> str:
        return next(c.detail for c in self._engine.coverage if c.component == "kv_pool")


def _shared_prefix_traffic(url: str, rng: random.Random) -> list:
    """One system prompt shared by three tenants: the first request fills the radix cache, the
    next six (two per tenant, concurrent) are handed its whole pages."""
    system = prompt(rng, SYSTEM_PREFIX)
    tenants = ("acme", "globex", "initech")
    plan = [
        Planned(
            i, "system", f"arch-sys-{i:04d}-{rng.getrandbits(48):012x}", tenants[i % 3], system + prompt(rng, 24), 8
        )
        for i in range(7)
    ]
    send = send_unified(url)
    first = send(plan[0])
    return [first, *run_plan(plan[1:], send, concurrency=CLIENTS)]


def test_glm5_0_5_23_clean_traffic_raises_nothing(glm5_unified):
    engine, watch = glm5_unified
    assert watch.since(0) == [], describe(watch.memory.findings)  # start-up: no gap, no pool finding
    mark = watch.mark()
    rng = random.Random(23)
    shared = _shared_prefix_traffic(engine.url, rng)
    assert all(o.ok for o in shared), outcome_summary(shared)
    # prefixes crossed tenants: every later request was handed the system prompt's 2 whole pages
    assert all((o.cached_tokens or 0) >= 2 * PAGE for o in shared[1:]), [o.cached_tokens for o in shared]
    limit = int(engine.server_info()["max_req_input_len"])
    plan = make_plan(CLEAN_REQUESTS, Limits(CONTEXT, limit), mix=CLEAN_MIX, seed=5, phase="arc")
    outcomes = run_plan(plan, send_unified(engine.url), concurrency=CLIENTS)
    print(f"  shared prefix: cached tokens {[o.cached_tokens for o in shared]}; mix {outcome_summary(outcomes)}")
    for o in outcomes:
        if o.req.kind in ABORT_KINDS:
            assert o.status == 200 and o.error is None and o.finish in ("abort", "closed", "length", "stop"), o
        else:
            assert o.ok, (o, outcome_summary(outcomes))
    assert any(o.req.kind in ABORT_KINDS and o.finish in ("abort", "closed") for o in outcomes), outcome_summary(
        outcomes
    )
    time.sleep(3.0)  # a closed stream is aborted by SGLang ~2 s later: let its frees reach the sidecar
    assert watch.since(mark) == [], describe(watch.since(mark))

    # every page read judged, none unverified; the engine's COVERAGE: the DSA pool and its
    # indexer cache watched (a unified engine digests nothing, so nothing is missing)
    stats = _Stats(watch)
    _watched(stats, "unified")
    coverage = {c.component: c for c in stats.engine("unified").coverage}
    assert coverage["indexer_cache"].status == "watched", coverage["indexer_cache"]
    assert "indexer" in coverage["indexer_cache"].detail
    assert "GlmMoeDsaForCausalLM" in coverage["model"].detail
    assert all(c.status == "watched" for c in coverage.values()), coverage


def test_glm5_0_5_23_pages_freed_under_their_reader(glm5_unified):
    """tests/integration/test_faults_engine.py's use_after_free on the DSA pool: two whole prompt pages of a
    decoding request are freed (its row still names them), read while free, then handed to
    another tenant's request and read again. Runs last: it breaks the engine's accounting."""
    engine, watch = glm5_unified
    rng = random.Random(6)
    mark = watch.mark()
    victim, other = make_rid("use_after_free", "victim", "g5"), make_rid("use_after_free", "other", "g5")
    # 200 prompt tokens = row pages 0-3; pages 1 and 2 are freed; the 40 new tokens stay in page 3
    with ThreadPoolExecutor(2) as pool:
        fv = pool.submit(generate, engine.url, victim, prompt(rng, 200), 40, "initech")
        freed = watch.wait_event("use_after_free", "freed")
        watch.wait_event("use_after_free", "victim_read_freed")
        fo = pool.submit(generate, engine.url, other, prompt(rng, 250), 4, "acme")  # 4 pages
        fo.result()
        fv.result()
    got = watch.wait_event("use_after_free", "other_got_pages")
    assert len(freed["pages"]) == 2 and got["pages"] == freed["pages"], (freed, got)
    found = watch.since(mark)
    assert sorted(f.kind for f in found) == ["foreign_read", "use_after_free"], describe(found)
    uaf, foreign = one(found, "use_after_free"), one(found, "foreign_read")
    for f in (uaf, foreign):
        assert f.severity == "critical" and f.engine.role == "unified"
        assert (f.reader.rid, f.reader.tenant) == (victim, "initech")
    # read while free: still the victim's own KV; then read after acme's request was given the pages
    assert sorted(uaf.pages) == sorted(freed["pages"]) and uaf.exposed == []
    assert sorted(foreign.pages) == sorted(got["pages"])
    assert parties(foreign) == [(other, "acme", sorted(got["pages"]))]
    assert uaf.first_seen_ns < foreign.first_seen_ns


@pytest.mark.sweep
def test_deepseek_v2_mla_pd_0_5_19_leak_is_caught(tmp_path, require_sglang):
    """Plain MLA (DeepSeek-V2, ``MLATokenToKVPool``: no indexer cache, so no coverage gap): the
    same incident on the leaking pair, caught with the latent digests (``make test-arch``)."""
    require_sglang(LEAKING)
    run = capture_incident(LEAKING, str(tmp_path), model="deepseek_v2")
    assert expected(LEAKING, run.scenario, run.findings, model="deepseek_v2") == (True, "")
    kinds = sorted({f.kind for f in run.findings})
    assert kinds == ["checksum_mismatch", "pool_smaller_than_context", "transfer_size_mismatch", "unwritten_read"]
    (read,) = [f for f in run.findings if f.kind == "unwritten_read"]
    assert read.reader.tenant == "initech" and {p.tenant for p in read.exposed} <= {"acme", "globex"} and read.exposed
    for role in ("prefill", "decode"):
        assert run.coverage(role)["kv_pool"] == "watched" and "MLATokenToKVPool" in run.kv_pool(role)

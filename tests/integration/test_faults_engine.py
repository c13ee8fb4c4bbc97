"""Faults injected into a real SGLang 0.5.23 engine on CPU, and what kvguard reports.

A test-only SGLang plugin (tests/faults/kvguard_faults, discovered through its
``sglang.srt.plugins`` entry point when tests/faults is on the engine's PYTHONPATH)
injects each fault into the running engine; the kvguard plugin and an in-process
sidecar watch as they would in production. Each test asserts the exact findings:
the kind, the reader, the pages and the exposed parties, and that nothing else was
reported. docs/fault-injection.md explains each fault and each expected finding.

Two engine set-ups, each started once (about 3 minutes in all on 2 cores):
  * one unified engine for faults 1-4 (the scenarios run one after the other and
    each leaves the engine consistent, except use_after_free, which runs last);
  * one prefill/decode pair (Mooncake over TCP) for fault 5.
Every pool is at least the context length, so ``pool_smaller_than_context`` never
fires. Faults that kvguard cannot see yet end in ``pytest.xfail`` with the reason
(after the test has checked that the fault really was injected).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvguard.demo.engines import PDPair
from kvguard.sidecar.detectors.probing import PrefixProbingDetector
from kvguard.sidecar.findings import Finding
from tests.support.engine_watch import Watch, describe, generate, prompt, watched_sglang
from tests.support.fault_plugin import FAULTS_DIR, make_rid

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

VERSION = "0.5.23"
PAGE = 4
CONTEXT = 256  # every pool below is >= this
UNIFIED_POOL = 1024
PREFILL_POOL, DECODE_POOL = 512, 256
WAIT_S = 60.0


def one(findings: list[Finding], kind: str) -> Finding:
    got = [f for f in findings if f.kind == kind]
    assert len(got) == 1, (kind, describe(findings))
    return got[0]


def parties(f: Finding) -> list[tuple[str, str, list[int]]]:
    return sorted((p.rid, p.tenant, sorted(p.pages)) for p in f.exposed)


def fault_env(events_dir: Path, faults: str) -> dict[str, str]:
    return {
        "KVGUARD_FAULT": faults,
        "KVGUARD_FAULT_DIR": str(events_dir),
        "KVGUARD_ROW_SAMPLE_EVERY": "1",
    }  # the row-corruption fault lives for one step


# --------------------------------------------------------------------------- unified engine: faults 1-4
@pytest.fixture(scope="class")
def unified(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    work = tmp_path_factory.mktemp("faults-unified")
    env = {
        **fault_env(
            work / "events",
            "use_after_free,double_free,row_corruption,late_write_forward,late_write_pool,salt_dropped,"
            "prefix_wrong_page",
        ),
        # use_after_free leaves the radix tree and the free list sharing two pages, which SGLang's
        # idle check (strict by default) turns into a scheduler exception; the other faults leave
        # the engine consistent.
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",
        # KV at rest: every slot a forward reads is checked (engine_hooks/content.py); the
        # other scenarios run with it on too, so it is checked quiet on each of them. Through
        # the device path (engine_hooks/content_device.py: what a GPU pool runs, here on host
        # tensors); the soak's unified engine runs the host path.
        "KVGUARD_CONTENT_CHECK": "all",
        "KVGUARD_CONTENT_PATH": "device",
        # every full page's content identity (engine_hooks/page_identity.py): each prefix hit of
        # every scenario is judged, so each is checked quiet on them too
        "KVGUARD_PAGE_IDENTITY": "1",
    }
    # (on exit: nothing reported after the last scenario's check, nothing lost: watched_sglang)
    with watched_sglang(
        work,
        VERSION,
        "unified engine",
        max_total_tokens=UNIFIED_POOL,
        context_length=CONTEXT,
        # one batch at a time (run_batch -> process_batch_result), so each fault lands between two known steps
        extra_args=["--disable-overlap-schedule", "--max-running-requests", "8"],
        extra_env=env,
        extra_pythonpath=[FAULTS_DIR],
    ) as served:
        yield served


@pytest.mark.usefixtures("unified")
class TestUnifiedEngine:
    """Faults 1-4 on one unified engine; each test asserts every finding its scenario caused."""

    def test_engine_start_reports_nothing(self, unified):
        engine, watch = unified
        assert watch.since(0) == [], describe(watch.memory.findings)
        hello = watch.sidecar.pipeline.records_by_kind.get("HELLO", 0)
        assert hello == 1
        assert watch.events("plugin", "armed"), "the fault plugin was not loaded by the engine"

    def test_double_free(self, unified):
        """The engine releases a finished request; the plugin frees its released pages again."""
        engine, watch = unified
        rng = random.Random(2)
        mark = watch.mark()
        rid = make_rid("double_free", "d", "1")
        generate(engine.url, rid, prompt(rng, 10), 4, "acme")  # 13 KV tokens: the partial last page is freed
        ev = watch.wait_event("double_free", "double_freed")
        found = watch.since(mark)
        assert [f.kind for f in found] == ["double_free"], describe(found)
        f = found[0]
        assert f.severity == "critical" and f.reader is None and f.engine.role == "unified"
        assert sorted(f.pages) == sorted(ev["pages"])
        assert f.evidence["free_kind"] == "free"
        # the freed pages still hold the request's KV: it is who a second owner would see
        assert parties(f) == [(rid, "acme", sorted(ev["pages"]))]

    def test_row_corruption(self, unified):
        """A req_to_token entry of a running request points at another running request's page."""
        engine, watch = unified
        rng = random.Random(3)
        mark = watch.mark()
        reader, owner = make_rid("row_corruption", "reader", "1"), make_rid("row_corruption", "owner", "1")
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(generate, engine.url, reader, prompt(rng, 16), 16, "initech"),
                pool.submit(generate, engine.url, owner, prompt(rng, 16), 16, "globex"),
            ]
            [x.result() for x in futures]
        ev = watch.wait_event("row_corruption", "row_corrupted")
        watch.wait_event("row_corruption", "row_restored")
        found = watch.since(mark)
        f = one(found, "foreign_read")
        assert [x.kind for x in found] == ["foreign_read"], describe(found)
        assert f.severity == "critical"
        assert (f.reader.rid, f.reader.tenant) == (reader, "initech")
        assert f.pages == [ev["owner_page"]]
        assert parties(f) == [(owner, "globex", [ev["owner_page"]])]

    def _stale_page_setup(self, engine, watch, fault: str, rng: random.Random, y_tokens: int):
        """x finishes and its last (partial) page goes back to the free list (a stack); y,
        the next request, is handed that page first. Returns (x, y, pool, y's future, event)."""
        x, y = make_rid(fault, "x", "1"), make_rid(fault, "y", "1")
        generate(engine.url, x, prompt(rng, 10), 4, "acme")
        released = watch.wait_event(fault, "x_released")
        assert released["stale"], released
        pool = ThreadPoolExecutor(2)
        fy = pool.submit(generate, engine.url, y, prompt(rng, 20), y_tokens, "globex")
        t_end = time.monotonic() + WAIT_S
        while time.monotonic() < t_end and not (
            watch.events(fault, "victim_got_stale_page") or watch.events(fault, "victim_missed")
        ):
            time.sleep(0.02)
        assert not watch.events(fault, "victim_missed"), watch.events(fault)
        victim = watch.wait_event(fault, "victim_got_stale_page")
        assert victim["victim"] == y and victim["page"] in released["stale"]
        return x, y, pool, fy, victim

    def test_late_write_through_a_forward(self, unified):
        """A decode forward's KV write lands in a page that now belongs to another live
        request (a stale slot of a finished request, reassigned)."""
        engine, watch = unified
        rng = random.Random(4)
        mark = watch.mark()
        fault = "late_write_forward"
        x, y, pool, fy, victim = self._stale_page_setup(engine, watch, fault, rng, 24)  # y is kept alive for z
        z = make_rid(fault, "z", "1")
        fz = pool.submit(generate, engine.url, z, prompt(rng, 18), 8, "initech")  # 18 % 4 != 0: see the plugin
        fz.result()
        fy.result()
        pool.shutdown()
        ev = watch.wait_event(fault, "injected")
        assert ev["writer"] == z and ev["victim"] == y and ev["page"] == victim["page"]
        found = watch.since(mark)
        assert [f.kind for f in found] == ["late_write"], describe(found)
        f = found[0]
        assert f.severity == "critical" and f.evidence == {"access": "write"}
        assert (f.reader.rid, f.reader.tenant) == (z, "initech")
        assert f.pages == [victim["page"]]
        assert parties(f) == [(y, "globex", [victim["page"]])]

    def test_late_write_straight_into_the_kv_pool(self, unified):
        """The same stale slots written through the KV pool (set_kv_buffer), outside any
        forward: how a late RDMA write from a remote sender lands. No record names the write;
        the engine's content check finds y's slots changed before y's next forward reads them."""
        engine, watch = unified
        rng = random.Random(5)
        mark = watch.mark()
        fault = "late_write_pool"
        x, y, pool, fy, victim = self._stale_page_setup(engine, watch, fault, rng, 8)
        fy.result()
        pool.shutdown()
        ev = watch.wait_event(fault, "injected")
        assert ev["victim"] == y and ev["page"] == victim["page"] and ev["method"] == "set_kv_buffer"
        found = watch.since(mark)
        assert [f.kind for f in found] == ["checksum_mismatch"], describe(found)
        f = found[0]
        assert (f.severity, f.reader.rid, f.reader.tenant, f.pages) == ("critical", y, "globex", [victim["page"]])
        assert f.evidence["via"] == "content" and f.evidence["slots_changed"] >= 1
        assert f.exposed == []  # who wrote it is unknown: no hooked path did
        # found by the device path (the fixture's KVGUARD_CONTENT_PATH), as a GPU pool would be
        assert "results read a step later" in engine.log_path.read_text(errors="replace")

    def test_a_dropped_cache_salt_hands_another_scopes_prefix(self, unified):
        """Salts keep otherwise-identical prefixes apart in SGLang's radix cache: requests with
        the same salt share, different salts do not (both quiet). The fault drops one request's
        salt from its cache lookup: it is handed the unsalted victim's cached prefix."""
        engine, watch = unified
        rng = random.Random(11)
        shared_prompt = prompt(rng, 24)
        mark = watch.mark()
        victim = make_rid("salt_dropped", "v", "1")
        generate(engine.url, victim, shared_prompt, 2, "acme")  # no salt: the default scope
        out = [
            generate(engine.url, f"kvg-salted-{i}", shared_prompt, 2, "globex", cache_salt="globex-1") for i in (1, 2)
        ]
        # the second globex request hit the first's prefix (same salt), neither hit acme's
        assert out[0]["meta_info"]["cached_tokens"] == 0, out[0]["meta_info"]
        assert out[1]["meta_info"]["cached_tokens"] >= PAGE, out[1]["meta_info"]
        assert watch.since(mark) == [], describe(watch.since(mark))
        rid = make_rid("salt_dropped", "f", "1")
        hit = generate(engine.url, rid, shared_prompt, 2, "initech", cache_salt="initech-1")
        watch.wait_event("salt_dropped", "dropped")
        assert hit["meta_info"]["cached_tokens"] >= PAGE, hit["meta_info"]  # it was handed a cached prefix
        found = watch.since(mark)
        assert [f.kind for f in found] == ["cross_salt_prefix_share"], describe(found)
        f = found[0]
        assert (f.severity, f.reader.rid, f.reader.tenant) == ("critical", rid, "initech")
        assert [(p.rid, p.tenant) for p in f.exposed] == [(victim, "acme")]
        assert len(f.pages) == hit["meta_info"]["cached_tokens"] // PAGE
        assert f.evidence["writer_scopes"] == ["0000000000000000"]

    def test_a_prefix_hit_handed_a_page_of_another_prefix(self, unified):
        """Content identity (KVGUARD_PAGE_IDENTITY). The clean twin first: a request whose prompt
        extends a cached one is handed that prefix, the identities match, nothing is reported.
        Then the fault: the faulty request is handed the same cached prefix except its row page
        1, which is the victim's cached page at that position (another prompt's KV). Ownership
        sees a shared page read as it should be; the identity names the page and its writer."""
        engine, watch = unified
        rng = random.Random(53)  # (its prompts are new to the cache)
        base = prompt(rng, 24)
        mark = watch.mark()
        victim = make_rid("prefix_wrong_page", "v", "1")
        generate(engine.url, victim, prompt(rng, 24), 2, "acme")
        generate(engine.url, "kvg-pwp-primer", base, 2, "globex")
        watch.settle()
        with watch.sidecar.lock:
            before = watch.sidecar.pipeline.stats().page_identity
        twin = generate(engine.url, "kvg-pwp-twin", base + prompt(rng, 4), 2, "globex")
        assert twin["meta_info"]["cached_tokens"] >= 2 * PAGE, twin["meta_info"]  # an ordinary prefix hit
        assert watch.since(mark) == [], describe(watch.since(mark))
        with watch.sidecar.lock:
            after = watch.sidecar.pipeline.stats().page_identity
        assert after["matched"] - before["matched"] >= 2 and after["mismatched"] == before["mismatched"]
        rid = make_rid("prefix_wrong_page", "f", "1")
        hit = generate(engine.url, rid, base + prompt(rng, 4), 2, "initech")
        ev = watch.wait_event("prefix_wrong_page", "injected")
        assert ev["rid"] == rid and ev["victim"] == victim and ev["page"] != ev["replaced"]
        assert hit["meta_info"]["cached_tokens"] >= 2 * PAGE, hit["meta_info"]
        found = watch.since(mark)
        assert [f.kind for f in found] == ["prefix_content_mismatch"], describe(found)
        f = found[0]
        assert (f.severity, f.reader.rid, f.reader.tenant, f.pages) == ("critical", rid, "initech", [ev["page"]])
        assert parties(f) == [(victim, "acme", [ev["page"]])]  # whose KV it attended over
        assert f.evidence["via"] == "prefix_hit" and f.evidence["row_pages"] == [ev["row_page"]]
        assert victim in f.summary and rid in f.summary

    def test_a_tenant_walking_anothers_cached_prompt_is_prefix_probing(self, unified):
        """prefix_probing on the real engine's radix cache: acme's prompt is cached; eve sends
        acme's first L tokens plus a wrong guess, L growing (the PromptPeek walk). With the
        detector on, one finding names eve's probes and acme's request as the victim."""
        engine, watch = unified
        detector = watch.sidecar.pipeline.detectors.get(PrefixProbingDetector)
        rng = random.Random(37)  # (a seed no other scenario of this engine uses: its prompt must be new to the cache)
        mark = watch.mark()
        victim = prompt(rng, 64)
        generate(engine.url, "probe-victim-acme", victim, 1, "acme")
        with watch.sidecar.lock:
            detector.enabled = True  # (as --isolate-tenants; the fixture's other scenarios run without it)
        try:
            for i, length in enumerate([16, 16, 20, 20, 24, 24, 28, 28, 32, 32]):
                guess = 3 + (victim[length] - 3 + 1 + i % 5) % 253  # never acme's next token
                generate(engine.url, f"probe-eve-{i}", victim[:length] + [guess], 1, "eve")
            found = watch.since(mark)
        finally:
            with watch.sidecar.lock:
                detector.enabled = False
        assert [f.kind for f in found] == ["prefix_probing"], describe(found)
        f = found[0]
        assert (f.severity, f.reader.tenant) == ("warning", "eve") and f.reader.rid.startswith("probe-eve-")
        assert [(p.rid, p.tenant) for p in f.exposed] == [("probe-victim-acme", "acme")]
        assert f.evidence["probes"] >= 8 and len(f.evidence["hit_lengths_tokens"]) >= 3, f.evidence
        report = {
            (r["reader_tenant"], r["writer_tenant"]): r["prefix_hits"] for r in detector.report(time.monotonic_ns())
        }
        assert report.get(("eve", "acme"), 0) >= 10, report

    def test_use_after_free(self, unified):
        """Two pages of a decoding request are freed early, read while free, then handed
        to another request and read again. Runs last: it breaks the engine's accounting."""
        engine, watch = unified
        rng = random.Random(6)
        mark = watch.mark()
        victim, other = make_rid("use_after_free", "victim", "1"), make_rid("use_after_free", "other", "1")
        with ThreadPoolExecutor(2) as pool:
            fv = pool.submit(generate, engine.url, victim, prompt(rng, 21), 40, "initech")
            freed = watch.wait_event("use_after_free", "freed")
            watch.wait_event("use_after_free", "victim_read_freed")
            fo = pool.submit(generate, engine.url, other, prompt(rng, 120), 4, "acme")
            fo.result()
            fv.result()
        got = watch.wait_event("use_after_free", "other_got_pages")
        assert len(freed["pages"]) == 2 and got["pages"] == freed["pages"], (freed, got)
        found = watch.since(mark)
        assert sorted(f.kind for f in found) == ["foreign_read", "use_after_free"], describe(found)
        uaf, foreign = one(found, "use_after_free"), one(found, "foreign_read")
        for f in (uaf, foreign):
            assert f.severity == "critical"
            assert (f.reader.rid, f.reader.tenant) == (victim, "initech")
        # read while free: the data there is the victim's own (nobody else exposed yet)
        assert sorted(uaf.pages) == sorted(freed["pages"]) and uaf.exposed == []
        assert uaf.evidence.get("access") != "write"
        # read after the pages went to `other`: the victim attends over other's KV
        assert sorted(foreign.pages) == sorted(got["pages"])
        assert parties(foreign) == [(other, "acme", sorted(got["pages"]))]
        assert uaf.first_seen_ns < foreign.first_seen_ns


# --------------------------------------------------------------------------- PD pair: fault 5
@pytest.fixture(scope="class")
def pd(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda) not installed")
    work = tmp_path_factory.mktemp("faults-pd")
    ring_dir, events_dir = work / "rings", work / "events"
    ring_dir.mkdir()
    events_dir.mkdir()
    watch = Watch(ring_dir, events_dir)
    t0 = time.monotonic()
    pair = PDPair(
        VERSION,
        ring_dir,
        work / "logs",
        prefill_pool_tokens=PREFILL_POOL,
        decode_pool_tokens=DECODE_POOL,
        context_length=CONTEXT,
        extra_env=fault_env(
            events_dir,
            "send_truncated,sender_truncated,send_foreign_page,send_source_released,completion_after_release",
        ),
        extra_pythonpath=[FAULTS_DIR],
        # direct: the faults fire by rid and the checks name the room the client chose
        router=False,
    )
    try:
        pair.start()
    except BaseException:
        watch.stop()
        raise
    print(f"\nprefill/decode pair ready in {time.monotonic() - t0:.1f} s")
    watch.settle()
    try:
        yield pair, watch
        assert pair.prefill.is_running() and pair.decode.is_running()
        watch.assert_clean_end()
    finally:
        pair.stop()
        watch.stop()


def _earlier_requests(pair: PDPair, rng: random.Random, tag: str, n: int = 2) -> dict[str, str]:
    """Normal requests that fill decode's small pool with their KV (pages are not zeroed).

    Decode's pool is 64 pages and each of these takes 52: the allocator hands out the
    never-used pages first, then merges the released ones back (sorted), so the next
    50-page reservation is made of pages these requests wrote last."""
    out = {}
    for i in range(n):
        tenant = ("acme", "globex")[i % 2]
        r = pair.generate(prompt(rng, 200), tenant=tenant, max_new_tokens=8, rid=f"kvg-earlier-{tag}-{i}")
        assert r.ok, r.summary()
        out[r.rid] = tenant
    return out


def send_foreign_page_scene(pair: PDPair, watch: Watch):
    """acme's victim request, then initech's request whose last sent page the fault swaps for
    the victim's first (``send_foreign_page``): (victim, victim's page, rid, reply, swap event).
    Nothing is reported before the faulty request."""
    rng = random.Random(9)
    mark = watch.mark()
    victim = pair.generate(
        prompt(rng, 40), tenant="acme", max_new_tokens=4, rid=make_rid("send_foreign_page", "v", "1")
    )
    assert victim.ok, victim.summary()
    victim_page = watch.wait_event("send_foreign_page", "victim")["page"]
    watch.settle()
    assert watch.since(mark) == [], describe(watch.since(mark))
    rid = make_rid("send_foreign_page", "f", "1")
    r = pair.generate(prompt(rng, 40), tenant="initech", max_new_tokens=4, rid=rid)
    assert r.ok and r.prompt_tokens == 40, r.summary()  # what a status-code check sees: success
    ev = watch.wait_event("send_foreign_page", "swapped")
    watch.wait_event("send_foreign_page", "restored")
    return victim, victim_page, rid, r, ev


def sent_while_another_prefills(pair: PDPair, rng: random.Random, f_rid: str, v_rid: str, watch: Watch, fault: bool):
    """f (initech) goes to the pair; while its transfer is in flight v (acme) is prefilled.
    With the fault, prefill released f's pages right after handing its last chunk to
    Mooncake, v got them, and Mooncake read them only after v computed its prompt there."""
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(pair.generate, prompt(rng, 40), tenant="initech", max_new_tokens=4, rid=f_rid)
        if fault:
            watch.wait_event("send_source_released", "released_early")
        victim = pair.generate(prompt(rng, 40), tenant="acme", max_new_tokens=4, rid=v_rid)
        r = pending.result(timeout=120)
    assert victim.ok and r.ok and r.prompt_tokens == 40, (victim.summary(), r.summary())
    return r, victim


def send_source_released_scene(pair: PDPair, watch: Watch, rng: random.Random):
    """``send_source_released``: f's source pages go to the victim v while f's transfer of
    them is in flight. (f's rid, f's reply, v's reply, the release event, the pages v got)."""
    fault = "send_source_released"
    rid, v_rid = make_rid(fault, "f", "1"), make_rid(fault, "v", "1")
    r, victim = sent_while_another_prefills(pair, rng, rid, v_rid, watch, fault=True)
    released = watch.wait_event(fault, "released_early")
    got = watch.wait_event(fault, "victim_written")["got"]
    assert got, "the victim was not handed the released pages"
    assert watch.wait_event(fault, "transfer_released")["victim_written"]
    return rid, r, victim, released, got


def completion_after_release_scene(pair: PDPair, watch: Watch, rng: random.Random):
    """``completion_after_release``: decode gives f's reservation up while prefill's transfer
    into it is in flight, the victim v is reserved the same pages, then f's transfer completes
    into them. (f's rid, v's rid, f's reply, the release event, the pages v got)."""
    fault = "completion_after_release"
    rid, v_rid = make_rid(fault, "f", "1"), make_rid(fault, "v", "1")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(pair.generate, prompt(rng, 40), tenant="initech", max_new_tokens=4, rid=rid)
        released = watch.wait_event(fault, "released_early")
        victim = pair.generate(prompt(rng, 40), tenant="acme", max_new_tokens=4, rid=v_rid)
        r = pending.result(timeout=120)
    assert victim.ok and not r.ok, (victim.summary(), r.summary())  # decode failed f: the client saw an error
    got = watch.wait_event(fault, "victim_reserved")["got"]
    assert got, "the victim was not reserved the released pages"
    assert watch.wait_event(fault, "transfer_released")["victim_written"]
    watch.wait_event(fault, "completion_reported")
    watch.settle()
    return rid, v_rid, r, released, got


def _in_flight_ended(watch: Watch) -> int:
    with watch.sidecar.lock:
        stats = watch.sidecar.pipeline.stats().ledger.in_flight
    return stats.completed + stats.unjudged


def _wait_sender_completions(watch: Watch, before: int, n: int = 1, timeout_s: float = 60.0) -> None:
    """Until the sidecar has applied ``n`` more senders' completions (XFER_DONE sender) than
    ``before``: prefill reports a completion at its next poll of the transfers in flight, which
    an idle scheduler (--sleep-on-idle) may take up to a second to reach, longer than the
    watch's quiet period."""
    deadline = time.monotonic() + timeout_s
    while _in_flight_ended(watch) < before + n:
        assert time.monotonic() < deadline, f"fewer than {n} sender completions within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.usefixtures("pd")
class TestPrefillDecodePair:
    def test_pair_start_reports_nothing(self, pd):
        pair, watch = pd
        assert watch.since(0) == [], describe(watch.memory.findings)
        assert watch.sidecar.pipeline.records_by_kind.get("HELLO", 0) == 2

    def test_prefill_sends_fewer_pages_than_decode_reserved(self, pd):
        """Prefill's scheduler sends only the first page (and says so: start_send_idx
        = 1 page); decode reserved 50 pages and generates over all of them."""
        pair, watch = pd
        rng = random.Random(7)
        earlier = _earlier_requests(pair, rng, "a")
        watch.settle()
        mark = watch.mark()
        rid = make_rid("send_truncated", "f", "1")
        r = pair.generate(prompt(rng, 200), tenant="initech", max_new_tokens=8, rid=rid)
        assert r.ok and r.prompt_tokens == 200, r.summary()  # what a status-code check sees: success
        ev = watch.wait_event("send_truncated", "truncated")
        assert ev["end_idx"] == PAGE and ev["room"] == r.room
        found = watch.since(mark)
        assert sorted(f.kind for f in found) == ["checksum_mismatch", "transfer_size_mismatch", "unwritten_read"], (
            describe(found)
        )
        size, read, digest = (one(found, k) for k in ("transfer_size_mismatch", "unwritten_read", "checksum_mismatch"))
        for f in (size, read, digest):
            assert f.engine.role == "decode" and f.severity == "critical"
            assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == (rid, "initech", r.room)
        # the two ends' digests cover what each saw: 4 tokens sent, 200 reserved
        assert digest.evidence["sender_tokens"] == [0, PAGE] and digest.evidence["receiver_tokens"] == [0, 200]
        assert size.evidence == {
            "direction": "fewer_sent",
            "sent_tokens": PAGE,
            "reserved_tokens": 200,
            "sent_pages": 1,
            "reserved_pages": 50,
        }
        # 49 reserved pages were never written for it; decode's own first write goes to a 51st page
        assert len(read.pages) == 49 and sorted(read.pages) == sorted(size.pages)
        assert read.exposed, "the stale pages must name whose KV they held"
        for party in read.exposed:
            assert earlier.get(party.rid) == party.tenant, (party, earlier)
        exposed_pages = sorted(p for party in read.exposed for p in party.pages)
        assert len(exposed_pages) == len(set(exposed_pages)) and set(exposed_pages) <= set(read.pages)

    def test_sender_drops_pages_below_the_scheduler(self, pd):
        """The same shortfall one layer down: the Mooncake sender transfers the first page
        only, while prefill's scheduler (and kvguard's send_kv_chunk hook) believe all 50
        pages went out."""
        pair, watch = pd
        rng = random.Random(8)
        mark = watch.mark()
        rid = make_rid("sender_truncated", "g", "1")
        r = pair.generate(prompt(rng, 200), tenant="initech", max_new_tokens=8, rid=rid)
        assert r.ok and r.prompt_tokens == 200, r.summary()
        ev = watch.wait_event("sender_truncated", "truncated")
        assert ev["pages_asked"] == 50 and ev["pages_sent"] == 1 and ev["room"] == r.room
        found = watch.since(mark)
        # XFER_SEND mirrors send_kv_chunk's range (200 of 200 tokens: no size mismatch, every
        # page counted written); the digests see it: prefill hashed the 200 tokens it meant to
        # send, decode the 200 reserved tokens, of which 196 still hold someone else's KV
        assert [f.kind for f in found] == ["checksum_mismatch"], describe(found)
        f = found[0]
        assert f.engine.role == "decode" and f.severity == "critical"
        assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == (rid, "initech", r.room)
        assert f.evidence["sender_tokens"] == f.evidence["receiver_tokens"] == [0, 200]
        assert f.evidence["sender_digest"] != f.evidence["receiver_digest"] and len(f.pages) == 50

    def test_prefill_sends_a_page_its_request_never_wrote(self, pd):
        """The sender ships a page its request never wrote: for the faulty request's last
        chunk, its row's last page names the victim's first page (the victim's KV goes to
        decode as the prompt's). Decode's reads and the digests look clean (the transfer
        wrote every reserved page, both ends hash what was shipped): only the send says it."""
        pair, watch = pd
        mark = watch.mark()
        victim, victim_page, rid, r, ev = send_foreign_page_scene(pair, watch)
        assert ev["victim_page"] == victim_page and ev["room"] == r.room
        found = watch.since(mark)
        assert [f.kind for f in found] == ["unwritten_send"], describe(found)
        f = found[0]
        assert (f.severity, f.engine.role, f.pages) == ("critical", "prefill", [victim_page])
        assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == (rid, "initech", r.room)
        assert f.evidence["receiver"] == {"rid": rid, "tenant": "initech"}  # decode's request (same rid, direct)
        assert (f.evidence["token_start"], f.evidence["token_end"]) == (0, 40)
        if victim_page != ev["own_page"]:  # the victim's page was not handed to the sender itself meanwhile
            assert victim.rid in [p.rid for p in f.exposed], describe(found)

    def test_prefill_reads_source_pages_after_they_changed_hands(self, pd):
        """The sender's side of a transfer in flight (TensorRT-LLM #12540 / #12542, SGLang
        #24527's family): the source pages are handed to another request before the transfer
        read them. At the send everything is the sender's own and written; only the pages'
        generations at the sender's completion show it. The clean twin (the same two requests,
        no fault: prefill keeps f's pages until its transfer completes) raises nothing."""
        pair, watch = pd
        rng = random.Random(10)
        mark = watch.mark()
        sent_while_another_prefills(pair, rng, "kvg-ssr-clean-f", "kvg-ssr-clean-v", watch, fault=False)
        watch.settle()
        assert watch.since(mark) == [], describe(watch.since(mark))

        mark, ended_before = watch.mark(), _in_flight_ended(watch)
        rid, r, victim, released, got = send_source_released_scene(pair, watch, rng)
        _wait_sender_completions(watch, ended_before, n=2)  # f's and v's
        found = watch.since(mark)
        # decode also sees it as the transfer's digests disagreeing: prefill hashed f's own KV
        # when it sent the chunk, decode hashed what landed (v's)
        assert sorted(f.kind for f in found) == ["checksum_mismatch", "use_after_free"], describe(found)
        uaf = one(found, "use_after_free")
        assert (uaf.severity, uaf.engine.role) == ("critical", "prefill")
        assert (uaf.reader.rid, uaf.reader.tenant, uaf.reader.bootstrap_room) == (rid, "initech", r.room)
        assert uaf.evidence["access"] == "send" and uaf.evidence["via"] == "transfer"
        assert uaf.evidence["receiver"] == {"rid": rid, "tenant": "initech"}  # decode's request (same rid, direct)
        assert set(got) <= set(uaf.pages) <= set(released["pages"])
        assert (victim.rid, "acme") in [(p.rid, p.tenant) for p in uaf.exposed], describe(found)
        digest = one(found, "checksum_mismatch")
        assert digest.engine.role == "decode" and digest.reader.rid == rid

    def test_a_completion_after_decode_gave_its_pages_away_is_a_late_write(self, pd):
        """The receiver's side of a transfer in flight (SGLang #24527's family: decode reusing
        pages before the prefill writer finished): decode gives f's reservation up while
        prefill's transfer into it is in flight and releases the pages at once (the deferred
        release of a failed transfer, SGLang's fix, reverted for that request), v is reserved
        the same pages, and then f's transfer completes into them."""
        pair, watch = pd
        rng = random.Random(11)
        mark, ended_before = watch.mark(), _in_flight_ended(watch)
        with watch.sidecar.lock:
            unjudged_before = watch.sidecar.pipeline.stats().ledger.in_flight.unjudged
        rid, v_rid, r, released, got = completion_after_release_scene(pair, watch, rng)
        _wait_sender_completions(watch, ended_before)
        found = watch.since(mark)
        with watch.sidecar.lock:
            in_flight = watch.sidecar.pipeline.stats().ledger.in_flight
        assert in_flight.unjudged == unjudged_before, (in_flight, "f's completion was a failure", describe(found))
        late = one(found, "late_write")
        # v's own transfer may land before or after f's: its digest sees f's KV only if f's came last
        assert {f.kind for f in found} <= {"late_write", "checksum_mismatch"}, describe(found)
        assert (late.severity, late.engine.role) == ("critical", "decode")
        assert (late.reader.rid, late.reader.tenant, late.reader.bootstrap_room) == (rid, "initech", r.room)
        assert late.evidence["access"] == "completion" and late.evidence["via"] == "transfer"
        assert set(got) <= set(late.pages) <= set(released["pages"])
        assert [(p.rid, p.tenant) for p in late.exposed] == [(v_rid, "acme")], describe(found)

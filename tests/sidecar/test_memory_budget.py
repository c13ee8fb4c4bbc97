"""The memory budget (issue 14 item 6): the ended-request directories are sized from
``--memory-budget`` and the estimate it applies is honest.

Before, every engine kept 100,000 ended requests whatever the node: ~50 MB per engine,
~400 MB on an 8-rank node against the manifests' 512Mi limit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tracemalloc
import uuid

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.sidecar import memory_budget as mb
from kvguard.sidecar.pipeline import Pipeline
from kvguard.sidecar.tracker import RequestDirectory, RequestInfo

MIB = 1 << 20


def ended_request(i: int) -> RequestInfo:
    # SGLang's rids are 32 hex characters; tenants come from a request field
    return RequestInfo(
        key=(i * 2654435761 + 1) & ((1 << 64) - 1),
        rid=uuid.uuid4().hex,
        tenant=f"tenant-{i % 50}",
        room=i * 7919,
        prompt_tokens=1000,
        begin_ns=10**15 + i,
        end_ns=10**15 + i,
        finish="stop",
        ttft_ns=123_456_789,
    )


def test_the_per_request_estimate_is_not_below_what_an_ended_request_costs():
    d = RequestDirectory(max_ended=10**9)
    n = 20_000
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(n):
            info = ended_request(i)
            d.begin(info)
            d.end(info.key)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_request = (after - before) / n
    print(f"{per_request:.0f} B per ended request (estimate {mb.ENDED_REQUEST_BYTES})")
    assert 0.5 * mb.ENDED_REQUEST_BYTES < per_request <= mb.ENDED_REQUEST_BYTES


def hello(pool_pages: int, rank: int) -> wire.Record:
    body = wire.Hello(
        wire.Role.DECODE,
        rank,
        1000 + rank,
        64,
        pool_pages,
        pool_pages * 64,
        131_072,
        131_072,
        "sglang",
        "0.5.23",
        "m",
        "0",
    )
    return wire.Record(wire.Kind.HELLO, 0, 1, 100 + rank, 0, body)


def test_eight_ranks_share_the_budget_and_the_directories_stay_within_it():
    budget = mb.MemoryBudget(384 * MIB, history_events=1 << 20)
    p = Pipeline([], history_events=1 << 20, memory_budget=budget)
    p.apply(hello(32_768, 0))
    alone = budget.ended_per_engine
    assert alone == mb.MAX_ENDED_PER_ENGINE  # one engine: the whole share, capped
    for rank in range(1, 8):
        p.apply(hello(32_768, rank))
    per_engine = budget.ended_per_engine
    assert mb.MIN_ENDED_PER_ENGINE < per_engine < alone
    for t in p.engines.values():  # every directory full
        for i in range(per_engine + 500):
            info = ended_request(i)
            t.requests.begin(info)
            t.requests.end(info.key)
        assert t.requests.num_ended == per_engine
    used = budget.usage(p.engines.values())
    assert sum(used.values()) <= budget.total_bytes, used
    assert used["ended_requests"] == 8 * per_engine * mb.ENDED_REQUEST_BYTES
    # an engine leaves: its share goes to the others
    p.on_engine_gone(100 + 7, 2)
    assert budget.ended_per_engine > per_engine


def test_a_smaller_budget_trims_what_is_kept_at_once():
    budget = mb.MemoryBudget(192 * MIB, history_events=1 << 16)
    p = Pipeline([], history_events=1 << 16, memory_budget=budget)
    p.apply(hello(1024, 0))
    t = next(iter(p.engines.values()))
    for i in range(mb.MAX_ENDED_PER_ENGINE):
        info = ended_request(i)
        t.requests.begin(info)
        t.requests.end(info.key)
    assert t.requests.num_ended == budget.ended_per_engine == mb.MAX_ENDED_PER_ENGINE
    for rank in range(1, 4):  # three more ranks: the first one's directory shrinks at the next HELLO
        p.apply(hello(1024, rank))
    assert t.requests.num_ended == budget.ended_per_engine < mb.MAX_ENDED_PER_ENGINE


def test_a_budget_below_the_fixed_parts_fails_at_start_naming_the_flag(tmp_path):
    with pytest.raises(mb.MemoryBudgetError, match="--memory-budget.*--history-events"):
        mb.MemoryBudget(64 * MIB, history_events=1 << 20)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard.sidecar.cli",
            "sidecar",
            "--ring-dir",
            str(tmp_path),
            "--memory-budget",
            "120Mi",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--memory-budget" in out.stderr and "--history-events" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard.sidecar.cli",
            "sidecar",
            "--ring-dir",
            str(tmp_path),
            "--memory-budget",
            "lots",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--memory-budget" in out.stderr and "lots" in out.stderr


def test_the_budget_is_exported_beside_the_real_rss(tmp_path):
    from fastapi.testclient import TestClient

    from kvguard.sidecar.api import create_app
    from kvguard.sidecar.service import Sidecar

    sidecar = Sidecar(str(tmp_path), memory_budget=256 * MIB)
    sidecar.pipeline.apply(hello(4096, 0))
    text = TestClient(create_app(sidecar)).get("/metrics").text
    assert "kvguard_memory_budget_bytes 2.68435456e+08" in text
    assert 'kvguard_memory_bytes{part="page_models"} 262144.0' in text
    assert "process_resident_memory_bytes" in text
    (capacity,) = re.findall(r"^kvguard_ended_requests_capacity (\S+)$", text, re.M)
    assert float(capacity) == mb.MAX_ENDED_PER_ENGINE


def test_a_pool_beyond_the_budget_is_capped_not_allocated():
    """A HELLO announcing 4M pages (a hostile ring, or a node bigger than the budget) used to
    allocate its page model whatever the budget (~90 MB each); now the model stops where the
    budget does, and pages past it are counted out of range."""
    budget = mb.MemoryBudget(256 * MIB, history_events=1 << 16)
    p = Pipeline([], history_events=1 << 16, memory_budget=budget)
    p.apply(hello(4 << 20, 0))
    (t,) = p.engines.values()
    allowed = t.pool.limit
    assert allowed < 4 << 20 and t.pool.num_pages <= allowed
    used = budget.usage(p.engines.values())
    assert sum(used.values()) <= budget.total_bytes, used
    p.apply(wire.Record(wire.Kind.ALLOC, 1, 2, 100, 0, wire.Pages(np.array([allowed + 5], np.int64))))
    assert t.pool.pages_out_of_range == 1 and t.pool.num_pages <= allowed

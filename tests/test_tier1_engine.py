"""Tier 1 inside a real SGLang 0.5.23 engine on CPU, with no sidecar at all.

The engine runs with ``KVGUARD_TIER1=1``, a small chunked-prefill size and the
radix cache on; nothing reads its ring while it serves. First a healthy mix
(shared prefixes, a prompt prefilled in several chunks, concurrent requests) must
give no Tier-1 violation; then the test-only fault plugin (tests/faults/kvguard_faults,
fault ``row_corruption``) points one req_to_token entry of a running request at
another running request's page, and the engine itself must say so: its log line
names the reader, the page and the page's owner, and a TIER1_VIOLATION record with
the same facts is in the ring for a sidecar that attaches later.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fault_plugin import FAULTS_DIR, make_rid

from kvguard.demo.engines import start_engine
from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import RingReader

pytestmark = [pytest.mark.engine, pytest.mark.timeout(240)]

VERSION = "0.5.23"
PAGE = 4
WAIT_S = 60.0
VIOLATION = "kvguard tier1 VIOLATION"


def generate(url: str, rid: str, input_ids: list[int], max_new_tokens: int) -> None:
    body = {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    r = httpx.post(url + "/generate", json=body, timeout=120.0)
    assert r.status_code == 200, (rid, r.status_code, r.text[:500])
    assert r.json()["meta_info"]["completion_tokens"] == max_new_tokens


def events(folder: Path, fault: str, event: str) -> list[dict]:
    try:
        lines = (folder / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = [json.loads(x) for x in lines if x.strip()]
    return [e for e in out if e["fault"] == fault and e["event"] == event]


def wait_for(fn, what: str, timeout_s: float = WAIT_S):
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    work = tmp_path_factory.mktemp("tier1-engine")
    ring_dir, events_dir = work / "rings", work / "events"
    ring_dir.mkdir()
    events_dir.mkdir()
    t0 = time.monotonic()
    eng = start_engine(
        VERSION,
        work / "logs",
        max_total_tokens=1024,
        context_length=256,
        ring_dir=ring_dir,
        # one batch at a time, so the corrupted row is read by exactly the next forward
        extra_args=["--disable-overlap-schedule", "--max-running-requests", "8", "--chunked-prefill-size", "16"],
        extra_env={"KVGUARD_TIER1": "1", "KVGUARD_FAULT": "row_corruption", "KVGUARD_FAULT_DIR": str(events_dir)},
        extra_pythonpath=[FAULTS_DIR],
    )
    print(f"\nengine ready in {time.monotonic() - t0:.1f} s")
    try:
        yield eng, ring_dir, events_dir
        assert eng.is_running(), eng.log_tail()
    finally:
        eng.stop()


def log_lines(eng, needle: str) -> list[str]:
    return [x for x in eng.log_path.read_text(errors="replace").splitlines() if needle in x]


def test_healthy_traffic_gives_no_violation(engine):
    eng, _, _ = engine
    rng = random.Random(7)
    prefix = [rng.randint(3, 255) for _ in range(24)]
    generate(eng.url, "warm-prefix", prefix + [9, 9, 9, 9], 4)  # the radix cache now holds the prefix
    jobs = [("shared-%d" % i, prefix + [rng.randint(3, 255) for _ in range(8 + i)], 12) for i in range(3)]
    jobs.append(("chunked", [rng.randint(3, 255) for _ in range(60)], 8))  # four 16-token prefill chunks
    jobs += [("plain-%d" % i, [rng.randint(3, 255) for _ in range(5 + 7 * i)], 10 + i) for i in range(3)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        [f.result() for f in [pool.submit(generate, eng.url, *j) for j in jobs]]
    assert log_lines(eng, "kvguard tier1 read check on"), "Tier 1 was not switched on in the engine"
    assert wait_for(lambda: log_lines(eng, "kvguard tier1: first check"), "first Tier-1 check", 10)
    assert log_lines(eng, VIOLATION) == []
    assert log_lines(eng, "kvguard tier1 check failed") == []


def test_a_foreign_row_entry_is_caught_by_the_engine_itself(engine):
    eng, ring_dir, events_dir = engine
    rng = random.Random(3)
    reader, owner = make_rid("row_corruption", "reader", "1"), make_rid("row_corruption", "owner", "1")
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(generate, eng.url, reader, [rng.randint(3, 255) for _ in range(16)], 16),
            pool.submit(generate, eng.url, owner, [rng.randint(3, 255) for _ in range(16)], 16),
        ]
        [f.result() for f in futures]
    (ev,) = wait_for(lambda: events(events_dir, "row_corruption", "row_corrupted"), "row_corrupted event")
    wait_for(lambda: events(events_dir, "row_corruption", "row_restored"), "row_restored event")
    (line,) = wait_for(lambda: log_lines(eng, VIOLATION), "Tier-1 violation in the engine log", 10)
    print(line)
    page = ev["owner_page"]
    assert f"request {reader} read page {page} (row page 1, request {owner})" in line
    # the same facts in the ring, for a sidecar that attaches later
    recs = []
    for path in ring_dir.glob("*.ring"):
        recs += [
            r.body
            for r in RingReader(str(path)).poll(max_bytes=64 << 20).records
            if r.kind == wire.Kind.TIER1_VIOLATION
        ]
    (v,) = recs
    assert v.reader_key == wire.request_key(reader) and v.pages.tolist() == [page]
    assert v.owner_keys.tolist() == [wire.request_key(owner)] and v.row_indices.tolist() == [1]
    assert v.tags.tolist() == [wire.Tier1Tag.OTHER_REQUEST]

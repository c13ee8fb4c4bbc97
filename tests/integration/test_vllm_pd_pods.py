"""The vLLM prefill/decode pair as it is deployed: prefill and decode in two pods, each
engine's rings in its own directory, one sidecar per pod, the two sidecars sharing only a
real redis-server (the transfer ledger's shared mode: docs/detectors.md). Requests go as
vLLM's Mooncake proxy sends them (tests/integration/test_vllm_pd.py), so the two pods' facts meet in
Redis by the room of the transfer id alone.

Decode's sidecar judges every transfer (the pages are decode's); prefill's only publishes.
Checked: clean transfers all paired through Redis with both digests compared and nothing
reported by either sidecar; a pull that leaves a reserved block unfilled is reported by
decode's sidecar, naming prefill's request as the sender.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.integration.test_vllm_engine import Watch, _text
from tests.integration.test_vllm_pd import _events, pair_dirs, running_pair, short_pull_after_acme
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CLUSTER = "vllm-pd-test"


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    base, events = pair_dirs(tmp_path_factory, "vllm-pd-pods")
    redis = RedisServer(base).start()
    dirs = {
        role: Path(tempfile.mkdtemp(prefix=f"kvg-vllm-{role}-", dir="/dev/shm"))
        for role in ("kv_producer", "kv_consumer")
    }
    prefill_sink = MemorySink()
    prefill_sidecar = Sidecar(
        str(dirs["kv_producer"]),
        sinks=[prefill_sink],
        remove_dead_rings=False,
        ledger=redis.url,
        ledger_cluster=CLUSTER,
    ).start()
    decode_watch = Watch(dirs["kv_consumer"], events, ledger=redis.url, ledger_cluster=CLUSTER)
    try:
        with running_pair(base, dirs, events, decode_watch) as pair:
            yield pair, prefill_sink
    finally:
        decode_watch.sidecar.stop()
        prefill_sidecar.stop()
        redis.kill()
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


def _paired(watch: Watch) -> dict:
    counts: dict = {}
    for per_engine in watch.stats().ledger.transfers_by_engine.values():
        for outcome, n in per_engine.items():
            counts[outcome] = counts.get(outcome, 0) + n
    return counts


def _until(check, timeout_s: float = 45.0):
    """Decode's sidecar pairs through Redis on its own cycle: wait for it."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return check()


def test_clean_transfers_pair_through_redis_and_neither_pod_reports_anything(pods):
    pair, prefill_sink = pods
    watch = pair.watch
    rng = random.Random(41)
    system = _text(rng, 100)
    prompts = [(t, system + _text(rng, rng.randint(10, 80))) for t in ("acme", "globex") for _ in range(3)]
    prompts += [(t, _text(rng, rng.randint(40, 200))) for t in ("acme", "initech")]
    before = _paired(watch).get("paired", 0)
    compared_before = watch.stats().ledger.digests_compared
    mark = watch.mark()
    for tenant, prompt in prompts:
        pair.complete(prompt, 8, tenant)
    assert _until(lambda: _paired(watch).get("paired", 0) - before >= len(prompts)), _paired(watch)
    found = watch.since(mark)
    assert found == [], watch.explain(found)
    assert prefill_sink.findings == []  # the sender's sidecar publishes; it never judges
    counts = _paired(watch)
    assert counts["paired"] - before == len(prompts) and counts["unpaired"] == counts["unverified"] == 0, counts
    assert watch.stats().ledger.digests_compared - compared_before == len(prompts)


def test_a_reserved_block_left_unfilled_is_reported_by_decodes_sidecar(pods):
    pair, prefill_sink = pods
    watch = pair.watch
    mark = short_pull_after_acme(pair, random.Random(42))
    wanted = {"transfer_size_mismatch", "unwritten_read"}
    assert _until(lambda: wanted <= {f.kind for f in watch.memory.findings[mark:]}), (
        _paired(watch),
        [f.to_dict() for f in watch.memory.findings[mark:]],
    )
    found = watch.since(mark)
    (event,) = [
        e for e in _events(pair) if e["fault"] == "pd_short_pull" and e["request"] in {f.reader.rid for f in found}
    ]
    assert {f.kind for f in found} == wanted, watch.explain(found)
    (size,) = [f for f in found if f.kind == "transfer_size_mismatch"]
    assert size.evidence["direction"] == "fewer_sent" and size.pages == [event["unfilled"]]
    assert size.evidence["sender_tenant"] == "globex"  # prefill's request, named from the other pod's facts
    assert prefill_sink.findings == []

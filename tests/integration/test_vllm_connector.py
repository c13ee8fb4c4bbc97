"""kvguard on a real vLLM engine with a KV connector: vLLM's reference ``ExampleConnector``
(shared storage on disk, ``kv_role: kv_both``) stores each new prompt's KV and loads it into
a later request's blocks. kvguard reports each store and load (KV_STORE, KV_LOAD through
engine_hooks/vllm/hooks_connector.py), credits the loaded blocks as written by the load,
and judges each load against what was stored.

One engine for the module: chunked prefill of 128 tokens a step, the clean prompts shorter
than one chunk, the local prefix cache reset between requests (``/reset_prefix_cache``, dev
mode) so that a repeated prompt is loaded from the connector rather than found in the
engine's own cache.

The reference connector keys stored KV by the prompt's tokens alone, without the request's
``cache_salt``: a request of another salt is served KV stored for the first one (the salt
dropped on the way to an external cache of issue 16/17, SGLang #37160, LMCache #4825), in
an unmodified vLLM: kvguard reports it as ``cross_salt_prefix_share`` via the load.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvguard.demo.vllm_engine import complete, complete_and_hang_up
from tests.integration.test_vllm_engine import _missing, _text, watched_vllm

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

CHUNK = 128  # tokens prefilled per step


@pytest.fixture(scope="module")
def vllm_connector(tmp_path_factory):
    if _missing:
        pytest.skip(_missing)
    base = tmp_path_factory.mktemp("vllm-connector")
    store = base / "kv-store"
    store.mkdir()
    config = {
        "kv_connector": "ExampleConnector",  # (its name in 0.30-0.32)
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    with watched_vllm(
        base,
        "kvg-vllm-conn-rings-",
        num_blocks=64,
        max_num_seqs=4,
        extra_args=["--max-num-batched-tokens", str(CHUNK), "--kv-transfer-config", json.dumps(config)],
        # the page content identity on: a load carries the stored object's (sidecar/offload.py)
        extra_env={"VLLM_SERVER_DEV_MODE": "1", "KVGUARD_PAGE_IDENTITY": "1"},
    ) as (engine, watch):
        yield engine, watch, store


def _reset_local_cache(engine) -> None:
    r = httpx.post(engine.url + "/reset_prefix_cache", timeout=30.0)
    r.raise_for_status()


def test_loads_from_the_connector_are_checked_and_clean_ones_are_quiet(vllm_connector):
    engine, watch, store = vllm_connector
    rng = random.Random(21)
    mark = watch.mark()
    before_stats = watch.stats()
    before = dict(before_stats.records_by_kind)
    identity_before = dict(watch.sidecar.pipeline.stats().page_identity)
    prompts = {"acme": _text(rng, 110), "globex": _text(rng, 90)}  # (prefilled in one step each)
    first = {}
    for tenant, prompt in prompts.items():  # stored
        first[tenant] = complete(engine, prompt, 16, tenant=tenant, cache_salt=f"{tenant}-salt")["choices"][0]["text"]
        _reset_local_cache(engine)
    for tenant, prompt in prompts.items():  # loaded from the connector into new blocks: same salt
        again = complete(engine, prompt, 16, tenant=tenant, cache_salt=f"{tenant}-salt")["choices"][0]["text"]
        assert again == first[tenant]  # (greedy: the loaded KV is the KV the first request computed)
        _reset_local_cache(engine)
    found = watch.since(mark)
    stats = watch.stats()
    counts = {k: stats.records_by_kind.get(k, 0) - before.get(k, 0) for k in ("KV_STORE", "KV_LOAD", "KV_DIGEST")}
    assert found == [], watch.explain(found)
    # two stores; two loads, issued and completed; the Worker's digest of each store and load
    assert counts == {"KV_STORE": 2, "KV_LOAD": 4, "KV_DIGEST": 4}, counts
    assert stats.loads_unverified == 0  # each load met the store it loads
    assert stats.load_digests_compared - before_stats.load_digests_compared == 2  # ... and the bytes stored
    (engine_stats,) = [e for e in stats.engines if e.pages_read]
    assert engine_stats.pages_unverified == 0
    # the blocks each load filled took the identities its object's blocks had when stored, and
    # the loading request's own tokens gave the same: judged, matched
    identity = watch.sidecar.pipeline.stats().page_identity
    loaded, matched = (identity[k] - identity_before[k] for k in ("loaded", "matched"))
    assert loaded >= 5 and matched >= loaded and identity["mismatched"] == 0, (identity_before, identity)


def test_a_load_of_kv_stored_under_another_salt_is_reported(vllm_connector):
    """The reference connector ignores cache_salt: globex's request with acme's prompt is
    served acme's stored KV. kvguard: cross_salt_prefix_share via the load, globex the reader,
    acme's request exposed."""
    engine, watch, store = vllm_connector
    rng = random.Random(22)
    prompt = _text(rng, 100)
    complete(engine, prompt, 8, tenant="acme", cache_salt="acme-salt")
    _reset_local_cache(engine)
    mark = watch.mark()
    complete(engine, prompt, 8, tenant="globex", cache_salt="globex-salt")
    found = watch.since(mark)
    assert [f.kind for f in found] == ["cross_salt_prefix_share"], [f.to_dict() for f in found]
    f = found[0]
    assert f.severity == "critical" and f.reader.tenant == "globex", f.to_dict()
    assert f.evidence.get("via") == "load", f.evidence
    assert [p.tenant for p in f.exposed] == ["acme"], f.to_dict()
    _reset_local_cache(engine)


def test_kv_changed_at_rest_in_the_connectors_store_is_reported_when_loaded(vllm_connector):
    """A stored object's bytes change on disk (a corrupted or swapped file): the next load
    puts other KV than was stored into acme's blocks. kvguard: checksum_mismatch via the
    load, the stored and loaded digests in the evidence."""
    engine, watch, store = vllm_connector
    rng = random.Random(23)
    prompt = _text(rng, 120)
    before = {p.name for p in store.iterdir()}
    complete(engine, prompt, 8, tenant="acme", cache_salt="acme-salt")
    (folder,) = [p for p in store.iterdir() if p.name not in before]  # this prompt's object
    _reset_local_cache(engine)
    victim = sorted(folder.glob("*.safetensors"))[-1]
    raw = bytearray(victim.read_bytes())
    raw[-2] ^= 0x40  # one bf16 value of the last layer's KV, in the data after the header
    victim.write_bytes(bytes(raw))
    mark = watch.mark()
    complete(engine, prompt, 8, tenant="acme", cache_salt="acme-salt")
    found = watch.since(mark)
    assert [f.kind for f in found] == ["checksum_mismatch"], [f.to_dict() for f in found]
    f = found[0]
    assert f.evidence.get("via") == "load" and f.evidence["stored_digest"] != f.evidence["loaded_digest"], f.evidence
    assert f.reader is not None and f.reader.tenant == "acme", f.to_dict()
    _reset_local_cache(engine)


def test_a_store_serving_another_objects_kv_names_whose_it_is(vllm_connector):
    """The store answers acme's key with globex's object (LMCache #4385, Dynamo #15079: a tier
    serving wrong KV silently): globex's files, of a prompt the same length, are copied over
    acme's. The load's bytes are globex's: kvguard's checksum_mismatch via the load names
    globex's object (``loaded_object_key``) and exposes globex's request, whose KV acme's
    request was handed. The clean twin is the round trip of the first test."""
    engine, watch, store = vllm_connector
    rng = random.Random(24)
    prompts = {"acme": _text(rng, 100), "globex": _text(rng, 100)}  # the same length: the same shapes
    folders = {}
    for tenant, prompt in prompts.items():
        before = {p.name for p in store.iterdir()}
        complete(engine, prompt, 8, tenant=tenant, cache_salt=f"{tenant}-salt")
        (folders[tenant],) = [p for p in store.iterdir() if p.name not in before]
        _reset_local_cache(engine)
    files = sorted(p.name for p in folders["globex"].glob("*.safetensors"))
    assert files and files == sorted(p.name for p in folders["acme"].glob("*.safetensors"))
    for name in files:
        (folders["acme"] / name).write_bytes((folders["globex"] / name).read_bytes())
    mark = watch.mark()
    complete(engine, prompts["acme"], 8, tenant="acme", cache_salt="acme-salt")
    found = watch.since(mark)
    assert [f.kind for f in found] == ["checksum_mismatch"], [f.to_dict() for f in found]
    f = found[0]
    assert f.evidence.get("via") == "load" and f.reader is not None and f.reader.tenant == "acme", f.to_dict()
    assert f.evidence.get("loaded_object_key") not in (None, f.evidence["object_key"]), f.evidence
    assert [p.tenant for p in f.exposed] == ["globex"], f.to_dict()
    _reset_local_cache(engine)


def test_concurrent_traffic_through_the_connector_is_quiet(vllm_connector):
    """Many requests at once over a few prompts per tenant (each prompt one tenant's, one
    salt): stores, loads into blocks of concurrent requests, local prefix hits on top of
    loads, decode long enough to preempt under 64 blocks, client hang-ups, and local cache
    resets while it runs. Nothing reported; loads were made and their digests compared."""
    engine, watch, _store = vllm_connector
    rng = random.Random(25)
    tenants = ("acme", "globex", "initech")
    # Base lengths with len - 1 no multiple of the block size: at such a length the
    # reference connector stores again on every request (its existence check counts one
    # token fewer than its save), and a store made while the prompt's prefill is split
    # over steps holds only the first chunk's blocks; a later load of it fills more blocks
    # than it holds and fails the engine (vLLM's own bug: the last test of this module;
    # seen once in CI with 65-token prompts on a loaded machine).
    prompts = {t: [_text(rng, n) for n in (40, 70, 90)] for t in tenants}
    # each base prompt stored whole first, one at a time (prefilled in one step), so the
    # concurrent requests load them rather than store them again, split
    for t in tenants:
        for p in prompts[t]:
            complete(engine, p, 1, tenant=t, cache_salt=f"{t}-salt")
    mark = watch.mark()
    before = watch.stats()
    jobs = [(tenants[i % 3], i) for i in range(60)]

    def run(job):
        tenant, i = job
        prompt = prompts[tenant][(i // 3) % 3] + ("" if i % 4 else _text(rng, 10))  # some extend a stored prompt
        if i % 17 == 5:
            complete_and_hang_up(engine, prompt, 300, tenant=tenant, cache_salt=f"{tenant}-salt")
        else:
            complete(engine, prompt, 20 + (i * 53) % 260, tenant=tenant, cache_salt=f"{tenant}-salt")
        if i % 10 == 9:
            _reset_local_cache(engine)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(run, jobs))
    found = watch.since(mark)
    stats = watch.stats()
    assert found == [], watch.explain(found)
    loads = stats.records_by_kind.get("KV_LOAD", 0) - before.records_by_kind.get("KV_LOAD", 0)
    compared = stats.load_digests_compared - before.load_digests_compared
    print(f"  {loads} KV_LOAD records, {compared} load digests compared")  # (shown with -s)
    assert loads >= 2, loads  # (how many depends on how the resets fall among the requests)
    assert compared > 0
    (engine_stats,) = [e for e in stats.engines if e.pages_read]
    assert engine_stats.pages_unverified == 0


def test_a_load_past_a_truncated_object_is_named_before_the_engine_fails(vllm_connector):
    """LAST in this module: it ends the engine. Under chunked prefill the reference connector
    saves a new request's prompt in the step of its first chunk, from the blocks that step
    has: 4 of the 9 its key claims (288 tokens). Loading it back fills 9 blocks from 4
    blocks' worth of KV, which fails the engine (vLLM 0.32.0: the request gets a 500 and the
    server exits). kvguard names the cause first: transfer_size_mismatch via the load."""
    engine, watch, _store = vllm_connector
    rng = random.Random(26)
    prompt = _text(rng, 300)
    complete(engine, prompt, 4, tenant="acme", cache_salt="acme-salt")
    _reset_local_cache(engine)
    mark = watch.mark()
    with pytest.raises(httpx.HTTPError):
        complete(engine, prompt, 4, tenant="acme", cache_salt="acme-salt", timeout_s=60.0)
    found = [f for f in watch.since(mark) if f.kind == "transfer_size_mismatch"]
    assert len(found) == 1, [f.to_dict() for f in watch.since(mark)]
    f = found[0]
    assert f.reader.tenant == "acme" and f.evidence["via"] == "load", f.to_dict()
    assert (f.evidence["direction"], f.evidence["stored_pages"], f.evidence["loaded_pages"]) == (
        "load_past_object",
        4,
        9,
    )

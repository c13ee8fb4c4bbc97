"""The SGLang adapter's HiCache hooks (engine_hooks/sglang/hooks_hicache.py) with stand-ins
for SGLang's L2 transfers, controller and radix cache: which KV_STORE / KV_LOAD records
each copy gives. The real engine: tests/integration/test_hicache_engine.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import probes as probes_mod  # noqa: E402
from kvguard.engine_hooks.sglang import _runtime as rt  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_hicache as hh  # noqa: E402
from tests.support.recording_probes import RecordingProbes  # noqa: E402

PS = 4  # device and host page size


@pytest.fixture
def probes():
    stub = RecordingProbes()
    probes_mod.reset_probes_for_tests(stub)
    rt.State.reset()
    rt.State.hello_done = True
    rt.State.kv_pool = KV_POOL
    yield stub
    probes_mod.reset_probes_for_tests(None)
    rt.State.reset()


KV_POOL, OTHER_POOL = object(), object()
HOST_POOL = types.SimpleNamespace(page_size=PS, size=64 * PS)


def slots(*pages):
    return torch.tensor(np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages]), dtype=torch.int64)


def transfer(host_pages, device_pages, device_pool=KV_POOL, is_draft=False):
    return types.SimpleNamespace(
        host_pool=HOST_POOL,
        device_pool=device_pool,
        host_indices=slots(*host_pages),
        device_indices=slots(*device_pages),
        is_draft=is_draft,
    )


def backup(*transfers):
    hh._stored_post(None, object(), list(transfers))


def submit_loads(*transfers):
    hh._loaded_post(None, object(), list(transfers))


CONTROLLER = types.SimpleNamespace(mem_pool_device=KV_POOL)


def issue_load(host_pages, device_pages):
    hh._load_issued_post(slots(*device_pages), CONTROLLER, slots(*host_pages))


def pages_of(call):
    return sorted({int(s) // PS for s in np.asarray(call[1][2]).tolist()})


def test_a_backup_and_its_load_back_name_the_same_object_for_the_request(probes):
    backup(transfer([10, 11, 12], [1, 2, 3]))
    (store,) = probes.named("kv_stored")
    rid, key = store[1][0], store[1][1]
    assert rid is None and key and pages_of(store) == [1, 2, 3] and store[2]["unit"] == "slots"

    def init_load_back(cache, params):
        issue_load([10, 11], [7, 8])  # a node split: the first two pages of the backup
        return 8, None  # (tokens loaded, last node)

    hook = hh.for_request_hook("UnifiedRadixCache.init_load_back")
    req = types.SimpleNamespace(rid="r-1", prefix_len=4, prefix_indices=torch.arange(0), origin_input_ids=[1] * 20)
    hook(init_load_back, object(), types.SimpleNamespace(req=req, host_hit_length=8))  # (loads 8)
    (begin,) = probes.named("request_begin")
    assert begin[1][0] == "r-1" and begin[1][4] == 4 + 8  # the device prefix and the tokens loaded
    submit_loads(transfer([10, 11], [7, 8]))
    loads = probes.named("kv_loaded")
    assert [(c[1][0], c[1][1], pages_of(c), c[1][3]) for c in loads] == [
        ("r-1", key, [7, 8], "issued"),
        ("r-1", key, [7, 8], "completed"),
    ]
    assert hh.Tier.for_request is None and not hh.Tier.pending


def test_a_load_across_two_backups_names_each(probes):
    backup(transfer([10, 11], [1, 2]))
    backup(transfer([12], [3]))
    k1, k2 = (c[1][1] for c in probes.named("kv_stored"))
    assert k1 != k2
    issue_load([11, 12], [7, 8])
    submit_loads(transfer([11, 12], [7, 8]))
    done = [(c[1][1], pages_of(c)) for c in probes.named("kv_loaded") if c[1][3] == "completed"]
    assert done == [(k1, [7]), (k2, [8])]


def test_a_restore_with_no_issued_load_is_its_requests_and_other_pools_are_skipped(probes):
    hook = hh.for_request_hook("UnifiedRadixCache.backup_kv_cache")
    req = types.SimpleNamespace(rid="r-ret")
    hook(lambda cache, r: backup(transfer([20, 21], [4, 5])), object(), req)
    (store,) = probes.named("kv_stored")
    assert store[1][0] == "r-ret"  # a retraction backup is the request's, not the cache's
    restore = hh.for_request_hook("UnifiedRadixCache.restore_kv_cache")
    restore(lambda cache, r, b: submit_loads(transfer([20, 21], [9, 10])), object(), req, None)
    (load,) = probes.named("kv_loaded")
    assert (load[1][0], load[1][1], pages_of(load), load[1][3]) == ("r-ret", store[1][1], [9, 10], "completed")
    backup(transfer([30], [6], device_pool=OTHER_POOL), transfer([31], [7], is_draft=True))
    assert len(probes.named("kv_stored")) == 1  # a side pool's and a draft model's copies are not the KV pool's


def test_the_request_is_forgotten_when_the_cache_call_raises(probes):
    hook = hh.for_request_hook("UnifiedRadixCache.init_load_back")

    def boom(cache, params):
        raise RuntimeError("engine error")

    with pytest.raises(RuntimeError, match="engine error"):
        hook(boom, object(), types.SimpleNamespace(req=types.SimpleNamespace(rid="r-x"), host_hit_length=0))
    assert hh.Tier.for_request is None


def test_tier_pages_keep_the_objects_order():
    """A backup's and a load's pages go out in the object's order, one per page (wire contract
    1.1): the sidecar pairs a store's page i with a whole load's page i to carry what each holds
    (its content identity). A sorted set loses that when the pool handed pages out of order."""
    from kvguard.engine_hooks.probes import Probes
    from tests.support.recording_probes import CaptureWriter

    cap = CaptureWriter()
    p = Probes(cap, page_size=4)
    slots = [36, 37, 38, 39, 8, 9, 10, 11, 20, 21]  # pages 9, 2, 5 (the last one partly)
    p.kv_stored(None, 7, slots, unit="slots")
    p.kv_loaded("r", 7, slots, "issued", unit="slots")
    store, load = cap.take()
    assert store.body.pages.tolist() == load.body.pages.tolist() == [9, 2, 5]


def test_a_backup_and_its_load_name_their_pages_in_the_backups_host_order():
    """A backup's copy and a load-back of it may gather their device indices in different
    orders; both records name the pages in host-slot order, so the store's page i and the
    load's page i hold the same tokens."""
    from kvguard.engine_hooks.sglang.hooks_hicache import _in_object_order

    host = np.array([8, 9, 10, 11, 0, 1, 2, 3])  # host pages 2 then 0 (page size 4)
    stored_from = np.array([40, 41, 42, 43, 12, 13, 14, 15])  # device pages 10 (tokens 8-11), 3 (tokens 0-3)
    loaded_into = np.array([20, 21, 22, 23, 4, 5, 6, 7])
    assert (_in_object_order(stored_from, host) // 4)[::4].tolist() == [3, 10]
    assert (_in_object_order(loaded_into, host) // 4)[::4].tolist() == [1, 5]
    ordered = np.arange(4)
    assert _in_object_order(ordered + 100, ordered).tolist() == [100, 101, 102, 103]  # (already in order)

"""The vLLM adapter's KV connector hooks (engine_hooks/vllm/hooks_connector.py) on stand-ins
for vLLM's scheduler and connector (no vLLM needed): a load becomes KV_LOAD issued then
completed (or failed) over the blocks the connector fills, the loaded tokens are not the
row's shared prefix, and the reference connector's stores become KV_STORE once the forward
that saves them ran. The same hooks on the real engine: tests/integration/test_vllm_connector.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.vllm import _runtime as rt
from kvguard.engine_hooks.vllm import hooks_connector as hconn
from kvguard.engine_hooks.vllm import hooks_core as hc
from tests.conftest import VLLM_TEST_BLOCK

PAGE = VLLM_TEST_BLOCK


@pytest.fixture
def captured(vllm_captured):
    return vllm_captured


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


class Lookup:
    """A connector that finds ``external`` tokens past the local hit, loaded (a)synchronously."""

    def __init__(self, external: int, is_async: bool):
        self.answer = (external, is_async)
        self.allocs = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.answer

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.allocs.append((request.request_id, num_external_tokens))


def _request(rid="r", salt=None, prompt=130, tenant="acme"):
    return types.SimpleNamespace(
        request_id=rid,
        num_output_tokens=0,
        cache_salt=salt,
        num_prompt_tokens=prompt,
        prompt_token_ids=list(range(prompt)),
        mm_features=[],
        block_hashes=[bytes([i]) * 8 for i in range(prompt // PAGE)],
        sampling_params=types.SimpleNamespace(extra_args={"kvguard_tenant": tenant}),
    )


def _scheduler(connector, *requests):
    s = types.SimpleNamespace(connector=connector, requests={r.request_id: r for r in requests})
    rt.State.scheduler = s
    hconn.attach(s)
    return s


def _new(rid, ids, computed, prompt=None):
    return types.SimpleNamespace(
        req_id=rid, block_ids=(ids,), num_computed_tokens=computed, prompt_token_ids=prompt, mm_features=[]
    )


def _step(new=(), resumed=()):
    return types.SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=list(resumed), new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set(resumed)
        ),
    )


def _admit(s, request, local: int, ids):
    """What the scheduler does for a waiting request: look up, allocate, tell the connector."""
    external, _ = s.connector.get_num_new_matched_tokens(request, local)
    s.connector.update_state_after_alloc(request, Blocks(ids), external)
    return external


def test_a_synchronous_load_is_issued_at_allocation_and_lands_in_the_step_that_schedules_it(captured):
    request = _request()
    s = _scheduler(Lookup(64, False), request)
    _admit(s, request, 32, [3, 4, 5, 6, 7])  # a 32-token local hit, 64 tokens from the connector
    assert s.connector.allocs == [("r", 64)]  # the engine's call ran, with its arguments
    begin, issued = captured.take()
    assert begin.kind == wire.Kind.REQ_BEGIN and begin.body.cached_tokens == 96 and begin.body.tenant == "acme"
    assert issued.kind == wire.Kind.KV_LOAD and issued.body.phase == wire.LoadPhase.ISSUED
    assert issued.body.pages.tolist() == [4, 5]  # tokens [32, 96): the second and third blocks
    hc.schedule_post(None, _step([_new("r", [3, 4, 5, 6, 7], 96)]), s)
    assign, landed = captured.take()
    # the hit is shared, the loaded blocks are the request's own (written by the load)
    assert assign.kind == wire.Kind.ASSIGN and assign.body.shared_until == 32
    assert landed.kind == wire.Kind.KV_LOAD and landed.body.phase == wire.LoadPhase.COMPLETED
    assert landed.body.pages.tolist() == [4, 5] and landed.body.object_key == issued.body.object_key
    hc.schedule_post(None, _step([_new("r2", [8], 0)]), s)  # later steps: nothing more of the load
    assert [r.kind for r in captured.take()] == [wire.Kind.REQ_BEGIN, wire.Kind.ASSIGN]


def test_an_asynchronous_load_lands_when_the_worker_reports_it_and_fails_on_an_invalid_block(captured):
    a, b = _request("a"), _request("b")
    s = _scheduler(Lookup(96, True), a, b)
    _admit(s, a, 0, [3, 4, 5, 6])
    _admit(s, b, 0, [7, 8, 9, 10])
    assert [r.body.phase for r in captured.take() if r.kind == wire.Kind.KV_LOAD] == [wire.LoadPhase.ISSUED] * 2
    hc.schedule_post(None, _step(), s)
    assert captured.take() == []  # both wait for their KV: nothing lands with a step
    out = types.SimpleNamespace(finished_recving={"a", "b"}, invalid_block_ids={9})
    hconn.xfer_finished_pre(s, out)
    phases = {r.body.req_key: (r.body.phase, r.body.pages.tolist()) for r in captured.take()}
    assert phases == {
        wire.request_key("a"): (wire.LoadPhase.COMPLETED, [3, 4, 5]),
        wire.request_key("b"): (wire.LoadPhase.FAILED, [7, 8, 9]),
    }
    hc.schedule_post(None, _step([_new("a", [3, 4, 5, 6], 96)]), s)  # scheduled once its KV is in
    (assign,) = captured.take()  # begun at its load already; the loaded tokens are its own
    assert assign.kind == wire.Kind.ASSIGN and assign.body.shared_until == 0


def test_a_load_of_a_request_resumed_after_a_preemption_lands_with_its_new_row(captured):
    request = _request()
    s = _scheduler(Lookup(64, False), request)
    hc.schedule_post(None, _step([_new("r", [3], 0)]), s)
    captured.take()
    _admit(s, request, 0, [4, 5, 6])  # preempted, then resumed: the connector reloads its prefix
    captured.take()
    step = _step(resumed=["r"])
    step.scheduled_cached_reqs.new_block_ids = [([4, 5, 6],)]
    step.scheduled_cached_reqs.num_computed_tokens = [64]
    hc.schedule_post(None, step, s)
    assign, landed = captured.take()
    assert assign.body.shared_until == 0 and landed.body.phase == wire.LoadPhase.COMPLETED


def test_no_external_tokens_means_no_load_and_a_connector_hook_failure_leaves_the_engine_call_alone(captured):
    request = _request()
    s = _scheduler(Lookup(0, False), request)
    _admit(s, request, 32, [3, 4])
    assert captured.take() == [] and s.connector.allocs == [("r", 0)]
    s.connector.answer = (64, False)
    blocks = Blocks([3])  # fewer blocks than the load names: our slicing is empty, nothing emitted
    s.connector.get_num_new_matched_tokens(request, 32)
    s.connector.update_state_after_alloc(request, blocks, 64)
    assert captured.take() == []
    s.connector.get_num_new_matched_tokens(request, 32)
    s.connector.update_state_after_alloc(request, None, 64)  # a hook failure: counted, the call still ran
    assert s.connector.allocs[-1] == ("r", 64)
    assert "Lookup.update_state_after_alloc" in rt.disabled_hooks()


class ExampleConnector:
    """The reference connector's parts the hooks use (its real class: vLLM's example_connector)."""

    def __init__(self, on_disk=()):
        self._block_size = PAGE
        self._requests_need_load = {}
        self.on_disk = set(on_disk)

    def _generate_foldername_debug(self, token_ids, mm_hashes, create_folder=False):
        assert not create_folder  # the hooks never make folders
        return "/store/" + "%x" % hash(tuple(token_ids.tolist()))

    def _found_match_for_prompt(self, prompt_token_ids, mm_hashes):
        return len(prompt_token_ids) in self.on_disk

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        hit = self._found_match_for_prompt(request.prompt_token_ids, [])
        return ((len(request.prompt_token_ids) - 2) // PAGE * PAGE - num_computed_tokens, False) if hit else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self._requests_need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output):
        reqs = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._requests_need_load:
                reqs.append(types.SimpleNamespace(is_store=False))
            elif not self._found_match_for_prompt(new.prompt_token_ids, []):
                reqs.append(types.SimpleNamespace(is_store=True))
        self._requests_need_load.clear()
        return types.SimpleNamespace(requests=reqs)


def test_the_reference_connectors_stores_go_out_after_their_forward_and_key_as_its_loads(captured):
    pytest.importorskip("torch")
    acme, globex = _request("acme-1", salt="a", prompt=130), _request("globex-1", salt="g", prompt=130)
    connector = ExampleConnector()
    s = _scheduler(connector, acme, globex)
    step = _step([_new("acme-1", [3, 4, 5, 6, 7], 0, prompt=acme.prompt_token_ids)])
    hc.schedule_post(None, step, s)
    captured.take()
    connector.build_connector_meta(step)
    assert captured.take() == []  # not before the forward that saves the KV
    hc.update_from_output_post(None, None, s, step)
    (stored,) = captured.take()
    # align_to_block_size(130) = 128 tokens: four blocks, keyed by the folder the connector uses
    assert stored.kind == wire.Kind.KV_STORE and stored.body.pages.tolist() == [3, 4, 5, 6]
    assert stored.body.scope == wire.request_scope(None, "a")
    connector.on_disk.add(130)
    _admit(s, globex, 0, [8, 9, 10, 11, 12])  # another salt, the same prompt: the connector loads it
    loaded = [r for r in captured.take() if r.kind == wire.Kind.KV_LOAD]
    assert loaded[0].body.object_key == stored.body.object_key  # what lets the sidecar compare the two
    assert loaded[0].body.scope == wire.request_scope(None, "g")
    step2 = _step([_new("globex-1", [8, 9, 10, 11, 12], 96, prompt=globex.prompt_token_ids)])
    connector.build_connector_meta(step2)
    hc.update_from_output_post(None, None, s, step2)
    assert all(r.kind != wire.Kind.KV_STORE for r in captured.take())  # a load is no store


def test_a_store_of_a_request_ending_in_its_first_step_keeps_its_salt(captured):
    """One output token: the request has left the scheduler when the store is reported
    after its step; its salt was taken when the store was planned (before: none, so the
    object read as unsalted and every salted load of it was a false cross-salt share)."""
    pytest.importorskip("torch")
    acme = _request("acme-1", salt="a", prompt=130)
    connector = ExampleConnector()
    s = _scheduler(connector, acme)
    step = _step([_new("acme-1", [3, 4, 5, 6, 7], 0, prompt=acme.prompt_token_ids)])
    hc.schedule_post(None, step, s)
    connector.build_connector_meta(step)
    del s.requests["acme-1"]  # finished in this step (vLLM frees it before the output is processed)
    captured.take()
    hc.update_from_output_post(None, None, s, step)
    (stored,) = [r for r in captured.take() if r.kind == wire.Kind.KV_STORE]
    assert stored.body.scope == wire.request_scope(None, "a")


class RacingConnector(ExampleConnector):
    """Its folder check answers differently from ours (a file removed in between)."""

    def build_connector_meta(self, scheduler_output):
        return types.SimpleNamespace(requests=[types.SimpleNamespace(is_store=True)])


def test_a_store_the_hooks_cannot_attribute_is_counted_not_guessed(captured, caplog):
    pytest.importorskip("torch")
    request = _request("r", prompt=130)
    connector = RacingConnector(on_disk={130})  # our check: on disk, so no store expected
    s = _scheduler(connector, request)
    step = _step([_new("r", [3, 4, 5, 6, 7], 0, prompt=request.prompt_token_ids)])
    with caplog.at_level("WARNING", logger="kvguard.vllm"):
        connector.build_connector_meta(step)
        connector.build_connector_meta(step)
    hc.update_from_output_post(None, None, s, step)
    assert [r for r in captured.take() if r.kind == wire.Kind.KV_STORE] == []
    assert rt.State.stores_unattributed == 2
    assert len([r for r in caplog.records if "could not attribute" in r.getMessage()]) == 1  # said once


def test_the_worker_digests_what_the_reference_connector_stored_and_what_it_loaded(captured):
    torch = pytest.importorskip("torch")
    from kvguard.engine_hooks.vllm import hooks_connector_worker as hw_conn

    rt.State.part_done = True  # this Worker announced itself
    kv = {f"layer.{i}": torch.randn(8, 2, PAGE, 4).to(torch.bfloat16) for i in range(2)}  # [B, H, N, C]
    tokens = torch.arange(2 * PAGE)

    def meta(is_store, blocks):
        slots = (torch.tensor(blocks)[:, None] * PAGE + torch.arange(PAGE)[None, :]).flatten()
        return types.SimpleNamespace(token_ids=tokens, slot_mapping=slots, is_store=is_store, mm_hashes=[])

    connector = ExampleConnector()
    connector.requests = []
    connector._get_connector_metadata = lambda: types.SimpleNamespace(requests=connector.requests)
    connector.requests = [meta(True, [2, 3])]
    for name, tensor in kv.items():
        hw_conn.save_kv_layer_post(None, None, connector, name, tensor)
    hw_conn.wait_for_save_post(None, None, connector)
    (stored,) = captured.take()
    assert stored.kind == wire.Kind.KV_DIGEST and stored.body.side == wire.TierSide.STORED
    for tensor in kv.values():  # the connector loads the same bytes into blocks 5, 6
        tensor[5:7] = tensor[2:4]
    connector.requests = [meta(False, [5, 6])]
    layers = {name: types.SimpleNamespace(kv_cache=t) for name, t in kv.items()}
    context = types.SimpleNamespace(attn_metadata={}, no_compile_layers=layers)
    hw_conn.start_load_kv_post(None, None, connector, context)
    (loaded,) = captured.take()
    assert loaded.body.side == wire.TierSide.LOADED and loaded.body.object_key == stored.body.object_key
    assert loaded.body.digest == stored.body.digest
    kv["layer.1"][6, 1, 3, 2] += 1  # one value changed at rest
    hw_conn.start_load_kv_post(None, None, connector, context)
    (changed,) = captured.take()
    assert changed.body.digest != stored.body.digest
    # no attention metadata: the connector loaded nothing, so nothing is hashed
    hw_conn.start_load_kv_post(None, None, connector, types.SimpleNamespace(attn_metadata=None))
    assert captured.take() == []


def test_a_connector_that_cannot_be_wrapped_leaves_the_forward_hook_running(captured, monkeypatch):
    """Watching a connector is optional: if wrapping it fails in the Worker, the failure is
    counted under its own name and the forwards are still reported."""
    from kvguard.engine_hooks.vllm import hooks_connector_worker as hw_conn
    from kvguard.engine_hooks.vllm import hooks_worker as hw

    def broken():
        raise RuntimeError("no transfer group layout we know")

    monkeypatch.setattr(hw_conn, "attach", broken)
    rt.State.hello_done = False
    table = types.SimpleNamespace(block_size=PAGE, block_table=types.SimpleNamespace(np=np.array([[3, 4]], np.int32)))
    runner = types.SimpleNamespace(
        input_batch=types.SimpleNamespace(
            num_reqs=1,
            req_ids=["r"],
            num_computed_tokens_cpu=np.array([40], np.int32),
            block_table=types.SimpleNamespace(block_tables=[table]),
        ),
        cache_config=types.SimpleNamespace(block_size=PAGE),
        speculative_config=None,
    )
    hw.prepare_inputs_pre(runner, None, np.array([1], np.int32))
    kinds = [r.kind for r in captured.take()]
    assert wire.Kind.ENGINE_PART in kinds and wire.Kind.FORWARD in kinds
    assert "KVConnector.worker_attach" in rt.disabled_hooks()

"""The vLLM adapter's prefill/decode transfer hooks (engine_hooks/vllm/hooks_transfer.py and
hooks_transfer_worker.py) on stand-ins for vLLM's scheduler and ``MooncakeConnector`` (no vLLM
needed): decode's pull is XFER_RESERVE then XFER_DONE (not a tier load), both ends carry the
room of the shared transfer id, prefill's REQ_END waits for its send, and the workers report
what is sent and both ends' digests. The real pair: tests/integration/test_vllm_pd.py."""

from __future__ import annotations

import types

import pytest
import torch

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.vllm import _runtime as rt
from kvguard.engine_hooks.vllm import hooks_connector as hconn
from kvguard.engine_hooks.vllm import hooks_core as hc
from kvguard.engine_hooks.vllm import hooks_transfer as htx
from kvguard.engine_hooks.vllm import hooks_transfer_worker as htw
from tests.conftest import VLLM_TEST_BLOCK as PAGE

TID = "xfer-3f1c"


@pytest.fixture
def captured(vllm_captured):
    return vllm_captured


class MooncakeConnector:
    """The scheduler-side calls of vLLM's connector, as it answers them for decode's pull."""

    def __init__(self):
        self.pulls = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if params.get("do_remote_prefill"):
            return request.num_prompt_tokens - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if params.get("do_remote_prefill"):
            self.pulls[request.request_id] = num_external_tokens
            params["do_remote_prefill"] = False  # (vLLM: only one transfer per request)


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def _request(rid, params, prompt=150, tenant="acme"):
    return types.SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        num_output_tokens=1,
        num_preemptions=0,
        stop_reason=None,
        arrival_time=0.0,
        cache_salt=None,
        get_finished_reason=lambda: 1,
        sampling_params=types.SimpleNamespace(extra_args={"kvguard_tenant": tenant}),
    )


def _scheduler(*requests):
    s = types.SimpleNamespace(connector=MooncakeConnector(), requests={r.request_id: r for r in requests})
    rt.State.scheduler = s
    hconn.attach(s)
    return s


def _step(new=()):
    return types.SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
    )


def test_the_room_is_the_transfer_ids_on_both_ends_and_a_plain_request_has_none(captured):
    _scheduler()
    room = htx.room_of_transfer(TID)
    assert room == htx.room_of(_request("p", {"do_remote_decode": True, "transfer_id": TID}))
    assert room == htx.room_of(_request("d", {"do_remote_prefill": True, "transfer_id": TID}))
    assert 0 < room < wire.NO_ROOM and room != htx.room_of_transfer(TID + "x")
    assert htx.room_of(_request("u", None)) is None


def test_decodes_pull_is_a_reserved_transfer_in_its_row_and_ends_with_the_worker(captured):
    params = {"do_remote_prefill": True, "transfer_id": TID, "remote_engine_id": "e", "remote_bootstrap_addr": "b"}
    request = _request("d", params, prompt=150)
    s = _scheduler(request)
    external, _ = s.connector.get_num_new_matched_tokens(request, 32)  # a block of its own cached
    s.connector.update_state_after_alloc(request, Blocks([3, 4, 5, 6, 7]), external)
    begin, row, reserve = captured.take()
    room = htx.room_of_transfer(TID)
    assert begin.kind == wire.Kind.REQ_BEGIN and begin.body.room == room and begin.body.cached_tokens == 150
    # the row first (its hit shared), so that the reservation is placed after the hit
    assert row.kind == wire.Kind.ASSIGN and row.body.pages.tolist() == [3, 4, 5, 6, 7] and row.body.shared_until == 32
    assert reserve.kind == wire.Kind.XFER_RESERVE and reserve.body.room == room
    assert reserve.body.tokens == 118 and reserve.body.pages.tolist() == [4, 5, 6, 7]
    hconn.xfer_finished_pre(s, types.SimpleNamespace(finished_recving={"d"}, invalid_block_ids=set()))
    (done,) = captured.take()  # a transfer, never a tier load
    assert done.kind == wire.Kind.XFER_DONE and done.body.side == wire.Side.RECEIVER
    assert done.body.status == wire.XferStatus.SUCCESS and done.body.room == room


def test_a_pull_with_an_invalid_block_ends_failed(captured):
    request = _request("d", {"do_remote_prefill": True, "transfer_id": TID})
    s = _scheduler(request)
    external, _ = s.connector.get_num_new_matched_tokens(request, 0)
    s.connector.update_state_after_alloc(request, Blocks([3, 4, 5, 6, 7]), external)
    captured.take()
    hconn.xfer_finished_pre(s, types.SimpleNamespace(finished_recving={"d"}, invalid_block_ids={6}))
    (done,) = captured.take()
    assert done.body.status == wire.XferStatus.FAILED


def _free(s, request, sent: bool) -> None:
    """``_free_request``: pre, the engine (the connector keeps the blocks of a request it still
    sends: it stays in ``requests``), post."""
    end_args = hc.free_request_pre(s, request)
    if not sent:
        s.requests.pop(request.request_id)
    hc.free_request_post(end_args, None, s, request)


def test_prefills_request_ends_when_its_send_finished(captured):
    request = _request("p", {"do_remote_decode": True, "transfer_id": TID})
    s = _scheduler(request)
    hc.schedule_post(None, _step([types.SimpleNamespace(req_id="p", block_ids=([3, 4],), num_computed_tokens=0)]), s)
    begin, _row = captured.take()
    assert begin.body.room == htx.room_of_transfer(TID)
    _free(s, request, sent=True)
    assert captured.take() == []  # its blocks are still to be sent
    hconn.xfer_finished_pre(s, types.SimpleNamespace(finished_sending={"p"}, finished_recving=None))
    done, end = captured.take()
    assert done.kind == wire.Kind.XFER_DONE and done.body.side == wire.Side.SENDER
    assert done.body.status == wire.XferStatus.SUCCESS
    assert end.kind == wire.Kind.REQ_END and end.body.output_tokens == 1


def test_a_prefill_request_freed_without_a_send_ends_its_side_aborted(captured):
    request = _request("p", {"do_remote_decode": True, "transfer_id": TID})
    s = _scheduler(request)
    hc.schedule_post(None, _step([types.SimpleNamespace(req_id="p", block_ids=([3],), num_computed_tokens=0)]), s)
    captured.take()
    _free(s, request, sent=False)
    done, end = captured.take()
    assert done.body.side == wire.Side.SENDER and done.body.status == wire.XferStatus.ABORTED
    assert end.kind == wire.Kind.REQ_END


# --------------------------------------------------------------------------- workers
def _worker_state(kv: torch.Tensor, requests=None) -> None:
    rt.State.part_done = True
    layer = types.SimpleNamespace(kv_cache=kv)
    rt.State.runner = types.SimpleNamespace(
        requests=requests or {},
        compilation_config=types.SimpleNamespace(static_forward_context={"model.layers.0.attn": layer}),
    )
    rt.State.kv_layers = {}


def test_prefills_worker_sends_the_blocks_decode_asked_for_with_their_tokens_and_digest(captured):
    kv = torch.arange(12 * 2 * PAGE * 4, dtype=torch.float32).reshape(12, 2, PAGE, 4)
    _worker_state(kv, {"p": types.SimpleNamespace(num_prompt_tokens=150)})
    send = {"p": (TID, [])}  # first named with no blocks, when it is scheduled
    htw.start_load_kv_pre(None, types.SimpleNamespace(reqs_to_send=send, reqs_to_recv={}))
    rt.State.runner.requests.clear()  # gone from the runner by the time it is sent
    send_meta = types.SimpleNamespace(p_req_id="p", transfer_id=TID, local_block_ids=[[2, 3, 4, 5, 6]])
    agent = types.SimpleNamespace(req_blocks={"d": (TID, [[8, 9, 10, 11]])})  # decode holds its first block
    htw.build_transfer_params_pre(None, [("d", send_meta)], agent)
    xsend, digest = captured.take()
    room = htx.room_of_transfer(TID)
    assert xsend.kind == wire.Kind.XFER_SEND and xsend.body.room == room and xsend.body.is_last
    assert xsend.body.pages.tolist() == [3, 4, 5, 6]  # the last four: decode's hit covers the first
    assert (xsend.body.token_start, xsend.body.token_end) == (32, 150)
    assert digest.kind == wire.Kind.XFER_DIGEST and digest.body.side == wire.Side.SENDER
    assert digest.body.alg == wire.DigestAlg.XXH3_BLOCK_ROWS

    # decode's worker: the same bytes in other blocks digest the same; one changed byte does not
    decode_kv = torch.zeros_like(kv)
    decode_kv[[8, 9, 10, 11]] = kv[[3, 4, 5, 6]]
    _worker_state(decode_kv)
    pull = types.SimpleNamespace(transfer_id=TID, local_block_ids=[[8, 9, 10, 11]], failed=False)
    htw.start_load_kv_pre(None, types.SimpleNamespace(reqs_to_send={}, reqs_to_recv={"e": {"d": pull}}))
    htw.get_finished_post(None, (None, {"d"}), None)
    (received,) = captured.take()
    assert received.body.side == wire.Side.RECEIVER and received.body.room == room
    assert received.body.digest == digest.body.digest
    decode_kv[9, 0, 0, 0] += 1
    htw.start_load_kv_pre(None, types.SimpleNamespace(reqs_to_send={}, reqs_to_recv={"e": {"d": pull}}))
    htw.get_finished_post(None, (None, {"d"}), None)
    (changed,) = captured.take()
    assert changed.body.digest != digest.body.digest


def test_workers_report_nothing_they_cannot_tell(captured):
    kv = torch.zeros(8, 2, PAGE, 4)
    _worker_state(kv)
    send_meta = types.SimpleNamespace(p_req_id="p", transfer_id=TID, local_block_ids=[[2, 3]])
    # prompt length never seen here (attached mid-run); decode asking for more than prefill holds
    htw.build_transfer_params_pre(None, [("d", send_meta)], types.SimpleNamespace(req_blocks={"d": (TID, [[5, 6]])}))
    rt.State.send_prompts[TID] = ("p", 60)
    htw.build_transfer_params_pre(None, [("d", send_meta)], types.SimpleNamespace(req_blocks={"d": (TID, [[5, 6, 7]])}))
    failed = types.SimpleNamespace(transfer_id=TID, local_block_ids=[[5, 6]], failed=True)
    htw.start_load_kv_pre(None, types.SimpleNamespace(reqs_to_send={}, reqs_to_recv={"e": {"d": failed}}))
    htw.get_finished_post(None, (None, {"d"}), None)  # a failed pull is not digested
    assert captured.take() == []

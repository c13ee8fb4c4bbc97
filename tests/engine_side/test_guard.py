"""The guard (KVGUARD_GUARD, engine_hooks/sglang/guard.py) without an engine: its
configuration, its decision in prefill's send_kv_chunk on SGLang-shaped objects, its
failure policy, and the sidecar's finding and metric from its GUARD record. The real
0.5.19 pair is tests/integration/test_guard_engine.py's."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvguard.engine_hooks import tier1
from kvguard.engine_hooks.sglang import _runtime as rt
from kvguard.engine_hooks.sglang import guard
from kvguard.engine_hooks.sglang import hooks_disagg as hd
from kvguard.engine_hooks.sglang._runtime import State
from kvguard.engine_hooks.sglang.guard import Guard, GuardConfig, GuardConfigError
from tests.sidecar.test_pipeline import engines, pd_request, run
from tests.support.recording_probes import RecordingProbes


# --------------------------------------------------------------------------- configuration
def test_off_by_default_and_values_are_case_insensitive():
    assert GuardConfig.from_env({}) == GuardConfig("off", "open")
    assert GuardConfig.from_env({"KVGUARD_GUARD": " Transfer ", "KVGUARD_GUARD_FAIL": "CLOSED"}) == GuardConfig(
        "transfer", "closed"
    )
    assert GuardConfig.from_env({"KVGUARD_GUARD": "full"}).transfer


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"KVGUARD_GUARD": "ful"}, "KVGUARD_GUARD='ful': expected one of off, transfer, full"),
        ({"KVGUARD_GUARD_FAIL": "shut"}, "KVGUARD_GUARD_FAIL='shut': expected one of open, closed"),
    ],
)
def test_a_bad_value_names_the_variable(env, needle):
    with pytest.raises(GuardConfigError, match=needle):
        GuardConfig.from_env(env)


def test_configure_logs_a_bad_value_and_stays_off_unless_fail_closed(caplog):
    with caplog.at_level(logging.ERROR, logger="kvguard.sglang"):
        assert guard.configure({"KVGUARD_GUARD": "yes"}) == GuardConfig()
    assert "KVGUARD_GUARD='yes'" in caplog.text and "the guard is off" in caplog.text
    with pytest.raises(GuardConfigError):
        guard.configure({"KVGUARD_GUARD": "yes", "KVGUARD_GUARD_FAIL": "closed"})


def test_full_turns_the_read_check_on_for_the_guard_and_says_so(caplog):
    try:
        with caplog.at_level(logging.INFO, logger="kvguard.sglang"):
            assert guard.configure({"KVGUARD_GUARD": "full"}).mode == "full"
        assert "KVGUARD_GUARD=full: transfer invariants and the read check (Tier 1) enforced" in caplog.text
        assert Guard.config.transfer and Guard.config.read
        assert tier1.required_by() == ("KVGUARD_GUARD=full", guard.on_read_violation)
        assert tier1.enabled_from_env({"KVGUARD_TIER1": "0"})  # on whatever KVGUARD_TIER1 says
        guard.configure({"KVGUARD_GUARD": "transfer"})
        assert tier1.required_by() is None and not tier1.enabled_from_env({})
    finally:
        guard.configure({})


# --------------------------------------------------------------------------- prefill's send
class KVPoll:  # the values of SGLang's enum that matter here
    Failed = 0
    Success = 4


@dataclass
class Info:
    endpoint: str
    dst_port: int
    dst_kv_indices: np.ndarray
    is_dummy: bool = False


@dataclass
class MooncakeManager:
    """0.5.19's Mooncake manager, as far as the guard uses it."""

    transfer_infos: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    _staging_outstanding: dict = field(default_factory=dict)

    def record_failure(self, room, reason):
        self.calls.append(("record_failure", room, reason))

    def update_status(self, room, status):
        self.calls.append(("update_status", room, status))

    def sync_status_to_decode_endpoint(self, remote, port, room, status, rank):
        self.calls.append(("sync", remote, port, room, status, rank))

    def _prefill_unique_rank(self):
        return 0


@pytest.fixture
def mooncake_module(monkeypatch):
    """A module named like SGLang's Mooncake connector, holding the manager class and KVPoll."""
    mod = types.ModuleType("sglang.srt.disaggregation.mooncake.conn")
    mod.KVPoll = KVPoll
    cls = type("MooncakeKVManager", (MooncakeManager,), {"__module__": mod.__name__})
    mod.MooncakeKVManager = cls
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return cls


class ConcludingManager:
    """0.5.23's manager: one call records the reason, marks Failed and tells decode."""

    def __init__(self):
        self.calls = []
        self.transfer_infos = {}

    def conclude_failure(self, *, bootstrap_room, failure_reason):
        self.calls.append(("conclude_failure", bootstrap_room, failure_reason))


def make_req(rid, mgr, room=7, prompt=1, warmup=False):
    sender = types.SimpleNamespace(kv_mgr=mgr)
    host = "2.2.2.2" if warmup else "10.0.0.2"  # SGLang's fake bootstrap host marks a warmup request
    return types.SimpleNamespace(
        rid=rid, bootstrap_room=room, disagg_kv_sender=sender, origin_input_ids=[5] * prompt, bootstrap_host=host
    )


@pytest.fixture
def probes(monkeypatch):
    State.reset()
    State.hello_done = True
    rec = RecordingProbes()
    monkeypatch.setattr(rt, "probes", lambda: rec)
    Guard.reset(GuardConfig("transfer"))
    yield rec
    Guard.reset()
    State.reset()


def test_a_rejected_request_is_failed_through_mooncakes_own_channel_before_it_sends(probes, mooncake_module):
    mgr = mooncake_module(transfer_infos={7: {"a": Info("10.0.0.2", 9000, np.arange(150))}})
    State.rejected["long"] = 600
    guard.before_send(object(), make_req("long", mgr), True)
    (rec, room, reason), (upd, _, status), sync = mgr.calls
    assert (rec, room, upd, status) == ("record_failure", 7, "update_status", KVPoll.Failed)
    assert "request long (bootstrap room 7) was rejected" in reason and "1 token(s) of a 600-token prompt" in reason
    assert sync == ("sync", "10.0.0.2", 9000, 7, KVPoll.Failed, 0)  # the three frames decode expects
    ((_, args, kwargs),) = probes.named("guard_acted")
    assert args == ("long", 7, "rejected_send", "aborted")
    assert kwargs == {"prompt_tokens": 600, "send_tokens": 1, "reserved_pages": 150, "reason": reason}
    # once per request
    guard.before_send(object(), make_req("long", mgr), True)
    assert len(mgr.calls) == 3 and len(probes.named("guard_acted")) == 1


def test_a_chunk_in_flight_keeps_decode_waiting_for_its_timeout_instead(probes, mooncake_module):
    mgr = mooncake_module(transfer_infos={7: {"a": Info("10.0.0.2", 9000, np.arange(150))}})
    mgr._staging_outstanding[7] = 1  # decode must not free pages a chunk may still land in
    State.rejected["long"] = 600
    guard.before_send(object(), make_req("long", mgr), True)
    assert [c[0] for c in mgr.calls] == ["record_failure", "update_status"]


def test_0_5_23s_manager_concludes_the_failure_in_one_call(probes):
    mgr = ConcludingManager()
    State.rejected["long"] = 600
    guard.before_send(object(), make_req("long", mgr), True)
    ((what, room, _reason),) = mgr.calls
    assert (what, room) == ("conclude_failure", 7)
    assert probes.named("guard_acted")[0][1][3] == "aborted"


def test_a_backend_it_cannot_fail_is_observed_and_left_alone(probes):
    mgr = types.SimpleNamespace(transfer_infos={})  # e.g. another transfer backend
    State.rejected["long"] = 600
    guard.before_send(object(), make_req("long", mgr), True)
    ((_, args, kwargs),) = probes.named("guard_acted")
    assert args[3] == "observed" and kwargs["reserved_pages"] == 0


@pytest.mark.parametrize("case", ["not rejected", "warmup", "guard off", "before hello"])
def test_nothing_is_touched_when_there_is_nothing_to_guard(probes, mooncake_module, case):
    mgr = mooncake_module(transfer_infos={7: {"a": Info("10.0.0.2", 9000, np.arange(150))}})
    if case != "not rejected":
        State.rejected["r"] = 600
    if case == "guard off":
        Guard.reset(GuardConfig("off"))
    if case == "before hello":
        State.hello_done = False
    guard.before_send(object(), make_req("r", mgr, warmup=case == "warmup"), True)
    assert mgr.calls == [] and probes.named("guard_acted") == []


def test_an_internal_error_turns_the_guard_off_for_the_engine_unless_fail_closed(probes):
    class Broken:
        transfer_infos = {}

        def conclude_failure(self, **kw):
            raise RuntimeError("manager changed")

    State.rejected["a"] = State.rejected["b"] = 600
    guard.before_send(object(), make_req("a", Broken()), True)  # fail open: no exception
    assert not rt.is_enabled(guard.GUARD_TRANSFER)
    assert [c[1][0] for c in probes.named("report_probe_error")] == ["sglang." + guard.GUARD_TRANSFER]
    Guard.reset(GuardConfig("transfer", "closed"))
    State.reset()
    State.hello_done = True
    State.rejected["b"] = 600
    with pytest.raises(RuntimeError, match="manager changed"):
        guard.before_send(object(), make_req("b", Broken()), True)


def test_the_send_hook_runs_the_guard_first_and_then_the_original_once(probes, mooncake_module):
    mgr = mooncake_module(transfer_infos={7: {"a": Info("10.0.0.2", 9000, np.arange(150))}})
    State.rejected["long"] = 600
    seen = []

    def original(sched, req, last_chunk=False, end_idx=None):
        seen.append([c[0] for c in mgr.calls])

    hd.send_kv_chunk_hook("Mixin.send_kv_chunk")(original, object(), make_req("long", mgr), True)
    assert seen == [["record_failure", "update_status", "sync"]]


# --------------------------------------------------------------------------- sent == reserved
def sending(rid, mgr, *, send_pages, sent_pages=0, prompt=30, prefix=0):
    """A request prefill is about to send: its sender initialised for ``send_pages``
    (SGLang's ``num_kv_indices``), ``sent_pages`` of them handed over so far (``curr_idx``)."""
    req = make_req(rid, mgr, prompt=prompt)
    req.disagg_kv_sender.num_kv_indices = send_pages
    req.disagg_kv_sender.curr_idx = sent_pages
    req.disagg_decode_prefix_len = prefix
    return req


@pytest.fixture
def reserved8(mooncake_module):
    """A 0.5.19 Mooncake manager whose room 7 has 8 pages reserved at decode, page size 4."""
    mgr = mooncake_module(transfer_infos={7: {"a": Info("10.0.0.2", 9000, np.arange(8))}})
    mgr.kv_args = types.SimpleNamespace(page_size=4)
    return mgr


@pytest.mark.parametrize("send_pages", [1, 7, 9])
def test_a_send_of_other_than_the_reserved_pages_is_failed_before_its_first_chunk(probes, reserved8, send_pages):
    guard.before_send(object(), sending("r", reserved8, send_pages=send_pages), False)
    (rec, room, reason), (upd, _, status), sync = reserved8.calls
    assert (rec, room, upd, status) == ("record_failure", 7, "update_status", KVPoll.Failed)
    assert f"prefill was about to send {send_pages} KV page(s) where decode reserved 8" in reason
    assert ("decode would read reserved pages nothing wrote" in reason) == (send_pages < 8)
    assert sync == ("sync", "10.0.0.2", 9000, 7, KVPoll.Failed, 0)
    ((_, args, kwargs),) = probes.named("guard_acted")
    assert args == ("r", 7, "send_size", "aborted")
    sent_tokens = min(30, send_pages * 4)
    assert kwargs == {"prompt_tokens": 30, "send_tokens": sent_tokens, "reserved_pages": 8, "reason": reason}
    # once per request: the next chunk's call changes nothing
    guard.before_send(object(), sending("r", reserved8, send_pages=send_pages), True)
    assert len(reserved8.calls) == 3 and len(probes.named("guard_acted")) == 1


def test_decodes_cached_prefix_is_not_counted_as_sent(probes, reserved8):
    # 0.5.23: decode holds the first 16 tokens; both ends count the 8 pages after them
    guard.before_send(object(), sending("r", reserved8, send_pages=8, prompt=46, prefix=16), False)
    assert reserved8.calls == [] and probes.named("guard_acted") == []
    guard.before_send(object(), sending("s", reserved8, send_pages=4, prompt=46, prefix=16), False)
    ((_, args, kwargs),) = probes.named("guard_acted")
    assert (
        args[2] == "send_size" and kwargs["send_tokens"] == 16 and "(16 token(s) cached at decode)" in kwargs["reason"]
    )


@pytest.mark.parametrize(
    "case", ["equal", "after the first chunk", "no sender count", "unknown reservation", "relayout", "warmup"]
)
def test_the_size_rule_touches_nothing_it_cannot_judge(probes, reserved8, case):
    req = sending("r", reserved8, send_pages=8 if case == "equal" else 1, sent_pages=1 if "after" in case else 0)
    if case == "no sender count":
        del req.disagg_kv_sender.num_kv_indices
    if case == "unknown reservation":  # a dummy rank, or decode's pages not known here
        reserved8.transfer_infos.clear()
    if case == "relayout":  # decode asked for a DCP relayout: pages do not map one to one
        reserved8.transfer_infos[7]["a"].mooncake_session_id = "s1"
        reserved8.decode_kv_args_table = {"s1": types.SimpleNamespace(requires_dcp_relayout=True)}
    if case == "warmup":
        req.bootstrap_host = "2.2.2.2"
    guard.before_send(object(), req, False)
    assert reserved8.calls == [] and probes.named("guard_acted") == []


def test_a_rejected_request_is_judged_by_the_rejection_rule_not_the_size_rule(probes, reserved8):
    State.rejected["long"] = 600
    guard.before_send(object(), sending("long", reserved8, send_pages=1, prompt=1), True)
    ((_, args, _kwargs),) = probes.named("guard_acted")
    assert args[2] == "rejected_send"


# --------------------------------------------------------------------------- the sidecar's side
def test_a_size_guard_record_becomes_a_transfer_size_mismatch_that_names_the_rule(tmp_path):
    prefill, decode = engines(tmp_path)
    prefill.request_begin("r-b", "globex", 21, 30, 0, False)
    prefill.guard_acted(
        "r-b", 21, "send_size", "aborted", prompt_tokens=30, send_tokens=4, reserved_pages=8, reason="w"
    )
    sidecar, findings = run(tmp_path)
    (guarded,) = [f for f in findings if f.evidence.get("source") == "engine_guard"]
    assert (guarded.kind, guarded.reader.rid, guarded.reader.tenant) == ("transfer_size_mismatch", "r-b", "globex")
    assert guarded.evidence["rule"] == "send_size" and guarded.evidence["sent_tokens"] == 4
    assert "4 token(s) of its 30-token prompt sent" in guarded.summary and "8 decode reserved" in guarded.summary
    assert "nothing was exposed" in guarded.summary and guarded.exposed == []
    assert sidecar.pipeline_stats().guard_aborts["transfer_size_mismatch"] == 1
    sidecar.stop()


def test_the_guard_record_becomes_a_finding_saying_what_was_prevented(tmp_path):
    prefill, decode = engines(tmp_path, prefill_pool_tokens=256)
    pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    prefill.request_begin("r-long", "initech", 13, 600, 0, False)
    prefill.rejected("r-long", "admission", "too long")
    prefill.guard_acted(
        "r-long", 13, "rejected_send", "aborted", prompt_tokens=600, send_tokens=1, reserved_pages=150, reason="why"
    )
    sidecar, findings = run(tmp_path)
    (guarded,) = [f for f in findings if f.evidence.get("source") == "engine_guard"]
    assert (guarded.kind, guarded.severity, guarded.engine.role) == ("transfer_size_mismatch", "critical", "prefill")
    assert (guarded.reader.rid, guarded.reader.tenant, guarded.reader.bootstrap_room) == ("r-long", "initech", 13)
    assert guarded.exposed == [] and guarded.pages == []
    assert guarded.evidence == {
        "source": "engine_guard",
        "action": "aborted",
        "rule": "rejected_send",
        "prompt_tokens": 600,
        "sent_tokens": 1,
        "reserved_pages": 150,
        "reason": "why",
    }
    assert "nothing was exposed" in guarded.summary
    stats = sidecar.pipeline_stats()
    assert stats.guard_aborts == {
        "transfer_size_mismatch": 1,
        "foreign_read": 0,
        "use_after_free": 0,
        "checksum_mismatch": 0,
    }
    sidecar.stop()


def test_an_observed_guard_finding_is_not_counted_as_an_abort(tmp_path):
    prefill, _decode = engines(tmp_path)
    prefill.request_begin("r-long", "initech", 13, 600, 0, False)
    prefill.guard_acted(
        "r-long", 13, "rejected_send", "observed", prompt_tokens=600, send_tokens=1, reserved_pages=0, reason="why"
    )
    sidecar, findings = run(tmp_path)
    (guarded,) = [f for f in findings if f.evidence.get("source") == "engine_guard"]
    assert guarded.evidence["action"] == "observed" and guarded.evidence["reserved_pages"] is None
    assert sidecar.pipeline_stats().guard_aborts == {
        "transfer_size_mismatch": 0,
        "foreign_read": 0,
        "use_after_free": 0,
        "checksum_mismatch": 0,
    }
    sidecar.stop()


# --------------------------------------------------------------------------- full: reads
class FINISH_ABORT:  # SGLang's name: the guard finds it in the req's own module
    def __init__(self, message=None, status_code=None, err_type=None):
        self.message, self.status_code, self.err_type = message, status_code, err_type


class Req:
    """SGLang's Req, as far as the read guard uses it."""

    def __init__(self, rid, output_ids=()):
        self.rid = rid
        self.output_ids = list(output_ids)
        self.to_finish = None
        self.finished_reason = None

    def finished(self):
        return self.finished_reason is not None

    def append_and_finish(self, token):  # what process_batch_result does with a sampled token
        self.output_ids.append(token)
        if self.to_finish:
            self.finished_reason, self.to_finish = self.to_finish, None


@pytest.fixture
def full(probes):
    Guard.reset(GuardConfig("full"))
    State.role = "unified"
    return probes


def batch(*reqs):
    return types.SimpleNamespace(reqs=list(reqs))


def test_a_refused_reader_is_aborted_at_its_result_and_streamed_without_the_token(full):
    victim, other = Req("victim", [7, 8]), Req("other", [1])
    # Tier 1, during the forward: the victim's row names a page of request "owner"
    guard.on_read_violation("victim", [tier1.TAG_OTHER, tier1.TAG_OTHER], [41, 42], ["owner", "owner"])
    ((_, args, kwargs),) = full.named("guard_acted")
    assert args == ("victim", -1, "read_foreign", "aborted") and kwargs["reserved_pages"] == 2
    assert "request victim's forward read 2 KV page(s) not its own (of request owner)" in kwargs["reason"]
    # process_batch_result: SGLang's own abort, before the sampled tokens are appended
    guard.before_result(object(), batch(other, victim), object())
    assert isinstance(victim.to_finish, FINISH_ABORT) and other.to_finish is None
    assert (victim.to_finish.status_code, victim.to_finish.err_type) == (500, "KVGuardReadViolation")
    assert victim.to_finish.message == kwargs["reason"]
    for req, token in ((other, 2), (victim, 666)):
        req.append_and_finish(token)
    # stream_output: the token of the refused forward never leaves; the other request's does
    guard.before_stream(object(), [other, victim], False)
    assert victim.output_ids == [7, 8] and victim.finished() and other.output_ids == [1, 2]
    assert Guard.to_cut == {}
    # once per request
    guard.on_read_violation("victim", [tier1.TAG_OTHER], [41], ["owner"])
    assert len(full.named("guard_acted")) == 1 and Guard.to_abort == {}


def test_a_reader_not_yet_finished_keeps_its_cut_until_it_is(full):
    chunked = Req("chunked", [])
    guard.on_read_violation("chunked", [tier1.TAG_FREE], [9], [None])
    assert full.named("guard_acted")[0][1][2] == "read_freed"
    guard.before_result(object(), batch(chunked), object())
    guard.before_stream(object(), [chunked], False)  # a middle chunk: no token, not finished
    assert id(chunked) in Guard.to_cut
    chunked.append_and_finish(666)  # its last chunk's token
    guard.before_stream(object(), [chunked], False)
    assert chunked.output_ids == [] and Guard.to_cut == {}


def test_on_prefill_of_a_pair_the_readers_transfer_is_failed_instead(full, mooncake_module):
    State.role = "prefill"
    mgr = mooncake_module(transfer_infos={7: {"a": Info("10.0.0.2", 9000, np.arange(4))}})
    guard.on_read_violation("r", [tier1.TAG_OTHER], [5], ["owner"])
    assert Guard.to_abort == {} and "r" in Guard.to_fail_send
    guard.before_send(object(), make_req("r", mgr), True)
    assert [c[0] for c in mgr.calls] == ["record_failure", "update_status", "sync"]
    assert "forward read 1 KV page(s) not its own" in mgr.calls[0][2]
    assert len(full.named("guard_acted")) == 1  # said when Tier 1 found it, not again at the send


def test_a_health_check_reader_is_observed_not_aborted(full):
    guard.on_read_violation("HEALTH_CHECK_1", [tier1.TAG_OTHER], [5], ["owner"])
    assert full.named("guard_acted")[0][1][3] == "observed" and Guard.to_abort == {}


@pytest.mark.parametrize("mode", ["off", "transfer"])
def test_below_full_reads_are_not_enforced(full, mode):
    Guard.reset(GuardConfig(mode))
    guard.on_read_violation("victim", [tier1.TAG_OTHER], [5], ["owner"])
    req = Req("victim")
    guard.before_result(object(), batch(req), object())
    assert full.named("guard_acted") == [] and req.to_finish is None


def test_an_internal_error_in_the_read_guard_turns_it_off_unless_fail_closed(full):
    guard.on_read_violation("victim", [tier1.TAG_OTHER], [5], ["owner"])
    guard.before_result(object(), object(), object())  # no .reqs: fail open
    assert not rt.is_enabled(guard.GUARD_READ)
    assert [c[1][0] for c in full.named("report_probe_error")] == ["sglang." + guard.GUARD_READ]
    Guard.reset(GuardConfig("full", "closed"))
    State.reset()
    guard.on_read_violation("victim", [tier1.TAG_OTHER], [5], ["owner"])
    ran = []
    hook = guard.result_hook("Scheduler.process_batch_result")  # as SGLang calls it: the error reaches it
    with pytest.raises(AttributeError):
        hook(lambda *a: ran.append(a), object(), object(), object())
    assert ran == []
    # fail open through the hook: the original still runs once
    Guard.reset(GuardConfig("full", "open"))
    State.reset()
    guard.on_read_violation("victim", [tier1.TAG_OTHER], [5], ["owner"])
    hook(lambda *a: ran.append(a), object(), object(), object())
    assert len(ran) == 1


def test_tier1_hands_the_reader_to_the_guard_on_every_check_that_finds_it():
    import torch

    seen = []
    t = tier1.Tier1(16, 4, on_reader=lambda *a: seen.append(a))
    t.allocated([1, 2])
    t.assigned("owner", 0, 0, [1])
    t.assigned("victim", 0, 0, [2])
    t.bind_row(0, "victim")
    req_to_token = torch.zeros((2, 16), dtype=torch.int32)
    req_to_token[0, :8] = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7])  # page 2, then the owner's page 1
    rows, lens = torch.tensor([0]), torch.tensor([8])
    assert t.check(req_to_token, rows, lens, ["victim"]) == 1
    assert t.check(req_to_token, rows, lens, ["victim"]) == 1  # reported once, handed over each time
    assert seen == [("victim", [tier1.TAG_OTHER], [1], ["owner"])] * 2 and t.reported == 1


def test_the_read_findings_carry_what_the_guard_did(tmp_path):
    _prefill, decode = engines(tmp_path)
    decode.request_begin("owner", "acme", None, 8, 0, False)
    decode.request_begin("victim", "initech", None, 8, 0, False)
    decode.guard_acted(
        "victim", -1, "read_foreign", "aborted", prompt_tokens=0, send_tokens=0, reserved_pages=1, reason="why"
    )
    # Tier 1's record for the same read, after the guard's (engine_hooks/tier1.py hands the reader over first)
    decode._tier1_violation(tier1.Violation("victim", 8, [1], [1], ["owner"], [tier1.TAG_OTHER]), 1)
    sidecar, findings = run(tmp_path)
    (read,) = [f for f in findings if f.kind == "foreign_read"]
    assert read.evidence["action"] == "aborted" and read.evidence["source"] == "engine_tier1"
    assert "the engine's guard failed the request before that forward's token was returned" in read.summary
    assert [p.tenant for p in read.exposed] == ["acme"] and read.reader.rid == "victim"
    assert sidecar.pipeline_stats().guard_aborts == {
        "transfer_size_mismatch": 0,
        "foreign_read": 1,
        "use_after_free": 0,
        "checksum_mismatch": 0,
    }
    sidecar.stop()

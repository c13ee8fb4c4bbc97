"""The guard (KVGUARD_GUARD, engine_hooks/sglang/guard.py) without an engine: its
configuration, its decision in prefill's send_kv_chunk on SGLang-shaped objects, its
failure policy, and the sidecar's finding and metric from its GUARD record. The real
0.5.19 pair is tests/test_guard_engine.py's."""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest
from recording_probes import RecordingProbes
from test_pipeline import engines, pd_request, run

from kvguard.engine_hooks.sglang import _runtime as rt
from kvguard.engine_hooks.sglang import guard
from kvguard.engine_hooks.sglang import hooks_disagg as hd
from kvguard.engine_hooks.sglang._runtime import State
from kvguard.engine_hooks.sglang.guard import Guard, GuardConfig, GuardConfigError


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


def test_full_says_at_start_up_that_it_enforces_the_transfer_invariants_only(caplog):
    with caplog.at_level(logging.WARNING, logger="kvguard.sglang"):
        assert guard.configure({"KVGUARD_GUARD": "full"}).mode == "full"
    assert "not in this build" in caplog.text and Guard.config.transfer


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


# --------------------------------------------------------------------------- the sidecar's side
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
    assert stats.guard_aborts == {"transfer_size_mismatch": 1}
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
    assert sidecar.pipeline_stats().guard_aborts == {"transfer_size_mismatch": 0}
    sidecar.stop()

"""The guard's digest rule without an engine (engine_hooks/sglang/guard_marker.py): the
marker's format, prefill writing it into the metadata row before its last chunk goes
out, decode comparing it in ``_apply_metadata_gate`` (a mismatch becomes a Failed poll
before the ranks agree), what is never compared, the failure policy, and the sidecar's
finding. The real pair is tests/integration/test_digest_engine.py's."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from kvguard.engine_hooks import digest as dg
from kvguard.engine_hooks import probes as probes_mod
from kvguard.engine_hooks.sglang import _runtime as rt
from kvguard.engine_hooks.sglang import guard_marker as gm
from kvguard.engine_hooks.sglang import hooks_disagg as hd
from kvguard.engine_hooks.sglang.guard import Guard, GuardConfig
from kvguard.engine_hooks.wire import marker as wm
from tests.engine_side.test_digest import HEADS, LAYERS, Pool, engine_side, make_kv, reference_streams, req, scattered
from tests.support.recording_probes import RecordingProbes

SUCCESS, FAILED, TRANSFERRING = gm.KVPOLL_SUCCESS, gm.KVPOLL_FAILED, 3


# --------------------------------------------------------------------------- the marker
def a_marker(room=77, digest=0xDEADBEEF_01234567):
    return wm.Marker(room, 0, 40, 0, HEADS, 3, digest)


def test_a_marker_reads_back_for_its_room_only():
    words = wm.pack(a_marker())
    assert words.dtype == np.int32 and len(words) == wm.SLOTS
    assert wm.unpack(words, 77) == a_marker()
    assert wm.unpack(words, 78) is None  # a row reused from another room's transfer
    torn = words.copy()
    torn[5] ^= 1
    assert wm.unpack(torn, 77) is None
    assert wm.unpack(np.zeros(wm.SLOTS, np.int32), 77) is None  # an unguarded prefill
    big = wm.Marker(1 << 40, 3, 9, 7, 1, 2, (1 << 64) - 1)  # rooms are u64, digests u64
    assert wm.unpack(wm.pack(big), 1 << 40) == big


@pytest.mark.parametrize(
    "bad", [wm.Marker(1, 5, 4, 0, 1, 3, 0), wm.Marker(1, 0, 4, 0, 0, 3, 0), wm.Marker(1, 0, 4, 1 << 16, 1, 3, 0)]
)
def test_a_marker_that_does_not_fit_is_refused(bad):
    with pytest.raises(ValueError):
        wm.pack(bad)


# --------------------------------------------------------------------------- prefill -> decode
@pytest.fixture
def probes():
    stub = RecordingProbes()
    probes_mod.reset_probes_for_tests(stub)
    rt.State.reset()
    hd.Digests.reset()
    rt.State.hello_done = True
    Guard.reset(GuardConfig("transfer"))
    yield stub
    Guard.reset()
    probes_mod.reset_probes_for_tests(None)
    rt.State.reset()
    hd.Digests.reset()


class Manager:
    def __init__(self):
        self.failures = []

    def record_failure(self, room, reason):
        self.failures.append((room, reason))


def metadata():
    return types.SimpleNamespace(output_ids=torch.zeros(8, 16, dtype=torch.int32))


class Pair:
    """A prefill and a decode engine side (real pools holding the same KV at different
    slots), the request on each, and decode's transfer queue entry."""

    def __init__(self, tokens=40, seed=21, flip=False):
        kv = make_kv(tokens, seed=seed)
        rng = np.random.default_rng(seed)
        self.p_slots, self.d_slots = scattered(tokens, 256, 4, rng), scattered(tokens, 256, 4, rng)
        self.prefill = engine_side(Pool(kv, self.p_slots, 256, 4), {2: self.p_slots})
        self.prefill.disagg_metadata_buffers = metadata()
        d_pool = Pool(kv, self.d_slots, 256, 4)
        if flip:  # a torn or late write into one received page
            d_pool.k_buffer[1][self.d_slots[9]].view(torch.uint8)[0, 3] ^= 0x10
        self.decode = engine_side(d_pool, {5: self.d_slots})
        self.decode_meta = metadata()
        self.want = reference_streams(kv, 0, tokens)
        self.pr, self.dr = req("r1", 2), req("r1", 5)
        self.pr.origin_input_ids = self.dr.origin_input_ids = [3] * tokens
        self.pr.metadata_buffer_index, self.tokens = 3, tokens
        self.mgr = Manager()
        self.entry = types.SimpleNamespace(
            req=self.dr, metadata_buffer_index=6, kv_receiver=types.SimpleNamespace(kv_mgr=self.mgr)
        )
        self.queue = types.SimpleNamespace(
            scheduler=self.decode, req_to_token_pool=self.decode.req_to_token_pool, queue=[self.entry]
        )

    def send(self, chunks=((16, False), (32, False), (40, True))):
        for end, last in chunks:
            token = hd._send_pre(self.prefill, self.pr, last)
            self.pr.start_send_idx = end
            hd._send_post(token, None, self.prefill, self.pr, last)
        # the transfer: Mooncake copies prefill's metadata row into decode's
        self.decode_meta.output_ids[6] = self.prefill.disagg_metadata_buffers.output_ids[3]

    def reserve(self):
        hd._pre_alloc_post((self.dr, 0, 0, False), torch.as_tensor(self.d_slots), self.queue, self.dr)

    def gate(self, polls):
        gm.gate_hook("utils._apply_metadata_gate")(None, polls, [self.entry], self.decode_meta)
        return polls

    def pop(self, returned: bool):
        before = hd._pop_transferred_pre(self.queue)
        self.queue.queue = []
        hd._pop_transferred_post(before, [self.dr] if returned else [], self.queue)


def digests(probes):
    return {c[1][2]: c[1] for c in probes.named("transfer_digest")}


def test_equal_kv_passes_the_gate_and_each_side_hashes_once(probes):
    pair = Pair()
    pair.reserve()
    pair.send()
    got = wm.unpack(pair.prefill.disagg_metadata_buffers.output_ids[3, 8:].numpy(), 77)
    assert got == wm.Marker(77, 0, 40, 0, HEADS, 3, pair.want)
    assert pair.gate([SUCCESS]) == [SUCCESS]
    assert hd.Digests.verified["r1"] == pair.want
    pair.pop(returned=True)
    d = digests(probes)
    assert d["sender"][3] == d["receiver"][3] == pair.want  # and the sidecar still compares both
    assert len(probes.named("transfer_digest")) == 2 and probes.named("guard_acted") == []
    assert not hd.Digests.verified and not hd.Digests.senders and pair.mgr.failures == []


def test_a_flipped_received_byte_fails_the_transfer_before_the_ranks_agree(probes):
    pair = Pair(flip=True)
    pair.reserve()
    pair.send()
    polls = pair.gate([SUCCESS])
    assert polls == [FAILED]
    ((room, reason),) = pair.mgr.failures  # what SGLang's failure_exception() reports to the client
    assert room == 77 and "differs from what prefill sent" in reason and "before its first decode step" in reason
    ((_, args, kwargs),) = probes.named("guard_acted")
    assert args == ("r1", 77, "digest_mismatch", "aborted")
    assert kwargs["send_tokens"] == 40 and kwargs["reserved_pages"] == 10 and kwargs["prompt_tokens"] == 40
    d = digests(probes)
    assert d["receiver"][3] != d["sender"][3] == pair.want and d["receiver"][4:6] == (0, 40)
    # SGLang then removes it without returning it: a failed transfer, no second receiver digest
    pair.pop(returned=False)
    assert len(probes.named("transfer_digest")) == 2
    assert [c[1][2:] for c in probes.named("transfer_done")] == [("receiver", "failed")]
    # the GUARD record first, so the sidecar's checksum finding knows what the guard did
    order = [c[0] if c[0] != "transfer_digest" else c[1][2] for c in probes.calls]
    assert order.index("guard_acted") < order.index("receiver")


@pytest.mark.parametrize("case", ["guard off", "no marker", "stale marker", "other range", "not landed", "warmup"])
def test_what_the_gate_does_not_compare_it_leaves_alone(probes, case):
    pair = Pair(flip=True)
    pair.reserve()
    if case == "guard off":
        Guard.reset(GuardConfig("off"))
    pair.send()
    row = pair.decode_meta.output_ids[6]
    if case == "no marker":  # an unguarded prefill leaves the padding as it was
        row[8:] = 0
    if case == "stale marker":  # the row's previous transfer, another room
        row[8:] = torch.from_numpy(wm.pack(a_marker(room=12)))
    if case == "other range":  # e.g. decode cached a prefix prefill's marker does not skip
        row[8:] = torch.from_numpy(wm.pack(wm.Marker(77, 8, 40, 0, HEADS, 3, 1)))
    if case == "warmup":
        pair.dr.bootstrap_host = rt.FAKE_BOOTSTRAP_HOST
    polls = pair.gate([TRANSFERRING if case == "not landed" else SUCCESS])
    assert polls[0] in (SUCCESS, TRANSFERRING) and pair.mgr.failures == []
    assert probes.named("guard_acted") == []


def test_an_unguarded_prefill_writes_no_marker_and_clears_none(probes):
    Guard.reset(GuardConfig("off"))
    pair = Pair()
    pair.prefill.disagg_metadata_buffers.output_ids[3, 8:] = 7  # whatever the row held
    pair.send()
    assert pair.prefill.disagg_metadata_buffers.output_ids[3, 8:].tolist() == [7] * 8
    assert digests(probes)["sender"][3] == pair.want  # the observer's digest as before


def test_a_guarded_prefill_clears_a_stale_marker_it_cannot_replace(probes, monkeypatch):
    pair = Pair()
    pair.prefill.disagg_metadata_buffers.output_ids[3, 8:] = torch.from_numpy(wm.pack(a_marker()))
    monkeypatch.setattr(hd, "_setup", lambda sched: None)  # a pool the digest does not support
    pair.send()
    assert wm.unpack(pair.prefill.disagg_metadata_buffers.output_ids[3, 8:].numpy(), 77) is None


def test_an_internal_error_turns_the_digest_rule_off_unless_fail_closed(probes, monkeypatch):
    pair = Pair(flip=True)
    pair.reserve()
    pair.send()
    monkeypatch.setattr(dg, "transfer_digest", lambda *a: (_ for _ in ()).throw(RuntimeError("pool changed")))
    assert pair.gate([SUCCESS]) == [SUCCESS]  # fail open: SGLang's own verdict stands
    assert not rt.is_enabled(gm.GUARD_DIGEST)
    assert [c[1][0] for c in probes.named("report_probe_error")] == ["sglang." + gm.GUARD_DIGEST]
    rt.State.reset()
    rt.State.hello_done = True
    Guard.reset(GuardConfig("transfer", "closed"))
    with pytest.raises(RuntimeError, match="pool changed"):
        pair.gate([SUCCESS])


# --------------------------------------------------------------------------- the sidecar's side
def test_the_checksum_finding_carries_what_decodes_guard_did(tmp_path):
    from tests.sidecar import test_ledger as lt

    prefill, decode = lt.engines(tmp_path)
    lt.begin(prefill, decode, "r-f", 90, 8, [1, 2])
    prefill.transfer_sent("r-f", 90, 0, 8, [50], True)
    prefill.transfer_digest("r-f", 90, "sender", 0x1111, 0, 8, LAYERS, 0, HEADS, HEADS, alg=dg.HEAD_STREAMS)
    decode.guard_acted(
        "r-f", 90, "digest_mismatch", "aborted", prompt_tokens=8, send_tokens=8, reserved_pages=2, reason="why"
    )
    decode.transfer_digest("r-f", 90, "receiver", 0x2222, 0, 8, LAYERS, 0, HEADS, HEADS, alg=dg.HEAD_STREAMS)
    decode.transfer_done("r-f", 90, "receiver", "failed")
    sidecar, sink = lt.run(tmp_path)
    (f,) = [f for f in sink.findings if f.kind == "checksum_mismatch"]
    assert f.evidence["action"] == "aborted" and "before its first decode step" in f.summary
    assert f.reader.rid == "r-f" and f.engine.role == "decode"
    assert sidecar.pipeline_stats().guard_aborts["checksum_mismatch"] == 1
    assert not [x for x in sink.findings if x.evidence.get("source") == "engine_guard"]  # no second finding
    sidecar.stop()

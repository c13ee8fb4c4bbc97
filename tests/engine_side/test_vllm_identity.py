"""The per-page content identity in vLLM's EngineCore (engine_hooks/vllm/identity_hooks.py,
``KVGUARD_PAGE_IDENTITY=1``): the ``hit`` and ``written`` identities of each request's full
blocks, from the step the scheduler returns and the request's own token ids, on the shapes
of vLLM's SchedulerOutput the hooks read."""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest

from kvguard.engine_hooks import probes as probes_mod
from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.vllm import _runtime as rt
from kvguard.engine_hooks.vllm import hooks_core as hc
from kvguard.engine_hooks.vllm import identity_hooks as hid
from kvguard.engine_hooks.vllm import plugin
from tests.support.recording_probes import CaptureWriter

PAGE = 16


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.setenv("KVGUARD_PAGE_IDENTITY", "1")
    cap = CaptureWriter()
    probes_mod.reset_probes_for_tests(Probes(cap, page_size=PAGE))
    rt.State.reset()
    rt.State.page_size, rt.State.hello_done = PAGE, True
    yield cap
    probes_mod.reset_probes_for_tests(None)
    rt.State.reset()


class Request:
    def __init__(self, rid: str, tokens, prompt: int | None = None):
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_prompt_tokens = prompt if prompt is not None else len(self.all_token_ids)
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.cache_salt = None
        self.sampling_params = None
        self.finished = False

    def is_finished(self) -> bool:
        return self.finished

    def get_finished_reason(self):
        return 1


def step(new=(), cached=(), resumed=()):
    """new: (rid, block ids, computed, scheduled); cached: (rid, block ids gained or None,
    computed, scheduled)."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[
            types.SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c) for r, ids, c, _ in new
        ],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[r for r, _, _, _ in cached],
            new_block_ids=[None if ids is None else (ids,) for _, ids, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens={r: n for r, *_, n in (*new, *cached)},
    )


def identities(records) -> list[tuple[str, int, list[int]]]:
    phase = {wire.IdentityPhase.HIT: "hit", wire.IdentityPhase.WRITTEN: "written"}
    return [
        (phase[r.body.phase], int(r.body.first_row_page), r.body.ids.tolist())
        for r in records
        if r.kind == wire.Kind.PAGE_IDENTITY
    ]


def chain(tokens, start: int, stop: int) -> list[int]:
    assert hid.Identity.chain is not None
    return hid.Identity.chain.chain(np.asarray(tokens), 0, stop)[start:].tolist()


def test_a_prefix_hit_reports_the_readers_own_identities_and_its_prefill_the_rest(captured):
    writer = Request("w", range(100, 100 + 3 * PAGE))
    reader = Request("r", [*range(100, 100 + 2 * PAGE), *range(7, 7 + PAGE + 5)])
    sched = types.SimpleNamespace(requests={"w": writer, "r": reader})
    hc.schedule_post(None, step(new=[("w", [1, 2, 3], 0, 3 * PAGE)]), sched)
    assert identities(captured.take()) == [("written", 0, chain(writer.all_token_ids, 0, 3))]
    # two blocks from the prefix cache, its own 21 tokens: one more full block, one partial
    hc.schedule_post(None, step(new=[("r", [1, 2, 4, 5], 2 * PAGE, PAGE + 5)]), sched)
    ids = chain(reader.all_token_ids, 0, 3)
    assert identities(captured.take()) == [("hit", 0, ids[:2]), ("written", 2, ids[2:])]
    assert ids[:2] == chain(writer.all_token_ids, 0, 2)  # the same tokens: the same identities


def test_a_chunked_prefill_continues_its_chain_and_decode_steps_report_nothing(captured):
    request = Request("c", range(3 * PAGE + 4))
    sched = types.SimpleNamespace(requests={"c": request})
    hc.schedule_post(None, step(new=[("c", [1, 2, 3, 4], 0, PAGE)]), sched)  # a first chunk of one block
    ids = chain(request.all_token_ids, 0, 3)
    assert identities(captured.take()) == [("written", 0, ids[:1])]
    assert "c" in rt.State.prefilling
    hc.schedule_post(None, step(cached=[("c", None, PAGE, 2 * PAGE + 4)]), sched)  # the rest
    assert identities(captured.take()) == [("written", 1, ids[1:3])]
    del rt.State.prefilling["c"]  # its first token came (update_from_output)
    request.all_token_ids.append(9)
    hc.schedule_post(None, step(cached=[("c", None, 3 * PAGE + 4, 1)]), sched)  # decoding
    assert identities(captured.take()) == []


def test_a_finished_request_reports_the_blocks_its_decode_completed(captured):
    request = Request("d", range(PAGE + 8))
    sched = types.SimpleNamespace(requests={"d": request})
    hc.schedule_post(None, step(new=[("d", [1, 2], 0, PAGE + 8)]), sched)
    captured.take()
    rt.State.prefilling.pop("d", None)
    request.all_token_ids += list(range(500, 500 + PAGE))  # decoded into the third block
    request.num_computed_tokens, request.finished = 2 * PAGE + 7, True
    hc.free_request_pre(sched, request)
    assert identities(captured.take()) == [("written", 1, chain(request.all_token_ids, 1, 2))]
    assert "d" not in hid.Identity.tips


def test_a_request_resumed_after_a_preemption_reports_its_new_row_from_the_start(captured):
    request = Request("p", range(2 * PAGE + 3))
    sched = types.SimpleNamespace(requests={"p": request})
    hc.schedule_post(None, step(new=[("p", [1, 2, 3], 0, 2 * PAGE + 3)]), sched)
    captured.take()
    # preempted, then resumed with its first block still cached: a new row
    hc.schedule_post(None, step(cached=[("p", [6, 7, 8], PAGE, PAGE + 3)], resumed=["p"]), sched)
    ids = chain(request.all_token_ids, 0, 2)
    assert identities(captured.take()) == [("hit", 0, ids[:1]), ("written", 1, ids[1:])]


def test_identities_are_off_by_default_and_a_bad_value_installs_no_hooks(captured, monkeypatch, caplog):
    monkeypatch.delenv("KVGUARD_PAGE_IDENTITY")
    rt.State.reset()
    rt.State.page_size, rt.State.hello_done = PAGE, True
    sched = types.SimpleNamespace(requests={"w": Request("w", range(2 * PAGE))})
    hc.schedule_post(None, step(new=[("w", [1, 2], 0, 2 * PAGE)]), sched)
    assert identities(captured.take()) == [] and hid.Identity.state == "off"
    monkeypatch.setenv("KVGUARD_PAGE_IDENTITY", "maybe")
    monkeypatch.setattr(plugin, "install", lambda version: pytest.fail("hooks installed with a bad value"))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0+cpu"))
    with caplog.at_level(logging.WARNING, logger="kvguard.vllm"):
        plugin.load()
    assert "KVGUARD_PAGE_IDENTITY='maybe'" in caplog.text


def test_a_decode_step_looks_at_no_request(captured):
    """Nothing prefilling, nothing resumed: the hook returns before looking at the batch (its
    cost per decode step is one check, not a pass over the batch)."""

    class Untouchable(dict):
        def get(self, *a, **k):
            raise AssertionError("a decode step looked a request up")

    sched = types.SimpleNamespace(requests=Untouchable())
    rids = [f"d{i}" for i in range(256)]
    for rid in rids:
        rt.State.rows[rid] = 1
    hc.schedule_post(None, step(cached=[(rid, None, 40, 1) for rid in rids]), sched)
    assert identities(captured.take()) == [] and hid.Identity.state == "on"


def test_an_engine_of_several_groups_says_it_reports_no_identities(captured, caplog):
    rt.State.group_rows = [{}, {}]
    sched = types.SimpleNamespace(requests={"w": Request("w", range(2 * PAGE))})
    with caplog.at_level(logging.WARNING, logger="kvguard.vllm"):
        hid.guarded(hid.scheduled, sched, step(new=[("w", [1, 2], 0, 2 * PAGE)]))
    assert identities(captured.take()) == [] and hid.Identity.state == "off"
    assert "no page content identity is reported: an engine of 2 KV cache groups" in caplog.text

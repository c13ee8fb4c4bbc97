"""The per-page content identity (engine_hooks/page_identity.py) in vLLM's EngineCore: what
a request's full blocks hold, reported when it is handed blocks it did not compute, fills
blocks, and finishes. Off unless ``KVGUARD_PAGE_IDENTITY=1`` (a bad value stops the plugin
from installing, plugin.py).

* ``Scheduler.schedule`` (hooks_core.py ``schedule_post``, after the step's ASSIGNs): a
  request scheduled for the first time (or resumed after a preemption, with a new row)
  reports ``hit`` for the blocks ``[0, num_computed_tokens // B)`` it was handed (the prefix
  cache's, and a KV connector's loads: the sidecar gives a loaded block the identity of the
  stored object it came from, sidecar/offload.py) and ``written`` for the full blocks this
  step's prefill fills; a request still prefilling (a later chunk) continues its chain
  with the blocks its chunk fills. Decode steps report nothing (one check per prefilling
  request per step, none per decoding one).
* ``Scheduler._free_request`` (``free_request_pre``, before REQ_END) of a finished request:
  ``written`` for the full blocks its decode completed (vLLM caches them as they fill, so a
  hit on one before its writer finished is not judged: no identity recorded yet).

The chain is over the request's own token ids (``Request.all_token_ids``), not vLLM's block
hashes: an identity computed by the same code that keys the prefix cache would agree with a
wrong key. Per request only the chain's tip is kept (the blocks hashed and the last id).
Engines with several KV cache groups report none (their pools are the groups'; not
verified). A failure switches the identity off for the process (logged once, reported as a
probe error); it never reaches the engine.
"""

from __future__ import annotations

import logging

from .. import page_identity as pid
from . import _runtime as rt
from ._runtime import State

log = logging.getLogger("kvguard.vllm")


Identity = pid.Switch(rt.Bounded())


def active() -> pid.PageIdentity | None:
    """The engine's identity chain (None when off; never for an engine of several groups)."""
    refused = f"an engine of {len(State.group_rows)} KV cache groups (one group only)" if State.group_rows else ""
    return Identity.active(State.hello_done, State.page_size, log, "block", refused=refused)


def guarded(fn, *args) -> None:
    Identity.guarded(rt.probes, fn, *args)


def _tokens(request, n: int):
    return pid.token_array(list(request.all_token_ids[:n]), None, n)


def _first(p, chain: pid.PageIdentity, request, rid: str, handed: int, stop: int) -> None:
    """A row's first report: ``hit`` for its first ``handed`` blocks, ``written`` for the rest
    up to ``stop`` (the full blocks this step fills)."""
    stop = max(stop, handed)
    ids = chain.chain(_tokens(request, stop * chain.page_size), 0, stop)
    if handed:
        p.page_identity(rid, 0, "hit", ids[:handed])
    if stop > handed:
        p.page_identity(rid, handed, "written", ids[handed:])
    Identity.tips[rid] = (stop, int(ids[-1]) if len(ids) else 0)


def _continued(p, chain: pid.PageIdentity, request, rid: str, stop: int) -> None:
    """``written`` for the full blocks ``[tip, stop)`` of a request whose chain is kept."""
    tip = Identity.tips.get(rid)
    if tip is None or stop <= tip[0]:
        return
    ids = chain.chain(_tokens(request, stop * chain.page_size), tip[0], stop, tip[1])
    p.page_identity(rid, tip[0], "written", ids)
    Identity.tips[rid] = (stop, int(ids[-1]))


def scheduled(sched, out) -> None:
    """After ``schedule_post``'s ASSIGNs: the hits and the blocks this step's prefills fill."""
    chain = active()
    if chain is None:
        return
    p = rt.probes()
    ps = chain.page_size
    planned = out.num_scheduled_tokens
    requests = sched.requests
    for new in out.scheduled_new_reqs:
        request = requests.get(new.req_id)
        if request is None:
            continue
        computed = int(new.num_computed_tokens)
        stop = min(computed + int(planned.get(new.req_id, 0)), len(request.all_token_ids)) // ps
        _first(p, chain, request, new.req_id, computed // ps, stop)
    cached = out.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    if not State.prefilling and not resumed:
        return  # a decode step: nothing (its requests' blocks are reported when they finish)
    req_ids = cached.req_ids
    # the few requests still prefilling or resumed, found by a C-level search of the batch
    # (not a Python pass over every decoding request: that would be a cost per decode step)
    for rid in dict.fromkeys([*resumed, *State.prefilling]):
        try:
            i = req_ids.index(rid)
        except ValueError:
            continue  # (not scheduled this step, or new: reported above)
        computed = cached.num_computed_tokens[i]
        request = requests.get(rid)
        if request is None:
            continue
        stop = min(int(computed) + int(planned.get(rid, 0)), len(request.all_token_ids)) // ps
        if rid in resumed:  # a new row after a preemption: its cached blocks handed back
            _first(p, chain, request, rid, int(computed) // ps, stop)
        else:
            _continued(p, chain, request, rid, stop)


def finished(request) -> None:
    """``_free_request`` of a request (before its REQ_END): a finished one's blocks completed
    during decode; either way its chain is dropped."""
    rid = request.request_id
    chain = active()
    if chain is None or rid not in Identity.tips:
        return
    if request.is_finished():
        _continued(rt.probes(), chain, request, rid, int(request.num_computed_tokens) // chain.page_size)
    Identity.tips.pop(rid, None)

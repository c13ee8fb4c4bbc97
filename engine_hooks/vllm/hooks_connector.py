"""The EngineCore's side of a KV connector: KV loaded into blocks from outside the engine
(a prefill instance, LMCache, an offload tier, shared storage) and, for connectors whose
stores we can attribute, KV stored out of it. The records are the host / storage tier's
(``KV_LOAD`` issued / completed / failed, ``KV_STORE``), judged by sidecar/offload.py.

Why it matters: with a connector, a request's row starts with blocks that no forward of
this engine writes: the connector does, before the first forward (a synchronous load) or
in the background (``load_kv_async``: the request waits in ``WAITING_FOR_REMOTE_KVS``).
Without these records the sidecar cannot credit those blocks as written, and a load that
lands after its blocks were freed and handed to another request (vLLM PR #32255, #52234:
the bug family of issue 17) would be invisible.

Connector-agnostic, through the scheduler's calls into whatever connector is configured
(the instance's methods are wrapped once, in ``Scheduler.__init__``):

* ``get_num_new_matched_tokens(request, num_computed_tokens) -> (external, is_async)``:
  the local prefix hit (its argument) and the tokens the connector will load;
* ``update_state_after_alloc(request, blocks, external)``: the blocks exist now; the load
  is issued into the blocks covering tokens ``[local, local + external)``;
* completion: a synchronous load lands before the forward of the step that schedules the
  request (announced in ``Scheduler.schedule``'s hook, after the row); an asynchronous one
  when the worker reports it in ``finished_recving`` (``_update_from_kv_xfer_finished``),
  failed when one of its blocks is in ``invalid_block_ids``.

The object key of a load is what the connector keys the KV by, where we know it
(:data:`STORE_AWARE`), else vLLM's own block hash of the last loaded block (the chained
prefix hash; salted with the request's ``cache_salt``). Stores are reported only for
connectors in :data:`STORE_AWARE`: a store reported that did not happen would make the
sidecar compare later loads against the wrong object. A load of an object the sidecar did
not see stored is counted unverified
(``kvguard_kv_tier_unverified_total{reason="load_of_unknown_object"}``), never guessed.
"""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from . import _runtime as rt
from . import hooks_transfer as htx
from ._runtime import State

log = logging.getLogger("kvguard.vllm")

OBJECT_KEY_SEED = 0x6B76675F6F626A6B  # "kvg_objk": keys leave the engine as keyed hashes only
# connectors whose object identity and stores this module understands: the reference
# connector (ExampleConnector in 0.30-0.32; SharedStorageConnector in older releases)
STORE_AWARE = ("ExampleConnector", "SharedStorageConnector")
MAX_PENDING_STEPS = 16  # steps scheduled whose output has not come back (async scheduling: 2)


def _hash_key(raw: bytes) -> int:
    return xxhash.xxh64_intdigest(raw, seed=OBJECT_KEY_SEED) or 1


# --------------------------------------------------------------------------- install
def attach(scheduler) -> None:
    """Wrap the scheduler's connector instance (``Scheduler.__init__``'s hook). Nothing
    happens without a connector; a connector of several groups is not modelled (as HELLO)."""
    connector = getattr(scheduler, "connector", None)
    if connector is None or getattr(connector, "__kvguard_wrapped__", False):
        return
    name = type(connector).__name__
    State.pd_connector = htx.is_pd_connector(connector)
    # (a subclass too: its stores are checked against the metadata it builds, step by step)
    State.connector_store_aware = any(c.__name__ in STORE_AWARE for c in type(connector).__mro__)
    rt.wrap_instance(connector, "get_num_new_matched_tokens", post=_matched_post)
    rt.wrap_instance(connector, "update_state_after_alloc", post=_after_alloc_post)
    if State.connector_store_aware:
        rt.wrap_instance(connector, "build_connector_meta", pre=_build_meta_pre, post=_build_meta_post)
    connector.__kvguard_wrapped__ = True
    log.info(
        "kvguard: vLLM KV connector %s: loads reported%s",
        name,
        " and stores" if State.connector_store_aware else " (its stores are not attributed: loads count unverified)",
    )


# --------------------------------------------------------------------------- object keys
def folder_key(connector, token_tensor, mm_hashes) -> int:
    """The reference connector's folder for these tokens (its own code names it), hashed."""
    folder = connector._generate_foldername_debug(token_tensor, mm_hashes, create_folder=False)
    return _hash_key(str(folder).rsplit("/", 1)[-1].encode())


def _example_key(connector, token_ids, mm_hashes) -> int:
    """The object a prompt's KV is stored as: the tokens it keys by are the prompt's first
    ``align_to_block_size(len(prompt))`` (its ReqMeta's ``token_ids``)."""
    import torch

    block = connector._block_size
    n = (len(token_ids) - 1) // block * block  # example_connector.align_to_block_size(len(prompt))
    return folder_key(connector, torch.tensor(token_ids)[:n], mm_hashes)


def _mm_hashes(request) -> list:
    return [f.identifier for f in (getattr(request, "mm_features", None) or [])]


def _load_key(connector, request, end_tokens: int) -> int:
    if State.connector_store_aware:
        return _example_key(connector, list(request.prompt_token_ids or []), _mm_hashes(request))
    hashes = getattr(request, "block_hashes", None) or []
    i = min(end_tokens // State.page_size, len(hashes)) - 1
    if i < 0:
        return _hash_key(request.request_id.encode())
    return _hash_key(bytes(hashes[i]))


# --------------------------------------------------------------------------- loads
def _matched_post(_token, result, connector, request, num_computed_tokens, *args, **kwargs) -> None:
    external, is_async = result
    if external:  # None: the connector cannot tell yet (it is asked again next step)
        # (a prefill/decode pull is a transfer, not a load: told now, before the connector clears its flag)
        room = htx.room_of(request) if htx.wants_remote_prefill(request) else None
        State.matched[request.request_id] = (int(num_computed_tokens), int(external), bool(is_async), room)
    else:
        State.matched.pop(request.request_id, None)


def _after_alloc_post(_token, _result, connector, request, blocks, num_external_tokens, *args, **kwargs) -> None:
    rid = request.request_id
    matched = State.matched.pop(rid, None)
    if not State.hello_done or not num_external_tokens or matched is None:
        return
    local, _, is_async, room = matched
    ps = State.page_size
    external = int(num_external_tokens)
    ids = blocks.get_block_ids()[0]
    pages = np.asarray(ids[local // ps : -(-(local + external) // ps)], np.int64)
    if len(pages) == 0:
        return
    p = rt.probes()
    salt = getattr(request, "cache_salt", None)
    if rid not in State.begun:  # announced now: the load's pages are the request's before it is scheduled
        State.begun[rid] = True
        p.request_begin(
            rid,
            rt.tenant_of(request),
            room,
            int(getattr(request, "num_prompt_tokens", 0) or 0),
            local + external,
            False,
            cache_salt=salt,
        )
    State.local_hit[rid] = local
    if room is not None:
        htx.reserve(rid, room, ids, pages, local, external)
        return
    key = _load_key(connector, request, local + external)
    p.kv_loaded(rid, key, pages, "issued", cache_salt=salt)
    State.loads[rid] = (key, pages, salt, is_async)


def loads_landed_in_schedule(out) -> None:
    """``Scheduler.schedule``'s hook, after the rows: a synchronous load lands in the forward
    this step runs (before attention reads it), for a new request or one resumed after a
    preemption."""
    if not State.loads:
        return
    p = rt.probes()
    cached = out.scheduled_cached_reqs
    for rid in [new.req_id for new in out.scheduled_new_reqs] + [
        r for r in cached.req_ids if r in cached.resumed_req_ids
    ]:
        load = State.loads.get(rid)
        if load is not None and not load[3]:
            del State.loads[rid]
            key, pages, salt, _ = load
            p.kv_loaded(rid, key, pages, "completed", cache_salt=salt)


def shared_until(rid: str, computed: int) -> int:
    """Where ``rid``'s prefix-cache hit ends in the row it is first scheduled with: the tokens
    a connector loaded for it are its own (written by the load), not shared."""
    local = State.local_hit.pop(rid, None)
    return computed if local is None else min(local, computed)


def xfer_finished_pre(self, kv_connector_output, *args, **kwargs) -> None:
    """``Scheduler._update_from_kv_xfer_finished``: the worker finished these async loads,
    pulls (decode) and sends (prefill)."""
    if State.sending:
        for rid in getattr(kv_connector_output, "finished_sending", None) or ():
            htx.sent(rid)
    recving = getattr(kv_connector_output, "finished_recving", None)
    if not recving or not (State.loads or State.receiving):
        return
    invalid = getattr(kv_connector_output, "invalid_block_ids", None) or set()
    p = rt.probes()
    for rid in recving:
        if State.receiving:
            htx.received(rid, invalid)
        load = State.loads.pop(rid, None)
        if load is None:
            continue
        key, pages, salt, _ = load
        failed = bool(invalid) and any(int(b) in invalid for b in pages.tolist())
        p.kv_loaded(rid, key, pages, "failed" if failed else "completed", cache_salt=salt)


def forget(rid: str) -> None:
    """The request ended: a load still pending for it is the engine's to finish (or never)."""
    State.matched.pop(rid, None)
    State.local_hit.pop(rid, None)


# --------------------------------------------------------------------------- stores
def _build_meta_pre(connector, scheduler_output, *args, **kwargs):
    """Which new requests the reference connector will store (its own rule, evaluated before
    it runs: a new request not loading whose prompt has no folder yet)."""
    loading = set(getattr(connector, "_requests_need_load", {}) or ())
    requests = getattr(State.scheduler, "requests", {})
    stores = []
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id in loading:
            continue
        tokens = list(new.prompt_token_ids or [])
        mm = _mm_hashes(new)
        if not connector._found_match_for_prompt(tokens, mm):
            # the salt now: a request that ends in this step (one output token) has left the
            # scheduler by the time the store is reported
            request = requests.get(new.req_id)
            salt = getattr(request, "cache_salt", None) if request is not None else None
            stores.append((new.req_id, tokens, mm, list(new.block_ids[0]), salt))
    return stores


def _build_meta_post(stores, meta, connector, scheduler_output, *args, **kwargs) -> None:
    """The stores go out once the step's forward ran (``stores_landed``): the connector
    saves each layer's KV as the forward writes it, so before that the pages hold nothing."""
    if not State.hello_done:
        return
    made = sum(1 for r in getattr(meta, "requests", ()) if getattr(r, "is_store", False))
    if made != len(stores):  # its folder check and ours disagreed (a file came or went between)
        if made and not State.stores_unattributed:
            log.warning(
                "kvguard: %s stored KV that kvguard could not attribute to a request (counted, not "
                "reported: loads of it count unverified)",
                type(connector).__name__,
            )
        State.stores_unattributed += made
    elif stores:
        pending = State.pending_stores
        pending[id(scheduler_output)] = stores
        while len(pending) > MAX_PENDING_STEPS:  # steps whose output never came (an engine error)
            pending.pop(next(iter(pending)))


def stores_landed(scheduler_output) -> None:
    """``Scheduler.update_from_output``: the forward of ``scheduler_output``'s step is done,
    and with it the reference connector's saves."""
    stores = State.pending_stores.pop(id(scheduler_output), None)
    if not stores:
        return
    p = rt.probes()
    ps = State.page_size
    for rid, tokens, mm, ids, salt in stores:
        n = (len(tokens) - 1) // ps * ps  # what it saved: align_to_block_size(len(prompt))
        if n <= 0:
            continue
        p.kv_stored(
            rid, _example_key(connector_of(), tokens, mm), np.asarray(ids[: n // ps], np.int64), cache_salt=salt
        )


def connector_of():
    return getattr(State.scheduler, "connector", None)

"""Scheduler and request lifecycle hooks: hello / request_begin / request_end / rejected.

* ``Scheduler.__init__`` (AFTER): pools, tree cache and disaggregation exist ->
  HELLO. Nothing is emitted before it.
* REQ_BEGIN is emitted lazily, once per rid, before the first record that names the
  request: its first row assignment (``alloc_for_extend``: ``cached_tokens`` is the
  radix-cache prefix length it matched; decode ``_pre_alloc``), or its rejection.
  ``prompt_tokens`` is ``len(req.origin_input_ids)``; for a rejected request it is
  taken *before* ``set_finish_with_abort`` replaces the prompt with a 1-token
  placeholder.
* ``Req.set_finish_with_abort`` and ``disaggregation.utils.prepare_abort`` -> REJECT,
  phase from the calling engine code.
* ``release_kv_cache(req, tree_cache, ...)`` (AFTER; 0.5.19 ``is_insert=``, 0.5.23
  ``checkpoint=``: only ``req`` is read) -> REQ_END when ``req.finished()``, preceded by the
  PAGE_IDENTITY of the pages its decode completed when ``KVGUARD_PAGE_IDENTITY`` is on
  (identity_hooks.py).
  Retraction also releases KV but the request is not finished: no REQ_END then.
"""

from __future__ import annotations

import time

from .. import coverage as cv
from . import _runtime as rt
from . import coverage as cv_sglang
from . import hooks_state as state_slots
from . import hooks_swa as swa
from . import identity_hooks
from ._runtime import State

# --------------------------------------------------------------------------- hello
_ROLE = {"null": "unified", "prefill": "prefill", "decode": "decode"}


def _scheduler_role(sched) -> str:
    mode = getattr(sched, "disaggregation_mode", None)
    value = getattr(mode, "value", None) or getattr(sched.server_args, "disaggregation_mode", None) or "null"
    return _ROLE.get(str(value).lower(), "unified")


def _tp_rank(sched) -> int:
    """The HELLO's rank: the scheduler's TP rank, and with pipeline parallelism its rank across
    the stages (``pp_rank * tp_size + tp_rank``, as SGLang numbers its scheduler processes): the
    rank a transfer's lane pairs by, so that prefill stage s sends to decode stage s
    (sidecar/ledger/lanes.py)."""
    rank = cv_sglang.scheduler_rank(sched, "tp_rank")
    if cv_sglang.pp_size(sched) > 1:
        tp_size = int(getattr(sched.server_args, "tp_size", 1) or 1)
        return cv_sglang.pp_rank(sched) * tp_size + rank
    return rank


def _full_allocator(alloc):
    """The allocator of pool 0's pages: a hybrid sliding-window allocator's full half (its own
    ``size`` is the smaller of its two halves')."""
    if type(alloc).__name__ in cv_sglang.SWA_ALLOCATORS:
        return getattr(alloc, "full_attn_allocator", alloc)
    return alloc


def _scheduler_init_post(result, sched, *args, **kwargs):
    alloc = sched.token_to_kv_pool_allocator
    page_size = int(getattr(alloc, "page_size", None) or sched.page_size)
    pool_tokens = int(sched.max_total_num_tokens)
    State.page_size = page_size
    State.role = _scheduler_role(sched)
    get_kvcache = getattr(alloc, "get_kvcache", None)
    State.kv_pool = get_kvcache() if callable(get_kvcache) else None
    rt.probes().hello(
        role=State.role,
        tp_rank=_tp_rank(sched),
        page_size=page_size,
        pool_pages=int(getattr(_full_allocator(alloc), "size", pool_tokens)) // page_size,
        pool_tokens=pool_tokens,
        context_len=int(sched.model_config.context_len),
        max_req_input_len=int(getattr(sched, "max_req_input_len", 0) or 0),
        engine_name="sglang",
        engine_version=State.engine_version,
        model=str(getattr(sched.server_args, "model_path", "") or ""),
    )
    # what the engine holds and what of it is watched (contract 1.5); a part whose pages
    # cannot be followed leaves the whole engine unwatched rather than half seen
    try:
        items = cv_sglang.inspect(sched, State.engine_version, State.role)
    except Exception as exc:  # noqa: BLE001 - an engine we cannot read: said, and nothing else sent
        items = [cv.unwatched("engine", f"kvguard could not inspect the scheduler: {type(exc).__name__}: {exc}")]
    rt.probes().coverage(items)
    for line in cv.log_lines(items):
        rt.log.info(line)
    if not cv.ownership_followed(items):
        rt.log.warning(
            "kvguard: this SGLang engine holds KV kvguard cannot follow (%s): it reports no page records, "
            "only that it is unwatched (a coverage_gap finding in the sidecar)",
            "; ".join(i.component for i in items if not i.watched & cv.OWNERSHIP),
        )
        return
    _declare_pools(sched, items)
    State.hello_done = True


def _followed(items, component: str) -> bool:
    item = next((i for i in items if i.component == component), None)
    return item is not None and bool(item.watched & cv.OWNERSHIP)


def _declare_pools(sched, items) -> None:
    """The pools besides pool 0 that coverage.py found followable, each declared as a pool of
    its own after HELLO and COVERAGE and before any record names it: a hybrid sliding-window
    engine's SWA pool (hooks_swa.py), a hybrid linear-attention engine's state slots (one token
    per page: a page is a slot; hooks_state.py)."""
    p = rt.probes()
    index = 1
    if _followed(items, "swa_pool"):
        alloc = sched.token_to_kv_pool_allocator
        swa_alloc = alloc.swa_attn_allocator
        window = int(sched.sliding_window_size)
        State.alloc_pool = {id(swa_alloc): index}
        State.alloc_refs = (alloc, swa_alloc)  # (their ids stay theirs while the map holds them)
        mapping = alloc.full_to_swa_index_mapping
        State.swa_pool, State.swa_mapping, State.swa_window = index, mapping, window
        on_host = getattr(getattr(mapping, "device", None), "type", None) == "cpu"
        State.swa_mapping_host = mapping.numpy() if on_host else None  # a view: the engine's updates show
        name = f"SWA KV ({cv_sglang.describe_pool(alloc.get_kvcache().swa_kv_pool)}), window {window}"
        p.pool_declared(index, State.page_size, int(swa_alloc.size) // State.page_size, "sliding_window", name, window)
        index += 1
    if _followed(items, "state_pool"):
        rtt = sched.req_to_token_pool
        State.state_pool, State.state_allocator = index, rtt.mamba_allocator
        p.pool_declared(index, 1, int(rtt.mamba_allocator.size), "state", cv_sglang.describe_state(rtt))


def scheduler_init_hook(name: str):
    return rt.after(name, _scheduler_init_post)


# --------------------------------------------------------------------------- reject
_ADMISSION_FUNCS = {
    "handle_generate_request",
    "_handle_generate_request",
    "_add_request_to_queue",
    "init_req_max_new_tokens",
    "_abort_on_queued_limit",
    "validate_input_length",
    "add",
    "_process_req",
}


# Scheduler functions that abort on a client's (or operator's) AbortReq: SGLang
# tears requests down with the same set_finish_with_abort / prepare_abort it uses
# to refuse them, so only the caller tells an abort from a refusal.
_CLIENT_ABORT_FUNCS = {"abort_request", "process_pending_chunked_abort"}


def reject_phase(frames) -> str:
    """Where in the engine a request was failed, from its calling frames."""
    frames = list(frames)
    if any(func in _CLIENT_ABORT_FUNCS for _f, func in frames):
        return "client_abort"
    for filename, func in frames:
        path = filename.replace("\\", "/")
        if "/disaggregation/" in path:
            if any(s in func for s in ("transfer", "bootstrap", "poll", "inflight", "commit")):
                return "transfer"
            if path.endswith("/prefill.py") and func in _ADMISSION_FUNCS:
                return "admission"
            if path.endswith("/decode.py") and func in _ADMISSION_FUNCS:
                return "admission"
            if "prefill" in path:
                return "prefill"
            if "decode" in path:
                return "decode"
        if func in _ADMISSION_FUNCS:
            return "admission"
        if "decode" in func or "retract" in func:
            return "decode"
        if "prefill" in func or "extend" in func:
            return "prefill"
    return "admission"


def _set_finish_with_abort_pre(req, *args, **kwargs):
    if not State.hello_done:
        return None
    prompt_tokens = len(req.origin_input_ids)  # before the placeholder replaces the prompt
    rt.ensure_begun(req, cached_tokens=0, prompt_tokens=prompt_tokens)
    return prompt_tokens


def _set_finish_with_abort_post(token, result, req, *args, **kwargs):
    if token is None:
        return
    error_msg = args[0] if args else kwargs.get("error_msg", "")
    phase = reject_phase(rt.caller_frames())
    if phase != "client_abort":  # a client abort ends as "abort", not "reject"
        if req.rid not in State.rejected:  # the first rejection's prompt length, not a later placeholder's
            State.rejected[req.rid] = token
    rt.probes().rejected(req.rid, phase, str(error_msg))


def set_finish_with_abort_hook(name: str):
    return rt.around(name, _set_finish_with_abort_pre, _set_finish_with_abort_post)


def _prepare_abort_post(result, req, *args, **kwargs):
    if not State.hello_done:
        return
    error_message = args[0] if args else kwargs.get("error_message", "")
    rt.ensure_begun(req)
    phase = reject_phase(rt.caller_frames())
    if phase != "client_abort":
        if req.rid not in State.rejected:
            State.rejected[req.rid] = len(req.origin_input_ids)
    rt.probes().rejected(req.rid, phase, str(error_message))


def prepare_abort_hook(name: str):
    return rt.after(name, _prepare_abort_post)


# --------------------------------------------------------------------------- release / end
def _finish_of(req) -> tuple[str, str]:
    reason = req.finished_reason
    try:
        info = reason.to_json() or {}
    except Exception:  # noqa: BLE001
        info = {}
    kind = str(info.get("type", "unknown"))
    message = info.get("message") or ""
    if kind == "abort" and req.rid in State.rejected:
        kind = "reject"
    if kind not in ("stop", "length", "abort", "reject"):
        kind = "unknown"
    return kind, str(message)


def _timings_ns(req) -> tuple[int, int]:
    ts = getattr(req, "time_stats", None)
    if ts is None:
        return 0, 0
    t0 = getattr(ts, "scheduler_recv_time", 0.0) or getattr(ts, "wait_queue_entry_time", 0.0) or 0.0
    first = getattr(ts, "prefill_finished_time", 0.0) or 0.0
    if not first and State.role == "decode":
        first = getattr(ts, "decode_prebuilt_finish_time", 0.0) or 0.0
    # TTFT as kvguard reports it is the prefill's own time: from the request's first
    # forward batch to its first token. Measured from arrival it also held queueing
    # and (PD prefill) the bootstrap handshake, which made requests that happened not
    # to wait look implausibly fast next to ones that did (a false ttft_anomaly on the
    # PD soak). A request that got a first token without ever entering a forward
    # batch keeps the arrival time as its start: its TTFT is then tiny, as it should be.
    started = getattr(ts, "forward_entry_time", 0.0) or t0
    ttft = int((first - started) * 1e9) if started and first and first >= started else 0
    e2e = int((time.perf_counter() - t0) * 1e9) if t0 else 0
    return ttft, e2e


# rids whose KV was released while they were unfinished: an optimistic PD prefill
# retry (0.5.23 ``optimistic_release_and_requeue``) or a retraction. They are
# prefilled again, partly from the prefix cache they filled themselves, so their TTFT
# says nothing about prefill speed (REQ_END flag ``reprefilled``). Bounded: entries
# leave at REQ_END; the oldest go first past the cap (a flag lost, never a record).
_reprefilled: dict[str, bool] = {}
_REPREFILLED_CAP = 65536


def _release_post(result, req, *args, **kwargs):
    if not State.hello_done or req.rid in State.ended:
        return
    if not req.finished():
        identity_hooks.Identity.tips.pop(req.rid, None)  # retracted: prefilled again as new
        if len(_reprefilled) >= _REPREFILLED_CAP:
            _reprefilled.pop(next(iter(_reprefilled)))
        _reprefilled[req.rid] = True
        return
    rt.ensure_begun(req)
    # the identities of the pages its decode completed, before REQ_END drops its row in the sidecar
    identity_hooks.guarded(identity_hooks.released, req)
    kind, reason = _finish_of(req)
    ttft, e2e = _timings_ns(req)
    State.ended[req.rid] = True
    rt.probes().request_end(
        req.rid, kind, ttft, e2e, len(req.output_ids), reason, reprefilled=_reprefilled.pop(req.rid, False)
    )
    State.begun.pop(req.rid, None)
    State.rejected.pop(req.rid, None)
    if State.state_pool:
        state_slots.forget(req.rid)
    if State.swa_pool:
        swa.forget(req.rid)


def release_kv_cache_hook(name: str):
    return rt.after(name, _release_post)

"""The guard (``KVGUARD_GUARD``): fail the one request that would hand foreign KV to a
client, inside the engine, before its tokens leave (docs/guard.md).

Modes:

* ``off`` (default): observe only.
* ``transfer``: invariants at the prefill/decode boundary, checked once per request.
  Enforced today: a request the engine rejected (admission, prefill) never has its KV
  sent as if it were done. That is SGLang 0.5.19's incident path: the over-long prompt
  is replaced by a 1-token placeholder, still bootstrapped, and its one page sent as a
  successful transfer into the 150 pages decode reserved; decode's attention then reads
  the other 149, still holding other tenants' KV. And, for every other request, the
  pages prefill's sender will send are the pages decode reserved (``send_size``), judged
  before its first chunk leaves. On decode, the received KV must match the digest
  prefill's guard carried in the transfer's metadata row (``digest_mismatch``,
  engine_hooks/sglang/guard_marker.py), checked before the first decode step.
* ``full``: ``transfer`` plus enforcing the engine's own read check (Tier 1,
  engine_hooks/tier1.py, turned on by this mode): a request whose forward reads a row
  page of another live request, one handed out but in no row, or a freed page, is
  finished with an error before that forward's token reaches the client (below). Not
  enforced in the engine: a reserved page of the reader's own that nothing wrote (the
  sidecar reports it as ``unwritten_read``; on prefill/decode the transfer rule above
  is what stops the incident's case).

How a reader is failed (``full``): Tier 1 hands each violating reader to
:func:`on_read_violation` during the forward (inline on CPU; on a GPU where the
scheduler waits for the sampled tokens, :func:`before_result`). At that batch's
``process_batch_result`` the request gets ``req.to_finish = FINISH_ABORT(reason, 500)``,
SGLang's own path for aborting a running request (client aborts, retraction failures):
it is finished, its KV released, its answer an HTTP 500 with the reason. The token the
violating forward produced for it is cut from its output before ``stream_output`` sends
anything (:func:`before_stream`), so a streaming client never sees it either. The other
requests of the batch are untouched. On a prefill engine of a pair the reader's
transfer is failed instead, as for a rejected send.

How a request is failed: in prefill's ``send_kv_chunk`` (the hook
engine_hooks/sglang/hooks_disagg.py already wraps), before the original runs, the room
is concluded *Failed* through the transfer manager's own failure channel, with a reason
(0.5.23+: ``conclude_failure``; 0.5.19-0.5.22 Mooncake: ``record_failure`` +
``update_status(Failed)`` + the same 3-frame status message the manager sends decode on
a failed transfer). Mooncake then drops the chunk (it never transfers for a Failed
room); prefill's in-flight queue finishes the request through
``handle_inflight_transfer_failure`` (its error, logged); decode's receiver polls
Failed and finishes its request with an HTTP 500 before any decode step reads the
reserved pages, and releases them. Other requests are untouched. Prefill's own answer carries the failure with the guard's
reason (``handle_inflight_transfer_failure`` -> ``prepare_abort``). When the manager is
not one the guard knows how to fail, nothing is changed and the record says
``observed``.

Failure policy (``KVGUARD_GUARD_FAIL``): ``open`` (default) turns the guard off for this
engine on any internal error (logged once, counted as a probe error, exported); the
engine serves on, observed as before. ``closed`` lets the error reach the engine, which
then fails the request whose send raised (docs/operations.md says when each is right).
A bad value of either variable is logged naming it and leaves the guard off, unless
``KVGUARD_GUARD_FAIL=closed``, which refuses to start.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import _runtime as rt
from ._runtime import State

log = logging.getLogger("kvguard.sglang")

MODES = ("off", "transfer", "full")
FAIL_POLICIES = ("open", "closed")
GUARD_TRANSFER = "guard.transfer"  # its name in the hook machinery (disabled on error, fail open)
GUARD_READ = "guard.read"  # the read enforcement's (KVGUARD_GUARD=full)
ABORT_STATUS = 500  # what SGLang answers for its own internal aborts (retraction failures)
ABORT_ERR_TYPE = "KVGuardReadViolation"


class GuardConfigError(ValueError):
    """KVGUARD_GUARD or KVGUARD_GUARD_FAIL has a value the guard does not know."""


@dataclass(frozen=True)
class GuardConfig:
    mode: str = "off"
    fail: str = "open"

    @property
    def transfer(self) -> bool:
        return self.mode in ("transfer", "full")

    @property
    def read(self) -> bool:
        return self.mode == "full"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> GuardConfig:
        raw_mode = environ.get("KVGUARD_GUARD", "")
        raw_fail = environ.get("KVGUARD_GUARD_FAIL", "")
        mode = raw_mode.strip().lower() or "off"
        fail = raw_fail.strip().lower() or "open"
        if fail not in FAIL_POLICIES:
            raise GuardConfigError(f"KVGUARD_GUARD_FAIL={raw_fail!r}: expected one of {', '.join(FAIL_POLICIES)}")
        if mode not in MODES:
            raise GuardConfigError(f"KVGUARD_GUARD={raw_mode!r}: expected one of {', '.join(MODES)}")
        return cls(mode, fail)


class Guard:
    """The process's guard configuration, set once by the plugin's ``load``."""

    config = GuardConfig()
    acted: rt._Bounded = rt._Bounded()  # rids the guard already acted on (once per request)
    # full: readers Tier 1 refused, waiting for their batch's result: rid -> reason
    to_abort: rt._Bounded = rt._Bounded()
    # full: reqs given to_finish, until their output is streamed: id(req) -> (req, output length to keep)
    to_cut: dict = {}
    # full, prefill of a pair: readers whose transfer is to be failed: rid -> reason
    to_fail_send: rt._Bounded = rt._Bounded()

    @classmethod
    def reset(cls, config: GuardConfig | None = None) -> None:
        cls.config = config or GuardConfig()
        cls.acted = rt._Bounded()
        cls.to_abort = rt._Bounded()
        cls.to_cut = {}
        cls.to_fail_send = rt._Bounded()


def configure(environ: Mapping[str, str] = os.environ) -> GuardConfig:
    """Read the guard's variables at plugin load. A bad value is logged naming it and
    leaves the guard off; with KVGUARD_GUARD_FAIL=closed it raises instead."""
    try:
        config = GuardConfig.from_env(environ)
    except GuardConfigError as exc:
        if environ.get("KVGUARD_GUARD_FAIL", "").strip().lower() == "closed":
            raise
        log.error("kvguard guard: %s; the guard is off for this engine", exc)
        config = GuardConfig()
    from kvguard.engine_hooks import tier1

    tier1.require("KVGUARD_GUARD=full" if config.read else None, on_read_violation)
    # WARNING, not INFO: this runs at plugin load, before SGLang configures its logging (only
    # WARNING and up reach the engine log then), and an operator must see that enforcement is on
    if config.mode == "full":
        log.warning(
            "kvguard guard: KVGUARD_GUARD=full: transfer invariants and the read check (Tier 1) enforced "
            "(KVGUARD_GUARD_FAIL=%s)",
            config.fail,
        )
    elif config.mode == "transfer":
        log.warning("kvguard guard: transfer invariants enforced (KVGUARD_GUARD_FAIL=%s)", config.fail)
    Guard.reset(config)
    return config


# --------------------------------------------------------------------------- prefill: before a send
def before_send(sched, *args, **kwargs) -> None:
    """``send_kv_chunk(req, last_chunk, end_idx)``'s guard step, before the original runs.
    Never raises unless KVGUARD_GUARD_FAIL=closed."""
    if not Guard.config.transfer or not rt.is_enabled(GUARD_TRANSFER) or not State.hello_done:
        return
    try:
        req = args[0] if args else kwargs["req"]
        _check_send(req)
    except Exception as exc:
        if Guard.config.fail == "closed":
            raise
        rt.hook_failed(GUARD_TRANSFER, exc)  # logged once, a PROBE_ERROR record, off for this engine


def _check_send(req) -> None:
    rid = req.rid
    read_reason = Guard.to_fail_send.pop(rid, None) if Guard.to_fail_send else None
    if read_reason is not None:
        _fail_send(req, read_reason)
        return
    prompt_tokens = State.rejected.get(rid)
    if prompt_tokens is None:
        _check_send_size(req)
        return
    if rid in Guard.acted or rt.is_warmup(req):
        return
    Guard.acted[rid] = True
    room, mgr = _room_and_manager(req)
    send_tokens = len(req.origin_input_ids)
    reserved_pages = _reserved_pages(mgr, room)
    reason = (
        f"kvguard guard: request {rid} (bootstrap room {room}) was rejected by the engine; refusing to send its "
        f"KV as a finished transfer ({send_tokens} token(s) of a {prompt_tokens}-token prompt"
        + (f" into {reserved_pages} reserved page(s))" if reserved_pages else ")")
    )
    _fail_send_rule(rid, room, mgr, "rejected_send", reason, prompt_tokens, send_tokens, reserved_pages)


def _fail_send_rule(
    rid, room: int, mgr, rule: str, reason: str, prompt_tokens: int, send_tokens: int, reserved_pages: int
) -> None:
    """A transfer rule broken at prefill's send: fail the room (when the backend lets the
    guard), log it once, and tell the sidecar what was done (a GUARD record)."""
    failed = _fail_room(mgr, room, reason) if room >= 0 else False
    if failed:
        log.error("%s: transfer failed, the request finishes with an error", reason)
    else:
        log.error("%s: this transfer backend cannot be failed by the guard; observed only", reason)
    rt.probes().guard_acted(
        rid,
        room,
        rule,
        "aborted" if failed else "observed",
        prompt_tokens=prompt_tokens,
        send_tokens=send_tokens,
        reserved_pages=reserved_pages,
        reason=reason,
    )


def _check_send_size(req) -> None:
    """Before a request's first chunk leaves (its sender has handed nothing to the manager
    yet): the pages the sender will send must be the pages decode reserved for it. Fewer
    leave reserved pages that nothing writes, holding whatever KV they held before (the
    incident's shape, here for any cause that leaves the sender initialised short, as
    the fault plugin's ``send_truncated`` does); more are cut by Mooncake to the reservation (its own warning),
    which means the two ends disagree about the prompt. Either way the transfer is failed
    before anything is sent. Once per request: after the first chunk ``curr_idx`` > 0."""
    sender = getattr(req, "disagg_kv_sender", None)
    if getattr(sender, "curr_idx", None) != 0:
        return
    send_pages = getattr(sender, "num_kv_indices", None)
    if not isinstance(send_pages, int) or req.rid in Guard.acted or rt.is_warmup(req):
        return
    room, mgr = _room_and_manager(req)
    reserved_pages = _reserved_pages(mgr, room)
    if reserved_pages == 0 or send_pages == reserved_pages or _relayout(mgr, room):
        return  # unknown (a dummy rank, another backend), equal, or not positional
    rid = req.rid
    Guard.acted[rid] = True
    prompt_tokens = len(req.origin_input_ids)
    prefix = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)  # 0.5.23: decode holds these
    page_size = int(getattr(getattr(mgr, "kv_args", None), "page_size", 0) or 0)
    send_tokens = min(prompt_tokens - prefix, send_pages * page_size) if page_size else 0
    reason = (
        f"kvguard guard: request {rid} (bootstrap room {room}): prefill was about to send {send_pages} KV "
        f"page(s) where decode reserved {reserved_pages} for its {prompt_tokens}-token prompt"
        + (f" ({prefix} token(s) cached at decode)" if prefix else "")
        + ("; decode would read reserved pages nothing wrote" if send_pages < reserved_pages else "")
    )
    _fail_send_rule(rid, room, mgr, "send_size", reason, prompt_tokens, send_tokens, reserved_pages)


def _relayout(mgr, room: int) -> bool:
    """Whether prefill's pages map onto decode's other than one to one, in order (context
    parallel filtering, DCP relayout): then the two counts are not comparable."""
    if getattr(mgr, "enable_all_cp_ranks_for_transfer", False) or getattr(mgr, "is_dummy_cp_rank", False):
        return True
    table = getattr(mgr, "decode_kv_args_table", None) or {}
    for info in mgr.transfer_infos.get(room, {}).values():
        registered = table.get(getattr(info, "mooncake_session_id", None))
        if getattr(registered, "requires_dcp_relayout", False):
            return True
    return False


def _reserved_pages(mgr, room: int) -> int:
    """Pages decode reserved for the room, as prefill's Mooncake manager knows them (0: unknown)."""
    infos = getattr(mgr, "transfer_infos", None)
    if not isinstance(infos, dict):
        return 0
    return max((len(i.dst_kv_indices) for i in infos.get(room, {}).values() if not i.is_dummy), default=0)


def _fail_room(mgr, room: int, reason: str) -> bool:
    """Conclude ``room`` Failed through the manager's own channel; False when it is not one
    the guard knows (then nothing was changed)."""
    if mgr is None:
        return False
    if hasattr(mgr, "conclude_failure"):  # 0.5.23: records the reason, marks Failed, tells decode
        mgr.conclude_failure(bootstrap_room=room, failure_reason=reason)
        return True
    needed = ("record_failure", "update_status", "sync_status_to_decode_endpoint", "_prefill_unique_rank")
    if "mooncake" not in type(mgr).__module__ or not all(hasattr(mgr, n) for n in needed):
        return False
    failed = _kvpoll_failed(mgr)
    mgr.record_failure(room, reason)
    mgr.update_status(room, failed)
    # what the transfer worker sends decode when a transfer fails: [room, status, rank], no
    # more frames (0.5.19's decode thread unpacks exactly three). Only when no chunk of the
    # room is in flight: decode then frees the pages at once, with nothing left to land in them.
    if getattr(mgr, "_staging_outstanding", {}).get(room, 0) == 0:
        rank = mgr._prefill_unique_rank()
        for info in getattr(mgr, "transfer_infos", {}).get(room, {}).values():
            if not info.is_dummy:
                mgr.sync_status_to_decode_endpoint(info.endpoint, info.dst_port, room, failed, rank)
    return True


def _kvpoll_failed(mgr) -> int:
    """``KVPoll.Failed`` as the manager's own module knows it (0 in every supported release)."""
    kvpoll: Any = getattr(sys.modules.get(type(mgr).__module__), "KVPoll", None)
    if kvpoll is None:
        kvpoll = importlib.import_module("sglang.srt.disaggregation.base.conn").KVPoll
    return int(kvpoll.Failed)


def _room_and_manager(req) -> tuple[int, Any]:
    """The request's bootstrap room (-1: none) and its sender's transfer manager (None: none)."""
    room = getattr(req, "bootstrap_room", None)
    return (-1 if room is None else int(room)), getattr(getattr(req, "disagg_kv_sender", None), "kv_mgr", None)


def _fail_send(req, reason: str) -> None:
    """Prefill of a pair, ``full``: the reader's forward read pages it does not own, so the KV
    it is about to send was computed over them; its transfer is failed like a rejected send's.
    (The GUARD record went out when Tier 1 found it: :func:`on_read_violation`.)"""
    room, mgr = _room_and_manager(req)
    if room >= 0 and _fail_room(mgr, room, reason):
        log.error("%s: transfer failed, the request finishes with an error", reason)
    else:
        log.error("%s: this transfer backend cannot be failed by the guard; its KV is sent", reason)


# --------------------------------------------------------------------------- full: reads
def on_read_violation(rid, tags, pages, owners) -> None:
    """Tier 1's per-reader callback (engine_hooks/tier1.py ``require``), in the forward that
    read the pages: decide once per request, and say so to the sidecar before Tier 1's own
    TIER1_VIOLATION record, so that the finding it raises carries what the guard did."""
    if not Guard.config.read or not rt.is_enabled(GUARD_READ) or rid in Guard.acted:
        return
    try:
        _decide_read(rid, tags, pages, owners)
    except Exception as exc:
        if Guard.config.fail == "closed":
            raise
        rt.hook_failed(GUARD_READ, exc)


def _decide_read(rid, tags, pages, owners) -> None:
    from kvguard.engine_hooks import tier1

    Guard.acted[rid] = True
    freed = all(t == tier1.TAG_FREE for t in tags)
    rule = "read_freed" if freed else "read_foreign"
    whose = sorted({str(o) for o in owners if o is not None})
    what = "freed" if freed else "not its own" + (f" (of request {', '.join(whose[:3])})" if whose else "")
    shown = ", ".join(str(p) for p in pages[:8]) + (", ..." if len(pages) > 8 else "")
    reason = (
        f"kvguard guard: request {rid}'s forward read {len(pages)} KV page(s) {what}: page(s) {shown}; "
        f"the request is failed before that forward's token is returned"
    )
    warmup = str(rid).startswith(rt.HEALTH_CHECK_RID_PREFIX)
    action = "observed" if warmup else "aborted"
    if not warmup:
        (Guard.to_fail_send if State.role == "prefill" else Guard.to_abort)[rid] = reason
    log.error("%s%s", reason, " (an engine health check: observed only)" if warmup else "")
    rt.probes().guard_acted(
        rid,
        -1,
        rule,
        action,
        prompt_tokens=0,
        send_tokens=0,
        reserved_pages=len(pages),
        reason=reason,
    )


def before_result(sched, *args, **kwargs) -> None:
    """``Scheduler.process_batch_result(batch, result)``'s guard step (``full``), before the
    original appends the batch's sampled tokens: look at the checks in flight (a GPU's; the
    scheduler is about to wait for the same step's tokens), then give each refused reader of
    this batch SGLang's own abort, and remember how much of its output may be streamed."""
    if not Guard.config.read or not rt.is_enabled(GUARD_READ):
        return
    try:
        tier1 = rt.probes().tier1
        if tier1 is not None:
            tier1.flush()
        if Guard.to_abort:
            batch = args[0] if args else kwargs["batch"]
            for req in batch.reqs:
                reason = Guard.to_abort.pop(req.rid, None)
                if reason is not None:
                    _abort(req, reason)
    except Exception as exc:
        if Guard.config.fail == "closed":
            raise
        rt.hook_failed(GUARD_READ, exc)


def _abort(req, reason: str) -> None:
    finish_abort: Any = getattr(sys.modules.get(type(req).__module__), "FINISH_ABORT", None)
    if finish_abort is None:
        finish_abort = importlib.import_module("sglang.srt.managers.schedule_batch").FINISH_ABORT
    req.to_finish = finish_abort(reason, ABORT_STATUS, ABORT_ERR_TYPE)
    if len(Guard.to_cut) >= rt.MAX_TRACKED:  # a request finished but never streamed: forget the oldest
        del Guard.to_cut[next(iter(Guard.to_cut))]
    Guard.to_cut[id(req)] = (req, len(req.output_ids))


def before_stream(streamer, *args, **kwargs) -> None:
    """``stream_output(reqs, ...)``'s guard step (``full``): a reader the guard aborted is
    streamed without the tokens its refused forward (or any later one) produced."""
    if not Guard.to_cut:
        return
    try:
        reqs = args[0] if args else kwargs["reqs"]
        for req in reqs:
            entry = Guard.to_cut.get(id(req))
            if entry is None or entry[0] is not req or not req.finished():
                continue  # not yet finished (a chunked prefill's middle chunk): its token comes later
            del Guard.to_cut[id(req)]
            del req.output_ids[entry[1] :]
    except Exception as exc:
        if Guard.config.fail == "closed":
            raise
        rt.hook_failed(GUARD_READ, exc)


def _step_first(step, name: str):
    """An AROUND hook running the guard's ``step`` and then the original once. Not
    ``rt.around``: that swallows a step's exception, and with KVGUARD_GUARD_FAIL=closed the
    guard's internal error must reach the engine (the step decides; it raises only then)."""

    def hook(original, *args, **kwargs):
        step(*args, **kwargs)
        return original(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = f"kvguard_{name}"
    return hook


def result_hook(name: str):
    return _step_first(before_result, name)


def stream_hook(name: str):
    return _step_first(before_stream, name)

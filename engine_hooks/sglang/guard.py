"""The guard (``KVGUARD_GUARD``): fail the one request that would hand foreign KV to a
client, inside the engine, before its tokens leave (docs/guard.md).

Modes:

* ``off`` (default): observe only.
* ``transfer``: invariants at the prefill/decode boundary, checked once per request.
  Enforced today: a request the engine rejected (admission, prefill) never has its KV
  sent as if it were done. That is SGLang 0.5.19's incident path: the over-long prompt
  is replaced by a 1-token placeholder, still bootstrapped, and its one page sent as a
  successful transfer into the 150 pages decode reserved; decode's attention then reads
  the other 149, still holding other tenants' KV.
* ``full``: ``transfer`` plus enforcing the engine's own read check (Tier 1). The read
  enforcement is not in this build: ``full`` logs so at start-up and enforces
  ``transfer``.

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


class GuardConfigError(ValueError):
    """KVGUARD_GUARD or KVGUARD_GUARD_FAIL has a value the guard does not know."""


@dataclass(frozen=True)
class GuardConfig:
    mode: str = "off"
    fail: str = "open"

    @property
    def transfer(self) -> bool:
        return self.mode in ("transfer", "full")

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

    @classmethod
    def reset(cls, config: GuardConfig | None = None) -> None:
        cls.config = config or GuardConfig()
        cls.acted = rt._Bounded()


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
    if config.mode == "full":
        log.warning(
            "kvguard guard: KVGUARD_GUARD=full: enforcing the read check (Tier 1) is not in this build; "
            "enforcing the transfer invariants only"
        )
    elif config.mode == "transfer":
        log.info("kvguard guard: transfer invariants enforced (KVGUARD_GUARD_FAIL=%s)", config.fail)
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
    prompt_tokens = State.rejected.get(rid)
    if prompt_tokens is None or rid in Guard.acted or rt.is_warmup(req):
        return
    Guard.acted[rid] = True
    room = getattr(req, "bootstrap_room", None)
    room = -1 if room is None else int(room)
    mgr = getattr(getattr(req, "disagg_kv_sender", None), "kv_mgr", None)
    send_tokens = len(req.origin_input_ids)
    reserved_pages = _reserved_pages(mgr, room)
    reason = (
        f"kvguard guard: request {rid} (bootstrap room {room}) was rejected by the engine; refusing to send its "
        f"KV as a finished transfer ({send_tokens} token(s) of a {prompt_tokens}-token prompt"
        + (f" into {reserved_pages} reserved page(s))" if reserved_pages else ")")
    )
    failed = _fail_room(mgr, room, reason) if room >= 0 else False
    if failed:
        log.error("%s: transfer failed, the request finishes with an error", reason)
    else:
        log.error("%s: this transfer backend cannot be failed by the guard; observed only", reason)
    rt.probes().guard_acted(
        rid,
        room,
        "rejected_send",
        "aborted" if failed else "observed",
        prompt_tokens=prompt_tokens,
        send_tokens=send_tokens,
        reserved_pages=reserved_pages,
        reason=reason,
    )


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

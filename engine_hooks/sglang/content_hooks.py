"""The content check (engine_hooks/content.py) in SGLang: set up on the first forward from
the model runner's KV pool, verified before each forward (the readers' rows), recorded
after it (the forward's ``out_cache_loc``) and when decode's poll reports a transfer done
(the request's row over its prompt). Off unless ``KVGUARD_CONTENT_CHECK`` asks for it.

On a device pool the check is the deferred one (engine_hooks/content_device.py): the
slots to verify are gathered from ``req_to_token`` on the device (no copy of the rows
to the host), and what a verify finds is reported by a later hook call, once the device
has done it."""

from __future__ import annotations

import logging

import numpy as np

from .. import content as ct
from . import _runtime as rt
from .coverage import content_buffers

log = logging.getLogger("kvguard.sglang")


class Content:
    check: ct.ContentCheck | None = None
    state = "unset"  # unset -> on / off (off: not asked for, or the pool cannot be checked)

    @classmethod
    def reset(cls) -> None:
        cls.check, cls.state = None, "unset"


def active(runner) -> ct.ContentCheck | None:
    """The pool's content check, set up on first use (None when off)."""
    if Content.state == "on":
        return Content.check
    if Content.state == "off":
        return None
    Content.state = "off"
    budget = ct.budget_from_env()  # a bad value was refused at load (plugin.py)
    if budget is False:
        return None
    per_forward = None if budget is None else int(budget)
    pool = getattr(runner, "token_to_kv_pool", None)
    try:
        k, v = content_buffers(pool)  # a latent (MLA) pool's one buffer stands for both
        Content.check = ct.for_pool(k, v, per_forward, ct.path_from_env())
    except Exception as exc:  # noqa: BLE001 - an unexpected pool: the check is off, the engine runs on
        log.warning("kvguard: %s is set but the KV pool cannot be checked, content check off: %s", ct.CONTENT_ENV, exc)
        return None
    Content.state = "on"
    log.warning(
        "kvguard: content check on (%s per forward), %d slots fingerprinted on %s%s",
        "every read slot" if per_forward is None else f"{per_forward} read slots",
        Content.check.num_slots,
        k.device,
        ", results read a step later" if Content.check.deferred else "",
    )
    return Content.check


def guarded(fn, *args) -> None:
    """Run a content-check step; a failure switches the check off (logged, reported as a
    probe error) and never reaches the forward or transfer hook that called it."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the engine and the other probes must not see it
        Content.state, Content.check = "off", None
        rt.probes().report_probe_error("content_check", exc)


def verify_reads(check, req_to_token, req_pool_indices, seq_lens: np.ndarray) -> None:
    """Before the forward: the readers' slots whose bytes changed since they were written."""
    which, positions = check.pick_index(seq_lens)
    if len(which) == 0:
        return
    if req_to_token.device.type == "cpu":
        rows = rt.host_int64(req_pool_indices)[which]
        slots = req_to_token.numpy()[rows, positions]
    else:  # gathered where the rows live: only the batch indices and positions go to the device
        from ..content_device import to_device

        rows = req_pool_indices[to_device(which, req_to_token.device)]
        slots = req_to_token[rows, to_device(positions, req_to_token.device)]
    report(check.verify(slots))


def written(check, slots) -> None:
    """After a hooked write: fingerprint ``slots`` (a deferred check may hand back what an
    earlier verify found by now)."""
    report(check.written(slots))


def loaded(slots) -> None:
    """A copy from outside any forward filled ``slots`` (a HiCache load-back, a retraction
    restore): on a host pool it is done, and the slots are fingerprinted as written; on a
    device pool it runs on a side stream the check is not ordered after, so the slots are
    forgotten (not verified) until a hooked write, never compared with bytes still landing."""
    check = Content.check if Content.state == "on" else None
    if check is None:
        return
    guarded(lambda: report(check.forget(slots) if check.deferred else check.written(slots)))


def report(changed) -> None:
    if changed is not None and len(changed):
        rt.probes().content_changed(changed)


def written_by_transfer(queue, req) -> None:
    """Decode's poll reported the request's KV transfer done: its prompt's slots hold it now."""
    check = Content.check if Content.state == "on" else None
    if check is None:
        return
    sched = queue.scheduler
    n = len(req.origin_input_ids)
    row = int(req.kv.req_pool_idx) if getattr(req, "kv", None) is not None else int(req.req_pool_idx)
    slots = sched.req_to_token_pool.req_to_token[row, :n]
    written(check, slots if check.deferred else rt.host_int64(slots))

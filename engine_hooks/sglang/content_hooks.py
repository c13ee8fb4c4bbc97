"""The content check (engine_hooks/content.py) in SGLang: set up on the first forward from
the model runner's KV pool, verified before each forward (the readers' rows), recorded
after it (the forward's ``out_cache_loc``) and when decode's poll reports a transfer done
(the request's row over its prompt). Off unless ``KVGUARD_CONTENT_CHECK`` asks for it."""

from __future__ import annotations

import logging

import numpy as np

from .. import content as ct
from . import _runtime as rt

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
        k, v = pool.k_buffer[0], pool.v_buffer[0]  # type: ignore[union-attr]
        Content.check = ct.ContentCheck(k, v, per_forward)
    except Exception as exc:  # noqa: BLE001 - an unexpected pool: the check is off, the engine runs on
        log.warning("kvguard: %s is set but the KV pool cannot be checked, content check off: %s", ct.CONTENT_ENV, exc)
        return None
    Content.state = "on"
    log.warning(
        "kvguard: content check on (%s per forward), %d slots fingerprinted",
        "every read slot" if per_forward is None else f"{per_forward} read slots",
        Content.check.num_slots,
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


def verify_reads(check: ct.ContentCheck, req_to_token, req_pool_indices, seq_lens: np.ndarray) -> None:
    """Before the forward: the readers' slots whose bytes changed since they were written."""
    rows = rt.host_int64(req_pool_indices)[: len(seq_lens)]
    which_rows, positions = check.pick(rows, seq_lens)
    if len(which_rows) == 0:
        return
    import torch

    idx_r = torch.from_numpy(which_rows).to(req_to_token.device)
    idx_p = torch.from_numpy(positions).to(req_to_token.device)
    slots = rt.host_int64(req_to_token[idx_r, idx_p])
    changed = check.verify(slots)
    if len(changed):
        rt.probes().content_changed(changed)


def written_by_transfer(queue, req) -> None:
    """Decode's poll reported the request's KV transfer done: its prompt's slots hold it now."""
    check = Content.check if Content.state == "on" else None
    if check is None:
        return
    sched = queue.scheduler
    n = len(req.origin_input_ids)
    row = int(req.kv.req_pool_idx) if getattr(req, "kv", None) is not None else int(req.req_pool_idx)
    check.written(rt.host_int64(sched.req_to_token_pool.req_to_token[row, :n]))

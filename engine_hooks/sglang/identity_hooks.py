"""The per-page content identity (engine_hooks/page_identity.py) in SGLang: what a request's
full pages hold, reported when it is handed prefix-cache pages, fills pages, and finishes.
Off unless ``KVGUARD_PAGE_IDENTITY=1`` (a bad value was refused at load, plugin.py).

* ``alloc_for_extend`` (hooks_rows.py ``_extend_post``, after the rows' ASSIGNs): per request,
  from its token ids (``origin_input_ids`` then ``output_ids``: what the radix cache keys
  by, SGLang 0.5.19 - 0.5.23), ``hit`` for the prefix pages ``[0, prefix_len // P)`` the
  radix cache handed it (its first extend only: a later chunk's prefix is its own earlier
  chunks) and ``written`` for the full pages ``[prefix_len // P, seq_len // P)`` the extend
  fills.
* ``release_kv_cache`` (hooks_requests.py ``_release_post``, before REQ_END: the sidecar's
  row of the request goes with it) of a finished request: ``written`` for the full pages its
  decode completed, from its last extend's end to its committed KV length (SGLang inserts
  generated tokens into the radix cache when the request finishes, so a later request may be
  handed them). A retracted request's chain is dropped: it is prefilled again as new.

Per request only the chain's tip is kept (the pages hashed and the last id), so a later
chunk or the release hashes only its own pages. A failure switches the identity off for the
process (logged once, reported as a probe error); it never reaches the engine.
"""

from __future__ import annotations

import logging

from .. import page_identity as pid
from . import _runtime as rt
from ._runtime import State

log = logging.getLogger("kvguard.sglang")


Identity = pid.Switch(rt._Bounded())


def active() -> pid.PageIdentity | None:
    """The engine's identity chain, set up on first use after HELLO (None when off)."""
    return Identity.active(State.hello_done, State.page_size, log)


def guarded(fn, *args) -> None:
    Identity.guarded(rt.probes, fn, *args)


def _tokens(req, n: int):
    return pid.token_array(req.origin_input_ids, req.output_ids, n)


def extended(reqs, held, prefix_lens, seq_lens) -> None:
    """After ``alloc_for_extend``'s ASSIGNs: each request's hit and written pages."""
    chain = active()
    if chain is None:
        return
    p = rt.probes()
    ps = chain.page_size
    for i, r in enumerate(reqs):
        first, stop = prefix_lens[i] // ps, seq_lens[i] // ps
        tip = Identity.tips.get(r.rid) if held[i] else None
        if tip is not None and tip[0] == first:  # a later chunk continuing its chain
            ids = chain.chain(_tokens(r, stop * ps), first, stop, tip[1])
        else:  # a first extend (or a chain not kept): from page 0
            whole = chain.chain(_tokens(r, stop * ps), 0, stop)
            if not held[i] and first:
                p.page_identity(r.rid, 0, "hit", whole[:first])
            tip = (len(whole), int(whole[-1]) if len(whole) else 0)
            ids = whole[first:]
        if len(ids):
            p.page_identity(r.rid, first, "written", ids)
            tip = (first + len(ids), int(ids[-1]))
        Identity.tips[r.rid] = tip  # (the release continues from here)


def _committed_len(req) -> int:
    """The KV positions the release hands the radix cache (SGLang 0.5.23 ``owned_kv_len``,
    0.5.19 ``effective_kv_committed_len``)."""
    for name in ("owned_kv_len", "effective_kv_committed_len"):
        fn = getattr(req, name, None)
        if callable(fn):
            return int(fn())
    return int(req.kv.kv_committed_len)


def released(req) -> None:
    """``release_kv_cache`` of a request (before its REQ_END): a finished one's pages
    completed during decode; either way its chain is dropped."""
    tip = Identity.tips.pop(req.rid, None)
    chain = Identity.chain if Identity.state == "on" else None
    if chain is None or tip is None or not req.finished():
        return
    ps = chain.page_size
    start, stop = tip[0], _committed_len(req) // ps
    if stop > start:
        ids = chain.chain(_tokens(req, stop * ps), start, stop, tip[1])
        rt.probes().page_identity(req.rid, start, "written", ids)

"""The guard's digest rule (``KVGUARD_GUARD=transfer`` or ``full``): decode fails a request
whose received KV differs from what prefill holds, before its first decode step.

Prefill's guard puts the sender's transfer digest (the XFER_DIGEST definition,
engine_hooks/digest.py) into the metadata row SGLang already sends with the last chunk
(the marker, engine_hooks/wire/marker.py): no extra message, no wait, no sidecar in the
path. Decode's guard compares it with the digest of the pages it reserved once SGLang
says the transfer and its metadata have landed, in ``_apply_metadata_gate``: that runs
on every TP rank before the ranks agree (a MIN all-reduce) on each request's status, so a
request failed on one rank is failed on all, and the original ``pop_transferred`` takes
its own failure path: HTTP 500 with the guard's reason, the reserved pages released, no
decode step run.

Prefill side (``send_kv_chunk`` of the last chunk, before the original writes the row):
:func:`sender_ahead` feeds the last chunk into the request's streaming digest now rather
than after the call, and writes the marker; :func:`sender_sent` emits the sender's
XFER_DIGEST after the call as before (none when the chunk ended elsewhere than where the
marker says). Decode side: :func:`gate_checked`.

Not compared (the marker is ignored, the sidecar still compares both ends): a decode
whose prefill is unguarded (no marker), another token range, head split or digest
algorithm than decode's own (prefill and decode TP differ), warmup transfers, and rows
that are not SGLang's 16-slot host rows.
"""

from __future__ import annotations

import logging
from typing import Any

from kvguard.engine_hooks import digest as dg
from kvguard.engine_hooks.wire import marker as wm

from . import _runtime as rt
from .guard import Guard

log = logging.getLogger("kvguard.sglang")

GUARD_DIGEST = "guard.digest"  # its name in the hook machinery (disabled on error, fail open)
KVPOLL_FAILED, KVPOLL_SUCCESS = 0, 4  # SGLang's KVPoll values in every supported release


def wanted() -> bool:
    return Guard.config.transfer and rt.is_enabled(GUARD_DIGEST)


def _failed(exc: Exception) -> None:
    if Guard.config.fail == "closed":
        raise exc
    rt.hook_failed(GUARD_DIGEST, exc)


def _alg(setup) -> int:
    from kvguard.engine_hooks.probes_transfer import _DIGEST_ALG

    return int(_DIGEST_ALG[setup.alg])


# --------------------------------------------------------------------------- prefill
def sender_ahead(sched, req, start: int, end_idx) -> int | None:
    """Before the last chunk's send: hash it into the request's digest and write the marker.
    Returns the token end the digest now covers (the chunk was fed), or None (not fed:
    the post hook hashes the chunk as usual)."""
    try:
        return _sender_ahead(sched, req, start, end_idx)
    except Exception as exc:  # noqa: BLE001
        _failed(exc)
        return None


def _sender_ahead(sched, req, start: int, end_idx) -> int | None:
    from . import hooks_disagg as hd

    row = wm.row(getattr(sched, "disagg_metadata_buffers", None), req.metadata_buffer_index)
    if row is None:
        return None
    row[0] = 0  # no marker unless one is written below (a row is reused request after request)
    if rt.is_warmup(req) or not rt.is_enabled(hd.SENDER_GUARD):
        return None
    end = int(end_idx) if end_idx is not None else len(req.origin_input_ids)
    if end <= start:
        return None
    hd._digest_guarded(
        hd.SENDER_GUARD, hd._sender_chunk, sched, req, start, end, hd._row_slots(sched, req, start, end), False
    )
    st = hd.Digests.senders.get(req.rid)
    if st is None or st.token_end != end:
        return None  # not hashed (unsupported pool, state dropped): nothing was fed
    words = wm.pack(
        wm.Marker(
            int(req.bootstrap_room),
            st.token_start,
            end,
            st.setup.head_start,
            st.setup.head_count,
            _alg(st.setup),
            st.stream.digest(),
        )
    )
    row.numpy()[:] = words
    return end


def sender_sent(req, ahead: int, end: int) -> None:
    """After the last chunk's send: the sender's XFER_DIGEST, from the state fed ahead."""
    from . import hooks_disagg as hd

    st = hd.Digests.senders.pop(req.rid, None)
    if st is None:
        return
    if end != ahead:
        dg.skips.skip("the last chunk was sent over another range than the guard's marker hashed")
        return
    hd._emit(req, "sender", st.setup, st.stream.digest(), st.token_start, end)


# --------------------------------------------------------------------------- decode
def gate_checked(result, polls, decode_reqs, metadata_buffers, *args, **kwargs) -> None:
    """``_apply_metadata_gate(polls, decode_reqs, metadata_buffers)``'s guard step, after it:
    for each transfer that polls Success with its metadata landed, compare decode's digest
    of its reserved pages with prefill's marker; a mismatch turns that poll into Failed
    before the ranks agree, with the guard's reason recorded as the room's failure."""
    if not wanted() or not rt.State.hello_done:
        return
    try:
        for i, poll in enumerate(polls):
            if int(poll) == KVPOLL_SUCCESS:
                _check_received(polls, i, decode_reqs[i], metadata_buffers)
    except Exception as exc:  # noqa: BLE001
        _failed(exc)


def _check_received(polls, i: int, decode_req, metadata_buffers) -> None:
    from . import hooks_disagg as hd

    req = decode_req.req
    rid = req.rid
    if rid in hd.Digests.verified or rt.is_warmup(req):
        return
    got = hd.Digests.receivers.get(rid)
    setup = hd.Digests.receiver_setup
    if got is None or setup is None:
        return
    row = wm.row(metadata_buffers, decode_req.metadata_buffer_index)
    room = int(req.bootstrap_room)
    m = wm.unpack(row.numpy(), room) if row is not None else None
    if m is None:
        return  # an unguarded prefill, or a row not written for this room
    token_start, slots = got
    mine = (token_start, token_start + int(slots.numel()), setup.head_start, setup.head_count, _alg(setup))
    if (m.token_start, m.token_end, m.head_start, m.head_count, m.alg) != mine:
        dg.skips.skip("the guard's marker covers other tokens, heads or algorithm than decode's digest")
        return
    digest = dg.transfer_digest(setup.view, slots, setup.head_start, setup.alg)
    hd.Digests.verified[rid] = digest  # pop_transferred's hook emits it without hashing again
    if digest == m.digest:
        return
    _fail_received(polls, i, decode_req, m, digest, setup)


def _fail_received(polls, i: int, decode_req, m: wm.Marker, digest: int, setup) -> None:
    from . import hooks_disagg as hd

    req = decode_req.req
    rid, room = req.rid, int(req.bootstrap_room)
    pages = -(-(m.token_end - m.token_start) // max(1, int(setup.view.page_size)))
    reason = (
        f"kvguard guard: request {rid} (bootstrap room {room}): the KV decode received for tokens "
        f"[{m.token_start}, {m.token_end}) differs from what prefill sent (digest {digest:016x}, prefill's "
        f"{m.digest:016x}); the request is failed before its first decode step"
    )
    mgr: Any = getattr(getattr(decode_req, "kv_receiver", None), "kv_mgr", None)
    recorded = callable(getattr(mgr, "record_failure", None))
    if recorded:
        mgr.record_failure(room, reason)  # what the receiver's failure_exception() reports
    polls[i] = KVPOLL_FAILED
    log.error("%s: transfer failed, the request finishes with an error", reason)
    p = rt.probes()
    p.guard_acted(
        rid,
        room,
        "digest_mismatch",
        "aborted",
        prompt_tokens=len(req.origin_input_ids),
        send_tokens=m.token_end - m.token_start,
        reserved_pages=pages,
        reason=reason,
    )
    # the receiver's digest: pop_transferred's hook emits none for a failed transfer
    hd.Digests.verified.pop(rid, None)
    hd.Digests.receivers.pop(rid, None)
    hd._emit(req, "receiver", setup, digest, m.token_start, m.token_end)


def gate_hook(name: str):
    """An AFTER hook that keeps the original's result (None) and lets the guard's own
    failure policy decide whether an internal error reaches the engine."""

    def hook(result, *args, **kwargs):
        gate_checked(result, *args, **kwargs)
        return None

    hook.__name__ = hook.__qualname__ = f"kvguard_{GUARD_DIGEST}"
    return hook

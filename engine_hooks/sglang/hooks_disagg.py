"""Prefill/decode disaggregation hooks: transfer_reserved / transfer_sent / transfer_done.

Decode side (srt/disaggregation/decode.py):
* ``DecodePreallocQueue._pre_alloc(req, prefix_indices, prefix_len, total_prefix_len)``
  binds a row and allocates the destination slots for the KV prefill will send;
  it returns them (``kv_loc``, positions ``[total_prefix_len, +len)``). ->
  rows_assigned (the decode-side radix prefix ``[0, prefix_len)`` as shared) and
  transfer_reserved(rid, room, tokens=len(kv_loc), slots=kv_loc). When it is
  called to resume a *retracted* request (``resume_retracted_reqs``) no transfer
  follows, so only the rows are reported.
* ``DecodeTransferQueue.pop_transferred``: requests it returns polled Success ->
  transfer_done(receiver, success); requests it removed without returning them
  failed (poll Failed, or aborted at commit) -> transfer_done(receiver, failed).
* ``DecodeTransferQueue._do_release``: the deferred release of a failed transfer's
  pages (after the prefill drain ack or timeout): frees inside it are kind
  "deferred".

Prefill side (srt/disaggregation/prefill.py, ``SchedulerDisaggregationPrefillMixin``):
* ``send_kv_chunk(req, last_chunk, end_idx)`` sends token range
  ``[req.start_send_idx, new req.start_send_idx)``; the pages are those of the
  request's row over that range (what the engine hands to ``sender.send``). ->
  transfer_sent(unit="slots").
* ``process_disagg_prefill_inflight_queue``: the requests it returns are done;
  transfer_done(sender, success), or failed when ``handle_inflight_transfer_failure``
  ran for them.

Transfer digests (XFER_DIGEST, engine_hooks/digest.py, docs/wire-format.md):
* sender: ``send_kv_chunk``'s post hook feeds each chunk's slots into per-(layer, head)
  streaming xxh3 states (a K and a V stream per head on host pools) and emits
  transfer_digest(sender) with the LAST chunk, over ``[first chunk's start, last
  chunk's end)``;
* receiver: ``_pre_alloc`` remembers the slots it reserved (positions
  ``[total_prefix_len, +len(kv_loc))``); ``pop_transferred`` hashes them for each request
  it returns (success), then emits transfer_digest(receiver) before transfer_done.
Host (CPU) pools: alg ``head_streams`` (alg 3; ``unit_bytes``, alg 1, is no longer
emitted); CUDA pools: ``device_reduced``. Warmup (fake) transfers and pools/dtypes/TP
splits the digest code does not understand are skipped (one log line per reason,
counted in ``digest.skips``). The digest runs under its own
guard: a failure disables the digest only, never transfer_sent/transfer_done.
"""

from __future__ import annotations

from collections import OrderedDict

from kvguard.engine_hooks import digest as dg

from . import _runtime as rt
from . import content_hooks, guard
from . import coverage as cv_sglang
from . import guard_marker as marker
from ._runtime import State


def _room(req) -> int:
    room = getattr(req, "bootstrap_room", None)
    return -1 if room is None else int(room)


# --------------------------------------------------------------------------- decode
def _arg(args, kwargs, i, key, default=None):
    return args[i] if len(args) > i else kwargs.get(key, default)


def _pre_alloc_pre(self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    prefix_len = _arg(args, kwargs, 2, "prefix_len") or 0
    total_prefix_len = _arg(args, kwargs, 3, "total_prefix_len")
    if total_prefix_len is None:
        total_prefix_len = prefix_len
    resumed = any(func == "resume_retracted_reqs" for _f, func in rt.caller_frames(4))
    return req, int(prefix_len), int(total_prefix_len), resumed


def _pre_alloc_post(token, kv_loc, self, *args, **kwargs):
    if not State.hello_done or kv_loc is None:
        return
    req, prefix_len, total_prefix_len, resumed = token
    if getattr(getattr(self, "scheduler", None), "enable_hisparse", False):
        return  # kv_loc are host indices there; not modelled
    from .hooks_rows import _rows_block

    n = int(kv_loc.numel())
    end = total_prefix_len + n
    rt.ensure_begun(req, cached_tokens=prefix_len)
    row = int(req.kv.req_pool_idx)
    block = _rows_block(self.req_to_token_pool.req_to_token, [row], end)[0]
    p = rt.probes()
    if prefix_len > 0:
        p.rows_assigned(req.rid, 0, prefix_len, prefix_len, block[:prefix_len])
    if n:
        p.rows_assigned(req.rid, total_prefix_len, end, total_prefix_len, block[total_prefix_len:end])
    if not resumed:
        p.transfer_reserved(req.rid, _room(req), n, kv_loc)
        if n:
            _digest_guarded(
                RECEIVER_GUARD, _receiver_reserved, self.scheduler, req, total_prefix_len, block[total_prefix_len:end]
            )


def pre_alloc_hook(name: str):
    return rt.around(name, _pre_alloc_pre, _pre_alloc_post, cats=("rows",))


def _pop_transferred_pre(self, *args, **kwargs):
    rids_to_check = _arg(args, kwargs, 0, "rids_to_check")
    return [dr.req for dr in self.queue if rids_to_check is None or dr.req.rid in rids_to_check]


def _pop_transferred_post(before, result, self, *args, **kwargs):
    if not State.hello_done or not before:
        return
    returned = {id(r) for r in result or ()}
    still_queued = {id(dr.req) for dr in self.queue}
    p = rt.probes()
    for req in before:
        if id(req) in returned:
            content_hooks.guarded(content_hooks.written_by_transfer, self, req)
            _digest_guarded(RECEIVER_GUARD, _receiver_digest, self, req)
            p.transfer_done(req.rid, _room(req), "receiver", "success")
        elif id(req) not in still_queued:
            Digests.receivers.pop(req.rid, None)
            Digests.verified.pop(req.rid, None)
            p.transfer_done(req.rid, _room(req), "receiver", "failed")


def pop_transferred_hook(name: str):
    return rt.around(name, _pop_transferred_pre, _pop_transferred_post)


def deferred_release_hook(name: str):
    return rt.around(name, None, None, free_kind="deferred")


# --------------------------------------------------------------------------- prefill
def _room_already_failed(req) -> bool:
    """True when the Mooncake sender will drop this chunk without transferring it: its
    ``add_transfer_request`` (0.5.19-0.5.23) returns early for a room marked
    ``KVPoll.Failed`` (decode aborted the request and told prefill so). A room missing
    from the table is not taken as failed: requests to SGLang's fake bootstrap host
    (warmup) never enter it and still complete. Only Mooncake's manager is trusted here;
    anything unexpected reads as "not failed", so a chunk is never hidden on a guess."""
    mgr = getattr(getattr(req, "disagg_kv_sender", None), "kv_mgr", None)
    status = getattr(mgr, "request_status", None)
    if status is None or "mooncake" not in type(mgr).__module__:
        return False
    room = _room(req)
    try:
        return room in status and int(status.get(room)) == 0  # KVPoll.Failed == 0 in every version
    except Exception:  # noqa: BLE001 - a probe never breaks the engine; unknown = not failed
        return False


def _send_pre(self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    start, dropped = int(req.start_send_idx or 0), _room_already_failed(req)
    ahead = None
    if not dropped and State.hello_done and _arg(args, kwargs, 1, "last_chunk", False) and marker.wanted():
        # the guard's transfer marker goes out in the metadata row the original writes and
        # hands to the transfer worker: the last chunk is hashed before, not after, the call
        ahead = marker.sender_ahead(self, req, start, _arg(args, kwargs, 2, "end_idx"))
    return req, start, dropped, ahead


def _send_post(token, result, self, *args, **kwargs):
    if not State.hello_done:
        return
    req, start, dropped, ahead = token
    if dropped:
        # the room had failed before the call: Mooncake dropped the chunk, nothing was
        # written into decode's pages (which decode may already have freed); an XFER_SEND
        # here would be a transfer that never happened (use_after_free "via transfer")
        Digests.senders.pop(req.rid, None)
        return
    last_chunk = bool(_arg(args, kwargs, 1, "last_chunk", False))
    end = int(req.start_send_idx or 0)
    if end < start or (end == start and not last_chunk):
        return  # nothing sent (skipped)
    slots = _row_slots(self, req, start, end)
    rt.ensure_begun(req)
    rt.probes().transfer_sent(req.rid, _room(req), start, end, slots, last_chunk, unit="slots")
    if ahead is not None:
        _digest_guarded(SENDER_GUARD, marker.sender_sent, req, ahead, end)
    else:
        _digest_guarded(SENDER_GUARD, _sender_chunk, self, req, start, end, slots, last_chunk)


def _row_slots(sched, req, start: int, end: int):
    """The KV slots of the request's row over token positions ``[start, end)``."""
    from .hooks_rows import _rows_block

    return _rows_block(sched.req_to_token_pool.req_to_token, [int(req.kv.req_pool_idx)], end)[0, start:end]


def send_kv_chunk_hook(name: str):
    """The guard's step (guard.py) first, under its own name and failure policy, so that
    an observation failure never switches it off; then the observing hook."""
    observe = rt.around(name, _send_pre, _send_post)

    def hook(original, *args, **kwargs):
        guard.before_send(*args, **kwargs)
        return observe(original, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = observe.__name__
    return hook


def _inflight_post(result, self, *args, **kwargs):
    if not State.hello_done:
        return
    p = rt.probes()
    for req in result or ():
        status = "failed" if State.xfer_failed.pop(req.rid, None) else "success"
        p.transfer_done(req.rid, _room(req), "sender", status)


def inflight_queue_hook(name: str):
    return rt.after(name, _inflight_post)


def _transfer_failure_pre(self, *args, **kwargs):
    req = _arg(args, kwargs, 0, "req")
    State.xfer_failed[req.rid] = True
    Digests.senders.pop(req.rid, None)


def transfer_failure_hook(name: str):
    return rt.around(name, _transfer_failure_pre, None)


# --------------------------------------------------------------------------- transfer digests
SENDER_GUARD = "transfer_digest.sender"
RECEIVER_GUARD = "transfer_digest.receiver"
MAX_SENDERS = 64  # open streaming states (requests between their first and last chunk); each is layers x heads xxh3
MAX_RECEIVERS = 4096  # reservations waiting for their transfer (slots only)


class _BoundedStates(OrderedDict):
    """Per-request digest state, oldest dropped past ``cap`` (requests that never finish
    their transfer: aborted, or failed where no hook saw it); drops are counted."""

    def __init__(self, cap: int):
        super().__init__()
        self.cap = cap
        self.dropped = 0

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > self.cap:
            self.popitem(last=False)
            self.dropped += 1


class _Sender:
    __slots__ = ("stream", "token_start", "token_end", "setup")

    def __init__(self, stream, token_start, setup):
        self.stream, self.token_start, self.token_end, self.setup = stream, token_start, token_start, setup


class Digests:
    senders: _BoundedStates = _BoundedStates(MAX_SENDERS)  # rid -> _Sender
    receivers: _BoundedStates = _BoundedStates(MAX_RECEIVERS)  # rid -> (token_start, reserved slots)
    verified: _BoundedStates = _BoundedStates(MAX_RECEIVERS)  # rid -> the digest the guard compared
    receiver_setup: _Setup | None = None  # decode's, for the guard (no scheduler at its hook)
    setups: dict = {}  # id(pool) -> _Setup, or the reason it cannot be digested

    @classmethod
    def reset(cls) -> None:
        cls.senders = _BoundedStates(MAX_SENDERS)
        cls.receivers = _BoundedStates(MAX_RECEIVERS)
        cls.verified = _BoundedStates(MAX_RECEIVERS)
        cls.receiver_setup = None
        cls.setups = {}
        dg.skips.reset()


class _Setup:
    """A rank's digest layout: its pool view and alg, the global kv heads it hashes
    (``head_start``, ``head_count`` of ``total_heads``: the streams' seeds), and where its
    partial sits in the end's tiling (``part_start`` of ``part_total``: the heads themselves, or
    with pipeline parallelism stage s's heads shifted by ``s * total_heads``, each stage hashing
    its own layers with their global layer ids, so that the stages' partials add up to the
    model's digest and an end completes only with every stage's: docs/wire-format.md)."""

    __slots__ = ("view", "alg", "head_start", "head_count", "total_heads", "part_start", "part_total")

    def __init__(self, view, alg, head_start, head_count, total_heads, stage: int = 0, stages: int = 1):
        self.view, self.alg = view, alg
        self.head_start, self.head_count, self.total_heads = head_start, head_count, total_heads
        self.part_start, self.part_total = stage * total_heads + head_start, stages * total_heads


def _digest_guarded(name: str, fn, *args) -> None:
    """Digests run under their own guard: a failure disables them, not the transfer records."""
    if not rt.is_enabled(name):
        return
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001
        rt.hook_failed(name, exc)
        (Digests.senders if name == SENDER_GUARD else Digests.receivers).clear()


def _attn_tp(sched) -> tuple[int, int]:
    """(rank, size) of the attention tensor-parallel group, which splits the kv heads."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return int(par.attn_tp_rank), int(par.attn_tp_size)
    except Exception:  # noqa: BLE001 - older layouts keep them on the scheduler
        rank, size = getattr(sched, "attn_tp_rank", None), getattr(sched, "attn_tp_size", None)
        if rank is None or size is None:
            if int(getattr(sched, "tp_size", 1) or 1) != 1:
                raise dg.Unsupported("attention TP rank/size not found") from None
            return 0, 1
        return int(rank), int(size)


def head_layout(local_heads: int, total_heads: int, rank: int, size: int) -> tuple[int, int] | None:
    """(head_start, head_count) of the global kv heads this rank holds; None when another
    rank already reports them (heads replicated because TP > kv heads)."""
    if local_heads * size == total_heads:
        return rank * local_heads, local_heads
    if local_heads == 1 and size > total_heads and size % total_heads == 0:
        replicas = size // total_heads
        return (rank // replicas, 1) if rank % replicas == 0 else None
    raise dg.Unsupported(f"{local_heads} local kv heads x attention TP {size} != {total_heads} model kv heads")


def _setup(sched) -> _Setup | None:
    pool = sched.token_to_kv_pool_allocator.get_kvcache()
    got = Digests.setups.get(id(pool))
    if got is None:
        try:
            view = dg.pool_view(pool)
            alg = view.alg()
            rank, size = _attn_tp(sched)
            if view.v is None:  # a latent pool: one head, the same on every attention-TP rank
                total = 1
                heads = (0, 1) if rank == 0 else None
            else:
                total = int(sched.model_config.get_total_num_kv_heads())
                heads = head_layout(view.heads, total, rank, size)
            got = (
                "kv heads (or the latent) reported by another TP rank (replicated)"
                if heads is None
                else _Setup(view, alg, heads[0], heads[1], total, cv_sglang.pp_rank(sched), cv_sglang.pp_size(sched))
            )
        except dg.Unsupported as exc:
            got = str(exc)
        Digests.setups[id(pool)] = got
    if isinstance(got, str):
        dg.skips.skip(got)
        return None
    return got


def _emit(req, side: str, s: _Setup, digest: int, token_start: int, token_end: int) -> None:
    rt.probes().transfer_digest(
        req.rid,
        _room(req),
        side,
        digest,
        token_start,
        token_end,
        s.view.layers,
        s.part_start,
        s.head_count,
        s.part_total,
        alg=s.alg,
    )


def _sender_chunk(sched, req, start: int, end: int, slots, last_chunk: bool) -> None:
    """Feed one sent chunk; emit the digest of everything sent with the last one."""
    if rt.is_warmup(req):
        return
    rid = req.rid
    st = Digests.senders.get(rid)
    if st is not None and st.token_end != start:
        Digests.senders.pop(rid)  # a new send of this rid from scratch (re-bootstrap): start over
        st = None
    if st is None:
        first = getattr(req, "disagg_decode_prefix_len", None)
        if first is not None and int(first) != start:
            dg.skips.skip("sender chunks seen from the middle of a transfer (earlier state dropped)")
            return
        s = _setup(sched)
        if s is None:
            return
        st = _Sender(dg.StreamingDigest(s.view, s.head_start, s.alg), start, s)
        Digests.senders[rid] = st
    if st.setup.alg == dg.DEVICE_REDUCED:
        # 0.5.23 early send of cached prefix pages under the overlap scheduler: the previous
        # step's forward may still be writing them on the forward stream; SGLang records an
        # event for its transfer worker, and our device reads wait on the same event.
        ev = getattr(getattr(req, "disagg_kv_sender", None), "_early_send_wait_event", None)
        if ev is not None and hasattr(ev, "wait"):
            ev.wait()
    st.stream.update(slots)
    st.token_end = end
    if last_chunk:
        Digests.senders.pop(rid, None)
        _emit(req, "sender", st.setup, st.stream.digest(), st.token_start, end)


def _receiver_reserved(sched, req, token_start: int, slots) -> None:
    if rt.is_warmup(req):  # the fake (warmup) transfer writes nothing
        return
    Digests.receivers[req.rid] = (int(token_start), slots.clone())
    if Digests.receiver_setup is None and marker.wanted():  # the guard compares before pop_transferred
        Digests.receiver_setup = _setup(sched)


def _receiver_digest(queue, req) -> None:
    """Hash the slots reserved for the transfer, now that it completed."""
    got = Digests.receivers.pop(req.rid, None)
    if got is None:
        return  # warmup, or no reservation seen (dropped at the cap: counted there)
    if getattr(queue, "enable_host_receive", False):
        dg.skips.skip("decode receives into host staging (enable_host_receive): not digested")
        return
    token_start, slots = got
    s = _setup(queue.scheduler)
    if s is None:
        return
    digest = Digests.verified.pop(req.rid, None)  # the guard hashed it already (guard_marker.py)
    if digest is None:
        digest = dg.transfer_digest(s.view, slots, s.head_start, s.alg)
    _emit(req, "receiver", s, digest, token_start, token_start + int(slots.numel()))

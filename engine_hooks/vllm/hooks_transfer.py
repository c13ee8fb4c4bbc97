"""The EngineCore's side of a prefill/decode transfer through a KV connector (vLLM's
``MooncakeConnector``): the same ``XFER_*`` records as SGLang's prefill/decode, paired by the
sidecar's transfer ledger (docs/detectors.md, "The transfer ledger").

The room: both ends of one transfer carry the ``transfer_id`` the proxy put in the request's
``kv_transfer_params`` (prefill: ``do_remote_decode``; decode: ``do_remote_prefill`` with the
prefill's bootstrap address and engine id). Its 63-bit hash is the room, on both engines,
whatever their request ids (a client sends none; each engine draws its own).

Decode (the receiver), all in the scheduler:

* ``update_state_after_alloc``: the blocks exist. REQ_BEGIN (with the room), the request's
  row (its prefix-cache hit shared), then ``XFER_RESERVE`` of the blocks the transfer will
  fill, tokens ``[local hit, local hit + external)``. The row goes out now, not at the first
  schedule: the ledger places the reservation in the row, and a load that lands after its
  blocks were freed must be judged against the row it was reserved in;
* ``finished_recving`` (``_update_from_kv_xfer_finished``): ``XFER_DONE`` receiver, failed
  when one of its blocks is in ``invalid_block_ids``.

Prefill (the sender): REQ_BEGIN with the room; the worker reports what it sends and its
digest (hooks_transfer_worker.py, it alone knows how many blocks decode asked for); when the
scheduler learns the send finished (``finished_sending``), ``XFER_DONE`` sender and then the
request's REQ_END, held back until then because its blocks stay the request's until sent. A
request freed without a delayed send (aborted, or not finished by length) ends its side as
``aborted``.
"""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from . import _runtime as rt
from ._runtime import State

log = logging.getLogger("kvguard.vllm")

ROOM_SEED = 0x6B76675F726F6F6D  # "kvg_room": prefill's and decode's hooks must agree on it
# connectors whose requests carry a transfer id shared by prefill and decode
PD_CONNECTORS = ("MooncakeConnector",)


def room_of_transfer(transfer_id) -> int:
    """The room of a transfer id: 63 bits, so never the wire's "no room" value."""
    return xxhash.xxh64_intdigest(str(transfer_id).encode(), seed=ROOM_SEED) >> 1


def room_of(request) -> int | None:
    """The room of a request taking part in a prefill/decode transfer, else None."""
    if not State.pd_connector:
        return None
    params = getattr(request, "kv_transfer_params", None)
    if not params:
        return None
    transfer_id = params.get("transfer_id")
    return None if not transfer_id else room_of_transfer(transfer_id)


def is_pd_connector(connector) -> bool:
    return any(c.__name__ in PD_CONNECTORS for c in type(connector).__mro__)


def request_room(request) -> int | None:
    """The room for ``request``'s REQ_BEGIN; a prefill request's send is awaited from now on."""
    room = room_of(request)
    if room is not None and request.kv_transfer_params.get("do_remote_decode"):
        State.sending[request.request_id] = room
    return room


# --------------------------------------------------------------------------- decode
def wants_remote_prefill(request) -> bool:
    """Before ``update_state_after_alloc`` clears it: decode will pull this request's prompt."""
    params = getattr(request, "kv_transfer_params", None)
    return bool(State.pd_connector and params and params.get("do_remote_prefill") and params.get("transfer_id"))


def reserve(rid: str, room: int, ids, pages: np.ndarray, local: int, external: int) -> None:
    """Decode's blocks for the transfer exist (``update_state_after_alloc``): ``ids`` its row,
    ``pages`` those the pull fills (tokens ``[local, local + external)``)."""
    p = rt.probes()
    p.row_pages_assigned(rid, 0, len(ids) * State.page_size, local, ids)
    p.transfer_reserved(rid, room, external, pages, unit="pages")
    State.receiving[rid] = (room, pages)


def received(rid: str, invalid) -> None:
    """``finished_recving``: the worker's pull of ``rid`` ended (failed: a block of it is invalid)."""
    pending = State.receiving.pop(rid, None)
    if pending is None:
        return
    room, pages = pending
    failed = bool(invalid) and any(int(b) in invalid for b in pages.tolist())
    rt.probes().transfer_done(rid, room, "receiver", "failed" if failed else "success")


# --------------------------------------------------------------------------- prefill
def sender_freed(request, end_args, delayed: bool) -> bool:
    """``Scheduler._free_request`` of a prefill request with a room: its REQ_END waits for the
    send when the connector kept its blocks for it. Returns whether the REQ_END was held."""
    rid = request.request_id
    room = State.sending.get(rid)
    if room is None:
        return False
    if delayed:
        State.ending[rid] = end_args
        return True
    del State.sending[rid]
    rt.probes().transfer_done(rid, room, "sender", "aborted")
    return False


def sent(rid: str) -> None:
    """``finished_sending``: the connector is done with ``rid``'s blocks (sent, or its wait for
    decode expired: the worker's XFER_SEND says whether anything went out)."""
    room = State.sending.pop(rid, None)
    if room is not None:
        rt.probes().transfer_done(rid, room, "sender", "success")
    end_args = State.ending.pop(rid, None)
    if end_args is not None:
        rt.probes().request_end(*end_args[0], **end_args[1])

"""The Worker's side of a prefill/decode transfer through vLLM's ``MooncakeConnector``: what
prefill sends (``XFER_SEND``) and both ends' digests of it (``XFER_DIGEST``, alg 4 block rows).

Why here: only prefill's worker learns how many blocks decode asked for. Decode pulls the
blocks it does not hold itself; with a prefix-cache hit of its own that is fewer than prefill
holds, and prefill then sends its *last* ones (``_build_transfer_params``: "partial prefix
cache hit"). The scheduler never sees that number.

* prefill, ``start_load_kv(metadata)``: a request to send is first named with no blocks, in
  the step that schedules it; its prompt length is read from the model runner then (by the
  time the blocks follow, the request has left the runner);
* prefill, ``_build_transfer_params(ready_reqs, agent_meta, ...)``: called on the sender's
  event loop when decode's pull arrives, before anything is written to decode. For each
  request: the blocks about to go out (the last ``len(decode's blocks)``), the tokens they
  hold ``[first sent block * block size, prompt)``, and the digest of those blocks;
* decode, ``start_load_kv(metadata)``: the pulls issued (which blocks each fills);
  ``get_finished()``: the pulls that ended; the digest of each successful one's blocks,
  before any forward reads or writes them.

Both digests hash the same whole blocks (a byte copy moves them), so they match exactly when
the transfer delivered what prefill held. With tensor parallelism each rank holds its own
slice of every block (its kv heads) and hashes that: rank r reports part ``r`` of
``tp_size`` (``head_start`` r, ``head_count`` 1, ``total_heads`` the TP size), the sidecar adds
an end's parts up once every rank's is in, and compares two ends only when both were split
alike (the same TP size: docs/wire-format.md, alg 4). Only rank 0 reports the send itself
(every rank sends the same blocks). Their token range is the blocks' span counted from
the first block sent, ``[0, blocks * block size)``, on both ends. Host pools only: a device
pool would need a reduction read at an existing sync (as SGLang's), not written for vLLM.
"""

from __future__ import annotations

import logging

from . import _runtime as rt
from ._runtime import State
from .hooks_connector_worker import kv_digest, worker_connector
from .hooks_transfer import is_pd_connector, room_of_transfer

log = logging.getLogger("kvguard.vllm")


def attach(runner) -> None:
    """In the Worker, once (its first step): wrap the Mooncake connector's worker if that is
    the connector configured."""
    connector = worker_connector()
    worker = getattr(connector, "connector_worker", None)
    if (
        connector is None
        or not is_pd_connector(connector)
        or worker is None
        or getattr(worker, "__kvguard_wrapped__", False)
    ):
        return
    State.runner = runner
    rt.wrap_instance(worker, "start_load_kv", pre=start_load_kv_pre)
    if getattr(worker, "is_kv_producer", False) or not getattr(worker, "is_kv_consumer", False):
        rt.wrap_instance(worker, "_build_transfer_params", pre=build_transfer_params_pre)
    if not getattr(worker, "is_kv_producer", False):
        rt.wrap_instance(worker, "get_finished", post=get_finished_post)
    worker.__kvguard_wrapped__ = True
    log.info("kvguard: vLLM %s: prefill/decode sends and digests reported by this worker", type(connector).__name__)


def _layers() -> dict:
    """Each attention layer's KV tensor, by layer name (dimension 0: blocks); allocated before
    the first forward and never replaced, so looked up once."""
    if State.kv_layers:
        return State.kv_layers
    context = State.runner.compilation_config.static_forward_context
    layers = {}
    for name, layer in context.items():
        kv = getattr(layer, "kv_cache", None)
        if isinstance(kv, (list, tuple)):  # one per virtual engine in some releases
            kv = kv[0] if kv else None
        if kv is not None and getattr(kv, "numel", lambda: 0)():
            layers[name] = kv
    State.kv_layers = layers
    return layers


def _digest(block_ids) -> int | None:
    import torch

    return kv_digest(_layers(), torch.as_tensor(list(block_ids), dtype=torch.int64))


def _reports() -> bool:
    """This worker reports transfers: rank 0 (unless silent for another reason), and a rank > 0
    for its part of the digests."""
    return State.part_done and (not State.worker_silent or State.tp_rank > 0)


def start_load_kv_pre(worker, metadata, *args, **kwargs) -> None:
    if not _reports():
        return
    requests = getattr(State.runner, "requests", {})
    for rid, (transfer_id, block_ids) in (getattr(metadata, "reqs_to_send", None) or {}).items():
        if not block_ids and transfer_id not in State.send_prompts:
            cached = requests.get(rid)
            if cached is not None:
                State.send_prompts[transfer_id] = (rid, int(cached.num_prompt_tokens))
    for pulls in (getattr(metadata, "reqs_to_recv", None) or {}).values():
        for rid, pull in pulls.items():
            if pull.local_block_ids and pull.local_block_ids[0]:
                State.pulls[rid] = pull


def build_transfer_params_pre(worker, ready_reqs, agent_meta, *args, **kwargs) -> None:
    """Prefill is about to write these requests' blocks into decode's (the sender's loop)."""
    if not _reports():
        return
    p = rt.probes()
    ps = State.page_size
    for d_rid, send_meta in ready_reqs:
        wanted = agent_meta.req_blocks.get(d_rid)
        if not wanted or not wanted[1] or not send_meta.local_block_ids:
            continue
        held = list(send_meta.local_block_ids[0])
        n_remote = len(wanted[1][0])
        if n_remote == 0 or n_remote > len(held):  # nothing asked, or the engine refuses it
            continue
        known = State.send_prompts.pop(send_meta.transfer_id, None)
        if known is None:  # its prompt length was never seen here (attached mid-run)
            continue
        rid, prompt_tokens = known
        pages = held[len(held) - n_remote :]
        start = (len(held) - n_remote) * ps
        room = room_of_transfer(send_meta.transfer_id)
        if State.tp_rank == 0:
            p.transfer_sent(rid, room, start, max(start, prompt_tokens), pages, True, unit="pages")
        digest = _digest(pages)
        if digest is not None:
            p.transfer_digest(
                rid, room, "sender", digest, 0, n_remote * ps, len(_layers()), State.tp_rank, 1, State.tp_size,
                alg="block_rows",
            )  # fmt: skip


def get_finished_post(_token, result, worker, *args, **kwargs) -> None:
    """Decode: these pulls ended; hash what each successful one wrote, before it is read."""
    if not State.pulls or not result:
        return
    recving = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    p = rt.probes()
    ps = State.page_size
    for rid in recving or ():
        pull = State.pulls.pop(rid, None)
        if pull is None or getattr(pull, "failed", False):
            continue
        blocks = list(pull.local_block_ids[0])
        digest = _digest(blocks)
        if digest is not None:
            room = room_of_transfer(pull.transfer_id)
            p.transfer_digest(
                rid, room, "receiver", digest, 0, len(blocks) * ps, len(_layers()), State.tp_rank, 1, State.tp_size,
                alg="block_rows",
            )  # fmt: skip

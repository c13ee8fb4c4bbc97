"""The Worker's side of vLLM's reference KV connector (``ExampleConnector``): a digest of
the KV it stores and of the KV it loads, where the KV is (KV_DIGEST records).

The EngineCore reports the connector's stores and loads (hooks_connector.py) but holds no
KV; the Worker does. The sidecar joins each digest to its object by key and compares the
loaded bytes with the stored ones: an object changed at rest (a corrupted or swapped
file, another model's KV under the same key) is a ``checksum_mismatch`` via the load.

What is hashed: per attention layer (in name order), the rows of the layer's KV tensor
for the object's blocks, as they lie in the pool. The store's digest is taken in
``wait_for_save`` (after the forward that wrote and saved them), the load's right after
``start_load_kv`` put them in place (before the forward reads them), only when the
connector actually loaded (it skips a step without attention metadata). Both cover whole
blocks: the reference connector stores and loads ``align_to_block_size(len(prompt))``
tokens. Host pools only: on a device the digest would need a device reduction read at an
existing sync (as SGLang's transfer digests do), not written yet; such engines send no
KV_DIGEST and their loads are judged without one. Only a 64-bit hash leaves the engine.
"""

from __future__ import annotations

import logging

import xxhash

from . import _runtime as rt
from ._runtime import State
from .hooks_connector import STORE_AWARE, folder_key

log = logging.getLogger("kvguard.vllm")


def _worker_ready() -> bool:
    return State.part_done and not State.worker_silent


def _blocks(slot_mapping, block_size: int):
    import torch

    return torch.unique_consecutive(slot_mapping.to("cpu") // block_size)


def kv_digest(layers: dict, block_ids) -> int | None:
    """xxh3 over each layer's rows ``block_ids`` (dimension 0: blocks), layers in name order;
    None when the KV is not in host memory."""
    import torch

    h = xxhash.xxh3_64()
    for name in sorted(layers):
        kv = layers[name]
        if kv.device.type != "cpu":
            return None
        rows = kv.index_select(0, block_ids).contiguous()
        h.update(rows.view(-1).view(torch.uint8).numpy())
    return h.intdigest() or 1


def worker_connector():
    """This Worker's KV connector, or None (looked up lazily: no connector module is
    imported by the plugin's load)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None
    except Exception:  # noqa: BLE001 - no transfer state in this layout: nothing to watch
        return None


def attach() -> None:
    """In the Worker, once (its first step): wrap the reference connector's worker-side
    calls if that is the connector configured."""
    connector = worker_connector()
    if connector is None or getattr(connector, "__kvguard_wrapped__", False):
        return
    if not any(c.__name__ in STORE_AWARE for c in type(connector).__mro__):
        return
    rt.wrap_instance(connector, "start_load_kv", post=start_load_kv_post)
    rt.wrap_instance(connector, "save_kv_layer", post=save_kv_layer_post)
    rt.wrap_instance(connector, "wait_for_save", post=wait_for_save_post)
    connector.__kvguard_wrapped__ = True
    log.info("kvguard: vLLM KV connector %s: stored and loaded KV digested in this worker", type(connector).__name__)


def _emit(connector, requests, layers: dict, side: str) -> None:
    if not layers:
        return
    p = rt.probes()
    for req in requests:
        blocks = _blocks(req.slot_mapping, connector._block_size)
        digest = kv_digest(layers, blocks)
        if digest is None:  # device memory: not digested (module docstring)
            continue
        p.kv_digest(None, folder_key(connector, req.token_ids, req.mm_hashes), digest, side)


def start_load_kv_post(_token, _result, self, forward_context, *args, **kwargs) -> None:
    """The reference connector loaded its requests' KV into their blocks (when it ran: it
    returns early without attention metadata, and injects only with per-layer metadata)."""
    if not _worker_ready() or not isinstance(getattr(forward_context, "attn_metadata", None), dict):
        return
    loads = [r for r in self._get_connector_metadata().requests if not r.is_store]
    if not loads:
        return
    layers = {
        name: layer.kv_cache
        for name, layer in forward_context.no_compile_layers.items()
        if getattr(layer, "kv_cache", None) is not None
    }
    _emit(self, loads, layers, "loaded")


def save_kv_layer_post(_token, _result, self, layer_name, kv_layer, *args, **kwargs) -> None:
    """Which tensor each layer's save read (the same views ``start_load_kv`` writes)."""
    State.saved_layers[layer_name] = kv_layer


def wait_for_save_post(_token, _result, self, *args, **kwargs) -> None:
    """The forward is done and each layer saved: hash what was stored."""
    if not _worker_ready():
        return
    stores = [r for r in self._get_connector_metadata().requests if r.is_store]
    if stores:
        _emit(self, stores, dict(State.saved_layers), "stored")

"""The probes of the prefill/decode transfer and of the guard: a mixin of
:class:`~kvguard.engine_hooks.probes.Probes` (same failure policy, same ring), kept apart
so that probes.py holds the page and request probes."""

from __future__ import annotations

import numpy as np

from . import wire
from .probe_support import as_int64, guarded_probe

_SIDE = {"sender": wire.Side.SENDER, "receiver": wire.Side.RECEIVER}
_STATUS = {"success": wire.XferStatus.SUCCESS, "failed": wire.XferStatus.FAILED, "aborted": wire.XferStatus.ABORTED}
_DIGEST_ALG = {
    "unit_bytes": wire.DigestAlg.XXH3_UNIT_BYTES,
    "device_reduced": wire.DigestAlg.XXH3_DEVICE_REDUCED,
    "head_streams": wire.DigestAlg.XXH3_HEAD_STREAMS,
    "block_rows": wire.DigestAlg.XXH3_BLOCK_ROWS,
}


class TransferProbes:
    # the Probes attributes these methods use, declared for the type checker
    page_size: int

    def _emit(self, kind: wire.Kind, payload: bytes, flags: int = 0) -> None: ...
    def row_pages(self, row_start: int, slots): ...

    @guarded_probe
    def transfer_reserved(self, rid: str, room: int, tokens: int, slots_or_pages, unit: str = "slots") -> None:
        """Decode reserved ``slots_or_pages`` (in row order) for ``tokens`` tokens of the transfer."""
        if unit == "pages":
            pages = as_int64(slots_or_pages)
        elif unit == "slots":
            pages = self.row_pages(0, slots_or_pages)
        else:
            raise ValueError(f"unit must be 'pages' or 'slots', got {unit!r}")
        x = wire.XferReserve(wire.request_key(rid), int(room) & wire.NO_ROOM, int(tokens), pages)
        self._emit(wire.Kind.XFER_RESERVE, wire.xfer_reserve_payload(x))

    @guarded_probe
    def transfer_sent(
        self,
        rid: str,
        room: int,
        token_start: int,
        token_end: int,
        slots_or_pages,
        is_last: bool,
        unit: str = "pages",
        digest: int = 0,
    ) -> None:
        if unit == "pages":
            pages = as_int64(slots_or_pages)
        elif unit == "slots":
            pages = self.row_pages(int(token_start), slots_or_pages)
        else:
            raise ValueError(f"unit must be 'pages' or 'slots', got {unit!r}")
        x = wire.XferSend(
            wire.request_key(rid),
            int(room) & wire.NO_ROOM,
            int(digest) & wire.NO_ROOM,
            int(token_start),
            int(token_end),
            bool(is_last),
            pages,
        )
        self._emit(wire.Kind.XFER_SEND, wire.xfer_send_payload(x))

    @guarded_probe
    def transfer_done(self, rid: str, room: int, side: str, status: str) -> None:
        x = wire.XferDone(wire.request_key(rid), int(room) & wire.NO_ROOM, _SIDE[side], _STATUS[status])
        self._emit(wire.Kind.XFER_DONE, wire.xfer_done_payload(x))

    @guarded_probe
    def transfer_digest(
        self,
        rid: str,
        room: int,
        side: str,
        digest: int,
        token_start: int,
        token_end: int,
        layers: int,
        head_start: int,
        head_count: int,
        total_heads: int,
        alg: str = "unit_bytes",
    ) -> None:
        """One end's digest of a transfer's KV (docs/wire-format.md, "Transfer digests")."""
        x = wire.XferDigest(
            wire.request_key(rid),
            int(room) & wire.NO_ROOM,
            _SIDE[side],
            _DIGEST_ALG[alg],
            int(digest) & wire.NO_ROOM,
            int(token_start),
            int(token_end),
            int(layers),
            int(head_start),
            int(head_count),
            int(total_heads),
        )
        self._emit(wire.Kind.XFER_DIGEST, wire.xfer_digest_payload(x))

    @guarded_probe
    def guard_acted(
        self,
        rid: str,
        room: int,
        rule: str,
        action: str,
        *,
        prompt_tokens: int,
        send_tokens: int,
        reserved_pages: int,
        reason: str,
    ) -> None:
        """The guard (KVGUARD_GUARD) found ``rule`` about to be broken for ``rid`` and did
        ``action`` ("aborted" or "observed"); ``reserved_pages`` 0 when the sender cannot tell."""
        g = wire.Guard(
            wire.request_key(rid),
            int(room) & wire.NO_ROOM,
            wire.GuardRule[rule.upper()],
            wire.GuardAction[action.upper()],
            int(prompt_tokens),
            int(send_tokens),
            int(reserved_pages),
            str(reason or ""),
        )
        self._emit(wire.Kind.GUARD, wire.guard_payload(g))

    # ---------------------------------------------------------------- host / storage tiers
    def _tier_pages(self, slots_or_pages, unit: str):
        if unit == "pages":
            return as_int64(slots_or_pages)
        if unit == "slots":
            # in the object's order (wire contract 1.1), one entry per page: a store's page i and
            # a whole load's page i hold the same tokens (the content identity is carried by
            # position, sidecar/offload.py); a sorted set of pages loses that whenever the pool
            # handed them out of order
            pages = as_int64(slots_or_pages) // self.page_size
            if len(pages) > 1:
                pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
            return pages
        raise ValueError(f"unit must be 'pages' or 'slots', got {unit!r}")

    @guarded_probe
    def kv_stored(
        self,
        rid: str | None,
        object_key: int,
        slots_or_pages,
        *,
        digest: int = 0,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        unit: str = "pages",
    ) -> None:
        """Device pages copied out to a host / storage object (``rid`` None: a prefix-cache
        node's, no request's). ``object_key``: the adapter's stable 64-bit id of the object
        (the same id its load-back names); ``extra_key`` / ``cache_salt``: what the object is
        keyed by besides the tokens (hashed, as REQ_SCOPE)."""
        s = wire.KvStore(
            0 if rid is None else wire.request_key(rid),
            int(object_key) & wire.NO_ROOM,
            int(digest) & wire.NO_ROOM,
            wire.request_scope(extra_key, cache_salt),
            self._tier_pages(slots_or_pages, unit),
        )
        self._emit(wire.Kind.KV_STORE, wire.kv_store_payload(s))

    @guarded_probe
    def kv_loaded(
        self,
        rid: str | None,
        object_key: int,
        slots_or_pages,
        phase: str,
        *,
        digest: int = 0,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        unit: str = "pages",
    ) -> None:
        """A host / storage object loaded into device pages: ``phase`` "issued" (destination
        chosen, copy queued), "completed" (the bytes are there), "failed"."""
        x = wire.KvLoad(
            0 if rid is None else wire.request_key(rid),
            int(object_key) & wire.NO_ROOM,
            int(digest) & wire.NO_ROOM,
            wire.request_scope(extra_key, cache_salt),
            wire.LoadPhase[phase.upper()],
            self._tier_pages(slots_or_pages, unit),
        )
        self._emit(wire.Kind.KV_LOAD, wire.kv_load_payload(x))

    @guarded_probe
    def kv_digest(self, rid: str | None, object_key: int, digest: int, side: str) -> None:
        """One side's digest of object ``object_key``'s KV, computed where the KV is: ``side``
        "stored" (the bytes copied out of the device pages) or "loaded" (the bytes as they
        landed). ``rid`` None when the computing process does not know the request (vLLM's
        Worker): the sidecar joins it to the object's KV_STORE / KV_LOAD by key."""
        d = wire.KvDigest(
            0 if rid is None else wire.request_key(rid),
            int(object_key) & wire.NO_ROOM,
            int(digest) & wire.NO_ROOM,
            wire.TierSide[side.upper()],
        )
        self._emit(wire.Kind.KV_DIGEST, wire.kv_digest_payload(d))

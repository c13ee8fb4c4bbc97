"""Loads from a host / storage tier of an object the request may not read (sidecar/offload.py):
``checksum_mismatch`` (another model's KV, or other bytes than were stored) and
``cross_salt_prefix_share`` (stored under another cache scope), ``transfer_size_mismatch``
(more pages loaded than the object was stored from), ``evidence.via = "load"``."""

from __future__ import annotations

from typing import ClassVar

from ..catalogue import KIND
from ..events import LoadedObjectMismatch
from ..findings import CRITICAL, Finding
from .base import At
from .reads import reader_party

WHAT = {
    KIND.checksum_mismatch: "loaded KV from a host / storage object that is not what was stored for it",
    KIND.transfer_size_mismatch: "loaded more pages from a host / storage object than it was stored from",
    KIND.cross_salt_prefix_share: "loaded KV from a host / storage object stored under another cache scope (salt / extra key)",
}


class OffloadDetector:
    kinds: ClassVar[tuple[str, ...]] = (
        KIND.checksum_mismatch,
        KIND.cross_salt_prefix_share,
        KIND.transfer_size_mismatch,
    )
    events: ClassVar[tuple[type, ...]] = (LoadedObjectMismatch,)

    def observe(self, event: LoadedObjectMismatch, at: At) -> list[Finding]:
        engine, reader = at.engine, event.reader
        who = f"request {reader.rid} (tenant {reader.tenant or '?'})" if reader is not None else "a cache prefetch"
        # whose KV the reader got: the object's owner, or, when the loaded bytes are another
        # remembered object's (the tier served the wrong object), that object's owner
        exposed = [event.stored_by] if event.stored_by is not None else []
        if event.loaded_from_key:
            exposed = [event.loaded_from] if event.loaded_from is not None else []
        merged: dict[str, dict] = {}  # one finding per kind (another model and other bytes: one mismatch)
        for kind, evidence in event.problems:
            merged.setdefault(kind, {}).update(evidence)
        out = []
        for kind, evidence in merged.items():
            summary = f"{engine.role} rank {engine.rank}: {who} {WHAT[kind]} (object {event.object_key:016x})"
            if kind == KIND.checksum_mismatch and event.loaded_from_key:
                evidence["loaded_object_key"] = f"{event.loaded_from_key:016x}"
                summary += f"; the bytes loaded are object {event.loaded_from_key:016x}'s"
            if exposed:
                p = exposed[0]
                summary += f"; it holds the KV of request {p.rid} (tenant {p.tenant or '?'})"
            out.append(
                Finding(
                    kind,
                    CRITICAL,
                    engine,
                    reader_party(reader) if reader is not None else None,
                    sorted(int(p) for p in set(event.pages.tolist())),
                    list(exposed),
                    at.ts_ns,
                    summary,
                    {"via": "load", "object_key": f"{event.object_key:016x}", **evidence},
                )
            )
        return out

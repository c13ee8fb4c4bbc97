"""KV copied out to a host / storage tier and loaded back (KV_STORE, KV_LOAD; SGLang's
HiCache device <-> host <-> storage, LMCache's tiers): the stored-objects component. It owns
the objects' model (what was stored, by whom, under which scope and digest) and reads the
engines' page models; the pipeline routes KV_STORE, KV_LOAD and KV_DIGEST to it.

What can go wrong, and what the sidecar says (docs/detectors.md):

- a store of pages that hold no KV written at their current allocation (freed, or
  reallocated and not yet written): the object holds someone else's stale KV, and a
  later hit serves it: ``unwritten_send`` with ``evidence.via = "offload"``;
- a load that completes after its destination pages were freed or handed to another
  request (SGLang #31427 / #30321: a load-back racing an eviction): ``late_write`` /
  ``use_after_free`` with ``evidence.via = "load"``, as a late transfer chunk;
- a load into more pages than its object was stored from (a truncated store):
  ``transfer_size_mismatch`` with ``evidence.direction = "load_past_object"``, via the load;
- a load of an object stored under another prefix-cache scope than the lookup's (a salt
  dropped on the way to an external cache, SGLang #37160, LMCache #4825):
  ``cross_salt_prefix_share`` with ``evidence.via = "load"``;
- a load of an object stored by an engine serving another model, or whose digest differs
  from the stored one (LMCache #4385, SGLang #24758): ``checksum_mismatch`` with
  ``evidence.via = "load"``. The digests come in the KV_STORE / KV_LOAD records, or, when
  another process of the engine holds the KV (vLLM's Worker), in KV_DIGEST records joined
  to the object by key: a stored digest may come before its KV_STORE (the Worker hashes as
  the forward saves; the EngineCore says KV_STORE after the step) and is kept for it; a
  loaded digest comes after its KV_LOAD completed and is compared at once.

The completed load's pages count as written by the request it was loaded for (or by
the cache, for a prefetch), so reads of loaded prefixes are judged like any other.

Content identity (KVGUARD_PAGE_IDENTITY, sidecar/page_identity.py): a store keeps the
identities its pages had (what prefix each holds, and whose tokens), and a load of the whole
object gives them to the pages it fills, when it is issued (the reader's prefix-cache ``hit``
record follows its admission, before the copy completes). So a lookup that hands a reader
another prefix's stored object (a tier or a tree serving the wrong KV under a key) is a
``prefix_content_mismatch`` naming whose tokens the object holds, where the object's own
digest, intact, says nothing. A load of part of an object (a radix node split since) gives
no identity: which of the object's pages it took is not in the record.
Objects are remembered (model, scope, digest, who stored them) up to ``MAX_OBJECTS``,
oldest forgotten first (counted); a load of an object not remembered is counted as
unverified, never guessed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvguard.engine_hooks import wire

from .detectors.reads import reader_party
from .events import LoadedObjectMismatch, ReadVerdict, SourcePagesSent
from .findings import Finding, Party
from .outlet import Outlet
from .page_identity import IdentityCounts, carry_loaded, stored_identities
from .page_pool import FREE, PADDING_PAGE, UNKNOWN
from .request_directory import RequestInfo

if TYPE_CHECKING:
    from .tracker import EngineTracker

MAX_OBJECTS = 100_000  # ~120 bytes each: 12 MB at most
MAX_PENDING_LOADS = 10_000
MAX_PENDING_DIGESTS = 10_000  # stored digests waiting for their KV_STORE; loads remembered for their digest
# stored objects' page identities (17 bytes per page): at most this many pages, oldest objects' first to go
MAX_IDENTITY_PAGES = 1 << 20
CACHE = RequestInfo(0, rid="(prefix cache)", tenant="")  # the writer / reader of a cache node's store or load


@dataclass(slots=True)
class StoredObject:
    model: str
    scope: int
    digest: int
    stored_by: Party | None  # the request whose KV it holds, when the store named one
    pages: int = 0  # how many device pages it was stored from (0: not said)


class StoredObjects:
    """Objects stored to a host / storage tier, and the loads of them (bounded, oldest forgotten)."""

    def __init__(self, out: Outlet, identity: IdentityCounts | None = None) -> None:
        self.out = out
        self.identity_counts = identity if identity is not None else IdentityCounts()
        # object key -> its pages' identities at the store (ids, whose tokens, known), bounded by pages
        self.stored_identities: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self.stored_identity_pages = 0
        self.stored_objects: OrderedDict[int, StoredObject] = OrderedDict()
        self.pending_loads: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.objects_forgotten = 0
        self.loads_unverified = 0  # completed loads of objects this sidecar never saw stored
        self.load_digests_compared = 0  # loads whose digest was compared with the stored one
        # (engine, object key) -> a stored digest whose KV_STORE has not come yet
        self.pending_store_digests: OrderedDict[tuple, int] = OrderedDict()
        # (engine, object key) -> (request key, pages) of its latest completed load, for its KV_DIGEST
        self.recent_loads: OrderedDict[tuple, tuple[int, np.ndarray]] = OrderedDict()
        # digest -> the key of the latest remembered object with it: a load whose bytes are not its
        # object's names the object they are (a tier serving the wrong object, LMCache #4385)
        self.keys_by_digest: dict[int, int] = {}

    # ------------------------------------------------------------------ stores
    def on_kv_store(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body: wire.KvStore = rec.body
        info = t.requests.get(body.req_key) if body.req_key else CACHE
        model = t.hello.model if t.hello is not None else ""
        stored_by = reader_party(info) if info is not None and body.req_key else None
        digest = body.digest or self.pending_store_digests.pop((t.engine_id, body.object_key), 0)
        self.stored_objects[body.object_key] = StoredObject(model, body.scope, digest, stored_by, len(body.pages))
        self.stored_objects.move_to_end(body.object_key)
        self._index_digest(digest, body.object_key)
        while len(self.stored_objects) > MAX_OBJECTS:
            key, gone = self.stored_objects.popitem(last=False)
            if self.keys_by_digest.get(gone.digest) == key:
                del self.keys_by_digest[gone.digest]
            self._remember_identities(key, None)
            self.objects_forgotten += 1
        if info is None or t.hello is None or (body.req_key and (not info.known or info.warmup)):
            return []
        pages = t.pool.ensure(body.pages.astype(np.int64))
        pages = pages[pages != PADDING_PAGE]
        self._remember_identities(body.object_key, stored_identities(t.pool, pages))
        pool = t.pool
        known = pages[pool.state[pages] != UNKNOWN]
        freed = known[pool.state[known] == FREE]
        unwritten = known[(pool.state[known] != FREE) & (pool.written_gen[known] != pool.gen[known])]
        if len(freed) == 0 and len(unwritten) == 0:
            return []
        verdict = ReadVerdict(info, unwritten, np.zeros(0, np.int64), freed, 0)
        event = SourcePagesSent(verdict, wire.NO_ROOM, 0, 0, None, via="offload", object_key=body.object_key)
        return self.out.emit(self.out.observe(event, t, rec.ts_ns))

    # ------------------------------------------------------------------ loads
    def on_kv_load(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body: wire.KvLoad = rec.body
        key = (rec.engine_id, body.object_key, body.req_key)
        pages = t.pool.ensure(body.pages.astype(np.int64))
        pages = pages[pages != PADDING_PAGE]
        if body.phase == wire.LoadPhase.ISSUED:
            stored = self.stored_identities.get(body.object_key)
            obj = self.stored_objects.get(body.object_key)
            if stored is not None and obj is not None and len(pages) == obj.pages:  # (a whole object only)
                carry_loaded(t.pool, pages, stored, self.identity_counts)
            self.pending_loads[key] = (pages, t.pool.gen[pages].copy())
            while len(self.pending_loads) > MAX_PENDING_LOADS:
                self.pending_loads.popitem(last=False)
            return []
        issued = self.pending_loads.pop(key, None)
        if body.phase != wire.LoadPhase.COMPLETED or t.hello is None:
            return []
        found = self._load_landed(t, body, pages, issued, rec.ts_ns)
        found += self._load_matches_object(t, body, pages, rec.ts_ns)
        _remember(self.recent_loads, (t.engine_id, body.object_key), (body.req_key, pages))
        return found

    # ------------------------------------------------------------------ digests from elsewhere
    def on_kv_digest(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body: wire.KvDigest = rec.body
        key = (t.engine_id, body.object_key)
        if body.side == wire.TierSide.STORED:
            obj = self.stored_objects.get(body.object_key)
            if obj is not None and not obj.digest:
                obj.digest = body.digest
                self._index_digest(body.digest, body.object_key)
            else:  # its KV_STORE is still to come (or replaces an older object of that key)
                _remember(self.pending_store_digests, key, body.digest)
            return []
        obj = self.stored_objects.get(body.object_key)
        if obj is None or not obj.digest or not body.digest or t.hello is None:
            return []  # (the load itself was counted unverified when it completed)
        self.load_digests_compared += 1
        if obj.digest == body.digest:
            return []
        req_key, pages = self.recent_loads.get(key, (body.req_key, np.zeros(0, np.int64)))
        reader = t.requests.get(req_key) if req_key else None
        if reader is not None and reader.warmup:
            return []
        evidence = {"stored_digest": f"{obj.digest:016x}", "loaded_digest": f"{body.digest:016x}"}
        event = LoadedObjectMismatch(
            reader, pages, body.object_key, obj.stored_by, (("checksum_mismatch", evidence),),
            *self._object_with(body.digest, body.object_key),
        )  # fmt: skip
        return self.out.emit(self.out.observe(event, t, rec.ts_ns))

    def _remember_identities(self, object_key: int, stored) -> None:
        """The stored pages' identities for the object (replacing what its key held), bounded."""
        gone = self.stored_identities.pop(object_key, None)
        if gone is not None:
            self.stored_identity_pages -= len(gone[0])
        if stored is None:
            return
        self.stored_identities[object_key] = stored
        self.stored_identity_pages += len(stored[0])
        while self.stored_identity_pages > MAX_IDENTITY_PAGES:
            _key, old = self.stored_identities.popitem(last=False)
            self.stored_identity_pages -= len(old[0])

    def _index_digest(self, digest: int, object_key: int) -> None:
        if digest:
            self.keys_by_digest[digest] = object_key

    def _object_with(self, digest: int, other_than: int) -> tuple[int, Party | None]:
        """The remembered object (key, whose KV) whose stored digest is ``digest``, if another
        than ``other_than``; (0, None) when none is."""
        key = self.keys_by_digest.get(digest, 0)
        obj = self.stored_objects.get(key) if key and key != other_than else None
        if obj is None or obj.digest != digest:
            return 0, None
        return key, obj.stored_by

    def _load_landed(self, t: EngineTracker, body: wire.KvLoad, pages, issued, ts_ns: int) -> list[Finding]:
        """The bytes are in ``pages`` now: still where the load was meant to go?"""
        pool = t.pool
        moved = np.zeros(0, np.int64)
        if issued is not None:  # pages freed and handed out again since the load was issued
            was, gens = issued
            same = was[: len(pages)] == pages[: len(was)]
            moved = pages[: len(same)][same & (pool.gen[pages[: len(same)]] != gens[: len(same)])]
        verdict = t.judge.check_write(body.req_key, pages, require_known_writer=False)
        # the object's KV is in those pages now, whoever holds them: it is what a stray read of
        # them exposes (as a transfer chunk's); whether they count as written is decided below
        t.pool.writer_slot[pages] = t.pool.slot(body.req_key)
        t.pool.mark_write_time(pages, ts_ns)
        found: list[Finding] = []
        bad = np.zeros(0, np.int64)
        if verdict is not None:
            bad = np.concatenate((verdict.freed, verdict.foreign))
            found = self.out.observe(verdict, t, ts_ns)
            t.mark_overwritten(verdict.foreign)
            for f in found:
                f.evidence.update({"via": "load", "object_key": f"{body.object_key:016x}"})
        good = np.setdiff1d(pages, np.concatenate((bad, moved)))
        if len(good):
            t.mark_written(body.req_key, good, ts_ns)
        return self.out.emit(found)

    def _load_matches_object(self, t: EngineTracker, body: wire.KvLoad, pages, ts_ns: int) -> list[Finding]:
        """Is the object what was stored under this key, for this model and scope?"""
        obj = self.stored_objects.get(body.object_key)
        if obj is None:
            self.loads_unverified += 1
            return []
        reader = t.requests.get(body.req_key) if body.req_key else None
        if reader is not None and reader.warmup:
            return []
        model = t.hello.model if t.hello is not None else ""
        problems: list[tuple[str, dict]] = []
        if obj.model and model and obj.model != model:
            problems.append(("checksum_mismatch", {"stored_model": obj.model, "loaded_model": model}))
        if obj.digest and body.digest:
            self.load_digests_compared += 1
        if obj.digest and body.digest and obj.digest != body.digest:
            problems.append(
                ("checksum_mismatch", {"stored_digest": f"{obj.digest:016x}", "loaded_digest": f"{body.digest:016x}"})
            )
        if obj.pages and len(pages) > obj.pages:
            # the load fills more pages than the object holds: those past its end get bytes
            # that were never stored for this key (a truncated store: the reference vLLM
            # connector under chunked prefill saves only the first chunk's blocks)
            problems.append(
                (
                    "transfer_size_mismatch",
                    {"direction": "load_past_object", "stored_pages": obj.pages, "loaded_pages": len(pages)},
                )
            )
        reader_scope = body.scope  # the scope of the lookup that found the object
        if obj.scope != reader_scope:
            problems.append(
                (
                    "cross_salt_prefix_share",
                    {"reader_scope": f"{reader_scope:016x}", "writer_scopes": [f"{obj.scope:016x}"]},
                )
            )
        if not problems:
            return []
        loaded_from = self._object_with(body.digest, body.object_key) if body.digest else (0, None)
        event = LoadedObjectMismatch(reader, pages, body.object_key, obj.stored_by, tuple(problems), *loaded_from)
        return self.out.emit(self.out.observe(event, t, ts_ns))


def _remember(table: OrderedDict, key, value) -> None:
    """Bounded: the oldest entry goes first."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_PENDING_DIGESTS:
        table.popitem(last=False)

"""The probe API: what engine adapters call, turned into wire records on the ring.

Adapters (``engine_hooks/sglang`` today) map engine functions onto these methods and
pass engine values as they come (torch tensors or numpy arrays of *token slots*);
this module converts slots to page ids, hashes request ids into 64-bit keys and
appends one record per call. It only appends: the sidecar does all the reasoning.

Threading and failure contract: every public method may be called from any engine
thread; it never blocks on the consumer and never raises into the engine. A probe
that fails is logged once with the reason, counted, reported to the sidecar as a
PROBE_ERROR record, and disabled for the rest of the process.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time

import numpy as np

from . import tier1 as tier1_mod
from . import wire
from .probe_support import as_int64, guarded_probe, is_ones
from .probes_transfer import TransferProbes
from .ring import DEFAULT_CAPACITY, RingSpaceError, RingWriter, ring_dir

log = logging.getLogger("kvguard.probes")

KVGUARD_VERSION = "0.1.0"
HEARTBEAT_INTERVAL_NS = 1_000_000_000
MAX_CACHED_KEYS = 1 << 16  # rid -> request key cache (cleared when full)

_ROLES = {
    "unified": wire.Role.UNIFIED,
    "null": wire.Role.UNIFIED,
    "prefill": wire.Role.PREFILL,
    "decode": wire.Role.DECODE,
}
_FINISH = {
    "stop": wire.Finish.STOP,
    "length": wire.Finish.LENGTH,
    "abort": wire.Finish.ABORT,
    "reject": wire.Finish.REJECT,
    "unknown": wire.Finish.UNKNOWN,
}
_FREE = {
    "free": wire.FreeKind.FREE,
    "group": wire.FreeKind.GROUP,
    "deferred": wire.FreeKind.DEFERRED,
    "page_ids": wire.FreeKind.PAGE_IDS,
}
_IDENTITY_PHASE = {"written": wire.IdentityPhase.WRITTEN, "hit": wire.IdentityPhase.HIT}
_PHASE = {
    "admission": wire.Phase.ADMISSION,
    "prefill": wire.Phase.PREFILL,
    "decode": wire.Phase.DECODE,
    "transfer": wire.Phase.TRANSFER,
    "client_abort": wire.Phase.CLIENT_ABORT,
}


_SMALL = 64  # below this many values, Python sets beat np.unique's fixed cost (~3 µs)
# One decode ASSIGN's payload: wire.ASSIGN_FIXED with count 1, then its one int32 page
# (exactly wire.assign_payload's bytes; tests/engine_side/test_probes.py checks it)
_ASSIGN_ONE = struct.Struct(wire.ASSIGN_FIXED.format + "i")
_PAGES_ONE = struct.Struct(wire.PAGES_FIXED.format + "i")  # ALLOC / FREE of one page


_ONES_U32: dict[int, np.ndarray] = {}


def _ones_u32(n: int) -> np.ndarray:
    """``n`` ones (uint32, read-only), kept per length: a decode step's write counts."""
    ones = _ONES_U32.get(n)
    if ones is None:
        if len(_ONES_U32) >= 64:
            _ONES_U32.clear()
        ones = _ONES_U32[n] = np.ones(n, np.uint32)
        ones.flags.writeable = False
    return ones


class Probes(TransferProbes):
    """``Probes(None)`` is a no-op. With ``no_ring_reason`` (the ring could not be made: a
    full ring volume, a bad directory) it also counts, in ``dropped_no_ring``, the probe
    records it does not write (one per probe call), and logs the running total now and
    then so that an engine log shows the blind engine long after its startup line."""

    def __init__(self, writer: RingWriter | None, page_size: int = 1, no_ring_reason: str = ""):
        self.writer = writer
        self.enabled = writer is not None
        self.no_ring_reason = no_ring_reason if writer is None else ""
        self.dropped_no_ring = 0
        self._next_drop_note = 1000
        self.page_size = page_size
        self.pool_page_sizes: dict[int, int] = {}  # pool index -> page size, for pools besides 0 (pool_declared)
        self.disabled_probes: set[str] = set()
        self.probe_errors = 0
        self.calls = 0
        self._last_heartbeat_ns = 0
        self._error_lock = threading.Lock()
        self._keys: dict = {}  # rid -> request key: hashing every rid of every forward costs more than the rest
        self._last_batch: tuple = ([], np.zeros(0, np.uint64))  # (rids, keys) of the last request_keys call
        # Tier 1, the engine's own read check (engine_hooks/tier1.py): created at HELLO when
        # KVGUARD_TIER1 is on, and fed by the allocation / assignment probes below
        self.tier1: tier1_mod.Tier1 | None = None

    def request_key(self, rid) -> int:
        key = self._keys.get(rid)
        if key is None:
            if len(self._keys) >= MAX_CACHED_KEYS:
                self._keys.clear()
            key = self._keys[rid] = wire.request_key(rid)
        return key

    def request_keys(self, rids) -> np.ndarray:
        """uint64 keys of ``rids`` (read-only: the array may be handed out again), from the
        cache (one dict lookup each when all are known). A decode batch keeps its requests
        for many steps: the same list as last time costs one list compare (~0.1 µs at batch
        256, the same string objects) instead of 256 lookups (~10 µs)."""
        last_rids, last_keys = self._last_batch
        if type(rids) is list and rids == last_rids:
            return last_keys
        try:
            keys = np.fromiter(map(self._keys.__getitem__, rids), dtype=np.uint64, count=len(rids))
        except KeyError:
            keys = np.fromiter(map(self.request_key, rids), dtype=np.uint64, count=len(rids))
        if type(rids) is list:
            self._last_batch = (list(rids), keys)
        return keys

    # ------------------------------------------------------------------ helpers
    def _dropped_for_want_of_a_ring(self) -> None:
        n = self.dropped_no_ring = self.dropped_no_ring + 1
        if n >= self._next_drop_note:
            self._next_drop_note = n * 1000
            try:
                log.warning("kvguard: %d probe records dropped so far: no ring (%s)", n, self.no_ring_reason)
            except Exception:  # noqa: BLE001 - the engine must never see our failures
                pass

    def _ring(self) -> RingWriter:
        """The ring: a probe that writes runs only when there is one (``enabled``, see
        ``guarded_probe``; the other writers check ``writer`` themselves)."""
        writer = self.writer
        assert writer is not None, "a probe wrote with no ring"
        return writer

    def _emit(self, kind: wire.Kind, payload: bytes, flags: int = 0, pool: int = 0) -> None:
        self.calls += 1
        writer = self.writer
        assert writer is not None, "a probe wrote with no ring"  # (``_ring``, inlined: every record comes here)
        writer.write(kind, payload, pool=pool, flags=flags)

    def slots_to_pages(self, slots) -> np.ndarray:
        """Unique page ids (sorted) covering these token slots."""
        a = as_int64(slots)
        if len(a) <= _SMALL:  # a decode step's few new pages
            ps = self.page_size
            return np.array(sorted({x // ps for x in a.tolist()}), dtype=np.int64)
        return np.unique(a // self.page_size)

    def row_pages(self, row_start: int, slots) -> np.ndarray:
        """One page per row page-index: the page holding each page-aligned position.

        ``slots`` holds the row's slots for positions ``row_start, row_start+1, ...``;
        a paged allocator keeps each page-aligned run of positions inside one page,
        so the first position of each run names the page.
        """
        slots = as_int64(slots)
        if len(slots) == 0:
            return slots
        first = (-row_start) % self.page_size  # offset of the first page-aligned position
        idx = np.arange(first, len(slots), self.page_size)
        if first:
            idx = np.concatenate(([0], idx))
        return slots[idx] // self.page_size

    def report_probe_error(self, name: str, exc: BaseException) -> None:
        with self._error_lock:
            self.probe_errors += 1
            count = self.probe_errors
        log.warning("kvguard probe %s failed and is disabled: %s: %s", name, type(exc).__name__, exc)
        if self.writer is not None:
            try:
                self.writer.write(
                    wire.Kind.PROBE_ERROR, wire.probe_error_payload(wire.ProbeError(count, name, type(exc).__name__))
                )
            except Exception:  # noqa: BLE001
                pass

    def _maybe_heartbeat(self) -> None:
        now = time.monotonic_ns()
        if now - self._last_heartbeat_ns >= HEARTBEAT_INTERVAL_NS:
            self._last_heartbeat_ns = now
            w = self._ring()
            self._emit(
                wire.Kind.HEARTBEAT,
                wire.heartbeat_payload(wire.Heartbeat(w.records_written, w.dropped_records, self.probe_errors)),
            )

    # ------------------------------------------------------------------ probes
    @guarded_probe
    def hello(
        self,
        role: str,
        tp_rank: int,
        page_size: int,
        pool_pages: int,
        pool_tokens: int,
        context_len: int,
        max_req_input_len: int,
        engine_name: str,
        engine_version: str,
        model: str,
        pid: int | None = None,
    ) -> None:
        """The engine's identity (first record of every engine). ``pid``: the engine process's
        (default: this process's; a recording made outside the engine passes each engine's own)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self.pool_page_sizes = {}  # a new HELLO: the pools are declared again after it
        if self.tier1 is None and tier1_mod.enabled_from_env():
            self.start_tier1(int(pool_pages))
        h = wire.Hello(
            _ROLES[str(role).lower()],
            int(tp_rank),
            os.getpid() if pid is None else int(pid),
            self.page_size,
            int(pool_pages),
            int(pool_tokens),
            int(context_len),
            int(max_req_input_len),
            engine_name,
            engine_version,
            str(model),
            KVGUARD_VERSION,
        )
        self.calls += 1
        self._ring().write_sticky(wire.Kind.HELLO, wire.hello_payload(h))

    @guarded_probe
    def engine_part(self, primary_pid: int, part: str, rank: int, page_size: int) -> None:
        """Instead of a HELLO, in a process that is one part of an engine whose HELLO another
        process sends (vLLM's Worker: forwards; its EngineCore: pages and requests). The
        sidecar applies this ring's records to that engine's timeline, merged by time."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        p = wire.EnginePart(int(primary_pid), wire.PartRole[part.upper()], int(rank))
        self.calls += 1
        self._ring().write_sticky(wire.Kind.ENGINE_PART, wire.engine_part_payload(p))

    @guarded_probe
    def coverage(self, items) -> None:
        """What the adapter found in the engine and what of it kvguard watches (contract 1.5),
        after HELLO: ``items`` are ``wire.CoverageItem``. Kept with the HELLO in the ring's
        header, so a sidecar that attaches later still learns what is not watched."""
        c = wire.Coverage(list(items)[: wire.MAX_COVERAGE_ITEMS])
        self.calls += 1
        self._ring().write_sticky(wire.Kind.COVERAGE, wire.coverage_payload(c), pool=0, append=True)

    @guarded_probe
    def pool_declared(
        self,
        pool: int,
        page_size: int,
        pool_pages: int,
        kind: str,
        name: str,
        window_tokens: int = 0,
        shares_pages: bool = False,
    ) -> None:
        """A KV pool besides pool 0 (contract 1.5): its records (``pool=`` on the page probes
        below) form a timeline of their own in the sidecar. After HELLO, before any of them.
        ``shares_pages``: its page ids are pool 0's (one allocator and the same memory, as
        vLLM's KV cache groups): its ALLOC / FREE go on pool 0, its rows and forwards on it."""
        if not 0 < int(pool) < 1 << 16:
            raise ValueError(f"pool index must be 1..65535, got {pool}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool_page_sizes[int(pool)] = int(page_size)
        info = wire.PoolInfo(
            int(page_size), int(pool_pages), int(window_tokens), wire.PoolKind[kind.upper()], name, bool(shares_pages)
        )
        self.calls += 1
        self._ring().write_sticky(wire.Kind.POOL, wire.pool_payload(info), pool=int(pool), append=True)

    def use_pool_page_size(self, pool: int, page_size: int) -> None:
        """The page size of a pool this process writes records for but did not declare (vLLM's
        Worker: its EngineCore declares the pools, the Worker's forwards name them)."""
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool_page_sizes[int(pool)] = int(page_size)

    @guarded_probe
    def request_begin(
        self,
        rid: str,
        tenant: str,
        bootstrap_room: int | None,
        prompt_tokens: int,
        cached_tokens: int,
        warmup: bool,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        room = wire.NO_ROOM if bootstrap_room is None else int(bootstrap_room) & wire.NO_ROOM
        r = wire.ReqBegin(
            wire.request_key(rid),
            room,
            int(prompt_tokens),
            int(cached_tokens),
            bool(warmup),
            str(rid),
            str(tenant or ""),
        )
        self._emit(wire.Kind.REQ_BEGIN, wire.req_begin_payload(r))
        if extra_key or cache_salt:  # its prefix-cache scope, as a hash only (contract 1.1)
            s = wire.ReqScope(r.req_key, wire.request_scope(extra_key, cache_salt))
            self._emit(wire.Kind.REQ_SCOPE, wire.req_scope_payload(s))

    @guarded_probe
    def request_end(
        self,
        rid: str,
        finish: str,
        ttft_ns: int,
        e2e_ns: int,
        output_tokens: int,
        reason: str,
        reprefilled: bool = False,
    ) -> None:
        r = wire.ReqEnd(
            wire.request_key(rid),
            max(0, int(ttft_ns)),
            max(0, int(e2e_ns)),
            int(output_tokens),
            _FINISH.get(finish, wire.Finish.UNKNOWN),
            str(reason or ""),
            bool(reprefilled),
        )
        self._emit(wire.Kind.REQ_END, wire.req_end_payload(r))

    @guarded_probe
    def pages_allocated(self, slots, page_starts: bool = False) -> None:
        """The pages holding ``slots`` were allocated. ``page_starts``: each slot is the first of
        its page (an allocator's new pages), so the pages are distinct: no de-duplication."""
        pages = as_int64(slots) // self.page_size if page_starts else self.slots_to_pages(slots)
        if len(pages):
            if self.tier1 is not None:
                self.tier1.allocated(pages)
            self._emit(wire.Kind.ALLOC, wire.pages_payload(pages))

    @guarded_probe
    def page_ids_allocated(self, page_ids: list, pool: int = 0) -> None:
        """``pages_allocated`` for an engine that hands out whole pages (vLLM's blocks): page
        ids, not slots. One page (a decode step's new block, the usual case) is encoded
        without numpy: at batch 256 a whole batch crosses into new blocks in one step.
        ``pool``: the pool they belong to (0, or one declared by ``pool_declared``)."""
        if not page_ids:
            return
        tier1 = self.tier1 if pool == 0 else None
        if len(page_ids) == 1:
            if tier1 is not None:
                tier1.allocated(np.asarray(page_ids, np.int64))
            self._emit(wire.Kind.ALLOC, _PAGES_ONE.pack(1, 0, int(page_ids[0])), pool=pool)
            return
        pages = np.unique(as_int64(page_ids))
        if tier1 is not None:
            tier1.allocated(pages)
        self._emit(wire.Kind.ALLOC, wire.pages_payload(pages), pool=pool)

    @guarded_probe
    def pages_freed(self, slots, kind: str = "free", pool: int = 0) -> None:
        free_kind = _FREE[kind]
        if free_kind == wire.FreeKind.PAGE_IDS:
            pages = np.unique(as_int64(slots))
        elif pool:
            pages = np.unique(as_int64(slots) // self.pool_page_sizes.get(pool, self.page_size))
        else:
            pages = self.slots_to_pages(slots)
        if len(pages):
            if self.tier1 is not None and pool == 0:
                self.tier1.freed(pages)
            self._emit(wire.Kind.FREE, wire.pages_payload(pages, free_kind), pool=pool)

    @guarded_probe
    def rows_assigned(self, rid: str, row_start: int, row_end: int, shared_until: int, slots, pool: int = 0) -> None:
        """Request ``rid``'s row positions ``[row_start, row_end)`` hold ``slots`` (one per
        position). ``pool``: a pool declared with the same page size as pool 0 (a hybrid
        sliding-window engine's SWA pool, whose slots are its own)."""
        row_start, row_end = int(row_start), int(row_end)
        shared_until = min(max(int(shared_until), row_start), row_end)
        if pool and self.pool_page_sizes.get(pool, self.page_size) != self.page_size:
            raise ValueError(f"pool {pool}'s page size is not pool 0's: send its rows as pages")
        pages = self.row_pages(row_start, slots)
        if self.tier1 is not None and pool == 0:
            self.tier1.assigned(rid, row_start, shared_until, pages)
        a = wire.Assign(self.request_key(rid), row_start, row_end, shared_until, pages)
        self._emit(wire.Kind.ASSIGN, wire.assign_payload(a), pool=pool)

    @guarded_probe
    def row_pages_assigned(
        self, rid: str, row_start: int, row_end: int, shared_until: int, pages, pool: int = 0
    ) -> None:
        """``rows_assigned`` for an engine that hands out whole pages (vLLM's blocks): ``pages``
        holds one page id per row page from ``row_start`` (page-aligned) on."""
        row_start, row_end = int(row_start), int(row_end)
        page_size = self.pool_page_sizes.get(pool, self.page_size) if pool else self.page_size
        if row_start % page_size:
            raise ValueError(f"row_start {row_start} is not a multiple of the page size {page_size}")
        shared_until = min(max(int(shared_until), row_start), row_end)
        pages = as_int64(pages)
        if self.tier1 is not None and pool == 0:
            self.tier1.assigned(rid, row_start, shared_until, pages)
        a = wire.Assign(self.request_key(rid), row_start, row_end, shared_until, pages)
        self._emit(wire.Kind.ASSIGN, wire.assign_payload(a), pool=pool)

    @guarded_probe
    def page_identity(self, rid: str, first_row_page: int, phase: str, ids) -> None:
        """The content identities (engine_hooks/page_identity.py) of request ``rid``'s full row
        pages ``first_row_page`` onwards: ``written``, pages its forwards filled; ``hit``, pages
        the prefix cache handed it (contract 1.6). After the ASSIGN that put them in its row."""
        ids = np.ascontiguousarray(ids, dtype=np.uint64)
        if len(ids) == 0:
            return
        body = wire.PageIdentity(self.request_key(rid), int(first_row_page), _IDENTITY_PHASE[phase], ids)
        self._emit(wire.Kind.PAGE_IDENTITY, wire.page_identity_payload(body))

    @guarded_probe
    def decode_rows_assigned(self, rids, positions, slots, pool: int = 0) -> None:
        """One token each: request ``rids[i]``'s position ``positions[i]`` went to slot
        ``slots[i]``. The same records as ``rows_assigned(rid, pos, pos + 1, pos, [slot])``
        per request, encoded together and written under one ring lock (a decode step
        sends a few of these; one call each cost ~5 µs)."""
        n = len(rids)
        if n == 0:
            return
        ps = self.pool_page_sizes.get(pool, self.page_size) if pool else self.page_size
        positions = as_int64(positions).tolist()
        pages = (as_int64(slots) // ps).tolist()
        if len(positions) != n or len(pages) != n:
            raise ValueError(f"{n} rids, {len(positions)} positions, {len(pages)} slots")
        tier1 = self.tier1 if pool == 0 else None
        pack = _ASSIGN_ONE.pack
        payloads = []
        for rid, pos, page in zip(rids, positions, pages):
            if tier1 is not None:
                tier1.assigned(rid, pos, pos, np.array((page,), np.int64))
            payloads.append(pack(self.request_key(rid), pos, pos + 1, pos, 1, page))
        self.calls += n
        self._ring().write_batch(wire.Kind.ASSIGN, payloads, pool=pool)

    @guarded_probe
    def forward(
        self,
        rids,
        seq_lens,
        written_slots,
        read_rows=None,
        mode: int = 0,
        written_counts=None,
        rows_are_page_starts: bool = False,
        read_pages=None,
        read_counts=None,
        pool: int = 0,
    ) -> None:
        """One forward: per request the slots it writes, then the first ``seq_len`` tokens it reads.

        ``written_slots``: a list of per-request slot arrays, or (with ``written_counts``)
        one flat array holding them back to back, which is much cheaper at large batches.
        The engine's actual rows, optionally, either as ``read_rows`` (per request; with
        ``rows_are_page_starts`` each entry holds only the slots at positions 0, page_size,
        2*page_size, ... rather than every slot) or already flat as ``read_pages`` (page
        ids, requests back to back) with ``read_counts`` (pages per request).
        """
        n = len(rids)
        if n == 0:
            return
        ps = self.pool_page_sizes.get(pool, self.page_size) if pool else self.page_size
        keys = self.request_keys(rids)
        if written_counts is None:
            written_counts = [len(w) for w in written_slots]
            written_slots = np.concatenate([as_int64(w) for w in written_slots]) if n else np.zeros(0, np.int64)
        flat = as_int64(written_slots) // ps
        counts = np.asarray(written_counts, dtype=np.int64)
        if len(flat) == n and is_ones(counts, n):  # decode: one token each, nothing to de-duplicate
            write_pages, write_counts = flat, _ones_u32(n)
        else:
            # one entry per page per request: drop consecutive repeats inside each request's run
            keep = np.ones(len(flat), bool)
            if len(flat) > 1:
                keep[1:] = flat[1:] != flat[:-1]
                starts = np.cumsum(counts)[:-1]
                keep[starts[starts < len(flat)]] = True
            owner = np.repeat(np.arange(n), counts)
            write_pages = flat[keep]
            write_counts = np.bincount(owner[keep], minlength=n).astype(np.uint32)
        if read_pages is not None:
            read_pages = np.asarray(read_pages).reshape(-1)  # int32 stays int32: it goes on the wire as such
            read_counts = np.asarray(read_counts, dtype=np.uint32)
        elif read_rows is not None:
            if rows_are_page_starts:
                rows = [as_int64(r) // ps for r in read_rows]
            else:
                rows = [self.row_pages(0, r) for r in read_rows]
            read_counts = np.fromiter((len(r) for r in rows), dtype=np.uint32, count=n)
            read_pages = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        else:
            read_counts = None
        f = wire.Forward(
            keys, as_int64(seq_lens).astype(np.uint32), write_counts, write_pages, read_counts, read_pages, mode
        )
        self._emit(wire.Kind.FORWARD, wire.forward_payload(f), pool=pool)
        self._maybe_heartbeat()

    def start_tier1(self, pool_pages: int) -> tier1_mod.Tier1:
        """Create Tier 1 (engine_hooks/tier1.py), fed from now on by the probes below."""
        required = tier1_mod.required_by()
        self.tier1 = tier1_mod.Tier1(
            int(pool_pages),
            self.page_size,
            on_violation=self._tier1_violation,
            on_error=lambda where, exc: self.report_probe_error("tier1." + where, exc),
            on_reader=required[1] if required else None,
        )
        log.info(
            "kvguard tier1 read check on (%s): %d pages of %d tokens",
            required[0] if required else tier1_mod.ENV + "=1",
            int(pool_pages),
            self.page_size,
        )
        return self.tier1

    def _tier1_violation(self, v: tier1_mod.Violation, reported_total: int) -> None:
        """Tier 1 found row pages that are not the reader's: one TIER1_VIOLATION record
        (the engine has already logged and counted it; this is for the sidecar)."""
        if self.writer is None:
            return
        owners = [0 if o is None else self.request_key(o) for o in v.owners]
        rec = wire.Tier1Violation(
            self.request_key(v.rid),
            int(reported_total),
            int(v.seq_len),
            np.asarray(v.pages, np.int64),
            np.asarray(v.row_indices, np.uint32),
            np.asarray(owners, np.uint64),
            np.asarray(v.tags, np.uint8),
        )
        self._emit(wire.Kind.TIER1_VIOLATION, wire.tier1_violation_payload(rec))

    @guarded_probe
    def content_changed(self, slots) -> None:
        """KV ``slots`` whose bytes changed with no hooked write (engine_hooks/content.py)."""
        slots = as_int64(slots)
        pages = np.unique(slots // self.page_size) if self.page_size > 1 else np.unique(slots)
        c = wire.ContentChanged(len(slots), pages)
        self._emit(wire.Kind.CONTENT_CHANGED, wire.content_changed_payload(c))

    @guarded_probe
    def rejected(self, rid: str, phase: str, reason: str) -> None:
        r = wire.Reject(wire.request_key(rid), _PHASE[phase], str(reason or ""))
        self._emit(wire.Kind.REJECT, wire.reject_payload(r))


_probes: Probes | None = None
_probes_lock = threading.Lock()


def get_probes() -> Probes:
    """The process-wide Probes; its ring is created on first use in ``$KVGUARD_RING_DIR``.

    ``KVGUARD_DISABLE=1`` gives a no-op instance. A ring that cannot be created (no room
    for it on the ring volume, bad directory, bad ``KVGUARD_RING_BYTES``) is logged once
    and also gives a no-op instance, which counts the records it drops
    (``Probes.dropped_no_ring``): kvguard must never stop the engine from serving.
    """
    global _probes
    if _probes is not None:
        return _probes
    with _probes_lock:
        if _probes is None:
            _probes = _make_probes()
    return _probes


def _make_probes() -> Probes:
    if os.environ.get("KVGUARD_DISABLE", "") in ("1", "true", "yes"):
        log.info("kvguard probes disabled by KVGUARD_DISABLE")
        return Probes(None)
    raw_capacity = os.environ.get("KVGUARD_RING_BYTES", str(DEFAULT_CAPACITY))
    try:
        writer = RingWriter(ring_dir(), int(raw_capacity))
    except RingSpaceError as exc:  # a full ring volume: one line, then no-op probes that count their drops
        log.error(
            "kvguard: %s; KV integrity is NOT monitored in this engine process (pid %d): its probes run "
            "without a ring and count the records they drop. Free the ring volume (rings of exited engines "
            "that no sidecar removed?) or raise its size, then restart the engine",
            exc,
            os.getpid(),
        )
        return Probes(None, no_ring_reason=str(exc))
    except (OSError, ValueError) as exc:
        log.error(
            "kvguard: cannot create ring in %s (KVGUARD_RING_BYTES=%s): %s; probes disabled",
            ring_dir(),
            raw_capacity,
            exc,
        )
        return Probes(None, no_ring_reason=f"cannot create ring in {ring_dir()}: {exc}")
    from kvguard.engine_hooks import native  # here, not at plugin load: the engine's logging is set up by now

    log.info("kvguard ring %s (%d bytes); transfer digests: %s", writer.path, writer.capacity, native.status())
    return Probes(writer)


def reset_probes_for_tests(probes: Probes | None = None) -> None:
    global _probes
    _probes = probes

"""The fault injectors (TEST ONLY). Runs inside SGLang 0.5.23 scheduler processes.

Hook targets are chosen so that none is hooked by kvguard itself
(engine_hooks/sglang/plugin.py): the order in which ``HookRegistry`` chains two
plugins' hooks on one target depends on entry-point discovery order, and kvguard
must observe the engine exactly as it would without this plugin.

Unified engine (run with ``--disable-overlap-schedule`` so steps are
``run_batch`` -> ``process_batch_result``, one batch at a time):
  * ``Scheduler.run_batch`` (around): snapshot the rows of fault requests; the
    ``late_write_forward`` redirect of one decode write.
  * ``Scheduler.process_batch_result`` (around): before, the ``row_corruption``
    restore; after, every other injection (the step's forward has run, its results
    are applied, finished requests are released).
  * ``mem_cache.allocation._prefix_kv_indices`` (around): ``prefix_wrong_page`` notes the
    victim's prompt when the victim is allocated; when a faulty request is handed a prefix of
    at least two pages, it replaces the slots of the prefix's row page 1 with the victim's
    cached page at the same position (a radix block handed from another prefix: vLLM #49125,
    SGLang #22819's shape). The tree and the allocator stay consistent: the faulty request's
    release frees nothing below its matched length, and the victim's page stays the tree's.
  * ``mem_cache.common._req_radix_key`` (around): ``salt_dropped`` drops the cache salt
    from the radix key a faulty request's prefix is looked up with (a salt lost on the
    way to the cache, SGLang #37160): it matches, and is handed, an unsalted request's KV.
Unified engine of a hybrid linear-attention model (tests/integration/test_state_sglang_engines.py):
  * ``Scheduler.process_batch_result`` (around), after: ``state_slot_freed`` returns the
    victim's Mamba state slot to ``MambaSlotAllocator`` right after its prefill, while it
    keeps decoding (``req.kv.mamba_pool_idx`` and the engine's row mapping still name it),
    at the head of the free list, so that the next admission gets it and both requests'
    forwards read and overwrite the same state in place.
Unified engine of a hybrid sliding-window model (tests/integration/test_swa_sglang_engines.py):
  * ``Scheduler.process_batch_result`` (around), after: ``swa_freed_under_reader`` notes the
    victim once it decodes past the window, and the SWA page a few positions behind the one it
    writes (inside its window, not the page it writes);
  * ``ScheduleBatch.prepare_for_extend`` (around), before: notes a batch that admits "other";
  * ``SWATokenToKVPoolAllocator.alloc_extend`` (around), before, for that batch (after any
    eviction its allocation needed): that page is freed through the SWA sub-allocator, the
    full-to-SWA mapping left pointing at it (the victim keeps reading it), and put at the head
    of the SWA free list: the other's prefill gets it (its prompt is shorter than the window,
    so the page stays inside its window, its own).
PD prefill engine:
  * ``PrefillBootstrapQueue._num_pages_to_send`` (after): the sender is initialised
    for 1 page (so that 1 page completes the transfer).
  * ``SchedulerDisaggregationPrefillMixin._send_kv_chunk`` (around): ``send_truncated``
    sends the first page only, through the scheduler (``start_send_idx`` = 1 page).
  * ``MooncakeKVSender.send`` (around): ``sender_truncated`` drops all but the first
    page inside the sender, below the scheduler (which believes it sent everything).
  * ``_send_kv_chunk`` and ``Scheduler.process_batch_result`` (around):
    ``send_foreign_page`` notes a victim request's first page when the victim sends;
    when the faulty request sends its last chunk, its row's last sent page names the
    victim's page instead of its own for the duration of the send (the sender ships a
    page its request never wrote: the victim's KV, TensorRT-LLM #12542's shape), and
    the row is put back after the step's results (before any free reads the row).
Unified engine with HiCache (tests/integration/test_hicache_engine.py):
  * ``mem_cache.common._req_radix_key`` (around): arms ``hicache_load_freed`` when the
    victim's prefix is looked up;
  * ``UnifiedRadixCache.ready_to_load_host_cache`` (around): before the controller submits
    the queued load-backs, frees their destination pages (the victim's load-back) back to
    the allocator: the load then lands in free pages and the victim reads them (a
    load-back racing an eviction, SGLang #31427 / #30321); ``hicache_host_flipped`` instead
    changes one value of the first queued host slot's K in every layer (host KV changed at
    rest: the load-back brings back other bytes than were backed up).
PD decode engine:
  * ``DecodeTransferQueue._poll_with_metadata_gate`` (before): ``flip_received_page``
    flips one byte in one page the request received, once its receiver's manager says
    the transfer succeeded. It runs inside ``pop_transferred`` before SGLang polls the
    queue, so always after the KV arrived and before kvguard hashes it (the guard in
    ``_apply_metadata_gate`` during that poll, the observer after ``pop_transferred``).

Every injection is logged and appended to ``<KVGUARD_FAULT_DIR>/events.jsonl``.
A failure inside an injector is reported as an ``error`` event and never propagates
into the engine.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from . import FAULTS, rid_prefix

log = logging.getLogger("kvguard.faults")

S = "sglang.srt."
RUN_BATCH = S + "managers.scheduler.Scheduler.run_batch"
RADIX_KEY = S + "mem_cache.common._req_radix_key"
PREFIX_KV_INDICES = S + "mem_cache.allocation._prefix_kv_indices"
PWP_ROW_PAGE = 1  # prefix_wrong_page: the faulty request's prefix row page handed from the victim's prefix
PROCESS_BATCH_RESULT = S + "managers.scheduler.Scheduler.process_batch_result"
NUM_PAGES_TO_SEND = S + "disaggregation.prefill.PrefillBootstrapQueue._num_pages_to_send"
SEND_KV_CHUNK_INNER = S + "disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk"
MOONCAKE_SEND = S + "disaggregation.mooncake.conn.MooncakeKVSender.send"
MOONCAKE_ADD_TRANSFER = S + "disaggregation.mooncake.conn.MooncakeKVManager.add_transfer_request"
INFLIGHT_QUEUE = S + "disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue"
RELEASE_KV_CACHE = S + "mem_cache.common.release_kv_cache"
POP_TRANSFERRED = S + "disaggregation.decode.DecodeTransferQueue.pop_transferred"
MOONCAKE_ABORT_NOTICE = S + "disaggregation.mooncake.conn.MooncakeKVManager._handle_abort_notification"
POLL_GATE = S + "disaggregation.decode.DecodeTransferQueue._poll_with_metadata_gate"
READY_TO_LOAD = S + "mem_cache.unified_radix_cache.UnifiedRadixCache.ready_to_load_host_cache"
PREPARE_FOR_EXTEND = S + "managers.schedule_batch.ScheduleBatch.prepare_for_extend"
SWA_ALLOC_EXTEND = S + "mem_cache.allocator.swa.SWATokenToKVPoolAllocator.alloc_extend"

HICACHE_FAULTS = ("hicache_load_freed", "hicache_host_flipped", "hicache_other_object")
HICACHE_QUEUED_FAULTS = ("hicache_load_freed", "hicache_host_flipped")  # act on the queued copy
D2H = S + "mem_cache.l2_transfer.L2TransferEngine.submit_device_to_host"
# the tree core builds a load-back's transfer from the node's host slots (python or rust core)
LOAD_BACK_SPECS = (
    S + "mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore.build_load_back_spec",
    S + "mem_cache.rust_tree_core.adapter.RustUnifiedTreeCore.build_load_back_spec",
)
UNIFIED_FAULTS = (
    "use_after_free",
    "double_free",
    "row_corruption",
    "late_write_forward",
    "late_write_pool",
    "spec_draft_foreign",
    "state_slot_freed",
    "swa_freed_under_reader",
)
PD_FAULTS = (
    "send_truncated",
    "sender_truncated",
    "send_foreign_page",
    "send_source_released",
    "completion_after_release",
)
HELD_TRANSFER_FAULTS = ("send_source_released", "completion_after_release")  # prefill holds f's last chunk
SSR_HOLD_S = 30.0  # send_source_released: the longest the faulty transfer waits for the victim
SHORT_SEND_FAULTS = ("send_truncated", "sender_truncated")  # the sender is initialised for 1 page
DECODE_FAULTS = ("flip_received_page",)
KV_POLL_FAILED = 0  # KVPoll.Failed in every version (plain ints)
FLIP_ROW_PAGE = 1  # the request's row page whose first slot gets the flipped byte (page 0 if shorter)

# freed pages are moved this deep into the free list (see _uaf_free); KVGUARD_FAULT_UAF_DEPTH
# overrides it (pages): with 64-token pages (DSA) a victim that never opens a new page needs ~1
UAF_FREE_LIST_DEPTH = int(os.environ.get("KVGUARD_FAULT_UAF_DEPTH", "20"))
HOLD_STEP_S = 0.05  # scheduler slow-down per step while a fault waits for its next request
HOLD_MAX_S = 30.0


# --------------------------------------------------------------------------- helpers
class Events:
    def __init__(self, folder: str | None):
        self.path = Path(folder) / "events.jsonl" if folder else None
        self.lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, fault: str, event: str, **data) -> None:
        record = {"fault": fault, "event": event, "pid": os.getpid(), "t": time.monotonic(), **data}
        log.warning("kvguard_faults: %s %s %s", fault, event, data)
        if self.path is None:
            return
        line = json.dumps(record) + "\n"
        with self.lock, open(self.path, "a") as f:
            f.write(line)


def logged(events: Events, fault: str, event: str, **match) -> dict | None:
    """The first ``event`` of ``fault`` in the events file matching ``match`` (any process's)."""
    if events.path is None or not events.path.exists():
        return None
    with events.lock, open(events.path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("fault") == fault and record.get("event") == event:
                if all(record.get(k) == v for k, v in match.items()):
                    return record
    return None


def fault_and_role(rid) -> tuple[str | None, str | None]:
    rid = str(rid or "")
    if not rid.startswith("kvgf-"):
        return None, None
    for fault in FAULTS:
        p = rid_prefix(fault)
        if rid.startswith(p):
            return fault, rid[len(p) :].split("-", 1)[0]
    return None, None


def _torch():
    import torch

    return torch


def page_size(sched) -> int:
    return int(getattr(sched.token_to_kv_pool_allocator, "page_size", 1) or 1)


def row_slots(sched, req, n: int) -> list[int]:
    rt = sched.req_to_token_pool.req_to_token
    return rt[int(req.kv.req_pool_idx), : int(n)].to("cpu").tolist()


def pages_of(slots, ps: int) -> list[int]:
    """Page ids of ``slots`` in row order, each once, without the padding page 0."""
    out, seen = [], {0}
    for s in slots:
        p = int(s) // ps
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def free_page_set(alloc) -> set[int]:
    """Every page the allocator can hand out now (free list + staged/released pages)."""
    torch = _torch()
    parts = [getattr(alloc, "free_pages", None), getattr(alloc, "release_pages", None)]
    parts += list(getattr(alloc, "staged_pages", None) or [])
    out: set[int] = set()
    for t in parts:
        if isinstance(t, torch.Tensor) and t.numel():
            out.update(int(x) for x in t.reshape(-1).tolist())
    return out


def dedupe_free_lists(alloc) -> int:
    """Drop repeated pages from the allocator's free lists (keeps the first); returns
    how many were dropped. Lets the engine go on after an injected double free."""
    torch = _torch()
    seen: set[int] = set()
    dropped = 0

    def uniq(t):
        nonlocal dropped
        keep = []
        for v in t.reshape(-1).tolist():
            if v in seen:
                dropped += 1
            else:
                seen.add(v)
                keep.append(v)
        return torch.tensor(keep, dtype=t.dtype, device=t.device)

    if isinstance(getattr(alloc, "free_pages", None), torch.Tensor):
        alloc.free_pages = uniq(alloc.free_pages)
    if isinstance(getattr(alloc, "release_pages", None), torch.Tensor):
        alloc.release_pages = uniq(alloc.release_pages)
    staged = getattr(alloc, "staged_pages", None)
    if staged:
        alloc.staged_pages = [u for u in (uniq(t) for t in staged) if u.numel()]
        alloc.num_staged_pages = sum(int(t.numel()) for t in alloc.staged_pages)
    return dropped


def move_pages_deeper(alloc, pages: list[int], depth: int) -> None:
    """Reorder the (unsorted, unified-mode) free list so ``pages`` sit ``depth`` entries
    in. Only the order changes: the same pages stay free."""
    torch = _torch()
    fp = alloc.free_pages
    rest = [int(x) for x in fp.tolist() if int(x) not in set(pages)]
    at = min(depth, len(rest))
    alloc.free_pages = torch.tensor(rest[:at] + list(pages) + rest[at:], dtype=fp.dtype, device=fp.device)


def pages_to_front(alloc, pages: list[int]) -> None:
    """Put just-freed ``pages`` first in the allocator's free list, taking them out of where a
    prefill/decode engine parks its frees until the next merge (0.5.19 ``release_pages``, 0.5.23
    ``staged_pages``): the next request allocated gets them. The same pages stay free."""
    torch = _torch()
    drop = set(pages)

    def without(t):
        return t[torch.tensor([int(x) not in drop for x in t.reshape(-1).tolist()], dtype=torch.bool)]

    if isinstance(getattr(alloc, "release_pages", None), torch.Tensor):
        alloc.release_pages = without(alloc.release_pages)
    staged = getattr(alloc, "staged_pages", None)
    if staged:
        alloc.staged_pages = [u for u in (without(t) for t in staged) if u.numel()]
        alloc.num_staged_pages = sum(int(t.numel()) for t in alloc.staged_pages)
    fp = alloc.free_pages
    head = torch.tensor(list(pages), dtype=fp.dtype, device=fp.device)
    alloc.free_pages = torch.cat((head, without(fp)))


# --------------------------------------------------------------------------- the driver
class Driver:
    def __init__(self, faults: set[str], events: Events):
        self.faults = set(faults)
        self.ev = events
        self.rows: dict[str, list[int]] = {}  # fault rid -> its row slots at its last forward
        self.done: set[tuple[str, str]] = set()
        self.hold: dict[str, float] = {}  # fault -> deadline: slow the loop while it waits for a request
        # use_after_free
        self.uaf_pages: list[int] | None = None
        self.uaf_victim: str | None = None
        self.uaf_victim_read = False
        # row_corruption: (reader rid, row, start, end, original slots)
        self.rc_pending = None
        # late_write_*: per fault
        self.lw = {
            f: {"stale": None, "victim": None, "page": None, "slots": None, "injected": False}
            for f in ("late_write_forward", "late_write_pool")
        }
        # spec_draft_foreign: (writer rid, row, start, original slots) to put back after the verify
        self.sdf_pending = None
        # PD: bootstrap_room -> fault
        self.pd_rooms: dict[int, str] = {}
        # send_foreign_page: the victim's first page's slots; the row entries to put back
        self.sfp_victim_slots: list[int] | None = None
        self.sfp_restore = None  # (req_to_token, row, start, original slots tensor)
        # state_slot_freed: the victim's freed state slot, once freed
        self.ssf_slot: int | None = None
        self.ssf_victim: str | None = None
        # swa_freed_under_reader: the victim (a Req) once past the window, its row position whose
        # SWA page is freed when "other" is admitted, and that page (0: noted, not freed yet)
        self.swa_page: int | None = None
        self.swa_victim = None
        self.swa_position = 0
        self.swa_batch = None  # the batch admitting "other", between prepare_for_extend and its allocation
        # send_source_released: the faulty request's rid once its pages were released early, the
        # pages, and the victim's prefill having written them (which lets the held transfer go)
        self.ssr_released: set[str] = set()
        self.ssr_pages: list[int] = []
        self.ssr_victim_written = threading.Event()
        self.held_rooms: dict[int, str] = {}  # room -> fault: last chunks held, not yet announced
        # completion_after_release (prefill): rooms whose held transfer has not landed yet, and the
        # abort notices decode sent for them meanwhile (delivered once the transfer has landed)
        self.car_in_flight: set[int] = set()
        self.car_notices: dict[int, list] = {}
        # completion_after_release (decode): f's rid once its reservation was released, its pages,
        # the room whose poll is turned into a failure during one pop_transferred, the victim logged
        self.car_released: set[str] = set()
        self.car_pages: list[int] = []
        self.car_fail_room: int | None = None
        self.car_victim_logged = False
        self.car_hold_until: float | None = None
        # hicache_*: fault -> the victim whose next queued load-back it acts on
        self.hicache_victims: dict[str, str] = {}
        self.hicache_backups: list = []  # hicache_other_object: host slots of recent backups
        # prefix_wrong_page: the victim's rid and prompt (token ids), noted at its allocation
        self.pwp_victim: tuple[str, list[int]] | None = None

    # ------------------------------------------------------------------ plumbing
    def guarded(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("kvguard_faults: %s failed", what)
            self.ev.emit("plugin", "error", where=what, error=f"{type(exc).__name__}: {exc}")
            return None

    def _arm_hold(self, fault: str) -> None:
        self.hold[fault] = time.monotonic() + HOLD_MAX_S

    def _release_hold(self, fault: str) -> None:
        self.hold.pop(fault, None)

    def _maybe_hold(self, batch) -> None:
        """Slow the scheduler loop while a fault waits for its next request, so the
        requests it needs alive stay alive (sleeping costs no CPU)."""
        now = time.monotonic()
        for fault, deadline in list(self.hold.items()):
            if now > deadline:
                self.ev.emit(fault, "hold_expired")
                del self.hold[fault]
        if self.hold and batch is not None and batch.reqs:
            time.sleep(HOLD_STEP_S)

    @staticmethod
    def _by_role(batch, fault: str) -> dict[str, tuple[int, object]]:
        out = {}
        for i, req in enumerate(batch.reqs):
            f, role = fault_and_role(req.rid)
            if f == fault and role not in out:
                out[role] = (i, req)
        return out

    # ------------------------------------------------------------------ run_batch
    def before_run(self, sched, batch):
        if batch is None or not batch.reqs:
            return None
        if not any(fault_and_role(r.rid)[0] for r in batch.reqs):
            return None
        seq = [int(x) for x in batch.seq_lens_cpu.tolist()]
        for i, req in enumerate(batch.reqs):
            if fault_and_role(req.rid)[0] and req.kv.req_pool_idx is not None:
                self.rows[req.rid] = row_slots(sched, req, seq[i])
        if "late_write_forward" in self.faults:
            return self._late_write_redirect(sched, batch, seq)
        return None

    def _late_write_redirect(self, sched, batch, seq):
        """Fault 4b: the writer's KV for this decode step goes to a slot of the victim's
        page (a page the writer never owned: it came from the finished request x)."""
        st = self.lw["late_write_forward"]
        if st["page"] is None or st["injected"] or not batch.forward_mode.is_decode():
            return None
        roles = self._by_role(batch, "late_write_forward")
        if "y" not in roles or "z" not in roles:
            return None
        (_, y), (iz, z) = roles["y"], roles["z"]
        if y.rid != st["victim"] or y.finished() or z.finished():
            return None
        ps = page_size(sched)
        position = seq[iz] - 1  # the position whose KV this decode step writes
        if position % ps == 0:
            return None  # the writer's own slot would open a page nothing wrote yet: wait a step
        orig = batch.out_cache_loc
        if orig is None or orig.numel() != len(batch.reqs):
            return None
        loc = orig.clone()
        writer_slot = int(loc[iz])
        target_slot = int(st["slots"][0])
        loc[iz] = target_slot
        batch.out_cache_loc = loc
        st["injected"] = True
        self._release_hold("late_write_forward")
        self.ev.emit(
            "late_write_forward",
            "injected",
            writer=z.rid,
            victim=y.rid,
            page=target_slot // ps,
            slot=target_slot,
            writer_slot=writer_slot,
            writer_page=writer_slot // ps,
            position=position,
        )

        def restore():
            batch.out_cache_loc = orig

        return restore

    # ------------------------------------------------------------------ process_batch_result
    def before_process(self, sched, batch):
        if self.rc_pending is not None:
            self._row_restore(sched, batch)
        if self.sdf_pending is not None:
            self._spec_restore(sched, batch)

    def after_process(self, sched, batch):
        if batch is None:
            return
        if "double_free" in self.faults:
            self.guarded("double_free", self._double_free, sched, batch)
        if "row_corruption" in self.faults:
            self.guarded("row_corruption", self._row_corrupt, sched, batch)
        for fault in ("late_write_forward", "late_write_pool"):
            if fault in self.faults:
                self.guarded(fault, self._late_write_track, sched, batch, fault)
        if "late_write_pool" in self.faults:
            self.guarded("late_write_pool", self._late_write_pool, sched, batch)
        if "use_after_free" in self.faults:
            self.guarded("use_after_free", self._use_after_free, sched, batch)
        if "spec_draft_foreign" in self.faults:
            self.guarded("spec_draft_foreign", self._spec_draft_foreign, sched, batch)
        if "state_slot_freed" in self.faults:
            self.guarded("state_slot_freed", self._state_slot_freed, sched, batch)
        if "swa_freed_under_reader" in self.faults:
            self.guarded("swa_freed_under_reader", self._swa_freed_under_reader, sched, batch)
        self._maybe_hold(batch)

    # fault 2 ----------------------------------------------------------------
    def _double_free(self, sched, batch):
        """The engine released a finished request; free its released pages once more."""
        torch = _torch()
        alloc = sched.token_to_kv_pool_allocator
        ps = page_size(sched)
        for req in batch.reqs:
            fault, role = fault_and_role(req.rid)
            if fault != "double_free" or not req.finished() or ("double_free", req.rid) in self.done:
                continue
            self.done.add(("double_free", req.rid))
            pages = pages_of(self.rows.get(req.rid, ()), ps)
            free_now = free_page_set(alloc)
            again = [p for p in pages if p in free_now]
            if not again:
                self.ev.emit(
                    "double_free",
                    "skipped",
                    rid=req.rid,
                    pages=pages,
                    reason="none of the request's pages was released to the free list",
                )
                continue
            slots = torch.tensor([p * ps for p in again], dtype=torch.int64, device=alloc.device)
            alloc.free(slots)  # the second free of these pages
            dropped = dedupe_free_lists(alloc)
            self.ev.emit(
                "double_free", "double_freed", rid=req.rid, pages=again, row_pages=pages, duplicates_dropped=dropped
            )

    # fault 3 ----------------------------------------------------------------
    def _row_corrupt(self, sched, batch):
        """Point one entry page of the reader's req_to_token row at the owner's page,
        writing the tensor directly (no ReqToTokenPool.write), between two steps."""
        if ("row_corruption", "injected") in self.done or not batch.forward_mode.is_decode():
            return
        roles = self._by_role(batch, "row_corruption")
        if "reader" not in roles or "owner" not in roles:
            if roles and "row_corruption" not in self.hold:
                self._arm_hold("row_corruption")  # keep the first one alive until the other decodes too
            return
        reader, owner = roles["reader"][1], roles["owner"][1]
        if reader.finished() or owner.finished():
            return
        ps = page_size(sched)
        start, end = ps, 2 * ps  # row page 1: a full prompt page, written at prefill
        if len(reader.origin_input_ids) < 3 * ps or len(owner.origin_input_ids) < 3 * ps:
            return
        rt = sched.req_to_token_pool.req_to_token
        r_row, o_row = int(reader.kv.req_pool_idx), int(owner.kv.req_pool_idx)
        original = rt[r_row, start:end].clone()
        rt[r_row, start:end] = rt[o_row, start:end]
        self.done.add(("row_corruption", "injected"))
        self._release_hold("row_corruption")
        self.rc_pending = (reader.rid, r_row, start, end, original)
        self.ev.emit(
            "row_corruption",
            "row_corrupted",
            reader=reader.rid,
            owner=owner.rid,
            row_page_index=1,
            reader_page=int(original[0]) // ps,
            owner_page=int(rt[o_row, start]) // ps,
            reader_output_tokens=len(reader.output_ids),  # before the forward that reads the corrupt row
        )

    def _row_restore(self, sched, batch):
        """After one forward read the corrupted row: put the reader's own slots back, so
        its release returns its own pages (the owner's pages stay the owner's)."""
        rid, row, start, end, original = self.rc_pending
        if not any(r.rid == rid for r in batch.reqs):
            return
        sched.req_to_token_pool.req_to_token[row, start:end] = original
        self.rc_pending = None
        self.ev.emit("row_corruption", "row_restored", reader=rid)

    # speculative decoding -----------------------------------------------------
    def _spec_draft_foreign(self, sched, batch):
        """Speculative decoding: the slots the writer's next verify writes its draft tokens to
        (its row's allocated-ahead entries ``[kv_committed_len, + draft tokens)``, set by
        ``alloc_for_spec_decode``) name the owner's prompt slots instead, written straight into
        the tensor between two steps (a verify-slot computation gone wrong: the drafted tokens'
        KV lands in another tenant's page, and the verify attends over it). The row's last
        allocated entry is left alone (the next allocation continues the page from it). Injected
        when the window opens a page, so that the verify's read of the foreign page shows too."""
        if ("spec_draft_foreign", "injected") in self.done or self.sdf_pending is not None:
            return
        width = int(getattr(sched.server_args, "speculative_num_draft_tokens", 0) or 0)
        roles = self._by_role(batch, "spec_draft_foreign")
        if "writer" not in roles or "owner" not in roles:
            if roles and "spec_draft_foreign" not in self.hold:
                self._arm_hold("spec_draft_foreign")  # keep the first one alive until the other decodes too
            return
        writer, owner = roles["writer"][1], roles["owner"][1]
        if width <= 0 or writer.finished() or owner.finished() or writer.kv.req_pool_idx is None:
            return
        start = int(writer.kv.kv_committed_len)
        if start + width >= int(writer.kv.kv_allocated_len) or len(writer.output_ids) == 0:
            return  # not decoding yet, or the draft window is not allocated ahead: wait a step
        ps = page_size(sched)
        if start // ps == (start + width - 1) // ps and start % ps:
            # the window lies inside one page and opens none: a row read reports one slot per page
            # (the page's first), so the verify's read of the foreign slots would not show; wait
            # for a window that opens a page (then both the write and the read are visible)
            return
        if len(owner.origin_input_ids) < 2 * ps + width:
            return
        rt = sched.req_to_token_pool.req_to_token
        w_row, o_row = int(writer.kv.req_pool_idx), int(owner.kv.req_pool_idx)
        original = rt[w_row, start : start + width].clone()
        foreign = rt[o_row, ps : ps + width].clone()  # from the owner's row page 1: a full prompt page
        rt[w_row, start : start + width] = foreign
        self.done.add(("spec_draft_foreign", "injected"))
        self._release_hold("spec_draft_foreign")
        self.sdf_pending = (writer.rid, w_row, start, original)
        self.ev.emit(
            "spec_draft_foreign",
            "verify_slots_redirected",
            writer=writer.rid,
            owner=owner.rid,
            positions=[start, start + width],
            owner_pages=sorted({int(x) // ps for x in foreign.tolist()}),
            writer_pages=sorted({int(x) // ps for x in original.tolist()}),
        )

    def _spec_restore(self, sched, batch):
        """After the verify forward wrote and read the redirected slots: the writer's own row
        entries back, so its release frees its own slots (the owner's stay the owner's)."""
        rid, row, start, original = self.sdf_pending
        if not any(r.rid == rid for r in batch.reqs):
            return
        sched.req_to_token_pool.req_to_token[row, start : start + len(original)] = original
        self.sdf_pending = None
        self.ev.emit("spec_draft_foreign", "row_restored", writer=rid)

    # fault 4 ----------------------------------------------------------------
    def _late_write_track(self, sched, batch, fault):
        """x finishes -> note its pages now free; y is prefilled -> the first of x's pages
        y was handed is the target (x's stale reference now points into y's KV)."""
        st = self.lw[fault]
        alloc = sched.token_to_kv_pool_allocator
        ps = page_size(sched)
        for req in batch.reqs:
            f, role = fault_and_role(req.rid)
            if f != fault:
                continue
            if role == "x" and req.finished() and st["stale"] is None:
                pages = pages_of(self.rows.get(req.rid, ()), ps)
                free_now = free_page_set(alloc)
                st["stale"] = [p for p in pages if p in free_now]
                self.ev.emit(fault, "x_released", rid=req.rid, pages=pages, stale=st["stale"])
            elif (
                role == "y"
                and st["victim"] is None
                and st["stale"] is not None
                and batch.forward_mode.is_extend()
                and not req.finished()
            ):
                n = len(req.origin_input_ids)
                slots = row_slots(sched, req, n)
                hit = [p for p in pages_of(slots, ps) if p in set(st["stale"])]
                st["victim"] = req.rid
                if not hit:
                    st["page"] = None
                    self.ev.emit(fault, "victim_missed", victim=req.rid, pages=pages_of(slots, ps), stale=st["stale"])
                    continue
                page = hit[0]
                st["page"] = page
                st["slots"] = [int(s) for s in slots if int(s) // ps == page]  # slots y wrote in that page
                self.ev.emit(fault, "victim_got_stale_page", victim=req.rid, page=page, slots=st["slots"])
                if fault == "late_write_forward":
                    self._arm_hold(fault)  # keep y alive until the writer z decodes

    def _late_write_pool(self, sched, batch):
        """Fault 4a: write KV into x's stale slots (now y's) straight through the KV pool
        (``set_kv_buffer``), outside any forward, as an RDMA write from a remote sender
        lands in decode memory: no engine function that kvguard hooks is involved."""
        st = self.lw["late_write_pool"]
        if st["page"] is None or st["injected"] or not batch.forward_mode.is_decode():
            return
        roles = self._by_role(batch, "late_write_pool")
        if "y" not in roles or roles["y"][1].rid != st["victim"] or roles["y"][1].finished():
            return
        torch = _torch()
        pool = sched.token_to_kv_pool_allocator.get_kvcache()
        loc = torch.tensor(st["slots"], dtype=torch.int64, device=pool.device)
        n = len(st["slots"])
        head_num, head_dim = int(pool.head_num), int(pool.head_dim)
        v_head_dim = int(getattr(pool, "v_head_dim", head_dim) or head_dim)
        start_layer = int(getattr(pool, "start_layer", 0) or 0)
        method = "set_kv_buffer"
        for layer in range(start_layer, start_layer + int(pool.layer_num)):
            k = torch.full((n, head_num, head_dim), 7.0, dtype=pool.dtype, device=pool.device)
            v = torch.full((n, head_num, v_head_dim), -7.0, dtype=pool.dtype, device=pool.device)
            try:
                pool.set_kv_buffer(None, loc, k, v, layer_id_override=layer)
            except Exception as exc:  # noqa: BLE001 - fall back to the buffers themselves
                method = f"k_buffer/v_buffer (set_kv_buffer: {type(exc).__name__}: {exc})"
                pool.k_buffer[layer - start_layer][loc] = k.view(pool.store_dtype)
                pool.v_buffer[layer - start_layer][loc] = v.view(pool.store_dtype)
        st["injected"] = True
        self.ev.emit(
            "late_write_pool", "injected", victim=st["victim"], page=st["page"], slots=st["slots"], method=method
        )

    # fault 1 ----------------------------------------------------------------
    def _use_after_free(self, sched, batch):
        if self.uaf_pages is None:
            self._uaf_free(sched, batch)
        elif not self.uaf_victim_read:
            if batch.forward_mode.is_decode() and any(r.rid == self.uaf_victim for r in batch.reqs):
                self.uaf_victim_read = True
                self.ev.emit("use_after_free", "victim_read_freed", victim=self.uaf_victim, pages=self.uaf_pages)
        elif ("use_after_free", "other") not in self.done and batch.forward_mode.is_extend():
            roles = self._by_role(batch, "use_after_free")
            if "other" in roles:
                other = roles["other"][1]
                self.done.add(("use_after_free", "other"))
                pages = pages_of(row_slots(sched, other, len(other.origin_input_ids)), page_size(sched))
                got = [p for p in self.uaf_pages if p in set(pages)]
                self._release_hold("use_after_free")
                self.ev.emit(
                    "use_after_free",
                    "other_got_pages",
                    other=other.rid,
                    victim=self.uaf_victim,
                    pages=got,
                    other_pages=pages,
                )

    def _state_slot_freed(self, sched, batch):
        """After the victim's prefill, its state slot goes back to the allocator (at the head
        of the free list) while the victim keeps decoding; then note which request got it."""
        if not batch.forward_mode.is_extend():
            return
        roles = self._by_role(batch, "state_slot_freed")
        if self.ssf_slot is None and "victim" in roles:
            victim = roles["victim"][1]
            if victim.finished():
                return
            torch = _torch()
            alloc = sched.req_to_token_pool.mamba_allocator
            slot = victim.kv.mamba_pool_idx.reshape(1)
            alloc.free(slot)  # the victim keeps it in req.kv and in the engine's row mapping
            rest = alloc.free_slots[:-1]  # free() appended it at the tail: the next admission takes the head
            alloc.free_slots = torch.cat((slot.to(rest.dtype), rest))
            self.ssf_slot, self.ssf_victim = int(slot[0]), victim.rid
            self._arm_hold("state_slot_freed")
            self.ev.emit("state_slot_freed", "freed", victim=victim.rid, slot=self.ssf_slot)
        elif self.ssf_slot is not None and "other" in roles and ("state_slot_freed", "other") not in self.done:
            other = roles["other"][1]
            self.done.add(("state_slot_freed", "other"))
            self._release_hold("state_slot_freed")
            got = other.kv.mamba_pool_idx
            self.ev.emit(
                "state_slot_freed",
                "other_got_slot",
                other=other.rid,
                victim=self.ssf_victim,
                slot=None if got is None else int(got),
            )

    def _swa_freed_under_reader(self, sched, batch):
        """Once the victim decodes past the window: note the SWA page 6 positions behind its
        last written one (in its window, not the page it writes); freed when "other" is admitted
        (``swa_free_for_other``)."""
        roles = self._by_role(batch, "swa_freed_under_reader")
        if self.swa_page and "other" in roles and ("swa_freed_under_reader", "other_seen") not in self.done:
            self.done.add(("swa_freed_under_reader", "other_seen"))
            other = roles["other"][1]
            slots = row_slots(sched, other, len(other.origin_input_ids))
            mapping = sched.token_to_kv_pool_allocator.full_to_swa_index_mapping
            twins = [int(mapping[s]) for s in slots]
            self.ev.emit("swa_freed_under_reader", "other_admitted", other=other.rid, full=slots, swa=twins)
        if self.swa_page is not None or not batch.forward_mode.is_decode():
            return
        if "victim" not in roles:
            return
        victim = roles["victim"][1]
        written = len(victim.origin_input_ids) + len(victim.output_ids) - 1  # positions with KV
        window = int(getattr(sched, "sliding_window_size", 0) or 0)
        if victim.finished() or written < 2 * window + 8:
            return
        self.swa_victim, self.swa_position, self.swa_page = victim, written - 6, 0
        self._arm_hold("swa_freed_under_reader")  # keep the victim decoding until "other" comes
        self.ev.emit("swa_freed_under_reader", "victim_ready", victim=victim.rid, window=window)

    def swa_other_admitted(self, batch):
        """Before ``prepare_for_extend``: whether this batch admits "other" (then the victim's
        noted SWA page is freed right before the SWA half allocates: ``swa_free_for_other``)."""
        if self.swa_victim is None or self.swa_page or ("swa_freed_under_reader", "other") in self.done:
            return
        if "other" in self._by_role(batch, "swa_freed_under_reader"):
            self.done.add(("swa_freed_under_reader", "other"))
            self.swa_batch = batch

    def swa_free_for_other(self, alloc):
        """Before ``SWATokenToKVPoolAllocator.alloc_extend`` of the batch admitting "other" (after
        any eviction that allocation needed, which puts the pages it frees at the head of the
        free list): free the victim's noted SWA page under it and put it at the head of the SWA
        free list: the other's prefill gets it as its first page."""
        batch, self.swa_batch = self.swa_batch, None
        if batch is None:
            return
        self._release_hold("swa_freed_under_reader")
        torch = _torch()
        victim = self.swa_victim
        full_slot = int(batch.req_to_token_pool.req_to_token[int(victim.kv.req_pool_idx), self.swa_position])
        page = int(alloc.full_to_swa_index_mapping[full_slot]) // int(alloc.page_size)
        if victim.finished() or page <= 0:
            self.ev.emit("swa_freed_under_reader", "skipped", victim=victim.rid, page=page)
            return
        swa = alloc.swa_attn_allocator
        swa.free_page_ids(torch.tensor([page], dtype=torch.int64, device=swa.device))
        move_pages_deeper(swa, [page], 0)
        self.swa_page = page
        self.ev.emit("swa_freed_under_reader", "freed", victim=victim.rid, page=page, position=self.swa_position)

    def _uaf_free(self, sched, batch):
        """After the victim's prefill: free two of its full prompt pages through the
        allocator while it keeps decoding (its row still names them)."""
        if not batch.forward_mode.is_extend():
            return
        roles = self._by_role(batch, "use_after_free")
        if "victim" not in roles:
            return
        victim = roles["victim"][1]
        if victim.finished():
            return
        torch = _torch()
        ps = page_size(sched)
        n = len(victim.origin_input_ids)
        last = (n - 1) // ps  # the partially filled page decode keeps writing: never freed here
        idx = [i for i in (1, 2) if i < last]
        if not idx:
            self.ev.emit("use_after_free", "skipped", victim=victim.rid, reason=f"prompt of {n} tokens is too short")
            self.uaf_pages = []
            return
        slots = row_slots(sched, victim, n)
        free_slots = [s for i in idx for s in slots[i * ps : (i + 1) * ps]]
        pages = pages_of(free_slots, ps)
        alloc = sched.token_to_kv_pool_allocator
        alloc.free(torch.tensor(free_slots, dtype=torch.int64, device=alloc.device))
        # The free list is a stack (freed pages first): the victim's own next page would
        # come from there. Move the freed pages a little deeper, so that the next
        # *other* request (which takes many pages at once) gets them, not the victim.
        move_pages_deeper(alloc, pages, UAF_FREE_LIST_DEPTH)
        self.uaf_pages, self.uaf_victim = pages, victim.rid
        self._arm_hold("use_after_free")
        self.ev.emit("use_after_free", "freed", victim=victim.rid, pages=pages, row_page_indices=idx)

    # ------------------------------------------------------------------ PD prefill
    def num_pages_to_send(self, result, queue, req, *args, **kwargs):
        fault, _role = fault_and_role(getattr(req, "rid", None))
        if fault not in SHORT_SEND_FAULTS or fault not in self.faults:
            return None
        room = int(req.bootstrap_room)
        self.pd_rooms[room] = fault
        self.ev.emit(fault, "sender_init", rid=req.rid, room=room, engine_pages=int(result), pages=1)
        return 1  # the sender completes the transfer after one page

    def send_kv_chunk_inner(self, original, sched, req, last_chunk=False, end_idx=None):
        fault, _role = fault_and_role(getattr(req, "rid", None))
        if fault == "completion_after_release" and fault in self.faults and last_chunk and _role == "f":
            self.pd_rooms[int(req.bootstrap_room)] = fault
        if fault == "send_source_released" and fault in self.faults and last_chunk:
            if _role == "f":
                self.pd_rooms[int(req.bootstrap_room)] = fault
            result = original(sched, req, last_chunk=last_chunk, end_idx=end_idx)
            if _role == "v":
                ps = page_size(sched)
                pages = pages_of(row_slots(sched, req, len(req.origin_input_ids)), ps)
                self.ev.emit(
                    fault,
                    "victim_written",
                    rid=req.rid,
                    pages=pages,
                    got=sorted(set(pages) & set(self.ssr_pages)),
                    still_free=sorted(set(pages) & free_page_set(sched.token_to_kv_pool_allocator)),
                )
                self.ssr_victim_written.set()
            return result
        if fault == "send_foreign_page" and fault in self.faults and last_chunk:
            self.guarded("send_foreign_page", self.swap_in_victim_page, sched, req, _role)
        if fault == "send_truncated" and fault in self.faults and last_chunk:
            ps = page_size(sched)
            new_end = min(ps, len(req.origin_input_ids))
            self.ev.emit(
                fault,
                "truncated",
                rid=req.rid,
                room=int(req.bootstrap_room),
                prompt_tokens=len(req.origin_input_ids),
                end_idx=new_end,
            )
            return original(sched, req, last_chunk=last_chunk, end_idx=new_end)
        return original(sched, req, last_chunk=last_chunk, end_idx=end_idx)

    def swap_in_victim_page(self, sched, req, role) -> None:
        ps = page_size(sched)
        n = len(req.origin_input_ids)
        rt = sched.req_to_token_pool.req_to_token
        row = int(req.kv.req_pool_idx)
        if role == "v":
            self.sfp_victim_slots = rt[row, :ps].to("cpu").tolist()
            self.ev.emit("send_foreign_page", "victim", rid=req.rid, page=self.sfp_victim_slots[0] // ps)
            return
        if self.sfp_victim_slots is None or (self.sfp_restore is not None) or n <= ps:
            self.ev.emit("send_foreign_page", "skipped", rid=req.rid, why="no victim yet, or the prompt is one page")
            return
        start = ((n - 1) // ps) * ps  # the row's last page (partial or whole) within the prompt
        torch = _torch()
        original_slots = rt[row, start : start + ps].clone()
        own_page = int(original_slots[0]) // ps
        rt[row, start : start + ps] = torch.tensor(self.sfp_victim_slots, dtype=rt.dtype, device=rt.device)
        self.sfp_restore = (rt, row, start, original_slots)
        self.ev.emit(
            "send_foreign_page",
            "swapped",
            rid=req.rid,
            room=int(req.bootstrap_room),
            row_page_index=start // ps,
            own_page=own_page,
            victim_page=self.sfp_victim_slots[0] // ps,
        )

    def restore_swapped_row(self) -> None:
        if self.sfp_restore is None:
            return
        rt, row, start, original_slots = self.sfp_restore
        self.sfp_restore = None
        rt[row, start : start + len(original_slots)] = original_slots
        self.ev.emit("send_foreign_page", "restored", row_page_start=start)

    def drop_salt(self, req, key) -> None:
        fault, role = fault_and_role(getattr(req, "rid", None))
        if fault == "salt_dropped" and role == "f" and getattr(key, "cache_salt", None) is not None:
            if ("salt_dropped", req.rid) not in self.done:
                self.done.add(("salt_dropped", req.rid))
                self.ev.emit("salt_dropped", "dropped", rid=req.rid)
            key.cache_salt = None

    def wrong_prefix_page(self, batch, req, slots):
        """``_prefix_kv_indices``' result for ``req``: for the faulty request, the same slots with
        row page PWP_ROW_PAGE's replaced by the victim's cached page at that position (None: as is)."""
        fault, role = fault_and_role(getattr(req, "rid", None))
        if fault != "prefix_wrong_page":
            return None
        if role == "v":
            self.pwp_victim = (req.rid, list(req.origin_input_ids))
            return None
        if role != "f" or ("prefix_wrong_page", req.rid) in self.done or self.pwp_victim is None:
            return None
        ps = int(batch.token_to_kv_pool_allocator.page_size)
        lo, hi = PWP_ROW_PAGE * ps, (PWP_ROW_PAGE + 1) * ps
        if len(slots) < hi:
            return None
        from array import array

        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tree = batch.tree_cache
        victim, tokens = self.pwp_victim
        match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        theirs = tree.path_device_indices(match.last_device_node)[: match.device_prefix_len]
        if len(theirs) < hi:
            raise RuntimeError(f"victim {victim}'s prefix is no longer cached ({len(theirs)} slots)")
        self.done.add(("prefix_wrong_page", req.rid))
        out = slots.clone()
        out[lo:hi] = theirs[lo:hi].to(out.device, out.dtype)
        self.ev.emit(
            "prefix_wrong_page",
            "injected",
            rid=req.rid,
            victim=victim,
            row_page=PWP_ROW_PAGE,
            page=int(theirs[lo]) // ps,
            replaced=int(slots[lo]) // ps,
        )
        return out

    def arm_hicache(self, req) -> None:
        fault, role = fault_and_role(getattr(req, "rid", None))
        if fault in HICACHE_FAULTS and role == "v" and (fault, req.rid) not in self.done:
            self.hicache_victims[fault] = req.rid

    def act_on_queued_loads(self, cache) -> None:
        """An armed victim's load-back is queued, its copy not submitted yet."""
        controller = getattr(cache, "cache_controller", None)
        if not self.hicache_victims or controller is None or not controller.load_queue:
            return
        for fault, rid in list(self.hicache_victims.items()):
            if fault not in HICACHE_QUEUED_FAULTS:
                continue
            del self.hicache_victims[fault]
            self.done.add((fault, rid))
            if fault == "hicache_load_freed":
                self._free_queued_loads(cache, controller, rid)
            else:
                self._flip_queued_host_kv(controller, rid)

    def remember_backups(self, transfers) -> None:
        """The host slots of each backup of the KV pool, newest last (a few dozen kept)."""
        for t in transfers or ():
            host = getattr(t, "host_indices", None)
            if host is None or getattr(t, "is_draft", False) or len(host) == 0:
                continue
            self.hicache_backups.append(host.to("cpu").clone())
            del self.hicache_backups[:-64]

    def other_object(self, spec):
        """``hicache_other_object``: the armed victim's load-back takes another backup's host
        slots of the same length (its node names the wrong host object: a tree or tier serving
        another prefix's KV under this one, the object itself intact)."""
        fault = "hicache_other_object"
        rid = self.hicache_victims.get(fault)
        kv_xfer = spec[0] if isinstance(spec, tuple) else None
        host = getattr(kv_xfer, "host_indices", None)
        if rid is None or host is None or len(host) == 0:
            return
        mine = set(host.to("cpu").tolist())
        newer: set[int] = set()  # host slots backed up since: a backup they overlap is gone in part
        for other in reversed(self.hicache_backups):
            slots = set(other.tolist())
            if len(other) != len(host) or mine & slots or newer & slots:
                newer |= slots
                continue
            del self.hicache_victims[fault]
            self.done.add((fault, rid))
            kv_xfer.host_indices = other.to(host.device).clone()
            self.ev.emit(fault, "injected", victim=rid, tokens=len(host), host_slot=int(other[0]))
            return

    def _free_queued_loads(self, cache, controller, rid: str) -> None:
        """Give the load-back's destination pages back to the allocator (the tree still names them)."""
        ps = int(getattr(cache.token_to_kv_pool_allocator, "page_size", 1) or 1)
        slots = []
        for op in controller.load_queue:
            cache.token_to_kv_pool_allocator.free(op.device_indices)
            slots += op.device_indices.to("cpu").tolist()
        self.ev.emit("hicache_load_freed", "injected", victim=rid, pages=pages_of(slots, ps))

    def _flip_queued_host_kv(self, controller, rid: str) -> None:
        """Change the first queued host slot's K (one value per layer) in the host pool."""
        host_pool = controller.mem_pool_host.anchor_entry.host_pool
        if getattr(host_pool, "layout", None) != "layer_first":
            raise RuntimeError(f"host layout {getattr(host_pool, 'layout', None)!r}: only layer_first is flipped")
        slot = int(controller.load_queue[0].host_indices[0])
        host_pool.k_buffer[:, slot, 0, 0] += 1.0
        device_slot = int(controller.load_queue[0].device_indices[0])
        self.ev.emit("hicache_host_flipped", "injected", victim=rid, host_slot=slot, device_slot=device_slot)

    def sender_send(self, original, sender, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
        fault = self.pd_rooms.get(int(getattr(sender, "bootstrap_room", -1)))
        if fault == "sender_truncated" and len(kv_indices) > 1:
            self.ev.emit(
                fault,
                "truncated",
                room=int(sender.bootstrap_room),
                pages_asked=len(kv_indices),
                pages_sent=1,
                tokens_asked=num_kv_tokens,
            )
            ps = getattr(getattr(sender.kv_mgr, "kv_args", None), "page_size", None)
            kv_indices = kv_indices[:1]
            if num_kv_tokens is not None and ps:
                num_kv_tokens = min(int(num_kv_tokens), int(ps))
        return original(sender, kv_indices, state_indices, num_kv_tokens=num_kv_tokens, indices_event=indices_event)

    # ------------------------------------------------------------------ send_source_released
    # The sender's source pages change hands while its transfer is in flight: prefill gives the
    # faulty request's KV back right after its last chunk was handed to Mooncake (an early
    # release), the next request (the victim) is allocated those pages and computes its prompt
    # in them, and only then does Mooncake read them: decode receives the victim's KV.
    def add_transfer_request(self, original, mgr, room, *args, **kwargs):
        is_last = args[2] if len(args) > 2 else kwargs.get("is_last_chunk", False)
        fault = self.pd_rooms.get(int(room))
        if fault not in HELD_TRANSFER_FAULTS or not is_last:
            return original(mgr, room, *args, **kwargs)
        # announced at the next poll of the transfers in flight (announce_held), not here: this
        # runs inside send_kv_chunk, before kvguard's hook writes the chunk's XFER_SEND, and decode
        # acts on the announcement
        self.held_rooms[int(room)] = fault
        if fault == "completion_after_release":
            self.car_in_flight.add(int(room))

        def victim_ready() -> bool:
            if fault == "send_source_released":
                return self.ssr_victim_written.wait(SSR_HOLD_S)
            # completion_after_release: decode (another process) logs when the victim holds f's pages
            deadline = time.monotonic() + SSR_HOLD_S
            while time.monotonic() < deadline:
                if logged(self.ev, fault, "victim_reserved") is not None:
                    return True
                time.sleep(0.05)
            return False

        def later():
            got = victim_ready()
            status = getattr(mgr, "request_status", {}).get(room)
            self.ev.emit(
                fault,
                "transfer_released",
                room=int(room),
                victim_written=got,
                status=None if status is None else int(status),
                has_transfer_info=room in getattr(mgr, "transfer_infos", {}),
            )
            self.guarded(f"{fault} transfer", lambda: original(mgr, room, *args, **kwargs))
            if fault == "completion_after_release":
                self.guarded(f"{fault} notices", self._deliver_notices_after_landing, mgr, int(room))

        threading.Thread(target=later, name="kvgf-held-transfer", daemon=True).start()
        return None

    def hold_abort_notice(self, original, mgr, msg) -> bool:
        """Decode's abort notice for a room whose held transfer has not landed: kept until it has
        (the notice lost in the race that is this fault: prefill writes on, not knowing)."""
        try:
            room = int(msg[1])
        except (IndexError, TypeError, ValueError):
            room = None
        if room is not None and room in self.car_in_flight:
            self.car_notices.setdefault(room, []).append(msg)
            self.ev.emit("completion_after_release", "abort_notice_held", room=room)
            return True
        return original(mgr, msg)

    def _deliver_notices_after_landing(self, mgr, room: int) -> None:
        deadline = time.monotonic() + SSR_HOLD_S
        while time.monotonic() < deadline and int(mgr.request_status.get(room, -1)) not in (0, 4):
            time.sleep(0.02)  # (KVPoll.Failed 0, Success 4: the transfer has concluded)
        self.car_in_flight.discard(room)
        for msg in self.car_notices.pop(room, []):
            mgr._handle_abort_notification(msg)

    def completions_reported(self, done) -> None:
        for req in done or ():
            fault, role = fault_and_role(getattr(req, "rid", None))
            if fault == "completion_after_release" and role == "f":
                self.ev.emit(fault, "completion_reported", rid=req.rid)

    def keep_victim_decoding(self, batch) -> None:
        """Decode: while the victim holds f's pages and prefill has not reported f's completion,
        slow the steps that decode it (sleeping, no CPU), so the victim still holds the pages
        when the completion is on record (a victim that came and went is not named: its bytes
        may have landed after it left)."""
        fault = "completion_after_release"
        if batch is None or not self.car_victim_logged or (fault, "reported") in self.done:
            return
        if not any(fault_and_role(getattr(r, "rid", None)) == (fault, "v") for r in batch.reqs):
            return
        if logged(self.ev, fault, "completion_reported") is not None:
            self.done.add((fault, "reported"))
            return
        if self.car_hold_until is None:
            self.car_hold_until = time.monotonic() + HOLD_MAX_S
        if time.monotonic() < self.car_hold_until:
            time.sleep(HOLD_STEP_S)

    def announce_held(self) -> None:
        for room, fault in list(self.held_rooms.items()):
            del self.held_rooms[room]
            self.ev.emit(fault, "transfer_held", room=room)

    def release_early(self, sched) -> None:
        for req in list(getattr(sched, "disagg_prefill_inflight_queue", ())):
            fault, role = fault_and_role(getattr(req, "rid", None))
            if fault != "send_source_released" or role != "f" or req.rid in self.ssr_released:
                continue
            import inspect

            from sglang.srt.disaggregation import prefill as prefill_module

            ps = page_size(sched)
            pages = pages_of(row_slots(sched, req, len(req.origin_input_ids)), ps)
            release = prefill_module.release_kv_cache
            params = inspect.signature(inspect.unwrap(release)).parameters
            if "checkpoint" in params:  # 0.5.23
                release(req, sched.tree_cache, checkpoint=False)
            else:  # 0.5.19-0.5.22
                release(req, sched.tree_cache, is_insert=False)
            self.ssr_released.add(req.rid)
            # the prompt's pages went into the radix cache at prefill: unlocked now, the cache's own
            # eviction gives them back to the allocator (everything evictable goes, f's included)
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            tree = sched.tree_cache
            tree.evict(EvictParams(num_tokens=int(tree.evictable_size())))
            alloc = sched.token_to_kv_pool_allocator
            freed = sorted(set(pages) & free_page_set(alloc))
            pages_to_front(alloc, freed)
            self.ssr_pages = freed
            self.ev.emit(
                "send_source_released", "released_early", rid=req.rid, room=int(req.bootstrap_room), pages=freed
            )

    def skip_second_release(self, original, req, *args, **kwargs):
        if getattr(req, "rid", None) in self.ssr_released and not req.kv.holds_kv:
            self.ev.emit("send_source_released", "second_release_skipped", rid=req.rid)
            return None
        return original(req, *args, **kwargs)

    # ------------------------------------------------------------------ completion_after_release
    # Decode gives a reservation up while prefill's transfer into it is still in flight and
    # releases its pages at once (the deferred release of a failed transfer reverted for that
    # request), the next request is reserved the same pages, and then the transfer completes.
    def pop_transferred(self, original, queue, *args, **kwargs):
        fault = "completion_after_release"
        target = None
        sched = queue.scheduler
        for decode_req in list(queue.queue):
            req = decode_req.req
            f, role = fault_and_role(getattr(req, "rid", None))
            if f != fault:
                continue
            room = int(req.bootstrap_room)
            if role == "f" and req.rid not in self.car_released:
                if logged(self.ev, fault, "transfer_held", room=room) is not None:
                    target = decode_req
            elif role == "v" and self.car_pages and not self.car_victim_logged:
                pages = pages_of(row_slots(sched, req, len(req.origin_input_ids)), page_size(sched))
                self.car_victim_logged = True
                self.ev.emit(
                    fault, "victim_reserved", rid=req.rid, pages=pages, got=sorted(set(pages) & set(self.car_pages))
                )
        if target is None:
            return original(queue, *args, **kwargs)
        req = target.req
        pages = pages_of(row_slots(sched, req, len(req.origin_input_ids)), page_size(sched))
        self.car_fail_room = int(req.bootstrap_room)
        deferred = queue.enable_deferred_kv_release
        queue.enable_deferred_kv_release = False
        try:
            return original(queue, *args, **kwargs)
        finally:
            queue.enable_deferred_kv_release = deferred
            self.car_fail_room = None
            self.car_released.add(req.rid)
            pages_to_front(sched.token_to_kv_pool_allocator, pages)
            self.car_pages = pages
            self.ev.emit(fault, "released_early", rid=req.rid, room=int(req.bootstrap_room), pages=pages)

    def fail_the_poll(self, polls, queue):
        """During the released request's pop_transferred: its poll reads Failed."""
        if self.car_fail_room is None or polls is None:
            return polls
        polls = list(polls)
        for i, decode_req in enumerate(queue.queue[: len(polls)]):
            if int(getattr(decode_req.req, "bootstrap_room", -1)) == self.car_fail_room:
                polls[i] = KV_POLL_FAILED
        return polls

    # ------------------------------------------------------------------ PD decode
    def flip_received_page(self, queue, decode_req) -> None:
        """XOR one byte (K, layer 0, head 0, the low byte of its first element) of the
        first slot of row page FLIP_ROW_PAGE: a torn or late write into a received page."""
        req = decode_req.req
        fault, _role = fault_and_role(getattr(req, "rid", None))
        if fault != "flip_received_page" or fault not in self.faults or (fault, req.rid) in self.done:
            return
        self.done.add((fault, req.rid))
        torch = _torch()
        sched = queue.scheduler
        ps = page_size(sched)
        n = len(req.origin_input_ids)
        index = FLIP_ROW_PAGE if n > FLIP_ROW_PAGE * ps else 0
        position = index * ps
        slot = row_slots(sched, req, n)[position]
        pool = sched.token_to_kv_pool_allocator.get_kvcache()
        layer = 0
        k = pool.k_buffer[layer]
        before = int(k[slot].contiguous().view(torch.uint8).reshape(-1)[0])
        k[slot].view(torch.uint8).reshape(-1)[0] ^= 0x01  # the low mantissa bits of a bf16: never a NaN
        after = int(k[slot].contiguous().view(torch.uint8).reshape(-1)[0])
        self.ev.emit(
            fault,
            "flipped",
            rid=req.rid,
            room=int(req.bootstrap_room),
            page=slot // ps,
            slot=slot,
            position=position,
            row_page_index=index,
            layer=layer,
            head=0,
            byte_before=before,
            byte_after=after,
        )


def transfer_landed(decode_req) -> bool:
    """Whether the receiver's transfer manager reports the room's transfer done (a plain
    read of its status table: no poll, which would change the receiver's state)."""
    receiver = decode_req.kv_receiver
    room = getattr(receiver, "bootstrap_room", None)
    mgr = getattr(receiver, "kv_mgr", None)
    if room is None or mgr is None or room not in getattr(mgr, "request_status", {}):
        return False
    return int(mgr.check_status(room)) == 4  # KVPoll.Success


# --------------------------------------------------------------------------- registration
_driver: Driver | None = None


def register(faults: set[str], folder: str | None) -> Driver:
    global _driver
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    d = _driver = Driver(faults, Events(folder))

    if faults & set(UNIFIED_FAULTS):

        def run_batch_hook(original, sched, batch, *args, **kwargs):
            restore = d.guarded("run_batch", d.before_run, sched, batch)
            try:
                return original(sched, batch, *args, **kwargs)
            finally:
                if restore is not None:
                    d.guarded("restore", restore)

        def process_batch_result_hook(original, sched, batch, *args, **kwargs):
            d.guarded("before_process", d.before_process, sched, batch)
            result = original(sched, batch, *args, **kwargs)
            d.guarded("after_process", d.after_process, sched, batch)
            return result

        HookRegistry.register(RUN_BATCH, run_batch_hook, HookType.AROUND)
        HookRegistry.register(PROCESS_BATCH_RESULT, process_batch_result_hook, HookType.AROUND)

    if "swa_freed_under_reader" in faults:

        def prepare_for_extend_hook(original, batch, *args, **kwargs):
            d.guarded("swa_freed_under_reader", d.swa_other_admitted, batch)
            try:
                return original(batch, *args, **kwargs)
            finally:
                d.swa_batch = None

        def swa_alloc_extend_hook(original, alloc, *args, **kwargs):
            d.guarded("swa_freed_under_reader", d.swa_free_for_other, alloc)
            return original(alloc, *args, **kwargs)

        HookRegistry.register(PREPARE_FOR_EXTEND, prepare_for_extend_hook, HookType.AROUND)
        HookRegistry.register(SWA_ALLOC_EXTEND, swa_alloc_extend_hook, HookType.AROUND)

    if "salt_dropped" in faults:

        def radix_key_hook(original, tree_cache, req, *args, **kwargs):
            key = original(tree_cache, req, *args, **kwargs)
            d.guarded("drop_salt", d.drop_salt, req, key)
            return key

        HookRegistry.register(RADIX_KEY, radix_key_hook, HookType.AROUND)

    if "prefix_wrong_page" in faults:

        def prefix_kv_indices_hook(original, batch, req, *args, **kwargs):
            slots = original(batch, req, *args, **kwargs)
            wrong = d.guarded("prefix_wrong_page", d.wrong_prefix_page, batch, req, slots)
            return slots if wrong is None else wrong

        HookRegistry.register(PREFIX_KV_INDICES, prefix_kv_indices_hook, HookType.AROUND)

    if faults & set(HICACHE_FAULTS):

        def arm_hook(original, tree_cache, req, *args, **kwargs):
            d.guarded("hicache_arm", d.arm_hicache, req)
            return original(tree_cache, req, *args, **kwargs)

        def ready_hook(original, cache, *args, **kwargs):
            d.guarded("hicache_queued_loads", d.act_on_queued_loads, cache)
            return original(cache, *args, **kwargs)

        HookRegistry.register(RADIX_KEY, arm_hook, HookType.AROUND)
        HookRegistry.register(READY_TO_LOAD, ready_hook, HookType.AROUND)

    if "hicache_other_object" in faults:

        def d2h_hook(original, engine, *args, **kwargs):
            d.guarded("hicache_backups", d.remember_backups, args[0] if args else kwargs.get("transfers"))
            return original(engine, *args, **kwargs)

        def load_back_spec_hook(original, core, *args, **kwargs):
            spec = original(core, *args, **kwargs)
            d.guarded("hicache_other_object", d.other_object, spec)
            return spec

        HookRegistry.register(D2H, d2h_hook, HookType.AROUND)
        for target in LOAD_BACK_SPECS:
            HookRegistry.register(target, load_back_spec_hook, HookType.AROUND)

    if faults & set(PD_FAULTS):

        def num_pages_hook(result, queue, req, *args, **kwargs):
            return d.guarded("num_pages_to_send", d.num_pages_to_send, result, queue, req)

        def send_inner_hook(original, sched, req, last_chunk=False, end_idx=None):
            return d.send_kv_chunk_inner(original, sched, req, last_chunk=last_chunk, end_idx=end_idx)

        HookRegistry.register(NUM_PAGES_TO_SEND, num_pages_hook, HookType.AFTER)
        HookRegistry.register(SEND_KV_CHUNK_INNER, send_inner_hook, HookType.AROUND)
        if "send_foreign_page" in faults and not faults & set(UNIFIED_FAULTS):

            def restore_hook(original, sched, batch, *args, **kwargs):
                try:
                    return original(sched, batch, *args, **kwargs)
                finally:
                    d.guarded("restore_swapped_row", d.restore_swapped_row)

            HookRegistry.register(PROCESS_BATCH_RESULT, restore_hook, HookType.AROUND)
        if faults & set(HELD_TRANSFER_FAULTS):

            def add_transfer_hook(original, mgr, room, *args, **kwargs):
                return d.add_transfer_request(original, mgr, room, *args, **kwargs)

            def inflight_hook(original, sched, *args, **kwargs):
                d.guarded("held transfers", d.announce_held)
                d.guarded("send_source_released release", d.release_early, sched)
                done = original(sched, *args, **kwargs)
                d.guarded("completions reported", d.completions_reported, done)
                return done

            def release_hook(original, req, *args, **kwargs):
                return d.skip_second_release(original, req, *args, **kwargs)

            def abort_notice_hook(original, mgr, msg, *args, **kwargs):
                return d.hold_abort_notice(lambda m, x: original(m, x, *args, **kwargs), mgr, msg)

            HookRegistry.register(MOONCAKE_ADD_TRANSFER, add_transfer_hook, HookType.AROUND)
            HookRegistry.register(MOONCAKE_ABORT_NOTICE, abort_notice_hook, HookType.AROUND)
            HookRegistry.register(INFLIGHT_QUEUE, inflight_hook, HookType.AROUND)
            HookRegistry.register(RELEASE_KV_CACHE, release_hook, HookType.AROUND)
        if "sender_truncated" in faults:

            def sender_hook(original, sender, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
                return d.sender_send(original, sender, kv_indices, state_indices, num_kv_tokens, indices_event)

            HookRegistry.register(MOONCAKE_SEND, sender_hook, HookType.AROUND)

    if "completion_after_release" in faults:

        def pop_hook(original, queue, *args, **kwargs):
            return d.pop_transferred(original, queue, *args, **kwargs)

        def poll_hook(original, queue, *args, **kwargs):
            polls = original(queue, *args, **kwargs)
            out = d.guarded("completion_after_release poll", d.fail_the_poll, polls, queue)
            return polls if out is None else out

        def slow_victim_hook(original, sched, batch, *args, **kwargs):
            d.guarded("completion_after_release victim", d.keep_victim_decoding, batch)
            return original(sched, batch, *args, **kwargs)

        HookRegistry.register(POP_TRANSFERRED, pop_hook, HookType.AROUND)
        HookRegistry.register(POLL_GATE, poll_hook, HookType.AROUND)
        HookRegistry.register(RUN_BATCH, slow_victim_hook, HookType.AROUND)

    if faults & set(DECODE_FAULTS):

        def gate_hook(queue, *args, **kwargs):
            for decode_req in list(queue.queue):
                if d.guarded("transfer_landed", transfer_landed, decode_req):
                    d.guarded("flip_received_page", d.flip_received_page, queue, decode_req)
            return None  # BEFORE hook: the arguments are unchanged

        HookRegistry.register(POLL_GATE, gate_hook, HookType.BEFORE)

    log.warning("kvguard_faults: TEST-ONLY fault injection armed in pid %d: %s", os.getpid(), ", ".join(sorted(faults)))
    d.ev.emit("plugin", "armed", faults=sorted(faults))
    return d

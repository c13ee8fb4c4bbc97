"""Tier 1: the read-time check inside the engine (pure torch; no engine imports).

The sidecar (Tier 2) judges every read from the records, but only while one is
attached and keeping up. Tier 1 runs in the engine process itself, on the engine's
device, so a foreign or freed page in a row is caught even with no sidecar:

* one ``int32`` **tag per KV page** (``tags``) and one **tag per req_to_token row**
  (``row_tags``), kept by the hooks that already see alloc / assign / free / row
  binding (fed by ``engine_hooks.probes.Probes``);
* per forward, **one gather + compare** over the rows attention reads
  (``req_to_token[rows, 0:seq_len:page_size]``): a row page is fine when its tag
  is the reader's own tag or a readable one (prefix-cache shared, never seen);
* the **violation count** is read back without stalling the step: on CPU it is a
  plain read (the work is synchronous anyway); on a GPU it is a ``non_blocking``
  copy into pinned memory plus an event, looked at on a later step;
* **details** (which request, which pages, whose they are) are computed only when
  the count is non-zero, then logged, counted and handed to ``on_violation``
  (the probes write a TIER1_VIOLATION record into the ring).

Tag values (int32)::

    UNKNOWN  2**31-1  never seen allocated since Tier 1 started (and padding page 0): readable
    SHARED   2**31-2  handed to a row through the prefix cache (many readers): readable
    1 ..     < SHARED one live request's own page (its tag: a per-process counter)
    FREE     -1       in the allocator's free list
    ALLOCATED -2      handed out, in no row yet

Rules (mirroring the sidecar's ownership model, but per page rather than per row,
so coarser and never stricter): ``alloc`` -> ALLOCATED; ``free`` -> FREE; a row
assignment below ``shared_until`` -> SHARED (a FREE page stays FREE, and the request's
own page stays its own: the radix cache re-asserts every prefilled row); an own
assignment claims pages that are ALLOCATED, UNKNOWN or already the request's
(another request's page is *not* claimed, so reading it is a violation).

The host arrays are the truth; on a GPU the device copies are brought up to date
(only the pages that changed) at the start of each check, on the stream the
forward runs on, so the check sees exactly the tags of the moment it was issued.

Failure contract: any exception, or an input tensor of an unexpected dtype or
device, is logged once with the reason, counted, and turns Tier 1 off for the rest
of the process; serving is never affected.
"""

from __future__ import annotations

import collections
import logging
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where a check runs (the sidecar has no torch)
    import torch

log = logging.getLogger("kvguard.tier1")

ENV = "KVGUARD_TIER1"
UNKNOWN = 2**31 - 1
SHARED = 2**31 - 2
READABLE_MIN = SHARED  # tags >= this are readable by every request
FREE = -1
ALLOCATED = -2
MAX_REQUEST_TAG = SHARED - 1
MAX_PAGES = 1 << 24  # a page id beyond this is refused (a corrupt input must not allocate gigabytes)
MAX_TRACKED = 1 << 16  # live request tags remembered (bounded like the adapter's other maps)
MAX_REPORTED = 1 << 14  # (reader, page) pairs already reported: a row stays corrupt for many steps
PENDING_MAX = 8  # GPU checks in flight before the oldest is waited for

# what a violation's page tag was (wire.Tier1Tag values)
TAG_FREE, TAG_ALLOCATED, TAG_OTHER = 1, 2, 3
TAG_NAMES = {TAG_FREE: "free", TAG_ALLOCATED: "allocated", TAG_OTHER: "other_request"}


# Set by an enforcer that needs the check whatever KVGUARD_TIER1 says (the guard's
# ``KVGUARD_GUARD=full``, engine_hooks/sglang/guard.py): (who asked, its per-reader callback).
_required: tuple[str, object] | None = None


def require(by: str | None, on_reader=None) -> None:
    """Turn the check on for this process, for ``by``, and hand every reader a check finds
    violating to ``on_reader(rid, tags, pages, owners)`` (each check that finds it, not only
    the first: an enforcer must see the reader in the step it acts on). ``None``: no longer
    required (KVGUARD_TIER1 decides again)."""
    global _required
    _required = None if by is None else (by, on_reader)


def required_by() -> tuple[str, object] | None:
    return _required


def enabled_from_env(environ=None) -> bool:
    """``KVGUARD_TIER1=1`` turns the check on. Off by default: on a GPU it costs a few
    small kernels per step, and on a CPU engine the gather runs on the serving cores
    (docs/performance.md); a bad value is logged and leaves it off. An enforcer that
    :func:`require` d it turns it on regardless."""
    if _required is not None:
        return True
    raw = (os.environ if environ is None else environ).get(ENV, "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw not in ("", "0", "false", "no", "off"):
        log.error("kvguard: %s=%r is not one of 1/0/true/false; Tier 1 stays off", ENV, raw)
    return False


class Tier1InputError(TypeError):
    """An engine tensor Tier 1 cannot check (dtype, device, shape)."""


class _Bounded(collections.OrderedDict):
    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > self.limit:
            self.popitem(last=False)


class Violation:
    """One reader's refused row pages in one forward."""

    __slots__ = ("rid", "seq_len", "pages", "row_indices", "owners", "tags")

    def __init__(self, rid, seq_len, pages, row_indices, owners, tags):
        self.rid, self.seq_len = rid, seq_len
        self.pages, self.row_indices, self.owners, self.tags = pages, row_indices, owners, tags

    def describe(self) -> str:
        parts = []
        for page, row_idx, owner, tag in zip(self.pages, self.row_indices, self.owners, self.tags):
            whose = f"request {owner}" if tag == TAG_OTHER else TAG_NAMES[tag]
            parts.append(f"page {page} (row page {row_idx}, {whose})")
        return ", ".join(parts)


class Tier1:
    def __init__(self, num_pages: int, page_size: int, on_violation=None, on_error=None, on_reader=None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = int(page_size)
        self.shift = self.page_size.bit_length() - 1 if self.page_size & (self.page_size - 1) == 0 else None
        self.tags = np.full(min(max(int(num_pages) + 2, 2), MAX_PAGES), UNKNOWN, np.int32)
        self.row_tags = np.zeros(1024, np.int32)  # 0: row not bound to a known request (not judged)
        self.on_violation = on_violation
        self.on_error = on_error  # (where, exception) once, when Tier 1 turns itself off
        # (rid, tags, pages, owners) for every violating reader of every check, before the
        # once-per-(reader, page) report: the guard's read enforcement (KVGUARD_GUARD=full)
        self.on_reader = on_reader
        self.enabled = True
        self.disabled_reason = ""
        self.errors = 0
        self.checks = 0
        self.violations = 0  # violating (reader, page) reads, every step counted
        self.reported = 0  # distinct (reader, page) pairs logged and recorded
        self._rid_tag: _Bounded = _Bounded(MAX_TRACKED)
        self._tag_rid: _Bounded = _Bounded(MAX_TRACKED)
        self._next_tag = 1
        self._seen: _Bounded = _Bounded(MAX_REPORTED)
        # device side (bound on the first check)
        self.device: torch.device | None = None
        self._tags_dev: torch.Tensor | None = None  # tags on the device (the host array itself on CPU)
        self._rows_dev: torch.Tensor | None = None  # row_tags, the same
        self._dirty_pages: list = []
        self._dirty_rows: list = []
        self._arange: torch.Tensor | None = None
        self._pending: collections.deque = collections.deque()
        self._pinned: torch.Tensor | None = None  # GPU: the violation counts read back, one per check in flight
        self._pin_next = 0
        self._bufs: dict = {}  # CPU only: reused work tensors of the check

    # ------------------------------------------------------------------ guard
    def _failed(self, where: str, exc: BaseException) -> None:
        self.errors += 1
        if self.enabled:
            self.enabled = False
            self.disabled_reason = f"{where}: {type(exc).__name__}: {exc}"
            log.error(
                "kvguard tier1 %s failed; Tier 1 is off for this process (serving is unaffected): %s: %s",
                where,
                type(exc).__name__,
                exc,
            )
            if self.on_error is not None:
                try:
                    self.on_error(where, exc)
                except Exception:  # noqa: BLE001
                    pass

    # ------------------------------------------------------------------ tags
    def tag_for(self, rid) -> int:
        tag = self._rid_tag.get(rid)
        if tag is None:
            tag = self._next_tag
            self._next_tag = tag + 1 if tag < MAX_REQUEST_TAG else 1
            self._rid_tag[rid] = tag
            self._tag_rid[tag] = rid
        return tag

    def _pages(self, pages) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64).reshape(-1)
        pages = pages[pages > 0]  # page 0 is the padding target: never anyone's
        if len(pages) and int(pages.max()) >= len(self.tags):
            top = int(pages.max())
            if top >= MAX_PAGES:
                raise Tier1InputError(f"page id {top} beyond {MAX_PAGES}")
            grown = np.full(max(top + 1, 2 * len(self.tags)), UNKNOWN, np.int32)
            grown[: len(self.tags)] = self.tags
            self.tags = grown
            self._tags_dev = None  # re-uploaded whole at the next check
        return pages

    def _touch(self, pages: np.ndarray) -> None:
        if self._tags_dev is not None and self.device is not None and self.device.type != "cpu" and len(pages):
            self._dirty_pages.append(pages)

    def allocated(self, pages) -> None:
        if not self.enabled:
            return
        try:
            p = self._pages(pages)
            self.tags[p] = ALLOCATED
            self._touch(p)
        except Exception as exc:  # noqa: BLE001
            self._failed("allocated", exc)

    def freed(self, pages) -> None:
        if not self.enabled:
            return
        try:
            p = self._pages(pages)
            self.tags[p] = FREE
            self._touch(p)
        except Exception as exc:  # noqa: BLE001
            self._failed("freed", exc)

    def assigned(self, rid, row_start: int, shared_until: int, pages) -> None:
        """``pages[k]`` is the page of row page index ``row_start // page_size + k``."""
        if not self.enabled:
            return
        try:
            pages = np.asarray(pages, dtype=np.int64).reshape(-1)
            if len(pages) == 0:
                return
            ps = self.page_size
            first = int(row_start) // ps
            positions = np.maximum(np.arange(first, first + len(pages)) * ps, int(row_start))
            shared = positions < int(shared_until)
            own = self.tag_for(rid)
            if shared.any():
                sp = self._pages(pages[shared])
                t = self.tags[sp]
                # the radix cache re-asserting a request's own pages (after each prefill chunk,
                # at release) leaves them its own; another request's page (or one never
                # claimed) handed over through the cache becomes readable by all
                self.tags[sp] = np.where((t == FREE) | (t == own), t, SHARED)
                self._touch(sp)
            if not shared.all():
                op = self._pages(pages[~shared])
                t = self.tags[op]
                claim = (t == ALLOCATED) | (t == UNKNOWN) | (t == own)
                self.tags[op[claim]] = own
                self._touch(op[claim])
        except Exception as exc:  # noqa: BLE001
            self._failed("assigned", exc)

    def bind_row(self, row: int, rid) -> None:
        if not self.enabled:
            return
        try:
            row = int(row)
            if row >= len(self.row_tags):
                if row >= MAX_PAGES:
                    raise Tier1InputError(f"row {row} beyond {MAX_PAGES}")
                grown = np.zeros(max(row + 1, 2 * len(self.row_tags)), np.int32)
                grown[: len(self.row_tags)] = self.row_tags
                self.row_tags = grown
                self._rows_dev = None
            self.row_tags[row] = self.tag_for(rid)
            if self._rows_dev is not None and self.device is not None and self.device.type != "cpu":
                self._dirty_rows.append(row)
        except Exception as exc:  # noqa: BLE001
            self._failed("bind_row", exc)

    def unbind_row(self, row: int) -> None:
        if not self.enabled:
            return
        try:
            row = int(row)
            if 0 <= row < len(self.row_tags):
                self.row_tags[row] = 0
                if self._rows_dev is not None and self.device is not None and self.device.type != "cpu":
                    self._dirty_rows.append(row)
        except Exception as exc:  # noqa: BLE001
            self._failed("unbind_row", exc)

    # ------------------------------------------------------------------ device copies
    def _sync_device(self, torch, device: torch.device) -> None:
        """Bring the device copies of ``tags`` and ``row_tags`` up to date."""
        if self.device is None:
            self.device = device
        tags_dev, rows_dev = self._tags_dev, self._rows_dev
        if self.device.type == "cpu":
            # the device arrays are the host arrays (no copy, nothing to bring up to date)
            if tags_dev is None or tags_dev.data_ptr() != self.tags.ctypes.data:
                self._tags_dev = torch.from_numpy(self.tags)
            if rows_dev is None or rows_dev.data_ptr() != self.row_tags.ctypes.data:
                self._rows_dev = torch.from_numpy(self.row_tags)
            return
        if tags_dev is None:
            self._tags_dev = torch.from_numpy(self.tags).to(device)
            self._dirty_pages.clear()
        elif self._dirty_pages:
            idx = np.unique(np.concatenate(self._dirty_pages))
            self._dirty_pages.clear()
            tags_dev[torch.from_numpy(idx).to(device, non_blocking=True)] = torch.from_numpy(self.tags[idx]).to(
                device, non_blocking=True
            )
        if rows_dev is None:
            self._rows_dev = torch.from_numpy(self.row_tags).to(device)
            self._dirty_rows.clear()
        elif self._dirty_rows:
            idx = np.unique(np.asarray(self._dirty_rows, np.int64))
            self._dirty_rows.clear()
            rows_dev[torch.from_numpy(idx).to(device, non_blocking=True)] = torch.from_numpy(self.row_tags[idx]).to(
                device, non_blocking=True
            )

    # ------------------------------------------------------------------ the check
    def check(self, req_to_token, req_pool_indices, seq_lens, rids, max_seq_len: int | None = None) -> int | None:
        """Check the rows of one forward. ``req_to_token``: the engine's [rows, ctx] int
        tensor; ``req_pool_indices`` / ``seq_lens``: the batch's rows and lengths (the
        first ``len(rids)`` entries are real requests; the rest is padding);
        ``max_seq_len``: the host-side maximum of those lengths when the engine has it
        (saves a device read). Returns the number of violating row pages found by this
        check when known now (CPU), else None (GPU: looked at on a later check)."""
        if not self.enabled:
            return None
        try:
            return self._check(req_to_token, req_pool_indices, seq_lens, rids, max_seq_len)
        except Exception as exc:  # noqa: BLE001
            self._failed("check", exc)
            return None

    def _check(self, req_to_token, req_pool_indices, seq_lens, rids, max_seq_len):
        import torch

        n = len(rids)
        for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
            if not isinstance(t, torch.Tensor):
                raise Tier1InputError(f"{name} is {type(t).__name__}, not a torch.Tensor")
            if t.dtype not in (torch.int32, torch.int64):
                raise Tier1InputError(f"{name} has dtype {t.dtype}, expected int32 or int64")
        if req_to_token.dim() != 2:
            raise Tier1InputError(f"req_to_token has {req_to_token.dim()} dimensions, expected 2")
        device = req_to_token.device
        if self.device is not None and device != self.device:
            raise Tier1InputError(f"req_to_token is on {device}, Tier 1 runs on {self.device}")
        if req_pool_indices.device != device or seq_lens.device != device:
            raise Tier1InputError(
                f"req_pool_indices on {req_pool_indices.device}, seq_lens on {seq_lens.device}, "
                f"req_to_token on {device}"
            )
        self._sync_device(torch, device)
        self._poll(block=False)
        if n == 0:
            return 0
        self.checks += 1
        if self.checks == 1:
            log.info("kvguard tier1: first check ran on %s (%d requests)", device, n)
        ps = self.page_size
        if max_seq_len is None:
            max_seq_len = int(seq_lens[:n].max())
        width = min(-(-int(max_seq_len) // ps), -(-req_to_token.shape[1] // ps))
        if width <= 0:
            return 0
        idx = req_pool_indices[:n].long()
        cols = req_to_token[:, : width * ps : ps]
        # one gather: the slot starting each row page. On CPU into reused buffers (fresh
        # half-megabyte tensors cost page faults every step); on a GPU fresh ones, since a
        # check in flight keeps its tensors until its count is read back
        slots = torch.index_select(cols, 0, idx, out=self._buf("slots", (n, width), cols.dtype, device))
        if self.shift is not None:
            pages = slots.bitwise_right_shift_(self.shift)
        else:
            pages = torch.div(slots, ps, rounding_mode="floor", out=slots)
        pages = pages.clamp_(0, len(self.tags) - 1)  # stale entries past seq_len may hold anything
        tags_dev, rows_dev = self._tags_dev, self._rows_dev
        assert tags_dev is not None and rows_dev is not None  # (made by _sync_device above)
        got = torch.index_select(
            tags_dev, 0, pages.view(-1), out=self._buf("got", (n * width,), tags_dev.dtype, device)
        ).view(n, width)
        reader = rows_dev.index_select(0, idx)
        n_pages = (seq_lens[:n] + (ps - 1)) // ps if self.shift is None else (seq_lens[:n] + (ps - 1)) >> self.shift
        n_pages = n_pages * (reader != 0)  # rows bound to no known request are not judged
        if self._arange is None or self._arange.numel() < width or self._arange.device != device:
            self._arange = torch.arange(max(width, 1024), device=device, dtype=n_pages.dtype)
        bad = torch.ne(got, reader.unsqueeze(1), out=self._buf("bad", (n, width), torch.bool, device))
        tmp = torch.lt(got, READABLE_MIN, out=self._buf("tmp", (n, width), torch.bool, device))
        bad.logical_and_(tmp)
        bad.logical_and_(torch.lt(self._arange[:width].unsqueeze(0), n_pages.unsqueeze(1), out=tmp))
        count = bad.sum()
        seq_host = seq_lens[:n]
        if device.type == "cpu":
            c = int(count)
            if c:
                self._details(bad, pages, got, list(rids), seq_host)
            return c
        # GPU: read the count back later, without waiting for the step
        if self._pinned is None:
            self._pinned = torch.zeros(PENDING_MAX, dtype=torch.int64, pin_memory=True)
        slot = self._pin_next
        self._pin_next = (slot + 1) % PENDING_MAX
        if len(self._pending) >= PENDING_MAX:
            self._poll(block=True, keep=PENDING_MAX - 1)
        self._pinned[slot : slot + 1].copy_(count.reshape(1), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        # the engine may advance its seq_lens in place before this is looked at: keep a copy
        self._pending.append((event, slot, bad, pages, got, list(rids), seq_host.clone()))
        return None

    def _buf(self, name: str, shape: tuple, dtype, device):
        import torch

        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        numel = 1
        for d in shape:
            numel *= d
        b = self._bufs.get(name)
        if b is None or b.numel() < numel or b.dtype != dtype:
            b = self._bufs[name] = torch.empty(max(numel, 1 << 16), dtype=dtype)
        return b[:numel].view(shape)

    def _poll(self, block: bool, keep: int = 0) -> None:
        """Look at finished GPU checks (oldest first); with ``block`` wait until at most ``keep`` remain."""
        pinned = self._pinned
        while self._pending:
            event, slot, bad, pages, got, rids, seq = self._pending[0]
            if not event.query():
                if not block or len(self._pending) <= keep:
                    return
                event.synchronize()
            self._pending.popleft()
            assert pinned is not None  # a check in flight was issued with its count slot in it
            if int(pinned[slot]):
                self._details(bad, pages, got, rids, seq)

    def flush(self) -> None:
        """Wait for every GPU check in flight and report what it found (nothing to do on CPU,
        where each check is looked at inline). Tests and shutdown call it, and the guard
        (KVGUARD_GUARD=full) where the scheduler itself synchronizes for the sampled tokens:
        the checks were queued before the forwards whose results it waits for, so this adds
        at most the check kernels' own time to a wait the scheduler makes anyway."""
        if self.enabled and self._pending:
            try:
                self._poll(block=True)
            except Exception as exc:  # noqa: BLE001
                self._failed("flush", exc)

    # ------------------------------------------------------------------ details (violations only)
    def _details(self, bad, pages, got, rids, seq_lens) -> None:
        where = bad.nonzero().cpu().numpy()
        pg = pages[bad].cpu().numpy().astype(np.int64)
        tg = got[bad].cpu().numpy().astype(np.int64)
        seq = seq_lens.cpu().numpy()
        self.violations += len(where)
        for i in np.unique(where[:, 0]).tolist():
            sel = where[:, 0] == i
            rid = rids[i]
            if self.on_reader is not None:
                self._tell_reader(rid, pg[sel], tg[sel])
            fresh = [k for k in np.flatnonzero(sel).tolist() if (rid, int(pg[k])) not in self._seen]
            if not fresh:
                continue
            for k in fresh:
                self._seen[(rid, int(pg[k]))] = True
            kinds, owners = self._kinds_owners(tg[fresh])
            v = Violation(
                rid, int(seq[i]), [int(pg[k]) for k in fresh], [int(where[k, 1]) for k in fresh], owners, kinds
            )
            self.reported += len(fresh)
            log.error("kvguard tier1 VIOLATION #%d: request %s read %s", self.reported, rid, v.describe())
            if self.on_violation is not None:
                try:
                    self.on_violation(v, self.reported)
                except Exception as exc:  # noqa: BLE001 - the log line and the counter stand on their own
                    log.warning("kvguard tier1: reporting a violation failed: %s: %s", type(exc).__name__, exc)

    def _kinds_owners(self, tags: np.ndarray) -> tuple[list[int], list]:
        """What each refused page's tag says (TAG_*), and its owning rid for another request's page."""
        kinds = [TAG_FREE if t == FREE else TAG_ALLOCATED if t == ALLOCATED else TAG_OTHER for t in tags.tolist()]
        owners = [self._tag_rid.get(t) if k == TAG_OTHER else None for t, k in zip(tags.tolist(), kinds)]
        return kinds, owners

    def _tell_reader(self, rid, pages: np.ndarray, tags: np.ndarray) -> None:
        kinds, owners = self._kinds_owners(tags)
        try:
            self.on_reader(rid, kinds, pages.tolist(), owners)
        except Exception as exc:  # noqa: BLE001 - the enforcer's failure is its own; the check goes on
            log.warning("kvguard tier1: the reader callback failed: %s: %s", type(exc).__name__, exc)

    def stats(self) -> dict:
        return {
            "enabled": self.enabled,
            "checks": self.checks,
            "violations": self.violations,
            "reported": self.reported,
            "errors": self.errors,
            "disabled_reason": self.disabled_reason,
        }

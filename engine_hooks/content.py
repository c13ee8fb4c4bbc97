"""Content at rest: a fingerprint of each KV slot when a hooked path writes it, verified
before a forward reads the slot (``KVGUARD_CONTENT_CHECK``).

Page records say who *should* have written a page; they cannot see a write that
bypasses every hooked path: a late RDMA write posted before an abort that lands after
the page was reassigned, a direct ``set_kv_buffer`` from a buggy path. Such a write
changes the KV bytes of a slot without a FORWARD or a transfer completion naming it.
This module keeps, per slot of the host KV pool, a 64-bit fingerprint of the slot's
layer-0 K and V bytes as the last hooked write left them (a forward's ``out_cache_loc``
after the forward ran; a transfer's reserved slots when decode's poll reports it done),
and before each forward re-computes it for (a sample of) the slots that forward's
readers attend over. A slot whose bytes changed with no hooked write is reported once
(``Probes.content_changed``): the sidecar raises ``late_write`` with
``evidence.via = "content"`` on its page.

The fingerprint: the K and V bytes of the slot's first KV head in layer 0, as
little-endian u64 words, each multiplied by a fixed odd random u64 and summed mod 2**64
(vectorised numpy, no Python per slot). Any change of a single word changes it (an odd
multiplier is invertible mod 2**64); unrelated changes cancel with probability 2**-64.
Layer 0's head 0 only: a write that leaves those bytes alone is not seen. The writes this
is for (a late RDMA write, a store or load-back, a pool write) write whole slots, every
head of every layer; the transfer digests cover all heads and layers of what was
transferred. Hashing every head costs the number of heads times more (measured: 1.9 ms
instead of ~0.2 ms per step at batch 256 for 8 heads x 128 dims).

Cost (host pools): 8 bytes of memory per slot, one gather of ``2 x head_dim`` elements
per slot checked or recorded. ``KVGUARD_CONTENT_CHECK``:

- ``off`` (default): nothing is kept or checked.
- ``all``: every slot a forward reads is verified (tests; small models), except the
  slots the forward itself writes first (their old bytes are never read).
- ``N`` (a positive integer): at most N read slots per forward, drawn at random, so a
  slot that stays in a row is verified within a few steps (``make bench`` reports
  ``engine.content_check_us_per_step_b256`` at N = 512).

Device (GPU) pools: ``engine_hooks/content_device.py`` computes the same fingerprints
with torch on the pool's device (the gather, the multiply and the sum run there; 8
bytes per checked slot come back, through pinned memory and an event, looked at on a
later step), so the check never waits for the device and never copies KV to the host.
``for_pool`` picks the path from where the pool lives.
"""

from __future__ import annotations

import logging
import os

import numpy as np

log = logging.getLogger("kvguard.content")

CONTENT_ENV = "KVGUARD_CONTENT_CHECK"
_SEED = 0x6B766763  # the multipliers are fixed per process; fingerprints never leave it
RUN = 16  # a sampled check reads runs of this many consecutive row positions


class ContentUnsupported(Exception):
    """The pool cannot be checked (device memory, unknown layout); the reason says why."""


def budget_from_env(raw: str | None = None) -> int | None | bool:
    """``False``: off; ``None``: every read slot; else the slots checked per forward.
    A value that is none of these fails at start-up, naming the variable and the value."""
    raw = (os.environ.get(CONTENT_ENV, "off") if raw is None else raw).strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return False
    if raw in ("all", "on", "1", "true", "yes"):
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{CONTENT_ENV}={raw!r}: expected off, all, or a positive number of slots per forward")
    return n


PATH_ENV = "KVGUARD_CONTENT_PATH"  # auto (default) | host | device: which implementation checks the pool


def path_from_env(raw: str | None = None) -> str:
    """``auto`` (host pools: numpy; device pools: the device path), ``host`` or ``device``
    (the deferred device path even on a host pool: what tests of that path run on a CPU).
    Anything else fails at start-up, naming the variable and the value."""
    raw = (os.environ.get(PATH_ENV, "auto") if raw is None else raw).strip().lower() or "auto"
    if raw not in ("auto", "host", "device"):
        raise ValueError(f"{PATH_ENV}={raw!r}: expected auto, host or device")
    return raw


def check_layout(k_layer0, v_layer0) -> int:
    """The bytes of KV head 0 of one slot (K or V); ContentUnsupported for a layout the
    fingerprint cannot read: not [slots, heads, dim], not contiguous, not whole u64 words."""
    for t in (k_layer0, v_layer0):
        if t.dim() != 3 or not t.is_contiguous():
            raise ContentUnsupported(f"KV buffer of shape {tuple(t.shape)}: expected a contiguous [slots, heads, dim]")
    head_bytes = int(k_layer0.shape[2]) * k_layer0.element_size()
    if head_bytes % 8 or int(v_layer0.shape[2]) * v_layer0.element_size() != head_bytes:
        raise ContentUnsupported(
            f"slot head of {head_bytes} bytes (K) is not a whole number of u64 words, or V differs"
        )
    if v_layer0.shape[0] != k_layer0.shape[0]:
        raise ContentUnsupported(f"K has {k_layer0.shape[0]} slots, V {v_layer0.shape[0]}")
    return head_bytes


def multipliers(words: int, seed: int = _SEED) -> tuple[np.ndarray, np.ndarray]:
    """The fixed odd u64 multipliers of the K and V words of a slot's head 0 (one per word)."""
    rng = np.random.default_rng(seed)
    mult = rng.integers(0, 1 << 63, size=2 * words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return mult[:words], mult[words:]


def pick_index(seq_lens: np.ndarray, budget: int | None, rng) -> tuple[np.ndarray, np.ndarray]:
    """(batch index, position) pairs to verify among ``seq_lens[i]`` positions of each
    reader ``i``: all of them, or about ``budget`` drawn at random in runs of RUN."""
    lens = np.maximum(np.asarray(seq_lens).astype(np.int64), 0)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if budget is None or total <= budget:
        which = np.repeat(np.arange(len(lens)), lens)
        starts = np.repeat(np.cumsum(lens) - lens, lens)
        return which, np.arange(total) - starts
    # runs of RUN consecutive positions (one page-aligned stretch of a row: neighbouring
    # slots in memory, so the check reads whole cache lines and pages instead of paying a
    # memory miss per slot; measured 3x cheaper than single random slots at batch 256)
    runs = max(budget // RUN, 1)
    flat = rng.integers(0, total, size=runs)
    ends = np.cumsum(lens)
    which = np.searchsorted(ends, flat, side="right")
    start = flat - (ends[which] - lens[which])
    start -= start % RUN
    pos = (start[:, None] + np.arange(RUN)[None, :]).reshape(-1)
    which = np.repeat(which, RUN)
    keep = pos < lens[which]
    return which[keep], pos[keep]


def for_pool(k_layer0, v_layer0, budget: int | None, path: str = "auto", seed: int = _SEED):
    """The content check for this pool: ContentCheck on a host pool, DeviceContentCheck
    on a device pool (or anywhere with ``path="device"``)."""
    on_host = str(getattr(k_layer0.device, "type", k_layer0.device)) == "cpu"
    if path == "host" and not on_host:
        raise ContentUnsupported(f"{PATH_ENV}=host but the KV pool is on {k_layer0.device}")
    if path == "device" or not on_host:
        from .content_device import DeviceContentCheck

        return DeviceContentCheck(k_layer0, v_layer0, budget, seed=seed)
    return ContentCheck(k_layer0, v_layer0, budget, seed=seed)


class ContentCheck:
    """Fingerprints of one host KV pool's slots (layer-0 K and V, layout [slots, heads, dim])."""

    deferred = False  # verify() reports what it found at once

    def __init__(self, k_layer0, v_layer0, budget: int | None, seed: int = _SEED):
        for t in (k_layer0, v_layer0):
            if str(getattr(t.device, "type", t.device)) != "cpu":
                raise ContentUnsupported(f"KV pool on device {t.device}: this is the host pools' check")
        head_bytes = check_layout(k_layer0, v_layer0)
        import torch

        # KV head 0 of each slot (a strided view, no copy): an eighth of a Llama-3-8B slot's bytes
        self._k = k_layer0.view(torch.uint8).numpy()[:, 0, :]
        self._v = v_layer0.view(torch.uint8).numpy()[:, 0, :]
        self._mk, self._mv = multipliers(head_bytes // 8, seed)
        self.num_slots = int(self._k.shape[0])
        self.fp = np.zeros(self.num_slots, np.uint64)  # 0: no fingerprint (never written by a hooked path)
        self.budget = budget
        self._rng = np.random.default_rng(seed + 1)
        self.slots_checked = 0
        self.slots_changed = 0

    def fingerprint(self, slots: np.ndarray) -> np.ndarray:
        k = self._k[slots].view(np.uint64)
        v = self._v[slots].view(np.uint64)
        with np.errstate(over="ignore"):
            fp = (k * self._mk).sum(axis=1, dtype=np.uint64) + (v * self._mv).sum(axis=1, dtype=np.uint64)
        fp[fp == 0] = 1
        return fp

    def _valid(self, slots) -> np.ndarray:
        slots = _host_slots(slots)
        return slots[(slots > 0) & (slots < self.num_slots)]  # slot 0: SGLang's padding slot

    def written(self, slots) -> np.ndarray:
        """A hooked path wrote ``slots``: remember what they hold now. Returns the changed
        slots found meanwhile (none: a host pool's verify reports at once), as the device
        check's does."""
        slots = self._valid(slots)
        if len(slots):
            self.fp[slots] = self.fingerprint(slots)
        return slots[:0]

    def forget(self, slots) -> np.ndarray:
        """``slots`` hold no fingerprint from here on, until a hooked write."""
        self.fp[self._valid(slots)] = 0
        return np.zeros(0, np.int64)

    def pick_index(self, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(batch index, position) pairs to verify (``pick_index`` of this module)."""
        return pick_index(seq_lens, self.budget, self._rng)

    def verify(self, slots) -> np.ndarray:
        """The slots (of those given) whose bytes changed since a hooked path last wrote them;
        each change is reported once (its new bytes become the fingerprint)."""
        slots = self._valid(slots)
        slots = slots[self.fp[slots] != 0]
        return compare(self, slots, self.fingerprint(slots))

    def flush(self) -> np.ndarray:
        """Nothing is in flight on a host pool: every verify reported at once."""
        return np.zeros(0, np.int64)


def compare(check, slots: np.ndarray, now: np.ndarray) -> np.ndarray:
    """The verify rule on the host table ``check.fp``: of ``slots`` (valid, each with a
    fingerprint), those whose bytes now hash to ``now[i]`` instead differ; each is reported
    once (its new fingerprint is kept)."""
    check.slots_checked += len(slots)
    if len(slots) == 0:
        return slots
    changed = now != check.fp[slots]
    if not changed.any():
        return slots[:0]
    bad = slots[changed]
    check.fp[bad] = now[changed]
    check.slots_changed += len(bad)
    return np.unique(bad)


def _host_slots(slots) -> np.ndarray:
    """Slot ids as a 1-D int64 numpy array (from a list, an array or a host tensor)."""
    if hasattr(slots, "detach"):
        slots = slots.detach().cpu().numpy()
    return np.asarray(slots).astype(np.int64, copy=False).reshape(-1)

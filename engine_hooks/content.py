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

Device (GPU) pools are not checked yet: reading the bytes there would need the
device-side reduction of the transfer digests and a read at the scheduler's existing
sync; the engine logs once that the check is off, and why.
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


class ContentCheck:
    """Fingerprints of one host KV pool's slots (layer-0 K and V, layout [slots, heads, dim])."""

    def __init__(self, k_layer0, v_layer0, budget: int | None, seed: int = _SEED):
        for t in (k_layer0, v_layer0):
            if str(getattr(t.device, "type", t.device)) != "cpu":
                raise ContentUnsupported(f"KV pool on device {t.device}: content checks run on host pools only")
            if t.dim() != 3 or not t.is_contiguous():
                raise ContentUnsupported(
                    f"KV buffer of shape {tuple(t.shape)}: expected a contiguous [slots, heads, dim]"
                )
        import torch

        # KV head 0 of each slot (a strided view, no copy): an eighth of a Llama-3-8B slot's bytes
        self._k = k_layer0.view(torch.uint8).numpy()[:, 0, :]
        self._v = v_layer0.view(torch.uint8).numpy()[:, 0, :]
        if self._k.shape[1] % 8 or self._v.shape[1] % 8:
            raise ContentUnsupported(f"slot of {self._k.shape[1]} bytes is not a whole number of u64 words")
        rng = np.random.default_rng(seed)
        words = self._k.shape[1] // 8 + self._v.shape[1] // 8
        mult = rng.integers(0, 1 << 63, size=words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._mk, self._mv = mult[: self._k.shape[1] // 8], mult[self._k.shape[1] // 8 :]
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
        slots = np.asarray(slots, np.int64).reshape(-1)
        return slots[(slots > 0) & (slots < self.num_slots)]  # slot 0: SGLang's padding slot

    def written(self, slots) -> None:
        """A hooked path wrote ``slots``: remember what they hold now."""
        slots = self._valid(slots)
        if len(slots):
            self.fp[slots] = self.fingerprint(slots)

    def pick(self, rows: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row index, position) pairs to verify among ``seq_lens[i]`` positions of each
        reader ``i``: all of them, or ``budget`` drawn at random."""
        lens = np.maximum(seq_lens.astype(np.int64), 0)
        total = int(lens.sum())
        if total == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        if self.budget is None or total <= self.budget:
            which = np.repeat(np.arange(len(lens)), lens)
            starts = np.repeat(np.cumsum(lens) - lens, lens)
            return rows[which], np.arange(total) - starts
        # runs of RUN consecutive positions (one page-aligned stretch of a row: neighbouring
        # slots in memory, so the check reads whole cache lines and pages instead of paying a
        # memory miss per slot; measured 3x cheaper than single random slots at batch 256)
        runs = max(self.budget // RUN, 1)
        flat = self._rng.integers(0, total, size=runs)
        ends = np.cumsum(lens)
        which = np.searchsorted(ends, flat, side="right")
        start = flat - (ends[which] - lens[which])
        start -= start % RUN
        pos = (start[:, None] + np.arange(RUN)[None, :]).reshape(-1)
        which = np.repeat(which, RUN)
        keep = pos < lens[which]
        return rows[which[keep]], pos[keep]

    def verify(self, slots) -> np.ndarray:
        """The slots (of those given) whose bytes changed since a hooked path last wrote them;
        each change is reported once (its new bytes become the fingerprint)."""
        slots = self._valid(slots)
        slots = slots[self.fp[slots] != 0]
        self.slots_checked += len(slots)
        if len(slots) == 0:
            return slots
        now = self.fingerprint(slots)
        changed = now != self.fp[slots]
        if not changed.any():
            return slots[:0]
        bad = slots[changed]
        self.fp[bad] = now[changed]
        self.slots_changed += len(bad)
        return np.unique(bad)

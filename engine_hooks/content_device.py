"""The content check (engine_hooks/content.py) on a KV pool in device memory: the same
fingerprints, reduced on the device, read back without waiting for it.

A GPU pool's bytes cannot be hashed on the host without copying them there (2 x
head_dim bytes per slot, every step) and waiting for the forward that wrote them. Here
the whole fingerprint runs with torch on the pool's device, on the stream the engine
is issuing on, so it is ordered after the forward (or before it) exactly as the hook
that asked for it:

* the head-0 K and V bytes of each slot are viewed as int64 words (no copy), gathered
  for the slots asked about, multiplied by the same fixed odd multipliers as the host
  check and summed: int64 arithmetic wraps mod 2**64, so the value is bit for bit the
  host check's u64 fingerprint (tests compare the two);
* only the slot ids and their fingerprints (16 bytes per slot) come back, by a
  ``non_blocking`` copy into pinned memory, with an event recorded after it;
* the host table (one u64 per slot, as on a host pool) is updated and compared when
  the event has completed: looked at (``event.query()``, never a wait) by every later
  call, so a changed slot is reported a step or a few after the forward that read it,
  and at the latest by ``flush`` (shutdown, tests).

Order is kept: requests complete in the order they were issued on one stream, and the
table applies them in that order, so a verify sees exactly the writes issued before it.
A slot id outside the pool (never expected from the engine's rows) is mapped to slot 0
on the device, since an out-of-range gather would fault the device and the engine with
it, and slot 0 (SGLang's padding slot) is never fingerprinted. At most ``max_pending``
requests are in flight: past that the oldest is waited for (a bound on pinned memory
that a healthy engine, which synchronizes every step for its sampled tokens, never
reaches).

On a host tensor (``KVGUARD_CONTENT_PATH=device`` on a CPU, what the tests run) the
same code runs with no event: each request is complete when it is issued.
"""

from __future__ import annotations

import collections

import numpy as np

from . import content as ct

WRITE, VERIFY, FORGET = 0, 1, 2
MAX_PENDING = 64


class DeviceContentCheck:
    """Fingerprints of one KV pool's slots, computed where the pool lives (layer-0 K and V,
    head 0, layout [slots, heads, dim])."""

    deferred = True  # verify() reports what earlier, completed requests found

    def __init__(self, k_layer0, v_layer0, budget: int | None, seed: int = ct._SEED, max_pending: int = MAX_PENDING):
        import torch

        head_bytes = ct.check_layout(k_layer0, v_layer0)
        self.device = k_layer0.device
        self._cuda = self.device.type == "cuda"
        try:
            # KV head 0 of every slot as int64 words: a strided view of the pool, no copy
            self._kw = k_layer0[:, 0, :].view(torch.int64)
            self._vw = v_layer0[:, 0, :].view(torch.int64)
        except RuntimeError as exc:
            raise ct.ContentUnsupported(f"KV head 0 of a slot cannot be read as int64 words: {exc}") from exc
        mk, mv = ct.multipliers(head_bytes // 8, seed)
        # the u64 multipliers' bit patterns as int64: products and sums wrap mod 2**64 alike
        self._mk = torch.from_numpy(mk.view(np.int64)).to(self.device)
        self._mv = torch.from_numpy(mv.view(np.int64)).to(self.device)
        self.num_slots = int(k_layer0.shape[0])
        self.fp = np.zeros(self.num_slots, np.uint64)  # the truth, on the host: 0 = never written
        self.budget = budget
        self._rng = np.random.default_rng(seed + 1)
        self.max_pending = max(int(max_pending), 1)
        self._pending: collections.deque = collections.deque()  # (kind, slots, fps, event) in issue order
        self.slots_checked = 0
        self.slots_changed = 0
        self.waits = 0  # requests waited for because max_pending were in flight
        self.event_factory = self._cuda_event if self._cuda else None  # tests may stand in a slow device

    # ------------------------------------------------------------------ issuing
    def pick_index(self, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ct.pick_index(seq_lens, self.budget, self._rng)

    def fingerprint_device(self, slots):
        """The fingerprints of ``slots`` (an int64 tensor on the pool's device), on the device."""
        import torch

        kg = torch.index_select(self._kw, 0, slots)
        vg = torch.index_select(self._vw, 0, slots)
        return kg.mul_(self._mk).sum(1) + vg.mul_(self._mv).sum(1)

    def written(self, slots) -> np.ndarray:
        """A hooked path wrote ``slots`` (host array or a tensor anywhere): their fingerprints
        are taken after what the stream already holds. Returns what completed requests found."""
        self._issue(WRITE, slots)
        return self._drain(block=False)

    def verify(self, slots) -> np.ndarray:
        """Ask whether ``slots`` still hold what hooked writes left; returns the changed slots
        that requests completed by now found (this one's, on a host tensor; on a device,
        usually an earlier step's), each once."""
        self._issue(VERIFY, slots)
        return self._drain(block=False)

    def flush(self) -> np.ndarray:
        """Wait for every request in flight and return the changed slots they found."""
        return self._drain(block=True)

    def forget(self, slots) -> np.ndarray:
        """Something wrote ``slots`` that this stream is not ordered after (a copy on another
        stream): they hold no fingerprint from here on (in issue order) until a hooked write."""
        host = np.asarray(slots.detach().cpu().numpy() if hasattr(slots, "detach") else slots, np.int64).reshape(-1)
        import torch

        self._pending.append((FORGET, torch.from_numpy(host.copy()), None, None))
        return self._drain(block=False)

    def _issue(self, kind: int, slots) -> None:
        import torch

        if isinstance(slots, torch.Tensor):
            s = slots.reshape(-1).to(self.device, torch.int64, non_blocking=True)
        else:
            s = to_device(np.asarray(slots, np.int64).reshape(-1), self.device)
        if s.numel() == 0:
            return
        # a fresh tensor (never the caller's, which it may reuse before this is looked at)
        s = torch.where((s > 0) & (s < self.num_slots), s, torch.zeros((), dtype=s.dtype, device=s.device))
        fps = self.fingerprint_device(s)
        event = None
        if self.event_factory is not None:
            if self._cuda:
                host_s = torch.empty(s.shape, dtype=torch.int64, pin_memory=True)
                host_f = torch.empty(fps.shape, dtype=torch.int64, pin_memory=True)
                host_s.copy_(s, non_blocking=True)
                host_f.copy_(fps, non_blocking=True)
                s, fps = host_s, host_f
            event = self.event_factory()
        if len(self._pending) >= self.max_pending:
            self.waits += 1
            self._drain(block=True, keep=self.max_pending - 1)
        self._pending.append((kind, s, fps, event))

    @staticmethod
    def _cuda_event():
        import torch

        event = torch.cuda.Event()
        event.record()
        return event

    # ------------------------------------------------------------------ completing
    def _drain(self, block: bool, keep: int = 0) -> np.ndarray:
        """Apply completed requests in issue order (with ``block``, wait until at most
        ``keep`` remain); the changed slots found, each once."""
        found = []
        while self._pending:
            kind, s, fps, event = self._pending[0]
            if event is not None and not event.query():
                if not block or len(self._pending) <= keep:
                    break
                event.synchronize()
            self._pending.popleft()
            slots = s.numpy()
            if kind == FORGET:
                self.fp[slots[(slots > 0) & (slots < self.num_slots)]] = 0
                continue
            now = fps.numpy().view(np.uint64).copy()
            now[now == 0] = 1
            valid = slots > 0
            if kind == WRITE:
                self.fp[slots[valid]] = now[valid]
                continue
            known = valid & (self.fp[slots] != 0)
            bad = ct.compare(self, slots[known], now[known])
            if len(bad):
                found.append(bad)
        if not found:
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate(found))

    @property
    def in_flight(self) -> int:
        return len(self._pending)


def to_device(values: np.ndarray, device):
    """A host int64 array on ``device`` without waiting for the device: through pinned memory
    and a ``non_blocking`` copy on CUDA (a pageable copy would synchronize the stream,
    stalling the engine's step); the array itself (shared) on the host."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)

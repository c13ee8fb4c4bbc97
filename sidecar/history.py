"""Bounded history of page and request events, for timelines. No I/O.

One numpy ring of fixed capacity (``capacity`` events, 40 bytes each; the default
1,048,576 events is 40 MiB) shared by all engines: when full, the oldest events are
overwritten, so a timeline covers the most recent ``capacity`` events. At the
reference workload (one decode rank: ~15k page writes/s, ~1k allocs and frees/s,
256 request reads per step at 60 steps/s) that is roughly the last 30 seconds; the
last writer of every page is kept separately by the tracker, for ever.

Reads are recorded per request per forward (page = -1, ``aux`` = seq_len), not per
page: 7.9M page reads/s would overwrite everything else within a second.
"""

from __future__ import annotations

import enum

import numpy as np

from . import native

EVENT_DTYPE = np.dtype(
    [
        ("ts_ns", "<i8"),
        ("req_key", "<u8"),
        ("engine", "<u4"),
        ("page", "<i4"),
        ("gen", "<u4"),
        ("aux", "<u4"),
        ("event", "u1"),
        ("_pad", "V1"),
        ("pool", "<u2"),  # the engine's pool (contract 1.5; 0: its token KV pool)
        ("_pad2", "V4"),
    ]
)
assert EVENT_DTYPE.itemsize == 40, EVENT_DTYPE.itemsize


def _kernel_layout_matches() -> bool:
    """Whether the compiled ``history_append`` writes events as EVENT_DTYPE lays them out."""
    if native.KERNELS is None:
        return False
    fields, itemsize = native.KERNELS.history_layout()
    assert EVENT_DTYPE.fields is not None
    return itemsize == EVENT_DTYPE.itemsize and all(EVENT_DTYPE.fields[name][1] == off for name, off in fields)


# the compiled column writes (kvguard.sidecar.native) may be used: False, the numpy ones below
_KERNEL_LAYOUT = _kernel_layout_matches()


class Event(enum.IntEnum):
    ALLOC = 1
    ASSIGN = 2
    WRITE = 3
    TRANSFER_WRITE = 4  # decode page filled by a paired transfer
    FREE = 5
    READ = 6  # per request: aux = seq_len, page = -1
    REQ_BEGIN = 7
    REQ_END = 8
    REJECT = 9


class History:
    def __init__(self, capacity: int = 1 << 20):
        if capacity < 1:
            raise ValueError(f"history capacity must be >= 1 event, got {capacity}")
        self.capacity = capacity
        self.events = np.zeros(capacity, EVENT_DTYPE)
        self.total = 0  # events ever appended
        # the columns as views, made once: taking a field of a structured array costs about as
        # much as writing a few values into it, and append runs once per record
        ev = self.events
        self._ts, self._key, self._engine = ev["ts_ns"], ev["req_key"], ev["engine"]
        self._page, self._gen, self._aux = ev["page"], ev["gen"], ev["aux"]
        self._event, self._pool = ev["event"], ev["pool"]

    @property
    def size(self) -> int:
        return min(self.total, self.capacity)

    def append(
        self, ts_ns: int, engine: int, event: Event, req_key=0, pages=None, gens=None, aux=0, pool: int = 0
    ) -> None:
        """Append one event per page (or one event when ``pages`` is None); ``ts_ns``,
        ``req_key``, ``gens`` and ``aux`` are scalars or arrays of the same length."""
        n = 1 if pages is None else len(pages)
        if isinstance(req_key, np.ndarray) and pages is None:
            n = len(req_key)
        if n == 0:
            return
        if n > self.capacity:  # keep the newest
            cut = slice(n - self.capacity, n)
            pages = None if pages is None else pages[cut]
            gens = gens[cut] if isinstance(gens, np.ndarray) else gens
            req_key = req_key[cut] if isinstance(req_key, np.ndarray) else req_key
            aux = aux[cut] if isinstance(aux, np.ndarray) else aux
            ts_ns = ts_ns[cut] if isinstance(ts_ns, np.ndarray) else ts_ns
            n = self.capacity
        start = self.total % self.capacity
        kernels = native.KERNELS
        if (
            kernels is not None
            and _KERNEL_LAYOUT
            and kernels.history_append(
                self.events, self.capacity, start, n, ts_ns, req_key, engine, pages, gens, aux, int(event), pool
            )
        ):
            self.total += n  # (stored as the numpy writes below store them; False: a value they must take)
            return
        if (
            n == 1
            and not isinstance(req_key, np.ndarray)
            and not isinstance(aux, np.ndarray)
            and not isinstance(ts_ns, np.ndarray)
        ):
            # one event (a request's begin or end, a one-page record): one element assignment
            page = -1 if pages is None else int(pages[0])
            gen = 0 if gens is None else int(gens if np.ndim(gens) == 0 else gens[0])
            self.events[start] = (ts_ns, req_key, engine, page, gen, aux, int(event), b"\0", pool, b"\0" * 4)
            self.total += 1
            return
        # a slice while the events fit before the end of the ring (no index array to build)
        at = slice(start, start + n) if start + n <= self.capacity else (start + np.arange(n)) % self.capacity
        self._ts[at] = ts_ns
        self._key[at] = req_key
        self._engine[at] = engine
        self._page[at] = -1 if pages is None else pages
        self._gen[at] = 0 if gens is None else gens
        self._aux[at] = aux
        self._event[at] = int(event)
        self._pool[at] = pool
        self.total += n

    def _ordered(self, mask: np.ndarray, limit: int) -> np.ndarray:
        live = self.events[: self.size]
        hits = np.flatnonzero(mask[: self.size])
        if len(hits) == 0:
            return live[:0]
        # ring order -> time order: positions after the write cursor are older
        start = self.total % self.capacity if self.total > self.capacity else 0
        order = np.argsort((hits - start) % max(self.size, 1), kind="stable")
        return live[hits[order]][-limit:]

    def page_events(self, engine: int, page: int, limit: int = 200, pool: int = 0) -> np.ndarray:
        ev = self.events
        return self._ordered((ev["engine"] == engine) & (ev["page"] == page) & (ev["pool"] == pool), limit)

    def request_events(self, req_key: int, limit: int = 500) -> np.ndarray:
        return self._ordered(self.events["req_key"] == np.uint64(req_key), limit)

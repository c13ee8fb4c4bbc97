"""The live requests' rows of one pool: one ``Row`` per request key, their scalars in one
``RowScalars`` table, and each key's index into it. No I/O.

Owned by the pool's ``EngineTracker`` (which applies ASSIGNs and request ends to it) and
read by its ``Judge`` (which gathers a whole batch's rows at once): one object both hold,
so neither re-declares the other's state.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat

import numpy as np

from . import native
from .page_pool import Row, RowScalars


class RowTable:
    """Rows by request key. ``version`` changes whenever a row comes or goes, so that a batch's
    key -> index mapping can be kept from one forward to the next (``indexes``)."""

    __slots__ = ("_rows", "scalars", "index", "version", "_memo", "get", "row_of")

    def __init__(self) -> None:
        self._rows: dict[int, Row] = {}
        # the dict's own lookups, bound once: a batch maps hundreds of keys through them, and
        # a Python method per key cost ~0.1 us each
        self.get = self._rows.get
        self.row_of = self._rows.__getitem__
        self.scalars = RowScalars()
        self.index: dict[int, int] = {}  # key -> its row's index in ``scalars``
        self.version = 0
        self._memo: tuple[int, np.ndarray, np.ndarray] | None = None

    # the dict a caller reads (and ``get``, ``row_of``: its own methods)
    def __getitem__(self, key: int) -> Row:
        return self._rows[key]

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def values(self):
        return self._rows.values()

    def items(self):
        return self._rows.items()

    # what the tracker changes
    def new(self, key: int) -> Row:
        """A fresh row for ``key`` (replacing none: the caller checked there was none)."""
        row = self._rows[key] = Row(self.scalars)
        self.index[key] = row.index
        self.version += 1
        return row

    def drop(self, key: int) -> Row | None:
        row = self._rows.pop(key, None)
        if row is not None:
            del self.index[key]
            self.scalars.release(row.index)
            self.version += 1
        return row

    # what the judge asks for a batch
    def indexes(self, req_keys: np.ndarray) -> np.ndarray:
        """Each key's row index in ``scalars`` (-1: no row), with one C-level pass over the keys;
        kept for the next forward, whose batch is mostly this one while no row came or went."""
        memo = self._memo
        if memo is not None and memo[0] == self.version and len(memo[1]) == len(req_keys):
            if native.array_equal(memo[1], req_keys):
                return memo[2]
        idx = np.fromiter(map(self.index.get, req_keys.tolist(), repeat(-1)), np.int64, len(req_keys))
        self._memo = (self.version, np.array(req_keys, np.uint64), idx)
        return idx

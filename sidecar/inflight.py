"""Transfers in flight: what a sent chunk read and where it lands, until the sender completes.

A prefill/decode transfer is not one instant. The sender's ``XFER_SEND`` says which of its
pages a chunk reads and (through the room's reservation) which decode pages it lands in;
the bytes move afterwards, in the transfer engine's own thread or the receiver's pull, and
the sender's ``XFER_DONE`` (success) says they have moved. In between, both page sets must
stay where they were:

* **source pages** must stay the sending request's, at the generation they had when sent.
  A page freed and handed to another request meanwhile (an early release on abort, an
  eviction, a timeout free: TensorRT-LLM #12540 / #12542, SGLang #24527's family) may be
  read after the new owner wrote it: the receiver then takes another request's KV as its
  prompt;
* **destination pages** must stay the receiver's until its transfer completes. If the
  receiver gave up and released them (a waiting timeout, an abort, a deferred release that
  came too early) and they went to another request, a completion that lands after that
  overwrites the new owner's KV.

Generations, not states, decide: a page freed but not yet handed out still holds what it
held (SGLang frees a prefill request's pages inside the same poll that saw its transfer
succeed, just before the sender's ``XFER_DONE``: a free alone is not a finding), while a
page allocated again (its generation moved) belongs to someone else. A receiver that has
reported success had every byte: nothing of that room can land late any more.

What this cannot see: the order of two pods' clocks. With a shared ledger the sender's
completion reaches the receiver's sidecar as a fact without a time it could compare with
its own frees, so late completions are judged only where one sidecar sees both ends.

Bounded: at most ``max_pages`` page ids are kept (the oldest rooms dropped first, counted
in ``dropped``); a room with no completion a while after its last chunk is forgotten
(``expire``, counted ``unjudged`` like a failed one).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .stats import InFlightStats

BYTES_PER_PAGE = 8  # an int32 page id and its uint32 generation


@dataclass(slots=True)
class InFlightChunk:
    token_start: int
    token_end: int
    sent_ns: int
    src_pages: np.ndarray  # int32: the sender's pages the chunk reads
    src_gens: np.ndarray  # uint32: their generations when sent
    dst_pages: np.ndarray  # int32: the receiver's pages it lands in (empty when not in view or already decided)
    dst_gens: np.ndarray

    @property
    def num_pages(self) -> int:
        return len(self.src_pages) + len(self.dst_pages)


@dataclass(slots=True)
class InFlightRoom:
    sender_engine: int
    sender_key: int
    room: int
    receiver_engine: int | None
    receiver_key: int
    chunks: list[InFlightChunk] = field(default_factory=list)


class InFlightSends:
    """Chunks sent and not yet completed, per (sender engine, sending request, room)."""

    def __init__(self, max_pages: int):
        if max_pages < 1:
            raise ValueError(f"max_pages must be at least 1, got {max_pages}")
        self.max_pages = max_pages
        self._rooms: OrderedDict[tuple[int, int, int], InFlightRoom] = OrderedDict()
        self._pages = 0
        self.completed = 0
        self.unjudged = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._rooms)

    def on_send(
        self,
        sender_engine: int,
        sender_key: int,
        room: int,
        receiver_engine: int | None,
        receiver_key: int,
        chunk: InFlightChunk,
    ) -> None:
        key = (sender_engine, sender_key, room)
        entry = self._rooms.get(key)
        if entry is None:
            entry = self._rooms[key] = InFlightRoom(sender_engine, sender_key, room, receiver_engine, receiver_key)
        else:
            self._rooms.move_to_end(key)
            if entry.receiver_engine is None and receiver_engine is not None:
                entry.receiver_engine, entry.receiver_key = receiver_engine, receiver_key
        entry.chunks.append(chunk)
        self._pages += chunk.num_pages
        while self._pages > self.max_pages and self._rooms:
            _, oldest = self._rooms.popitem(last=False)
            self._pages -= sum(c.num_pages for c in oldest.chunks)
            self.dropped += 1

    def complete(self, sender_engine: int, sender_key: int, room: int) -> InFlightRoom | None:
        """The sender's transfer completed: its chunks, to be checked (None when none is held)."""
        entry = self._pop(sender_engine, sender_key, room)
        if entry is not None:
            self.completed += 1
        return entry

    def abandon(self, sender_engine: int, sender_key: int, room: int) -> None:
        """The sender's transfer failed or its request ended without a completion."""
        if self._pop(sender_engine, sender_key, room) is not None:
            self.unjudged += 1

    def expire(self, before_ns: int) -> None:
        """Forget rooms whose last chunk was sent before ``before_ns`` with no completion since
        (counted ``unjudged``): the oldest are first, a room moving to the end on each chunk."""
        while self._rooms:
            key, entry = next(iter(self._rooms.items()))
            if entry.chunks[-1].sent_ns >= before_ns:
                return
            self._pop(*key)
            self.unjudged += 1

    def forget_engine(self, engine_id: int) -> None:
        for key in [k for k, e in self._rooms.items() if engine_id in (e.sender_engine, e.receiver_engine)]:
            self._pop(*key)

    def _pop(self, sender_engine: int, sender_key: int, room: int) -> InFlightRoom | None:
        entry = self._rooms.pop((sender_engine, sender_key, room), None)
        if entry is not None:
            self._pages -= sum(c.num_pages for c in entry.chunks)
        return entry

    def stats(self) -> InFlightStats:
        return InFlightStats(len(self._rooms), self._pages, self.completed, self.unjudged, self.dropped)

"""Ingest: find the rings in a directory, drain them in batches, merge them in time order.

New engine processes are picked up as their ring files appear; rings whose producer
has exited (or whose pid now belongs to another process) are drained one last time,
then closed and removed. Bad ring files are refused once with a clear log line and a
counter, never retried until the file changes.

Records of all rings are merged by their monotonic timestamps and released only once
they are ``slack_ns`` old, so that causally ordered events on different engines (a
prefill send before the decode's "transfer complete") are processed in that order.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import time
from dataclasses import dataclass, field

from engine_hooks import wire
from engine_hooks.ring import RING_SUFFIX, RingError, RingReader, RingTruncated

log = logging.getLogger("kvguard.ingest")


@dataclass
class IngestStats:
    rings_attached: int = 0
    rings_detached: int = 0
    ring_errors: int = 0
    records_read: int = 0
    records_lost: int = 0
    last_error: str = ""
    dropped_before_attach: dict = field(default_factory=dict)
    # decode counters of rings already retired, so exported totals never go down
    retired_invalid: dict = field(default_factory=lambda: {"unknown_kind": 0, "bad_version": 0, "bad_payload": 0})
    retired_corrupt_bytes: int = 0


class RingSet:
    def __init__(self, directory: str, slack_ns: int = 50_000_000, remove_dead: bool = True):
        self.directory = directory
        self.slack_ns = slack_ns
        self.remove_dead = remove_dead
        self.readers: dict[str, RingReader] = {}
        self.refused: dict[str, float] = {}  # path -> mtime when refused
        self.retired: set[str] = set()  # rings of exited engines left on disk (remove_dead=False): never re-read
        self.stats = IngestStats()
        self._heap: list = []
        self._tiebreak = itertools.count()
        self._warned_missing_dir = False
        self.gone: list[int] = []  # engine ids retired since the last take_gone()

    # ------------------------------------------------------------------ discovery
    def scan(self) -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            if not self._warned_missing_dir:
                log.warning("ring directory %s does not exist yet; waiting for engines", self.directory)
                self._warned_missing_dir = True
            return
        except OSError as exc:
            self._error(f"cannot list ring directory {self.directory}: {exc}")
            return
        self._warned_missing_dir = False
        for name in sorted(names):
            path = os.path.join(self.directory, name)
            if not name.endswith(RING_SUFFIX) or path in self.readers or path in self.retired:
                continue
            try:
                mtime = os.path.getmtime(path)
            except OSError:
                continue
            if self.refused.get(path) == mtime:
                continue
            self._attach(path, mtime)

    def _attach(self, path: str, mtime: float) -> None:
        try:
            reader = RingReader(path)
        except RingError as exc:
            self.refused[path] = mtime
            self._error(f"refusing ring: {exc}")
            return
        self.readers[path] = reader
        self.stats.rings_attached += 1
        try:
            sticky = reader.sticky_records() if reader.resumed else []
            dropped, backlog = reader.dropped_records, reader.backlog_bytes
        except RingTruncated as exc:  # cut between the reader's checks and these
            self._retire_truncated(path, reader, exc)
            return
        for rec in sticky:  # the HELLO was consumed by our predecessor: replay the header's copy first
            heapq.heappush(self._heap, (rec.ts_ns, next(self._tiebreak), rec))
        self.stats.dropped_before_attach[path] = dropped
        log.info("attached ring %s (engine pid %d, engine_id %d, %d bytes backlog, %d records already dropped%s)",
                 path, reader.pid, reader.engine_id, backlog, dropped,
                 f"; resuming at seq {reader.next_seq}: page state before it is unknown, reads of those pages "
                 f"are counted as unverified until the pages are reallocated" if reader.resumed else "")

    def _error(self, message: str) -> None:
        self.stats.ring_errors += 1
        self.stats.last_error = message
        log.error("%s", message)

    # ------------------------------------------------------------------ draining
    def poll(self) -> None:
        """Drain every attached ring into the merge buffer; retire rings of dead engines."""
        self.scan()
        for path, reader in list(self.readers.items()):
            try:
                alive = reader.producer_alive()
                result = reader.poll()
                self.stats.records_read += len(result.records)
                self.stats.records_lost += result.lost
                for rec in result.records:
                    heapq.heappush(self._heap, (rec.ts_ns, next(self._tiebreak), rec))
                if not alive and reader.backlog_bytes == 0:
                    self._detach(path, reader)
            except RingTruncated as exc:  # reading its mapping now would be SIGBUS: the sidecar would die
                self._retire_truncated(path, reader, exc)

    def _retire_truncated(self, path: str, reader: RingReader, exc: RingTruncated) -> None:
        """A ring whose file shrank under us: counted as a ring error, closed without
        touching its mapping, its engine's state closed (no more records can come from
        it), the file left as it is and not attached again until it changes."""
        self._error(f"retiring ring: {exc}; engine pid {reader.pid} (engine_id {reader.engine_id}) is no longer "
                    f"watched (kvguard never shrinks a ring: something else cut the file)")
        self._forget(path, reader)
        try:
            self.refused[path] = os.path.getmtime(path)
        except OSError:
            pass

    def _detach(self, path: str, reader: RingReader) -> None:
        log.info("engine pid %d exited; ring %s drained (%d records lost in total) and %s", reader.pid, path,
                 reader.records_lost, "removed" if self.remove_dead else "kept")
        self._forget(path, reader)
        if self.remove_dead:
            try:
                os.unlink(path)
            except OSError:
                pass
        else:
            self.retired.add(path)

    def _forget(self, path: str, reader: RingReader) -> None:
        """Fold a retired reader's counters into the totals, close it, and let the
        pipeline close its engine's state (``take_gone``)."""
        for reason in self.stats.retired_invalid:
            self.stats.retired_invalid[reason] += getattr(reader.stats, reason)
        self.stats.retired_corrupt_bytes += reader.stats.corrupt_bytes
        if reader.stats.last_error:
            log.warning("ring %s had unreadable records; last: %s", path, reader.stats.last_error)
        reader.close()
        del self.readers[path]
        self.gone.append(reader.engine_id)
        self.stats.rings_detached += 1

    def ready(self, now_ns: int | None = None, flush: bool = False) -> list[wire.Record]:
        """Records old enough to be processed in global time order (all of them if ``flush``)."""
        horizon = (time.monotonic_ns() if now_ns is None else now_ns) - self.slack_ns
        out = []
        while self._heap and (flush or self._heap[0][0] <= horizon):
            out.append(heapq.heappop(self._heap)[2])
        return out

    @property
    def pending(self) -> int:
        """Records drained but not yet released (younger than the merge slack)."""
        return len(self._heap)

    def take_gone(self) -> list[int]:
        gone, self.gone = self.gone, []
        return gone

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()

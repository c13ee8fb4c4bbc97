"""Ingest: find the rings in a directory, drain them in batches, merge them in time order.

New engine processes are picked up as their ring files appear; rings whose producer
has exited (or whose pid now belongs to another process) are drained one last time,
then closed and removed. Bad ring files are refused once with a clear log line and a
counter, never retried until the file changes.

Every ``*.ring`` entry is handled on its own, and nothing one entry does can stop the
others: only regular files are attached (``lstat``; symbolic links are never followed,
directories, FIFOs and devices are refused), any ``OSError`` on an entry refuses that
entry (one log line, one count in ``kvguard_ring_errors_total``, looked at again only
when its inode, size or mtime changes), and at most ``max_rings`` rings (fewer if the
file descriptor limit says so; EMFILE the same) are attached: the rest wait, counted
once, until one detaches. The directory is listed only when its mtime changed (and
once a second), so thousands of junk entries cost nothing between changes.

Records of all rings are merged by their monotonic timestamps and released only once
they were stamped ``slack_ns`` before the poll that drained them began, so that causally
ordered events on different engines or processes (a prefill send before the decode's
"transfer complete"; vLLM's EngineCore handing out a block before its Worker's forward
writes it) are processed in that order however long a poll takes.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import os
import resource
import stat
import time
from dataclasses import dataclass, field

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import RING_SUFFIX, RingError, RingReader, RingTruncated

from . import native

log = logging.getLogger("kvguard.ingest")


@dataclass
class IngestStats:
    rings_attached: int = 0
    rings_detached: int = 0
    ring_errors: int = 0
    records_read: int = 0
    records_lost: int = 0
    polls_held: int = 0  # polls whose releases waited for a record being written or left unread
    records_out_of_order: int = 0  # released after a newer record of another ring (the merge slack was short)
    last_error: str = ""
    dropped_before_attach: dict = field(default_factory=dict)
    # decode counters of rings already retired, so exported totals never go down
    retired_invalid: dict = field(
        default_factory=lambda: {"unknown_kind": 0, "bad_version": 0, "bad_payload": 0, "foreign_engine": 0}
    )
    retired_corrupt_bytes: int = 0


# What one ingest cycle reads from the rings at most, all together, and at least from each
# ring: a saturated cycle that read 8 MiB from each of four rings held the ingest lock for
# tens of seconds on a loaded 2-core machine. About 1 MiB is ~7,000 records, tens of ms to apply.
CYCLE_BYTES = 1 << 20
# the longest a record a producer is still writing holds back the release of every ring's
# newer records: a GC pause or a descheduled engine thread takes this long at most, a
# stopped or wedged one is passed by after it (its record then counts as out of order)
MAX_WRITER_HOLD_NS = 2_000_000_000
MIN_RING_BYTES = 64 << 10

# At most this many rings attached at once (``--max-rings``); the file descriptor limit may
# lower it (each attached ring holds FDS_PER_RING descriptors, FD_RESERVE are kept for the
# HTTP server, logs and the recording). Rings past the cap wait, counted once, until one detaches.
DEFAULT_MAX_RINGS = 1024
FDS_PER_RING = 1  # the ring's own fd (the liveness lock; the reader maps nothing, engine_hooks/ring.py)
FD_RESERVE = 128
# the directory is listed again only when its mtime changed, and at least this often (entries
# refused earlier are looked at again then, by (inode, size, mtime), never re-read unchanged)
RESCAN_S = 1.0
# a directory mtime this recent may still hide a change made in the same clock tick: list again
MTIME_TRUST_NS = 100_000_000


STICKY = -2  # in a refusal key: refused while the inode exists, whatever its size and mtime


def _entry_key(st: os.stat_result) -> tuple[int, int, int]:
    """What must change before a refused entry is looked at again."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:o})"


def fd_limit() -> int:
    """The soft file descriptor limit (1 << 20 when unlimited or unknown)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 1 << 20
    return 1 << 20 if soft == resource.RLIM_INFINITY or soft < 0 else soft


def raise_fd_limit(max_rings: int) -> int:
    """Raise the soft file descriptor limit (up to the hard one) to what ``max_rings`` rings
    need; returns the soft limit now. Never fails: a limit it cannot raise lowers the ring cap."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = max_rings * FDS_PER_RING + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            if new > soft:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
    except (OSError, ValueError):
        pass
    return fd_limit()


class RingSet:
    def __init__(
        self,
        directory: str,
        slack_ns: int = 50_000_000,
        remove_dead: bool = True,
        max_rings: int = DEFAULT_MAX_RINGS,
        rescan_s: float = RESCAN_S,
        assign_runs: bool = True,
    ):
        if max_rings < 1:
            raise ValueError(f"--max-rings must be >= 1, got {max_rings}")
        self.directory = directory
        self.slack_ns = slack_ns
        # back-to-back one-page ASSIGNs (a decode step's, one per request) come as one record of
        # columns (``wire.AssignRun``) that the pipeline applies as a batch
        self.assign_runs = assign_runs
        self.polled_at_ns = 0  # when the last poll began
        self.released_until_ns = 0  # the newest record released so far
        self.hold_ns = 0  # the last poll's hold (0: none): see poll
        self.remove_dead = remove_dead
        self.max_rings = max_rings
        self.rescan_s = rescan_s
        self.readers: dict[str, RingReader] = {}
        # path -> (inode, size, mtime_ns) when refused: looked at again only once that changes
        self.refused: dict[str, tuple[int, int, int]] = {}
        # rings not attached for want of room (the cap, or file descriptors): counted and logged
        # once, attached when room frees up
        self.waiting: set[str] = set()
        self.retired: set[str] = set()  # rings of exited engines left on disk (remove_dead=False): never re-read
        self.stats = IngestStats()
        self._heap: list = []
        self._tiebreak = itertools.count()
        self._warned_missing_dir = False
        self._dir_mtime_ns: int | None = None  # the directory's mtime when it was last listed (trusted)
        self._next_rescan = 0.0
        self._list_error_until = 0.0
        self.gone: list[int] = []  # engine ids retired since the last take_gone()

    @property
    def ring_cap(self) -> int:
        """Rings that may be attached at once: ``max_rings``, lowered to what the fd limit allows."""
        return max(1, min(self.max_rings, (fd_limit() - FD_RESERVE) // FDS_PER_RING))

    # ------------------------------------------------------------------ discovery
    def scan(self) -> None:
        """Attach new rings. The directory is listed only when it changed (or every ``rescan_s``):
        thousands of junk entries cost nothing between changes. Every entry is handled on its own:
        whatever it is and whatever fails, the others are still attached and drained."""
        now = time.monotonic()
        try:
            before_ns = time.time_ns()
            dir_mtime = os.stat(self.directory).st_mtime_ns
            if dir_mtime == self._dir_mtime_ns and now < self._next_rescan:
                return
            names = os.listdir(self.directory)
        except FileNotFoundError:
            if not self._warned_missing_dir:
                log.warning("ring directory %s does not exist yet; waiting for engines", self.directory)
                self._warned_missing_dir = True
            self._dir_mtime_ns = None
            return
        except OSError as exc:
            if now >= self._list_error_until:  # said (and counted) once per rescan, not every poll
                self._error(f"cannot list ring directory {self.directory}: {exc}")
                self._list_error_until = now + self.rescan_s
            self._dir_mtime_ns = None
            return
        self._warned_missing_dir = False
        # a change in the same clock tick as the mtime we saw would leave it unchanged: trust it only if older
        self._dir_mtime_ns = dir_mtime if dir_mtime < before_ns - MTIME_TRUST_NS else None
        # a full scan looks at refused and waiting entries again; between them only new names cost anything
        full = now >= self._next_rescan
        if full:
            self._next_rescan = now + self.rescan_s
        present = set()
        no_fds = False
        cap = self.ring_cap
        for name in sorted(names):
            if not name.endswith(RING_SUFFIX):
                continue
            path = os.path.join(self.directory, name)
            if path in self.readers or path in self.retired:
                continue
            present.add(path)
            if path in self.refused or path in self.waiting:
                if not full or (path in self.waiting and (no_fds or len(self.readers) >= cap)):
                    continue  # unchanged, or still no room: no system call for it
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # gone since the listing
            except OSError as exc:
                self._refuse(path, None, f"cannot stat: {exc}")
                continue
            key = _entry_key(st)
            if path in self.refused:
                if self.refused[path] in (key, (key[0], STICKY, STICKY)):
                    continue
                del self.refused[path]  # changed: looked at again
            if not stat.S_ISREG(st.st_mode):
                self._refuse(
                    path,
                    key,
                    f"{_kind_of(st.st_mode)}, not a regular file: only ring files the "
                    f"engines create are attached (symbolic links are never followed)",
                )
                continue
            if no_fds or len(self.readers) >= cap:
                self._wait(
                    path,
                    "too many open files"
                    if no_fds
                    else f"{len(self.readers)} rings attached, the most this sidecar attaches at once "
                    f"(--max-rings {self.max_rings}, file descriptor limit {fd_limit()})",
                )
                continue
            no_fds = self._attach(path, key)
        if full:  # entries gone from the directory are forgotten (a later file of that name is new)
            self.refused = {p: k for p, k in self.refused.items() if p in present}
            self.waiting &= present

    def _refuse(self, path: str, key: tuple | None, why: str) -> None:
        """Refuse an entry: one log line and one count, not again until it changes."""
        self.waiting.discard(path)
        self.refused[path] = key if key is not None else (-1, -1, -1)
        self._error(f"refusing ring: {path}: {why}")

    def _wait(self, path: str, why: str) -> None:
        """No room for this ring now: counted and logged once, attached when room frees up."""
        if path not in self.waiting:
            self.waiting.add(path)
            self._error(f"not attaching ring {path} for now: {why}; its engine is unwatched until a ring detaches")

    def _attach(self, path: str, key: tuple) -> bool:
        """Attach one ring; True when the process ran out of file descriptors (attach no more now)."""
        try:
            kernels = native.KERNELS  # (the compiled run decoding, when built: the same runs)
            run_length = kernels.assign_run_length if kernels is not None and self.assign_runs else None
            reader = RingReader(path, runs=self.assign_runs, run_length=run_length)
        except RingError as exc:
            self._refuse(path, key, str(exc).removeprefix(f"{path}: "))
            return False
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                self._wait(path, f"{os.strerror(exc.errno)} ({errno.errorcode[exc.errno]})")
                return True  # tried again at the next full scan, or when a ring detaches
            self._refuse(path, key, f"cannot open: {exc}")
            return False
        owner = next((p for p, r in self.readers.items() if r.engine_id == reader.engine_id), None)
        if owner is not None:
            # records are bound to their ring by the header's engine_id: a second ring claiming an
            # attached engine's id could otherwise change that engine's state and raise findings
            # naming its requests. Refused for as long as this file (inode) exists.
            other = self.readers[owner]
            reader.close()
            self._refuse(
                path,
                (key[0], STICKY, STICKY),
                f"its header claims engine_id {reader.engine_id} (pid {reader.pid}), which ring {owner} "
                f"(engine pid {other.pid}) already has: not attached (a forged or copied ring)",
            )
            return False
        was_waiting = path in self.waiting
        self.waiting.discard(path)
        self.readers[path] = reader
        self.stats.rings_attached += 1
        try:
            sticky = reader.sticky_records() if reader.resumed else []
            dropped, backlog = reader.dropped_records, reader.backlog_bytes
        except (RingError, OSError) as exc:  # cut between the reader's checks and these
            self._retire_broken(path, reader, exc)
            return False
        for rec in sticky:  # the HELLO was consumed by our predecessor: replay the header's copy first
            heapq.heappush(self._heap, (rec.ts_ns, next(self._tiebreak), rec))
        self.stats.dropped_before_attach[path] = dropped
        log.info(
            "attached ring %s (engine pid %d, engine_id %d, %d bytes backlog, %d records already dropped%s%s)",
            path,
            reader.pid,
            reader.engine_id,
            backlog,
            dropped,
            f"; resuming at seq {reader.next_seq}: page state before it is unknown, reads of those pages "
            f"are counted as unverified until the pages are reallocated"
            if reader.resumed
            else "",
            "; it had been waiting for room" if was_waiting else "",
        )
        return False

    def _error(self, message: str) -> None:
        self.stats.ring_errors += 1
        self.stats.last_error = message
        log.error("%s", message)

    # ------------------------------------------------------------------ draining
    def poll(self, max_bytes: int = CYCLE_BYTES) -> bool:
        """Drain the attached rings into the merge buffer, at most about ``max_bytes`` in all
        (shared out between the rings, at least ``MIN_RING_BYTES`` each), so that one cycle
        under a backlog stays short (the ingest lock is held for a cycle); retire rings of
        dead engines. True when a ring still has a backlog (call again without waiting)."""
        # before any ring is read: a record stamped before this was published before it, so the
        # horizon of ``ready`` counts from here (not from when the poll ended: a ring read early
        # in a slow poll can miss a record that a ring read late already depends on)
        self.polled_at_ns = time.monotonic_ns()
        self.scan()
        share = max(MIN_RING_BYTES, max_bytes // max(1, len(self.readers)))
        backlogged = False
        hold = 0  # releases stop short of this stamp: a record still being written, or left unread
        for path, reader in list(self.readers.items()):
            try:
                alive = reader.producer_alive()
                writing_since = reader.writing_since_ns  # before its data: a record stamped then may land after
                result = reader.poll(max_bytes=share)
                self.stats.records_read += sum(map(wire.records_in, result.records))
                self.stats.records_lost += result.lost
                for rec in result.records:
                    heapq.heappush(self._heap, (rec.ts_ns, next(self._tiebreak), rec))
                backlog = reader.last_backlog  # (as of the poll's start: see RingReader.poll)
                # (not for long, and not for a dead producer: a writer killed mid-record, or stopped,
                # must not hold every other engine's records back)
                if writing_since and alive and self.polled_at_ns - writing_since < MAX_WRITER_HOLD_NS:
                    hold = min(hold or writing_since, writing_since)
                if backlog > 0:  # the rest is older than anything published later: wait for it
                    last = result.records[-1].ts_ns if result.records else self.polled_at_ns
                    hold = min(hold or last, last)
                if not alive and backlog == 0:
                    self._detach(path, reader)
                backlogged = backlogged or backlog > 0
            except (RingError, OSError) as exc:  # RingTruncated: reading its mapping now would be SIGBUS
                self._retire_broken(path, reader, exc)
        self.hold_ns = hold
        if hold:
            self.stats.polls_held += 1
        return backlogged

    def _retire_broken(self, path: str, reader: RingReader, exc: Exception) -> None:
        """A ring that cannot be read any more (its file shrank under us, or an I/O error):
        counted as a ring error, closed without touching its mapping, its engine's state
        closed (no more records can come from it), the file left as it is and not attached
        again until it changes. The other rings are not affected."""
        if isinstance(exc, RingTruncated):
            why = (
                f"{exc}; engine pid {reader.pid} (engine_id {reader.engine_id}) is no longer watched (kvguard "
                f"never shrinks a ring: something else cut the file)"
            )
        else:
            why = (
                f"{path}: cannot read it: {exc}; engine pid {reader.pid} (engine_id {reader.engine_id}) is no "
                f"longer watched"
            )
        self._error(f"retiring ring: {why}")
        self._forget(path, reader)
        try:
            self.refused[path] = _entry_key(os.lstat(path))
        except OSError:
            pass

    def _detach(self, path: str, reader: RingReader) -> None:
        log.info(
            "engine pid %d exited; ring %s drained (%d records lost in total) and %s",
            reader.pid,
            path,
            reader.records_lost,
            "removed" if self.remove_dead else "kept",
        )
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
        if self.waiting:  # room for a ring that was waiting: list the directory at the next poll
            self._dir_mtime_ns = None
            self._next_rescan = 0.0

    def ready(self, now_ns: int | None = None, flush: bool = False) -> list[wire.Record]:
        """Records old enough to be processed in global time order (all of them if ``flush``):
        stamped ``slack_ns`` before the last poll began (``now_ns``: before that time instead)."""
        horizon = (self.polled_at_ns if now_ns is None else now_ns) - self.slack_ns
        if self.hold_ns:  # a producer was writing a record stamped then (or a ring was left unread)
            horizon = min(horizon, self.hold_ns - 1)
        out = []
        while self._heap and (flush or self._heap[0][0] <= horizon):
            out.append(heapq.heappop(self._heap)[2])
        if out:
            if out[0].ts_ns < self.released_until_ns:  # only past a writer stopped for over 2 s
                self.stats.records_out_of_order += 1
            self.released_until_ns = max(self.released_until_ns, out[-1].ts_ns)
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

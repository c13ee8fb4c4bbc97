"""Single-producer shared-memory ring with eBPF ring-buffer manners.

One file per engine process in ``KVGUARD_RING_DIR`` (default ``/dev/shm/kvguard``),
named ``kvguard-<pid>-<start_ns>.ring``. The engine process is the only producer;
one sidecar is the only consumer.

File layout (all integers little-endian)::

    off   size  field             owner     meaning
      0      8  magic             producer  b"KVGRING1"
      8      4  version           producer  ring layout version (1)
     12      4  header_size       producer  bytes before the data area (4096)
     16      8  capacity          producer  data area bytes, a power of two
     24      4  pid               producer  engine process id
     28      4  engine_id         producer  id stamped into every record header
     32      8  start_ns          producer  CLOCK_REALTIME ns at ring creation
     40      8  proc_start_ticks  producer  /proc/<pid>/stat starttime (pid-reuse check)
     64      8  write_pos         producer  total bytes ever published (monotonic)
     72      8  next_seq          producer  sequence number of the next record attempted
     80      8  dropped_records   producer  records dropped because the ring was full
     88      8  dropped_bytes     producer  their bytes
     96      8  records_written   producer  records published
    104      8  writing_since_ns  producer  CLOCK_MONOTONIC ns at which the record being written
                                            now was stamped (0 = none): a consumer merging rings
                                            releases nothing stamped after it (sidecar/ingest.py)
    128      8  read_pos          consumer  total bytes consumed (monotonic)
    136      8  consumer_pid      consumer  pid of the attached sidecar, 0 if none
    144      8  consumer_next_seq consumer  sequence number the consumer expects next (a
                                            restarted sidecar resumes from it without
                                            mistaking consumed records for lost ones)
    512      4  sticky_len        producer  length of the sticky record copy below (0 = none)
    520  <3576  sticky_record     producer  a copy of the engine's latest HELLO (or a part's ENGINE_PART) record, and
                                            of the COVERAGE and POOL records sent after it (contract
                                            1.5), back to back, so a sidecar that attaches after they
                                            were consumed (a restart) still learns the page size,
                                            roles, pools and what is not watched
   4096      …  data              producer  records (wire/), never straddling the end

Publishing: the producer copies a whole record into the data area with one slice
assignment and only then stores the new ``write_pos`` (one aligned 8-byte store), so
a reader never sees a half-written record; a producer that dies mid-record leaves
``write_pos`` where it was and the torn bytes are never read. A record that does not
fit before the end of the data area is preceded by a PAD record (or, when fewer
than 32 bytes remain, by nothing: readers skip such a tail) and written at offset 0.

Space: the producer allocates the whole file (``posix_fallocate``) before it maps it, so
no later store can fault for want of space (a sparse file on a full tmpfs gets the
writer killed by SIGBUS at its first store to an unbacked page). When the space cannot
be reserved no ring is made (``RingSpaceError``, the ``.init`` file removed): the probes
run without a ring and count what they drop (``engine_hooks/probes.py``).

Write path: a record is framed (``frame``: ``wire.encode``'s bytes, its ``seq`` and
``ts_ns`` left 0) before the producer takes its lock; under the lock it only stamps
``writing_since_ns``, the ``seq`` and ``ts_ns`` (16 bytes, into the framed record), copies
the record into the data area and moves the counters. A batch is framed into one buffer
and, when all of it fits (room in the ring, and before the end of the data area), copied
with one slice assignment and published with one ``write_pos`` store; else record by
record, exactly as ``write`` would.

Full ring: the producer drops the record, bumps ``dropped_records`` and never
waits. The dropped record still consumed a sequence number, so the consumer sees
exactly where the gap is.

Liveness: the producer holds a shared ``flock`` on the file for its whole life; the
kernel releases it when the process dies. A reader that can take the lock
exclusively knows the producer is gone. This works across the containers of a pod
without a shared pid namespace (a pid check would call a live engine dead there) and
cannot be fooled by pid reuse. Files are created mode 0660 so a sidecar of the same
group can write its read position.

Memory ordering: the data copy and the ``write_pos`` store are ordinary stores; on
x86-64 (TSO) they become visible in program order. Readers also validate each
record's magic, length and sequence, so a reordering on a weaker machine shows up as
counted corrupt bytes, never as a wrong record.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from . import wire
from .wire import ALIGN, HEADER_SIZE, MAX_RECORD_BYTES
from .wire import HEADER as RECORD_HEADER
from .wire import MAGIC as RECORD_MAGIC
from .wire import VERSION as RECORD_VERSION

log = logging.getLogger(__name__)

RING_MAGIC = b"KVGRING1"
RING_VERSION = 1
HEADER_BYTES = 4096
DEFAULT_RING_DIR = "/dev/shm/kvguard"
DEFAULT_CAPACITY = 16 << 20
# the largest data area a ring may have: the writer refuses more, the reader refuses a header
# claiming more (a garbage or hostile header must not make the sidecar map or copy gigabytes)
MAX_CAPACITY = 1 << 30
# a reader copies at most this much of the data area at once (more only for one record that is
# longer, up to wire.MAX_RECORD_BYTES): its memory does not grow with the ring's capacity
READ_CHUNK_BYTES = 8 << 20
RING_SUFFIX = ".ring"

_FIXED = struct.Struct("<8sIIQIIQQ")  # magic .. proc_start_ticks
# indices into the header viewed as uint64
_WRITE_POS, _NEXT_SEQ, _DROPPED_RECORDS, _DROPPED_BYTES, _RECORDS_WRITTEN, _WRITING_SINCE = 8, 9, 10, 11, 12, 13
_READ_POS, _CONSUMER_PID, _CONSUMER_NEXT_SEQ = 16, 17, 18
_POSITION = struct.Struct("<QQQ")  # read_pos, consumer_pid, consumer_next_seq: written together
_U64 = 0xFFFFFFFFFFFFFFFF
_STICKY_LEN_OFF, _STICKY_OFF = 512, 520
MAX_STICKY_BYTES = HEADER_BYTES - _STICKY_OFF
_STICKY_LEN = struct.Struct("<I")
# a record header's seq and ts_ns (wire.HEADER: magic, version, kind, length, seq, ts_ns, ...):
# the only bytes of a framed record written under the ring's lock
_SEQ_TS = struct.Struct("<QQ")
_SEQ_TS_OFF = 8
_SEQ_WORD = _SEQ_TS_OFF // 8  # the same, in 8-byte words from the record's start (records are 8-aligned)


class RingError(RuntimeError):
    """A ring file this reader will not attach to; the message says why."""


class RingTruncated(RingError):
    """An attached ring's file shrank below what the reader mapped: retire it, untouched."""


class RingSpaceError(OSError):
    """The ring's space could not be reserved (``posix_fallocate``): no ring is made."""

    def __init__(self, directory: str, size: int, err: int | None):
        err = err or 0
        name = errno.errorcode.get(err, str(err))
        super().__init__(
            err,
            f"cannot reserve {size} bytes for a ring in {directory}: {name} "
            f"({os.strerror(err) if err else 'unknown error'})",
        )
        self.directory, self.size = directory, size

    def __str__(self) -> str:
        return self.strerror or ""  # always the message above (OSError(errno, strerror))


def ring_dir() -> str:
    return os.environ.get("KVGUARD_RING_DIR", DEFAULT_RING_DIR)


def proc_start_ticks(pid: int) -> int:
    """Process start time in clock ticks since boot, 0 when unknown (pid-reuse check)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # the command name may contain spaces: fields restart after the last ')'
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else 0


def _check_capacity(capacity: int) -> int:
    if capacity < 4096 or capacity & (capacity - 1) or capacity > MAX_CAPACITY:
        raise ValueError(
            f"KVGUARD_RING_BYTES: capacity must be a power of two from 4096 to {MAX_CAPACITY} (1 GiB), got {capacity}"
        )
    return capacity


def record_length(buf, pos: int = 0) -> int:
    """The length of a record whose header starts at ``pos`` when the header is structurally
    valid (magic, alignment, at most ``MAX_RECORD_BYTES``) whether or not the whole record is in
    ``buf``; 0 otherwise."""
    if len(buf) - pos < HEADER_SIZE:
        return 0
    magic, _version, _kind, length = RECORD_HEADER.unpack_from(buf, pos)[:4]
    if magic != RECORD_MAGIC or length < HEADER_SIZE or length % ALIGN or length > MAX_RECORD_BYTES:
        return 0
    return length


def whole_records(buf, start: int = 0, end: int | None = None) -> int:
    """Bytes of ``buf[start:end]`` taken by the complete, structurally valid records at its start
    (where a bounded read of a longer stream may stop without cutting a record)."""
    end = len(buf) if end is None else end
    pos = start
    while True:
        length = record_length(buf, pos)
        if not length or pos + length > end:
            return pos - start
        pos += length


def frame(kind: int, payload: bytes, engine_id: int, pool: int = 0, flags: int = 0) -> bytearray:
    """``wire.encode(kind, 0, 0, engine_id, payload, pool, flags)`` as a mutable buffer (header,
    payload, zero padding to a multiple of 8: one allocation, the payload copied once); the
    ring writer stamps its ``seq`` and ``ts_ns`` in place under its lock."""
    length = HEADER_SIZE + len(payload)
    padded = (length + ALIGN - 1) & ~(ALIGN - 1)
    record = bytearray(padded)
    RECORD_HEADER.pack_into(record, 0, RECORD_MAGIC, RECORD_VERSION, kind, padded, 0, 0, engine_id, pool, flags)
    record[HEADER_SIZE:length] = payload
    return record


# from this many records of one length on, a batch is framed and stamped with numpy (below
# it, one struct call per record is cheaper than numpy's fixed cost)
_BATCH_NUMPY_MIN = 16


class _Batch:
    """Records of one kind framed back to back in one buffer (``frame``'s bytes each), before
    the ring's lock is taken: ``ends[i]`` is where record ``i`` ends. Many records of one
    length (a decode step's ASSIGNs) are framed as rows of a numpy array, and ``seqs`` /
    ``stamps`` are strided views of their ``seq`` and ``ts_ns`` words (``seqs`` holding 0, 1,
    ...), so that stamping them under the lock is two numpy operations that allocate nothing."""

    __slots__ = ("buf", "ends", "seqs", "stamps")

    def __init__(self, kind: int, payloads: list[bytes] | tuple[bytes, ...], engine_id: int, pool: int):
        n = len(payloads)
        plen = len(payloads[0])
        self.seqs: np.ndarray | None = None
        self.stamps: np.ndarray | None = None
        if n >= _BATCH_NUMPY_MIN and all(len(p) == plen for p in payloads):
            size = (HEADER_SIZE + plen + ALIGN - 1) & ~(ALIGN - 1)
            self.buf = bytearray(n * size)
            self.ends = list(range(size, n * size + 1, size))
            rows = np.frombuffer(self.buf, dtype=np.uint8).reshape(n, size)
            head = RECORD_HEADER.pack(RECORD_MAGIC, RECORD_VERSION, kind, size, 0, 0, engine_id, pool, 0)
            rows[:, :HEADER_SIZE] = np.frombuffer(head, dtype=np.uint8)
            rows[:, HEADER_SIZE : HEADER_SIZE + plen] = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(
                n, plen
            )
            words = np.frombuffer(self.buf, dtype="<u8")
            self.seqs = words[_SEQ_WORD :: size // 8]
            self.seqs[:] = np.arange(n, dtype=np.uint64)
            self.stamps = words[_SEQ_WORD + 1 :: size // 8]
            return
        ends: list[int] = []
        total = 0
        for p in payloads:
            total += (HEADER_SIZE + len(p) + ALIGN - 1) & ~(ALIGN - 1)
            ends.append(total)
        buf = bytearray(total)
        pack_into = RECORD_HEADER.pack_into
        start = 0
        for p, end in zip(payloads, ends):
            pack_into(buf, start, RECORD_MAGIC, RECORD_VERSION, kind, end - start, 0, 0, engine_id, pool, 0)
            buf[start + HEADER_SIZE : start + HEADER_SIZE + len(p)] = p
            start = end
        self.buf, self.ends = buf, ends

    def stamp(self, seq: int, ts: int) -> None:
        """Record ``i`` gets ``seq + i`` and ``ts`` (under the ring's lock)."""
        if self.seqs is not None and self.stamps is not None:
            self.seqs += seq
            self.stamps.fill(ts)
            return
        pack_into, buf = _SEQ_TS.pack_into, self.buf
        start = 0
        for end in self.ends:
            pack_into(buf, start + _SEQ_TS_OFF, seq, ts)
            seq += 1
            start = end

    def release(self) -> None:
        """Drop the numpy views of the buffer."""
        self.seqs = self.stamps = None


def _header_words(mm: mmap.mmap) -> memoryview | np.ndarray:
    """The ring header as little-endian 8-byte words. A native ``memoryview`` on a
    little-endian machine (a store or load costs half a numpy element's), numpy's ``<u8``
    elsewhere; both are aligned 8-byte stores into the mapping."""
    if sys.byteorder == "little":
        return memoryview(mm)[:HEADER_BYTES].cast("Q")
    return np.frombuffer(mm, dtype="<u8", count=HEADER_BYTES // 8)


class RingWriter:
    """The producer end. ``write`` never blocks on the consumer and never raises."""

    def __init__(self, directory: str, capacity: int = DEFAULT_CAPACITY, engine_id: int | None = None):
        self.capacity = _check_capacity(capacity)
        self.pid = os.getpid()
        start_ns = time.time_ns()
        self.engine_id = engine_id if engine_id is not None else (hash((self.pid, start_ns)) & 0xFFFFFFFF)
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"kvguard-{self.pid}-{start_ns}{RING_SUFFIX}")
        # the header is written under a name readers ignore, then the file is renamed:
        # a reader never sees a ring without its header
        tmp_path = self.path + ".init"
        size = HEADER_BYTES + capacity
        fd = os.open(tmp_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            # group-writable whatever the umask: the sidecar may run as another user of the
            # pod's shared group, and it writes read_pos into the header
            os.fchmod(fd, 0o660)
            # every page of the ring is allocated now, not at its first store: a sparse file
            # (ftruncate) on a full filesystem gets the engine killed by SIGBUS at the first
            # write to a page the filesystem cannot back (tmpfs, a memory emptyDir)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise RingSpaceError(directory, size, exc.errno) from exc
            self._mm = mmap.mmap(fd, size)
            # liveness: a shared lock held for the producer's lifetime. The kernel drops it
            # when the process dies, and unlike a pid it means the same thing in every
            # container of the pod (no shared pid namespace needed)
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            try:  # a ring that could not be made leaves nothing behind (its space is given back)
                os.unlink(tmp_path)
            except OSError:
                pass
            raise
        self._lock_fd = fd
        self._mm[: _FIXED.size] = _FIXED.pack(
            RING_MAGIC,
            RING_VERSION,
            HEADER_BYTES,
            capacity,
            self.pid,
            self.engine_id,
            start_ns,
            proc_start_ticks(self.pid),
        )
        os.rename(tmp_path, self.path)
        self._u64 = _header_words(self._mm)
        self._mask = capacity - 1
        self._write_pos = 0
        self._seq = 0
        self._lock = threading.Lock()  # engine threads (scheduler, transfer pollers) share one ring
        self.sticky_overflow = 0  # records that did not fit the header's sticky copy (write_sticky)

    def write(self, kind: wire.Kind, payload: bytes, pool: int = 0, flags: int = 0) -> bool:
        """Publish one record; False if it was dropped because the ring is full."""
        record = frame(kind, payload, self.engine_id, pool, flags)  # encoded before the lock
        u64 = self._u64
        with self._lock:
            # stamped, and the stamp shown in the header, before the copy (which may stall on a
            # page fault): the consumer waits for it instead of passing it by
            ts = u64[_WRITING_SINCE] = time.monotonic_ns()
            try:
                seq = self._seq
                self._seq = u64[_NEXT_SEQ] = seq + 1
                _SEQ_TS.pack_into(record, _SEQ_TS_OFF, seq, ts)
                return self._publish(record)
            finally:
                u64[_WRITING_SINCE] = 0

    def write_batch(self, kind: wire.Kind, payloads: Iterable[bytes], pool: int = 0) -> int:
        """Publish several records of one kind under one lock hold and one timestamp
        (each its own record and seq, exactly as ``write`` would); returns how many
        were written (the others were dropped because the ring is full)."""
        payloads = payloads if isinstance(payloads, (list, tuple)) else list(payloads)
        if len(payloads) <= 1:
            return sum(self.write(kind, p, pool) for p in payloads)
        batch = _Batch(kind, payloads, self.engine_id, pool)  # encoded before the lock
        n = len(batch.ends)
        u64 = self._u64
        try:
            with self._lock:
                ts = u64[_WRITING_SINCE] = time.monotonic_ns()
                try:
                    seq = self._seq
                    self._seq = u64[_NEXT_SEQ] = seq + n
                    batch.stamp(seq, ts)
                    return self._publish_batch(batch.buf, batch.ends)
                finally:
                    u64[_WRITING_SINCE] = 0
        finally:
            batch.release()

    def write_sticky(self, kind: wire.Kind, payload: bytes, pool: int = 0, append: bool = False) -> bool:
        """Publish a record and keep a copy in the header for consumers that attach later.
        A HELLO (or a part's ENGINE_PART) starts the copy anew; ``append`` adds what belongs
        with it (contract 1.5: the engine's COVERAGE and POOL records) after the copy held
        so far, while it fits (a record that does not fit is still published, only not kept:
        ``sticky_overflow`` counts it)."""
        record = frame(kind, payload, self.engine_id, pool)  # encoded before the lock
        size = len(record)
        mm, u64 = self._mm, self._u64
        with self._lock:
            ts = u64[_WRITING_SINCE] = time.monotonic_ns()
            try:
                seq = self._seq
                self._seq = u64[_NEXT_SEQ] = seq + 1
                _SEQ_TS.pack_into(record, _SEQ_TS_OFF, seq, ts)
                (held,) = _STICKY_LEN.unpack_from(mm, _STICKY_LEN_OFF) if append else (0,)
                if held + size <= MAX_STICKY_BYTES:
                    # length 0 while the bytes change: a consumer reading now sees no copy, never a torn one
                    _STICKY_LEN.pack_into(mm, _STICKY_LEN_OFF, 0)
                    mm[_STICKY_OFF + held : _STICKY_OFF + held + size] = record
                    _STICKY_LEN.pack_into(mm, _STICKY_LEN_OFF, held + size)
                else:
                    self.sticky_overflow += 1
                return self._publish(record)
            finally:
                u64[_WRITING_SINCE] = 0

    def _publish(self, record: bytes | bytearray | memoryview) -> bool:
        """Copy one whole record (seq and ts_ns stamped) into the data area and publish it, or
        count it dropped when the ring is full. Under the lock; allocates nothing."""
        size = len(record)
        u64 = self._u64
        pos = self._write_pos
        offset = pos & self._mask
        tail = self.capacity - offset
        needed = size if size <= tail else size + tail
        if needed > self.capacity - (pos - int(u64[_READ_POS])):
            u64[_DROPPED_RECORDS] += 1
            u64[_DROPPED_BYTES] += size
            return False
        if size > tail:
            if tail >= HEADER_SIZE:
                RECORD_HEADER.pack_into(
                    self._mm,
                    HEADER_BYTES + offset,
                    RECORD_MAGIC,
                    RECORD_VERSION,
                    wire.Kind.PAD,
                    tail,
                    0,
                    0,
                    self.engine_id,
                    0,
                    0,
                )
            pos += tail
            offset = 0
        self._mm[HEADER_BYTES + offset : HEADER_BYTES + offset + size] = record
        pos += size
        u64[_RECORDS_WRITTEN] += 1
        u64[_WRITE_POS] = pos  # publish last
        self._write_pos = pos
        return True

    def _publish_batch(self, buf: bytearray, ends: list[int]) -> int:
        """``_publish`` each record of ``buf`` (ending at ``ends``); returns how many were
        written. When all of them fit before the end of the data area: one copy, one
        ``write_pos`` store (the same bytes and counters as one ``_publish`` each)."""
        total = ends[-1]
        u64 = self._u64
        pos = self._write_pos
        offset = pos & self._mask
        if total <= self.capacity - offset and total <= self.capacity - (pos - int(u64[_READ_POS])):
            self._mm[HEADER_BYTES + offset : HEADER_BYTES + offset + total] = buf
            pos += total
            u64[_RECORDS_WRITTEN] += len(ends)
            u64[_WRITE_POS] = pos  # publish last
            self._write_pos = pos
            return len(ends)
        written = 0
        with memoryview(buf) as view:
            start = 0
            for end in ends:
                written += self._publish(view[start:end])
                start = end
        return written

    @property
    def dropped_records(self) -> int:
        return int(self._u64[_DROPPED_RECORDS])

    @property
    def records_written(self) -> int:
        return int(self._u64[_RECORDS_WRITTEN])

    def close(self, unlink: bool = False) -> None:
        u64 = self._u64
        del self._u64  # the mapping cannot be closed while a view of it is alive
        if isinstance(u64, memoryview):
            u64.release()
        del u64
        self._mm.close()
        os.close(self._lock_fd)
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass


@dataclass(slots=True)
class PollResult:
    records: list
    lost: int  # records the producer dropped since the previous poll (sequence gaps)


class RingReader:
    """The consumer end of one ring file.

    The ring file can shrink under the reader (truncated by anyone with write access):
    a load from a mapped page past the new end of file is SIGBUS, which would kill the
    whole sidecar. So the reader maps nothing: the header's 8-byte counters are read with
    ``pread`` and its own (read position, next sequence, consumer pid) written with
    ``pwrite``, the sticky record and the data area copied with ``pread``; a read past the
    end returns short instead of faulting. (An earlier version touched a mapping right
    after ``fstat`` showed the file covered it: a thread stopped between the two, the file
    cut meanwhile, was SIGBUS on resuming; seen once in the truncation test.) A ring found
    shorter than it should be raises ``RingTruncated`` and is not read or written again.
    The producer's counters are published through its mapping; the page cache is the same
    object, so ``pread`` sees each 8-byte aligned store whole.
    """

    def __init__(self, path: str, runs: bool = False, run_length=None):
        self.path = path
        # decode back-to-back one-page ASSIGNs as one record of columns (``wire.AssignRun``): the
        # sidecar's ingest asks for it, other readers get every record on its own; ``run_length``
        # (the sidecar's compiled kernels, when it has them): how long such a run is
        self.runs = runs
        self.run_length = run_length
        self._open = False  # the header may be read and written (False once truncated or closed)
        self.truncated = ""  # why the ring must not be touched any more ("" while it may)
        try:
            # never through a symbolic link, never blocking (a FIFO swapped in after the caller's lstat)
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except PermissionError as exc:
            raise RingError(
                f"{path}: permission denied ({exc.strerror}): the sidecar must be able to write the "
                f"ring header (run it as the engine's user or group; rings are created mode 0660)"
            ) from exc
        except FileNotFoundError as exc:
            raise RingError(f"{path}: cannot open: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RingError(f"{path}: not a regular file (mode {st.st_mode:o})")
            size = st.st_size
            if size < HEADER_BYTES:
                raise RingError(f"{path}: {size} bytes, shorter than a ring header ({HEADER_BYTES})")
            fixed = os.pread(fd, _FIXED.size, 0)  # copied, not mapped: a file cut meanwhile reads short
            if len(fixed) < _FIXED.size:
                raise RingError(f"{path}: truncated while being attached")
            magic, version, header_size, capacity, pid, engine_id, start_ns, ticks = _FIXED.unpack(fixed)
            problem = None
            if magic != RING_MAGIC:
                problem = f"bad magic {magic!r}, not a kvguard ring"
            elif version != RING_VERSION:
                problem = (
                    f"ring layout version {version}; this sidecar reads version {RING_VERSION}: upgrade the sidecar"
                )
            elif header_size != HEADER_BYTES or capacity < 4096 or capacity & (capacity - 1):
                problem = f"implausible header (header_size {header_size}, capacity {capacity})"
            elif capacity > MAX_CAPACITY:
                problem = (
                    f"implausible header: capacity {capacity} bytes, more than a ring may have "
                    f"({MAX_CAPACITY}): not mapped"
                )
            elif size < HEADER_BYTES + capacity:
                problem = f"file is {size} bytes, header says {HEADER_BYTES + capacity}"
            if problem:
                raise RingError(f"{path}: {problem}")
            self._size = HEADER_BYTES + capacity  # the file must stay at least this long
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd  # also the liveness lock's fd (see producer_alive)
        self.capacity, self.pid, self.engine_id = capacity, pid, engine_id
        self.start_ns, self.proc_start_ticks = start_ns, ticks
        self._mask = capacity - 1
        self._open = True
        self._check()
        self._consumer_pid = os.getpid()
        self._set(_CONSUMER_PID, self._consumer_pid)
        self.read_pos = self._get(_READ_POS)
        self.last_backlog = 0  # unread bytes when the last poll began, less what it read
        # a previous consumer left read_pos and the next sequence it expected: resume there
        self.next_seq: int | None = self._get(_CONSUMER_NEXT_SEQ) if self.read_pos else None
        self.resumed = self.read_pos > 0
        self.stats = wire.DecodeStats()
        self.records_lost = 0

    def _check(self) -> None:
        """Raise ``RingTruncated`` unless the file still covers the whole ring."""
        if not self.truncated:
            size = os.fstat(self._lock_fd).st_size
            if size >= self._size:
                return
            self.truncated = (
                f"{self.path}: truncated to {size} bytes while attached (the ring is {self._size} "
                f"bytes): not read again"
            )
            self._open = False  # nothing is read or written any more
        raise RingTruncated(self.truncated)

    def _get(self, index: int) -> int:
        """The header's 8-byte counter ``index`` (a copy: cannot fault)."""
        if not self._open:
            self._check()
            raise RingTruncated(f"{self.path}: closed")
        data = os.pread(self._lock_fd, 8, index * 8)
        if len(data) < 8:
            self._check()  # the file shrank: raises
            raise RingTruncated(f"{self.path}: header read short: not read again")
        return int.from_bytes(data, "little")

    def _set(self, index: int, value: int) -> None:
        """Store the reader's own counter ``index``. (A file cut between the size check and
        this write grows back by at most the header: never a fault, and the next check
        still sees it shorter than the ring.)"""
        self._check()
        if not self._open:
            raise RingTruncated(f"{self.path}: closed")
        os.pwrite(self._lock_fd, (int(value) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"), index * 8)

    def _pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the file at ``offset``: a copy that cannot fault."""
        data = os.pread(self._lock_fd, length, offset)
        if len(data) < length:
            self._check()  # the file shrank: raises
            raise RingTruncated(f"{self.path}: read {len(data)} of {length} bytes at offset {offset}: not read again")
        return data

    @property
    def dropped_records(self) -> int:
        """The producer's own count of dropped records (includes drops before we attached)."""
        return self._get(_DROPPED_RECORDS)

    @property
    def writing_since_ns(self) -> int:
        """When the record the producer is writing now was stamped (0: none in progress)."""
        return self._get(_WRITING_SINCE)

    @property
    def backlog_bytes(self) -> int:
        return self._get(_WRITE_POS) - self.read_pos

    def producer_alive(self) -> bool:
        """Whether the producer still holds its lock on the ring (see RingWriter)."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return self._pid_alive()  # a filesystem without flock: fall back to the pid
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def _pid_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        # a live pid with another start time is a new process that reused the pid
        return not self.proc_start_ticks or proc_start_ticks(self.pid) == self.proc_start_ticks

    def sticky_records(self) -> list:
        """The header's copy of the engine's HELLO and what was kept with it (decoded), or [] if none."""
        raw = self._pread(_STICKY_LEN_OFF, HEADER_BYTES - _STICKY_LEN_OFF)
        (length,) = struct.unpack_from("<I", raw, 0)
        if not 0 < length <= MAX_STICKY_BYTES:
            return []
        start = _STICKY_OFF - _STICKY_LEN_OFF
        out = []
        for rec in wire.decode_stream(raw[start : start + length], wire.DecodeStats()):
            if rec.engine_id == self.engine_id:
                out.append(rec)
            else:
                self._foreign(rec)
        return out

    def poll(self, max_bytes: int = 8 << 20) -> PollResult:
        """Decode what the producer published since the last poll (at most ``max_bytes``).
        Raises ``RingTruncated`` (and reads nothing more) if the file shrank under us."""
        self._check()
        write_pos = self._get(_WRITE_POS)
        if write_pos - self.read_pos > self.capacity or write_pos < self.read_pos:
            # what was skipped cannot exceed what the ring holds: a garbage write_pos (2^64-ish)
            # must not become 1.8e19 corrupt bytes
            self.stats.corrupt_bytes += min(abs(write_pos - self.read_pos), self.capacity)
            self.stats.last_error = f"write_pos {write_pos} inconsistent with read_pos {self.read_pos}: resynchronised"
            self.read_pos = write_pos
            self.last_backlog = 0
            self._set(_READ_POS, write_pos)
            return PollResult([], 0)
        if write_pos == self.read_pos:  # nothing published since: no copy, no header write
            self.last_backlog = 0
            return PollResult([], 0)
        records: list[wire.Record] = []
        limit = min(write_pos, self.read_pos + max_bytes)
        while self.read_pos < write_pos and (self.read_pos < limit or not records):
            offset = self.read_pos & self._mask
            tail = self.capacity - offset
            if tail < wire.HEADER_SIZE:
                self.read_pos += tail
                continue
            chunk = min(tail, write_pos - self.read_pos)
            # what this poll may still copy: the rest of max_bytes (at least one record header),
            # never more than READ_CHUNK_BYTES at once
            cap = min(READ_CHUNK_BYTES, max(limit - self.read_pos, wire.HEADER_SIZE))
            if chunk <= cap:
                data = self._pread(HEADER_BYTES + offset, chunk)
                records.extend(
                    wire.decode_stream(
                        data, self.stats, short_tail_ok=chunk == tail, runs=self.runs, run_length=self.run_length
                    )
                )
                self.read_pos += chunk
            else:  # a copy no bigger than cap (or one record), however much is published
                self.read_pos += self._read_bounded(offset, chunk, records, cap)
        result = self._mark_gaps(records)
        # what is left of what was published when this poll began: the ingest's hold and its
        # "call again" need no second read of write_pos (a record published since was stamped
        # after the poll began, and is read by the next one)
        self.last_backlog = write_pos - self.read_pos
        self._store_position()
        return result

    def _store_position(self) -> None:
        """The reader's read position, pid and next expected sequence, in one write (adjacent
        header words). Not preceded by a size check: a file cut since this poll's check grows
        back by at most the header (a write cannot fault), and the next poll's check retires it."""
        if not self._open:
            raise RingTruncated(f"{self.path}: closed")
        os.pwrite(
            self._lock_fd,
            _POSITION.pack(self.read_pos & _U64, self._consumer_pid, (self.next_seq or 0) & _U64),
            _READ_POS * 8,
        )

    def _read_bounded(self, offset: int, avail: int, records: list, cap: int = READ_CHUNK_BYTES) -> int:
        """Decode the whole records at the start of ``avail`` published bytes at ``offset``
        without copying more than ``cap`` (or the one record there, when it is longer);
        returns the bytes consumed. Bytes that start no valid record are counted as corrupt
        up to ``avail``, exactly as one big copy would have counted them."""
        data = self._pread(HEADER_BYTES + offset, cap)
        whole = whole_records(data)
        if whole == 0:
            length = record_length(data)
            if not length or length > avail:
                self.stats.corrupt_bytes += avail
                self.stats.last_error = f"no valid record header at byte {offset} of the data area"
                return avail
            data, whole = self._pread(HEADER_BYTES + offset, length), length  # one record longer than a chunk
        records.extend(wire.decode_stream(data, self.stats, end=whole, runs=self.runs, run_length=self.run_length))
        return whole

    def _mark_gaps(self, records: list) -> PollResult:
        """Insert a LOST marker where sequence numbers jump, so state can resync there."""
        out, lost = [], 0
        expected = 0 if self.next_seq is None else self.next_seq
        for rec in records:
            if rec.engine_id != self.engine_id:
                self._foreign(rec)  # never applied, and its seq is not this engine's either
                continue
            if rec.seq > expected:
                gap = rec.seq - expected
                lost += gap
                out.append(wire.Record(wire.Kind.LOST, expected, rec.ts_ns, rec.engine_id, 0, gap))
            out.append(rec)
            expected = rec.seq + wire.records_in(rec)
        self.next_seq = expected
        self.records_lost += lost
        return PollResult(out, lost)

    def _foreign(self, rec) -> None:
        """A record whose ``engine_id`` is not the one in this ring's header. Records are bound
        to the ring they come from: a ring writer stamps its own id on everything, so another
        id is a forgery (or memory corruption) and must not touch another engine's state."""
        self.stats.foreign_engine += 1
        self.stats.last_error = (
            f"{rec.kind.name} seq {rec.seq} stamped engine_id {rec.engine_id} in the ring of "
            f"engine_id {self.engine_id} (pid {self.pid}): skipped"
        )

    def close(self) -> None:
        if self._open:
            try:
                self._set(_CONSUMER_PID, 0)
            except (RingTruncated, OSError):
                pass
        self._open = False
        try:
            os.close(self._lock_fd)
        except OSError:
            pass

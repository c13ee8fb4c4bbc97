"""One sidecar per ring directory: an exclusive ``flock`` on a lock file in the directory.

Two sidecars draining the same rings would each consume part of every ring (read_pos
is shared), so both would see sequence gaps that are not real losses and judge reads
against half the history. The lock is taken at start-up and held for the process's
life; the kernel releases it when the process dies (kill -9 included), so a stale
file never blocks a restart. The file holds the holder's pid, for the message the
second sidecar prints. Its name does not end in ``.ring``: ingest never looks at it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

LOCK_NAME = ".kvguard-sidecar.lock"

log = logging.getLogger("kvguard.sidecar")


class RingDirBusy(RuntimeError):
    """Another live sidecar holds the ring directory; the message names it."""


def lock_ring_dir(directory: str) -> int | None:
    """Take the ring directory's lock; returns the fd to keep open (None when the filesystem
    has no flock: logged, not fatal). Raises RingDirBusy when another sidecar holds it."""
    os.makedirs(directory, exist_ok=True)  # as the engines do; a sidecar may start first
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o660)
        writable = True
    except PermissionError:  # left by a sidecar of another user: a read-only fd can be locked too
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        writable = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        raise RingDirBusy(
            f"ring directory {directory} is already watched by another kvguard sidecar "
            f"(pid {holder if holder else 'unknown'}, lock {path}); one sidecar per ring directory: "
            f"stop that one first, or give this one another --ring-dir"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        os.close(fd)
        log.warning(
            "cannot lock %s (%s): a second sidecar on this ring directory would not be refused", path, exc.strerror
        )
        return None
    if writable:
        try:
            os.fchmod(fd, 0o660)  # group-writable whatever the umask, as the rings are
        except OSError:
            pass
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _read_pid(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0

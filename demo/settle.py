"""Waiting for an in-process sidecar to catch up with the engines it watches."""

from __future__ import annotations

import time


def drained(sidecar) -> bool:
    """Every record the engines have published so far has been applied: no ring holds
    unread bytes and nothing read waits in the merge buffer. Checked under the ingest lock,
    between two cycles (a cycle applies all it released before it lets go of the lock)."""
    rings = getattr(sidecar, "rings", None)
    if rings is None:
        return True
    with sidecar.lock:
        return not rings.pending and all(reader.backlog_bytes <= 0 for reader in rings.readers.values())


def wait_until_applied(sidecar, quiet_s: float = 0.4, max_s: float = 10.0) -> None:
    """Until the sidecar has applied everything the engines wrote: the rings drained, and
    no new record for ``quiet_s`` (the engine writes its last records, release and frees,
    around the time the client gets its answer), or ``max_s`` at most.

    Quiet alone is not enough on a loaded machine: an ingest thread starved of CPU for
    ``quiet_s`` applies nothing, which looks like quiet while the record the caller waits
    for (written before the client got its answer) still sits in a ring."""
    t_end = time.monotonic() + max_s
    last, since = -1, time.monotonic()
    while time.monotonic() < t_end:
        n = sum(sidecar.pipeline.records_by_kind.values())
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s and drained(sidecar):
            return
        time.sleep(0.05)

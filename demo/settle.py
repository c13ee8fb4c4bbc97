"""Waiting for an in-process sidecar to catch up with the engines it watches."""

from __future__ import annotations

import time


def wait_until_applied(sidecar, quiet_s: float = 0.4, max_s: float = 10.0) -> None:
    """Until the sidecar has applied everything the engines wrote: no new record for
    ``quiet_s`` (the engine writes its last records, release and frees, around the time
    the client gets its answer), or ``max_s`` at most."""
    t_end = time.monotonic() + max_s
    last, since = -1, time.monotonic()
    while time.monotonic() < t_end:
        n = sum(sidecar.pipeline.records_by_kind.values())
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)

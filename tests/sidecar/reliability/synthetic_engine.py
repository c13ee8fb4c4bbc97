"""A synthetic engine process for the reliability tests: the project's own probe path
(``engine_hooks.probes.get_probes``, which makes the ``RingWriter`` from
``KVGUARD_RING_DIR`` / ``KVGUARD_RING_BYTES`` exactly as the SGLang plugin does),
driven with clean request cycles whose reads the sidecar checks.

    python synthetic_engine.py fill CYCLES   write CYCLES request cycles as fast as possible,
                                             then print one JSON line (ring path, counters)
                                             and exit 0
    python synthetic_engine.py loop          print the ring path, then one request cycle
                                             every few ms until SIGTERM
    python synthetic_engine.py flood         print the ring path, then request cycles as fast
                                             as possible until SIGTERM (saturates a sidecar)

Run as a file (``sidecar_under_test.ENGINE``), never imported; kvguard itself is importable
from the venv.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time

import numpy as np

from kvguard.engine_hooks import probes as probes_mod

PAGE = 4
POOL_PAGES = 256


def cycle(p: probes_mod.Probes, i: int, pages: int = 8) -> int:
    """One clean request: allocate, assign, write and read its own pages, end, free.
    Returns the probe calls made (each one record when there is a ring)."""
    rid = f"r-{i}"
    first = (i * pages) % (POOL_PAGES - pages)
    slots = np.arange(first * PAGE, (first + pages) * PAGE)
    p.request_begin(rid, "acme", None, len(slots), 0, False)
    p.pages_allocated(slots)
    p.rows_assigned(rid, 0, len(slots), 0, slots)
    p.forward([rid], [len(slots)], [slots], [slots])
    p.request_end(rid, "stop", 1_000, 2_000, 1, "")
    p.pages_freed(slots)
    return 6


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    mode = sys.argv[1]
    p = probes_mod.get_probes()
    p.hello(
        "unified",
        0,
        PAGE,
        POOL_PAGES,
        POOL_PAGES * PAGE,
        POOL_PAGES * PAGE,
        POOL_PAGES * PAGE,
        "synthetic",
        "0",
        "none",
    )
    calls = 1
    writer = p.writer
    if mode == "fill":
        for i in range(int(sys.argv[2])):
            calls += cycle(p, i, pages=64)  # ~1 KB of records a cycle
        print(
            json.dumps(
                {
                    "ring": writer.path if writer is not None else None,
                    "probe_calls": calls,
                    "records_written": writer.records_written if writer is not None else 0,
                    "dropped_ring_full": writer.dropped_records if writer is not None else 0,
                    # absent before the fix: the probes had no such counter
                    "dropped_no_ring": getattr(p, "dropped_no_ring", None),
                }
            ),
            flush=True,
        )
        return 0
    if mode in ("loop", "flood"):
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        print(writer.path if writer is not None else "", flush=True)
        pause = 0.005 if mode == "loop" else 0.0
        i = 0
        while not stop:
            cycle(p, i, pages=8 if mode == "loop" else 64)
            i += 1
            if pause:
                time.sleep(pause)
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())

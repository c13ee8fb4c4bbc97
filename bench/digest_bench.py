"""Raw xxh3 speed over page-sized buffers: the ceiling the transfer digest path is held to.

The transfer digest path (docs/architecture.md, "Transfer integrity") is not implemented
yet, so there is nothing of kvguard's to time: ``digest.gbps`` is reported as null with
that reason, and only the raw figure is measured.

Page bytes: one layer's KV of one page of a GLM-class MLA model, 64 tokens x (512 latent
+ 64 rope) x 2 bytes (bf16) = 73,728 bytes. The buffers (256 distinct pages, 18 MiB) are
larger than the caches, like KV pages streamed from memory.
"""

from __future__ import annotations

import time

import numpy as np
import xxhash

PAGE_BYTES = 64 * (512 + 64) * 2  # 73,728
NOT_IMPLEMENTED = "transfer digest path not implemented yet (transfer-integrity issue): no kvguard code to time"


def raw_xxh3(page_bytes: int = PAGE_BYTES, pages: int = 256, rounds: int = 8) -> dict:
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, page_bytes * pages, dtype=np.uint8)
    views = [memoryview(buf[i * page_bytes:(i + 1) * page_bytes]) for i in range(pages)]
    h = xxhash.xxh3_64_intdigest
    best = None
    for _ in range(rounds):
        c0 = time.thread_time_ns()
        for v in views:
            h(v)
        cpu = time.thread_time_ns() - c0
        best = cpu if best is None else min(best, cpu)
    return {"page_bytes": page_bytes, "pages": pages, "gbps": page_bytes * pages / best,  # bytes/ns == GB/s
            "xxhash_version": xxhash.VERSION}

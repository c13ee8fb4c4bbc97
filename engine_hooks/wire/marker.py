"""The guard's transfer marker: what prefill's guard tells decode's about a transfer, in
the metadata row SGLang already sends with the transfer's last chunk
(docs/wire-format.md, "The guard's transfer marker").

SGLang's ``MetadataBuffers.output_ids`` is an int32 ``[rows, 16]`` buffer whose row
travels with the last chunk (Mooncake's aux data). SGLang writes slot 0 (the first
output token) and pads the row to 64 bytes because RDMA wants at least that much, in
every release kvguard supports; the marker lives in the padding, slots 8-15. Nothing in
SGLang reads them, so an unguarded decode ignores a marker and a guarded decode paired
with an unguarded prefill finds none.

The marker says: the digest of the KV prefill holds for tokens ``[token_start,
token_end)`` of the room's request, over the kv heads ``[head_start, +head_count)``, by
``alg`` (the XFER_DIGEST definition, docs/wire-format.md "Transfer digests"). Its last
word binds it to the room, so a row reused from an earlier request (a stale marker) or
a torn one never matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = 0x4B564731  # "KVG1"
FIRST_SLOT = 8  # output_ids row slots [8, 16)
SLOTS = 8
ROW_SLOTS = 16  # the row SGLang allocates: the marker needs all of it
_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Marker:
    room: int
    token_start: int
    token_end: int
    head_start: int
    head_count: int
    alg: int
    digest: int  # u64


def _check(words: list[int], room: int) -> int:
    """The XOR of the first seven words (as u32) and of the room's two 32-bit halves."""
    acc = (int(room) & _MASK32) ^ ((int(room) >> 32) & _MASK32)
    for w in words[:7]:
        acc ^= w & _MASK32
    return acc


def pack(m: Marker) -> np.ndarray:
    """The marker's eight int32 words."""
    if not (0 <= m.head_start < 1 << 16 and 0 < m.head_count < 1 << 16):
        raise ValueError(f"head range {m.head_start}+{m.head_count} does not fit the marker")
    if not (0 <= m.token_start <= m.token_end < 1 << 31):
        raise ValueError(f"token range [{m.token_start}, {m.token_end}) does not fit the marker")
    words = [
        MAGIC,
        m.token_start,
        m.token_end,
        m.head_start | m.head_count << 16,
        int(m.alg),
        m.digest & _MASK32,
        (m.digest >> 32) & _MASK32,
    ]
    words.append(_check(words, m.room))
    return np.array(words, dtype=np.uint32).view(np.int32)


def unpack(words, room: int) -> Marker | None:
    """The marker in ``words`` (eight int32) for ``room``; None when there is none, or it
    was written for another room, or it is torn."""
    w = np.asarray(words, dtype=np.int32).view(np.uint32).tolist()
    if len(w) != SLOTS or w[0] != MAGIC or w[7] != _check(w, room):
        return None
    return Marker(int(room), w[1], w[2], w[3] & 0xFFFF, w[3] >> 16, w[4], w[5] | w[6] << 32)


def row(buffers, index: int):
    """The marker's slots of metadata row ``index`` (a torch view: writes go to the row),
    or None when the buffer is not SGLang's 16-slot host row (then no marker is carried)."""
    ids: Any = getattr(buffers, "output_ids", None)
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) != 2 or int(shape[1]) != ROW_SLOTS:
        return None
    if str(ids.device) != "cpu" or str(ids.dtype) != "torch.int32":
        return None
    return ids[int(index), FIRST_SLOT : FIRST_SLOT + SLOTS]

"""Tensor-parallel lanes: one transfer story per rank pair under one bootstrap_room.

With tensor parallelism each scheduler rank of an SGLang engine is its own process, with its
own allocator, pool and ring (one engine timeline per rank), and each rank moves its own kv
heads: prefill's attention-TP rank i sends to decode's rank i, all under the room the router
gave the request. One story per room would mix the ranks (decode rank 1's reservation taken
for a retry of rank 0's, its completion paired with nothing: its pages never written, its reads
alarmed). So the ledger keys rank r's side of a room as ``room | r << 64``: above every real
room (a u64), rank 0's key the room itself, the same key on both pods for the shared ledger.

The digests stay on the room itself (rank 0's story): each rank reports the partial sum over
its own heads, and each end's sum completes only with every rank's part
(sidecar/ledger/digests.py), so a missing, late or restarted rank leaves the pair uncompared,
never mismatched.

Lanes pair rank i with rank i: prefill and decode with the same attention-TP size (what the
soak and the fault tests run). Under pipeline parallelism a stage's HELLO rank counts across
the stages (``pp_rank * tp_size + tp_rank``, engine_hooks/sglang/hooks_requests.py), so
prefill stage s's lane is decode stage s's: SGLang sends each stage's layers stage to stage.
A receiving rank whose lane no sender ever spoke in (decode at a larger TP size than prefill)
takes rank 0's chunks (``TransferLedger._borrow_sender``).
"""

from __future__ import annotations

LANE_SHIFT = 64
ROOM_MASK = (1 << LANE_SHIFT) - 1


def lane_key(room: int, rank: int) -> int:
    """The ledger's key for ``rank``'s side of ``room``."""
    return room if rank <= 0 else room | (rank << LANE_SHIFT)


def room_of(key: int) -> int:
    """The bootstrap_room a ledger key stands for (what findings report)."""
    return key & ROOM_MASK


def rank_of(key: int) -> int:
    return key >> LANE_SHIFT

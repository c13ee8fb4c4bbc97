"""The transfer ledger: pairs the prefill (sender) and decode (receiver) ends of a KV transfer.

``memory`` (sidecar/ledger/memory.py) is the pairing core and the whole ledger when one
sidecar sees both engines. ``redis://`` adds sidecar/ledger/shared.py: each sidecar
publishes its side's facts per room to Redis and fetches the other side's, off the
ingest thread, and the facts it fetches are applied to the same core.
"""

from .digests import DigestSum, DigestVerdict
from .memory import REMOTE_ENGINE, Pairing, RoomState, SentChunk, TransferLedger

__all__ = ["DigestSum", "DigestVerdict", "Pairing", "REMOTE_ENGINE", "RoomState", "SentChunk", "TransferLedger"]

"""Findings from the guard (``KVGUARD_GUARD``, engine_hooks/sglang/guard.py).

The guard checks an invariant in the engine, and when it is about to be broken it fails
the request there (``action: aborted``) or, when it cannot, lets it go on and says so
(``action: observed``). Either way it sends a GUARD record; here it becomes the finding
the same event would have raised without the guard, carrying what the guard did:

- ``rejected_send`` (prefill was about to send a rejected request's KV as a finished
  transfer, SGLang 0.5.19's incident path) -> ``transfer_size_mismatch`` on the prefill
  engine: the engine sends a placeholder's ``send_tokens`` for a prompt of
  ``prompt_tokens``, into ``reserved_pages`` pages decode reserved. When the guard
  aborted it, decode never read those pages: nobody is exposed, and the finding says what
  was prevented. When it only observed, decode's own findings (``unwritten_read`` with
  the exposed tenants, ``transfer_size_mismatch``) follow from decode's records as usual.
- ``send_size`` (prefill was about to send a number of pages other than decode reserved
  for the request: a sender initialised short, pages dropped below the scheduler) ->
  ``transfer_size_mismatch`` on the prefill engine, as above.
- ``read_foreign`` / ``read_freed`` (``KVGUARD_GUARD=full``: the engine's read check refused a
  reader) -> no finding here: the pipeline keeps the action on the reader's request
  (``RequestInfo.guard_action``), and the ``foreign_read`` / ``use_after_free`` findings of
  that reader (sidecar/detectors/tier1.py and reads.py) carry ``evidence.action``.
- ``digest_mismatch`` (decode's guard found the received KV differing from prefill's
  digest before the first decode step) -> likewise no finding here: the
  ``checksum_mismatch`` the two XFER_DIGEST records raise (transfers.py) carries it.

``evidence.source`` is ``"engine_guard"``. Warmup requests are never alarmed.
"""

from __future__ import annotations

from typing import ClassVar

from kvguard.engine_hooks import wire

from ..catalogue import KIND
from ..findings import CRITICAL, Finding, Party
from .base import At
from .reads import reader_party

ACTIONS = {wire.GuardAction.ABORTED: "aborted", wire.GuardAction.OBSERVED: "observed"}
# KVGUARD_GUARD=full: the engine's read check refused a reader. No finding of its own: the
# reader's read findings (Tier 1's TIER1_VIOLATION, Tier 2's FORWARD judgement, both after
# this record) carry the action; the kind an abort is counted under
READ_RULES = {wire.GuardRule.READ_FOREIGN: KIND.foreign_read, wire.GuardRule.READ_FREED: KIND.use_after_free}
# the same for the decode guard's digest comparison: the sidecar's own checksum_mismatch,
# from the two XFER_DIGEST records, carries the action
CARRIED_RULES = {**READ_RULES, wire.GuardRule.DIGEST_MISMATCH: KIND.checksum_mismatch}
# every kind kvguard_guard_aborts_total{kind} counts (exported at 0 from the start)
GUARD_ABORT_KINDS = (KIND.transfer_size_mismatch, *CARRIED_RULES.values())


class GuardDetector:
    """A GUARD record: the engine's guard caught an invariant about to be broken."""

    kinds: ClassVar[tuple[str, ...]] = (KIND.transfer_size_mismatch,)
    events: ClassVar[tuple[type, ...]] = (wire.Guard,)

    def observe(self, g: wire.Guard, at: At) -> list[Finding]:
        if g.rule in CARRIED_RULES:
            return []  # the model keeps the action; the read / checksum findings carry it (request_records.py on_guard)
        tracker = at.tracker
        info = tracker.requests.get(g.req_key) if tracker is not None else None
        if info is not None and info.warmup:
            return []
        room = None if g.room == wire.NO_ROOM else g.room
        reader = reader_party(info) if info is not None else Party(f"key:{g.req_key:016x}", "", room)
        action = ACTIONS[g.action]
        into = f" into the {g.reserved_pages} pages decode reserved" if g.reserved_pages else ""
        outcome = (
            "the guard failed the request before decode read any of them: nothing was exposed"
            if action == "aborted"
            else "the guard could not fail it on this transfer backend (observed only): see decode's findings"
        )
        who = (
            f"{at.engine.role} rank {at.engine.rank}: request {reader.rid} (tenant {reader.tenant or '?'}, room {room})"
        )
        if g.rule == wire.GuardRule.SEND_SIZE:
            what = (
                f"was about to have {g.send_tokens} token(s) of its {g.prompt_tokens}-token prompt sent, in a "
                f"number of pages other than the {g.reserved_pages} decode reserved"
            )
        else:
            what = (
                f"was rejected by the engine, which then sent {g.send_tokens} token(s) of its "
                f"{g.prompt_tokens}-token prompt as a finished transfer{into}"
            )
        summary = f"{who} {what}; {outcome}"
        evidence = {
            "source": "engine_guard",
            "action": action,
            "rule": g.rule.name.lower(),
            "prompt_tokens": g.prompt_tokens,
            "sent_tokens": g.send_tokens,
            "reserved_pages": g.reserved_pages or None,
            "reason": g.reason,
        }
        return [Finding(KIND.transfer_size_mismatch, CRITICAL, at.engine, reader, [], [], at.ts_ns, summary, evidence)]

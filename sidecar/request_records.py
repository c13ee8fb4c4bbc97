"""The requests component: what the engine says about its requests and itself (HELLO,
REQ_BEGIN, REQ_END, REJECT, GUARD, TIER1_VIOLATION).

A request's facts live in its engine's request directory (``EngineTracker.requests``); this
component applies the records to it, tells the transfers component when a request with a room
begins, is rejected or ends (its ledger holds the room's two ends), passes a request's end to
the detectors with its prompt facts (TTFT) and to the tracer, and counts what the engine's
guard prevented.
"""

from __future__ import annotations

import logging
from collections import Counter

from kvguard.engine_hooks import wire

from .detectors.guard import ACTIONS, CARRIED_RULES
from .engine_parts import EngineParts
from .events import RequestEnded
from .findings import Finding
from .history import Event
from .memory_budget import MemoryBudget
from .outlet import Outlet, engine_ref
from .tracker import ROLE_NAMES, EngineTracker
from .transfer_flow import Transfers, lane, role_of

log = logging.getLogger("kvguard.pipeline")


class RequestRecords:
    """Applies request and engine records; ``guard_aborts``: finding kind -> requests the
    engine's guard failed."""

    def __init__(
        self,
        out: Outlet,
        engines: dict[int, EngineTracker],
        transfers: Transfers,
        memory_budget: MemoryBudget,
        parts: EngineParts,
        tracer=None,
    ):
        self.out = out
        self.engines = engines
        self.transfers = transfers
        self.memory_budget = memory_budget
        self.parts = parts
        self.tracer = tracer  # sidecar.tracing.TraceRecorder or None: request spans
        self.guard_aborts: Counter = Counter()

    def handlers(self) -> dict:
        """record kind -> ``(tracker, record) -> findings``, for the pipeline's dispatch."""
        K = wire.Kind
        return {
            K.HELLO: self.on_hello,
            K.REQ_BEGIN: self.on_request_begin,
            K.REQ_END: self.on_request_end,
            K.REJECT: self.on_reject,
            # the engine's own read check (sidecar/detectors/tier1.py)
            K.TIER1_VIOLATION: lambda t, rec: self.out.judge(rec.body, t, rec.ts_ns),
            # what the engine's guard did (sidecar/detectors/guard.py)
            K.GUARD: self.on_guard,
        }

    def on_hello(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, ts = rec.body, rec.ts_ns
        allowed = self.memory_budget.pages_allowed([o for o in self.engines.values() if o is not t])
        if body.pool_pages > allowed:
            log.error(
                "engine %d (pid %d) announces a pool of %d pages; --memory-budget %d leaves room to model "
                "%d: pages past %d are not tracked (counted in kvguard_page_ids_out_of_range_total, their "
                "reads unverified). Raise --memory-budget (and the container's memory limit)",
                rec.engine_id,
                body.pid,
                body.pool_pages,
                self.memory_budget.total_bytes,
                allowed,
                allowed,
            )
        t.on_hello(body, max_pages=allowed)
        self.parts.on_hello(rec.engine_id, body.pid)
        self.memory_budget.size_directories(list(self.engines.values()))  # its page model is known now
        log.info(
            "engine %d: %s %s rank %d pid %d, page_size %d, pool %d pages / %d tokens, context %d",
            rec.engine_id,
            body.engine_name,
            ROLE_NAMES.get(body.role),
            body.tp_rank,
            body.pid,
            body.page_size,
            body.pool_pages,
            body.pool_tokens,
            body.context_len,
        )
        found = self.out.observe(body, t, ts)
        if not found:
            self.out.resolved(self.out.incidents.on_engine_hello(body.pid, ROLE_NAMES.get(body.role), True, ts))
        return self.out.emit(found)

    def on_request_begin(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, eid = rec.body, rec.engine_id
        t.on_request_begin(body, rec.ts_ns)
        self.out.record(rec.ts_ns, eid, Event.REQ_BEGIN, body.req_key, aux=body.prompt_tokens)
        if body.room != wire.NO_ROOM and role_of(t) == wire.Role.PREFILL:
            self.transfers.on_sender_begin(t, body)
        if self.tracer is not None:
            self.tracer.on_request_begin(engine_ref(t), t.requests.get(body.req_key))
        return []

    def on_request_end(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body, ts = rec.body, rec.ts_ns
        info = t.requests.get(body.req_key)
        row = t.rows.get(body.req_key)
        pages = 0 if row is None else int((row.pages > 0).sum())  # before on_request_end drops the row
        written = t.take_prompt_pages_written(body.req_key)
        t.on_request_end(body, ts)
        for pool_tracker in t.pools.values():  # its rows in the engine's other pools go too
            pool_tracker.release_row(body.req_key)
        self.out.record(ts, rec.engine_id, Event.REQ_END, body.req_key, aux=int(body.finish))
        found = self.transfers.on_request_end(t, info, body, ts)
        if info is not None and t.hello is not None:
            ps = max(t.page_size, 1)
            span = -(-info.prompt_tokens // ps) - info.cached_tokens // ps  # pages the uncached prompt spans
            found += self.out.judge(RequestEnded(info, None if written is None else (written, span)), t, ts)
            self.out.resolved(self.out.incidents.on_request_end(t.hello.pid, info.rid, ts))
        if self.tracer is not None:  # after the TTFT finding, so that it lands on the open span
            self.tracer.on_request_end(
                engine_ref(t), t.requests.get(body.req_key), pages=pages, output_tokens=body.output_tokens
            )
        return found

    def on_reject(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        t.on_reject(body)
        self.out.record(rec.ts_ns, rec.engine_id, Event.REJECT, body.req_key, aux=int(body.phase))
        info = t.requests.get(body.req_key)
        if role_of(t) == wire.Role.PREFILL and info is not None and info.room is not None:
            gave_up = "abort" if body.phase == wire.Phase.CLIENT_ABORT else "reject"
            return self.transfers.sender_gave_up(body.req_key, lane(t, info.room), gave_up, rec.ts_ns)
        return []

    def on_guard(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        carried_kind = CARRIED_RULES.get(body.rule)
        if carried_kind is not None:  # the request's read / checksum findings, raised after this, carry the action
            t.requests.get_or_stub(body.req_key).guard_action = ACTIONS[body.action]
            if body.action == wire.GuardAction.ABORTED:
                self.guard_aborts[carried_kind] += 1
            return []
        found = self.out.observe(body, t, rec.ts_ns)
        if rec.body.action == wire.GuardAction.ABORTED:
            # counted before filing: a finding that joins an open incident is not delivered
            # again, but the engine still failed that request
            for f in found:
                self.guard_aborts[f.kind] += 1
        return self.out.emit(found)

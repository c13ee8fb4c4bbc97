"""The pages component: the records that change an engine's page model (ALLOC, ASSIGN, FREE,
FORWARD, CONTENT_CHANGED, REQ_SCOPE, PAGE_IDENTITY), what the engine declares about its pools (POOL,
COVERAGE) and gaps in its stream (LOST).

Each engine's page model and its judge are sidecar/tracker.py's ``EngineTracker`` (one per
pool: ``tracker.pools``); this component applies records to them and hands the verdicts they
return (writes and reads where they should not be, pages freed twice, prefixes shared across
scopes, a coverage gap, a gap in the records) to the outlet. The pipeline routes each record to
the model of the pool its header names before it gets here.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from kvguard.engine_hooks import wire

from .events import ContentChangedAt, PagesFreedTwice, RecordsLost
from .findings import Finding
from .history import Event
from .memory_budget import MemoryBudget
from .outlet import Outlet
from .page_identity import IdentityCounts, judge_hit, record_written
from .tracker import EngineTracker

log = logging.getLogger("kvguard.pipeline")


class PageRecords:
    """Applies page records to the engines' page models; counts what it had to skip."""

    def __init__(self, out: Outlet, engines: dict[int, EngineTracker], memory_budget: MemoryBudget):
        self.out = out
        self.engines = engines
        self.memory_budget = memory_budget
        self.records_lost = 0
        self.records_lost_by_engine: dict[int, int] = {}  # engine id -> records lost since first seen
        # records naming a pool their engine never declared (POOL), or a kind a pool does not hold: skipped
        self.records_undeclared_pool = 0
        self.identity = IdentityCounts()  # pages of PAGE_IDENTITY records, by what became of them

    def handlers(self) -> dict:
        """record kind -> ``(tracker, record) -> findings``, for the pipeline's dispatch."""
        K = wire.Kind
        return {
            K.FORWARD: self.on_forward,
            K.ALLOC: self.on_alloc,
            K.ASSIGN: self.on_assign,
            K.FREE: self.on_free,
            K.REQ_SCOPE: self.on_scope,
            K.PAGE_IDENTITY: self.on_page_identity,
            K.CONTENT_CHANGED: lambda t, rec: self.out.judge(
                ContentChangedAt(rec.body.pages, rec.body.slots_changed), t, rec.ts_ns
            ),
            # what the engine holds and what of it is watched (contract 1.5)
            K.COVERAGE: self.on_coverage,
            K.POOL: self.on_pool,
            K.LOST: self.on_lost,
        }

    def forget_engine(self, engine_id: int) -> None:
        self.records_lost_by_engine.pop(engine_id, None)

    # ------------------------------------------------------------------ the page model
    def on_alloc(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        pages, gens = t.on_alloc_gens(rec.body.pages)  # the valid ids: one past the limit is counted and skipped
        self.out.record(rec.ts_ns, rec.engine_id, Event.ALLOC, 0, pages, gens, pool=t.pool_index)
        return []

    def on_assign(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        if type(body) is wire.AssignRun:
            return self.on_assign_run(t, rec)
        events = t.on_assign(body)
        self.out.record(
            rec.ts_ns, rec.engine_id, Event.ASSIGN, body.req_key, body.pages, aux=body.row_start, pool=t.pool_index
        )
        findings: list[Finding] = []
        for event in events:
            findings += self.out.judge(event, t, rec.ts_ns)
        return findings

    def on_assign_run(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """Back-to-back one-page ASSIGNs (a decode step's, one per request) as a batch: those
        that repeat what their row already holds change nothing and are only recorded; the
        others are applied one by one, in order, exactly as on their own (``on_assign``)."""
        run: wire.AssignRun = rec.body
        self.out.record(
            run.ts_ns, rec.engine_id, Event.ASSIGN, run.req_keys, run.pages, aux=run.row_start, pool=t.pool_index
        )
        findings: list[Finding] = []
        rest = t.on_assign_run(run)
        if len(rest):
            for i, event in t.on_assign_run_rest(run, rest):
                findings += self.out.judge(event, t, int(run.ts_ns[i]))
        return findings

    def on_free(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        body = rec.body
        self.out.record(rec.ts_ns, rec.engine_id, Event.FREE, 0, body.pages, aux=int(body.free_kind), pool=t.pool_index)
        already = t.on_free(body.pages)
        if len(already) == 0:
            return []
        return self.out.judge(PagesFreedTwice(already, body.free_kind.name.lower()), t, rec.ts_ns)

    def on_scope(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        t.on_scope(rec.body)
        for pool_tracker in t.pools.values():  # their pages take the writer's scope too
            pool_tracker.on_scope(rec.body)
        return []

    def on_page_identity(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """Content identities of a request's full pages (contract 1.6, sidecar/page_identity.py):
        kept for the pages it wrote; compared for the prefix-cache pages it was handed."""
        body: wire.PageIdentity = rec.body
        if body.phase == wire.IdentityPhase.WRITTEN:
            record_written(t.pool, t.rows, body, self.identity)
            return []
        reader = t.requests.get(body.req_key)
        known = reader if reader is not None and reader.known else None  # (a stub is never judged)
        mismatch = judge_hit(t.pool, t.rows, body, known, self.identity)
        return self.out.judge(mismatch, t, rec.ts_ns) if mismatch is not None else []

    def on_forward(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        f: wire.Forward = rec.body
        ts_ns = rec.ts_ns
        # a forward writes its new tokens' KV before attention reads the rows
        findings = []
        writers = None  # each page's writer (below, unless a decode step's: then the batch's keys)
        if t.decode_writes(f.req_keys, f.write_counts, f.write_pages, ts_ns):
            writers = f.req_keys  # a decode step's: one page each, all the writers' own, marked
        elif t.judge.writes_overlap(f.write_pages):  # a page written twice: the order matters, one request at a time
            w_off = np.concatenate(([0], np.cumsum(f.write_counts, dtype=np.int64)))
            for i, key in enumerate(f.req_keys.tolist()):
                if w_off[i + 1] > w_off[i]:
                    written = f.write_pages[w_off[i] : w_off[i + 1]].astype(np.int64)
                    verdict = t.judge.check_write(key, written)
                    if verdict is not None:
                        findings += self.out.judge(verdict, t, ts_ns)
                    t.mark_written(key, written, ts_ns)
        else:  # the whole batch at once: verdicts only for the requests that wrote where they should not
            for _i, verdict in t.judge.check_writes(f.req_keys, f.write_counts, f.write_pages):
                findings += self.out.judge(verdict, t, ts_ns)
            t.mark_writes(f.req_keys, f.write_counts, f.write_pages, ts_ns)
        # (a forward's late write is not marked as replacing its owner's KV, as a late transfer
        # chunk is: it writes single token slots, the owner may write that slot itself before
        # it reads it, and the record names pages, not slots: docs/detectors.md, late_write)
        t.count_prompt_writes(f.req_keys, f.seq_lens, f.write_counts, f.write_pages)
        if writers is None:
            writers = np.repeat(f.req_keys, f.write_counts)
        self.out.record(ts_ns, t.engine_id, Event.WRITE, writers, f.write_pages, pool=t.pool_index)
        if not t.pool_index:  # (a read per request per forward: pool 0's says it)
            self.out.record(ts_ns, t.engine_id, Event.READ, f.req_keys, aux=f.seq_lens)
        # the whole batch is judged at once; verdicts come only for requests with something to look at
        for _i, read in t.judge.classify_reads(
            f.req_keys, f.seq_lens, f.read_counts, f.read_pages, want_shared=self.out.detectors.wants_shared_reads
        ):
            findings += self.out.judge(read, t, ts_ns)
        return findings

    # ------------------------------------------------------------------ what the engine declares
    def on_coverage(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """An engine's COVERAGE, or a part's (vLLM's Worker reports its own, about its
        forwards): merged by component, so either order gives the engine's whole account."""
        items = {item.component: item for item in (t.coverage.items if t.coverage is not None else ())}
        items.update((item.component, item) for item in rec.body.items)
        t.coverage = wire.Coverage(list(items.values()))
        if t.coverage_reported or not t.coverage.gaps:
            return []  # one coverage_gap per engine: a later gap shows in /metrics and /v1/engines
        t.coverage_reported = True
        return self.out.judge(t.coverage, t, rec.ts_ns)

    def on_pool(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """A pool besides pool 0 (POOL, after the engine's HELLO): a tracker of its own, sharing
        the engine's request directory, with the HELLO's identity and this pool's page figures."""
        info: wire.PoolInfo = rec.body
        if t.hello is None or rec.pool == 0 or t.pool_index:
            self.undeclared_pool(t, rec)
            return []
        pool_tracker = EngineTracker(t.engine_id, t.requests, info)
        pool_tracker.pool_index = rec.pool
        if info.shares_pages:
            # the same pages as pool 0 (vLLM's KV cache groups: one block pool, aliased memory): one
            # page model, so a block one group freed and another took is judged as such; the rows
            # are this pool's. Its judge is the full one: the page-change log is pool 0's to consume
            pool_tracker.share_pool(t)
        hello = replace(
            t.hello,
            page_size=info.page_size,
            pool_pages=info.pool_pages,
            pool_tokens=info.pool_pages * info.page_size,
        )
        t.pools.pop(rec.pool, None)  # declared again (a replayed sticky copy): the new one replaces it
        allowed = self.memory_budget.pages_allowed(list(self.engines.values()))  # (t's own pools included)
        pool_tracker.on_hello(hello, max_pages=allowed)
        t.pools[rec.pool] = pool_tracker
        log.info(
            "engine %d pool %d (%s, %s): page_size %d, %d pages%s",
            rec.engine_id,
            rec.pool,
            info.name,
            info.kind.name.lower(),
            info.page_size,
            info.pool_pages,
            f", window {info.window_tokens} tokens" if info.window_tokens else "",
        )
        return []

    def undeclared_pool(self, t: EngineTracker, rec: wire.Record) -> None:
        self.records_undeclared_pool += 1
        if self.records_undeclared_pool == 1:
            log.warning(
                "engine %d: %s record for pool %d, which the engine did not declare (or a kind no pool "
                "holds): skipped and counted in kvguard_records_undeclared_pool_total (logged once)",
                rec.engine_id,
                rec.kind.name,
                rec.pool,
            )

    # ------------------------------------------------------------------ gaps
    def on_lost(self, t: EngineTracker, rec: wire.Record) -> list[Finding]:
        """One gap (a LOST marker): its own size, and the engine's running total, go into the
        finding; the incident that groups an engine's gaps adds them up (sidecar/incidents.py)."""
        self.records_lost += rec.body
        total = self.records_lost_by_engine[t.engine_id] = self.records_lost_by_engine.get(t.engine_id, 0) + rec.body
        t.on_lost(rec.ts_ns)
        for pool_tracker in t.pools.values():  # the gap may hide any pool's records
            pool_tracker.on_lost(None)
        return self.out.judge(RecordsLost(rec.body, rec.seq, total), t, rec.ts_ns)

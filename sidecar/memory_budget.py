"""The sidecar's memory budget (``--memory-budget``): what the state it keeps may cost.

Most of the sidecar's memory is fixed by what it watches: the Python runtime and its
libraries, the event history (``--history-events`` x 40 B) and one page model per engine
(about 64 B per pool page, rows included: docs/performance.md, "Memory"). What grows with
traffic is the directory of *ended* requests each engine keeps, so that findings about a
page written by a request that has finished still name its rid and tenant. It was 100,000
entries per engine whatever the node: about 50 MB per engine, 400 MB on an 8-rank node,
over the manifests' 512Mi limit. Now its capacity is what the budget leaves after the fixed
parts, shared between the engines attached, recomputed on every HELLO and engine exit.

The per-entry sizes are measured (tracemalloc; ``tests/sidecar/test_memory_budget.py`` keeps them
honest) and rounded up; ``kvguard_memory_bytes{part}`` exports the estimate per part beside
the process's real RSS (``process_resident_memory_bytes``).
"""

from __future__ import annotations

from .stats import MemoryStats

MIB = 1 << 20
DEFAULT_BUDGET_BYTES = 384 * MIB  # the manifests' limit is 512Mi: the rest is merge buffers, copies, slack
RUNTIME_BYTES = 100 * MIB  # Python, numpy, FastAPI/uvicorn, prometheus-client: ~70-90 MiB measured idle
HISTORY_EVENT_BYTES = 40
POOL_BYTES_PER_PAGE = 64  # page arrays + live rows, 59 B measured at the reference workload (rows with room to grow)
ENDED_REQUEST_BYTES = 600  # a RequestInfo with a 32-character rid in the LRU: 524 B measured
MIN_ENDED_PER_ENGINE = 1_000
MAX_ENDED_PER_ENGINE = 100_000  # more names nothing a finding still needs (requests ended minutes ago)
MIN_PAGES_MODELLED = 1_024  # an engine's model tracks at least this many pages, whatever the budget
# the incident store's share (sidecar/incidents.py IncidentStore.max_bytes) and the transfer
# ledger's (sidecar/ledger/memory.py TransferLedger.max_bytes): 1/16 of the budget each, 1 to
# 32 MiB (24 MiB at the default budget: ~400 incidents of a 150-page read with 20 findings each;
# ~10,000 rooms in flight of 600 tokens at page size 4, five times an 8-rank node's batches)
INCIDENTS_SHARE = 16
MIN_INCIDENTS_BYTES = 1 * MIB
MAX_INCIDENTS_BYTES = 32 * MIB


def share_bytes(total_bytes: int) -> int:
    """The incident store's and the transfer ledger's share each (INCIDENTS_SHARE)."""
    return min(MAX_INCIDENTS_BYTES, max(MIN_INCIDENTS_BYTES, total_bytes // INCIDENTS_SHARE))


class MemoryBudgetError(ValueError):
    pass


class MemoryBudget:
    def __init__(self, total_bytes: int = DEFAULT_BUDGET_BYTES, history_events: int = 1 << 20):
        self.total_bytes = int(total_bytes)
        self.history_bytes = int(history_events) * HISTORY_EVENT_BYTES
        self.incidents_bytes = share_bytes(self.total_bytes)
        self.ledger_bytes = share_bytes(self.total_bytes)
        self.shares_bytes = self.incidents_bytes + self.ledger_bytes
        need = RUNTIME_BYTES + self.history_bytes + self.shares_bytes + MIN_ENDED_PER_ENGINE * ENDED_REQUEST_BYTES
        if self.total_bytes < need:
            raise MemoryBudgetError(
                f"--memory-budget: {self.total_bytes} bytes is less than the sidecar needs before watching any "
                f"engine: ~{RUNTIME_BYTES // MIB} MiB of runtime + --history-events {history_events} x "
                f"{HISTORY_EVENT_BYTES} B + {self.shares_bytes // MIB} MiB of incidents and transfer rooms + "
                f"{MIN_ENDED_PER_ENGINE} "
                f"ended requests = {need} bytes ({-(-need // MIB)} MiB); raise it or lower --history-events"
            )
        self.ended_per_engine = MAX_ENDED_PER_ENGINE

    @staticmethod
    def pages_modelled(t) -> int:
        """Pages an engine's model tracks: its pool, or less where the budget capped it, and the
        same for each pool it declared besides (contract 1.5: ``t.pools``)."""
        info = getattr(t, "pool_info", None)
        if info is not None and info.shares_pages:
            own = 0  # pool 0's page model, counted there
        else:
            own = min(t.hello.pool_pages, t.pool.limit) if t.hello else 0
        return own + sum(MemoryBudget.pages_modelled(p) for p in getattr(t, "pools", {}).values())

    def pools_bytes(self, engines) -> int:
        return sum(POOL_BYTES_PER_PAGE * self.pages_modelled(t) for t in engines)

    def pages_allowed(self, others: list) -> int:
        """The most pages a new engine's model may track beside ``others`` (the engines already
        modelled) while every engine keeps its minimum of ended requests: a HELLO announcing a
        pool beyond it (a node bigger than the budget, or a hostile ring) is capped there, its
        pages past the cap counted out of range and their reads unverified, never allocated."""
        spare = (
            self.total_bytes
            - RUNTIME_BYTES
            - self.history_bytes
            - self.shares_bytes
            - self.pools_bytes(others)
            - (len(others) + 1) * MIN_ENDED_PER_ENGINE * ENDED_REQUEST_BYTES
        )
        return max(MIN_PAGES_MODELLED, spare // POOL_BYTES_PER_PAGE)

    def size_directories(self, engines: list) -> int:
        """Share what the fixed parts and the live requests leave between the engines'
        ended-request directories (trimming them at once); returns the capacity per engine.
        Called on every HELLO and engine exit, and every few seconds as live requests vary. A node whose page models
        alone exceed the budget still keeps ``MIN_ENDED_PER_ENGINE`` each (over budget: the
        usage metric shows it)."""
        live = sum(len(t.requests.live) for t in engines) * ENDED_REQUEST_BYTES  # bounded by the engines' batches
        spare = (
            self.total_bytes - RUNTIME_BYTES - self.history_bytes - self.shares_bytes - self.pools_bytes(engines) - live
        )
        per_engine = spare // (max(1, len(engines)) * ENDED_REQUEST_BYTES)
        self.ended_per_engine = int(min(MAX_ENDED_PER_ENGINE, max(MIN_ENDED_PER_ENGINE, per_engine)))
        for t in engines:
            t.requests.resize(self.ended_per_engine)
        return self.ended_per_engine

    def usage(self, engines, incidents=None, ledger=None) -> dict[str, int]:
        """Estimated bytes by part (the budget counts these); ``incidents``: the IncidentStore,
        ``ledger``: the TransferLedger (their own estimates, bounded by their shares)."""
        ended = live = 0
        for t in engines:
            ended += t.requests.num_ended
            live += len(t.requests.live)
        return {
            "runtime": RUNTIME_BYTES,
            "history": self.history_bytes,
            "page_models": self.pools_bytes(engines),
            "ended_requests": ended * ENDED_REQUEST_BYTES,
            "live_requests": live * ENDED_REQUEST_BYTES,
            "incidents": incidents.nbytes if incidents is not None else 0,
            "transfer_rooms": ledger.nbytes if ledger is not None else 0,
        }

    def stats(self, engines, incidents=None, ledger=None) -> MemoryStats:
        """The budget, the estimate by part (``usage``) and the directories' share (sidecar/stats.py)."""
        return MemoryStats(
            budget_bytes=self.total_bytes,
            bytes_by_part=self.usage(engines, incidents, ledger),
            ended_per_engine=self.ended_per_engine,
        )

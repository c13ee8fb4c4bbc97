"""When a forward carries the engine's actual rows: a fixed interval, or a CPU budget.

Gathering the rows (one page id per page of every request in the batch) is the probes'
most expensive step: at batch 256 and 32k context, ~131k scattered entries of the row
table, ~0.75 ms on a host CPU, memory-bound. A fixed "every Nth forward" spends that
whether the batch is 1 or 256, so small batches get fewer checks than they could
afford and large ones blow the per-step budget. With a budget the interval follows the
measured cost: every forward gains ``budget_ns`` of credit, a sample is taken once the
credit covers the last sample's cost, and the sample's measured cost is spent. The mean
cost of sampling per forward then stays at or below the budget (batch 1: rows every
forward; batch 256 at 32k context: about every 25th), and rows go out at least every
``max_interval`` forwards whatever they cost, so no batch goes unchecked for long.

On a GPU the measured cost includes the wait for the device (the copy to the host
synchronises), so a busy device lowers the sampling rate instead of stalling more.
"""

from __future__ import annotations

import logging
import os

EVERY_ENV = "KVGUARD_ROW_SAMPLE_EVERY"
BUDGET_ENV = "KVGUARD_ROW_SAMPLE_BUDGET_US"
DEFAULT_BUDGET_US = 30  # ~0.2 % of a 16 ms decode step
DEFAULT_EVERY = 16  # the fixed interval when a budget is switched off (KVGUARD_ROW_SAMPLE_BUDGET_US=0)
MAX_INTERVAL = 64  # with a budget: rows at least every this many forwards

log = logging.getLogger("kvguard.probes")


class RowSampler:
    def __init__(self, every: int = DEFAULT_EVERY, budget_ns: int = 0, max_interval: int = MAX_INTERVAL):
        self.every, self.budget_ns, self.max_interval = every, budget_ns, max_interval
        self.forwards = 0  # forwards seen (fixed interval)
        self.since = 0  # forwards since the last sample (budget)
        self.credit_ns = 0
        self.last_cost_ns = 0  # the next sample is assumed to cost what the last one did
        self.samples = 0

    def due(self) -> bool:
        """Called once per forward: does this one carry the rows?"""
        self.forwards += 1
        if not self.budget_ns:
            return bool(self.every) and self.forwards % self.every == 0
        self.since += 1
        self.credit_ns = min(self.credit_ns + self.budget_ns, self.budget_ns * self.max_interval)
        return self.credit_ns >= self.last_cost_ns or self.since >= self.max_interval

    def spent(self, cost_ns: int) -> None:
        """The sample just taken cost this much (wall time of the gather)."""
        self.samples += 1
        if self.budget_ns:
            self.credit_ns -= cost_ns
            self.last_cost_ns = cost_ns
            self.since = 0


def _non_negative_int(name: str, raw: str, default: int) -> int:
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        log.error("kvguard: %s=%r is not a non-negative integer; using %d", name, raw, default)
        return default
    return value


def from_env(environ=os.environ) -> RowSampler:
    """KVGUARD_ROW_SAMPLE_BUDGET_US (default 30; 0 = off) or KVGUARD_ROW_SAMPLE_EVERY.

    Setting only KVGUARD_ROW_SAMPLE_EVERY=N keeps the fixed "every Nth forward" (0 =
    never); setting both makes N the longest interval under the budget."""
    every_raw, budget_raw = environ.get(EVERY_ENV), environ.get(BUDGET_ENV)
    every = DEFAULT_EVERY if every_raw is None else _non_negative_int(EVERY_ENV, every_raw, DEFAULT_EVERY)
    if budget_raw is None:
        budget_us = DEFAULT_BUDGET_US if every_raw is None else 0
    else:
        budget_us = _non_negative_int(BUDGET_ENV, budget_raw, DEFAULT_BUDGET_US)
    if budget_us and every_raw is not None:
        return RowSampler(every, budget_us * 1000, max_interval=every or MAX_INTERVAL)
    return RowSampler(every, budget_us * 1000)

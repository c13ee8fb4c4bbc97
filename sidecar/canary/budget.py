"""The request budget: every HTTP request the canary sends takes one unit first.

The canary promises an operator a hard upper bound on the traffic it adds to a
production endpoint (``--budget N``). The bound is enforced here, at the one place
requests leave, not by the plan's arithmetic: a plan bug cannot exceed it.
"""

from __future__ import annotations

import threading

DEFAULT_BUDGET = 64  # HTTP requests, discovery GETs included (docs/canary.md)


class BudgetExhausted(Exception):
    """Raised instead of sending a request the budget has no room for."""


class Budget:
    """A thread-safe countdown of HTTP requests."""

    def __init__(self, limit: int, on_take=None) -> None:
        if limit < 1:
            raise ValueError(f"--budget must be at least 1, got {limit}")
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()
        self._on_take = on_take  # called with n after each reservation (a progress bar), outside the lock

    @property
    def left(self) -> int:
        return self.limit - self.used

    def take(self, n: int = 1, what: str = "request") -> None:
        """Reserve ``n`` requests atomically (a prefill/decode pair posts two at once)."""
        with self._lock:
            if self.used + n > self.limit:
                raise BudgetExhausted(f"budget of {self.limit} requests spent ({self.used} used); not sending {what}")
            self.used += n
        if self._on_take is not None:
            self._on_take(n)

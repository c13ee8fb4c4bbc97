"""The sidecar's HTTP server: uvicorn (h11) with a connection cap and a request deadline.

uvicorn closes an idle keep-alive connection after ``timeout_keep_alive``, but a connection
that never completes a request has no deadline at all, and nothing caps how many are open:
1,500 half-open connections to the sidecar all stayed open, one file descriptor each, and the
fds are the same budget the ring readers draw on. Here:

- a connection that has not sent a complete request head within ``request_timeout_s`` of
  connecting (or of its previous response) is closed;
- past ``max_connections`` open connections, a new one is closed at once, before any byte is
  read; ``limit_concurrency`` answers 503 to requests over the same cap.

Both are counted (``kvguard_http_connections_closed_total{reason}``). The probes and the
scrape are short GETs and never come near either limit.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvguard.http")

DEFAULT_MAX_CONNECTIONS = 128
DEFAULT_REQUEST_TIMEOUT_S = 10.0

# closed connections by reason; read by sidecar.metrics (one process serves one sidecar)
# (health_*: the probes' own listener, sidecar/health_server.py)
closed_connections = {"over_limit": 0, "request_timeout": 0, "health_over_limit": 0, "health_bad_request": 0}


class HttpConfigError(ValueError):
    pass


def check_limits(max_connections: int, request_timeout_s: float) -> None:
    if max_connections < 4:
        raise HttpConfigError(
            f"--http-max-connections: expected at least 4 (probes and a scrape), got {max_connections}"
        )
    if not 0 < request_timeout_s <= 300:
        raise HttpConfigError(f"--http-request-timeout-s: expected seconds in (0, 300], got {request_timeout_s}")


def guarded_protocol(max_connections: int, request_timeout_s: float) -> type:
    """An h11 protocol class with these limits, for ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # here: the CLI's other commands need no uvicorn

    check_limits(max_connections, request_timeout_s)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._deadline: asyncio.TimerHandle | None = None
            self._refused = len(self.connections) >= max_connections
            if self._refused:
                closed_connections["over_limit"] += 1
                transport.close()
                return
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(request_timeout_s, self._no_request_in_time)

        def _no_request_in_time(self) -> None:
            self._deadline = None
            if self.cycle is None or self.cycle.response_complete:  # no request under way
                closed_connections["request_timeout"] += 1
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete and self._deadline is not None:
                self._deadline.cancel()  # a request head arrived: the app answers it
                self._deadline = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._deadline is None and not self.transport.is_closing():
                self._arm()  # the next request head must come in time too (keep-alive closes idle ones)

        def connection_lost(self, exc: Exception | None) -> None:
            deadline = getattr(self, "_deadline", None)
            if deadline is not None:
                deadline.cancel()
                self._deadline = None
            if getattr(self, "_refused", False):  # closed in connection_made: nothing was set up
                return
            super().connection_lost(exc)

    return GuardedH11Protocol

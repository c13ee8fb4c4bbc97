"""The probes' own listener (``kvguard sidecar --health-listen``): ``/healthz`` and ``/readyz``
on a port of their own, so that a flood of connections to the API port (which closes new
connections past ``--http-max-connections``, sidecar/http_server.py) cannot fail the kubelet's
probes and get a healthy sidecar restarted.

Deliberately small: HTTP/1.x GETs of two paths, one request per connection (``Connection:
close``), a request head of at most ``MAX_HEAD_BYTES`` within ``HEAD_TIMEOUT_S``, at most
``MAX_CONNECTIONS`` open at once (more are closed at once, counted as the API port's are). The
answers are the API's (``Sidecar.healthy()``, which never takes the ingest lock). It runs in
the API server's event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket

from .http_server import closed_connections

log = logging.getLogger("kvguard.http")

MAX_CONNECTIONS = 16  # the kubelet's probes (and an operator's curl) only
HEAD_TIMEOUT_S = 2.0
MAX_HEAD_BYTES = 8192
PATHS = ("/healthz", "/readyz")


def _response(status: int, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
    head = (
        f"HTTP/1.1 {status} {reason[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + payload


def answer(healthy, method: str, path: str) -> bytes:
    """The response to one request; ``healthy()`` is ``Sidecar.healthy``."""
    path = path.split("?", 1)[0]
    if path not in PATHS:
        return _response(404, {"detail": f"only {' and '.join(PATHS)} here"})
    if method not in ("GET", "HEAD"):
        return _response(405, {"detail": "GET only"})
    ok, detail = healthy()
    body = {"ready": ok, **detail} if path == "/readyz" else detail
    return _response(200 if ok else 503, body)


async def start(sock: socket.socket, healthy) -> asyncio.Server:
    """Serve the probes on ``sock`` (bound and listening) until the returned server is closed."""
    open_connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_connections
        if open_connections >= MAX_CONNECTIONS:
            closed_connections["health_over_limit"] += 1
            writer.close()
            return
        open_connections += 1
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                closed_connections["health_bad_request"] += 1
                return
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                closed_connections["health_bad_request"] += 1
                writer.write(_response(400, {"detail": "expected an HTTP/1.x request line"}))
            else:
                writer.write(answer(healthy, parts[0], parts[1]))
            await asyncio.wait_for(writer.drain(), HEAD_TIMEOUT_S)
        except (TimeoutError, ConnectionError):
            pass
        except Exception:  # one bad connection must not take the probes' listener down
            log.exception("health listener: a connection failed")
        finally:
            open_connections -= 1
            writer.close()

    return await asyncio.start_server(handle, sock=sock, limit=MAX_HEAD_BYTES)

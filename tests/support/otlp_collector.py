"""A real OTLP/HTTP receiver for the sidecar's exporters (traces, finding logs): it decodes each
protobuf export request it is sent and keeps it, with its path and headers, and answers with
the given HTTP status (a permanent error such as 400 is not retried by the exporter)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _messages(signal: str):
    """(request, response) protobuf classes of the OTLP collector service for ``signal``."""
    if signal == "logs":
        from opentelemetry.proto.collector.logs.v1 import logs_service_pb2 as pb

        return pb.ExportLogsServiceRequest, pb.ExportLogsServiceResponse
    if signal == "traces":
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        return pb.ExportTraceServiceRequest, pb.ExportTraceServiceResponse
    raise ValueError(f"signal must be 'logs' or 'traces', got {signal!r}")


class Collector(ThreadingHTTPServer):
    """``requests``: (path, decoded export request) in arrival order; ``headers``: each one's."""

    def __init__(self, signal: str, status: int = 200):
        self.request_type, self.response_type = _messages(signal)
        super().__init__(("127.0.0.1", 0), _Handler)
        self.status = status
        self.requests: list = []
        self.headers: list[dict] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: Collector

    def do_POST(self):
        body = self.server.request_type()
        body.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        self.server.headers.append(dict(self.headers))
        data = self.server.response_type().SerializeToString()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

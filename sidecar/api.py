"""HTTP: /healthz and /metrics (the /v1 API comes with the sidecar-core issue)."""

from __future__ import annotations

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from .metrics import KVGuardCollector
from .service import Sidecar


def create_app(sidecar: Sidecar, registry: CollectorRegistry | None = None) -> FastAPI:
    registry = registry or CollectorRegistry()
    registry.register(KVGuardCollector(sidecar))
    app = FastAPI(title="kvguard sidecar", version="0.1.0")

    @app.get("/healthz")
    def healthz():
        ok, detail = sidecar.healthy()
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app

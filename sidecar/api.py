"""HTTP API (FastAPI): health, metrics, incidents and timelines.

``/healthz``, ``/readyz`` and ``/metrics`` are open (probes and Prometheus). Everything
under ``/v1`` names requests and tenants and needs ``Authorization: Bearer <token>``;
with no token configured ``/v1`` answers 403 rather than serving unauthenticated.
Handlers read the pipeline under the sidecar's lock and never hold it for long.
"""

from __future__ import annotations

import hmac
import os
import tempfile
import time
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from pydantic import BaseModel
from starlette.background import BackgroundTask

from kvguard.engine_hooks import wire

from . import bundle, incident_view
from .detectors.probing import PrefixProbingDetector
from .history import Event
from .metrics import KVGuardCollector
from .service import Sidecar

INCIDENT_ID = r"^inc-[0-9a-f]{16}$"
MAX_RID = 256


class ErrorBody(BaseModel):
    detail: str


# FastAPI's ``responses=``: status code -> its OpenAPI description
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing or wrong bearer token"},
    403: {"model": ErrorBody, "description": "no API token configured on this sidecar"},
}


def _event_dict(ev, directory) -> dict:
    key = int(ev["req_key"])
    info = directory.get(key) if key else None
    out = {"ts_ns": int(ev["ts_ns"]), "event": Event(int(ev["event"])).name.lower()}
    page = int(ev["page"])
    if page >= 0:
        out["page"] = page
    if int(ev["gen"]):
        out["generation"] = int(ev["gen"])
    if key:
        out["rid"] = info.rid if info else f"key:{key:016x}"
        out["tenant"] = info.tenant if info else ""
    aux_name = {
        Event.READ: "seq_len",
        Event.ASSIGN: "row_start",
        Event.REQ_BEGIN: "prompt_tokens",
        Event.TRANSFER_WRITE: "sent_tokens",
        Event.FREE: "free_kind",
    }.get(Event(int(ev["event"])))
    if aux_name:
        out[aux_name] = int(ev["aux"])
    return out


def create_app(sidecar: Sidecar, registry: CollectorRegistry | None = None, api_token: str | None = None) -> FastAPI:
    if registry is None:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, against the memory budget
    registry.register(KVGuardCollector(sidecar))
    app = FastAPI(
        title="kvguard sidecar",
        version="0.1.0",
        description="KV-cache integrity findings, incidents and page/request timelines.",
    )

    def require_token(request: Request) -> None:
        if not api_token:
            raise HTTPException(
                403, "the /v1 API is disabled: no API token configured (KVGUARD_API_TOKEN or --api-token-file)"
            )
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_token.encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    auth = [Depends(require_token)]

    # The probes run on the event loop itself (async, no thread-pool hop: each hop is a wait
    # for the GIL, which a saturated ingest thread holds) and never take the ingest lock.
    @app.get("/healthz", responses={503: {"description": "the ingest loop is not running"}})
    async def healthz():
        ok, detail = sidecar.healthy()
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/readyz", responses={503: {"description": "not ready"}})
    async def readyz():
        ok, detail = sidecar.healthy()
        return JSONResponse({"ready": ok, **detail}, status_code=200 if ok else 503)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format"}},
    )
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/incidents", dependencies=auth, responses=AUTH_RESPONSES)
    def list_incidents(
        state: Annotated[str | None, Query(pattern="^(firing|resolved)$")] = None,
        kind: Annotated[str | None, Query(pattern="^[a-z_]{1,64}$")] = None,
        tenant: Annotated[str | None, Query(max_length=MAX_RID)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ):
        with sidecar.lock:
            found = sidecar.pipeline.incidents.list(state, kind, tenant, limit)
            return {"incidents": [i.to_dict() for i in found]}

    # the incident view (sidecar/incident_view.py): HTML with inline SVG, no script, nothing
    # loaded from elsewhere (CSP); registered before /v1/incidents/{incident_id}, which "view" is not.
    # No response_class=HTMLResponse: that would document the JSON errors as text/html too
    html_responses: dict[int | str, dict[str, Any]] = {
        200: {"content": {"text/html": {}}, "description": "the incident view (HTML)"}
    }

    def _html(body: str) -> HTMLResponse:
        return HTMLResponse(
            body,
            headers={
                "Content-Security-Policy": incident_view.CSP,
                "X-Content-Type-Options": "nosniff",
                "Referrer-Policy": "no-referrer",
                "Cache-Control": "no-store",  # it names requests and tenants
            },
        )

    @app.get(
        "/v1/incidents/view",
        dependencies=auth,
        responses={**AUTH_RESPONSES, **html_responses},
    )
    def incidents_view(
        state: Annotated[str | None, Query(pattern="^(firing|resolved)$")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ):
        with sidecar.lock:
            found = [i.to_dict() for i in sidecar.pipeline.incidents.list(state, None, None, limit)]
        return _html(incident_view.render_list(found))

    @app.get(
        "/v1/incidents/{incident_id}/view",
        dependencies=auth,
        responses={**AUTH_RESPONSES, **html_responses, 404: {"model": ErrorBody, "description": "no such incident"}},
    )
    def incident_view_page(incident_id: Annotated[str, Path(pattern=INCIDENT_ID)]):
        with sidecar.lock:
            inc = sidecar.pipeline.incidents.incidents.get(incident_id)
            if inc is None:
                raise HTTPException(404, f"no incident {incident_id}")
            picture = incident_view.gather(sidecar.pipeline, inc)
        return _html(incident_view.render_incident(picture))

    @app.get(
        "/v1/incidents/{incident_id}/bundle",
        dependencies=auth,
        response_class=Response,
        responses={
            **AUTH_RESPONSES,
            200: {
                "content": {"application/gzip": {}},
                "description": "the incident's bundle: a .tar.gz, MANIFEST.json first (docs/api.md, Incident bundles)",
            },
            404: {"model": ErrorBody, "description": "no such incident"},
        },
    )
    def incident_bundle(
        incident_id: Annotated[str, Path(pattern=INCIDENT_ID)],
        before_s: Annotated[float, Query(gt=0, le=86400)] = bundle.DEFAULT_BEFORE_S,
        max_recording_mb: Annotated[int, Query(ge=1, le=4096)] = bundle.DEFAULT_MAX_RECORDING_BYTES >> 20,
    ):
        """Built in a temporary file (the lock held only while the pipeline is copied), sent, then
        deleted. No replay here: it would take CPU from ingestion; `kvguard bundle` checks the file."""
        fd, path = tempfile.mkstemp(prefix=f"kvguard-bundle-{incident_id}-", suffix=".tar.gz")
        os.close(fd)
        try:
            bundle.from_sidecar(
                sidecar, incident_id, path, before_s=before_s, max_recording_bytes=max_recording_mb << 20
            )
        except bundle.NoSuchIncident:
            os.unlink(path)
            raise HTTPException(404, f"no incident {incident_id}") from None
        except BaseException:
            os.unlink(path)
            raise
        return FileResponse(
            path,
            media_type="application/gzip",
            filename=bundle.default_out(incident_id),
            headers={"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"},
            background=BackgroundTask(os.unlink, path),
        )

    @app.get(
        "/v1/incidents/{incident_id}",
        dependencies=auth,
        responses={**AUTH_RESPONSES, 404: {"model": ErrorBody, "description": "no such incident"}},
    )
    def get_incident(incident_id: Annotated[str, Path(pattern=INCIDENT_ID)]):
        with sidecar.lock:
            inc = sidecar.pipeline.incidents.incidents.get(incident_id)
            if inc is None:
                raise HTTPException(404, f"no incident {incident_id}")
            body = inc.to_dict(with_findings=True)
            body["timeline"] = _incident_timeline(sidecar, inc)
            return body

    @app.get("/v1/isolation", dependencies=auth, responses=AUTH_RESPONSES)
    def isolation(window_s: Annotated[int, Query(ge=60, le=3600)] = 3600):
        """Per (reader tenant, writer tenant): the prefix-cache hits that crossed tenants in the
        last ``window_s`` (whole minutes; sidecar/detectors/probing.py), and whether the probing
        detector is on. The evidence behind `kvguard isolation-report`."""
        with sidecar.lock:
            detector = sidecar.pipeline.detectors.get(PrefixProbingDetector)
            pairs = detector.report(time.monotonic_ns(), window_s * 10**9)
            return {
                "window_s": window_s,
                "probing_detector": bool(detector.enabled),
                "cross_tenant_hits_total": detector.cross_tenant_hits,
                "pairs_dropped": detector.pairs_dropped,
                "pairs": pairs,
            }

    @app.get("/v1/engines", dependencies=auth, responses=AUTH_RESPONSES)
    def engines():
        # the figures /metrics renders too (sidecar/stats.py): plain values, so the lock is
        # held only while they are taken, not while the response is built
        with sidecar.lock:
            engines = sidecar.pipeline.engine_stats()
        return {
            "engines": [
                {
                    "engine": e.engine_id,
                    "role": e.role,
                    "rank": e.rank,
                    "pid": e.pid,
                    "page_size": e.page_size,
                    "pool_pages": e.pool_pages,
                    "context_len": e.context_len,
                    "pages": dict(e.pages_by_state),
                    "live_requests": e.live_requests,
                    # what the engine holds and what of it kvguard watches (contract 1.5; [] before it)
                    "coverage_gaps": e.coverage_gaps,
                    "coverage": [
                        {
                            "component": c.component,
                            "status": c.status,
                            "watched": list(c.watched),
                            "missing": list(c.missing),
                            "detail": c.detail,
                        }
                        for c in e.coverage
                    ],
                    "pools": [
                        {
                            "pool": p.index,
                            "kind": p.kind,
                            "name": p.name,
                            "page_size": p.page_size,
                            "pool_pages": p.pool_pages,
                            "window_tokens": p.window_tokens,
                            "pages": dict(p.pages_by_state),
                        }
                        for p in e.pools
                    ],
                }
                for e in engines
            ]
        }

    @app.get(
        "/v1/pages/{engine}/{page}/timeline",
        dependencies=auth,
        responses={**AUTH_RESPONSES, 404: {"model": ErrorBody, "description": "no such engine or page"}},
    )
    def page_timeline(
        engine: Annotated[int, Path(ge=0, le=2**32 - 1)],
        page: Annotated[int, Path(ge=0, le=2**31 - 1)],
        limit: Annotated[int, Query(ge=1, le=5000)] = 200,
        pool_index: Annotated[int, Query(alias="pool", ge=0, le=65535)] = 0,
    ):
        with sidecar.lock:
            t = sidecar.pipeline.engines.get(engine)
            if t is None:
                raise HTTPException(404, f"no engine {engine} (see /v1/engines)")
            if pool_index:  # one of the engine's other pools (POOL, contract 1.5; /v1/engines lists them)
                t = t.pools.get(pool_index)
                if t is None:
                    raise HTTPException(404, f"engine {engine} has no pool {pool_index} (see /v1/engines)")
            if page >= t.pool.num_pages:
                raise HTTPException(404, f"engine {engine} has no page {page} (pool of {t.pool.num_pages})")
            pool = t.pool
            last = t.requests.get(int(pool.last_writer[page]))
            now = {
                "state": _state_name(int(pool.state[page])),
                "generation": int(pool.gen[page]),
                "last_writer": (last.rid if last else None),
                "last_writer_tenant": (last.tenant if last else None),
            }
            history = sidecar.pipeline.history
            events = (
                []
                if history is None
                else [_event_dict(e, t.requests) for e in history.page_events(engine, page, limit, pool_index)]
            )
            return {"engine": engine, "pool": pool_index, "page": page, "now": now, "events": events}

    @app.get(
        "/v1/requests/{rid}/timeline",
        dependencies=auth,
        responses={**AUTH_RESPONSES, 404: {"model": ErrorBody, "description": "no such request in history"}},
    )
    def request_timeline(
        rid: Annotated[str, Path(min_length=1, max_length=MAX_RID)], limit: Annotated[int, Query(ge=1, le=5000)] = 500
    ):
        key = wire.request_key(rid)
        with sidecar.lock:
            out = _request_entries(sidecar, key, rid, limit)
            if not out:
                raise HTTPException(404, f"request {rid!r} is not in the sidecar's history")
            # the other end of a disaggregated request, found by its bootstrap_room: behind SGLang's
            # router a client that sends no rid gets a different rid on prefill and on decode
            other_key, other_rid = _transfer_peer(sidecar, key)
            if other_key:
                out += _request_entries(sidecar, other_key, other_rid, limit)
            return {"rid": rid, "engines": out}

    return app


def _request_entries(sidecar: Sidecar, key: int, rid: str, limit: int) -> list[dict]:
    """Per engine that knows the request: its rid there, tenant, finish and recent events."""
    history = sidecar.pipeline.history
    out = []
    for engine_id, t in sidecar.pipeline.engines.items():
        events: list = []  # its History events on this engine
        if history is not None:
            events = [e for e in history.request_events(key, limit) if int(e["engine"]) == engine_id]
        info = t.requests.get(key)
        if info is None and not events:
            continue
        out.append(
            {
                "engine": engine_id,
                "role": sidecar.pipeline.engine_ref(t).role,
                "rid": rid,
                "tenant": info.tenant if info else None,
                "finish": info.finish if info else None,
                "events": [_event_dict(e, t.requests) for e in events],
            }
        )
    return out


def _transfer_peer(sidecar: Sidecar, key: int) -> tuple[int, str]:
    """(key, rid) of the other end of this request's transfer when its rid differs, else (0, "")."""
    ledger = sidecar.pipeline.ledger
    for t in sidecar.pipeline.engines.values():
        info = t.requests.get(key)
        if info is None or info.room is None:
            continue
        for side in ("sender_key", "receiver_key"):
            state = ledger.find(info.room, **{side: key})
            if state is None or getattr(state, side) != key:
                continue
            if side == "receiver_key" and state.sender_key and state.sender_key != key:
                return state.sender_key, state.sender_rid or f"key:{state.sender_key:016x}"
            if side == "sender_key" and state.receiver_key and state.receiver_key != key:
                engine = state.receiver_engine
                receiver = sidecar.pipeline.engines.get(engine) if engine is not None else None
                peer = receiver.requests.get(state.receiver_key) if receiver is not None else None
                return state.receiver_key, peer.rid if peer is not None else f"key:{state.receiver_key:016x}"
    return 0, ""


def _state_name(state: int) -> str:
    from .tracker import STATE_NAMES

    return STATE_NAMES.get(state, "unknown")


def _incident_timeline(sidecar: Sidecar, inc, limit: int = 50) -> list[dict]:
    """The reader's recent events on the engine of the incident (what it was assigned, wrote, read)."""
    history = sidecar.pipeline.history
    if history is None or inc.reader is None:
        return []
    key = wire.request_key(inc.reader["rid"])
    for t in sidecar.pipeline.engines.values():
        if t.hello is not None and t.hello.pid == inc.engine["pid"]:
            return [
                _event_dict(e, t.requests)
                for e in history.request_events(key, limit)
                if int(e["engine"]) == t.engine_id
            ]
    return []

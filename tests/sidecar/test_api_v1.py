"""/v1: bearer token, incidents with evidence and timelines, and validated inputs."""

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.api import create_app
from kvguard.sidecar.service import Sidecar

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def client(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    p.request_begin("r-acme", "acme", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r-acme", 0, 8, 0, np.arange(4, 12))
    p.forward(["r-acme"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
    p.request_end("r-acme", "stop", 1, 2, 1, "")
    p.pages_freed(np.arange(4, 12))
    p.request_begin("r-initech", "initech", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r-initech", 0, 8, 0, np.arange(4, 12))
    p.forward(["r-initech"], [8], [np.arange(4, 8)], [np.arange(4, 12)])
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    sidecar.run_once(flush=True)
    yield TestClient(create_app(sidecar, CollectorRegistry(), api_token=TOKEN)), sidecar
    sidecar.stop()


def test_v1_needs_the_bearer_token(client):
    c, _ = client
    assert c.get("/v1/incidents").status_code == 401
    assert c.get("/v1/incidents", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = c.get("/v1/incidents", headers={"Authorization": "Basic " + TOKEN})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.get("/healthz").status_code in (200, 503) and c.get("/metrics").status_code == 200


def test_without_a_configured_token_v1_is_forbidden(tmp_path):
    sidecar = Sidecar(str(tmp_path))
    c = TestClient(create_app(sidecar, CollectorRegistry(), api_token=None))
    r = c.get("/v1/incidents", headers=AUTH)
    assert r.status_code == 403 and "no API token configured" in r.json()["detail"]


def test_incidents_list_and_detail_with_timeline(client):
    c, _ = client
    (inc,) = c.get("/v1/incidents", headers=AUTH).json()["incidents"]
    assert (inc["kind"], inc["state"], inc["reader"]["tenant"], inc["tenants_exposed"]) == (
        "unwritten_read",
        "firing",
        "initech",
        ["acme"],
    )
    assert inc["exposed"] == [{"rid": "r-acme", "tenant": "acme", "pages": [2]}]
    detail = c.get(f"/v1/incidents/{inc['id']}", headers=AUTH).json()
    assert detail["findings"][0]["pages"] == [2]
    events = [(e["event"], e.get("page")) for e in detail["timeline"]]
    assert ("assign", 1) in events and ("write", 1) in events and ("read", None) in events
    assert c.get("/v1/incidents", params={"tenant": "globex"}, headers=AUTH).json()["incidents"] == []


def test_page_timeline_names_the_writers_in_order(client):
    c, sidecar = client
    (engine_id,) = sidecar.pipeline.engines
    body = c.get(f"/v1/pages/{engine_id}/2/timeline", headers=AUTH).json()
    assert body["now"] == {"state": "owned", "generation": 2, "last_writer": "r-acme", "last_writer_tenant": "acme"}
    seen = [(e["event"], e.get("rid")) for e in body["events"]]
    assert seen == [
        ("alloc", None),
        ("assign", "r-acme"),
        ("write", "r-acme"),
        ("free", None),
        ("alloc", None),
        ("assign", "r-initech"),
    ]


def test_request_timeline(client):
    c, _ = client
    body = c.get("/v1/requests/r-initech/timeline", headers=AUTH).json()
    (engine,) = body["engines"]
    assert engine["tenant"] == "initech"
    assert [e["event"] for e in engine["events"]][:2] == ["req_begin", "assign"]
    assert c.get("/v1/requests/nope/timeline", headers=AUTH).status_code == 404


@pytest.mark.parametrize(
    "path",
    [
        "/v1/incidents/not-an-id",
        "/v1/pages/-1/2/timeline",
        "/v1/pages/1/x/timeline",
        "/v1/incidents?limit=0",
        "/v1/incidents?state=exploded",
        "/v1/pages/99/1/timeline",
        "/v1/incidents/inc-0000000000000000",
    ],
)
def test_hostile_input_gets_a_4xx_with_a_reason(client, path):
    c, _ = client
    r = c.get(path, headers=AUTH)
    assert 400 <= r.status_code < 500 and r.json()["detail"]

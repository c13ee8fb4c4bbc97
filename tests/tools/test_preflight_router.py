"""``kvguard preflight --url`` given SGLang's router: every worker behind it is checked.

Fast tests run a stub router answering exactly what the real ``sglang-router`` 0.3.2
answers (captured below) in front of stub servers; one engine test puts the real
router in front of a real SGLang 0.5.23 prefill/decode pair on CPU.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvguard.demo import engines
from kvguard.sidecar import cli
from kvguard.sidecar.preflight import router as preflight_router
from tests.tools.test_preflight import REAL_MODELS, Stub, free_closed_port, models, run_json, run_text, server_info

# Captured from sglang-router 0.3.2 (python -m sglang_router.launch_router) in front of
# a SGLang 0.5.23 prefill/decode pair on CPU (model path shortened), PD mode
# (--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL). The worker URLs are
# replaced by the stubs' in the tests.
REAL_ROUTER_WORKERS_PD = {
    "workers": [
        {"id": "753e499c-3401-4c4e-aa2e-b454584509e6", "url": "http://127.0.0.1:43389", "model_id": "/models/tiny",
         "priority": 50, "cost": 1.0, "worker_type": "prefill", "is_healthy": True, "load": 0,
         "connection_mode": "HTTP", "bootstrap_port": 45031,
         "metadata": {"tp_size": "1", "model_type": "gpt2", "disaggregation_mode": "prefill",
                      "load_balance_method": "follow_bootstrap_room", "architectures": "[\"GPT2LMHeadModel\"]",
                      "dp_size": "1", "model_path": "/models/tiny", "served_model_name": "/models/tiny"},
         "disable_health_check": False},
        {"id": "a464d254-3f16-4ed9-ac1e-d6a8e0cd5bd1", "url": "http://127.0.0.1:59017", "model_id": "/models/tiny",
         "priority": 50, "cost": 1.0, "worker_type": "decode", "is_healthy": True, "load": 0,
         "connection_mode": "HTTP",
         "metadata": {"model_path": "/models/tiny", "served_model_name": "/models/tiny", "model_type": "gpt2",
                      "tp_size": "1", "disaggregation_mode": "decode", "load_balance_method": "round_robin",
                      "architectures": "[\"GPT2LMHeadModel\"]", "dp_size": "1"},
         "disable_health_check": False},
    ],
    "total": 2,
    "stats": {"prefill_count": 1, "decode_count": 1, "regular_count": 0},
}  # fmt: skip
# The same router in regular mode (--worker-urls URL URL): the order is the router's.
REAL_ROUTER_WORKERS_REGULAR = {
    "workers": [
        {"id": "cd879346-c0a4-44e2-a2e0-95fad75d4ee6", "url": "http://127.0.0.1:59017", "model_id": "/models/tiny",
         "priority": 50, "cost": 1.0, "worker_type": "regular", "is_healthy": True, "load": 0,
         "connection_mode": "HTTP",
         "metadata": {"load_balance_method": "round_robin", "tp_size": "1", "disaggregation_mode": "null",
                      "model_path": "/models/tiny", "dp_size": "1", "architectures": "[\"GPT2LMHeadModel\"]",
                      "model_type": "gpt2", "served_model_name": "/models/tiny"},
         "disable_health_check": False},
        {"id": "578a38c5-c697-4ab6-a256-9d923b50aa8e", "url": "http://127.0.0.1:43389", "model_id": "/models/tiny",
         "priority": 50, "cost": 1.0, "worker_type": "regular", "is_healthy": True, "load": 0,
         "connection_mode": "HTTP",
         "metadata": {"served_model_name": "/models/tiny", "dp_size": "1", "tp_size": "1",
                      "model_path": "/models/tiny", "architectures": "[\"GPT2LMHeadModel\"]", "model_type": "gpt2",
                      "disaggregation_mode": "null", "load_balance_method": "round_robin"},
         "disable_health_check": False},
    ],
    "total": 2,
    "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 2},
}  # fmt: skip
# Its other answers: /server_info is not a route (404, no body, no content type);
# /get_server_info is the router's own summary, served as text/plain; /v1/models has no
# max_model_len; with --api-key, /workers answers 401 with no body.
REAL_ROUTER_GET_SERVER_INFO = b'{"router_manager":true,"routers_count":1,"workers_count":2}'
REAL_ROUTER_MODELS = b'{"object":"list","data":[{"id":"/models/tiny","object":"model","owned_by":"local"}]}'
TEXT_PLAIN = "text/plain; charset=utf-8"


def router_routes(workers: Any, *, api_key: str | None = None) -> dict[str, tuple]:
    listing = (200, workers, "application/json") if api_key is None else (401, b"", None)
    return {
        "/server_info": (404, b"", None),
        "/workers": listing,
        "/list_workers": (404, b"", None),
        "/get_server_info": (200, REAL_ROUTER_GET_SERVER_INFO, TEXT_PLAIN),
        "/v1/models": (200, REAL_ROUTER_MODELS, TEXT_PLAIN),
        "/health": (200, b"OK", TEXT_PLAIN),
    }


def listing(shape: dict[str, Any], *urls: str, **entry_over: Any) -> dict[str, Any]:
    """``shape`` with its workers' URLs replaced by ``urls`` (in order); ``entry_over`` applies to all."""
    body = copy.deepcopy(shape)
    assert len(urls) == len(body["workers"])
    for entry, url in zip(body["workers"], urls):
        entry["url"] = url
        entry.update(entry_over)
    return body


@pytest.fixture
def stubs():
    made: list[Stub] = []

    def make(n: int = 1) -> list[Stub]:
        new = [Stub() for _ in range(n)]
        made.extend(new)
        return new

    yield make
    for s in made:
        s.close()


def pd_fleet(stubs, *, prefill_pool: int = 256, decode_pool: int = 4096, version: str = "0.5.23"):
    """A stub router (PD mode) in front of a stub prefill and a stub decode server (context 2048)."""
    router, prefill, decode = stubs(3)
    prefill.set(
        server_info(disaggregation_mode="prefill", max_total_num_tokens=prefill_pool, version=version), REAL_MODELS
    )
    decode.set(
        server_info(disaggregation_mode="decode", max_total_num_tokens=decode_pool, version=version), REAL_MODELS
    )
    router.routes.update(router_routes(listing(REAL_ROUTER_WORKERS_PD, prefill.url, decode.url)))
    return router, prefill, decode


# ---------------------------------------------------------------- prefill/decode router


def test_pd_router_reports_each_worker_with_url_and_role(stubs):
    router, prefill, decode = pd_fleet(stubs, prefill_pool=256, decode_pool=4096)
    rc, reports = run_json(router.url)
    assert rc == 2
    assert [(r["url"], r["role"], r["verdict"], r["severity"], r["router"], r["router_worker_type"])
            for r in reports] == [
        (prefill.url, "prefill", "pool_smaller_than_context", "critical", router.url, "prefill"),
        (decode.url, "decode", "safe", None, router.url, "decode"),
    ]  # fmt: skip
    p, d = reports
    assert (p["pool_tokens"], p["context_len"], p["exit_code"]) == (256, 2048, 2)
    assert (d["pool_tokens"], d["context_len"], d["exit_code"], d["ratio"]) == (4096, 2048, 0, 2.0)
    assert p["notes"] == [] and d["notes"] == []
    # the router itself was asked for its list only; each worker was read directly
    assert [path for path, _ in router.requests] == ["/server_info", "/workers"]
    assert [path for path, _ in prefill.requests] == ["/server_info", "/v1/models"]
    assert [path for path, _ in decode.requests] == ["/server_info", "/v1/models"]


def test_pd_router_text_names_router_and_each_worker(stubs):
    router, prefill, decode = pd_fleet(stubs, prefill_pool=256, decode_pool=4096)
    rc, text = run_text(router.url)
    assert rc == 2
    assert text.startswith(
        f"{router.url}: SGLang router listing 2 workers (1 prefill, 1 decode); "
        f"each is checked directly:\n\n{prefill.url}: POOL SMALLER THAN CONTEXT (critical)"
    )
    assert f"\n\n{decode.url}: SAFE\n" in text
    assert text.count(f"  behind router:      {router.url} (listed as prefill)") == 1
    assert text.count(f"  behind router:      {router.url} (listed as decode)") == 1
    assert "role:               decode (prefill/decode disaggregation)" in text
    assert text.rstrip().endswith("2 servers: 1 safe, 1 pool smaller than context, 0 cannot tell; exit 2")


def test_pd_router_all_safe_exits_0(stubs):
    router, _, _ = pd_fleet(stubs, prefill_pool=2048, decode_pool=4096)
    rc, reports = run_json(router.url)
    assert rc == 0 and [r["verdict"] for r in reports] == ["safe", "safe"]


def test_decode_pool_smaller_is_reported_for_decode_only(stubs):
    router, prefill, decode = pd_fleet(stubs, prefill_pool=4096, decode_pool=1024)
    rc, reports = run_json(router.url)
    assert rc == 2
    assert [(r["url"], r["verdict"], r["severity"]) for r in reports] == [
        (prefill.url, "safe", None),
        (decode.url, "pool_smaller_than_context", "warning"),
    ]


def test_old_prefill_behind_router_gets_the_leak_note(stubs):
    router, prefill, _ = pd_fleet(stubs, prefill_pool=256, decode_pool=4096, version="0.5.19")
    rc, [p, _] = run_json(router.url)
    assert rc == 2 and p["url"] == prefill.url and any("predates" in n for n in p["notes"])


# ---------------------------------------------------------------- regular router


def test_regular_router_checks_every_worker(stubs):
    router, a, b = stubs(3)
    a.set(server_info(max_total_num_tokens=4096), REAL_MODELS)
    b.set(server_info(max_total_num_tokens=256), REAL_MODELS)
    router.routes.update(router_routes(listing(REAL_ROUTER_WORKERS_REGULAR, b.url, a.url)))
    rc, reports = run_json(router.url)
    assert rc == 2
    # sorted by URL within a type (the router's own order is not stable)
    expected = sorted([(a.url, "safe"), (b.url, "pool_smaller_than_context")])
    assert [(r["url"], r["verdict"]) for r in reports] == expected
    assert all(
        r["role"] == "unified" and r["router_worker_type"] == "regular" and r["router"] == router.url for r in reports
    )
    rc, text = run_text(router.url)
    assert text.startswith(f"{router.url}: SGLang router listing 2 workers (2 regular); each is checked directly:")


def test_regular_router_in_front_of_pd_servers_notes_it(stubs):
    router, prefill = stubs(2)
    prefill.set(server_info(disaggregation_mode="prefill", max_total_num_tokens=4096), REAL_MODELS)
    body = listing(REAL_ROUTER_WORKERS_REGULAR, prefill.url, prefill.url + "/other")
    prefill.routes["/other/server_info"] = (200, server_info(max_total_num_tokens=4096), "application/json")
    prefill.routes["/other/v1/models"] = (200, REAL_MODELS, "application/json")
    router.routes.update(router_routes(body))
    rc, [r, _] = run_json(router.url)
    assert rc == 0 and r["role"] == "prefill"
    assert r["notes"] == [
        "the router sends whole requests to this server (a regular worker) but it is a "
        "prefill server of a prefill/decode deployment"
    ]


# ---------------------------------------------------------------- a router that cannot be fully checked


def test_unreachable_worker_is_unknown_with_its_url_and_role(stubs):
    router, prefill = stubs(2)
    prefill.set(server_info(disaggregation_mode="prefill", max_total_num_tokens=4096), REAL_MODELS)
    dead = f"http://127.0.0.1:{free_closed_port()}"
    # the router still lists it as healthy: its health check lags (60 s by default)
    router.routes.update(router_routes(listing(REAL_ROUTER_WORKERS_PD, prefill.url, dead)))
    rc, reports = run_json(router.url, timeout_s=5)
    assert rc == 1
    assert [(r["url"], r["role"], r["verdict"]) for r in reports] == [
        (prefill.url, "prefill", "safe"),
        (dead, "decode", "unknown"),
    ]
    assert reports[1]["reason"].startswith("cannot connect for GET /server_info")
    _, text = run_text(router.url, timeout_s=5)
    assert f"{dead}: cannot tell: cannot connect for GET /server_info" in text
    assert f"  behind router:      {router.url} (listed as decode)" in text


def test_unknown_worker_does_not_hide_a_smaller_pool(stubs):
    router, prefill = stubs(2)
    prefill.set(server_info(disaggregation_mode="prefill", max_total_num_tokens=256), REAL_MODELS)
    dead = f"http://127.0.0.1:{free_closed_port()}"
    router.routes.update(router_routes(listing(REAL_ROUTER_WORKERS_PD, prefill.url, dead)))
    rc, reports = run_json(router.url, timeout_s=5)
    assert rc == 2 and [r["verdict"] for r in reports] == ["pool_smaller_than_context", "unknown"]


def test_router_listing_no_workers_is_unknown_never_a_pass(stubs):
    [router] = stubs(1)
    router.routes.update(
        router_routes({"workers": [], "total": 0, "stats": {"prefill_count": 0, "decode_count": 0, "regular_count": 0}})
    )
    rc, [r] = run_json(router.url)
    assert (rc, r["url"], r["role"], r["verdict"], r["router"]) == (1, router.url, "router", "unknown", router.url)
    assert r["reason"].startswith("the router lists no workers (GET /workers is empty): nothing to check")
    rc, text = run_text(router.url)
    assert rc == 1 and text.startswith(f"{router.url}: cannot tell: the router lists no workers")


@pytest.mark.parametrize("present", ["prefill", "decode"])
def test_pd_router_missing_one_side_is_unknown(stubs, present):
    # a worker the router could not register is absent from /workers, not listed as unhealthy
    router, server = stubs(2)
    server.set(server_info(disaggregation_mode=present, max_total_num_tokens=4096), REAL_MODELS)
    body = copy.deepcopy(REAL_ROUTER_WORKERS_PD)
    body["workers"] = [w for w in body["workers"] if w["worker_type"] == present]
    body["workers"][0]["url"] = server.url
    body["total"], body["stats"] = (
        1,
        {"prefill_count": int(present == "prefill"), "decode_count": int(present == "decode"), "regular_count": 0},
    )
    router.routes.update(router_routes(body))
    rc, reports = run_json(router.url)
    assert rc == 1
    assert [(r["url"], r["role"], r["verdict"]) for r in reports] == [
        (server.url, present, "safe"),
        (router.url, "router", "unknown"),
    ]
    lacking = "decode" if present == "prefill" else "prefill"
    assert reports[1]["reason"].startswith(f"the router lists 1 {present} worker and no {lacking} worker")


def test_router_with_api_key_and_no_token_names_the_url(stubs):
    [router] = stubs(1)
    router.routes.update(router_routes(REAL_ROUTER_WORKERS_PD, api_key="sekret"))
    rc, [r] = run_json(router.url)
    assert (rc, r["url"], r["verdict"]) == (1, router.url, "unknown")
    assert r["reason"] == (
        "GET /server_info answered HTTP 404; as SGLang's router: GET /workers answered HTTP 401 "
        "(the server wants a bearer token: --bearer-token-file or $KVGUARD_BEARER_TOKEN)"
    )
    _, text = run_text(router.url)
    assert text.startswith(f"{router.url}: cannot tell: GET /server_info answered HTTP 404; as SGLang's router")


def test_bearer_token_goes_to_router_and_workers(stubs):
    router, prefill, decode = pd_fleet(stubs)
    rc, _ = run_json(router.url, environ={"KVGUARD_BEARER_TOKEN": "sekret"})
    assert rc == 2
    for s in (router, prefill, decode):
        assert {h.get("authorization") for _, h in s.requests} == {"Bearer sekret"}


def test_neither_server_nor_router(stubs):
    [other] = stubs(1)
    other.routes["/server_info"] = (404, b"", None)
    rc, [r] = run_json(other.url)
    assert rc == 1 and r["reason"] == (
        "GET /server_info answered HTTP 404; GET /workers answered HTTP 404 too: "
        "neither an SGLang server, nor SGLang's router, nor a vLLM server at this URL"
    )
    other.routes["/workers"] = (200, [{"url": "http://x:1"}], "application/json")  # not the router's shape
    rc, [r] = run_json(other.url)
    assert rc == 1 and "without a router's 'workers' list" in r["reason"]


@pytest.mark.parametrize("workers,expect", [
    ([7], "GET /workers: entry 0 is int, not an object"),
    ([{"worker_type": "prefill"}], "GET /workers: entry 0 has no 'url'"),
    ([{"url": ""}], "GET /workers: entry 0 has no 'url'"),
])  # fmt: skip
def test_malformed_router_listing_is_unknown(stubs, workers, expect):
    [router] = stubs(1)
    router.routes.update(router_routes({"workers": workers, "total": len(workers)}))
    rc, [r] = run_json(router.url)
    assert (rc, r["url"], r["role"], r["reason"]) == (1, router.url, "router", expect)


def test_bad_worker_url_in_listing_is_unknown_for_that_worker(stubs):
    router, prefill = stubs(2)
    prefill.set(server_info(disaggregation_mode="prefill", max_total_num_tokens=4096), REAL_MODELS)
    router.routes.update(router_routes(listing(REAL_ROUTER_WORKERS_PD, prefill.url, "decode-0:30000")))
    rc, reports = run_json(router.url)
    assert rc == 1 and reports[1]["url"] == "decode-0:30000" and reports[1]["role"] == "decode"
    assert "has no scheme" in reports[1]["reason"]


def test_grpc_worker_is_unknown_not_skipped(stubs):
    [router] = stubs(1)
    body = listing(REAL_ROUTER_WORKERS_PD, "grpc://10.0.0.1:50051", "grpc://10.0.0.2:50051", connection_mode="gRPC")
    router.routes.update(router_routes(body))
    rc, reports = run_json(router.url)
    assert rc == 1 and [r["role"] for r in reports] == ["prefill", "decode"]
    assert all(r["verdict"] == "unknown" and r["reason"].startswith("gRPC worker") for r in reports)


def test_dp_aware_ranks_are_one_server(stubs):
    router, prefill, decode = pd_fleet(stubs, prefill_pool=4096)
    body = listing(REAL_ROUTER_WORKERS_PD, prefill.url + "@0", decode.url)
    extra = copy.deepcopy(body["workers"][0])
    extra["url"] = prefill.url + "@1"
    body["workers"].insert(1, extra)
    router.routes.update(router_routes(body))
    rc, reports = run_json(router.url)
    assert rc == 0 and [r["url"] for r in reports] == [prefill.url, decode.url]
    assert reports[0]["notes"] == [
        f"the router lists it once per DP rank (2 ranks, {prefill.url}@RANK); they share this server, checked once"
    ]
    assert len(prefill.requests) == 2  # /server_info and /v1/models, once


def test_router_type_disagreeing_with_server_and_unhealthy_flag_are_noted(stubs):
    router, prefill, decode = pd_fleet(stubs, prefill_pool=4096)
    body = listing(REAL_ROUTER_WORKERS_PD, decode.url, prefill.url, is_healthy=False)  # types swapped
    router.routes.update(router_routes(body))
    rc, reports = run_json(router.url)
    assert rc == 0
    by_url = {r["url"]: r for r in reports}
    assert by_url[decode.url]["role"] == "decode" and by_url[decode.url]["router_worker_type"] == "prefill"
    assert by_url[decode.url]["notes"] == [
        "the router lists this server as a prefill worker but the server reports role 'decode'",
        "the router marks this worker unhealthy (is_healthy false)",
    ]


def test_worker_that_is_a_router_is_not_followed(stubs):
    # a router listing itself (or another router) as a worker: read as a server only, no loop
    [router] = stubs(1)
    router.routes.update(router_routes(listing(REAL_ROUTER_WORKERS_PD, router.url, router.url + "/")))
    rc, reports = run_json(router.url)
    assert rc == 1 and len(reports) == 2
    assert all(r["reason"] == "GET /server_info answered HTTP 404" for r in reports)


def test_router_answering_server_info_itself_is_still_followed(stubs):
    # a router version that answers /server_info with its own summary is not judged on it
    router, prefill, decode = pd_fleet(stubs)
    router.routes["/server_info"] = (200, json.loads(REAL_ROUTER_GET_SERVER_INFO), "application/json")
    rc, reports = run_json(router.url)
    assert rc == 2 and [r["url"] for r in reports] == [prefill.url, decode.url]


def test_router_listing_times_out(stubs):
    [router] = stubs(1)
    router.routes.update(router_routes(REAL_ROUTER_WORKERS_PD))
    router.routes["/workers"] = (200, REAL_ROUTER_WORKERS_PD, "application/json", 3.0)
    t0 = time.monotonic()
    rc, [r] = run_json(router.url, timeout_s=0.5)
    assert rc == 1 and r["reason"] == (
        "GET /server_info answered HTTP 404; as SGLang's router: GET /workers timed out after 0.5 s"
    )
    assert time.monotonic() - t0 < 2.5


def test_router_and_direct_servers_together(stubs):
    router, prefill, decode = pd_fleet(stubs)
    [direct] = stubs(1)
    direct.set(server_info(max_total_num_tokens=4096), models(2048))
    rc, reports = run_json(direct.url, router.url)
    assert rc == 2 and [r["url"] for r in reports] == [direct.url, prefill.url, decode.url]
    assert reports[0]["router"] is None
    rc, text = run_text(direct.url, router.url)
    assert text.rstrip().endswith("3 servers: 2 safe, 1 pool smaller than context, 0 cannot tell; exit 2")


def test_password_in_router_url_is_masked(stubs):
    router, _, _ = pd_fleet(stubs)
    url = router.url.replace("http://", "http://ops:s3cret@")
    rc, reports = run_json(url)
    assert rc == 2 and {r["router"] for r in reports} == {router.url.replace("http://", "http://ops:***@")}
    _, text = run_text(url)
    assert "s3cret" not in text


def test_cli_with_router_url(stubs, capsys, monkeypatch):
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN", raising=False)
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN_FILE", raising=False)
    router, prefill, decode = pd_fleet(stubs)
    assert cli.main(["preflight", "--url", router.url, "--json"]) == 2
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(x["url"], x["role"]) for x in lines] == [(prefill.url, "prefill"), (decode.url, "decode")]


def test_parse_workers_counts_types():
    body = listing(REAL_ROUTER_WORKERS_PD, "http://p:1", "http://d:2")
    got = preflight_router.parse_workers(body)
    assert [(w.url, w.worker_type, w.http, w.healthy) for w in got.workers] == [
        ("http://p:1", "prefill", True, True),
        ("http://d:2", "decode", True, True),
    ]
    assert got.counts == {"prefill": 1, "decode": 1, "regular": 0}
    assert preflight_router.missing_role(got) is None


# ---------------------------------------------------------------- the real router


class _RegularRouter:
    """``sglang_router.launch_router --worker-urls ...`` (regular mode; test-only: the demo
    harness's :class:`engines.Router` is the prefill/decode one). Its own process group."""

    def __init__(self, worker_urls: list[str], log_dir: Path) -> None:
        self.port = engines.free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"sglang-router-regular-{self.port}.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
                 "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(engines.free_port()),
                 "--prometheus-host", "127.0.0.1"],
                cwd=log_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_workers(url: str, n: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until the router at ``url`` lists ``n`` workers (it registers them in the background)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the router at {url} exited with {proc.returncode}"
        try:
            r = httpx.get(url + "/workers", timeout=2)
            last = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code == 200 and len(r.json()["workers"]) == n:
                return
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.3)
    raise AssertionError(f"the router at {url} does not list {n} workers after {timeout_s:.0f} s (last: {last})")


@pytest.mark.engine
@pytest.mark.timeout(480)
def test_real_router_in_front_of_sglang_0_5_23_pd(shared_pd, tmp_path, capsys, monkeypatch):
    """Preflight through sglang-router 0.3.2 reports the prefill (pool 256 < context 2048:
    critical) and the decode (pool 1024 < 2048: warning) workers separately, in PD mode and in
    regular mode. On the session's shared pair (tests/support/shared_pd.py)."""
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN", raising=False)
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN_FILE", raising=False)
    t0 = time.monotonic()
    pair = shared_pd.pair
    assert pair.prefill is not None and pair.decode is not None and pair.router is not None
    P, D, R = pair.prefill.url, pair.decode.url, pair.router.url
    wait_workers(R, 2, pair.router.proc)
    assert httpx.get(R + "/server_info", timeout=5).status_code == 404  # what tells a router from a server
    assert cli.main(["preflight", "--url", R, "--json"]) == 2
    reports = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert cli.main(["preflight", "--url", R]) == 2
    text = capsys.readouterr().out
    regular = _RegularRouter([P, D], tmp_path / "logs")
    try:
        wait_workers(regular.url, 2, regular.proc)
        assert cli.main(["preflight", "--url", regular.url, "--json"]) == 2
        reg_reports = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    finally:
        regular.stop()
    assert [{k: r[k] for k in ("url", "role", "verdict", "severity", "pool_tokens", "context_len", "version",
                               "router", "router_worker_type")} for r in reports] == [
        {"url": P, "role": "prefill", "verdict": "pool_smaller_than_context", "severity": "critical",
         "pool_tokens": 256, "context_len": 2048, "version": "0.5.23", "router": R, "router_worker_type": "prefill"},
        {"url": D, "role": "decode", "verdict": "pool_smaller_than_context", "severity": "warning",
         "pool_tokens": 1024, "context_len": 2048, "version": "0.5.23", "router": R, "router_worker_type": "decode"},
    ]  # fmt: skip
    assert reports[0]["reason"].startswith("KV pool holds 256 tokens but the context length is 2048 (0.12x)")
    assert text.startswith(f"{R}: SGLang router listing 2 workers (1 prefill, 1 decode)")
    assert f"{P}: POOL SMALLER THAN CONTEXT (critical)" in text and f"{D}: POOL SMALLER THAN CONTEXT (warning)" in text
    # regular mode: the same two servers, typed "regular" by the router, their own roles reported
    assert sorted(
        (r["url"], r["role"], r["verdict"], r["severity"], r["router_worker_type"]) for r in reg_reports
    ) == sorted(
        [
            (P, "prefill", "pool_smaller_than_context", "critical", "regular"),
            (D, "decode", "pool_smaller_than_context", "warning", "regular"),
        ]
    )
    print(f"engine test: {time.monotonic() - t0:.1f} s (shared pair and router start-up {pair.startup_s:.1f} s)")


@pytest.mark.engine
@pytest.mark.timeout(300)
def test_real_sglang_0_5_23_server_pool_smaller_than_context(shared_pd, capsys, monkeypatch):
    """``kvguard preflight --url`` given one real SGLang 0.5.23 server (the shared pair's
    prefill: pool 256 tokens, context 2048), text and JSON, every field it reads from it."""
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN", raising=False)
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN_FILE", raising=False)
    url = shared_pd.pair.prefill.url
    assert cli.main(["preflight", "--url", url]) == 2
    text = capsys.readouterr().out
    assert "POOL SMALLER THAN CONTEXT (critical)" in text and "SGLang version:     0.5.23" in text
    assert cli.main(["preflight", "--url", url, "--json"]) == 2
    r = json.loads(capsys.readouterr().out)
    assert {k: r[k] for k in ("url", "role", "pool_tokens", "context_len", "max_req_input_len", "page_size",
                              "verdict", "version", "context_source", "server_info_context_length",
                              "model_max_len", "severity")} == {
        "url": url, "role": "prefill", "pool_tokens": 256, "context_len": 2048, "max_req_input_len": 250,
        "page_size": 4, "verdict": "pool_smaller_than_context", "version": "0.5.23",
        "context_source": "/v1/models", "server_info_context_length": 2048, "model_max_len": 2048,
        "severity": "critical",
    }  # fmt: skip
    assert r["reason"].startswith("KV pool holds 256 tokens but the context length is 2048 (0.12x)")

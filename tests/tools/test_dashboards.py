"""The Grafana dashboards: generated JSON in sync, every query answered by a real Prometheus, push.

1. ``dashboards/generated/*.json`` is exactly what ``dashboards/src`` generates.
2. Every panel query (and every variable query) runs against a real Prometheus
   (``/usr/bin/prometheus``, Debian's, ``make apt``) that scraped a real sidecar every
   second: a uvicorn server with ``create_app`` over a ``Sidecar`` that drains real rings.
   The rings hold the 2026 incident in miniature plus steady traffic:

       prefill  pool 256 tokens < context 2048            -> pool_smaller_than_context
       decode   pages 1 2 written by acme, then initech reserves 1..4, prefill sends
                1 token                                   -> transfer_size_mismatch,
                                                             unwritten_read (acme exposed)
       unified  20 requests at 1 ms/token, then one at 1 us/token -> ttft_anomaly
       traffic  a prefill -> decode request every 0.2 s (pages 10 11), all verified

   Grafana's macros get concrete values ($__rate_interval = 10s); template variables
   get their All value, as Grafana sends them.
3. ``kvguard dashboards push`` against a stub of Grafana's ``POST /api/dashboards/db``
   that answers as Grafana does: 200, 401, 412 version-mismatch, 500; and a port where
   nothing listens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvguard.demo.engine_env import free_port
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.cli import build_parser
from kvguard.sidecar.dashboards_cli import DASHBOARDS_DIR, load_generator
from kvguard.sidecar.finding_kinds import possible_findings
from tests.support.prom_queries import PrometheusQueries

GENERATED = DASHBOARDS_DIR / "generated"
PROVISIONING = DASHBOARDS_DIR / "provisioning"
PROMETHEUS = "/usr/bin/prometheus"
SCRAPE_S = 1
# Grafana's macros, as Grafana would expand them for a 1 s scrape interval (rate windows
# of 10 samples; `offset` and `increase` need durations)
MACROS = {"__rate_interval": "10s", "__interval": "2s", "__range": "1m", "__range_s": "60", "__interval_ms": "2000"}
CLUSTER = "gpu-west"
VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(GENERATED.glob("*.json"))}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return out


def targets(dashboard: dict) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in panels(dashboard) for t in p.get("targets", [])]


def expand(expr: str, dashboard: dict) -> str:
    """Grafana's interpolation: macros get concrete values, multi-value variables their All value."""
    all_values = {v["name"]: v.get("allValue") for v in dashboard["templating"]["list"]}

    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in MACROS:
            return MACROS[name]
        assert all_values.get(name), f"{expr!r}: ${name} is neither a Grafana macro nor a variable with an All value"
        return all_values[name]

    return VARIABLE.sub(value, expr)


# ---------------------------------------------------------------------- 1. generated JSON
def test_the_committed_json_is_what_the_sources_generate():
    generator = load_generator(DASHBOARDS_DIR / "src")
    assert generator.stale(GENERATED) == [], "run `kvguard dashboards generate` and commit dashboards/generated"
    assert sorted(generator.DASHBOARDS) == sorted(dashboards())


def test_generate_check_names_stale_missing_and_extra_files(tmp_path, capsys):
    assert run_cli("dashboards", "generate", "--out", str(tmp_path)) == 0
    assert run_cli("dashboards", "generate", "--check", "--out", str(tmp_path)) == 0
    (tmp_path / "kvguard-pages.json").write_text("{}\n")
    (tmp_path / "kvguard-integrity.json").unlink()
    (tmp_path / "kvguard-fleet.json").write_text("{}\n")
    (tmp_path / "old.json").write_text("{}\n")
    capsys.readouterr()
    assert run_cli("dashboards", "generate", "--check", "--out", str(tmp_path)) == 1
    err = capsys.readouterr().err
    for name in ("kvguard-fleet.json", "kvguard-integrity.json", "kvguard-pages.json", "old.json"):
        assert f"{tmp_path / name}: not what dashboards/src generates" in err
    assert run_cli("dashboards", "generate", "--out", str(tmp_path)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kvguard-fleet.json",
        "kvguard-integrity.json",
        "kvguard-pages.json",
    ]


def test_every_panel_is_described_and_reads_the_chosen_prometheus():
    uids = set()
    for name, d in dashboards().items():
        assert d["uid"] not in uids and d["tags"] == ["kvguard"], name
        uids.add(d["uid"])
        assert [v["name"] for v in d["templating"]["list"]][:2] == ["datasource", "instance"]
        ids = [p["id"] for p in panels(d)]
        assert ids == list(range(1, len(ids) + 1)), f"{name}: panel ids"
        for p in panels(d):
            if p["type"] in ("row", "text"):
                continue
            assert p.get("description"), f"{name}: {p['title']!r} has no description"
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            ref_ids = [t["refId"] for t in p["targets"]]
            assert ref_ids == [chr(ord("A") + i) for i in range(len(ref_ids))], p["title"]


def test_no_query_groups_by_or_filters_on_a_request_or_tenant():
    for d in dashboards().values():
        for title, t in targets(d):
            assert not re.search(r"\b(rid|tenant|bootstrap_room|room|page)\b", t["expr"]), (title, t["expr"])


def test_provisioning_files_load_the_generated_dashboards_from_one_prometheus():
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "kvguard.yaml").read_text())
    assert provider["apiVersion"] == 1
    (p,) = provider["providers"]
    assert p["type"] == "file" and p["options"]["path"] == "/var/lib/grafana/dashboards/kvguard"
    assert p["allowUiUpdates"] is False  # the repository is the source of truth
    sources = yaml.safe_load((PROVISIONING / "datasources" / "kvguard-prometheus.yaml").read_text())
    (ds,) = sources["datasources"]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["url"].startswith("http")
    assert ds["jsonData"]["timeInterval"] == "30s"  # $__rate_interval follows the scrape interval


# ---------------------------------------------------------------------- 2. a real Prometheus
def slots(pages):
    return np.concatenate([np.arange(p * 4, p * 4 + 4) for p in pages])


def pd_request(prefill, decode, rid, tenant, room, pages, tokens, sent_tokens):
    for p in (prefill, decode):
        p.request_begin(rid, tenant, room, tokens, 0, False)
    decode.pages_allocated(slots(pages))
    decode.rows_assigned(rid, 0, tokens, 0, slots(pages)[:tokens])
    decode.transfer_reserved(rid, room, tokens, slots(pages)[:tokens])
    prefill.pages_allocated(slots([50]))
    prefill.transfer_sent(rid, room, 0, sent_tokens, [50], True)
    prefill.transfer_done(rid, room, "sender", "success")
    prefill.request_end(rid, "length", 1_000_000, 1_000_000, 1, "")
    prefill.pages_freed(slots([50]))
    decode.transfer_done(rid, room, "receiver", "success")
    decode.forward([rid], [tokens], [[]], [slots(pages)[:tokens]])


def incident(prefill, decode, unified):
    pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    decode.request_end("r-acme", "length", 1_000_000, 2_000_000, 1, "")
    decode.pages_freed(slots([1, 2]))
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)  # stays live: still leaking
    for i in range(20):  # 64 uncached prompt tokens in 64 ms: 1 ms per token
        unified.request_begin(f"warm-{i}", "acme", None, 64, 0, False)
        unified.request_end(f"warm-{i}", "stop", 64_000_000, 70_000_000, 4, "")
    unified.request_begin("r-fast", "initech", None, 64, 0, False)
    unified.request_end("r-fast", "stop", 64_000, 1_000_000, 4, "")  # 1 us per token: nothing was prefilled


def traffic(prefill, decode, stop: threading.Event, max_requests: int = 600):
    for i in range(max_requests):
        if stop.wait(0.2):
            return
        rid = f"t-{i}"
        pd_request(prefill, decode, rid, "globex", 1000 + i, [10, 11], 8, 8)
        decode.request_end(rid, "length", 1_000_000, 2_000_000, 1, "")
        decode.pages_freed(slots([10, 11]))


class Stack(PrometheusQueries):
    """A sidecar serving /metrics over HTTP, scraped every second by a real Prometheus."""

    def __init__(self, tmp: Path):
        import uvicorn

        from kvguard.sidecar.api import create_app
        from kvguard.sidecar.service import Sidecar

        ring_dir = str(tmp / "rings")
        os.makedirs(ring_dir)
        self.prefill, self.decode, self.unified = (Probes(RingWriter(ring_dir, 1 << 18)) for _ in range(3))
        self.prefill.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.19", "tiny")  # pool < context
        self.decode.hello("decode", 0, 4, 64, 256, 256, 256, "sglang", "0.5.19", "tiny")
        self.unified.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.19", "tiny")
        incident(self.prefill, self.decode, self.unified)
        self.sidecar = Sidecar(ring_dir, slack_ns=0, poll_interval_s=0.05, ttft_anomaly=True).start()
        self.stop_traffic = threading.Event()
        self.traffic = threading.Thread(
            target=traffic, args=(self.prefill, self.decode, self.stop_traffic), daemon=True
        )
        self.traffic.start()
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.sidecar, CollectorRegistry()), host="127.0.0.1", port=port, log_level="warning"
            )
        )
        self.server_thread = threading.Thread(target=self.server.run, daemon=True)
        self.server_thread.start()
        self.prom_url = f"http://127.0.0.1:{free_port()}"
        config = tmp / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                    # the cluster label a multi-cluster Prometheus (Thanos, Mimir, a relabeling) adds:
                    # the fleet dashboard groups by it
                    "scrape_configs": [
                        {
                            "job_name": "kvguard",
                            "static_configs": [{"targets": [self.target], "labels": {"cluster": CLUSTER}}],
                        }
                    ],
                }
            )
        )
        self.prom_log = open(tmp / "prometheus.log", "w")
        self.prometheus = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={self.prom_url.removeprefix('http://')}",
                "--log.level=warn",
            ],
            stdout=self.prom_log,
            stderr=subprocess.STDOUT,
        )

    def wait_for_scrapes(self, n: int, timeout_s: float = 60) -> None:
        """Until Prometheus holds ``n`` successful scrapes of the sidecar (and the traffic is in them)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.prometheus.poll() is None, Path(self.prom_log.name).read_text()
            try:
                got = self.query(f'sum_over_time(up{{job="kvguard", instance="{self.target}"}}[5m])')
                if got and float(got[0]["value"][1]) >= n:
                    return
            except (httpx.HTTPError, AssertionError):
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"Prometheus did not scrape {self.target} {n} times in {timeout_s} s: "
            f"{Path(self.prom_log.name).read_text()}"
        )

    def close(self) -> None:
        self.prometheus.terminate()
        self.prometheus.wait(timeout=20)
        self.prom_log.close()
        self.server.should_exit = True
        self.server_thread.join(timeout=10)
        self.stop_traffic.set()
        self.traffic.join(timeout=10)
        self.sidecar.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not os.path.exists(PROMETHEUS):
        pytest.skip(f"Prometheus is not installed at {PROMETHEUS} (`make apt` installs Debian's prometheus)")
    s = Stack(tmp_path_factory.mktemp("prometheus"))
    try:
        s.wait_for_scrapes(12)  # rate windows of 10 s hold 10 samples
        yield s
    finally:
        s.close()


def all_targets():
    return [
        pytest.param(name, title, t, id=f"{name}:{title}:{t['refId']}")
        for name, d in dashboards().items()
        for title, t in targets(d)
    ]


@pytest.mark.parametrize("name, title, target", all_targets())
def test_every_panel_query_returns_data_from_prometheus(stack, name, title, target):
    expr = expand(target["expr"], dashboards()[name])
    assert stack.query(expr), f"{title}: no data for {expr}"
    if target.get("range", True) and not target.get("instant"):
        series = stack.query_range(expr)
        assert series and all(s["values"] for s in series), f"{title}: no range data for {expr}"


def test_every_variable_query_lists_the_sidecar_and_its_engines(stack):
    values = {}
    for d in dashboards().values():
        for v in d["templating"]["list"]:
            if v["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
            assert m, v["query"]
            values[v["name"]] = stack.api(f"label/{m[2]}/values", **{"match[]": expand(m[1], d)})
    assert values == {"instance": [stack.target], "role": ["decode", "prefill", "unified"], "cluster": [CLUSTER]}


def panel_values(stack, dashboard: str, title: str, ref: str = "A") -> dict[tuple, float]:
    d = dashboards()[dashboard]
    (target,) = [t for p_title, t in targets(d) if p_title == title and t["refId"] == ref]
    result = stack.query(expand(target["expr"], d))
    return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}


def test_the_integrity_dashboard_shows_the_incident(stack):
    d = "kvguard-integrity.json"
    found = panel_values(stack, d, "Findings since sidecar start")
    raised = {
        (("kind", "pool_smaller_than_context"), ("severity", "critical")): 1.0,
        (("kind", "transfer_size_mismatch"), ("severity", "critical")): 1.0,
        (("kind", "ttft_anomaly"), ("severity", "warning")): 1.0,
        (("kind", "unwritten_read"), ("severity", "critical")): 1.0,
    }
    # every other pair this sidecar can raise shows 0: checked, nothing found (sidecar/finding_kinds.py)
    zeros = {(("kind", k), ("severity", s)): 0.0 for k, s in possible_findings(stack.sidecar.pipeline)}
    assert found == {**zeros, **raised}
    assert panel_values(stack, d, "Incidents since sidecar start") == found  # one request each, in this story
    firing = {dict(k)["kind"]: v for k, v in panel_values(stack, d, "Incidents firing, by kind").items()}
    assert firing == {
        kind: 1.0 for kind in ("pool_smaller_than_context", "transfer_size_mismatch", "ttft_anomaly", "unwritten_read")
    }  # initech is still decoding
    assert panel_values(stack, d, "Incidents firing") == {(): 4.0}
    assert panel_values(stack, d, "Ingest lag")[()] < 1
    assert panel_values(stack, d, "Critical findings") == {(): 3.0}
    assert panel_values(stack, d, "Engine rings attached") == {(): 3.0}
    assert panel_values(stack, d, "Records lost") == {(): 0.0}
    ratio = {dict(k)["role"]: v for k, v in panel_values(stack, d, "KV pool / context length, per engine").items()}
    assert ratio == {"prefill": 256 / 2048, "decode": 1.0, "unified": 1.0}
    blind = {dict(k)["role"]: v for k, v in panel_values(stack, d, "Blind reads, by engine role").items()}
    assert blind["decode"] == 0.0  # the sidecar saw every page from its allocation


def test_the_fleet_dashboard_shows_the_incidents_by_cluster_sidecar_and_engine(stack):
    """What the sidecar's own store holds, as the fleet dashboard shows it from Prometheus."""
    d = "kvguard-fleet.json"
    with stack.sidecar.lock:
        firing = stack.sidecar.pipeline.incidents.firing_by_kind()
    assert sum(firing.values()) == 4  # the story's: pool, short transfer, unwritten read, fast TTFT
    assert panel_values(stack, d, "Incidents firing") == {(): 4.0}
    assert panel_values(stack, d, "Clusters with an incident firing") == {(): 1.0}
    assert panel_values(stack, d, "Sidecars with an incident firing") == {(): 1.0}
    assert panel_values(stack, d, "Incidents firing, by cluster") == {(("cluster", CLUSTER),): 4.0}
    by_sidecar = panel_values(stack, d, "Incidents firing, by sidecar and kind")
    assert by_sidecar == {
        (("cluster", CLUSTER), ("instance", stack.target), ("kind", kind)): float(n) for kind, n in firing.items()
    }
    engines = panel_values(stack, d, "Engines behind the sidecars with incidents firing")
    assert engines == {
        (("cluster", CLUSTER), ("instance", stack.target), ("role", role)): 1.0
        for role in ("decode", "prefill", "unified")
    }
    # unwritten_read: one exposure incident, opened since the stack started (a time range of an hour: the
    # incident's series did not exist an hour ago, so its whole count is new in the range)
    dash = dashboards()[d]
    ((_, target),) = [t for t in targets(dash) if t[0] == "Exposure incidents opened in the time range"]
    (result,) = stack.query(expand(target["expr"].replace("$__range", "1h"), dash))
    assert float(result["value"][1]) == 1.0


def test_the_pages_dashboard_shows_traffic_and_transfers(stack):
    d = "kvguard-pages.json"
    xfer = {dict(k)["kind"]: v for k, v in panel_values(stack, d, "Transfer records per second, by kind").items()}
    assert sorted(xfer) == ["XFER_DONE", "XFER_RESERVE", "XFER_SEND"] and min(xfer.values()) > 0
    # every completed transfer paired: the sidecar watches the sender (prefill) itself
    by_engine = panel_values(stack, d, "Transfers completed per second, by outcome")
    assert all(v == 0 for k, v in by_engine.items() if dict(k)["role"] == "prefill")  # sends, never receives
    outcomes = {dict(k)["outcome"]: v for k, v in by_engine.items() if dict(k)["role"] == "decode"}
    assert sorted(outcomes) == ["paired", "unpaired", "unverified", "warmup"] and outcomes["paired"] > 0
    assert outcomes["unpaired"] == outcomes["unverified"] == outcomes["warmup"] == 0
    reads = {dict(k)["role"]: v for k, v in panel_values(stack, d, "Page reads checked per second, by role").items()}
    assert reads["decode"] > 0
    states = {dict(k)["state"] for k in panel_values(stack, d, "KV pages by ownership state: $role")}
    assert {"free", "owned"} <= states
    assert panel_values(stack, d, "Rings attached") == {(("instance", stack.target),): 3.0}


# ---------------------------------------------------------------------- 3. push
TOKEN = "glsa_kvguard_test_token"


class FakeGrafana(ThreadingHTTPServer):
    """Grafana's POST /api/dashboards/db: bearer auth, versions per uid, 412 on a version mismatch."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), GrafanaHandler)
        self.failing = False
        self.versions: dict[str, int] = {}
        self.seen: list[tuple[str, str, dict]] = []  # path, Authorization header, body
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class GrafanaHandler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.path, self.headers.get("Authorization", ""), body))
        if not self.path.endswith("/api/dashboards/db"):
            return self.answer(404, {"message": "Not found"})
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.answer(401, {"message": "invalid API key", "messageId": "api-key.invalid"})
        if self.server.failing:
            return self.answer(500, {"message": "Internal Server Error"})
        dash, versions = body["dashboard"], self.server.versions
        if dash["uid"] in versions and not body.get("overwrite") and dash.get("version", 0) != versions[dash["uid"]]:
            return self.answer(
                412, {"status": "version-mismatch", "message": "The dashboard has been changed by someone else"}
            )
        versions[dash["uid"]] = versions.get(dash["uid"], 0) + 1
        slug = re.sub(r"[^a-z0-9]+", "-", dash["title"].lower()).strip("-")
        self.answer(
            200,
            {
                "id": len(versions),
                "uid": dash["uid"],
                "url": f"/d/{dash['uid']}/{slug}",
                "status": "success",
                "version": versions[dash["uid"]],
                "slug": slug,
            },
        )

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def grafana():
    server = FakeGrafana()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "grafana-token"
    path.write_text(TOKEN + "\n")
    return str(path)


def run_cli(*argv: str) -> int:
    args = build_parser().parse_args(list(argv))
    return args.func(args)


def push(url: str, *extra: str) -> int:
    return run_cli("dashboards", "push", "--url", url, *extra)


def test_push_uploads_every_dashboard_with_the_token(grafana, token_file, capsys):
    assert push(grafana.url, "--token-file", token_file, "--folder-uid", "kvguard") == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"kvguard-fleet.json: {grafana.url}/d/kvguard-fleet/kvguard-incidents-across-the-fleet "
        f"(uid kvguard-fleet, version 1)",
        f"kvguard-integrity.json: {grafana.url}/d/kvguard-integrity/kvguard-kv-integrity "
        f"(uid kvguard-integrity, version 1)",
        f"kvguard-pages.json: {grafana.url}/d/kvguard-pages/kvguard-pages-transfers-ttft "
        f"(uid kvguard-pages, version 1)",
    ]
    sent = {body["dashboard"]["uid"]: (path, auth, body) for path, auth, body in grafana.seen}
    for d in dashboards().values():
        path, auth, body = sent[d["uid"]]
        assert path == "/api/dashboards/db" and auth == f"Bearer {TOKEN}"
        assert body["dashboard"] == {**d, "id": None}
        assert body["overwrite"] is False and body["folderUid"] == "kvguard"


def test_push_again_is_refused_as_a_version_mismatch_until_overwrite(grafana, token_file, capsys):
    assert push(grafana.url, "--token-file", token_file) == 0
    capsys.readouterr()
    assert push(grafana.url, "--token-file", token_file) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kvguard dashboards push: {name}: Grafana refused it (HTTP 412 version-mismatch: The dashboard "
        f"has been changed by someone else): the dashboard was changed in Grafana since (or pushed "
        f"before); the repository is the source of truth: re-run with --overwrite to replace it"
        for name in ("kvguard-fleet.json", "kvguard-integrity.json", "kvguard-pages.json")
    ]
    assert push(grafana.url, "--token-file", token_file, "--overwrite") == 0
    assert grafana.versions == {"kvguard-fleet": 2, "kvguard-integrity": 2, "kvguard-pages": 2}


def test_push_with_a_wrong_token_exits_4_after_one_request_and_never_prints_it(grafana, tmp_path, capsys):
    wrong = tmp_path / "wrong"
    wrong.write_text("glsa_not_the_token")
    assert push(grafana.url, "--token-file", str(wrong)) == 4
    captured = capsys.readouterr()
    assert captured.err == (
        f"kvguard dashboards push: kvguard-fleet.json: Grafana at {grafana.url} rejected "
        f"the credentials (HTTP 401: invalid API key): check --token-file or "
        f"$KVGUARD_GRAFANA_TOKEN\n"
    )
    assert len(grafana.seen) == 1 and "glsa_not_the_token" not in captured.err + captured.out


def test_push_with_a_password_in_the_url_never_prints_it(grafana, capsys, monkeypatch):
    monkeypatch.delenv("KVGUARD_GRAFANA_TOKEN", raising=False)
    url = grafana.url.replace("http://", "http://admin:s3cret@")
    assert push(url) == 4
    err = capsys.readouterr().err
    assert "admin:***@127.0.0.1" in err and "s3cret" not in err
    assert grafana.seen[0][1].startswith("Basic ")


def test_push_to_a_failing_grafana_exits_3(grafana, token_file, capsys):
    grafana.failing = True
    assert push(grafana.url, "--token-file", token_file) == 3
    assert capsys.readouterr().err == (
        f"kvguard dashboards push: kvguard-fleet.json: Grafana at {grafana.url} "
        f"failed (HTTP 500: Internal Server Error); try again later\n"
    )
    assert len(grafana.seen) == 1


def test_push_where_nothing_listens_exits_3(token_file, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert push(url, "--token-file", token_file, "--timeout", "2") == 3
    assert capsys.readouterr().err == (
        f"kvguard dashboards push: kvguard-fleet.json: cannot connect to Grafana "
        f"at {url}: [Errno 111] Connection refused\n"
    )


def test_push_under_a_sub_path_reaches_the_api_there(grafana, token_file):
    assert push(grafana.url + "/grafana", "--token-file", token_file) == 0
    assert {path for path, _, _ in grafana.seen} == {"/grafana/api/dashboards/db"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--url", "grafana:3000"],
            "--url: expected http(s)://HOST[:PORT][/PATH] (Grafana's root URL), got 'grafana:3000'",
        ),
        (
            ["--url", "http://g", "--token-file", "/nonexistent/token"],
            "--token-file '/nonexistent/token': No such file or directory",
        ),
        (
            ["--url", "http://g", "--dir", "/nonexistent"],
            "--dir '/nonexistent': no dashboard JSON files (run "
            "`kvguard dashboards generate`, or pass dashboards/generated "
            "of the kvguard source tree)",
        ),
    ],
)
def test_push_refuses_bad_arguments_with_exit_2_and_sends_nothing(argv, message, capsys):
    assert run_cli("dashboards", "push", *argv) == 2
    assert capsys.readouterr().err == f"kvguard dashboards push: {message}\n"


def test_push_refuses_an_empty_token_file(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert push("http://g", "--token-file", str(empty)) == 2
    assert capsys.readouterr().err == f"kvguard dashboards push: --token-file {str(empty)!r} is empty\n"


def test_an_incident_kvguard_opens_is_an_annotation_with_a_link_to_the_views(stack):
    """Every dashboard marks the incidents the sidecars open (a Prometheus annotation over
    kvguard_incidents_total) and links to the incident views at the ``kvguard_api`` URL the
    operator sets. A double free on the unified engine, after Prometheus started scraping,
    shows up in the annotation's query."""
    for d in dashboards().values():
        (ann,) = [a for a in d["annotations"]["list"] if a["name"] == "kvguard incidents"]
        assert ann["enable"] and ann["datasource"]["uid"] == "${datasource}"
        assert [link["url"] for link in d["links"]] == ["${kvguard_api}/v1/incidents/view"]
        assert "kvguard_api" in [v["name"] for v in d["templating"]["list"]]
    pages = np.arange(200, 202)
    stack.unified.pages_allocated(pages * 4)
    stack.unified.pages_freed(pages * 4)
    stack.unified.pages_freed(pages * 4)  # the second free: double_free, a new incident
    expr = expand(ann["expr"], dashboards()["kvguard-integrity.json"])
    deadline = time.monotonic() + 60
    kinds: set = set()
    while time.monotonic() < deadline and "double_free" not in kinds:
        time.sleep(SCRAPE_S)
        kinds = {s["metric"]["kind"] for s in stack.query_range(expr, seconds=120) if s["values"]}
    assert "double_free" in kinds, (expr, kinds)

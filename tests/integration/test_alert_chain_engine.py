"""The alert chain end to end, every component real (issue #6, item 6).

    SGLang 0.5.23 (CPU, kvguard plugin + the test-only fault plugin)
      -> ring -> kvguard Sidecar (in process) serving /metrics over HTTP (uvicorn)
      -> Prometheus (/usr/bin/prometheus) scraping every second, evaluating the REAL
         alerts/kvguard.rules.yaml (the generated config points at the file)
      -> Alertmanager (/usr/bin/prometheus-alertmanager), critical alerts routed to a
         ``pagerduty_configs`` entry (routing key from a file, send_resolved)
      -> a local PagerDuty Events API v2 endpoint started here (POST /v2/enqueue, 202)

Two faults are injected into the engine: a row corruption (one request reads another
tenant's page: foreign_read) and a double free. Both page. The double free is the one
followed to its resolve: ``KVGuardDoubleFree`` fires on ``kvguard_incidents_firing``,
so it resolves when the sidecar resolves the incident (no repeat for the incident
store's quiet period, 5 minutes by default). The test keeps the default while it
checks the trigger and the dashboards, then sets the quiet period to 0 ("the fault has
not recurred, and we stop waiting"): the next ingest tick resolves the incident, the
series leaves /metrics, the rule stops matching, Prometheus sends the resolved alert
and Alertmanager the resolve. Nothing in the chain is bypassed; only the wait is cut.
(The other paging rules count new findings over 5-minute windows and resolve 5
minutes after the last one: too long for CI; alerts/tests/findings.yaml covers them.)

The receiver must get, for the double free: a trigger with severity critical, the
alert name and the runbook link, and a dedup_key equal to the SHA-256 of the
aggregation group key Alertmanager logs for that group; then a resolve with the same
dedup_key. The sidecar's own PagerDuty sink (incident id as dedup_key) runs beside it
into the same receiver, under another routing key, and must trigger and resolve too,
with its delivery counters (kvguard_sink_events_total) saying so through Prometheus.

While the double-free incident is open, every Grafana panel query (dashboards/generated)
runs against this Prometheus, and every one returns data. Panels of things a unified
engine never does (KV transfers exist only between prefill and decode) show the
sidecar's zero series: /metrics exports every record kind, and every finding its
configuration can raise, at 0 from the start (sidecar/finding_kinds.py). The TTFT
detector is opt-in, so the chain's sidecar turns it on to give its panel a series;
tests/tools/test_dashboards.py feeds those panels nonzero values from synthetic rings.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvguard.demo.engines import free_port, start_engine
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.delivery import RetryPolicy
from kvguard.sidecar.sinks.pagerduty import pagerduty_sink
from tests.support.fault_plugin import FAULTS_DIR, make_rid
from tests.support.prom_queries import PrometheusQueries
from tests.tools.test_dashboards import CLUSTER, dashboards, expand, targets

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "alerts" / "kvguard.rules.yaml"

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

PROMETHEUS = "/usr/bin/prometheus"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"
VERSION = "0.5.23"
WAIT_S = 90.0
AM_KEY = "am0routing0key0for0the0e2e0test0"  # 32 letters/digits, as PagerDuty's integration keys
SIDECAR_KEY = "sidecar0routing0key0for0the0e2e0"
RUNBOOK = "https://github.com/kvguard/kvguard/blob/main/docs/runbooks/{}.md"


# --------------------------------------------------------------------------- the PagerDuty end
class EventsV2Receiver:
    """PagerDuty's Events API v2 as far as a sender can tell: POST /v2/enqueue with a
    JSON event; 202 and ``{"status": "success"}`` when it is well formed, 400 with
    ``errors`` when not (as PagerDuty answers). Every accepted event is recorded."""

    def __init__(self):
        self.events: list[dict] = []
        self.rejected: list[str] = []
        self.cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v2/enqueue":
                    return self._answer(404, {"status": "not found"})
                try:
                    event = json.loads(body)
                    errors = receiver.validate(event)
                except ValueError as exc:
                    event, errors = None, [f"invalid JSON: {exc}"]
                with receiver.cond:
                    if errors:
                        receiver.rejected.append("; ".join(errors))
                    else:
                        receiver.events.append(event)
                    receiver.cond.notify_all()
                if errors:
                    return self._answer(
                        400, {"status": "invalid event", "message": "Event object is invalid", "errors": errors}
                    )
                self._answer(202, {"status": "success", "message": "Event processed", "dedup_key": event["dedup_key"]})

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: a free one, no race
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v2/enqueue"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def validate(event: dict) -> list[str]:
        errors = []
        if not re.fullmatch(r"[A-Za-z0-9]{32}", str(event.get("routing_key", ""))):
            errors.append("routing_key: not a 32-character integration key")
        if event.get("event_action") not in ("trigger", "acknowledge", "resolve"):
            errors.append(f"event_action: {event.get('event_action')!r}")
        if event.get("event_action") != "trigger":
            if not event.get("dedup_key"):
                errors.append("dedup_key: required to acknowledge or resolve")
            return errors
        payload = event.get("payload") or {}
        if not payload.get("summary") or len(payload["summary"]) > 1024:
            errors.append("payload.summary: required, at most 1024 characters")
        if not payload.get("source"):
            errors.append("payload.source: required")
        if payload.get("severity") not in ("critical", "error", "warning", "info"):
            errors.append(f"payload.severity: {payload.get('severity')!r}")
        if len(json.dumps(event)) > 512 * 1024:
            errors.append("event larger than 512 KB")
        return errors

    def wait_for(self, what: str, pred, timeout_s: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                assert not self.rejected, f"the receiver rejected events: {self.rejected}"
                got = [e for e in self.events if pred(e)]
                if got:
                    return got[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} within {timeout_s} s; received: {self.events}")
                self.cond.wait(min(left, 0.5))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------- processes
def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args[0]} exited {proc.returncode}: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready in {timeout_s} s: {log.read_text()[-3000:]}")


def spawn(stack: ExitStack, args: list[str], log: Path) -> subprocess.Popen:
    out = stack.enter_context(open(log, "w"))
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def stop():
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    stack.callback(stop)
    return proc


def alertmanager_config(work: Path, receiver_url: str) -> Path:
    key_file = work / "pagerduty-routing-key"
    key_file.write_text(AM_KEY + "\n")
    key_file.chmod(0o600)
    config = {
        "route": {
            "receiver": "tickets",  # warnings: no receiver here (a ticket queue in production)
            "group_by": ["alertname"],
            "group_wait": "1s",
            "group_interval": "1s",
            "repeat_interval": "4h",
            "routes": [{"receiver": "pagerduty", "matchers": ['severity="critical"']}],
        },
        "receivers": [
            {"name": "tickets"},
            {
                "name": "pagerduty",
                "pagerduty_configs": [
                    {
                        "routing_key_file": str(key_file),
                        "url": receiver_url,
                        "send_resolved": True,
                        "severity": "{{ .CommonLabels.severity }}",
                        "description": "{{ .CommonLabels.alertname }}: {{ .CommonAnnotations.summary }}",
                        "links": [{"href": "{{ .CommonAnnotations.runbook_url }}", "text": "runbook"}],
                    }
                ],
            },
        ],
    }
    path = work / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def prometheus_config(work: Path, sidecar_target: str, am_target: str) -> Path:
    path = work / "prometheus.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(RULES)],  # the real rule file, not a copy
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am_target]}]}]},
                "scrape_configs": [
                    {
                        "job_name": "kvguard",
                        # the cluster label a multi-cluster Prometheus adds (the fleet dashboard's variable)
                        "static_configs": [{"targets": [sidecar_target], "labels": {"cluster": CLUSTER}}],
                    }
                ],
            }
        )
    )
    return path


def group_keys(am_log: Path, alertname: str) -> set[str]:
    """The aggregation group keys Alertmanager logged (debug level) for ``alertname``'s group."""
    keys = set()
    for m in re.finditer(r'aggrGroup="((?:[^"\\]|\\.)*)"', am_log.read_text()):
        key = m.group(1).replace('\\"', '"')
        if f'alertname="{alertname}"' in key:
            keys.add(key)
    return keys


class Chain(PrometheusQueries):
    def __init__(self, stack: ExitStack, work: Path):
        import uvicorn

        from kvguard.sidecar.api import create_app

        self.work = work
        ring_dir, self.events_dir = work / "rings", work / "fault-events"
        ring_dir.mkdir()
        self.events_dir.mkdir()
        self.receiver = EventsV2Receiver()
        stack.callback(self.receiver.close)
        # the engine starts first: it takes longest
        engine = start_engine(
            VERSION,
            work / "logs",
            max_total_tokens=1024,
            context_length=256,
            ring_dir=ring_dir,
            wait=False,
            extra_args=["--disable-overlap-schedule", "--max-running-requests", "8"],
            extra_env={
                "KVGUARD_FAULT": "double_free,row_corruption",
                "KVGUARD_FAULT_DIR": str(self.events_dir),
                "KVGUARD_ROW_SAMPLE_EVERY": "1",
            },  # the row corruption lives for one step
            extra_pythonpath=[FAULTS_DIR],
        )
        stack.callback(engine.stop)
        self.engine = engine
        self.sink = pagerduty_sink(
            SIDECAR_KEY, url=self.receiver.url, retry=RetryPolicy(initial_s=0.1, max_s=1.0, deadline_s=20.0)
        )
        # ttft_anomaly on so that the TTFT panel has its (zero) series. It cannot flag anything
        # here: it judges and learns only normally finished requests with >= 32 uncached prompt
        # tokens and gives no verdict before 20 learned ones; this test sends three requests of
        # 10-16 tokens (and the engine's warmup request, which is never judged).
        self.sidecar = Sidecar(str(ring_dir), sinks=[self.sink], ttft_anomaly=True).start()
        stack.callback(self.sidecar.stop)  # also shuts the sink down
        port = free_port()
        self.sidecar_target = f"127.0.0.1:{port}"
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(self.sidecar, CollectorRegistry()), host="127.0.0.1", port=port, log_level="warning"
            )
        )
        server_thread = threading.Thread(target=server.run, daemon=True)
        server_thread.start()

        def stop_server():
            server.should_exit = True
            server_thread.join(timeout=10)

        stack.callback(stop_server)

        self.am_url = f"http://127.0.0.1:{free_port()}"
        self.am_log = work / "alertmanager.log"
        am = spawn(
            stack,
            [
                ALERTMANAGER,
                f"--config.file={alertmanager_config(work, self.receiver.url)}",
                f"--storage.path={work / 'am-data'}",
                f"--web.listen-address={self.am_url[7:]}",
                "--cluster.listen-address=",
                "--log.level=debug",
            ],
            self.am_log,
        )
        self.prom_url = f"http://127.0.0.1:{free_port()}"
        self.prom_log = work / "prometheus.log"
        prom = spawn(
            stack,
            [
                PROMETHEUS,
                f"--config.file={prometheus_config(work, self.sidecar_target, self.am_url[7:])}",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address={self.prom_url[7:]}",
                "--rules.alert.resend-delay=1s",
                "--log.level=warn",
            ],
            self.prom_log,
        )
        wait_http(f"{self.am_url}/-/ready", am, self.am_log)
        wait_http(f"{self.prom_url}/-/ready", prom, self.prom_log)
        t0 = time.monotonic()
        engine.wait_ready()
        print(f"\nengine ready {time.monotonic() - t0:.1f} s after Prometheus and Alertmanager")

    # -- Prometheus
    def wait_query(self, what: str, expr: str, timeout_s: float = WAIT_S) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.query(expr)
            if got:
                return got
            time.sleep(0.5)
        raise AssertionError(f"{what}: {expr} empty for {timeout_s} s")

    # -- the engine's fault plugin
    def fault_events(self, fault: str, event: str) -> list[dict]:
        path = self.events_dir / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, filter(None, lines)) if e["fault"] == fault and e["event"] == event]

    def wait_fault(self, fault: str, event: str) -> dict:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert not self.fault_events("plugin", "error"), self.fault_events("plugin", "error")
            got = self.fault_events(fault, event)
            if got:
                return got[0]
            time.sleep(0.05)
        raise AssertionError(f"the fault plugin never reported {fault}/{event}")

    def generate(self, rid: str, n_prompt: int, max_new_tokens: int, tenant: str, rng: random.Random) -> None:
        body = {
            "rid": rid,
            "input_ids": [rng.randint(3, 255) for _ in range(n_prompt)],
            "routing_key": tenant,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
        r = httpx.post(self.engine.url + "/generate", json=body, timeout=120.0)
        assert r.status_code == 200, (rid, r.status_code, r.text[:500])

    def wait_incidents(self, kind: str) -> list:
        """The sidecar's incidents of ``kind``, once it has filed one (it drains the ring every 10 ms)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            with self.sidecar.lock:
                got = [i for i in self.sidecar.pipeline.incidents.incidents.values() if i.kind == kind]
            if got:
                return got
            time.sleep(0.05)
        raise AssertionError(f"the sidecar filed no {kind} incident in {WAIT_S} s")


@pytest.fixture(scope="module")
def chain(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    for binary in (PROMETHEUS, ALERTMANAGER):
        if not os.path.exists(binary):
            pytest.skip(f"{binary} is not installed (`make apt` installs Debian's prometheus, prometheus-alertmanager)")
    with ExitStack() as stack:  # every process and thread is stopped, whatever fails
        yield Chain(stack, tmp_path_factory.mktemp("alert-chain"))


def am_events(chain: Chain, alertname: str | None = None) -> list[dict]:
    return [
        e
        for e in chain.receiver.events
        if e["routing_key"] == AM_KEY and (alertname is None or alertname in json.dumps(e.get("payload", {})))
    ]


def test_a_double_free_pages_through_alertmanager_and_resolves_when_the_incident_does(chain):
    rng = random.Random(6)
    # 1. a row corruption: the reader attends over the owner's page (foreign_read, pages)
    reader, owner = make_rid("row_corruption", "reader", "e2e"), make_rid("row_corruption", "owner", "e2e")
    with ThreadPoolExecutor(2) as pool:
        for f in [
            pool.submit(chain.generate, reader, 16, 16, "initech", rng),
            pool.submit(chain.generate, owner, 16, 16, "globex", rng),
        ]:
            f.result()
    chain.wait_fault("row_corruption", "row_corrupted")
    # 2. a double free: the plugin frees a finished request's pages again
    chain.generate(make_rid("double_free", "d", "e2e"), 10, 4, "acme", rng)
    freed = chain.wait_fault("double_free", "double_freed")

    # the sidecar's own PagerDuty sink: one trigger per incident, dedup_key = incident id
    (inc,) = chain.wait_incidents("double_free")
    assert inc.state == "firing" and sorted(inc.pages) == sorted(freed["pages"])
    own = chain.receiver.wait_for(
        "the sidecar's double-free trigger",
        lambda e: e["routing_key"] == SIDECAR_KEY and e["event_action"] == "trigger" and e["dedup_key"] == inc.id,
    )
    assert own["payload"]["severity"] == "critical" and own["payload"]["class"] == "double_free"

    # Alertmanager's trigger for KVGuardDoubleFree
    trigger = chain.receiver.wait_for(
        "Alertmanager's KVGuardDoubleFree trigger",
        lambda e: (
            e["routing_key"] == AM_KEY
            and e["event_action"] == "trigger"
            and "KVGuardDoubleFree" in e["payload"]["summary"]
        ),
    )
    assert trigger["payload"]["severity"] == "critical"
    assert trigger["payload"]["summary"] == (
        "KVGuardDoubleFree: KV pages were freed while already free; the allocator may hand one page to two requests."
    )
    assert trigger["links"] == [{"href": RUNBOOK.format("KVGuardDoubleFree"), "text": "runbook"}]
    firing_details = trigger["payload"]["custom_details"]["firing"]
    assert "runbook_url = " + RUNBOOK.format("KVGuardDoubleFree") in firing_details
    assert f"instance = {chain.sidecar_target}" in firing_details and "kind = double_free" in firing_details
    # dedup_key: SHA-256 of the aggregation group key Alertmanager logged for the group
    (key,) = group_keys(chain.am_log, "KVGuardDoubleFree")
    assert key == '{}/{severity="critical"}:{alertname="KVGuardDoubleFree"}'
    assert trigger["dedup_key"] == hashlib.sha256(key.encode()).hexdigest()
    groups = httpx.get(f"{chain.am_url}/api/v2/alerts/groups", timeout=10).json()
    (group,) = [g for g in groups if g["labels"] == {"alertname": "KVGuardDoubleFree"}]
    assert group["receiver"]["name"] == "pagerduty" and len(group["alerts"]) == 1

    # the row corruption paged too, as its own group (its own dedup_key)
    foreign = chain.receiver.wait_for(
        "Alertmanager's KVGuardForeignRead trigger",
        lambda e: (
            e["routing_key"] == AM_KEY
            and e["event_action"] == "trigger"
            and "KVGuardForeignRead" in e["payload"]["summary"]
        ),
    )
    assert foreign["payload"]["severity"] == "critical" and foreign["dedup_key"] != trigger["dedup_key"]
    assert foreign["links"] == [{"href": RUNBOOK.format("KVGuardForeignRead"), "text": "runbook"}]

    # nothing else fired: exactly the two incidents, exactly their two alerts
    with chain.sidecar.lock:
        opened = sorted((i.kind, i.severity) for i in chain.sidecar.pipeline.incidents.incidents.values())
    assert opened == [("double_free", "critical"), ("foreign_read", "critical")]
    firing = {a["metric"]["alertname"] for a in chain.query('ALERTS{alertstate="firing"}')}
    assert firing == {"KVGuardDoubleFree", "KVGuardForeignRead"}

    # 3. every dashboard panel, while the incident is open
    check_every_panel_query_returns_data(chain)

    # 4. the fault does not recur: the incident resolves, and so does the page
    chain.sidecar.pipeline.incidents.quiet_resolve_ns = 0  # the next ingest tick resolves it
    resolve = chain.receiver.wait_for(
        "Alertmanager's KVGuardDoubleFree resolve",
        lambda e: (
            e["routing_key"] == AM_KEY and e["event_action"] == "resolve" and e["dedup_key"] == trigger["dedup_key"]
        ),
    )
    assert inc.state == "resolved" and inc.resolution == "no recurrence"
    assert group_keys(chain.am_log, "KVGuardDoubleFree") == {key}
    chain.receiver.wait_for(
        "the sidecar's double-free resolve",
        lambda e: e["routing_key"] == SIDECAR_KEY and e["event_action"] == "resolve" and e["dedup_key"] == inc.id,
    )
    # exactly one trigger and one resolve for the group: no duplicate pages
    double_free = [e for e in chain.receiver.events if e["dedup_key"] == trigger["dedup_key"]]
    assert [e["event_action"] for e in double_free] == ["trigger", "resolve"], double_free
    assert resolve["routing_key"] == AM_KEY
    # the foreign-read page stays open: its rule counts findings over 5 minutes
    assert not [
        e for e in chain.receiver.events if e["dedup_key"] == foreign["dedup_key"] and e["event_action"] == "resolve"
    ]

    # the sidecar's own sink: both incidents triggered and resolved, nothing failed, as
    # Prometheus sees it on /metrics
    chain.wait_query(
        "the sink's resolves on /metrics",
        'kvguard_sink_events_total{sink="pagerduty",action="resolve",result="delivered"} == 2',
    )
    assert (
        float(
            chain.query('sum(kvguard_sink_events_total{sink="pagerduty",action="trigger",result="delivered"})')[0][
                "value"
            ][1]
        )
        == 2
    )
    assert float(chain.query('sum(kvguard_sink_events_total{result!="delivered"})')[0]["value"][1]) == 0
    assert not chain.query('ALERTS{alertname="KVGuardAlertDeliveryFailing"}')

    assert chain.engine.is_running(), chain.engine.log_tail()
    assert not chain.fault_events("plugin", "error")
    assert chain.sidecar.rings.stats.records_lost == 0 and chain.sidecar.pipeline.apply_errors == 0


def check_every_panel_query_returns_data(chain: Chain) -> None:
    # the rate windows ($__rate_interval = 10s) need 10 scrapes of the engine's series
    chain.wait_query(
        "ten scrapes since the engine came up",
        f'count_over_time(kvguard_kv_pool_tokens{{instance="{chain.sidecar_target}"}}[1m]) >= 12',
    )
    empty = {}
    checked = 0
    for name, d in dashboards().items():
        for title, target in targets(d):
            expr = expand(target["expr"], d)
            instant = chain.query(expr)
            ranged = chain.query_range(expr) if target.get("range", True) and not target.get("instant") else None
            checked += 1
            if not instant or ranged is not None and not (ranged and all(s["values"] for s in ranged)):
                empty[(name, title, target["refId"])] = expr
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"])
                assert m, v["query"]
                values = chain.api(f"label/{m[2]}/values", **{"match[]": expand(m[1], d)})
                expected = {"instance": [chain.sidecar_target], "cluster": [CLUSTER]}.get(m[2], ["unified"])
                assert values == expected, (v["name"], values)
    assert checked > 30
    assert not empty, f"panel queries that returned no data: {empty}"

"""PagerDuty and Alertmanager sinks against a real local HTTP receiver with scripted answers."""

import json
import logging
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvguard.sidecar.findings import EngineRef, Finding, Party
from kvguard.sidecar.incidents import IncidentStore, incident_id, incident_key
from kvguard.sidecar.sinks.alertmanager import alertmanager_sink
from kvguard.sidecar.sinks.delivery import RetryPolicy
from kvguard.sidecar.sinks.pagerduty import load_routing_key, pagerduty_sink

KEY = "R0UT1NGKEY0123456789abcdefABCDEF"
FAST = RetryPolicy(initial_s=0.01, max_s=0.05, deadline_s=0.5)


class Receiver:
    """Records every POST; answers with the next scripted status (then 202)."""

    def __init__(self, script=()):
        self.script, self.bodies = list(script), []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.bodies.append(json.loads(body))
                status = receiver.script.pop(0) if receiver.script else 202
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


def finding(summary="s", pages=range(1, 4)):
    return Finding(
        "unwritten_read",
        "critical",
        EngineRef("decode", 0, 9),
        Party("r-x", "initech", 5),
        list(pages),
        [Party("r-a", "acme", None, [2])],
        1,
        summary,
        {"reader_prompt_tokens": 600},
    )


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def test_pagerduty_trigger_then_resolve_with_the_incident_id(receiver):
    sink = pagerduty_sink(KEY, receiver.url + "/v2/enqueue", retry=FAST)
    f = finding(summary="x" * 5000)
    store = IncidentStore()
    inc, _ = store.observe(f)
    sink.send(f)
    store.on_request_end(9, "r-x", 2)
    sink.resolve(inc)
    assert sink.force_flush()
    trigger, resolve = receiver.bodies
    assert trigger["event_action"] == "trigger" and trigger["routing_key"] == KEY
    assert trigger["dedup_key"] == inc.id == incident_id(incident_key(f))
    payload = trigger["payload"]
    assert (
        payload["severity"] == "critical" and len(payload["summary"]) == 1024 and payload["class"] == "unwritten_read"
    )
    assert payload["custom_details"]["exposed"] == [{"rid": "r-a", "tenant": "acme", "pages": [2]}]
    assert resolve == {"routing_key": KEY, "event_action": "resolve", "dedup_key": inc.id}
    sink.shutdown()


def test_huge_findings_stay_under_the_512kb_event_limit(receiver):
    sink = pagerduty_sink(KEY, receiver.url, retry=FAST)
    sink.send(finding(pages=range(1, 300_000)))
    assert sink.force_flush()
    (event,) = receiver.bodies
    assert len(json.dumps(event)) < 512 * 1024 and event["payload"]["custom_details"]["pages_truncated"] is True
    sink.shutdown()


def test_429_and_500_are_retried_400_is_not():
    r = Receiver(script=[429, 500, 202, 400])
    sink = pagerduty_sink(KEY, r.url, retry=FAST)
    sink.send(finding())
    sink.send(finding())
    assert sink.force_flush()
    assert len(r.bodies) == 4  # 3 tries for the first, 1 for the second
    assert sink.counts["delivered"] == 1 and sink.counts["retries"] == 2 and sink.counts["failed_permanent"] == 1
    sink.shutdown()
    r.close()


def test_a_refused_connection_is_retried_until_the_deadline_and_never_blocks(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    sink = pagerduty_sink(KEY, f"http://127.0.0.1:{port}", retry=FAST)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        sink.send(finding())
        assert time.monotonic() - t0 < 0.05  # enqueue only
        assert sink.force_flush(5)
    assert sink.counts["failed_retries"] == 1 and sink.counts["retries"] >= 2
    assert KEY not in caplog.text
    sink.shutdown()


def test_a_full_queue_drops_and_counts():
    r = Receiver()
    sink = pagerduty_sink(KEY, r.url, retry=FAST, max_queue=1)
    sink._stop.set()  # worker exits once idle; nothing drains now
    sink._thread.join(1)
    sink.send(finding())
    sink.send(finding())
    assert sink.counts["dropped_queue_full"] == 1
    r.close()


def test_routing_key_errors_name_the_setting_not_the_value(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGUARD_PAGERDUTY_ROUTING_KEY", "short-secret")
    with pytest.raises(ValueError, match=r"\$KVGUARD_PAGERDUTY_ROUTING_KEY: not a PagerDuty integration key") as e:
        load_routing_key()
    assert "short-secret" not in str(e.value)
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    assert load_routing_key(str(f)) == KEY
    with pytest.raises(ValueError, match="no such file|No such file"):
        load_routing_key(str(tmp_path / "missing"))


def test_alertmanager_gets_a_firing_then_resolved_alert(receiver):
    sink = alertmanager_sink(receiver.url, retry=FAST)
    f = finding()
    store = IncidentStore()
    inc, _ = store.observe(f)
    sink.send(f)
    store.on_request_end(9, "r-x", 2)
    sink.resolve(inc)
    assert sink.force_flush()
    (firing,), (resolved,) = receiver.bodies
    assert firing["labels"]["alertname"] == "KVGuardUnwrittenRead" and firing["labels"]["incident_id"] == inc.id
    assert firing["annotations"]["exposed_tenants"] == "acme" and "startsAt" in firing
    assert resolved["labels"] == firing["labels"] and "endsAt" in resolved
    sink.shutdown()


def test_the_sidecar_refuses_to_start_with_a_bad_routing_key(monkeypatch, capsys):
    from kvguard.sidecar.cli import main

    monkeypatch.setenv("KVGUARD_PAGERDUTY_ROUTING_KEY", "not-a-key")
    assert main(["sidecar", "--pagerduty", "--ring-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "$KVGUARD_PAGERDUTY_ROUTING_KEY: not a PagerDuty integration key" in err and "not-a-key" not in err


# ---------------------------------------------------------------------------- delivery metrics
def sink_samples(sink) -> dict[tuple, float]:
    """The sink's series as a real sidecar exports them on /metrics: (name, labels...) -> value."""
    from fastapi.testclient import TestClient
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families

    from kvguard.sidecar.api import create_app
    from kvguard.sidecar.service import Sidecar

    with tempfile.TemporaryDirectory() as ring_dir:
        sidecar = Sidecar(ring_dir, sinks=[sink])
        text = TestClient(create_app(sidecar, CollectorRegistry())).get("/metrics").text
        sidecar.rings.close()  # not started; the sink is shut down by the test
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvguard_sink_"):
                out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def events(samples, sink="pagerduty") -> dict[tuple[str, str], float]:
    return {
        (dict(k[1:])["action"], dict(k[1:])["result"]): v
        for k, v in samples.items()
        if k[0] == "kvguard_sink_events_total" and dict(k[1:])["sink"] == sink
    }


def gauge(samples, name, sink="pagerduty") -> float:
    return samples[(name, ("sink", sink))]


def test_delivery_results_are_exported_per_action_and_result():
    # trigger: 429, 500, then accepted; resolve: 400 (not retried)
    r = Receiver(script=[429, 500, 202, 400])
    sink = pagerduty_sink(KEY, r.url, retry=FAST)
    assert events(sink_samples(sink)) == {
        (a, res): 0.0 for a in ("trigger", "resolve") for res in ("delivered", "rejected", "gave_up", "dropped")
    }
    f = finding()
    store = IncidentStore()
    inc, _ = store.observe(f)
    sink.send(f)
    sink.resolve(inc)
    assert sink.force_flush()
    samples = sink_samples(sink)
    assert {k: v for k, v in events(samples).items() if v} == {
        ("trigger", "delivered"): 1.0,
        ("resolve", "rejected"): 1.0,
    }
    assert samples[("kvguard_sink_retries_total", ("sink", "pagerduty"))] == 2.0
    assert len(r.bodies) == 4  # 3 tries for the trigger, 1 for the resolve
    assert gauge(samples, "kvguard_sink_queue_depth") == 0.0
    assert gauge(samples, "kvguard_sink_queue_capacity") == 1000.0
    assert gauge(samples, "kvguard_sink_last_success_timestamp_seconds") > 1.7e9
    sink.shutdown()
    r.close()


def test_a_receiver_that_times_out_is_retried_then_given_up(caplog):
    release = threading.Event()

    class Hanging(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            release.wait(10)  # longer than the client's timeout

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hanging)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sink = pagerduty_sink(
        KEY,
        f"http://127.0.0.1:{server.server_address[1]}",
        timeout_s=0.1,
        retry=RetryPolicy(initial_s=0.01, max_s=0.02, deadline_s=0.05),
    )
    with caplog.at_level(logging.WARNING):
        sink.send(finding())
        assert sink.force_flush(10)
    samples = sink_samples(sink)
    assert {k: v for k, v in events(samples).items() if v} == {("trigger", "gave_up"): 1.0}
    assert samples[("kvguard_sink_retries_total", ("sink", "pagerduty"))] >= 1
    assert gauge(samples, "kvguard_sink_last_success_timestamp_seconds") == 0.0
    assert "pagerduty: trigger not delivered after retries: ReadTimeout" in caplog.text and KEY not in caplog.text
    release.set()
    sink.shutdown()
    server.shutdown()


def test_a_refused_connection_and_a_full_queue_are_exported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    refused = alertmanager_sink(f"http://127.0.0.1:{port}", retry=FAST)
    refused.send(finding())
    assert refused.force_flush(5)
    assert {k: v for k, v in events(sink_samples(refused), "alertmanager").items() if v} == {
        ("trigger", "gave_up"): 1.0
    }
    refused.shutdown()

    full = pagerduty_sink(KEY, f"http://127.0.0.1:{port}", retry=FAST, max_queue=1)
    full._stop.set()  # worker exits once idle; nothing drains now
    full._thread.join(1)
    full.send(finding())
    full.resolve(IncidentStore().observe(finding())[0])
    samples = sink_samples(full)
    assert {k: v for k, v in events(samples).items() if v} == {("resolve", "dropped"): 1.0}
    assert gauge(samples, "kvguard_sink_queue_depth") == 1.0


def test_a_hanging_receiver_never_holds_up_detection():
    """While the receiver holds the sink's worker, the sidecar keeps ingesting and the
    scrape shows the backlog; once it answers, everything is delivered."""
    from kvguard.engine_hooks.probes import Probes
    from kvguard.engine_hooks.ring import RingWriter
    from kvguard.sidecar.service import Sidecar

    release, arrived = threading.Event(), []

    class Held(BaseHTTPRequestHandler):
        def do_POST(self):
            arrived.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            release.wait(30)
            self.send_response(202)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sink = pagerduty_sink(KEY, f"http://127.0.0.1:{server.server_address[1]}", timeout_s=60, retry=FAST)
    with tempfile.TemporaryDirectory() as ring_dir:
        p = Probes(RingWriter(ring_dir, 1 << 16))
        p.hello("unified", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.23", "tiny")  # pool < context: a finding
        sidecar = Sidecar(ring_dir, slack_ns=0, sinks=[sink])
        sidecar.run_once(flush=True)
        sink.send(finding())  # a second event queues behind the held one
        p.request_begin("r-1", "acme", None, 8, 0, False)
        sidecar.run_once(flush=True)  # ingest goes on while the sink's worker is stuck
        assert sidecar.pipeline.records_by_kind["REQ_BEGIN"] == 1
        assert sidecar.pipeline.findings_by_kind[("pool_smaller_than_context", "warning")] == 1
        deadline = time.monotonic() + 10
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.01)
        samples = sink_samples(sink)
        assert gauge(samples, "kvguard_sink_queue_depth") == 2.0
        assert not any(events(samples).values())
        release.set()
        assert sink.force_flush(10)
        samples = sink_samples(sink)
        assert events(samples)[("trigger", "delivered")] == 2.0 and gauge(samples, "kvguard_sink_queue_depth") == 0
        sidecar.stop()
    server.shutdown()

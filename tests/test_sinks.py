"""PagerDuty and Alertmanager sinks against a real local HTTP receiver with scripted answers."""

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sidecar.findings import EngineRef, Finding, Party
from sidecar.incidents import IncidentStore, incident_id, incident_key
from sidecar.sinks.alertmanager import alertmanager_sink
from sidecar.sinks.delivery import RetryPolicy
from sidecar.sinks.pagerduty import load_routing_key, pagerduty_sink

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
    return Finding("unwritten_read", "critical", EngineRef("decode", 0, 9), Party("r-x", "initech", 5), list(pages),
                   [Party("r-a", "acme", None, [2])], 1, summary, {"reader_prompt_tokens": 600})


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
    assert payload["severity"] == "critical" and len(payload["summary"]) == 1024 and payload["class"] == "unwritten_read"
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
    from sidecar.cli import main

    monkeypatch.setenv("KVGUARD_PAGERDUTY_ROUTING_KEY", "not-a-key")
    assert main(["sidecar", "--pagerduty", "--ring-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "$KVGUARD_PAGERDUTY_ROUTING_KEY: not a PagerDuty integration key" in err and "not-a-key" not in err

"""Findings as OpenTelemetry log records (sidecar/finding_logs.py), received over real OTLP/HTTP.

A stub collector (an HTTP server in the test) decodes each ExportLogsServiceRequest with
opentelemetry-proto, as a collector's OTLP/HTTP receiver would. A real sidecar drains real
rings with the sink configured only by OTEL_* variables: the incident's findings arrive as
one record each, with the finding's JSON as attributes and the trace/span ids of the span
kvguard put the finding on; a clean run sends nothing.
"""

from __future__ import annotations

import json
import threading

import pytest
from opentelemetry.sdk._logs.export import LogRecordExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar import finding_logs
from kvguard.sidecar.finding_logs import FindingLogSink, flatten, from_env
from kvguard.sidecar.findings import EngineRef, Finding, Party
from kvguard.sidecar.incidents import incident_id, incident_key
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from kvguard.sidecar.tracing import TraceRecorder
from tests.support.otlp_collector import Collector as OtlpCollector
from tests.support.pd_records import finish, pd_request

# every OTEL_* variable of the environment the tests run in is cleared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("clean_otel_env")


class Collector(OtlpCollector):
    """The OTLP/HTTP logs receiver (tests/support/otlp_collector.py), with the records it got."""

    def __init__(self, status: int = 200):
        super().__init__("logs", status)

    def records(self) -> list:
        return [
            (rl.resource, record)
            for _path, body in self.requests
            for rl in body.resource_logs
            for sl in rl.scope_logs
            for record in sl.log_records
        ]


def any_value(v):
    """An OTLP AnyValue as Python."""
    which = v.WhichOneof("value")
    if which == "array_value":
        return [any_value(x) for x in v.array_value.values]
    return getattr(v, which)


def attributes(record) -> dict:
    return {a.key: any_value(a.value) for a in record.attributes}


def run_sidecar(ring_dir, incident: bool, tracer=None, finding_log_sink=None):
    """acme's request; with ``incident``, initech's short transfer read over acme's pages."""
    sink = MemorySink()
    sidecar = Sidecar(str(ring_dir), sinks=[sink], slack_ns=0, tracer=tracer, finding_logs=finding_log_sink)
    prefill = Probes(RingWriter(str(ring_dir), 1 << 16))
    decode = Probes(RingWriter(str(ring_dir), 1 << 16))
    # pools as large as the context: a clean run has nothing to say
    prefill.hello("prefill", 0, 4, 512, 2048, 2048, 2048, "sglang", "0.5.23", "tiny")
    decode.hello("decode", 0, 4, 512, 2048, 2048, 2048, "sglang", "0.5.23", "tiny")
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    if incident:
        pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)
    sidecar.run_once(flush=True)
    sidecar.stop()  # shuts the sinks down: the batch processor exports what it holds
    return sink.findings


def test_each_finding_is_one_log_record_with_its_json_as_attributes_and_its_spans_ids(tmp_path, monkeypatch):
    collector = Collector()
    spans = InMemorySpanExporter()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "kvguard-gpu-node-7")
        tracer = TraceRecorder(spans, batch=False)
        sink = from_env(tracer=tracer)
        findings = run_sidecar(tmp_path, incident=True, tracer=tracer, finding_log_sink=sink)
    finally:
        collector.close()
    assert sorted(f.kind for f in findings) == ["transfer_size_mismatch", "unwritten_read"]
    assert {path for path, _ in collector.requests} == {"/v1/logs"}
    records = collector.records()
    assert len(records) == len(findings)  # exactly one each
    resource, record = next((r, rec) for r, rec in records if attributes(rec)["kind"] == "unwritten_read")
    (read,) = [f for f in findings if f.kind == "unwritten_read"]
    assert {a.key: a.value.string_value for a in resource.attributes}["service.name"] == "kvguard-gpu-node-7"
    # the attributes: the finding's JSON line, flattened, and its incident
    attrs = attributes(record)
    want = json.loads(read.to_json())
    assert attrs["kind"] == "unwritten_read" and attrs["severity"] == "critical"
    assert (
        attrs["engine.role"] == "decode" and attrs["reader.rid"] == "r-initech" and attrs["reader.tenant"] == "initech"
    )
    assert attrs["reader.bootstrap_room"] == 13 and attrs["pages"] == want["pages"]
    assert attrs["exposed.rid"] == ["r-acme"] and attrs["exposed.tenant"] == ["acme"]
    assert json.loads(attrs["exposed.pages"]) == [p["pages"] for p in want["exposed"]]
    assert attrs["first_seen_ns"] == want["first_seen_ns"] and attrs["summary"] == want["summary"]
    assert {k: v for k, v in attrs.items() if k.startswith("evidence.")} == flatten({"evidence": want["evidence"]})
    assert attrs["kvguard.incident.id"] == incident_id(incident_key(read))
    assert record.body.string_value == read.summary and record.event_name == "kvguard.finding"
    assert record.severity_number == 21 and record.severity_text == "CRITICAL"  # FATAL
    # the trace context: the reader's request span, which carries the finding as an event
    (span,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == "decode request" and s.attributes.get("gen_ai.response.id") == "r-initech"
    ]
    assert [e.attributes["kvguard.finding.kind"] for e in span.events][-1] == "unwritten_read"
    assert int.from_bytes(record.trace_id, "big") == span.context.trace_id
    assert int.from_bytes(record.span_id, "big") == span.context.span_id
    assert sink.delivery_stats().events[("trigger", "delivered")] == 2


def test_a_clean_run_sends_no_log_record(tmp_path, monkeypatch):
    collector = Collector()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", collector.url + "/v1/logs")
        sink = from_env()
        assert sink is not None
        findings = run_sidecar(tmp_path, incident=False, finding_log_sink=sink)
    finally:
        collector.close()
    assert findings == [] and collector.requests == []
    assert sink.counts["emitted"] == 0


def finding(rid="r-1", severity="warning") -> Finding:
    return Finding(
        "ttft_anomaly", severity, EngineRef("unified", 0, 7), Party(rid, "acme", None), [], [], 1, "fast", {}
    )


def test_a_collector_that_fails_is_counted_and_survived(tmp_path, monkeypatch):
    collector = Collector(status=400)  # a permanent error: the exporter does not retry it
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        sink = from_env()
        for i in range(3):
            sink.send(finding(f"r-{i}"))  # never raises on the ingest thread
        sink.shutdown()
    finally:
        collector.close()
    stats = sink.delivery_stats()
    assert stats.events[("trigger", "gave_up")] == 3 and stats.events[("trigger", "delivered")] == 0
    assert stats.queue_depth == 0 and sink.counts["failed"] == 3


class Blocked:
    """An exporter stuck in its first export (a collector that does not answer)."""

    def __init__(self):
        self.release = threading.Event()
        self.exported: list = []

    def export(self, batch):
        self.release.wait()
        self.exported += batch
        return LogRecordExportResult.SUCCESS

    def shutdown(self):
        self.release.set()

    def force_flush(self, timeout_millis=30000):
        return True


def test_a_full_queue_drops_and_counts_instead_of_waiting():
    exporter = Blocked()
    sink = FindingLogSink(exporter, max_queue=2)
    for i in range(5):
        sink.send(finding(f"r-{i}"))  # returns at once: the exporter is stuck
    assert sink.counts["emitted"] == 2 and sink.counts["dropped"] == 3
    assert sink.delivery_stats().events[("trigger", "dropped")] == 3
    exporter.release.set()
    sink.shutdown()
    assert len(exporter.exported) == 2 and sink.queue_depth() == 0


def test_flatten_keeps_otlp_types_and_says_the_rest_as_json():
    got = flatten(
        {
            "a": {"b": 1, "c": None},
            "room": 1 << 64,
            "mixed": [1, "x"],
            "nested": [[1], [2]],
            "parties": [{"rid": "r", "n": 1}, {"rid": "s", "n": 2}],
            "flag": True,
            "empty": [],
        }
    )
    assert got == {
        "a.b": 1,
        "room": str(1 << 64),
        "mixed": '[1, "x"]',
        "nested": "[[1], [2]]",
        "parties.rid": ["r", "s"],
        "parties.n": [1, 2],
        "flag": True,
        "empty": [],
    }


def test_off_by_default_and_bad_settings_are_refused_naming_the_variable():
    assert from_env({}) is None
    assert from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_LOGS_EXPORTER": "none"}) is None
    assert from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}) is None
    for env, message in (
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT='c:4318'"),
        (
            {"OTEL_LOGS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL",
        ),
        ({"OTEL_LOGS_EXPORTER": "kafka"}, "OTEL_LOGS_EXPORTER='kafka'"),
        ({"OTEL_LOGS_EXPORTER": "console", "OTEL_BLRP_MAX_QUEUE_SIZE": "lots"}, "OTEL_BLRP_MAX_QUEUE_SIZE='lots'"),
    ):
        with pytest.raises(ValueError, match=message):
            from_env(env)
    assert finding_logs.SEVERITY["warning"][1] == "WARNING"

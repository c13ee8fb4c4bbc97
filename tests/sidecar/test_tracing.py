"""Request spans and finding events (sidecar/tracing.py), read back through the SDK's exporters.

Most tests drive ``TraceRecorder`` directly, as the pipeline does, and read the spans
from an ``InMemorySpanExporter`` (synchronous processor). One exports over real OTLP/HTTP
to a stub collector configured only by OTEL_* variables; one runs the incident through
a real Sidecar once pipeline.py calls the recorder (docs/tracing.md, "Wiring").
"""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import xxhash
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import error_attributes, gen_ai_attributes
from opentelemetry.trace import StatusCode

from kvguard.sidecar import tracing
from kvguard.sidecar.findings import EngineRef, Finding, Party
from kvguard.sidecar.incidents import incident_id, incident_key
from kvguard.sidecar.tracing import TraceRecorder, from_env
from kvguard.sidecar.tracker import RequestInfo
from tests.support.otlp_collector import Collector

DECODE = EngineRef("decode", 0, 4242)
PREFILL = EngineRef("prefill", 0, 4141)
# every OTEL_* variable of the environment the tests run in is cleared (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("clean_otel_env")


@pytest.fixture
def spans():
    return InMemorySpanExporter()


@pytest.fixture
def rec(spans):
    recorder = TraceRecorder(spans, batch=False)
    yield recorder
    recorder.shutdown()


def request(rid="r-initech", tenant="initech", room=13, begin_ns=1_000_000_000, prompt=600, cached=0):
    return RequestInfo(xxhash.xxh3_64_intdigest(rid.encode()), rid, tenant, room, False, prompt, cached, begin_ns)


def ended(info: RequestInfo, end_ns: int, finish="length", ttft_ns=2_000_000) -> RequestInfo:
    info.end_ns, info.finish, info.ttft_ns = end_ns, finish, ttft_ns
    return info


def unwritten_read(engine=DECODE, rid="r-initech", at_ns=1_500_000_000) -> Finding:
    return Finding(
        "unwritten_read",
        "critical",
        engine,
        Party(rid, "initech", 13),
        [2, 3, 4],
        [Party("r-acme", "acme", None, [2]), Party("r-globex", "globex", None, [3, 4])],
        at_ns,
        "decode rank 0: request r-initech read 3 pages not written for it",
        {"pages_read": 4},
    )


def by_name(spans: InMemorySpanExporter) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


# ---------------------------------------------------------------------- request spans
def test_a_request_is_one_span_from_begin_to_end_with_genai_attributes(rec, spans):
    info = request(prompt=600, cached=64)
    rec.on_request_begin(DECODE, info)
    assert spans.get_finished_spans() == ()  # open until REQ_END
    rec.on_request_end(DECODE, ended(info, 1_250_000_000), pages=150, output_tokens=7)
    (span,) = spans.get_finished_spans()
    assert span.name == "decode request" and span.parent is None
    assert span.end_time - span.start_time == 250_000_000  # engine clock differences are kept exactly
    assert dict(span.attributes) == {
        "kvguard.engine.role": "decode",
        "kvguard.engine.rank": 0,
        "kvguard.engine.pid": 4242,
        "gen_ai.response.id": "r-initech",
        "kvguard.tenant": "initech",
        "kvguard.transfer.room": 13,
        "gen_ai.usage.input_tokens": 600,
        "gen_ai.usage.cache_read.input_tokens": 64,
        "gen_ai.usage.output_tokens": 7,
        "gen_ai.response.finish_reasons": ("length",),
        "kvguard.request.ttft_s": 0.002,
        "kvguard.request.pages": 150,
        "kvguard.request.end_seen": True,
    }
    assert span.status.status_code == StatusCode.UNSET
    assert span.resource.attributes["service.name"] == "kvguard-sidecar"
    assert span.instrumentation_scope.name == "kvguard.sidecar"


def test_span_times_are_the_engine_monotonic_times_on_the_wall_clock(rec, spans):
    import time

    now_mono, now_wall = time.monotonic_ns(), time.time_ns()
    info = request(begin_ns=now_mono - 2_000_000_000)
    rec.on_request_begin(DECODE, info)
    rec.on_request_end(DECODE, ended(info, now_mono))
    (span,) = spans.get_finished_spans()
    assert abs(span.end_time - now_wall) < 50_000_000 and span.end_time - span.start_time == 2_000_000_000


def test_prefill_and_decode_spans_of_one_request_share_the_trace_derived_from_the_room(rec, spans):
    # through SGLang's router a client that sends no rid gets a different rid on each engine:
    # the room is what both ends share
    rec.on_request_begin(PREFILL, request("r-prefill-side"))
    rec.on_request_end(PREFILL, ended(request("r-prefill-side"), 1_100_000_000))
    rec.on_request_begin(DECODE, request())
    rec.on_request_end(DECODE, ended(request(), 1_100_000_000))
    rec.on_request_begin(DECODE, request("r-other", room=14))
    rec.on_request_end(DECODE, ended(request("r-other", room=14), 1_100_000_000))
    rec.on_request_begin(DECODE, request("r-unified", room=None))
    rec.on_request_end(DECODE, ended(request("r-unified", room=None), 1_100_000_000))
    prefill, decode, other, unified = spans.get_finished_spans()
    assert (prefill.name, decode.name) == ("prefill request", "decode request")
    assert prefill.context.trace_id == decode.context.trace_id == xxhash.xxh3_128_intdigest(b"room:13")
    assert other.context.trace_id == xxhash.xxh3_128_intdigest(b"room:14")
    assert unified.context.trace_id == xxhash.xxh3_128_intdigest(b"r-unified")  # no room: the rid's
    assert prefill.context.span_id != decode.context.span_id and prefill.parent is decode.parent is None


def test_an_end_without_a_begin_still_makes_a_span_marked_as_such(rec, spans):
    info = ended(request(begin_ns=0), 1_300_000_000)  # began before the sidecar attached
    rec.on_request_end(DECODE, info)
    (span,) = spans.get_finished_spans()
    assert span.attributes["kvguard.request.begin_seen"] is False and span.start_time == span.end_time


def test_a_request_begun_before_its_engines_hello_keeps_its_span_after_it(rec, spans):
    info = request()
    rec.on_request_begin(tracing.UNKNOWN_ENGINE, info)
    rec.on_finding(unwritten_read())  # by now the engine is known as decode rank 0
    rec.on_request_end(DECODE, ended(info, 1_600_000_000))
    (span,) = spans.get_finished_spans()
    assert span.name == "unknown request" and [e.name for e in span.events] == ["kvguard.finding"]
    assert span.attributes["kvguard.request.end_seen"] is True


def test_rejected_and_warmup_requests_say_so(rec, spans):
    info = request()
    info.warmup, info.rejected = True, "prefill: input too long"
    rec.on_request_begin(PREFILL, info)
    rec.on_request_end(PREFILL, ended(info, 1_100_000_000, finish="reject", ttft_ns=0))
    (span,) = spans.get_finished_spans()
    assert span.attributes["kvguard.request.warmup"] is True
    assert span.attributes["kvguard.request.rejected"] == "prefill: input too long"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("reject",)
    assert "kvguard.request.ttft_s" not in span.attributes


# ---------------------------------------------------------------------- findings
def test_a_critical_finding_is_an_event_on_the_readers_span_and_marks_it_an_error(rec, spans):
    info = request()
    rec.on_request_begin(DECODE, info)
    finding = unwritten_read()
    rec.on_finding(finding)
    rec.on_request_end(DECODE, ended(info, 2_000_000_000))
    (span,) = spans.get_finished_spans()
    (event,) = span.events
    assert event.name == "kvguard.finding" and event.timestamp - span.start_time == 500_000_000
    assert dict(event.attributes) == {
        "kvguard.finding.kind": "unwritten_read",
        "kvguard.finding.severity": "critical",
        "kvguard.finding.summary": "decode rank 0: request r-initech read 3 pages not written for it",
        "kvguard.finding.pages": 3,
        "kvguard.finding.exposed_tenants": ("acme", "globex"),
        "kvguard.finding.exposed_requests": ("r-acme", "r-globex"),
        "kvguard.incident.id": incident_id(incident_key(finding)),
    }
    assert span.status.status_code == StatusCode.ERROR and span.status.description == "kvguard unwritten_read"
    assert span.attributes["error.type"] == "unwritten_read"
    assert rec.counts["finding_events"] == 1 and rec.counts["finding_spans"] == 0


def test_a_warning_finding_is_an_event_that_leaves_the_status_alone(rec, spans):
    info = request()
    rec.on_request_begin(DECODE, info)
    rec.on_finding(
        Finding(
            "ttft_anomaly", "warning", DECODE, Party("r-initech", "initech", 13), [], [], 1_200_000_000, "too fast", {}
        )
    )
    rec.on_request_end(DECODE, ended(info, 1_300_000_000))
    (span,) = spans.get_finished_spans()
    assert [e.attributes["kvguard.finding.kind"] for e in span.events] == ["ttft_anomaly"]
    assert span.status.status_code == StatusCode.UNSET and "error.type" not in span.attributes


def test_a_finding_for_a_request_whose_span_is_closed_gets_a_span_in_that_requests_trace(rec, spans):
    rec.on_finding(unwritten_read())  # the request began before the sidecar attached
    (span,) = spans.get_finished_spans()
    assert span.name == "kvguard.finding" and span.start_time == span.end_time
    assert span.context.trace_id == xxhash.xxh3_128_intdigest(b"room:13")  # the reader's room, as its span's
    assert span.attributes["gen_ai.response.id"] == "r-initech" and span.attributes["kvguard.tenant"] == "initech"
    assert span.status.status_code == StatusCode.ERROR and span.events[0].attributes["kvguard.finding.pages"] == 3
    assert rec.counts["finding_spans"] == 1


def test_a_finding_without_a_reader_is_a_span_of_its_own(rec, spans):
    engine = EngineRef("prefill", 0, 4141)
    rec.on_finding(
        Finding(
            "pool_smaller_than_context",
            "critical",
            engine,
            None,
            [],
            [],
            1_000_000_000,
            "prefill pool 681280 < context 1048576",
            {},
        )
    )
    rec.on_finding(Finding("events_lost", "warning", engine, None, [], [], 1_000_000_000, "lost", {}))
    pool, lost = spans.get_finished_spans()
    assert pool.name == lost.name == "kvguard.finding" and pool.context.trace_id != lost.context.trace_id
    assert dict(pool.attributes) == {
        "kvguard.engine.role": "prefill",
        "kvguard.engine.rank": 0,
        "kvguard.engine.pid": 4141,
        "error.type": "pool_smaller_than_context",
    }
    assert lost.status.status_code == StatusCode.UNSET


def test_the_recorder_is_a_sink(rec, spans):
    rec.send(unwritten_read())
    rec.resolve(object())
    assert rec.force_flush() is True and len(spans.get_finished_spans()) == 1


# ---------------------------------------------------------------------- bounds and failures
def test_open_spans_are_bounded_the_oldest_is_ended_as_incomplete(spans):
    rec = TraceRecorder(spans, batch=False, max_open=2)
    for i in range(3):
        rec.on_request_begin(DECODE, request(f"r{i}", begin_ns=1_000_000_000 + i))
    (evicted,) = spans.get_finished_spans()
    assert evicted.attributes["gen_ai.response.id"] == "r0" and evicted.attributes["kvguard.request.end_seen"] is False
    assert rec.counts["evicted"] == 1
    rec.shutdown()  # ends the rest, also as incomplete
    assert [s.attributes["kvguard.request.end_seen"] for s in spans.get_finished_spans()] == [False] * 3


def test_an_engine_that_exits_ends_its_open_spans(rec, spans):
    rec.on_request_begin(DECODE, request("r1"))
    rec.on_request_begin(PREFILL, request("r1"))
    rec.on_engine_gone(DECODE, 1_400_000_000)
    (span,) = spans.get_finished_spans()
    assert span.name == "decode request" and span.attributes["kvguard.request.end_seen"] is False


def test_a_retried_rid_ends_the_span_that_never_ended(rec, spans):
    rec.on_request_begin(DECODE, request())
    rec.on_request_begin(DECODE, request(begin_ns=1_100_000_000))
    (stale,) = spans.get_finished_spans()
    assert stale.attributes["kvguard.request.end_seen"] is False


def test_the_recorder_never_raises_and_logs_a_failure_once(rec, spans, caplog):
    caplog.set_level(logging.ERROR, "kvguard.tracing")
    rec.on_request_begin(DECODE, None)
    rec.on_request_begin(DECODE, None)
    rec.on_request_end(DECODE, None)
    rec.on_finding(None)
    assert rec.counts["errors"] == 4
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and messages[0].startswith("tracing: on_request_begin failed (AttributeError")


def test_max_open_must_be_positive(spans):
    with pytest.raises(ValueError, match="max_open must be >= 1, got 0"):
        TraceRecorder(spans, max_open=0)


def test_attribute_names_are_the_semantic_conventions():
    assert tracing.GEN_AI_RESPONSE_ID == gen_ai_attributes.GEN_AI_RESPONSE_ID
    assert tracing.GEN_AI_USAGE_INPUT_TOKENS == gen_ai_attributes.GEN_AI_USAGE_INPUT_TOKENS
    assert tracing.GEN_AI_USAGE_OUTPUT_TOKENS == gen_ai_attributes.GEN_AI_USAGE_OUTPUT_TOKENS
    assert tracing.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS == gen_ai_attributes.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS
    assert tracing.GEN_AI_RESPONSE_FINISH_REASONS == gen_ai_attributes.GEN_AI_RESPONSE_FINISH_REASONS
    assert tracing.ERROR_TYPE == error_attributes.ERROR_TYPE


# ---------------------------------------------------------------------- configuration
def test_tracing_is_off_without_an_exporter_or_endpoint():
    assert from_env() is None
    assert from_env({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) is None
    assert from_env({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) is None


@pytest.mark.parametrize(
    "env, message",
    [
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL='grpc': kvguard ships the OTLP/HTTP exporter only; use http/protobuf "
            "(the collector's port 4318)",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4318"},
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='collector:4318': expected http(s)://HOST:PORT",
        ),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER='zipkin': kvguard supports otlp, console and none"),
    ],
)
def test_bad_configuration_is_refused_at_start_naming_the_variable(env, message):
    with pytest.raises(ValueError) as err:
        from_env(env)
    assert str(err.value) == message


def test_the_console_exporter_writes_to_stderr_not_to_the_json_findings(capsys):
    rec = from_env({"OTEL_TRACES_EXPORTER": "console"})
    rec.on_request_begin(DECODE, request())
    rec.on_request_end(DECODE, ended(request(), 1_100_000_000))
    rec.shutdown()
    captured = capsys.readouterr()
    assert captured.out == "" and '"name": "decode request"' in captured.err


def test_spans_reach_an_otlp_collector_configured_by_the_standard_variables(monkeypatch):
    collector = Collector("traces")
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=kvguard-ops")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "kvguard-gpu-node-7")
        rec = from_env()
        info = request()
        rec.on_request_begin(DECODE, info)
        rec.on_finding(unwritten_read())
        rec.on_request_end(DECODE, ended(info, 2_000_000_000), pages=150)
        rec.shutdown()  # flushes the batch processor
    finally:
        collector.close()
        collector.server_close()
    ((path, body),) = collector.requests
    assert path == "/v1/traces" and collector.headers[0]["x-tenant"] == "kvguard-ops"
    (resource_spans,) = body.resource_spans
    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
    assert resource["service.name"] == "kvguard-gpu-node-7"
    (span,) = [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert span.name == "decode request" and span.status.code == 2  # STATUS_CODE_ERROR
    assert int.from_bytes(span.trace_id, "big") == xxhash.xxh3_128_intdigest(f"room:{info.room}".encode())
    attrs = {a.key: a.value for a in span.attributes}
    assert attrs["gen_ai.response.id"].string_value == "r-initech" and attrs["kvguard.request.pages"].int_value == 150
    (event,) = span.events
    tenants = {a.key: a for a in event.attributes}["kvguard.finding.exposed_tenants"]
    assert [v.string_value for v in tenants.value.array_value.values] == ["acme", "globex"]


# ---------------------------------------------------------------------- through the pipeline
def wired() -> bool:
    from kvguard.sidecar.service import Sidecar

    return "tracer" in inspect.signature(Sidecar.__init__).parameters


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
    decode.transfer_done(rid, room, "receiver", "success")
    decode.forward([rid], [tokens], [[]], [slots(pages)[:tokens]])


@pytest.mark.skipif(
    not wired(),
    reason="pipeline.py does not call the TraceRecorder yet (Sidecar(tracer=...), docs/tracing.md 'Wiring')",
)
def test_the_incident_through_a_real_sidecar_is_two_traces(tmp_path, spans):
    from kvguard.engine_hooks.probes import Probes
    from kvguard.engine_hooks.ring import RingWriter
    from kvguard.sidecar.service import Sidecar

    prefill, decode = Probes(RingWriter(str(tmp_path), 1 << 16)), Probes(RingWriter(str(tmp_path), 1 << 16))
    prefill.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.19", "tiny")  # pool < context
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    decode.request_end("r-acme", "length", 1_000_000, 2_000_000, 3, "")
    decode.pages_freed(slots([1, 2]))
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)
    sidecar = Sidecar(str(tmp_path), slack_ns=0, tracer=TraceRecorder(spans, batch=False))
    sidecar.run_once(flush=True)
    sidecar.stop()  # r-initech is still decoding: its span ends as incomplete
    got = by_name(spans)
    (pool,) = got["kvguard.finding"]
    assert pool.events[0].attributes["kvguard.finding.kind"] == "pool_smaller_than_context"
    acme = [s for s in got["decode request"] if s.attributes["gen_ai.response.id"] == "r-acme"][0]
    assert acme.attributes["kvguard.request.pages"] == 2 and acme.attributes["gen_ai.usage.output_tokens"] == 3
    assert acme.attributes["gen_ai.response.finish_reasons"] == ("length",) and acme.events == ()
    initech = [s for s in got["decode request"] if s.attributes["gen_ai.response.id"] == "r-initech"][0]
    assert [e.attributes["kvguard.finding.kind"] for e in initech.events] == [
        "transfer_size_mismatch",
        "unwritten_read",
    ]
    assert initech.events[1].attributes["kvguard.finding.exposed_tenants"] == ("acme",)
    assert initech.status.status_code == StatusCode.ERROR and initech.attributes["kvguard.request.end_seen"] is False
    sent = [s for s in got["prefill request"] if s.attributes["gen_ai.response.id"] == "r-initech"][0]
    assert sent.context.trace_id == initech.context.trace_id

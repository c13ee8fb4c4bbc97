"""OpenTelemetry traces: one span per request per engine, kvguard's findings as span events.

``TraceRecorder`` is driven by the pipeline on the ingest thread:

- ``on_request_begin(engine, info)`` when a REQ_BEGIN is applied: starts the span;
- ``on_finding(finding)`` for each finding delivered to the sinks: an event on the
  reader's span (status ERROR when critical), or a span of its own when the reader's
  span is not open or the finding names no reader (lost records, pool < context);
- ``on_request_end(engine, info, pages=, output_tokens=)`` when a REQ_END is applied:
  sets the finish, TTFT and sizes, ends the span.

It also has the sink methods (``send``, ``resolve``, ``force_flush``, ``shutdown``), so it
can sit in the pipeline's sink list and get its findings that way.

Threading contract (as OpenTelemetry's span processors): every method is called on
the ingest thread and must not block or raise. Spans are handed to a
``BatchSpanProcessor`` whose worker thread exports them; a failure here is logged
once per kind of error and counted in ``counts["errors"]``, and ingestion goes on.

    engine records (CLOCK_MONOTONIC ns)        spans (Unix epoch ns)
    REQ_BEGIN rid=r room=m ----------------->  start "decode request", trace id = xxh3_128("room:m")
    FORWARD ... finding(reader r) ---------->  event "kvguard.finding" (+ status ERROR if critical)
    REQ_END  rid=r finish=length ----------->  end, gen_ai.response.finish_reasons=["length"]

NOTE: the trace id is derived from what both ends of one disaggregated request share,
its ``bootstrap_room`` (from the rid for a request without one), so the prefill span and
the decode span are in one trace even when each engine drew its own rid (a client that
sends no rid through SGLang's router), and a ``traceidratio`` sampler keeps or drops
both together. The spans are siblings without a common parent (kvguard does not see
the client's request).

NOTE: records carry the engine host's ``CLOCK_MONOTONIC``; spans need wall-clock
time. The offset between the two clocks is read once at start-up (the sidecar runs on
the engines' host, and CLOCK_MONOTONIC is system-wide).

Configuration is OpenTelemetry's own environment (``from_env``, docs/tracing.md).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping
from urllib.parse import urlsplit

import xxhash
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import SpanKind, Status, StatusCode

from .findings import CRITICAL, EngineRef, Finding
from .incidents import incident_id, incident_key
from .tracker import RequestInfo

log = logging.getLogger("kvguard.tracing")

SCOPE = "kvguard.sidecar"
DEFAULT_SERVICE_NAME = "kvguard-sidecar"
MAX_EXPOSED_RIDS = 32

# GenAI semantic conventions (now in open-telemetry/semantic-conventions-genai; the
# names are checked against opentelemetry-semantic-conventions in tests/sidecar/test_tracing.py)
GEN_AI_RESPONSE_ID = "gen_ai.response.id"  # the engine's rid (SGLang answers with it as the response id)
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
ERROR_TYPE = "error.type"

# kvguard's own attributes (no semantic convention covers them)
ENGINE_ROLE = "kvguard.engine.role"
ENGINE_RANK = "kvguard.engine.rank"
ENGINE_PID = "kvguard.engine.pid"
TENANT = "kvguard.tenant"
TRANSFER_ROOM = "kvguard.transfer.room"
REQUEST_PAGES = "kvguard.request.pages"
REQUEST_TTFT_S = "kvguard.request.ttft_s"  # engine-measured, not the client's time to first chunk
REQUEST_WARMUP = "kvguard.request.warmup"
REQUEST_REJECTED = "kvguard.request.rejected"
REQUEST_BEGIN_SEEN = "kvguard.request.begin_seen"
REQUEST_END_SEEN = "kvguard.request.end_seen"
FINDING_EVENT = "kvguard.finding"
FINDING_KIND = "kvguard.finding.kind"
FINDING_SEVERITY = "kvguard.finding.severity"
FINDING_SUMMARY = "kvguard.finding.summary"
FINDING_PAGES = "kvguard.finding.pages"
FINDING_EXPOSED_TENANTS = "kvguard.finding.exposed_tenants"
FINDING_EXPOSED_REQUESTS = "kvguard.finding.exposed_requests"
INCIDENT_ID = "kvguard.incident.id"


class RidTraceIds(RandomIdGenerator):
    """Trace ids from a request's identity (trace_source) for request spans; random ones otherwise."""

    def __init__(self):
        self._next = threading.local()

    def use(self, source: str | None) -> None:
        """The next trace id generated on this thread is the source's (None: a random one)."""
        self._next.trace_id = 0 if source is None else trace_id_for(source)

    def generate_trace_id(self) -> int:
        trace_id = getattr(self._next, "trace_id", 0)
        self._next.trace_id = 0
        return trace_id or super().generate_trace_id()


def trace_id_for(source: str) -> int:
    return xxhash.xxh3_128_intdigest(source.encode()) or 1  # 0 is the invalid trace id


def trace_source(rid: str, room: int | None) -> str:
    """What a request's trace id is derived from: its bootstrap_room, the one identity both
    ends of a disaggregated request share (their rids may differ), else its rid."""
    return rid if room is None else f"room:{room}"


class TraceRecorder:
    def __init__(
        self,
        exporters: SpanExporter | list[SpanExporter],
        *,
        batch: bool = True,
        resource: Resource | None = None,
        sampler=None,
        max_open: int = 65536,
    ):
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.max_open = max_open
        self._ids = RidTraceIds()
        self.provider = TracerProvider(resource=resource or default_resource(), sampler=sampler, id_generator=self._ids)
        for exporter in exporters if isinstance(exporters, list) else [exporters]:
            self.provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(SCOPE, _version())
        self._open: OrderedDict[tuple, trace.Span] = OrderedDict()  # (role, rank, pid, rid) -> open span
        self._clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self.counts: Counter = Counter()  # spans_started, spans_ended, evicted, finding_events, finding_spans, errors
        self._logged: set[str] = set()
        # the span the last finding went on: the finding's log record (sidecar/finding_logs.py),
        # delivered right after this sink on the same thread, carries its trace and span ids
        self._last_finding: tuple[Finding, trace.SpanContext] | None = None

    # ------------------------------------------------------------------ pipeline hooks
    def on_request_begin(self, engine: EngineRef, info: RequestInfo) -> None:
        try:
            self._begin(engine, info, info.begin_ns, begin_seen=True)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop ingestion
            self._failed("on_request_begin", exc)

    def on_request_end(
        self, engine: EngineRef, info: RequestInfo, *, pages: int | None = None, output_tokens: int | None = None
    ) -> None:
        try:
            self._end(engine, info, pages, output_tokens)
        except Exception as exc:  # noqa: BLE001
            self._failed("on_request_end", exc)

    def on_finding(self, finding: Finding) -> None:
        try:
            self._finding(finding)
        except Exception as exc:  # noqa: BLE001
            self._failed("on_finding", exc)

    def span_context_of(self, finding: Finding) -> trace.SpanContext | None:
        """The context of the span ``finding`` was put on (an event on its reader's span, or a
        span of its own), when it was the last finding this recorder got; else None."""
        last = self._last_finding
        return last[1] if last is not None and last[0] is finding else None

    def on_engine_gone(self, engine: EngineRef, ts_ns: int) -> None:
        """The engine exited: its requests will never end; end their spans, marked incomplete."""
        try:
            for key in [k for k in self._open if k[:3] == _engine_key(engine)]:
                self._close(self._open.pop(key), ts_ns)
        except Exception as exc:  # noqa: BLE001
            self._failed("on_engine_gone", exc)

    # ------------------------------------------------------------------ sink interface
    def send(self, finding: Finding) -> None:
        self.on_finding(finding)

    def resolve(self, incident) -> None:
        pass  # an incident resolves when its reader ends: the span has ended already

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """End the spans still open (marked incomplete), export what is queued, stop."""
        now = time.monotonic_ns()
        while self._open:
            self._close(self._open.popitem(last=False)[1], now)
        self.provider.shutdown()

    # ------------------------------------------------------------------ internals
    def _begin(self, engine: EngineRef, info: RequestInfo, ts_ns: int, begin_seen: bool) -> trace.Span:
        key = (*_engine_key(engine), info.rid)
        stale = self._open.pop(key, None)
        if stale is not None:  # the same rid began again on this engine (a retry): the old one never ended
            self._close(stale, ts_ns)
        span = self._start(
            f"{engine.role} request",
            trace_source(info.rid, info.room),
            request_attributes(engine, info, begin_seen),
            self._wall(ts_ns),
        )
        self._open[key] = span
        self.counts["spans_started"] += 1
        while len(self._open) > self.max_open:  # requests whose end we will never see (lost records)
            self._close(self._open.popitem(last=False)[1], ts_ns)
            self.counts["evicted"] += 1
        return span

    def _end(self, engine: EngineRef, info: RequestInfo, pages: int | None, output_tokens: int | None) -> None:
        key = self._key_of(engine, info.rid)
        if key is None:  # began before the sidecar attached (or its REQ_BEGIN was lost)
            self._begin(engine, info, info.begin_ns or info.end_ns, begin_seen=False)
            key = self._key_of(engine, info.rid)
            if key is None:  # (not reached: _begin just opened it)
                return
        span = self._open.pop(key)
        span.set_attributes(end_attributes(info, pages, output_tokens))
        span.end(end_time=self._wall(info.end_ns))
        self.counts["spans_ended"] += 1

    def _finding(self, f: Finding) -> None:
        at = self._wall(f.first_seen_ns)
        key = None if f.reader is None else self._key_of(f.engine, f.reader.rid)
        span = None if key is None else self._open[key]
        standalone = span is None
        if standalone:  # in the reader's trace when there is a reader, else in a trace of its own
            attrs = engine_attributes(f.engine)
            if f.reader is not None:
                attrs.update({GEN_AI_RESPONSE_ID: f.reader.rid, TENANT: f.reader.tenant})
            source = None if f.reader is None else trace_source(f.reader.rid, f.reader.bootstrap_room)
            span = self._start(FINDING_EVENT, source, attrs, at)
        assert span is not None  # (the reader's open span, or the one just started)
        self._last_finding = (f, span.get_span_context())
        span.add_event(FINDING_EVENT, finding_attributes(f), timestamp=at)
        if f.severity == CRITICAL:
            span.set_attribute(ERROR_TYPE, f.kind)
            span.set_status(Status(StatusCode.ERROR, f"kvguard {f.kind}"))
        if standalone:
            span.end(end_time=at)
            self.counts["finding_spans"] += 1
        else:
            self.counts["finding_events"] += 1

    def _start(self, name: str, source: str | None, attributes: dict, start_ns: int) -> trace.Span:
        """A root span (never a child of whatever is current), in the source's trace when given."""
        if source is not None:
            self._ids.use(source)
        try:
            return self.tracer.start_span(
                name, context=Context(), kind=SpanKind.INTERNAL, attributes=attributes, start_time=start_ns
            )
        finally:
            self._ids.use(None)

    def _key_of(self, engine: EngineRef, rid: str) -> tuple | None:
        """The open span's key for this engine's request, or None."""
        # NOTE: an engine is "unknown" until its HELLO: a request that began before it is filed there
        for key in ((*_engine_key(engine), rid), (*_engine_key(UNKNOWN_ENGINE), rid)):
            if key in self._open:
                return key
        return None

    def _close(self, span: trace.Span, ts_ns: int) -> None:
        span.set_attribute(REQUEST_END_SEEN, False)
        span.end(end_time=self._wall(ts_ns))
        self.counts["spans_ended"] += 1

    def _wall(self, monotonic_ns: int) -> int:
        return (monotonic_ns or time.monotonic_ns()) + self._clock_offset_ns

    def _failed(self, where: str, exc: Exception) -> None:
        self.counts["errors"] += 1
        kind = f"{where}:{type(exc).__name__}"
        if kind not in self._logged:  # once per kind of failure; the count says how often
            self._logged.add(kind)
            log.error(
                "tracing: %s failed (%s: %s); spans may be missing, ingestion goes on",
                where,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )


# ---------------------------------------------------------------------- attributes
UNKNOWN_ENGINE = EngineRef("unknown", 0, 0)  # what the pipeline calls an engine before its HELLO


def _engine_key(engine: EngineRef) -> tuple:
    # the pid alone is not enough: engines in one process (tests, replays) share it
    return (engine.role, engine.rank, engine.pid)


def engine_attributes(engine: EngineRef) -> dict:
    return {ENGINE_ROLE: engine.role, ENGINE_RANK: engine.rank, ENGINE_PID: engine.pid}


def request_attributes(engine: EngineRef, info: RequestInfo, begin_seen: bool = True) -> dict:
    attrs = {
        **engine_attributes(engine),
        GEN_AI_RESPONSE_ID: info.rid,
        TENANT: info.tenant,
        GEN_AI_USAGE_INPUT_TOKENS: info.prompt_tokens,
        GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: info.cached_tokens,
    }
    if info.room is not None:  # OTLP integers are int64; SGLang's rooms are 63-bit
        attrs[TRANSFER_ROOM] = info.room if info.room < 1 << 63 else str(info.room)
    if info.warmup:
        attrs[REQUEST_WARMUP] = True
    if not begin_seen:
        attrs[REQUEST_BEGIN_SEEN] = False
    return attrs


def end_attributes(info: RequestInfo, pages: int | None, output_tokens: int | None) -> dict:
    attrs: dict = {REQUEST_END_SEEN: True}
    if info.finish and info.finish != "unknown":
        attrs[GEN_AI_RESPONSE_FINISH_REASONS] = [info.finish]
    if info.ttft_ns > 0:
        attrs[REQUEST_TTFT_S] = info.ttft_ns / 1e9
    if info.rejected:
        attrs[REQUEST_REJECTED] = info.rejected
    if pages is not None:
        attrs[REQUEST_PAGES] = pages
    if output_tokens is not None:
        attrs[GEN_AI_USAGE_OUTPUT_TOKENS] = output_tokens
    return attrs


def finding_attributes(f: Finding) -> dict:
    attrs = {
        FINDING_KIND: f.kind,
        FINDING_SEVERITY: f.severity,
        FINDING_SUMMARY: f.summary,
        FINDING_PAGES: len(f.pages),
        INCIDENT_ID: incident_id(incident_key(f)),
    }
    if f.exposed:
        attrs[FINDING_EXPOSED_TENANTS] = sorted({p.tenant or "?" for p in f.exposed})
        attrs[FINDING_EXPOSED_REQUESTS] = [p.rid for p in f.exposed[:MAX_EXPOSED_RIDS]]
    return attrs


# ---------------------------------------------------------------------- configuration
def default_resource() -> Resource:
    """OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES as set; service.name kvguard-sidecar otherwise."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    return resource


def from_env(environ: Mapping[str, str] | None = None) -> TraceRecorder | None:
    """A recorder configured by the standard OTEL_* variables, or None when tracing is off.

    Off unless OTEL_TRACES_EXPORTER names an exporter or an OTLP endpoint is set
    (OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and off with
    OTEL_SDK_DISABLED=true. Bad values raise ValueError naming the variable.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint_keys = otlp_endpoint_keys(env, "TRACES")
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        names = ["otlp"] if endpoint_keys else ["none"]
    if names == ["none"]:
        return None
    exporters = [_exporter(name, env, endpoint_keys) for name in names if name != "none"]
    return TraceRecorder(exporters)


def _exporter(name: str, env: Mapping[str, str], endpoint_keys: list[str]) -> SpanExporter:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr)  # stdout carries `kvguard sidecar --json`
    if name != "otlp":
        raise ValueError(
            f"OTEL_TRACES_EXPORTER={env.get('OTEL_TRACES_EXPORTER')!r}: kvguard supports otlp, console and none"
        )
    check_otlp(env, "TRACES", endpoint_keys)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression, TLS: from the same OTEL_* variables


def otlp_endpoint_keys(env: Mapping[str, str], signal: str) -> list[str]:
    """The OTLP endpoint variables set for ``signal`` (TRACES, LOGS): its own, then the shared one."""
    return [k for k in (f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT") if env.get(k)]


def check_otlp(env: Mapping[str, str], signal: str, endpoint_keys: list[str]) -> None:
    """The OTLP settings kvguard can honour for ``signal``, or ValueError naming the variable:
    the protocol (OTLP/HTTP protobuf only: the gRPC exporter is not installed) and the endpoints."""
    for key in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(key, "").strip()
        if protocol:
            if protocol != "http/protobuf":
                raise ValueError(
                    f"{key}={protocol!r}: kvguard ships the OTLP/HTTP exporter only; use "
                    f"http/protobuf (the collector's port 4318)"
                )
            break
    for key in endpoint_keys:
        parts = urlsplit(env[key])
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{key}={env[key]!r}: expected http(s)://HOST:PORT")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvguard")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0"

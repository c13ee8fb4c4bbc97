"""Findings as OpenTelemetry log records, over OTLP/HTTP (docs/tracing.md, "Findings as logs").

Every finding the pipeline delivers (the first of each incident, and a repeat that names a
new exposed party: the findings ``kvguard sidecar --json`` prints) also leaves as one log
record: its body the finding's summary, its attributes the finding's JSON line flattened
(``flatten``: nested keys joined with dots, lists of objects split into one list per key,
what OTLP cannot hold as a value as JSON text), ``kvguard.incident.id``, the event name
``kvguard.finding``, its severity mapped (``SEVERITY``), its time the finding's, and, where
kvguard traces, the trace and span ids of the span the finding went on (the reader's
request span: sidecar/tracing.py), so a log backend links the record to the trace.

``FindingLogSink`` is a sink (``send``, ``resolve``, ``force_flush``, ``shutdown``,
``delivery_stats``): the pipeline lists it after the trace recorder, so that the span the
finding went on is known when the record is made. It never blocks or raises on the ingest
thread: records go to a ``BatchLogRecordProcessor`` whose thread exports them; at most
``max_queue`` records wait (OTEL_BLRP_MAX_QUEUE_SIZE, 2048), more are dropped and counted;
export failures (after the exporter's own retries) are counted and logged once. The counts
are ``kvguard_sink_events_total{sink="otlp-logs"}`` (docs/metrics.md), the alert sinks'
metric, so KVGuardAlertDeliveryFailing covers them.

Configuration is OpenTelemetry's environment, as for traces (``from_env``):
OTEL_LOGS_EXPORTER (otlp, console, none), OTEL_EXPORTER_OTLP_[LOGS_]ENDPOINT and the rest of
the exporter's variables, OTEL_BLRP_*; on when an OTLP endpoint is set, off otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import (
    BatchLogRecordProcessor,
    LogRecordExporter,
    LogRecordExportResult,
    SimpleLogRecordProcessor,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import NonRecordingSpan

from .findings import Finding
from .incidents import incident_id, incident_key
from .sinks.delivery import ACTIONS, RESULTS
from .stats import SinkStats
from .tracing import FINDING_EVENT, INCIDENT_ID, SCOPE, check_otlp, default_resource, otlp_endpoint_keys

log = logging.getLogger("kvguard.finding_logs")

SINK_NAME = "otlp-logs"
DEFAULT_MAX_QUEUE = 2048  # the SDK's default for OTEL_BLRP_MAX_QUEUE_SIZE
# kvguard's severities on OpenTelemetry's scale: "critical" as Python's logging bridge maps
# CRITICAL (FATAL, 21): a finding that pages someone; the text keeps kvguard's word
SEVERITY = {
    "critical": (SeverityNumber.FATAL, "CRITICAL"),
    "warning": (SeverityNumber.WARN, "WARNING"),
    "info": (SeverityNumber.INFO, "INFO"),
}
INT64 = (-(1 << 63), (1 << 63) - 1)
BLRP_VARS = ("OTEL_BLRP_MAX_QUEUE_SIZE", "OTEL_BLRP_SCHEDULE_DELAY", "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE")


# ---------------------------------------------------------------------- attributes
def _primitive(value) -> bool:
    return isinstance(value, (str, bool, float)) or isinstance(value, int) and INT64[0] <= value <= INT64[1]


def _homogeneous(values: Sequence) -> bool:
    """A list OTLP holds as an array: primitives of one type (bools are not ints here)."""
    return all(_primitive(v) for v in values) and len({type(v) for v in values}) <= 1


def flatten(value: Mapping, prefix: str = "") -> dict:
    """A finding's JSON (``Finding.to_dict``) as OpenTelemetry attributes: dicts into dotted
    keys, a list of objects into one list per key (``exposed.rid``, ``exposed.tenant``), and
    what OTLP has no value type for (an integer past int64, a list of lists, mixed lists) as
    JSON text. None is left out (OTLP has no null attribute)."""
    out: dict = {}
    for k, v in value.items():
        key = f"{prefix}{k}"
        if v is None:
            continue
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        elif _primitive(v):
            out[key] = v
        elif isinstance(v, int):  # past int64 (SGLang's rooms are 63-bit, so in practice never)
            out[key] = str(v)
        elif isinstance(v, (list, tuple)):
            if _homogeneous(v):
                out[key] = list(v)
            elif v and all(isinstance(x, Mapping) for x in v):
                names = list(dict.fromkeys(n for x in v for n in x))
                for name in names:
                    column = [x.get(name) for x in v]
                    out[f"{key}.{name}"] = column if _homogeneous(column) else json.dumps(column)
            else:
                out[key] = json.dumps(v, default=str)
        else:
            out[key] = str(v)
    return out


def finding_log_attributes(f: Finding) -> dict:
    attrs = flatten(f.to_dict())
    attrs[INCIDENT_ID] = incident_id(incident_key(f))
    return attrs


# ---------------------------------------------------------------------- the sink
class _Counting(LogRecordExporter):
    """Counts each record the processor hands the exporter: exported, or failed (the exporter
    said so or raised, after its own retries). The sink's queue bound is computed from them."""

    def __init__(self, exporter: LogRecordExporter, sink: FindingLogSink):
        self.exporter, self.sink = exporter, sink

    def export(self, batch):
        try:
            result = self.exporter.export(batch)
        except Exception as exc:  # noqa: BLE001 - counted and logged; the processor goes on
            self.sink._done(len(batch), ok=False, why=f"{type(exc).__name__}: {exc}")
            return LogRecordExportResult.FAILURE
        self.sink._done(len(batch), ok=result == LogRecordExportResult.SUCCESS, why="the exporter reported a failure")
        return result

    def shutdown(self):
        return self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class FindingLogSink:
    name = SINK_NAME

    def __init__(
        self,
        exporters: LogRecordExporter | list[LogRecordExporter],
        *,
        batch: bool = True,
        resource: Resource | None = None,
        max_queue: int | None = None,
        tracer=None,
    ):
        exporters = exporters if isinstance(exporters, list) else [exporters]
        self.max_queue = max_queue or _env_int(os.environ, "OTEL_BLRP_MAX_QUEUE_SIZE") or DEFAULT_MAX_QUEUE
        self.provider = LoggerProvider(resource=resource or default_resource(), shutdown_on_exit=False)
        for exporter in exporters:
            counted = _Counting(exporter, self)
            processor = (
                BatchLogRecordProcessor(
                    counted,
                    max_queue_size=self.max_queue,
                    # at most the queue (the SDK refuses a batch larger than its queue)
                    max_export_batch_size=min(
                        _env_int(os.environ, "OTEL_BLRP_MAX_EXPORT_BATCH_SIZE") or 512, self.max_queue
                    ),
                )
                if batch
                else SimpleLogRecordProcessor(counted)
            )
            self.provider.add_log_record_processor(processor)
        self._copies = len(exporters)  # each record goes to every exporter
        self.logger = self.provider.get_logger(SCOPE, _version())
        self.tracer = tracer  # sidecar.tracing.TraceRecorder or None: the span each finding went on
        self._clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self._lock = threading.Lock()  # the counts: the ingest thread and the export thread
        self.counts: Counter = Counter()  # emitted, exported, failed, dropped, errors
        self.results: Counter = Counter({(a, r): 0 for a in ACTIONS for r in RESULTS})
        self.last_success_s = 0.0
        self._logged: set[str] = set()

    # ------------------------------------------------------------------ sink interface (ingest thread)
    def send(self, finding: Finding) -> None:
        try:
            self._emit(finding)
        except Exception as exc:  # noqa: BLE001 - telemetry must never stop ingestion
            self.counts["errors"] += 1
            self._log_once(f"emit:{type(exc).__name__}", "finding logs: a record could not be made (%s: %s)", exc)

    def resolve(self, incident) -> None:
        pass  # a log record per finding; a resolution is not a finding

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()

    def queue_depth(self) -> int:
        with self._lock:
            c = self.counts
            return c["emitted"] * self._copies - c["exported"] - c["failed"]

    def delivery_stats(self) -> SinkStats:
        """As the queued alert sinks' (sidecar/sinks/delivery.py): a record exported is
        ``delivered``, one the exporter failed (after its retries) ``gave_up``, one over the
        queue bound ``dropped``."""
        with self._lock:
            events = dict(self.results)
        return SinkStats(
            name=self.name,
            events=events,
            retries=0,  # the OTLP exporter retries inside one export: not seen from here
            queue_depth=self.queue_depth(),
            queue_capacity=self.max_queue,
            last_success_s=self.last_success_s,
        )

    # ------------------------------------------------------------------ internals
    def _emit(self, f: Finding) -> None:
        if self.queue_depth() >= self.max_queue:  # the exporter is behind: drop, never wait
            with self._lock:
                self.counts["dropped"] += 1
                self.results[("trigger", "dropped")] += 1
            self._log_once("dropped", "finding logs: queue full (%s records), dropping records", self.max_queue)
            return
        number, text = SEVERITY.get(f.severity, (SeverityNumber.UNSPECIFIED, f.severity.upper()))
        span_context = self.tracer.span_context_of(f) if self.tracer is not None else None
        context = trace.set_span_in_context(NonRecordingSpan(span_context)) if span_context is not None else None
        with self._lock:
            self.counts["emitted"] += 1
        self.logger.emit(
            timestamp=(f.first_seen_ns or time.monotonic_ns()) + self._clock_offset_ns,
            observed_timestamp=time.time_ns(),
            context=context,
            severity_number=number,
            severity_text=text,
            body=f.summary,
            attributes=finding_log_attributes(f),
            event_name=FINDING_EVENT,
        )

    def _done(self, count: int, ok: bool, why: str) -> None:
        """Called on the processor's thread with each batch's outcome."""
        with self._lock:
            self.counts["exported" if ok else "failed"] += count
            self.results[("trigger", "delivered" if ok else "gave_up")] += count
            if ok:
                self.last_success_s = time.time()
        if not ok:
            self._log_once("export", "finding logs: %s records not exported (%s)", count, why)

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:  # once per kind; the counts say how often
            self._logged.add(kind)
            log.error(message + '; the count is in kvguard_sink_events_total{sink="otlp-logs"}', *args)


# ---------------------------------------------------------------------- configuration
def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{key}={raw!r}: expected a positive integer")
    return int(raw)


def from_env(environ: Mapping[str, str] | None = None, tracer=None) -> FindingLogSink | None:
    """A sink configured by the standard OTEL_* variables, or None when finding logs are off.

    On when OTEL_LOGS_EXPORTER names an exporter, or an OTLP endpoint is set
    (OTEL_EXPORTER_OTLP_LOGS_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT: one endpoint for
    traces and logs, as a collector takes both); off with OTEL_LOGS_EXPORTER=none or
    OTEL_SDK_DISABLED=true. A bad value raises ValueError naming the variable and the value.
    """
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint_keys = otlp_endpoint_keys(env, "LOGS")
    names = [n.strip().lower() for n in env.get("OTEL_LOGS_EXPORTER", "").split(",") if n.strip()]
    if not names:
        names = ["otlp"] if endpoint_keys else ["none"]
    if names == ["none"]:
        return None
    for key in BLRP_VARS:
        _env_int(env, key)  # the SDK would fall back to its default quietly: say it at start-up instead
    exporters: list[LogRecordExporter] = []
    for name in names:
        if name == "none":
            continue
        if name == "console":
            from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter

            exporters.append(ConsoleLogRecordExporter(out=sys.stderr))  # stdout carries `--json`
        elif name == "otlp":
            check_otlp(env, "LOGS", endpoint_keys)
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

            exporters.append(OTLPLogExporter())  # endpoint, headers, timeout, TLS: the OTEL_* variables
        else:
            raise ValueError(
                f"OTEL_LOGS_EXPORTER={env.get('OTEL_LOGS_EXPORTER')!r}: kvguard supports otlp, console and none"
            )
    return FindingLogSink(exporters, max_queue=_env_int(env, "OTEL_BLRP_MAX_QUEUE_SIZE"), tracer=tracer)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvguard")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0"

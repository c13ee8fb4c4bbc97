"""``kvguard replay``: detection offline over recorded segments, through the same Pipeline.

Segments are replayed in recording order (from their headers: recording runs by start
time, segments of a run by index), whatever order they were given in; a segment given
twice is replayed once. Every record goes through ``sidecar.pipeline.Pipeline.apply``
exactly as the live sidecar applied it, so a complete recording gives the same findings,
field for field, as the live run.

What a recording cannot vouch for is reported, never guessed over:

* LOST markers recorded live are applied as they were (the ``events_lost`` finding).
* A sequence gap that the recording did not mark (a corrupt chunk, a segment deleted by
  retention or not given) resets that engine's page state exactly as a LOST marker does,
  but raises no finding: it is a *problem* of the recording, printed on stderr and
  counted in the summary (``records_missing``), because findings in that window may be
  missing from the replay.
* The CARRIED HELLOs at the start of a rotated segment are applied only when the replay
  has not seen that engine (the replay starts at this segment); otherwise they are skipped.

Settings that change verdicts (``VERDICT_OPTIONS``: tenant isolation, the TTFT detector,
the orphan timeout) are taken from the recording: the live sidecar writes them at the
start of every segment (an OPTIONS event, format version 2). A flag given to ``kvguard
replay`` overrides the recording's value; a recording without them (format 1) replays
with the flags, else the sidecar's defaults. The summary says which value came from
where. A recording made with a shared ledger (Redis) is replayed with the embedded one
(the other pod's facts are not in it), and the summary says so.

Exit status: 0 when the replay ran (findings or not, recording damage or not); 3 when it
ran but something failed that may have cost findings: the pipeline raised on a record
(``apply_errors``) or the engines recorded a probe failure (``probe_errors``: a
PROBE_ERROR record, a hook that turned itself off); 1 when an input cannot be read at
all (missing, not a recording, a newer format or another wire contract version),
checked for every input before anything is replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from kvguard.engine_hooks import wire

from .findings import Finding
from .pipeline import Pipeline
from .recorder import RecordingError, SegmentHeader, SegmentReader, SidecarEvent, is_segment_name

MAX_PROBLEMS_KEPT = 100
# Pipeline keyword -> the sidecar's default: the settings a recording carries and replay applies
VERDICT_OPTIONS = {
    "isolate_tenants": False,
    "ttft_anomaly": True,
    "orphan_timeout_s": 120.0,
    "detect_prefix_probing": False,
}


@dataclass
class ReplayStats:
    files: int = 0  # segments replayed
    recordings: int = 0  # distinct recording runs among them
    records: int = 0  # records applied (carried HELLOs that were applied included)
    carried_applied: int = 0
    carried_skipped: int = 0
    lost_recorded: int = 0  # records the engines dropped (ring full), as the live sidecar recorded them
    records_missing: int = 0  # sequence gaps the recording did not mark (damage, segments missing)
    duplicate_segments: int = 0
    missing_segments: int = 0  # segment indexes absent between two given segments of one run
    unreadable_segments: int = 0  # valid when checked, unreadable when replayed (deleted meanwhile)
    corrupt_chunks: int = 0
    corrupt_bytes: int = 0
    truncated_bytes: int = 0
    bad_records: int = 0  # records inside intact chunks that do not decode (unknown kind, version, payload)
    seq_resets: int = 0  # an engine's sequence went backwards
    blind_resets: int = 0  # places where a known hole reset every engine's page state
    sidecar_events: int = 0  # recorded ticks and engine-gone events applied
    engines: dict = field(default_factory=dict)  # engine_id -> {"first_seq": n, "records": n}
    problems: list = field(default_factory=list)
    problems_total: int = 0


def _hello_key(rec: wire.Record):
    return rec.seq, rec.ts_ns, rec.pool, rec.body


def find_segments(paths) -> list[str]:
    """Files as given; directories expand to the segment files in them; an incident bundle
    (``kvguard bundle``, sidecar/bundle.py) to its recording, extracted into a temporary
    directory removed at exit. RecordingError if none."""
    out = []
    for path in paths:
        path = os.fspath(path)
        if os.path.isfile(path) and _is_bundle(path):
            out += _bundle_segments(path)
        elif os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if is_segment_name(n))
            if not names:
                raise RecordingError(f"{path}: directory holds no kvguard recording segments (kvguard-*.kvgrec)")
            out += [os.path.join(path, n) for n in names]
        elif not os.path.exists(path):
            raise RecordingError(f"{path}: no such file")
        else:
            out.append(path)
    return out


def _is_bundle(path: str) -> bool:
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b":  # gzip: a segment file starts with its own magic
            return False
    from .bundle import read_manifest

    return read_manifest(path) is not None


def _bundle_segments(path: str) -> list[str]:
    import atexit
    import shutil
    import tempfile

    from .bundle import extract

    dest = tempfile.mkdtemp(prefix="kvguard-replay-bundle-")
    atexit.register(shutil.rmtree, dest, True)
    found = extract(path, dest, only_recording=True)
    if not found:
        raise RecordingError(f"{path}: the bundle holds no recording (its MANIFEST.json's gaps say why)")
    return sorted(found)


class Replay:
    """Replays segments through a fresh Pipeline. ``run(paths)`` returns the findings delivered."""

    def __init__(self, sinks=(), on_problem=None, overrides: dict | None = None):
        self.sinks = list(sinks)
        unknown = set(overrides or ()) - set(VERDICT_OPTIONS)
        if unknown:
            raise ValueError(f"not a replay option: {', '.join(sorted(unknown))}")
        # flags given to `kvguard replay`: they win over the recording's values
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self.options, self.options_source = self._merge(None)
        self.recorded_shared_ledger = False
        self.pipeline = Pipeline(self.sinks, **self.options)
        self.pipelines = [self.pipeline]  # one per recording run (a run is one live sidecar process)
        self._run_records = 0  # records applied to the current run's pipeline
        self._run_id: int | None = None
        self.stats = ReplayStats()
        self.header: SegmentHeader | None = None  # the segment being replayed (maps ts_ns to wall time)
        self._on_problem = on_problem
        self._expected: dict[int, int] = {}  # engine_id -> next sequence number
        self._hello: dict[int, tuple] = {}  # engine_id -> the HELLO applied last
        self._seen: set[int] = set()  # engines with any record applied
        self._path = ""
        self._after_missing: set[str] = set()  # segments that follow missing segments of their run
        self.findings_by_kind: Counter = Counter()  # findings delivered (new incidents), by kind

    # ------------------------------------------------------------------ planning
    def plan(self, paths) -> list[tuple[str, SegmentHeader]]:
        """Validate every input's header and put them in recording order (raises RecordingError)."""
        seen: dict[tuple[int, int], str] = {}
        runs: dict[int, list[tuple[int, str, SegmentHeader]]] = {}
        for path in find_segments(paths):
            reader = SegmentReader(path)
            header = reader.header
            reader.close()
            key = (header.recording_id, header.segment_index)
            if key in seen:
                self.stats.duplicate_segments += 1
                self._problem(
                    f"{path}: same segment as {seen[key]} (recording {header.recording_id:016x} "
                    f"segment {header.segment_index}); replayed once"
                )
                continue
            seen[key] = path
            runs.setdefault(header.recording_id, []).append((header.segment_index, path, header))
        order = sorted(runs.values(), key=lambda segs: min(h.created_realtime_ns for _, _, h in segs))
        plan = []
        for segs in order:
            segs.sort(key=lambda s: s[0])
            for (prev, _, _), (index, path, _) in zip(segs, segs[1:]):
                if index > prev + 1:
                    self._after_missing.add(path)
                    self.stats.missing_segments += index - prev - 1
                    self._problem(
                        f"segments {prev + 1}..{index - 1} of recording {segs[0][2].recording_id:016x} "
                        f"are not among the inputs (deleted by retention, or not given)"
                    )
            plan += [(path, header) for _, path, header in segs]
        self.stats.recordings = len(runs)
        return plan

    # ------------------------------------------------------------------ replaying
    def run(self, paths) -> list[Finding]:
        plan = self.plan(paths)
        findings = []
        for path, _header in plan:
            findings += self.replay_segment(path)
        return findings

    def replay_segment(self, path: str) -> list[Finding]:
        try:
            reader = SegmentReader(path)
        except RecordingError as exc:
            self.stats.unreadable_segments += 1
            self._problem(f"{exc} (it was readable when the replay started)")
            self._blind_all(f"{path}: segment unreadable")
            return []
        self._path, self.header = path, reader.header
        if self._run_id is not None and reader.header.recording_id != self._run_id:
            self._new_run()
        self._run_id = reader.header.recording_id
        self.stats.files += 1
        if path in self._after_missing:
            self._blind_all(f"{path}: segments before it are missing")
        findings = []
        problems_seen = holes = 0
        with reader:
            rs = reader.stats
            for rec, carried in reader:
                problems_seen = self._forward_reader_problems(reader, problems_seen)
                if rs.corrupt_chunks != holes:  # a chunk was lost before this record: who knows what it held
                    holes = rs.corrupt_chunks
                    self._blind_all(f"{path}: corrupt chunk")
                findings += self.apply(rec, carried)
            self._forward_reader_problems(reader, problems_seen)
            if rs.corrupt_chunks != holes or rs.truncated_bytes:
                self._blind_all(f"{path}: the segment ends in damaged or unfinished data")
            self.stats.corrupt_chunks += rs.corrupt_chunks
            self.stats.corrupt_bytes += rs.corrupt_bytes
            self.stats.truncated_bytes += rs.truncated_bytes
            self.stats.bad_records += rs.decode.unknown_kind + rs.decode.bad_version + rs.decode.bad_payload
        return findings

    def _merge(self, recorded: dict | None) -> tuple[dict, dict]:
        """Each verdict option's value and where it came from: a flag, the recording, the default."""
        options, source = {}, {}
        for name, default in VERDICT_OPTIONS.items():
            if name in self.overrides:
                options[name], source[name] = self.overrides[name], "flag"
            elif recorded is not None and name in recorded:
                options[name], source[name] = type(default)(recorded[name]), "recording"
            else:
                options[name], source[name] = default, "default"
        return options, source

    def _use_options(self, recorded: dict) -> None:
        """An OPTIONS event: the live sidecar's settings. At the start of a run (before any
        record) the run's pipeline is rebuilt with them; later, a change is reported (a live
        sidecar keeps its settings for its life) and the replay goes on with the first."""
        options, source = self._merge(recorded)
        self.recorded_shared_ledger = self.recorded_shared_ledger or bool(recorded.get("shared_ledger"))
        if options == self.options:
            if self._run_records == 0:  # the same values, now known to come from the recording
                self.options_source = source
            return
        if self._run_records == 0:
            self.options, self.options_source = options, source
            self.pipeline = Pipeline(self.sinks, **options)
            self.pipelines[-1] = self.pipeline
            return
        self._problem(f"{self._path}: recorded options changed within a run ({recorded}); replay keeps {self.options}")

    def _new_run(self) -> None:
        """A new recording run is a restarted live sidecar: it started from an empty pipeline too."""
        self.pipeline = Pipeline(self.sinks, **self.options)
        self.pipelines.append(self.pipeline)
        self._run_records = 0
        self._expected.clear()
        self._hello.clear()
        self._seen.clear()

    def _forward_reader_problems(self, reader: SegmentReader, already: int) -> int:
        for message in reader.stats.problems[already:]:
            self._problem(message)
        return len(reader.stats.problems)

    def apply(self, rec, carried: bool = False) -> list[Finding]:
        """One recorded record: continuity and carry-over bookkeeping, then the pipeline."""
        if isinstance(rec, SidecarEvent):
            return self._sidecar_event(rec)
        eid = rec.engine_id
        if carried:
            if rec.kind == wire.Kind.HELLO:
                skip = eid in self._hello and self._hello[eid] == _hello_key(rec)
            else:  # context of another kind (third-party writers): only for an engine not seen yet
                skip = eid in self._seen
            if skip:
                self.stats.carried_skipped += 1
                return []
            self.stats.carried_applied += 1
        else:
            expected = self._expected.get(eid)
            if expected is not None and rec.seq > expected:
                gap = rec.seq - expected
                self.stats.records_missing += gap
                self.pipeline.tracker(eid).on_lost(rec.ts_ns)
                self._problem(
                    f"{self._path}: engine {eid}: records {expected}..{rec.seq - 1} ({gap}) are not in "
                    f"the recording; its page state was reset there, findings in that window may be missing"
                )
            elif expected is not None and rec.seq < expected:
                self.stats.seq_resets += 1
                self._problem(
                    f"{self._path}: engine {eid}: sequence went back from {expected} to {rec.seq} (engine id reused?)"
                )
            engine = self.stats.engines.setdefault(eid, {"first_seq": rec.seq, "records": 0})
            engine["records"] += 1
            if rec.kind == wire.Kind.LOST:
                self.stats.lost_recorded += rec.body
                self._expected[eid] = rec.seq + rec.body
            elif expected is not None or rec.kind != wire.Kind.HELLO:
                # an engine's first record being a HELLO sets no expectation: a sidecar that resumed
                # a ring applies the ring's saved HELLO copy, then records from where it resumed
                self._expected[eid] = rec.seq + 1
        if rec.kind == wire.Kind.HELLO:
            self._hello[eid] = _hello_key(rec)
        self._seen.add(eid)
        self.stats.records += 1
        self._run_records += 1
        found = self.pipeline.apply(rec)
        for f in found:
            self.findings_by_kind[f.kind] += 1
        return found

    def _blind_all(self, why: str) -> None:
        """A known hole in the recording: forget every engine's page state, as a LOST marker does."""
        for tracker in self.pipeline.engines.values():
            tracker.on_lost()
        self.stats.blind_resets += 1
        self._problem(f"{why}: page state of every engine reset there; findings in that window may be missing")

    def _sidecar_event(self, ev: SidecarEvent) -> list[Finding]:
        """The live sidecar's own state changes, at the point in the stream where it made them."""
        self.stats.sidecar_events += 1
        if ev.kind == "options":
            self._use_options(ev.options or {})
            return []
        if ev.kind == "gap":
            self.stats.records_missing += ev.count
            self._expected.clear()  # the gaps that follow are this one: do not count them twice
            self._blind_all(
                f"{self._path}: the recorder could not record {ev.count} records here (see its write errors)"
            )
            return []
        if ev.kind == "tick":
            fn = getattr(self.pipeline, "tick", None)
            args: tuple[int, ...] = (ev.ts_ns,)
        else:
            fn = getattr(self.pipeline, "on_engine_gone", None)
            args = (ev.engine_id, ev.ts_ns)
        if fn is None:
            self._problem(f"{self._path}: recorded {ev.kind} event, but this pipeline has no such hook; ignored")
            return []
        try:
            found = fn(*args)  # a tick can raise findings too (transfers decided by time: orphans, expiries)
        except Exception as exc:  # noqa: BLE001 - a replay never crashes on recorded input
            self.pipeline.apply_errors += 1
            self._problem(f"{self._path}: {ev.kind} event failed: {type(exc).__name__}: {exc}")
            return []
        found = found if isinstance(found, list) else []
        for f in found:
            self.findings_by_kind[f.kind] += 1
        return found

    def _problem(self, message: str) -> None:
        self.stats.problems_total += 1
        if len(self.stats.problems) < MAX_PROBLEMS_KEPT:
            self.stats.problems.append(message)
        if self._on_problem is not None:
            self._on_problem(message)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        s = self.stats
        by_kind = self.findings_by_kind
        suppressed = sum(p.findings_suppressed for p in self.pipelines)
        apply_errors = sum(p.apply_errors for p in self.pipelines)
        probe_errors = sum(p.records_by_kind.get("PROBE_ERROR", 0) for p in self.pipelines)
        return {
            "segments": s.files,
            "recordings": s.recordings,
            "records": s.records,
            "engines": len(s.engines),
            "findings": sum(by_kind.values()),
            "findings_by_kind": dict(sorted(by_kind.items())),
            "findings_suppressed": suppressed,
            "records_lost": s.lost_recorded,
            "records_missing": s.records_missing,
            "carried_applied": s.carried_applied,
            "carried_skipped": s.carried_skipped,
            "duplicate_segments": s.duplicate_segments,
            "missing_segments": s.missing_segments,
            "unreadable_segments": s.unreadable_segments,
            "corrupt_chunks": s.corrupt_chunks,
            "corrupt_bytes": s.corrupt_bytes,
            "truncated_bytes": s.truncated_bytes,
            "bad_records": s.bad_records,
            "seq_resets": s.seq_resets,
            "blind_resets": s.blind_resets,
            "sidecar_events": s.sidecar_events,
            "apply_errors": apply_errors,
            "probe_errors": probe_errors,
            "problems": s.problems_total,
            "problem_messages": list(s.problems),
            "options": dict(self.options),
            "options_source": dict(self.options_source),
            "recorded_with_shared_ledger": self.recorded_shared_ledger,
        }


def replay(paths, sinks=()) -> tuple[list[Finding], Replay]:
    """Convenience: replay ``paths`` (files or directories); raises RecordingError for unreadable input."""
    r = Replay(sinks)
    return r.run(paths), r


# --------------------------------------------------------------------------- the command
def _wall(header: SegmentHeader | None, ts_ns: int) -> str:
    if header is None:
        return f"t={ts_ns / 1e9:.6f}"
    secs, ns = divmod(header.wall_ns(ts_ns), 1_000_000_000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{ns // 1000:06d}Z"


def _pages(pages, limit: int = 16) -> str:
    text = ",".join(str(p) for p in pages[:limit])
    return text + (f",... (+{len(pages) - limit})" if len(pages) > limit else "")


def format_finding(finding: Finding, header: SegmentHeader | None) -> str:
    line = f"{_wall(header, finding.first_seen_ns)} {finding.severity.upper()} {finding.kind}: {finding.summary}"
    extra = []
    if finding.pages:
        extra.append(f"pages {_pages(finding.pages)}")
    if finding.exposed:
        extra.append(
            "exposed " + "; ".join(f"{p.rid} ({p.tenant or '?'}) pages {_pages(p.pages)}" for p in finding.exposed)
        )
    return line + (f" [{' | '.join(extra)}]" if extra else "")


class _PrintSink:
    """One readable line per finding, with wall time from the segment being replayed."""

    def __init__(self, replay_ref: list):
        self.replay_ref = replay_ref

    def send(self, finding: Finding) -> None:
        sys.stdout.write(format_finding(finding, self.replay_ref[0].header) + "\n")

    def force_flush(self) -> None:
        sys.stdout.flush()

    def shutdown(self) -> None:
        self.force_flush()


def _print_summary(s: dict) -> None:
    kinds = ", ".join(f"{k} {n}" for k, n in s["findings_by_kind"].items())
    lines = [
        f"replayed {s['segments']} segment(s) of {s['recordings']} recording(s): {s['records']} records "
        f"from {s['engines']} engine(s)",
        f"findings: {s['findings']}"
        + (f" ({kinds})" if kinds else "")
        + (f"; {s['findings_suppressed']} repeats suppressed" if s["findings_suppressed"] else ""),
        f"lost records: {s['records_lost']} dropped by the engines (ring full, recorded live); "
        f"{s['records_missing']} missing from the recording",
    ]
    damage = [
        f"{n} {k.replace('_', ' ')}"
        for k in (
            "corrupt_chunks",
            "corrupt_bytes",
            "truncated_bytes",
            "bad_records",
            "duplicate_segments",
            "missing_segments",
            "unreadable_segments",
            "seq_resets",
            "apply_errors",
        )
        if (n := s[k])
    ]
    lines.append(
        "recording problems: " + (", ".join(damage) + " (details on stderr)" if damage or s["problems"] else "none")
    )
    if s["probe_errors"]:
        lines.append(
            f"probe errors: {s['probe_errors']} recorded by the engines (a hook failed and turned itself off: "
            "what it would have reported is not in the recording)"
        )
    src = s["options_source"]
    lines.append(
        "options: "
        + ", ".join(f"{k}={_option_text(v)} ({src[k]})" for k, v in s["options"].items())
        + (
            "; recorded with a shared ledger, replayed with the embedded one"
            if s["recorded_with_shared_ledger"]
            else ""
        )
    )
    sys.stdout.write("\n".join(lines) + "\n")


def _option_text(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else f"{value:g}"


def exit_status(summary: dict) -> int:
    """0, or 3 when the replay ran but a pipeline or probe error may have cost findings."""
    return 3 if summary["apply_errors"] or summary["probe_errors"] else 0


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def cmd_replay(args) -> int:
    problems_printed = [0]

    def on_problem(message: str) -> None:
        problems_printed[0] += 1
        if problems_printed[0] <= 20:
            sys.stderr.write(f"kvguard replay: warning: {message}\n")
        elif problems_printed[0] == 21:
            sys.stderr.write("kvguard replay: warning: more problems; counted in the summary\n")

    from .sinks.basic import JsonLinesSink

    ref: list = []
    sink = JsonLinesSink(sys.stdout) if args.json else _PrintSink(ref)  # --json: the live sidecar's own sink
    overrides = {
        "isolate_tenants": args.isolate_tenants,
        "detect_prefix_probing": args.detect_prefix_probing,
        "ttft_anomaly": args.ttft_anomaly,
        "orphan_timeout_s": args.orphan_timeout_s,
    }
    if args.orphan_timeout_s is not None and not args.orphan_timeout_s > 0:
        sys.stderr.write(
            f"kvguard replay: error: --orphan-timeout-s: expected seconds > 0, got {args.orphan_timeout_s}\n"
        )
        return 2
    r = Replay([sink], on_problem=on_problem, overrides=overrides)
    ref.append(r)
    try:
        plan = r.plan(args.paths)
    except RecordingError as exc:
        sys.stderr.write(f"kvguard replay: error: {exc}\n")
        return 1
    summary = None
    from .progress import progress_bar

    sizes = [_size(path) for path, _header in plan]
    try:
        with progress_bar(total=sum(sizes), unit="B", desc="segments", quiet=args.json, unit_scale=True) as bar:
            for (path, _header), size in zip(plan, sizes):
                r.replay_segment(path)
                bar.update(size)
        summary = r.summary()
        if args.html:
            write_html(r, args.html)
        if args.json:
            sys.stdout.write(json.dumps({"summary": summary}) + "\n")
        else:
            _print_summary(summary)
        sys.stdout.flush()
    except BrokenPipeError:  # `kvguard replay ... | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return exit_status(summary or r.summary())


def write_html(r: Replay, out_dir: str) -> list[str]:
    """``--html DIR``: the incident view (sidecar/incident_view.py) of every incident the replay
    holds at its end, one standalone file each, and an index.html linking them; the paths go to
    stderr (stdout may be --json's). An incident id met again in a later recording run (the
    sidecar restarted) gets the run's number in its file name."""
    from . import incident_view

    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    listed: list[dict] = []
    names: dict[str, str] = {}
    for run, pipeline in enumerate(r.pipelines):
        for inc in pipeline.incidents.incidents.values():
            name = f"{inc.id}.html" if inc.id not in names else f"{inc.id}-run{run}.html"
            path = incident_view.write_standalone(pipeline, inc, os.path.join(out_dir, name))
            names.setdefault(inc.id, name)
            listed.append({**inc.to_dict(), "_file": name})
            written.append(path)
    index = os.path.join(out_dir, "index.html")
    with open(index, "w", encoding="utf-8") as f:
        f.write(incident_view.render_list(listed, href=lambda d: d["_file"]))
    sys.stderr.write(f"kvguard replay: incident views: {len(written)} file(s), index {index}\n")
    return written


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "replay",
        help="re-run detection offline over recorded segment files",
        description="Replay recorded segments (files, or directories of kvguard-*.kvgrec) through the same "
        "detection pipeline as the live sidecar, in recording order. The settings that change verdicts "
        "(--isolate-tenants, --detect-prefix-probing, --ttft-anomaly, --orphan-timeout-s) are taken from the recording, where the "
        "live sidecar wrote its own; a flag given here overrides the recording's value, and a recording "
        "without them (format 1) uses the flags, else the sidecar's defaults. The summary names each "
        "value's source. Exit 0 when it ran (with or without findings), 3 when it ran but a pipeline "
        "error or a recorded probe error may have cost findings, 1 when an input cannot be read, 2 for "
        "a bad flag value.",
    )
    p.add_argument(
        "--isolate-tenants",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="report prefix-cache pages written by one tenant and read by another (cross_tenant_prefix_share); "
        "default: as recorded, else off",
    )
    p.add_argument(
        "--detect-prefix-probing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="report one tenant walking another's cached prompt (prefix_probing; implied by --isolate-tenants); "
        "default: as recorded, else off",
    )
    p.add_argument(
        "--ttft-anomaly",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the ttft_anomaly detector; default: as recorded, else on",
    )
    p.add_argument(
        "--orphan-timeout-s",
        type=float,
        default=None,
        help="seconds before a reserved transfer whose prefill never reported is an orphan_transfer; "
        "default: as recorded, else 120",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="FILE",
        help="segment files, recording directories or incident bundles (kvguard bundle)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='one JSON object per finding (as `kvguard sidecar --json`), then one {"summary": ...} line',
    )
    p.add_argument(
        "--html",
        metavar="DIR",
        default=None,
        help="write the incident view (a page-ownership timeline, standalone HTML) of each incident "
        "the replay ends with into DIR, one file per incident, and DIR/index.html linking them",
    )
    p.set_defaults(func=cmd_replay)

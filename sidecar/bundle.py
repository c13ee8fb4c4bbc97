"""``kvguard bundle``: one incident, everything the engine team needs about it, in one file.

An SRE hands the engine team one ``.tar.gz`` (docs/operations.md, "Handing an incident to
the engine team"; the layout in docs/api.md, "Incident bundles"):

``MANIFEST.json`` (first member)
    format name and version, the incident, where the bundle came from, every other member
    with its size, sha256 and what it is, the recording window, the replay check, and
    ``gaps``: everything the bundle could not include, and why. Never silent.
``SHA256SUMS``
    the same digests for ``sha256sum -c`` after ``tar xzf``.
``incident.json``
    the incident with its first findings (``GET /v1/incidents/{id}``) and the other
    incidents of its reader on its engine (a short transfer behind an unwritten read).
``timeline.json``
    the page-ownership timeline the incident view draws: the history's events on the
    incident's pages, the reader's reads, the parties named (``incident_view.gather``).
``transfers.json``
    both ends' facts of the reader's transfer(s) as this sidecar's ledger holds them, and
    with the shared (Redis) ledger the facts each pod published for the room.
``versions.json`` / ``settings.json``
    kvguard's and each engine's versions (HELLO); the sidecar's settings, secrets redacted
    (sidecar/secrets.py ``redact_settings``).
``incident.html``
    the standalone incident view (``incident_view``; what ``write_standalone`` writes).
``recording/kvguard-*.kvgrec``
    the recorded record stream around the incident: ``kvguard replay BUNDLE`` (or on the
    extracted files) re-runs detection over it. Present only where the sidecar records
    (``--record-dir``) or the bundle is made from a recording.

Privacy: every member holds what the wire contract carries (page ids, counts, digests,
request ids, tenant labels, engine identity: docs/wire-format.md), never token ids, text
or KV bytes; the settings hold no secret (tests/sidecar/test_bundle.py and the engine
test assert it on real bundles).

Building is split so that a live sidecar holds its lock only to copy: ``collect`` (under
the lock) copies plain data out of the pipeline; ``write`` (unlocked) copies the recording's
segments, checks the replay when asked, and packs the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field

from kvguard.engine_hooks import wire

from . import incident_view
from .ledger.lanes import rank_of, room_of
from .recorder import RecordingError, SegmentHeader, SegmentReader

FORMAT = "kvguard-bundle"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
SUMS = "SHA256SUMS"
RECORDING_DIR = "recording"
DEFAULT_BEFORE_S = 120.0  # recorded time kept before the incident (and before its reader began)
DEFAULT_MAX_RECORDING_BYTES = 256 << 20
MAX_MANIFEST_BYTES = 4 << 20  # a manifest larger than this is not one of ours

WHAT = {
    "incident.json": "the incident and its first findings, and the other incidents of its reader",
    "timeline.json": "the page-ownership timeline: history events on the incident's pages, the reader's reads",
    "transfers.json": "both ends' transfer facts for the reader's room(s): this sidecar's ledger, the shared ledger",
    "versions.json": "kvguard's version and each engine's (HELLO: engine, version, model, pool, context)",
    "settings.json": "the sidecar's settings, secrets redacted",
    "incident.html": "the incident view, standalone HTML (open in a browser)",
}


class NoSuchIncident(LookupError):
    """The incident is not in the sidecar's store (or in the recording's replay)."""


@dataclass
class Segment:
    """One recording segment to copy: its first ``size`` bytes (a segment being written grows)."""

    path: str
    header: SegmentHeader
    size: int

    @property
    def name(self) -> str:  # a segment still open is complete up to ``size``: closed in the bundle
        base = os.path.basename(self.path)
        return base[: -len(".open")] if base.endswith(".open") else base


@dataclass
class Contents:
    """What goes into a bundle, copied out of a pipeline (plain data: safe to use unlocked)."""

    incident: dict
    picture: incident_view.IncidentPicture
    transfers: dict
    versions: dict
    settings: dict
    source: dict
    segments: list[Segment] = field(default_factory=list)
    recording: dict = field(default_factory=dict)  # the window and what was selected
    gaps: list[dict] = field(default_factory=list)  # {"what", "why"}: what the bundle lacks

    def gap(self, what: str, why: str) -> None:
        self.gaps.append({"what": what, "why": why})


# ------------------------------------------------------------------------------ collecting
def collect(
    pipeline,
    incident,
    *,
    source: dict,
    settings: dict,
    segments: list[Segment] | None,
    no_recording_why: str = "",
    before_s: float = DEFAULT_BEFORE_S,
    max_recording_bytes: int = DEFAULT_MAX_RECORDING_BYTES,
    hellos=(),
) -> Contents:
    """Copy what a bundle holds about ``incident`` out of ``pipeline``. Under the sidecar's lock
    for a live one. ``segments``: the recording run the incident belongs to, oldest first
    (None: there is no recording, and ``no_recording_why`` says why); ``hellos``: HELLOs of
    engines that are gone from the pipeline (a replay's end)."""
    picture = incident_view.gather(pipeline, incident)
    inc = dict(picture.incident)
    inc["related"] = picture.related
    c = Contents(
        incident=inc,
        picture=picture,
        transfers=_transfers(pipeline, inc, picture),
        versions=_versions(pipeline, hellos),
        settings=settings,
        source=source,
    )
    if picture.history_events == 0:
        c.gap("timeline.json", "the sidecar keeps no event history (--history-events 0)")
    elif not picture.events and not picture.reads:
        c.gap("timeline.json", "the event history holds no event of this incident any more (it rotated past it)")
    elif picture.events_total > len(picture.events) or picture.reads_total > len(picture.reads):
        c.gap(
            "timeline.json",
            f"bounded: the newest {len(picture.events)} of {picture.events_total} page events and "
            f"{len(picture.reads)} of {picture.reads_total} reads",
        )
    if picture.pages_total > len(picture.pages):
        c.gap("timeline.json", f"the first {len(picture.pages)} of the {picture.pages_total} pages are drawn")
    if segments is None:
        c.gap(RECORDING_DIR, no_recording_why or "no recording")
    else:
        c.segments, c.recording = _select(
            segments, _window_start(pipeline, incident, before_s), _window_end(incident), max_recording_bytes, c
        )
    return c


def _window_start(pipeline, incident, before_s: float) -> int:
    """Where the recording kept should begin: ``before_s`` before the incident or its reader's
    begin, whichever is earlier (the reader's row was built from its begin on)."""
    start = incident.first_seen_ns
    if incident.reader:
        key = wire.request_key(incident.reader["rid"])
        for t in pipeline.engines.values():
            info = t.requests.get(key)
            if info is not None and info.begin_ns:
                start = min(start, info.begin_ns)
    return start - int(before_s * 1e9)


def _window_end(incident) -> int:
    return max(incident.last_seen_ns, incident.resolved_ns or 0)


def _select(segments: list[Segment], start_ns: int, end_ns: int, max_bytes: int, c: Contents):
    """The run's segments covering [start_ns, end_ns] (segment i covers its creation time up to
    segment i+1's), the oldest left out first past ``max_bytes``."""
    segs = sorted(segments, key=lambda s: s.header.segment_index)
    if not segs:
        c.gap(RECORDING_DIR, "the recording holds no segment of this incident's run (deleted by retention?)")
        return [], {"window_start_ns": start_ns, "window_end_ns": end_ns, "segments": 0}
    first = max([i for i, s in enumerate(segs) if s.header.created_monotonic_ns <= start_ns], default=0)
    last = max([i for i, s in enumerate(segs) if s.header.created_monotonic_ns <= end_ns], default=first)
    chosen = segs[first : max(first, last) + 1]
    # a run recorded from its segment 0 holds everything its sidecar saw (a sidecar's pipeline starts
    # empty with its recording): nothing is missing. A later first segment means retention deleted some
    if segs[0].header.segment_index > 0 and segs[0].header.created_monotonic_ns > start_ns:
        c.gap(
            RECORDING_DIR,
            f"the recording's oldest segment left starts "
            f"{(segs[0].header.created_monotonic_ns - start_ns) / 1e9:.1f} s after the window's start: "
            f"segments 0..{segs[0].header.segment_index - 1} of the run were deleted by retention",
        )
    cut = 0
    while len(chosen) > 1 and sum(s.size for s in chosen) > max_bytes:
        cut += chosen.pop(0).size
    if cut:
        c.gap(
            RECORDING_DIR,
            f"the oldest {cut} bytes of the window were left out (over the bundle's recording bound of {max_bytes} bytes)",
        )
    return chosen, {
        "window_start_ns": start_ns,
        "window_end_ns": end_ns,
        "recording_id": f"{segs[0].header.recording_id:016x}",
        "segments": len(chosen),
        "first_segment_index": chosen[0].header.segment_index,
        "last_segment_index": chosen[-1].header.segment_index,
        "bytes": sum(s.size for s in chosen),
    }


def _rooms(inc: dict) -> list[int]:
    rooms = []
    for d in [inc, *inc.get("related", [])]:
        room = (d.get("reader") or {}).get("bootstrap_room")
        if room is not None and room not in rooms:
            rooms.append(int(room))
    return rooms


def _digests(d) -> dict:
    out = {}
    for alg, parts in d.by_alg.items():
        out[str(alg)] = {
            "complete": d.complete(alg),
            "value": f"{d.value(alg):016x}" if d.complete(alg) else None,
            "parts": [
                {
                    "head_start": h,
                    **{k: v for k, v in dataclasses.asdict(p).items() if k != "digest"},
                    "digest": f"{p.digest:016x}",
                }
                for h, p in sorted(parts.items())
            ],
        }
    return out


def _room_facts(state, held_as: str) -> dict:
    from .ledger.memory import REMOTE_ENGINE, _reserved

    reserved = _reserved(state) if state.reserved_pages is not None else None
    return {
        "room": room_of(state.room),
        "rank": rank_of(state.room),  # the tensor-parallel rank pair this story is (sidecar/ledger/lanes.py)
        "held_as": held_as,
        "sender": {
            "rid": state.sender_rid,
            "tenant": state.sender_tenant,
            "key": f"{state.sender_key:016x}" if state.sender_key else None,
            "engine": "peer pod (shared ledger)" if state.sender_engine == REMOTE_ENGINE else state.sender_engine,
            "began": state.sender_began,
            "gave_up": state.sender_gave_up,
            "ended": state.sender_ended,
            "chunks": [dataclasses.asdict(ch) | {"digest": f"{ch.digest:016x}"} for ch in state.chunks],
            "chunks_from_peer_pod": sorted(list(x) for x in state.remote_chunks),
            "digests": _digests(state.sender_digest),
        },
        "receiver": {
            "key": f"{state.receiver_key:016x}" if state.receiver_key else None,
            "engine": state.receiver_engine,
            "reserved_tokens": state.reserved_tokens,
            "reserved_pages": None if reserved is None else [int(p) for p in reserved],
            "reserved_row_base": state.reserved_row_base,
            "done_status": state.done_status,
            "ended_before_done": state.receiver_ended,
            "digests": _digests(state.receiver_digest),
        },
        "digests_compared": state.compared,
        "orphan_reported": state.orphan_reported,
        "warmup": state.warmup,
        "overflowed": state.overflowed,
    }


def _transfers(pipeline, inc: dict, picture) -> dict:
    ledger = pipeline.ledger
    rooms = []
    tables = (("live", ledger.rooms), ("pending", ledger.pending), ("closed", ledger.closed))
    wanted = set(_rooms(inc))
    # every rank pair's story of each room (one scan: a bundle is made on demand, not per record)
    lanes: dict[int, set[int]] = {room: {room} for room in wanted}
    for _name, table in tables:
        for key in table:
            if room_of(key) in wanted:
                lanes[room_of(key)].add(key)
    for room in _rooms(inc):
        for key in sorted(lanes[room]):
            held = None
            for name, table in tables:
                state = table.get(key)
                if state is not None:
                    held = _room_facts(state, name)
                    break
            if held is None and key != room:
                continue
            if held is None:
                held = {"room": room, "held_as": None}
                if room in ledger.forgotten:
                    held["why"] = "evicted while its receiver waited (the ledger's bound): its result was unverified"
                else:
                    held["why"] = "no longer held (closed rooms are kept for the last few thousand transfers)"
            rooms.append(held)
    return {
        "ledger": "shared" if pipeline.shared_ledger is not None else "memory",
        "rooms": rooms,
        "transfer_evidence": picture.transfer(),
        # filled by ``add_shared_facts`` where the sidecar uses the shared ledger
        "shared_ledger": None,
    }


def add_shared_facts(contents: Contents, shared_ledger) -> None:
    """The facts each pod published for the incident's rooms, read from the store now (one round
    trip per store node, on a client of its own: not the ingest thread's state, nor the ledger
    thread's connections). A failure is a gap."""
    from .ledger.shared import SIDES

    rooms = [r["room"] for r in contents.transfers["rooms"]]
    out: dict = {"url": shared_ledger.display_url, "cluster": shared_ledger.cluster, "this_pod": shared_ledger.pod}
    try:
        answers = shared_ledger.read_rooms(rooms)
    except Exception as exc:  # noqa: BLE001 - Redis down is a gap in the bundle, not a failed bundle
        contents.gap("transfers.json", f"the shared ledger could not be read ({type(exc).__name__}: {exc})")
        out["rooms"] = None
        contents.transfers["shared_ledger"] = out
        return
    out["rooms"] = []
    for room, held in zip(rooms, answers):
        entry: dict = {"room": room}
        for side in SIDES:
            facts = []
            for pod, raw in held[side]:
                try:
                    facts.append({"pod": pod, "facts": json.loads(raw) if raw else None})
                except ValueError:
                    facts.append({"pod": pod, "facts": None, "why": "not JSON"})
            entry[side] = facts
        if held["decided"]:
            entry["decided_sending_requests"] = held["decided"]
        if not entry["sender"] and not entry["receiver"]:
            entry["why"] = (
                "no facts under the room's key: deleted once decode decided the transfer (the shared ledger "
                "keeps undecided rooms for its TTL)"
            )
        out["rooms"].append(entry)
    contents.transfers["shared_ledger"] = out


def _hello_dict(engine_id, h) -> dict:
    return {
        "engine": engine_id,
        "role": getattr(h.role, "name", str(h.role)).lower(),
        "rank": h.tp_rank,
        "pid": h.pid,
        "engine_name": h.engine_name,
        "engine_version": h.engine_version,
        "model": h.model,
        "kvguard_version": h.kvguard_version,
        "page_size": h.page_size,
        "pool_pages": h.pool_pages,
        "pool_tokens": h.pool_tokens,
        "context_len": h.context_len,
        "max_req_input_len": h.max_req_input_len,
    }


def _versions(pipeline, hellos) -> dict:
    engines = []
    seen = set()
    for t in pipeline.engines.values():
        if t.hello is not None:
            entry = _hello_dict(t.engine_id, t.hello)
            entry["coverage"] = [
                {"component": e.component, "status": e.status, "missing": list(e.missing)} for e in t.stats().coverage
            ]
            engines.append(entry)
            seen.add(t.engine_id)
    for engine_id, h in hellos:
        if engine_id not in seen:
            engines.append(_hello_dict(engine_id, h) | {"gone": True})
    return {
        "kvguard": kvguard_version(),
        "wire_contract": f"{wire.VERSION}.{wire.WIRE_MINOR}",
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "engines": engines,
    }


def kvguard_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvguard")
    except metadata.PackageNotFoundError:
        from kvguard import __version__

        return __version__


# ------------------------------------------------------------------------------ segments
def run_segments(paths: list[str], recording_id: int | None = None) -> list[Segment]:
    """The segments among ``paths`` of one recording run (``recording_id``; None: the newest
    run), with their sizes now. Unreadable ones are skipped (retention deletes files)."""
    segs = []
    for path in paths:
        try:
            reader = SegmentReader(path)
        except RecordingError:
            continue
        reader.close()
        segs.append(Segment(path, reader.header, reader.size))
    if recording_id is None and segs:
        recording_id = max(segs, key=lambda s: s.header.created_realtime_ns).header.recording_id
    return [s for s in segs if s.header.recording_id == recording_id]


# ------------------------------------------------------------------------------ writing
def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=False, default=_default) + "\n").encode()


def _default(value):
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def _timeline(pic) -> dict:
    parties = {f"{k:016x}": v for k, v in pic.parties.items()}

    def named(e: dict) -> dict:
        out = {k: v for k, v in e.items() if k != "key"}
        if e.get("key"):
            out["req_key"] = f"{e['key']:016x}"
            party = pic.parties.get(e["key"])
            if party is not None:
                out["rid"], out["tenant"] = party["rid"], party["tenant"]
        return out

    return {
        "engine": pic.engine_id,
        "pages": pic.pages,
        "pages_total": pic.pages_total,
        "page_events": [named(e) for e in pic.events],
        "page_events_total": pic.events_total,
        "reader_reads": pic.reads,
        "reader_reads_total": pic.reads_total,
        "parties": parties,
        "history_capacity_used": pic.history_events,
        "note": "ts_ns: the engines' CLOCK_MONOTONIC; aux: seq_len for READ, row_start for ASSIGN, "
        "prompt_tokens for REQ_BEGIN, sent_tokens for TRANSFER_WRITE, the free kind for FREE",
    }


def _stage(contents: Contents, staging: str) -> None:
    """Every member as a file under ``staging`` (segments copied up to their size then)."""
    pic = contents.picture
    files = {
        "incident.json": _json_bytes(contents.incident),
        "timeline.json": _json_bytes(_timeline(pic)),
        "transfers.json": _json_bytes(contents.transfers),
        "versions.json": _json_bytes(contents.versions),
        "settings.json": _json_bytes(contents.settings),
        # what incident_view.write_standalone writes, rendered from the picture taken under the lock
        "incident.html": incident_view.render_incident(pic, api_base=None).encode(),
    }
    for name, data in files.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    if contents.segments:
        os.makedirs(os.path.join(staging, RECORDING_DIR), exist_ok=True)
    copied = []
    for seg in contents.segments:
        try:
            with open(seg.path, "rb") as src, open(os.path.join(staging, RECORDING_DIR, seg.name), "wb") as dst:
                left = seg.size
                while left > 0:
                    block = src.read(min(left, 1 << 20))
                    if not block:
                        break
                    dst.write(block)
                    left -= len(block)
            copied.append(seg)
        except OSError as exc:  # deleted by retention meanwhile: said, never silent
            contents.gap(f"{RECORDING_DIR}/{seg.name}", f"could not be copied: {exc}")
            try:
                os.unlink(os.path.join(staging, RECORDING_DIR, seg.name))
            except OSError:
                pass
    contents.segments = copied


def _members(staging: str) -> list[dict]:
    out: list[dict] = []
    for root, _dirs, names in os.walk(staging):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, staging).replace(os.sep, "/")
            if rel in (MANIFEST, SUMS):
                continue
            digest = _sha256_file(path)
            what = WHAT.get(rel) or (
                "a recording segment (kvguard replay)" if rel.startswith(RECORDING_DIR + "/") else ""
            )
            out.append({"name": rel, "bytes": os.path.getsize(path), "sha256": digest.hexdigest(), "what": what})
    out.sort(key=lambda m: (m["name"].startswith(RECORDING_DIR + "/"), m["name"]))
    return out


def _sha256_file(path: str):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest


def _pack(staging: str, manifest: dict, out_path: str) -> None:
    """MANIFEST.json first (a reader finds it without reading the rest), then SHA256SUMS, then
    the members in the manifest's order; written to a temporary name and renamed."""
    tmp = f"{out_path}.part-{os.getpid()}"
    mtime = int(time.time())
    try:
        with tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as tar:
            sums = "".join(f"{m['sha256']}  {m['name']}\n" for m in manifest["members"]).encode()
            for name, data in ((MANIFEST, _json_bytes(manifest)), (SUMS, sums)):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), mtime, 0o644
                tar.addfile(info, io.BytesIO(data))
            for m in manifest["members"]:
                info = tar.gettarinfo(os.path.join(staging, m["name"]), arcname=m["name"])
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mode = 0o644
                with open(os.path.join(staging, m["name"]), "rb") as f:
                    tar.addfile(info, f)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _manifest(contents: Contents, members: list[dict], check: dict) -> dict:
    inc = contents.incident
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kvguard_version": contents.versions.get("kvguard"),
        "incident": {
            k: inc.get(k) for k in ("id", "kind", "severity", "state", "engine", "reader", "summary", "tenants_exposed")
        },
        "source": contents.source,
        "members": members,
        "recording": contents.recording or None,
        "replay_check": check,
        "gaps": contents.gaps,
        "privacy": "page ids, counts, digests, request ids, tenant labels, engine identity and settings "
        "(secrets redacted); no token ids, text or KV bytes",
    }


NOT_CHECKED = {"checked": False, "why": "not asked"}


def write(contents: Contents, out_path: str, *, check: bool = True, shared_ledger=None) -> dict:
    """Stage, optionally check that the recording reproduces the incident, and pack the bundle
    at ``out_path``; returns its manifest. Unlocked (it copies files and may replay)."""
    if shared_ledger is not None:
        add_shared_facts(contents, shared_ledger)
    elif contents.transfers.get("ledger") == "shared":
        contents.gap("transfers.json", "the shared ledger's own copy of the facts was not read (no client here)")
    staging = tempfile.mkdtemp(prefix="kvguard-bundle-", dir=os.path.dirname(os.path.abspath(out_path)) or None)
    try:
        _stage(contents, staging)
        if contents.segments:
            result = replay_check(os.path.join(staging, RECORDING_DIR), contents.incident) if check else NOT_CHECKED
        else:
            result = {"checked": False, "why": "no recording in the bundle"}
        manifest = _manifest(contents, _members(staging), result)
        _pack(staging, manifest, out_path)
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ------------------------------------------------------------------------------ the replay check
def replay_check(recording_dir: str, incident: dict) -> dict:
    """Replay the bundle's recording and compare: the same incident id, and its first findings
    equal to the incident's, field for field (``Finding.to_dict``)."""
    from .replay import Replay

    r = Replay([])
    try:
        r.run([recording_dir])
    except RecordingError as exc:
        return {"checked": True, "reproduces": False, "why": str(exc)}
    found = None
    for pipeline in r.pipelines:
        found = pipeline.incidents.incidents.get(incident["id"]) or found
    summary = r.summary()
    out = {
        "checked": True,
        "replay": {
            k: summary[k]
            for k in ("segments", "records", "engines", "findings_by_kind", "records_missing", "problems", "options")
        },
    }
    if found is None:
        return out | {"reproduces": False, "why": f"the replay raised no incident {incident['id']}"}
    want, got = incident.get("findings") or [], found.findings
    equal = sum(1 for a, b in zip(want, got) if a == b)
    out |= {"findings_compared": len(want), "findings_equal": equal}
    if want and got and want[0] == got[0]:
        return out | {"reproduces": True}
    return out | {"reproduces": False, "why": "the replay's first finding of the incident differs from the live one"}


# ------------------------------------------------------------------------------ reading bundles
def read_manifest(path: str) -> dict | None:
    """The manifest of a bundle at ``path``, or None when it is not a kvguard bundle."""
    try:
        with tarfile.open(path, "r:gz") as tar:
            first = tar.next()
            if first is None or first.name != MANIFEST or not first.isfile() or first.size > MAX_MANIFEST_BYTES:
                return None
            f = tar.extractfile(first)
            manifest = json.loads(f.read()) if f is not None else None
    except (OSError, tarfile.TarError, ValueError, EOFError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def extract(path: str, dest: str, only_recording: bool = False) -> list[str]:
    """Extract the bundle's members (its recording only, with ``only_recording``) into ``dest``,
    checking each against the manifest's sha256; returns the paths extracted. RecordingError
    names what is wrong (a member changed, one missing, a path outside the bundle)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise RecordingError(f"{path}: not a kvguard bundle")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise RecordingError(
            f"{path}: bundle format version {manifest.get('format_version')}, this kvguard reads {FORMAT_VERSION}"
        )
    wanted = {
        m["name"]: m for m in manifest["members"] if not only_recording or m["name"].startswith(RECORDING_DIR + "/")
    }
    out = []
    with tarfile.open(path, "r:gz") as tar:
        for info in tar:
            m = wanted.pop(info.name, None)
            if m is None:
                continue
            name = os.path.normpath(info.name)
            if not info.isfile() or name.startswith("..") or os.path.isabs(name):
                raise RecordingError(f"{path}: member {info.name!r} is not a plain file inside the bundle")
            target = os.path.join(dest, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            digest = hashlib.sha256()
            src = tar.extractfile(info)
            assert src is not None  # (a regular file)
            with open(target, "wb") as dst:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
            if digest.hexdigest() != m["sha256"]:
                raise RecordingError(f"{path}: member {info.name} does not match the manifest's sha256")
            out.append(target)
    if wanted:
        raise RecordingError(f"{path}: members listed in the manifest are missing: {', '.join(sorted(wanted))}")
    return out


def recheck(path: str) -> dict:
    """Replay the recording of the bundle at ``path`` and write the result into its manifest
    (the sidecar's route does not replay: it would take CPU from ingestion). Returns the manifest."""
    manifest = read_manifest(path)
    if manifest is None:
        raise RecordingError(f"{path}: not a kvguard bundle")
    staging = tempfile.mkdtemp(prefix="kvguard-bundle-", dir=os.path.dirname(os.path.abspath(path)) or None)
    try:
        extract(path, staging)
        if os.path.isdir(os.path.join(staging, RECORDING_DIR)):
            with open(os.path.join(staging, "incident.json"), encoding="utf-8") as f:
                incident = json.load(f)
            manifest["replay_check"] = replay_check(os.path.join(staging, RECORDING_DIR), incident)
        _pack(staging, manifest, path)
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def describe(manifest: dict, path: str) -> str:
    """What ``kvguard bundle`` prints on stderr: the file, its contents, the check, the gaps."""
    inc = manifest["incident"]
    lines = [
        f"kvguard bundle: {path}: incident {inc['id']} ({inc['kind']}, {inc['severity']}, {inc['state']})",
        f"  {len(manifest['members'])} member(s): "
        + ", ".join(m["name"] for m in manifest["members"] if not m["name"].startswith(RECORDING_DIR + "/")),
    ]
    rec = manifest.get("recording")
    if rec:
        lines.append(f"  recording: {rec['segments']} segment(s), {rec['bytes']} bytes (kvguard replay {path})")
    check = manifest.get("replay_check") or {}
    if check.get("checked"):
        if check.get("reproduces"):
            lines.append(
                f"  replay check: the recording reproduces the incident "
                f"({check.get('findings_equal')} of {check.get('findings_compared')} findings equal)"
            )
        else:
            lines.append(f"  replay check: does NOT reproduce the incident: {check.get('why')}")
    for g in manifest.get("gaps", []):
        lines.append(f"  not included: {g['what']}: {g['why']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the two sources
def from_sidecar(
    sidecar,
    incident_id: str,
    out_path: str,
    *,
    before_s: float = DEFAULT_BEFORE_S,
    max_recording_bytes: int = DEFAULT_MAX_RECORDING_BYTES,
    check: bool = False,
) -> dict:
    """A bundle of a live sidecar's incident (the HTTP route). The lock is held only while the
    pipeline is copied and the recording flushed; ``check`` (replaying in this process) is off
    for the route: ``kvguard bundle --api`` checks the file it saves instead."""
    recorder = getattr(sidecar, "recorder", None)
    with sidecar.lock:
        inc = sidecar.pipeline.incidents.incidents.get(incident_id)
        if inc is None:
            raise NoSuchIncident(incident_id)
        segs = None
        if recorder is not None and hasattr(recorder, "segments"):
            recorder.flush()  # the open segment holds every record applied so far, in whole chunks
            # sizes taken now (headers only: a few ms): the open segment grows once the lock is released
            segs = run_segments(recorder.segments, recorder.recording_id)
        contents = collect(
            sidecar.pipeline,
            inc,
            source={"kind": "sidecar", "pid": os.getpid()},
            settings=sidecar_settings(sidecar),
            segments=segs,
            no_recording_why="the sidecar records nothing (start it with --record-dir): the bundle holds "
            "the history's timeline, not a replayable recording",
            before_s=before_s,
            max_recording_bytes=max_recording_bytes,
        )
    return write(contents, out_path, check=check, shared_ledger=getattr(sidecar, "shared_ledger", None))


def from_recording(
    paths,
    incident_id: str,
    out_path: str,
    *,
    before_s: float = DEFAULT_BEFORE_S,
    max_recording_bytes: int = DEFAULT_MAX_RECORDING_BYTES,
    check: bool = True,
    on_problem=None,
) -> dict:
    """A bundle of an incident found by replaying a recording (files, directories or a bundle):
    the replay's pipeline gives the incident, its timeline and transfer facts; the recording's
    own settings and engines' HELLOs the rest; the window is cut from the incident's run."""
    from .replay import Replay

    r = Replay([], on_problem=on_problem)
    plan = r.plan(paths)
    runs: list[int] = []  # the recording id of each of r.pipelines (one per run, in plan order)
    for path, header in plan:
        if not runs or runs[-1] != header.recording_id:
            runs.append(header.recording_id)
        r.replay_segment(path)
    found = None
    for index, pipeline in enumerate(r.pipelines):
        if incident_id in pipeline.incidents.incidents:
            found = (index, pipeline)
    if found is None:
        raise NoSuchIncident(incident_id)
    index, pipeline = found
    run_id = runs[index] if index < len(runs) else None
    summary = r.summary()
    settings = {
        "options": summary["options"],
        "options_source": summary["options_source"],
        "recorded_with_shared_ledger": summary["recorded_with_shared_ledger"],
        "note": "a recording carries the settings that change verdicts only; the sidecar's other settings are not in it",
    }
    hellos = [(eid, key[3]) for eid, key in r._hello.items()] if index == len(r.pipelines) - 1 else []
    segs = [Segment(path, header, _size(path)) for path, header in plan if header.recording_id == run_id]
    contents = collect(
        pipeline,
        pipeline.incidents.incidents[incident_id],
        source={
            "kind": "recording",
            "inputs": [os.path.basename(os.fspath(p)) for p in paths],
            "recording_problems": summary["problems"],
        },
        settings=settings,
        segments=segs,
        before_s=before_s,
        max_recording_bytes=max_recording_bytes,
        hellos=hellos,
    )
    if summary["recorded_with_shared_ledger"]:
        contents.gap(
            "transfers.json",
            "recorded with a shared ledger: the peer pod's facts are not in a recording, so the replay "
            "(and these transfer facts) hold this pod's side only",
        )
    return write(contents, out_path, check=check)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def sidecar_settings(sidecar) -> dict:
    """The sidecar's settings for a bundle: what the command line gave it (``sidecar.settings``,
    set by ``kvguard sidecar``, already redacted) and what the pipeline runs with."""
    from .secrets import environment_settings

    p = sidecar.pipeline
    out = {
        "command_line": getattr(sidecar, "settings", None),
        "verdict_options": p.verdict_options(),
        "history_events": p.history.capacity if p.history is not None else 0,
        "ledger": "memory" if sidecar.shared_ledger is None else sidecar.shared_ledger.display_url,
        "recording": None
        if getattr(sidecar, "recorder", None) is None
        else {
            "dir": getattr(sidecar.recorder, "directory", None),
            "max_bytes": getattr(sidecar.recorder, "max_bytes", None),
            "max_age_s": getattr(sidecar.recorder, "max_age_s", None),
        },
        "environment": environment_settings(os.environ),
    }
    return out


def default_out(incident_id: str) -> str:
    return f"kvguard-bundle-{incident_id}.tar.gz"


def _stderr(text: str) -> None:
    sys.stderr.write(text + "\n")

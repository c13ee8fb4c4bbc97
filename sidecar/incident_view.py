"""The incident view: one incident as a page-ownership timeline an SRE can look at (issue 37).

Two steps, so the renderer is a pure function and the sidecar's lock is held only to copy:

* ``gather(pipeline, incident)`` copies what the pipeline already holds about the incident
  into plain data (an :class:`IncidentPicture`): the incident with its first findings, the
  other incidents of the same reader on the same engine (the short transfer behind an
  ``unwritten_read``), and the bounded history's events (sidecar/history.py) on the
  incident's pages and the reader's reads. Call it under ``sidecar.lock``.
* ``render_incident(picture)`` and ``render_list(incidents)`` turn that into one HTML
  document with inline SVG: pages on one axis, time on the other; per page its owners
  (ASSIGN .. FREE) and writes coloured by request, frees and reallocations marked; the
  reader's reads over the pages it read; the transfer's reserved vs sent range; the
  finding's summary. No script, no external resource (the API serves it with ``CSP``);
  every text is escaped. The picture is bounded (``MAX_PAGES`` pages, ``MAX_EVENTS``
  events, ``MAX_READS`` reads): the page says what it left out.

It names nothing the finding does not: the requests and tenants shown are the incident's
reader and exposed parties, and whoever else wrote the same pages in the history window
(the finding's own evidence); no prompt text, no KV bytes.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvguard.engine_hooks import wire

from .history import Event, History

MAX_PAGES = 200  # page rows drawn
MAX_EVENTS = 20_000  # page events drawn (the newest)
MAX_READS = 400  # reader reads drawn (the newest)
MAX_RELATED = 10
# the response header the API sends with every view: nothing loads, nothing runs
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"
PALETTE = [
    "#d62728",
    "#1f77b4",
    "#2ca02c",
    "#9467bd",
    "#ff7f0e",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#393b79",
    "#637939",
]
OTHER = "#b0b0b0"  # requests beyond the palette, and unknown writers
FREE_NAMES = {0: "free", 1: "evict", 2: "abort"}


@dataclass
class IncidentPicture:
    """What the view draws, copied out of the pipeline (plain data; safe to use unlocked)."""

    incident: dict  # Incident.to_dict(with_findings=True)
    related: list[dict] = field(default_factory=list)  # same reader, same engine, other kinds
    engine_id: int | None = None
    pages: list[int] = field(default_factory=list)  # the rows drawn, ascending
    pages_total: int = 0  # the pages the incident names (before MAX_PAGES)
    events: list[dict] = field(default_factory=list)  # {"ts_ns", "event", "page", "key", "gen", "aux"}
    events_total: int = 0  # events on those pages in the history (before MAX_EVENTS)
    reads: list[dict] = field(default_factory=list)  # the reader's READs: {"ts_ns", "seq_len"}
    reads_total: int = 0
    parties: dict[int, dict] = field(default_factory=dict)  # req_key -> {"rid", "tenant", "role"}
    history_events: int = 0  # the history ring's size (0: no history kept)
    generated_ns: int = 0  # wall clock when gathered

    def transfer(self) -> dict | None:
        """The transfer's reserved vs sent evidence: this incident's, else a related one's."""
        for inc in [self.incident, *self.related]:
            ev = inc.get("evidence") or {}
            if "reserved_tokens" in ev and "sent_tokens" in ev:
                return {"incident": inc["id"], "kind": inc["kind"], **ev}
        return None


# ---------------------------------------------------------------------------------- gathering
def _tracker_for(pipeline, engine: dict):
    """The incident's engine by (role, rank, pid): one process may hold several engines' probes
    (a prefill and a decode in one test process, vLLM's workers), so the pid alone is not enough."""
    for t in pipeline.engines.values():
        ref = pipeline.engine_ref(t)
        if t.hello is not None and (ref.role, ref.rank, ref.pid) == (engine["role"], engine["rank"], engine["pid"]):
            return t
    return None


def _engine_from_history(history: History, reader_key: int, pages: list[int]) -> int | None:
    """The engine of an incident whose engine has gone (a replay's end, the demo): the one where
    the reader was assigned the incident's pages, else the one where it has events at all."""
    if not reader_key:
        return None
    ev = history.events[: history.size]
    mine = ev[ev["req_key"] == np.uint64(reader_key)]
    if len(mine) == 0:
        return None
    if pages:
        assigned = mine[(mine["event"] == int(Event.ASSIGN)) & np.isin(mine["page"], pages)]
        if len(assigned):
            return _most_common(assigned["engine"])
    return _most_common(mine["engine"])


def _most_common(engine_ids: np.ndarray) -> int:
    """The engine id named most often. (Not ``np.bincount``: engine ids are 32-bit values, and
    a count per possible id allocated gigabytes.)"""
    ids, counts = np.unique(engine_ids, return_counts=True)
    return int(ids[counts.argmax()])


def _ordered(history: History, mask: np.ndarray) -> np.ndarray:
    """The masked events in time order (ring order: positions after the write cursor are older)."""
    live = history.events[: history.size]
    hits = np.flatnonzero(mask)
    start = history.total % history.capacity if history.total > history.capacity else 0
    order = np.argsort((hits - start) % max(history.size, 1), kind="stable")
    return live[hits[order]]


def gather(pipeline, incident, now_ns: int | None = None) -> IncidentPicture:
    """Copy what the view needs about ``incident`` (an incidents.Incident) out of ``pipeline``.
    Call it under the sidecar's lock; the result holds no reference into the pipeline."""
    inc = incident.to_dict(with_findings=True)
    pic = IncidentPicture(inc, generated_ns=now_ns if now_ns is not None else time.time_ns())
    reader = inc.get("reader") or None
    reader_rid = reader["rid"] if reader else ""
    # the other incidents of this reader on this engine (a short transfer and what it left unwritten)
    if reader_rid:
        for other in pipeline.incidents.incidents.values():
            if (
                other.id != incident.id
                and other.reader is not None
                and other.reader.get("rid") == reader_rid
                and other.engine == incident.engine
            ):
                pic.related.append(other.to_dict())
                if len(pic.related) >= MAX_RELATED:
                    break
    # the parties the finding names, by the key the records carry
    reader_key = wire.request_key(reader_rid) if reader_rid else 0
    if reader_key:
        pic.parties[reader_key] = {"rid": reader_rid, "tenant": (reader or {}).get("tenant") or "", "role": "reader"}
    for inc_dict in [inc, *pic.related]:
        for party in inc_dict["exposed"]:
            key = wire.request_key(party["rid"])
            pic.parties.setdefault(key, {"rid": party["rid"], "tenant": party["tenant"] or "", "role": "exposed"})
    # the pages: the incident's, its exposed parties', a related transfer's unfilled ones, and
    # the rest of the reader's row in the history (the pages the transfer did fill)
    pages: set[int] = set(inc["pages"])
    for party in inc["exposed"]:
        pages.update(party["pages"])
    for other in pic.related:
        pages.update(other["pages"])
    history = pipeline.history
    tracker = _tracker_for(pipeline, inc["engine"])
    engine_id = None
    if history is not None and history.size:
        pic.history_events = history.size
        engine_id = (
            tracker.engine_id if tracker is not None else _engine_from_history(history, reader_key, sorted(pages))
        )
    pic.engine_id = engine_id
    if history is not None and engine_id is not None and reader_key:
        ev = history.events[: history.size]
        own = (
            (ev["engine"] == engine_id)
            & (ev["req_key"] == np.uint64(reader_key))
            & (ev["pool"] == 0)
            & (ev["event"] == int(Event.ASSIGN))
        )
        pages.update(int(p) for p in np.unique(ev["page"][own]))
    pic.pages_total = len(pages)
    pic.pages = sorted(pages)[:MAX_PAGES]
    if history is None or engine_id is None:
        return pic
    ev = history.events[: history.size]
    on_engine = ev["engine"] == engine_id
    if pic.pages:
        page_mask = on_engine & (ev["pool"] == 0) & np.isin(ev["page"], pic.pages)
        found = _ordered(history, page_mask)
        pic.events_total = len(found)
        found = found[-MAX_EVENTS:]
        pic.events = [
            {
                "ts_ns": int(e["ts_ns"]),
                "event": Event(int(e["event"])).name,
                "page": int(e["page"]),
                "key": int(e["req_key"]),
                "gen": int(e["gen"]),
                "aux": int(e["aux"]),
            }
            for e in found
        ]
    if reader_key:
        read_mask = on_engine & (ev["req_key"] == np.uint64(reader_key)) & (ev["event"] == int(Event.READ))
        reads = _ordered(history, read_mask)
        pic.reads_total = len(reads)
        pic.reads = [{"ts_ns": int(e["ts_ns"]), "seq_len": int(e["aux"])} for e in reads[-MAX_READS:]]
    # the other writers' names, where the engine still knows them
    directory = tracker.requests if tracker is not None else None
    for e in pic.events:
        key = e["key"]
        if key and key not in pic.parties:
            info = directory.get(key) if directory is not None else None
            pic.parties[key] = {
                "rid": info.rid if info is not None else f"key:{key:016x}",
                "tenant": (info.tenant if info is not None else "") or "",
                "role": "other",
            }
    return pic


# ---------------------------------------------------------------------------------- rendering
def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _pages_text(pages: list[int], limit: int = 12) -> str:
    """Runs of consecutive pages: 2-64, 70, 80-90."""
    runs: list[str] = []
    ordered = sorted(pages)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(f"{ordered[i]}-{ordered[j]}" if j > i else f"{ordered[i]}")
        i = j + 1
    more = f", … ({len(runs) - limit} more runs)" if len(runs) > limit else ""
    return ", ".join(runs[:limit]) + more


def _wall(ts_ns: int) -> str:
    """A wall-clock time; the records' clock may be the engine's monotonic one (not a date)."""
    if not ts_ns:
        return "-"
    if ts_ns < 10**18:  # before 2001: a monotonic clock
        return f"{ts_ns / 1e9:.3f} s (engine clock)"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts_ns / 1e9))


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em;margin:.2em 0}h2{font-size:1.1em;margin:1.2em 0 .4em}
.sev-critical{color:#fff;background:#c0392b}.sev-warning{color:#222;background:#f1c40f}.sev-info{background:#ddd}
.badge{padding:.1em .5em;border-radius:.3em;font-size:.85em;font-weight:600}
.summary{font-size:1.05em;background:#f7f7f7;border-left:4px solid #c0392b;padding:.6em .8em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left}
th{background:#f0f0f0}.sw{display:inline-block;width:.9em;height:.9em;border-radius:.2em;vertical-align:middle}
.note{color:#666;font-size:.85em}.mono{font-family:ui-monospace,monospace}
svg{border:1px solid #ddd;background:#fff}
"""


def _document(title: str, body: str) -> str:
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{_e(CSP)}\">"
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def _colours(pic: IncidentPicture) -> dict[int, str]:
    """One colour per request: the reader first, then the exposed parties, then other writers."""
    order = sorted(pic.parties, key=lambda k: ({"reader": 0, "exposed": 1}.get(pic.parties[k]["role"], 2), k))
    return {key: PALETTE[i] if i < len(PALETTE) else OTHER for i, key in enumerate(order)}


def _party_text(pic: IncidentPicture, key: int) -> str:
    p = pic.parties.get(key)
    if p is None:
        return f"key:{key:016x}" if key else "(no request)"
    return f"request {p['rid']} (tenant {p['tenant'] or '?'})"


def _svg(pic: IncidentPicture, colours: dict[int, str]) -> str:
    """Pages (rows) x time (columns): ownership spans, writes, frees, reallocations, reads."""
    if not pic.pages or not (pic.events or pic.reads):
        return "<p class='note'>No events of these pages are left in the sidecar's history window.</p>"
    times = [e["ts_ns"] for e in pic.events] + [r["ts_ns"] for r in pic.reads]
    t0, t1 = min(times), max(times)
    span = max(t1 - t0, 1)
    row = 14 if len(pic.pages) <= 40 else (8 if len(pic.pages) <= 100 else 5)
    left, top, width = 90, 40, 1100
    reader_row = top  # the reader's own row above the pages: its reads
    pages_top = top + 24
    height = pages_top + row * len(pic.pages) + 40
    index = {p: i for i, p in enumerate(pic.pages)}

    def x(ts: int) -> float:
        return left + (ts - t0) / span * width

    def y(page: int) -> int:
        return pages_top + index[page] * row

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{left + width + 50}' height='{height}' "
        f"role='img' aria-label='page ownership timeline' font-size='11' font-family='sans-serif'>"
    ]
    # axes: time ticks (ms after the first event drawn) and page labels
    for i in range(6):
        ts = t0 + span * i // 5
        anchor = "end" if i == 5 else "middle"  # (the last label would run past the picture's edge)
        out.append(
            f"<line x1='{x(ts):.1f}' y1='{top - 6}' x2='{x(ts):.1f}' y2='{height - 30}' stroke='#eee'/>"
            f"<text x='{x(ts):.1f}' y='{height - 14}' text-anchor='{anchor}'>{(ts - t0) / 1e6:.3g} ms</text>"
        )
    label_every = 1 if row >= 14 else max(1, 12 // row)
    for i, page in enumerate(pic.pages):
        if i % label_every == 0:
            out.append(f"<text x='{left - 6}' y='{y(page) + row - 2}' text-anchor='end'>page {page}</text>")
    reader = pic.incident.get("reader") or None
    reader_key = wire.request_key(reader["rid"]) if reader else 0
    if reader:
        out.append(
            f"<text x='{left - 6}' y='{reader_row + 12}' text-anchor='end' font-weight='bold'>reader</text>"
            f"<rect x='{left}' y='{reader_row}' width='{width}' height='16' fill='#fafafa' stroke='#ddd'/>"
        )
    # per page: ownership spans (ASSIGN -> FREE / next ASSIGN), writes, frees, reallocations
    by_page: dict[int, list[dict]] = {}
    for e in pic.events:
        by_page.setdefault(e["page"], []).append(e)
    for page, evs in by_page.items():
        yy = y(page)
        owner, since = 0, evs[0]["ts_ns"]
        last_write: dict[int, float] = {}
        freed_before = False

        def span_to(end: int, owner: int, since: int, yy: int = yy, page: int = page) -> None:
            if owner:
                w = max(x(end) - x(since), 1.0)
                out.append(
                    f"<rect x='{x(since):.1f}' y='{yy}' width='{w:.1f}' height='{row - 1}' "
                    f"fill='{colours.get(owner, OTHER)}' fill-opacity='0.35'>"
                    f"<title>page {page}: owned by {_e(_party_text(pic, owner))}</title></rect>"
                )

        for e in evs:
            kind, ts = e["event"], e["ts_ns"]
            if kind == "ASSIGN":
                span_to(ts, owner, since)
                owner, since = e["key"], ts
            elif kind in ("WRITE", "TRANSFER_WRITE"):
                key = e["key"] or owner
                xx = x(ts)
                if abs(last_write.get(key, -10.0) - xx) < 1.5:
                    continue  # coalesce writes closer than a pixel and a half
                last_write[key] = xx
                what = "transfer write" if kind == "TRANSFER_WRITE" else "write"
                out.append(
                    f"<rect x='{xx:.1f}' y='{yy}' width='2' height='{row - 1}' fill='{colours.get(key, OTHER)}'>"
                    f"<title>page {page}: {what} by {_e(_party_text(pic, key))}</title></rect>"
                )
            elif kind == "FREE":
                span_to(ts, owner, since)
                owner, since, freed_before = 0, ts, True
                out.append(
                    f"<rect x='{x(ts):.1f}' y='{yy}' width='1.5' height='{row - 1}' fill='#000'>"
                    f"<title>page {page}: {FREE_NAMES.get(e['aux'], 'free')} (generation {e['gen']})</title></rect>"
                )
            elif kind == "ALLOC":
                span_to(ts, owner, since)
                owner, since = 0, ts
                if freed_before:  # reallocated after a free: the old KV is still there
                    out.append(
                        f"<path d='M{x(ts):.1f},{yy + row - 1} l3,-{row - 1} l3,{row - 1}z' fill='#555'>"
                        f"<title>page {page}: reallocated (generation {e['gen']}), not zeroed</title></path>"
                    )
        span_to(t1, owner, since)
    # the reader's reads: a mark on the reader's row, a line over the pages it read
    read_pages = [p for p in pic.incident["pages"] if p in index]
    colour = colours.get(reader_key, OTHER)
    for r in pic.reads:
        xx = x(r["ts_ns"])
        out.append(
            f"<rect x='{xx - 1:.1f}' y='{reader_row + 2}' width='3' height='12' fill='{colour}'>"
            f"<title>read by {_e(_party_text(pic, reader_key))}: {r['seq_len']} tokens</title></rect>"
        )
        if read_pages:
            y0, y1 = y(min(read_pages)), y(max(read_pages)) + row
            out.append(
                f"<line x1='{xx:.1f}' y1='{y0}' x2='{xx:.1f}' y2='{y1}' stroke='{colour}' stroke-width='1' "
                "stroke-dasharray='3,2' stroke-opacity='0.8'/>"
            )
    out.append("</svg>")
    return "".join(out)


def _transfer_html(pic: IncidentPicture) -> str:
    t = pic.transfer()
    if t is None:
        return ""
    sent, reserved = int(t.get("sent_tokens") or 0), int(t.get("reserved_tokens") or 0)
    sent_pages, reserved_pages = t.get("sent_pages"), t.get("reserved_pages")
    width = 600
    full = max(sent, reserved, 1)
    w_res, w_sent = width * reserved / full, max(width * sent / full, 2 if sent else 0)
    direction = "more than reserved" if t.get("direction") == "more_sent" else "short"
    text = f"prefill sent {sent} of {reserved} reserved tokens"
    if sent_pages is not None and reserved_pages is not None:
        text += f" ({sent_pages} of {reserved_pages} pages)"
    return (
        "<h2>The transfer</h2>"
        f"<p id='transfer'><b>{_e(text)}</b> <span class='note'>({_e(direction)}; {_e(t['kind'])}, "
        f"incident {_e(t['incident'])})</span></p>"
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width + 20}' height='46' font-size='11' "
        "font-family='sans-serif' role='img' aria-label='reserved vs sent'>"
        f"<rect x='10' y='6' width='{w_res:.1f}' height='14' fill='#f4d03f' stroke='#b7950b'>"
        f"<title>reserved: {reserved} tokens</title></rect>"
        f"<rect x='10' y='6' width='{w_sent:.1f}' height='14' fill='#1f77b4'><title>sent: {sent} tokens</title></rect>"
        f"<text x='10' y='36'>blue: sent ({sent} tokens) · yellow: reserved ({reserved} tokens), "
        "never written by the transfer</text></svg>"
    )


def render_incident(pic: IncidentPicture, api_base: str | None = "/v1") -> str:
    """The incident as one HTML document. ``api_base`` None: standalone (no API links)."""
    inc = pic.incident
    colours = _colours(pic)
    eng = inc["engine"]
    reader = inc.get("reader") or None
    sev = inc["severity"]
    parts = [
        f"<h1>{_e(inc['kind'])} <span class='badge sev-{_e(sev)}'>{_e(sev)}</span> "
        f"<span class='badge'>{_e(inc['state'])}</span></h1>",
        f"<p class='mono'>{_e(inc['id'])} · {_e(eng['role'])} rank {_e(eng['rank'])} (pid {_e(eng['pid'])}) · "
        f"first seen {_e(_wall(inc['first_seen_ns']))} · {_e(inc['count'])} finding(s)</p>",
        f"<p class='summary' id='summary'>{_e(inc['summary'])}</p>",
    ]
    if inc.get("resolution"):
        parts.append(f"<p class='note'>resolved: {_e(inc['resolution'])}</p>")
    # who: the reader and the exposed parties
    rows = []
    if reader:
        key = wire.request_key(reader["rid"])
        rows.append(
            f"<tr id='reader-row'><td><span class='sw' style='background:{colours.get(key, OTHER)}'></span> reader</td>"
            f"<td class='mono'>{_e(reader['rid'])}</td><td>{_e(reader.get('tenant') or '?')}</td>"
            f"<td>{_e(_pages_text(inc['pages']))}</td></tr>"
        )
    for party in inc["exposed"]:
        key = wire.request_key(party["rid"])
        rows.append(
            f"<tr class='exposed-row'><td><span class='sw' style='background:{colours.get(key, OTHER)}'></span> "
            f"exposed</td><td class='mono'>{_e(party['rid'])}</td><td>{_e(party['tenant'] or '?')}</td>"
            f"<td>{_e(_pages_text(party['pages']))}</td></tr>"
        )
    if rows:
        parts.append("<h2>Who</h2><table><tr><th>role</th><th>request</th><th>tenant</th><th>pages</th></tr>")
        parts += rows
        parts.append("</table>")
    if inc["tenants_exposed"]:
        parts.append(
            f"<p id='tenants-exposed'>Tenants whose KV was exposed: <b>{_e(', '.join(inc['tenants_exposed']))}</b></p>"
        )
    parts.append(_transfer_html(pic))
    # the timeline
    parts.append("<h2>Page ownership timeline</h2>")
    notes = []
    if pic.pages_total > len(pic.pages):
        notes.append(f"showing the first {len(pic.pages)} of {pic.pages_total} pages")
    if pic.events_total > len(pic.events):
        notes.append(f"showing the newest {len(pic.events)} of {pic.events_total} page events")
    if pic.reads_total > len(pic.reads):
        notes.append(f"showing the newest {len(pic.reads)} of {pic.reads_total} reads")
    if pic.history_events:
        notes.append(f"from the sidecar's event history (the newest {pic.history_events} events of all engines)")
    else:
        notes.append("the sidecar keeps no event history: no timeline")
    parts.append(f"<p class='note'>{_e('; '.join(notes))}.</p>")
    parts.append(_svg(pic, colours))
    legend = ["<p class='note'>"]
    for key, colour in colours.items():
        legend.append(f"<span class='sw' style='background:{colour}'></span> {_e(_party_text(pic, key))} &nbsp; ")
    legend.append(
        "<br>shaded: owned (ASSIGN until FREE) · bar: a write · black bar: free · "
        "grey triangle: reallocated, not zeroed · dashed line: a read by the reader</p>"
    )
    parts.append("".join(legend))
    if pic.related:
        parts.append("<h2>Related incidents (same reader, same engine)</h2><ul>")
        for r in pic.related:
            link = (
                f"<a href='{_e(api_base)}/incidents/{_e(r['id'])}/view'>{_e(r['id'])}</a>"
                if api_base is not None
                else _e(r["id"])
            )
            parts.append(f"<li>{link} <b>{_e(r['kind'])}</b> ({_e(r['severity'])}): {_e(r['summary'])}</li>")
        parts.append("</ul>")
    findings = inc.get("findings") or []
    if findings:
        parts.append(f"<h2>Findings ({len(findings)} kept of {_e(inc['count'])})</h2><ul>")
        for f in findings:
            parts.append(f"<li><span class='mono'>{_e(_wall(f['first_seen_ns']))}</span> {_e(f['summary'])}</li>")
        parts.append("</ul>")
    foot = f"generated {_wall(pic.generated_ns)} by kvguard"
    if api_base is not None:
        foot += f" · JSON: {api_base}/incidents/{inc['id']}"
        parts.append(f"<p class='note'><a href='{_e(api_base)}/incidents/view'>all incidents</a></p>")
    parts.append(f"<p class='note'>{_e(foot)}</p>")
    return _document(f"kvguard {inc['kind']} {inc['id']}", "\n".join(parts))


def render_list(incidents: list[dict], api_base: str | None = "/v1", href=None) -> str:
    """Open and recent incidents (Incident.to_dict), each linking to its view. ``href(incident)``
    overrides the link (standalone: the file beside it)."""
    rows = []
    for inc in incidents:
        link = href(inc) if href is not None else f"{api_base}/incidents/{inc['id']}/view"
        reader = inc.get("reader") or {}
        rows.append(
            f"<tr><td><a href='{_e(link)}'>{_e(inc['id'])}</a></td><td>{_e(inc['state'])}</td>"
            f"<td><span class='badge sev-{_e(inc['severity'])}'>{_e(inc['severity'])}</span></td>"
            f"<td>{_e(inc['kind'])}</td><td>{_e(inc['engine']['role'])} rank {_e(inc['engine']['rank'])}</td>"
            f"<td class='mono'>{_e(reader.get('rid', ''))}</td><td>{_e(reader.get('tenant', ''))}</td>"
            f"<td>{_e(', '.join(inc['tenants_exposed']))}</td><td>{_e(inc['count'])}</td>"
            f"<td>{_e(_wall(inc['last_seen_ns']))}</td></tr>"
        )
    table = (
        "<table><tr><th>incident</th><th>state</th><th>severity</th><th>kind</th><th>engine</th>"
        "<th>reader</th><th>reader tenant</th><th>tenants exposed</th><th>findings</th><th>last seen</th></tr>"
        + "".join(rows)
        + "</table>"
        if rows
        else "<p>No incidents.</p>"
    )
    return _document("kvguard incidents", f"<h1>kvguard incidents</h1>{table}")


# ---------------------------------------------------------------------------------- standalone files
EXPOSURE_FIRST = ("unwritten_read", "foreign_read", "use_after_free")


def headline_incident(pipeline):
    """The incident a person should look at first: the one that exposed the most parties (a
    read over other requests' KV), else the first critical one, else the first one; None: none."""
    incidents = list(pipeline.incidents.incidents.values())
    if not incidents:
        return None
    exposing = [i for i in incidents if i.kind in EXPOSURE_FIRST and i.exposed]
    if exposing:
        return max(exposing, key=lambda i: (len(i.exposed), len(i.pages)))
    critical = [i for i in incidents if i.severity == "critical"]
    return (critical or incidents)[0]


def write_standalone(pipeline, incident, path: str) -> str:
    """The incident view as a standalone HTML file at ``path`` (no API links); returns the path.
    Call it where nothing else changes the pipeline (under the sidecar's lock, or after it stopped)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_incident(gather(pipeline, incident), api_base=None))
    return path

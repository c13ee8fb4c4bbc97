"""The incident view (issue 37): /v1/incidents/{id}/view and /v1/incidents/view as HTML with
inline SVG behind the /v1 token, and `kvguard replay --html DIR`.

The incident is the one of tests/sidecar/test_pipeline.py through real Probes, rings and a
Sidecar (with a Recorder, so the same run replays): acme and globex write decode pages, free
them, then initech reserves 16 tokens over those pages, prefill sends 1 token, and
initech's read of the other 15 is an unwritten_read exposing acme and globex."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar import incident_view
from kvguard.sidecar.api import create_app
from kvguard.sidecar.cli import main
from kvguard.sidecar.recorder import Recorder
from kvguard.sidecar.service import Sidecar
from tests.support.pd_records import pd_request, slots

TOKEN = "view-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def the_incident(ring_dir, probes_ring_bytes: int = 1 << 16):
    """The short-transfer incident written into ``ring_dir`` by the engine-side probes."""
    prefill = Probes(RingWriter(str(ring_dir), probes_ring_bytes))
    decode = Probes(RingWriter(str(ring_dir), probes_ring_bytes))
    prefill.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.19", "tiny")
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny")
    for rid, tenant, room, pages in (("r-acme", "acme", 11, [1, 2]), ("r-globex", "globex", 12, [3, 4])):
        last = pd_request(prefill, decode, rid, tenant, room, pages, 8, 8)
        decode.request_end(rid, "length", 1000, 2000, 1, "")
        decode.pages_freed(slots(pages + [last]))
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)
    return prefill, decode


def watched(base):
    """A Sidecar (recording into base/rec) that watched the incident."""
    sidecar = Sidecar(str(base / "rings"), slack_ns=0, recorder=Recorder(base / "rec", max_bytes=1 << 22))
    the_incident(base / "rings")
    sidecar.run_once(flush=True)
    sidecar.run_once(flush=True)
    return sidecar, base / "rec"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    sidecar, rec_dir = watched(tmp_path_factory.mktemp("view"))
    client = TestClient(create_app(sidecar, CollectorRegistry(), api_token=TOKEN))
    yield client, sidecar, rec_dir
    sidecar.stop()


def unwritten(sidecar):
    (inc,) = [i for i in sidecar.pipeline.incidents.incidents.values() if i.kind == "unwritten_read"]
    return inc


def text_of(page: str) -> str:
    """What a person reads: tags out, entities decoded, whitespace collapsed."""
    page = re.sub(r"<(style|title)[^>]*>.*?</\1>", " ", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_the_view_shows_reader_exposed_tenants_pages_and_the_short_transfer(live):
    client, sidecar, _ = live
    inc = unwritten(sidecar)
    r = client.get(f"/v1/incidents/{inc.id}/view", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp
    assert r.headers["cache-control"] == "no-store"
    page = r.text
    seen = text_of(page)
    assert "unwritten_read" in seen and inc.summary in seen
    reader_row = re.search(r"<tr id='reader-row'>.*?</tr>", page, re.S).group(0)
    assert "r-initech" in reader_row and "initech" in reader_row
    assert "Tenants whose KV was exposed: acme, globex" in seen
    assert seen.count("exposed r-") == 2  # acme's and globex's requests, each a row
    assert "prefill sent 1 of 16 reserved tokens (1 of 4 pages)" in seen
    # the timeline: the pages as rows, their owners' spans and writes, frees, reallocations, reads
    assert "<svg" in page and "<script" not in page.lower()
    for p in (1, 2, 3, 4):
        assert f">page {p}</text>" in page
    assert "owned by request r-acme (tenant acme)" in page and "write by request r-globex (tenant globex)" in page
    assert "reallocated (generation" in page and "read by request r-initech (tenant initech): 17 tokens" in page
    assert "transfer_size_mismatch" in seen  # the related incident, linked
    assert re.search(r"href='/v1/incidents/inc-[0-9a-f]{16}/view'", page)
    # nothing loads from anywhere: no src=, no external href
    assert not re.search(r"\bsrc=", page) and not re.search(r"href='(https?:)?//", page)


def test_the_list_links_to_each_incident_view(live):
    client, sidecar, _ = live
    r = client.get("/v1/incidents/view", headers=AUTH)
    assert r.status_code == 200 and "default-src 'none'" in r.headers["content-security-policy"]
    for inc in sidecar.pipeline.incidents.incidents.values():
        assert f"href='/v1/incidents/{inc.id}/view'" in r.text
    assert "initech" in r.text and "acme, globex" in r.text


def test_the_view_needs_the_token_and_unknown_ids_are_404(live, tmp_path):
    client, sidecar, _ = live
    inc = unwritten(sidecar)
    for path in (f"/v1/incidents/{inc.id}/view", "/v1/incidents/view"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/incidents/inc-0000000000000000/view", headers=AUTH).status_code == 404
    assert client.get("/v1/incidents/not-an-id/view", headers=AUTH).status_code == 422
    assert client.get(f"/v1/incidents/{inc.id}", headers=AUTH).json()["id"] == inc.id  # JSON unchanged
    off = TestClient(create_app(Sidecar(str(tmp_path)), CollectorRegistry(), api_token=None))
    assert off.get(f"/v1/incidents/{inc.id}/view", headers=AUTH).status_code == 403


def test_names_are_escaped():
    inc = {
        "id": "inc-0123456789abcdef",
        "kind": "unwritten_read",
        "severity": "critical",
        "state": "firing",
        "engine": {"role": "decode", "rank": 0, "pid": 1},
        "reader": {"rid": "<script>alert(1)</script>", "tenant": "t'\"><img src=x>", "bootstrap_room": None},
        "first_seen_ns": 0,
        "last_seen_ns": 0,
        "count": 1,
        "summary": "read </p><script>x</script>",
        "pages": [1],
        "tenants_exposed": ["<b>evil</b>"],
        "exposed": [{"rid": "r&1", "tenant": "<b>evil</b>", "pages": [1]}],
        "evidence": {},
        "resolved_ns": 0,
        "resolution": "",
        "findings": [],
    }
    pic = incident_view.IncidentPicture(inc, pages=[1], pages_total=1)
    page = incident_view.render_incident(pic)
    assert "<script" not in page and "<img" not in page and "<b>evil" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "r&amp;1" in page
    listing = incident_view.render_list([inc])
    assert "<script" not in listing and "<img" not in listing


def test_the_picture_is_bounded_and_says_so(monkeypatch, live):
    _, sidecar, _ = live
    monkeypatch.setattr(incident_view, "MAX_PAGES", 2)
    monkeypatch.setattr(incident_view, "MAX_EVENTS", 5)
    with sidecar.lock:
        pic = incident_view.gather(sidecar.pipeline, unwritten(sidecar))
    assert pic.pages == [1, 2] and pic.pages_total >= 4 and len(pic.events) == 5 < pic.events_total
    seen = text_of(incident_view.render_incident(pic))
    assert f"showing the first 2 of {pic.pages_total} pages" in seen
    assert f"showing the newest 5 of {pic.events_total} page events" in seen


def test_replay_html_writes_one_file_per_incident(tmp_path, capsys):
    sidecar, rec_dir = watched(tmp_path)
    sidecar.stop()  # the recording is complete
    out = tmp_path / "html"
    rc = main(["replay", "--json", "--html", str(out), str(rec_dir)])
    assert rc == 0
    captured = capsys.readouterr()
    for line in captured.out.splitlines():  # --json: stdout holds JSON lines only
        assert line.startswith("{")
    ids = {i.id for i in sidecar.pipeline.incidents.incidents.values()}
    files = {p.name for p in out.iterdir()}
    assert files == {f"{i}.html" for i in ids} | {"index.html"}
    page = (out / f"{unwritten(sidecar).id}.html").read_text()
    seen = text_of(page)
    assert "r-initech" in seen and "acme, globex" in seen and "prefill sent 1 of 16 reserved tokens" in seen
    assert ">page 3</text>" in page and "owned by request r-globex (tenant globex)" in page
    assert "/v1/" not in page  # standalone: no links into an API it is not served by
    assert "meta http-equiv='Content-Security-Policy'" in page
    assert str(out / "index.html") in captured.err


def test_the_demo_writes_the_view_of_the_incident_it_shows(tmp_path):
    from kvguard.demo.run import write_view

    sidecar, _ = watched(tmp_path)
    sidecar.stop()
    path = write_view(sidecar.pipeline, str(tmp_path / "work"))
    assert path == str(tmp_path / f"kvguard-demo-{unwritten(sidecar).id}.html")  # the exposing one
    seen = text_of(open(path, encoding="utf-8").read())
    assert "r-initech" in seen and "acme, globex" in seen and "prefill sent 1 of 16 reserved tokens" in seen
    empty = Sidecar(str(tmp_path / "none"))
    assert write_view(empty.pipeline, str(tmp_path / "work2")) is None


def test_the_engine_of_a_gone_incident_is_found_from_history_whatever_its_id():
    # engine ids are 32-bit values (the demo's were ~3.5e9): found by counting the ids named, not
    # by a count per possible id (np.bincount allocated 26 GiB here in the real demo)
    from kvguard.sidecar.history import Event, History
    from kvguard.sidecar.incident_view import _engine_from_history

    h = History(64)
    big, other = 3_505_424_510, 7
    for engine in (big, big, other):
        h.append(1, engine, Event.ASSIGN, req_key=42, pages=np.array([5, 6]))
    h.append(2, other, Event.READ, req_key=42, aux=8)
    assert _engine_from_history(h, 42, [5, 6]) == big
    assert _engine_from_history(h, 42, [99]) == big  # no ASSIGN of those pages: where it has events at all
    assert _engine_from_history(h, 43, [5]) is None

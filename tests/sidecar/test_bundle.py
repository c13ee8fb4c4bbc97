"""``kvguard bundle`` (sidecar/bundle.py, bundle_cli.py) and ``GET /v1/incidents/{id}/bundle``.

A real sidecar drains real rings (the 2026 incident's shape: decode reserves 16 tokens, prefill
sends 1, decode reads pages acme's request wrote) and records them (a real Recorder); the
bundle is made over its real HTTP API (uvicorn), from its recording, and in-process; then the
recording inside it is replayed by ``kvguard replay`` and must give the live findings, field
for field. The engine test (tests/integration/test_incident_engine.py) does the same on real
SGLang engines and checks that no prompt text or token id is in the bundle.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar import bundle
from kvguard.sidecar.api import create_app
from kvguard.sidecar.cli import main
from kvguard.sidecar.recorder import Recorder
from kvguard.sidecar.secrets import redact_settings
from kvguard.sidecar.service import Sidecar
from tests.sidecar.reliability.sidecar_under_test import free_port
from tests.support.pd_records import finish, pd_request

TOKEN = "bundle-test-token-6d1f"
LEDGER_PASSWORD = "ledger-pw-93ab"
OTLP_HEADER = "x-api-key=otlp-secret-77c2"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def live(tmp_path, monkeypatch):
    """A sidecar that saw acme's request, then initech's short transfer read over acme's pages."""
    monkeypatch.setenv("KVGUARD_API_TOKEN", TOKEN)
    monkeypatch.setenv("KVGUARD_LEDGER_PASSWORD", LEDGER_PASSWORD)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", OTLP_HEADER)
    ring_dir, rec_dir = tmp_path / "rings", tmp_path / "rec"
    sidecar = Sidecar(str(ring_dir), slack_ns=0, recorder=Recorder(rec_dir, segment_bytes=4096, max_bytes=1 << 22))
    # what `kvguard sidecar` sets from its command line
    sidecar.settings = redact_settings(
        {"ledger": f"redis://:{LEDGER_PASSWORD}@redis:6379/0", "api_token_file": "/etc/kvguard/api-token"}
    )
    prefill = Probes(RingWriter(str(ring_dir), 1 << 16))
    decode = Probes(RingWriter(str(ring_dir), 1 << 16))
    prefill.hello("prefill", 0, 4, 64, 256, 2048, 2048, "sglang", "0.5.19", "tiny-model")
    decode.hello("decode", 0, 4, 8, 32, 32, 32, "sglang", "0.5.19", "tiny-model")
    last = pd_request(prefill, decode, "r-acme", "acme", 11, [1, 2], 8, 8)
    finish(decode, "r-acme", [1, 2, last])
    sidecar.run_once(flush=True)
    for i in range(40):  # other traffic: the recording rotates (4 KiB segments)
        last = pd_request(prefill, decode, f"r-other-{i}", "globex", 100 + i, [5, 6], 8, 8)
        finish(decode, f"r-other-{i}", [5, 6, last])
        sidecar.run_once(flush=True)
    pd_request(prefill, decode, "r-initech", "initech", 13, [1, 2, 3, 4], 16, 1)
    sidecar.run_once(flush=True)
    yield sidecar, rec_dir
    sidecar.stop()


def incident_of(sidecar, kind="unwritten_read"):
    (inc,) = [i for i in sidecar.pipeline.incidents.incidents.values() if i.kind == kind]
    return inc


def members(path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def test_a_live_bundle_holds_the_incident_its_timeline_transfer_versions_settings_and_view(live, tmp_path):
    sidecar, _ = live
    inc = incident_of(sidecar)
    out = tmp_path / "b.tar.gz"
    manifest = bundle.from_sidecar(sidecar, inc.id, str(out), check=True)
    files = members(out)
    with tarfile.open(out, "r:gz") as tar:
        assert tar.getnames()[:2] == ["MANIFEST.json", "SHA256SUMS"]  # found without reading the rest
    assert json.loads(files["MANIFEST.json"]) == manifest and manifest["format"] == "kvguard-bundle"
    # every member listed with its digest, and SHA256SUMS says the same (sha256sum -c)
    listed = {m["name"]: m for m in manifest["members"]}
    assert set(listed) == set(files) - {"MANIFEST.json", "SHA256SUMS"}
    for name, m in listed.items():
        assert hashlib.sha256(files[name]).hexdigest() == m["sha256"] and m["bytes"] == len(files[name])
    sums = dict(line.split("  ")[::-1] for line in files["SHA256SUMS"].decode().splitlines())
    assert sums == {name: m["sha256"] for name, m in listed.items()}

    incident = json.loads(files["incident.json"])
    assert incident["id"] == inc.id and incident["findings"] == inc.to_dict(with_findings=True)["findings"]
    assert incident["tenants_exposed"] == ["acme"] and incident["reader"]["rid"] == "r-initech"
    assert [r["kind"] for r in incident["related"]] == ["transfer_size_mismatch"]
    timeline = json.loads(files["timeline.json"])
    assert {"r-acme", "r-initech"} <= {e.get("rid") for e in timeline["page_events"]}
    assert timeline["reader_reads"] and set(incident["pages"]) <= set(timeline["pages"])
    (room,) = json.loads(files["transfers.json"])["rooms"]
    assert room["room"] == 13 and room["sender"]["rid"] == "r-initech"
    assert [(c["token_start"], c["token_end"]) for c in room["sender"]["chunks"]] == [(0, 1)]
    assert room["receiver"]["reserved_tokens"] == 16 and room["receiver"]["reserved_pages"] == [1, 2, 3, 4]
    versions = json.loads(files["versions.json"])
    assert {(e["role"], e["engine_name"], e["engine_version"], e["model"]) for e in versions["engines"]} == {
        ("prefill", "sglang", "0.5.19", "tiny-model"),
        ("decode", "sglang", "0.5.19", "tiny-model"),
    }
    settings = json.loads(files["settings.json"])
    assert settings["command_line"]["ledger"] == "redis://***@redis:6379/0"
    assert settings["environment"]["KVGUARD_API_TOKEN"] == "(set, not shown)"
    assert settings["verdict_options"]["orphan_timeout_s"] == 120.0
    html = files["incident.html"].decode()
    assert html.startswith("<!DOCTYPE html>") and "r-initech" in html and "/v1/" not in html
    # the recording: segments of the incident's window, replayed here: the same incident, the same findings
    assert manifest["recording"]["segments"] > 1 and any(n.startswith("recording/") for n in files)
    assert manifest["gaps"] == []  # recorded from the sidecar's start: nothing is missing
    check = manifest["replay_check"]
    assert check["reproduces"] is True and check["findings_equal"] == check["findings_compared"] >= 1
    # nothing secret, anywhere in it
    blob = b"".join(files.values())
    for secret in (TOKEN, LEDGER_PASSWORD, OTLP_HEADER, "otlp-secret"):
        assert secret.encode() not in blob, secret


def test_kvguard_replay_on_the_bundle_or_a_file_from_it_gives_the_live_findings(live, tmp_path, capsys):
    sidecar, _ = live
    inc = incident_of(sidecar)
    out = tmp_path / "b.tar.gz"
    bundle.from_sidecar(sidecar, inc.id, str(out))
    live_finding = inc.to_dict(with_findings=True)["findings"][0]

    assert main(["replay", "--json", str(out)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert live_finding in lines[:-1]
    # the same from the files a person extracts with tar
    extracted = tmp_path / "x"
    with tarfile.open(out, "r:gz") as tar:
        tar.extractall(extracted, filter="data")
    segments = sorted(str(p) for p in (extracted / "recording").iterdir())
    assert main(["replay", "--json", *segments]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert live_finding in lines[:-1]


def test_the_route_serves_the_bundle_behind_the_token_and_404s_an_unknown_incident(live):
    sidecar, _ = live
    inc = incident_of(sidecar)
    client = TestClient(create_app(sidecar, CollectorRegistry(), api_token=TOKEN))
    assert client.get(f"/v1/incidents/{inc.id}/bundle").status_code == 401
    r = client.get(f"/v1/incidents/{inc.id}/bundle", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    assert f"kvguard-bundle-{inc.id}.tar.gz" in r.headers["content-disposition"]
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:gz") as tar:
        manifest = json.loads(tar.extractfile("MANIFEST.json").read())
    # the sidecar does not replay (CPU is ingestion's); `kvguard bundle` checks the file it saves
    assert manifest["incident"]["id"] == inc.id and manifest["replay_check"]["checked"] is False
    r = client.get("/v1/incidents/inc-0000000000000000/bundle", headers=AUTH)
    assert r.status_code == 404 and r.json()["detail"] == "no incident inc-0000000000000000"
    assert client.get(f"/v1/incidents/{inc.id}/bundle?max_recording_mb=0", headers=AUTH).status_code == 422


@pytest.fixture
def served(live):
    sidecar, rec_dir = live
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(sidecar, CollectorRegistry(), api_token=TOKEN), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.02)
    yield sidecar, f"http://127.0.0.1:{port}", rec_dir
    server.should_exit = True
    thread.join()


def test_the_command_fetches_the_bundle_checks_its_replay_and_names_what_it_wrote(served, tmp_path, capsys):
    sidecar, url, _ = served
    inc = incident_of(sidecar)
    out = tmp_path / "handed-over.tar.gz"
    assert main(["bundle", inc.id, "--api", url, "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "replay check: the recording reproduces the incident" in captured.err
    manifest = bundle.read_manifest(str(out))
    assert manifest["replay_check"]["reproduces"] is True
    # the rewritten manifest still matches the members
    files = members(out)
    assert all(hashlib.sha256(files[m["name"]]).hexdigest() == m["sha256"] for m in manifest["members"])


def test_the_command_says_which_incident_is_unknown_and_when_the_sidecar_is_unreachable(served, tmp_path, capsys):
    _, url, _ = served
    assert main(["bundle", "inc-00000000000000ff", "--api", url, "-o", str(tmp_path / "x.tar.gz")]) == 3
    assert f"no incident inc-00000000000000ff on the sidecar at {url}" in capsys.readouterr().err
    closed = f"http://127.0.0.1:{free_port()}"
    assert main(["bundle", "inc-00000000000000ff", "--api", closed, "-o", str(tmp_path / "x.tar.gz")]) == 1
    assert f"cannot reach the sidecar at {closed}" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.tar.gz")
    with pytest.raises(SystemExit) as exc:
        main(["bundle", "not-an-incident"])
    assert exc.value.code == 2


def test_the_command_makes_the_bundle_from_a_recording(live, tmp_path, capsys):
    sidecar, rec_dir = live
    inc = incident_of(sidecar)
    sidecar.recorder.flush()
    out = tmp_path / "from-rec.tar.gz"
    assert main(["bundle", inc.id, "--from-recording", str(rec_dir), "-o", str(out)]) == 0
    manifest = bundle.read_manifest(str(out))
    assert manifest["source"]["kind"] == "recording" and manifest["replay_check"]["reproduces"] is True
    incident = json.loads(members(out)["incident.json"])
    assert incident["findings"] == inc.to_dict(with_findings=True)["findings"]
    capsys.readouterr()
    assert main(["bundle", "inc-00000000000000ff", "--from-recording", str(rec_dir), "-o", str(out)]) == 3
    assert "no incident inc-00000000000000ff in the replay of" in capsys.readouterr().err


def test_what_a_bundle_cannot_hold_is_in_its_manifest_never_silent(live, tmp_path, capsys):
    sidecar, _ = live
    inc = incident_of(sidecar)
    # the window cut down to one segment: said, and the replay check says it no longer reproduces
    out = tmp_path / "cut.tar.gz"
    manifest = bundle.from_sidecar(sidecar, inc.id, str(out), max_recording_bytes=1, check=True)
    assert manifest["recording"]["segments"] == 1
    (gap,) = [g for g in manifest["gaps"] if g["what"] == "recording"]
    assert "were left out" in gap["why"]
    # without acme's writes the replay cannot name whose KV was read: checked, and said
    check = manifest["replay_check"]
    assert check["checked"] is True and check["reproduces"] is False and check["findings_equal"] == 0
    # no recorder at all: the bundle still has everything else, and says there is no recording
    sidecar.recorder, recorder = None, sidecar.recorder
    try:
        out = tmp_path / "norec.tar.gz"
        manifest = bundle.from_sidecar(sidecar, inc.id, str(out))
    finally:
        sidecar.recorder = recorder
    assert not any(m["name"].startswith("recording/") for m in manifest["members"])
    (gap,) = [g for g in manifest["gaps"] if g["what"] == "recording"]
    assert "--record-dir" in gap["why"]
    assert manifest["replay_check"] == {"checked": False, "why": "no recording in the bundle"}
    assert main(["replay", str(out)]) == 1
    assert "the bundle holds no recording" in capsys.readouterr().err

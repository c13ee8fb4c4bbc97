"""``kvguard canary`` against real SGLang prefill/decode pairs serving the echo model.

The incident's configuration (demo/engines.py PDPair defaults: prefill pool
256 tokens, decode pool 1024, context 2048, page size 4, Mooncake over TCP on CPU)
with the echo GPT-2 of the words demo (lag 413, real weights), so KV read from
another request comes back as that request's characters. The canary is pointed at
the pair the way it would be without a router: ``--url DECODE --prefill-url
PREFILL`` (each request posted to both with one bootstrap room, like SGLang's
router; there is no Python router in SGLang 0.5.x to start here).

- 0.5.19 leaks: the canary exits 3 and names tenant A's marker text found in a
  tenant-B answer; the sidecar, watching the same engines, reports the same
  request reading pages that held tenant A's KV (the tenant labels agree).
- 0.5.23 has the fix: the same plan, at the default budget, exits 0.

The 0.5.19 pair runs with a decode waiting timeout of 5 s, the shared 0.5.23 pair with 10 s
(tests/support/shared_pd.py; the harness default is 20 s): on 0.5.23 each over-pool probe waits that
long for KV that never comes.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from kvguard.demo.echo_model import echo_model_dir
from kvguard.demo.engines import PDPair
from kvguard.demo.scenario import WORDS_DEMO
from kvguard.sidecar.cli import main
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.shared_pd import WAITING_TIMEOUT_S as SHARED_WAITING_TIMEOUT_S

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]

WAITING_TIMEOUT_S = 5
TENANT_A, TENANT_B = "kvguard-canary-a", "kvguard-canary-b"


def _pair(version: str, tmp_path, ring_dir=None) -> PDPair:
    # the canary's own router-less PD mode (--url decode --prefill-url prefill) posts to both
    # engines itself, so no router is started in front of the pair
    return PDPair(
        version,
        ring_dir,
        tmp_path / "logs",
        model_dir=echo_model_dir(WORDS_DEMO["lag"]),
        load_format="auto",
        waiting_timeout_s=WAITING_TIMEOUT_S,
        router=False,
    )


def _canary(capsys, pair: PDPair, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["canary", "--url", pair.decode.url, "--prefill-url", pair.prefill.url, "--json", "--seed", "11", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_sglang_0_5_19_pair_leaks_the_victims_markers(tmp_path, capsys, require_sglang):
    require_sglang("0.5.19")
    ring_dir = os.path.join(tmp_path, "rings")
    os.makedirs(ring_dir)
    memory = MemorySink()
    sidecar = Sidecar(ring_dir, sinks=[memory], remove_dead_rings=False).start()
    try:
        with _pair("0.5.19", tmp_path, ring_dir) as pair:
            # victims and over-pool probes only: 6 discovery GETs + 12 probes x 2 servers
            rc, rep = _canary(capsys, pair, "--budget", "30")
            time.sleep(0.5)  # let the sidecar drain the last steps
    finally:
        sidecar.stop()

    assert rc == 3 and rep["verdict"] == "leak", json.dumps(rep, indent=1)[:4000]
    assert rep["requests_sent"] <= 30
    assert rep["servers"][0]["version"] == "0.5.19" and rep["limits"]["pool_tokens"] == 256
    assert "echo" in rep["model"] and "echo model" in rep["model_note"]
    leaked = [r for r in rep["requests"] if r["leak"]]
    assert leaked and all(r["tenant"] == TENANT_B and r["phase"] == "over_pool" and r["status"] == 200 for r in leaked)
    for r in leaked:  # the marker text is tenant A's, named in the finding
        assert len(r["leak"]["fragment"]) >= 10 and r["leak"]["blocks"]
        assert all(b.startswith(("#" + rep["marker_run"], "[" + rep["marker_run"])) for b in r["leak"]["blocks"])
    messages = " ".join(f["message"] for f in rep["findings"] if f["kind"] == "marker_leak")
    assert leaked[0]["leak"]["blocks"][0] in messages
    # the over-length prompts were served: the status check alone would have passed them
    assert any(f["kind"] == "should_have_been_error" for f in rep["findings"])
    assert all(r["ok"] for r in rep["requests"] if r["phase"] == "victim")

    # the sidecar saw the same requests read tenant A's pages, under the same tenant labels
    reads = [f for f in memory.findings if f.kind == "unwritten_read"]
    readers = {f.reader.rid: f for f in reads if f.reader is not None}
    for r in leaked:
        f = readers.get(r["rid"])
        assert f is not None and f.reader.tenant == TENANT_B, (r["rid"], [x.to_dict() for x in reads])
        assert TENANT_A in {p.tenant for p in f.exposed}


def test_sglang_0_5_23_pair_is_clean(shared_pd, capsys):
    """On the session's shared pair (tests/support/shared_pd.py: the same pools and echo model as above,
    its own waiting timeout, with SGLang's router in front, which the canary's PD mode bypasses)."""
    window = shared_pd.window()
    rc, rep = _canary(capsys, shared_pd.pair)  # the default plan and budget
    assert rc == 0 and rep["verdict"] == "clean" and rep["findings"] == [], json.dumps(rep, indent=1)[:4000]
    assert rep["requests_sent"] <= 64 and rep["servers"][0]["version"] == "0.5.23"
    phases = {r["phase"] for r in rep["requests"]}
    assert {"victim", "over_pool", "over_context", "near_pool", "shared_prefix", "abort", "concurrent"} <= phases
    # the fix: over-length prompts fail instead of being answered from someone else's KV
    assert all(not r["ok"] for r in rep["requests"] if r["phase"] in ("over_pool", "over_context"))
    assert all(r["ok"] for r in rep["requests"] if r["phase"] in ("victim", "near_pool", "concurrent"))

    # the sidecar watching the pair agrees: no read of anyone's KV; decode's reservations for the
    # prompts prefill refused are orphans until its waiting timeout, and nothing else is reported
    window.settle()
    rids = {r["rid"] for r in rep["requests"] if r.get("rid")}
    refused = {r["rid"] for r in rep["requests"] if r["phase"] in ("over_pool", "over_context")}
    deadline = time.monotonic() + 3 * SHARED_WAITING_TIMEOUT_S  # an orphan is judged at decode's waiting timeout
    while time.monotonic() < deadline and not any(f.kind == "orphan_transfer" for f in window.findings(rids=rids)):
        time.sleep(0.5)
    window.settle()
    found = window.findings(rids=rids)
    assert {f.kind for f in found} == {"orphan_transfer"}, [f.to_dict() for f in found]
    assert {f.reader.rid for f in found} <= refused, [f.to_dict() for f in found]

"""prefix_probing and the isolation report: one tenant walking another tenant's cached prompt a
token at a time is reported when tenants are declared isolated; shared system prompts, a
tenant's own turns and repeated identical probes are not; the report counts crossings
whatever the switch."""

from __future__ import annotations

import time

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.detectors.probing import PrefixProbingDetector
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

PS = 4  # tokens per page
VICTIM_TOKENS = 64  # acme's cached prompt: 16 pages, slots 4 .. 67 (pages 1 .. 16)


class Engine:
    def __init__(self, tmp_path):
        self.p = Probes(RingWriter(str(tmp_path), 1 << 20))
        self.p.hello("unified", 0, PS, 1024, 1024 * PS, 4096, 4096, "sglang", "0.5.23", "tiny")
        self.next_page = 1
        self.n = 0

    def pages(self, count: int) -> np.ndarray:
        first = self.next_page
        self.next_page += count
        return np.arange(first, first + count)

    def request(self, tenant: str, prompt: int, hit_pages: np.ndarray | None = None) -> np.ndarray:
        """A request of ``prompt`` tokens whose first pages come from the cache (``hit_pages``),
        the rest newly allocated and written; it ends, and the cache keeps its pages."""
        self.n += 1
        rid = f"{tenant}-{self.n}"
        hit = 0 if hit_pages is None else len(hit_pages) * PS
        own = self.pages(-(-(prompt - hit) // PS))
        row = own if hit_pages is None else np.concatenate((hit_pages, own))
        slots = np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in row])[:prompt]
        p = self.p
        p.request_begin(rid, tenant, None, prompt, hit, False)
        p.pages_allocated(own * PS)
        p.rows_assigned(rid, 0, prompt, hit, slots)
        written = slots[hit:]
        p.forward([rid], [prompt], [written], [slots])
        p.request_end(rid, "stop", 1, 2, 1, "")
        return row


def run(tmp_path, isolate: bool):
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0, isolate_tenants=isolate)
    sidecar.run_once(flush=True)
    detector = sidecar.pipeline.detectors.get(PrefixProbingDetector)
    report = detector.report(time.monotonic_ns())
    sidecar.stop()
    return [f for f in sink.findings if f.kind == "prefix_probing"], report


def walk(e: Engine, victim: np.ndarray, prober: str, lengths) -> None:
    """Each probe: the cached prefix recovered so far (``pages`` of the victim's) plus one guessed token."""
    for pages in lengths:
        e.request(prober, pages * PS + 1, victim[:pages])


def test_a_tenant_walking_another_tenants_cached_prompt_is_reported(tmp_path):
    e = Engine(tmp_path)
    victim = e.request("acme", VICTIM_TOKENS)
    walk(e, victim, "eve", [2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    found, report = run(tmp_path, isolate=True)
    (f,) = found
    assert (f.severity, f.reader.tenant) == ("warning", "eve")
    assert [(p.tenant, p.rid) for p in f.exposed] == [("acme", "acme-1")]
    assert f.evidence["probes"] == 8 and f.evidence["hit_lengths_tokens"] == [8, 12, 16, 20]
    assert f.evidence["victim_tenants"] == ["acme"] and len(f.evidence["probing_requests"]) == 8
    assert set(f.pages) <= set(victim.tolist())
    ((row),) = report
    assert (row["reader_tenant"], row["writer_tenant"], row["prefix_hits"]) == ("eve", "acme", 10)
    assert row["reader_requests"] == 10 and row["pages"] == sum([2, 2, 3, 3, 4, 4, 5, 5, 6, 6])


def test_off_by_default_but_the_report_still_counts(tmp_path):
    e = Engine(tmp_path)
    victim = e.request("acme", VICTIM_TOKENS)
    walk(e, victim, "eve", [2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    found, report = run(tmp_path, isolate=False)
    assert found == [] and [(r["reader_tenant"], r["prefix_hits"]) for r in report] == [("eve", 10)]


def test_a_shared_system_prompt_across_tenants_is_not_probing(tmp_path):
    # ten tenants' chats on acme's cached 16-token system prompt: one hit length, and a message after it
    e = Engine(tmp_path)
    system = e.request("acme", 16)
    for i in range(10):
        for _turn in range(3):
            e.request(f"tenant-{i}", 16 + 23, system)
    found, report = run(tmp_path, isolate=True)
    assert found == []
    assert sorted(r["reader_tenant"] for r in report) == [f"tenant-{i}" for i in range(10)]


def test_hits_at_many_lengths_followed_by_real_questions_are_not_probing(tmp_path):
    # another tenant's requests reuse acme's cached documents of several lengths (RAG over a
    # shared corpus), each with a question after it: many hits, many lengths, nothing walked
    e = Engine(tmp_path)
    corpus = e.request("acme", VICTIM_TOKENS)
    for pages in [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]:
        e.request("globex", pages * PS + 30, corpus[:pages])
    found, report = run(tmp_path, isolate=True)
    assert found == [] and [(r["reader_tenant"], r["prefix_hits"]) for r in report] == [("globex", 12)]


def test_repeating_one_probe_or_walking_ones_own_prompt_is_not_probing(tmp_path):
    e = Engine(tmp_path)
    victim = e.request("acme", VICTIM_TOKENS)
    walk(e, victim, "eve", [3] * 12)  # the same hit every time: nothing walked
    walk(e, victim, "acme", [2, 3, 4, 5, 6, 7, 8, 9, 10])  # acme's own prompt
    walk(e, victim, "", [2, 3, 4, 5, 6, 7, 8, 9, 10])  # no tenant label: not judged
    found, report = run(tmp_path, isolate=True)
    assert found == [] and [(r["reader_tenant"], r["prefix_hits"]) for r in report] == [("eve", 12)]


def test_probes_spread_over_more_than_the_window_are_not_one_walk():
    # the rule on its own events: eight walking probes a second apart gather within a 10 s
    # window, and never within a 1 s one
    from kvguard.engine_hooks import wire
    from kvguard.sidecar.detectors.base import At
    from kvguard.sidecar.events import PrefixHit
    from kvguard.sidecar.findings import EngineRef
    from kvguard.sidecar.tracker import EngineTracker, RequestDirectory, RequestInfo

    def probes(window_ns: int) -> list:
        t = EngineTracker(1, RequestDirectory())
        t.on_hello(wire.Hello(wire.Role.UNIFIED, 0, 1, PS, 64, 256, 2048, 250, "sglang", "x", "m", "0"))
        t.requests.begin(RequestInfo(7, rid="acme-1", tenant="acme"))
        d = PrefixProbingDetector(enabled=True, window_ns=window_ns)
        engine = EngineRef("unified", 0, 1)
        found = []
        for i in range(8):
            length = 8 + 4 * (i // 2)
            reader = RequestInfo(100 + i, rid=f"eve-{i}", tenant="eve", prompt_tokens=length + 1)
            t.requests.begin(reader)
            hit = PrefixHit(reader, length, np.array([1, 2]), np.array([7, 7], np.uint64))
            found += d.observe(hit, At(t, engine, 1, i * 10**9))
        return found

    assert len(probes(10 * 10**9)) == 1
    assert probes(10**9) == []


def test_the_isolation_report_is_served_behind_the_token_and_printed_by_the_cli(tmp_path):
    """A real `kvguard sidecar` process watching the walk: /v1/isolation needs the token, and
    `kvguard isolation-report` prints the crossing pair (exit 1: some hit crossed tenants)."""
    import os

    import httpx

    from tests.sidecar.test_sidecar_cli import RunningSidecar, free_port, kvguard

    rings = tmp_path / "rings"
    rings.mkdir()
    e = Engine(rings)
    victim = e.request("acme", VICTIM_TOKENS)
    walk(e, victim, "eve", [2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    port = free_port()
    token = "isolation-test-token"
    env = dict(os.environ, KVGUARD_API_TOKEN=token)
    args = ["--ring-dir", str(rings), "--listen", f"127.0.0.1:{port}", "--isolate-tenants"]
    url = f"http://127.0.0.1:{port}"
    with RunningSidecar(args, port, env=env) as sidecar:
        assert sidecar.healthy
        assert httpx.get(f"{url}/v1/isolation", timeout=5).status_code == 401
        deadline = time.time() + 30
        body: dict = {}
        while time.time() < deadline and not body.get("pairs"):
            body = httpx.get(f"{url}/v1/isolation", headers={"Authorization": f"Bearer {token}"}, timeout=5).json()
            time.sleep(0.2)
        assert body["probing_detector"] is True and body["cross_tenant_hits_total"] == 10
        assert [(p["reader_tenant"], p["writer_tenant"], p["prefix_hits"]) for p in body["pairs"]] == [
            ("eve", "acme", 10)
        ]
        r = kvguard("isolation-report", "--url", url)  # no token: said so, exit 2
        assert r.returncode == 2 and "HTTP 401" in r.stderr and "KVGUARD_API_TOKEN" in r.stderr
        token_file = tmp_path / "token"
        token_file.write_text(token + "\n")
        r = kvguard("isolation-report", "--url", url, "--api-token-file", str(token_file))
        assert r.returncode == 1, r.stderr
        assert "probing detector on" in r.stdout
        (row,) = [line.split() for line in r.stdout.splitlines() if line.startswith("eve")]
        assert row[:3] == ["eve", "acme", "10"]
        r = kvguard("isolation-report", "--url", url, "--api-token-file", str(token_file), "--window-s", "30")
        assert r.returncode == 2 and "60 .. 3600" in r.stderr

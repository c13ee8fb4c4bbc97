"""What an engine holds and what of it kvguard watches (COVERAGE, contract 1.5), and engines
with more than one pool (POOL: a sliding-window pool, a second KV cache group, a state pool),
each pool its own timeline.

Through the real probes, the wire codec and the sidecar's pipeline (and, for the sticky copy,
a real ring and the sidecar service): an unwatched component is said once, with the metrics
to keep it visible; a pool's pages are judged in that pool only, both ways.
"""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingReader, RingWriter
from kvguard.sidecar.api import create_app
from kvguard.sidecar.pipeline import Pipeline
from kvguard.sidecar.service import Sidecar
from tests.support.recording_probes import CaptureWriter, judged

PAGE = 4
WATCHED, PARTIAL, UNWATCHED = wire.CoverageStatus.WATCHED, wire.CoverageStatus.PARTIAL, wire.CoverageStatus.UNWATCHED
OWN, DIGESTS = int(wire.Capability.OWNERSHIP), int(wire.Capability.DIGESTS)


def _engine(writer=None) -> tuple[CaptureWriter, Probes]:
    cap = writer or CaptureWriter()
    p = Probes(cap, page_size=PAGE)
    p.hello("unified", 0, PAGE, 32, 32 * PAGE, 128, 128, "vllm", "0.32.0", "tiny-gemma3", pid=4242)
    return cap, p


def _kinds(found) -> list[str]:
    return [f.kind for f in found]


# --------------------------------------------------------------------------- coverage
def test_an_engine_watched_whole_raises_nothing_and_shows_no_gap():
    cap, p = _engine()
    p.coverage([wire.CoverageItem("kv_pool", WATCHED, OWN | DIGESTS, 0, "MHA pool, bf16")])
    pipeline = Pipeline()
    assert judged(pipeline, cap) == []
    (engine,) = pipeline.engine_stats()
    assert engine.coverage_gaps == 0
    assert [(c.component, c.status, c.watched) for c in engine.coverage] == [
        ("kv_pool", "watched", ("ownership", "digests"))
    ]


def test_an_unwatched_component_is_one_warning_naming_it_and_why_and_stays_visible():
    cap, p = _engine()
    items = [
        wire.CoverageItem("kv_pool", PARTIAL, OWN, DIGESTS, "MLATokenToKVPool: latent digests not defined here"),
        wire.CoverageItem("draft", UNWATCHED, 0, OWN, "EAGLE draft worker: its KV writes are not hooked"),
        wire.CoverageItem("parallel", WATCHED, OWN, 0, "tp 1"),
    ]
    p.coverage(items)
    pipeline = Pipeline()
    (finding,) = judged(pipeline, cap)
    assert (finding.kind, finding.severity) == ("coverage_gap", "warning")
    assert "draft: not watched: EAGLE draft worker" in finding.summary
    assert "kv_pool: partly watched (no digests)" in finding.summary
    assert [u["component"] for u in finding.evidence["unwatched"]] == ["kv_pool", "draft"]
    assert finding.evidence["unwatched"][0]["missing"] == ["digests"]
    assert finding.evidence["watched"] == ["parallel"]
    # the same COVERAGE again (the ring's sticky copy replayed after a sidecar restart), and a part's
    # (vLLM's Worker) with a gap of its own: merged into the engine's account, no second finding
    p.coverage(items)
    p.coverage([wire.CoverageItem("worker", UNWATCHED, 0, OWN, "its forwards are not reported: x")])
    assert judged(pipeline, cap) == []
    assert pipeline.findings_by_kind[("coverage_gap", "warning")] == 1
    (engine,) = pipeline.engine_stats()
    assert engine.coverage_gaps == 3
    assert [c.component for c in engine.coverage] == ["kv_pool", "draft", "parallel", "worker"]


def test_coverage_is_in_metrics_and_v1_engines(tmp_path):
    writer = RingWriter(str(tmp_path), 1 << 16)
    p = Probes(writer, page_size=PAGE)
    p.hello("decode", 0, PAGE, 32, 32 * PAGE, 128, 128, "sglang", "0.5.23", "tiny-dsv2")
    p.coverage(
        [
            wire.CoverageItem("kv_pool", WATCHED, OWN, 0, "MLATokenToKVPool"),
            wire.CoverageItem("state_pool", UNWATCHED, 0, OWN, "MambaPool: not hooked"),
        ]
    )
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    try:
        sidecar.run_once(flush=True)
        client = TestClient(create_app(sidecar, CollectorRegistry(), api_token="t"))
        text = client.get("/metrics").text
        engines = client.get("/v1/engines", headers={"Authorization": "Bearer t"}).json()["engines"]
    finally:
        sidecar.stop()
    pid = str(engines[0]["pid"])
    assert f'kvguard_engine_coverage_gaps{{pid="{pid}",role="decode"}} 1.0' in text
    assert f'kvguard_engine_component_watched{{component="state_pool",pid="{pid}",role="decode"}} 0.0' in text
    assert f'kvguard_engine_component_watched{{component="kv_pool",pid="{pid}",role="decode"}} 1.0' in text
    assert 'kvguard_findings_total{kind="coverage_gap",severity="warning"} 1.0' in text
    (engine,) = engines
    assert engine["coverage_gaps"] == 1
    assert engine["coverage"][1] == {
        "component": "state_pool",
        "status": "unwatched",
        "watched": [],
        "missing": ["ownership"],
        "detail": "MambaPool: not hooked",
    }


def test_an_engine_without_coverage_has_no_coverage_series(tmp_path):
    """An adapter from before contract 1.5: coverage unknown, never shown as complete."""
    p = Probes(RingWriter(str(tmp_path), 1 << 16), page_size=PAGE)
    p.hello("unified", 0, PAGE, 32, 32 * PAGE, 128, 128, "sglang", "0.5.23", "tiny")
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    try:
        sidecar.run_once(flush=True)
        text = TestClient(create_app(sidecar, CollectorRegistry())).get("/metrics").text
    finally:
        sidecar.stop()
    assert "kvguard_engine_coverage_gaps{" not in text
    assert "kvguard_engine_component_watched{" not in text


def test_the_ring_keeps_coverage_and_pools_with_its_hello_for_a_late_sidecar(tmp_path):
    writer = RingWriter(str(tmp_path), 1 << 16)
    p = Probes(writer, page_size=PAGE)
    p.hello("unified", 0, PAGE, 32, 32 * PAGE, 128, 128, "vllm", "0.32.0", "tiny")
    p.coverage([wire.CoverageItem("kv_group_1", UNWATCHED, 0, OWN, "x" * 300)])  # a long detail: truncated
    p.pool_declared(1, 64, 16, "state", "mamba state")
    p.forward(["a"], [3], [[0]], pool=1)  # not sticky
    kinds = [(r.kind, r.pool) for r in RingReader(writer.path).sticky_records()]
    assert kinds == [(wire.Kind.HELLO, 0), (wire.Kind.COVERAGE, 0), (wire.Kind.POOL, 1)]
    # a new HELLO (the same process announcing itself again) starts the copy anew
    p.hello("unified", 0, PAGE, 32, 32 * PAGE, 128, 128, "vllm", "0.32.0", "tiny")
    assert [r.kind for r in RingReader(writer.path).sticky_records()] == [wire.Kind.HELLO]
    # more than the header holds: published, not kept, counted
    for i in range(200):
        p.pool_declared(1 + i, PAGE, 8, "full_attention", "g" * 200)
    assert writer.sticky_overflow > 0
    assert len(RingReader(writer.path).sticky_records()) < 201


# --------------------------------------------------------------------------- pools
def _two_pools(window: int = 8) -> tuple[CaptureWriter, Probes, Pipeline]:
    cap, p = _engine()
    p.coverage(
        [wire.CoverageItem("kv_pool", WATCHED, OWN, 0, "full"), wire.CoverageItem("kv_group_1", WATCHED, OWN, 0, "swa")]
    )
    p.pool_declared(1, PAGE, 32, "sliding_window", "kv cache group 1 (sliding window)", window_tokens=window)
    pipeline = Pipeline()
    assert judged(pipeline, cap) == []
    return cap, p, pipeline


def _request(p: Probes, rid: str, tenant: str, pages0: list[int], pages1: list[int], tokens: int) -> None:
    p.request_begin(rid, tenant, None, tokens, 0, False)
    p.page_ids_allocated(pages0)
    p.row_pages_assigned(rid, 0, tokens, 0, pages0)
    p.page_ids_allocated(pages1, pool=1)
    p.row_pages_assigned(rid, 0, tokens, 0, pages1, pool=1)


def _forward(p: Probes, rid: str, seq: int, write_page: tuple[int, int], rows: tuple[list, list]) -> None:
    """One forward of one request in both pools (the vLLM worker writes one FORWARD per group)."""
    for pool, page, row in ((0, write_page[0], rows[0]), (1, write_page[1], rows[1])):
        p.forward(
            [rid],
            [seq],
            np.array([page * PAGE]),
            written_counts=[1],
            read_pages=np.array(row),
            read_counts=[len(row)],
            pool=pool,
        )


def test_each_pool_is_its_own_timeline_and_a_clean_run_is_quiet():
    cap, p, pipeline = _two_pools()
    # the same page ids in both pools belong to different requests: no cross-talk
    _request(p, "a", "acme", [1, 2], [3, 4], 8)
    _request(p, "b", "globex", [3, 4], [1, 2], 8)
    p.forward(["a", "b"], [8, 8], np.array([1, 2, 3, 4]) * PAGE, written_counts=[2, 2])
    p.forward(["a", "b"], [8, 8], np.array([3, 4, 1, 2]) * PAGE, written_counts=[2, 2], pool=1)
    _forward(p, "a", 8, (2, 4), ([1, 2], [3, 4]))
    _forward(p, "b", 8, (4, 2), ([3, 4], [1, 2]))
    assert judged(pipeline, cap) == []
    (engine,) = pipeline.engine_stats()
    (pool,) = engine.pools
    assert (pool.index, pool.kind, pool.window_tokens) == (1, "sliding_window", 8)
    assert pool.pages_read == engine.pages_read == 8 and pool.pages_by_state["owned"] == 4
    # the request ends: its rows go in both pools
    p.request_end("a", "stop", 1, 2, 1, "")
    p.request_end("b", "stop", 1, 2, 1, "")
    assert judged(pipeline, cap) == []
    t = pipeline.engines[1]
    assert len(t.rows) == 0 and len(t.pools[1].rows) == 0


def test_a_page_freed_under_its_reader_in_the_second_pool_is_caught_there_with_the_victim_named():
    cap, p, pipeline = _two_pools()
    _request(p, "a", "acme", [1, 2], [3, 4], 8)
    p.forward(["a"], [8], np.array([1, 2]) * PAGE, written_counts=[2])
    p.forward(["a"], [8], np.array([3, 4]) * PAGE, written_counts=[2], pool=1)
    assert judged(pipeline, cap) == []
    # pool 1 frees page 4 while "a" still reads it; page 4 of pool 0 is untouched
    p.pages_freed([4], kind="page_ids", pool=1)
    p.page_ids_allocated([4], pool=1)
    _request(p, "b", "globex", [5], [4], 4)
    p.forward(["b"], [4], np.array([4]) * PAGE, written_counts=[1], pool=1)
    found = judged(pipeline, cap)
    assert found == [] or _kinds(found) == ["late_write"]  # (b writes a page "a" still names: its own now)
    _forward(p, "a", 9, (3, 4), ([1, 2, 3], [3, 4, 4]))
    found = [f for f in judged(pipeline, cap) if f.kind != "late_write"]
    assert found, "a read of a page reallocated to another request in pool 1 went unseen"
    f = found[0]
    assert f.kind in ("foreign_read", "use_after_free", "unwritten_read")
    assert f.reader.rid == "a" and f.evidence["pool"] == 1 and f.evidence["pool_kind"] == "sliding_window"
    assert 4 in f.pages and any(x.tenant == "globex" for x in f.exposed)


def test_window_evictions_inside_a_live_request_are_not_frees_under_a_reader():
    """A sliding-window pool frees pages behind the window while the request lives; the
    adapter points those row positions at page 0 (the engine's null block) before the free,
    so the next forward's read over the row is not a use after free."""
    cap, p, pipeline = _two_pools(window=8)
    _request(p, "a", "acme", [1, 2, 3], [1, 2, 3], 12)
    p.forward(["a"], [12], np.array([1, 2, 3]) * PAGE, written_counts=[3])
    p.forward(["a"], [12], np.array([1, 2, 3]) * PAGE, written_counts=[3], pool=1)
    # page 1 of pool 1 falls behind the window: row position 0 -> page 0, then freed and reused
    p.row_pages_assigned("a", 0, 4, 0, [0], pool=1)
    p.pages_freed([1], kind="page_ids", pool=1)
    _request(p, "b", "globex", [4], [1], 4)
    p.forward(["b"], [4], np.array([4]) * PAGE, written_counts=[1])
    p.forward(["b"], [4], np.array([1]) * PAGE, written_counts=[1], pool=1)
    p.page_ids_allocated([5])
    p.row_pages_assigned("a", 12, 16, 12, [5])
    p.page_ids_allocated([6], pool=1)
    p.row_pages_assigned("a", 12, 16, 12, [6], pool=1)
    _forward(p, "a", 13, (5, 6), ([1, 2, 3, 5], [0, 2, 3, 6]))
    assert judged(pipeline, cap) == []
    assert pipeline.engines[1].pools[1].judge.pages_unverified == 0


def test_records_of_an_undeclared_pool_are_counted_and_skipped():
    cap, p = _engine()
    p.forward(["a"], [4], [[4]], pool=3)
    p.page_ids_allocated([2], pool=3)
    pipeline = Pipeline()
    assert judged(pipeline, cap) == []
    assert pipeline.records_undeclared_pool == 2
    assert pipeline.stats().records_undeclared_pool == 2


def test_a_gap_forgets_every_pool_and_a_new_hello_drops_the_pools():
    cap, p, pipeline = _two_pools()
    _request(p, "a", "acme", [1], [1], 4)
    p.forward(["a"], [4], [[4]], pool=1)
    assert judged(pipeline, cap) == []
    t = pipeline.engines[1]
    pipeline.apply(wire.Record(wire.Kind.LOST, 0, 1, 1, 0, 5))
    assert t.pools[1].pool.counts_by_state()["unknown"] == t.pools[1].pool.num_pages
    p.hello("unified", 0, PAGE, 32, 32 * PAGE, 128, 128, "vllm", "0.32.0", "tiny-gemma3", pid=4242)
    judged(pipeline, cap)
    assert t.pools == {} and t.coverage is None


# --------------------------------------------------------------------------- preflight
def test_preflight_prints_what_a_sidecar_watches_and_can_require_it(tmp_path, monkeypatch):
    """``kvguard preflight --sidecar URL``: each engine's coverage from the sidecar's /v1/engines;
    ``--require-coverage`` exits 3 on a part not watched (when the pool checks passed)."""
    import io
    import json

    import httpx

    from kvguard.sidecar.preflight import cli as preflight_cli
    from kvguard.sidecar.preflight.coverage import EXIT_COVERAGE_GAP

    p = Probes(RingWriter(str(tmp_path), 1 << 16), page_size=PAGE)
    p.hello("decode", 0, PAGE, 32, 32 * PAGE, 128, 128, "sglang", "0.5.23", "tiny-dsv2")
    p.coverage(
        [
            wire.CoverageItem("kv_pool", WATCHED, OWN | DIGESTS, 0, "MLATokenToKVPool"),
            wire.CoverageItem("draft", UNWATCHED, 0, OWN, "speculative decoding (NEXTN): not hooked"),
        ]
    )
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    try:
        sidecar.run_once(flush=True)
        client = TestClient(create_app(sidecar, CollectorRegistry(), api_token="tok"))

        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.host == "sidecar":
                return client.request(request.method, request.url.path, headers=dict(request.headers))
            return httpx.Response(404)  # the engine's own endpoints: not what this test is about

        transport = httpx.MockTransport(handler)
        token = tmp_path / "token"
        token.write_text("tok\n")
        safe = preflight_cli.Report(
            url="http://engine:1", verdict="safe", role="decode", pool_tokens=512, context_len=256, page_size=4
        )
        safe.max_req_input_len = 250
        monkeypatch.setattr(preflight_cli, "check", lambda url, **kw: [safe])

        def preflight(**options) -> tuple[int, str]:
            out = io.StringIO()
            code = preflight_cli.run(
                ["http://engine:1"],
                out=out,
                transport=transport,
                sidecars=["http://sidecar:9464"],
                api_token_file=str(token),
                **options,
            )
            return code, out.getvalue()

        code, text = preflight()
        assert code == 0  # informational without --require-coverage
        assert "kvguard coverage of decode rank 0" in text and "1 part(s) NOT fully watched" in text
        assert "NO   draft: speculative decoding (NEXTN): not hooked" in text
        code, text = preflight(require_coverage=True, as_json=True)
        assert code == EXIT_COVERAGE_GAP
        cov_line = json.loads(text.splitlines()[-1])
        assert cov_line["coverage_gaps"] == 1 and cov_line["coverage"][1]["component"] == "draft"
        # without the token: the sidecar cannot be read, which --require-coverage does not take as complete
        token.write_text("wrong\n")
        code, text = preflight(require_coverage=True)
        assert code == EXIT_COVERAGE_GAP and "UNKNOWN: HTTP 401" in text
    finally:
        sidecar.stop()


def test_a_pools_page_timeline_is_its_own(tmp_path):
    """/v1/pages/{engine}/{page}/timeline?pool=P: the events of that pool's page, not pool 0's."""
    writer = RingWriter(str(tmp_path), 1 << 16)
    p = Probes(writer, page_size=PAGE)
    p.hello("unified", 0, PAGE, 32, 32 * PAGE, 128, 128, "sglang", "0.5.23", "tiny")
    p.pool_declared(1, PAGE, 16, "state", "mamba state")
    p.request_begin("a", "acme", None, 4, 0, False)
    p.page_ids_allocated([3])
    p.row_pages_assigned("a", 0, 4, 0, [3])
    p.page_ids_allocated([3], pool=1)
    p.row_pages_assigned("a", 0, 4, 0, [3], pool=1)
    p.pages_freed([3], kind="page_ids", pool=1)
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    try:
        sidecar.run_once(flush=True)
        client = TestClient(create_app(sidecar, CollectorRegistry(), api_token="t"))
        auth = {"Authorization": "Bearer t"}
        engine = client.get("/v1/engines", headers=auth).json()["engines"][0]
        assert [(x["pool"], x["kind"]) for x in engine["pools"]] == [(1, "state")]
        eid = engine["engine"]
        zero = client.get(f"/v1/pages/{eid}/3/timeline", headers=auth).json()
        one = client.get(f"/v1/pages/{eid}/3/timeline?pool=1", headers=auth).json()
        assert [e["event"] for e in zero["events"]] == ["alloc", "assign"] and zero["now"]["state"] == "owned"
        assert [e["event"] for e in one["events"]] == ["alloc", "assign", "free"] and one["now"]["state"] == "free"
        assert client.get(f"/v1/pages/{eid}/3/timeline?pool=2", headers=auth).status_code == 404
    finally:
        sidecar.stop()

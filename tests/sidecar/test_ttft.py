"""ttft_anomaly on realistic timing: cold start, queueing, cache hits, outliers; and the incident."""

import random

from kvguard.sidecar.detectors.base import At
from kvguard.sidecar.detectors.ttft import TTFTDetector
from kvguard.sidecar.events import RequestEnded
from kvguard.sidecar.findings import EngineRef
from kvguard.sidecar.tracker import RequestInfo

ENGINE = EngineRef("prefill", 0, 1)
US = 1_000


def observe(det, engine_id, engine, info, ts_ns, prompt_pages=None):
    """As the pipeline calls it: a request's end (with the tracker's prompt-page counts), at
    its engine and time."""
    return det.observe(RequestEnded(info, prompt_pages), At(None, engine, engine_id, ts_ns))


def req(i, prompt, ttft_ns, cached=0, finish="length"):
    return RequestInfo(
        i, f"r{i}", "acme", prompt_tokens=prompt, cached_tokens=cached, ttft_ns=int(ttft_ns), finish=finish
    )


def realistic_stream(rng, n, per_token_us=50.0):
    """Prefill at ~50 us/token with lognormal noise, a fixed overhead, exponential queueing
    delays, a third of requests hitting the prefix cache, and a slow cold start."""
    for i in range(n):
        prompt = rng.randint(40, 2000)
        cached = rng.choice([0, 0, prompt - rng.randint(1, 31), int(prompt * 0.6)])
        uncached = prompt - cached
        compute = uncached * per_token_us * US * rng.lognormvariate(0, 0.25)
        cold = 20 if i < 5 else 1  # first requests compile kernels
        queue = rng.expovariate(1 / 200_000) * 1_000  # mean 200 ms of queueing
        yield req(i, prompt, 2_000_000 + compute * cold + queue, cached)


def test_no_false_alarms_on_a_realistic_distribution():
    det = TTFTDetector()
    rng = random.Random(7)
    findings = [f for r in realistic_stream(rng, 3000) for f in observe(det, 1, ENGINE, r, 0)]
    assert findings == []


def prefill_only_stream(rng, n, start, slowdown=1.0):
    """What the engine reports as TTFT (first forward to first token: no queueing), with
    everything slowed alike by ``slowdown`` (a loaded host): a fixed step cost plus
    ~50 us/token, lognormal noise, a third of requests hitting the prefix cache."""
    for i in range(start, start + n):
        prompt = rng.randint(40, 2000)
        cached = rng.choice([0, 0, prompt - rng.randint(1, 31), int(prompt * 0.6)])
        compute = 2_000_000 + (prompt - cached) * 50 * US * rng.lognormvariate(0, 0.25)
        yield req(i, prompt, compute * slowdown, cached)


def later_requests(det, rng, n, start=10_000, slowdown=1.0, ts=100):
    """Feed n more requests (ids from ``start``); the findings they released."""
    return [f for r in prefill_only_stream(rng, n, start, slowdown) for f in observe(det, 1, ENGINE, r, ts)]


def test_the_incidents_placeholder_prefill_is_flagged_after_warmup():
    det = TTFTDetector()
    rng = random.Random(3)
    for r in realistic_stream(rng, 200):
        observe(det, 1, ENGINE, r, 0)
    # 2,000 prompt tokens answered after a 1-token prefill: ~3 ms. Too fast against the
    # past, but not by 32x: the verdict waits for requests that ran after it
    assert observe(det, 1, ENGINE, req(999, 2000, 3_000_000), 42) == []
    (f,) = later_requests(det, rng, 100)
    assert f.kind == "ttft_anomaly" and f.reader.rid == "r999"
    assert f.evidence["uncached_tokens"] == 2000 and f.evidence["ns_per_token"] == 1500.0
    assert f.evidence["floor_basis"] == "later" and f.evidence["later_requests"] >= 5
    assert det.suspects[1] == [] and det.suspects_cleared == 0


def test_a_speed_up_is_learned_not_flagged():
    """The PD soak's false alarms under outside CPU load: the floor was learned while the
    engine ran 20x slower (chunked prefill interleaved with other work on 2 shared CPUs); once the load went, normal requests looked 'too fast'. Their
    verdict waits for later requests, which are just as fast: no finding."""
    det = TTFTDetector()
    rng = random.Random(11)
    assert later_requests(det, rng, 400, start=0, slowdown=20.0) == []  # a loaded host: 20x slower
    assert later_requests(det, rng, 1500) == []
    assert det.suspects_cleared > 10 and det.suspects[1] == []
    # without waiting for later requests, the same stream raised false alarms
    old = TTFTDetector(certain_factor=4.0)
    rng = random.Random(11)
    later_requests(old, rng, 400, start=0, slowdown=20.0)
    assert len(later_requests(old, rng, 1500)) > 20
    # at the new speed a request that skipped its prefill is still caught
    assert observe(det, 1, ENGINE, req(999, 2000, 3_000_000), 42) == []
    assert [f.reader.rid for f in later_requests(det, rng, 100, start=20_000)] == ["r999"]


def test_a_slow_down_raises_nothing():
    det = TTFTDetector()
    rng = random.Random(12)
    assert later_requests(det, rng, 400, start=0) == []
    assert later_requests(det, rng, 1000, slowdown=6.0) == []
    assert det.suspects_cleared == 0


def test_far_below_the_floor_is_flagged_at_once():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 1000, 50_000_000), 0)
    (f,) = observe(det, 1, ENGINE, req(9, 1000, 1_000_000), 7)  # 50x below: no load change does that
    assert f.evidence["floor_basis"] == "past" and det.suspects[1] == []


def test_a_suspect_without_later_traffic_is_judged_after_the_wait():
    det = TTFTDetector(warmup=5, max_wait_ns=1_000)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 1000, 50_000_000), 0)
    assert observe(det, 1, ENGINE, req(9, 1000, 5_000_000), 100) == []  # 10x below: waits
    assert det.tick(500) == []
    (f,) = det.tick(1_100)
    assert f.reader.rid == "r9" and f.evidence["floor_basis"] == "past and later" and det.suspects[1] == []


def test_a_suspect_is_judged_when_its_engine_goes():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 1000, 50_000_000), 0)
    assert observe(det, 1, ENGINE, req(9, 1000, 5_000_000), 100) == []
    (f,) = det.on_engine_gone(1, 200)
    assert f.reader.rid == "r9" and 1 not in det.models and 1 not in det.suspects


def test_cold_start_is_learned_not_judged():
    det = TTFTDetector(warmup=20)
    assert all(observe(det, 1, ENGINE, req(i, 600, 3_000_000), 0) == [] for i in range(20))


def test_cache_hits_rejections_and_short_prompts_are_not_judged():
    det = TTFTDetector(warmup=1)
    observe(det, 1, ENGINE, req(0, 1000, 50_000_000), 0)
    assert observe(det, 1, ENGINE, req(1, 1000, 100_000, cached=990), 0) == []  # 10 uncached tokens
    assert observe(det, 1, ENGINE, req(2, 1000, 100_000, finish="reject"), 0) == []
    assert observe(det, 1, ENGINE, req(3, 20, 1_000), 0) == []


def test_flagged_samples_do_not_drag_the_floor_down():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 1000, 50_000_000), 0)
    hits = [observe(det, 1, ENGINE, req(100 + i, 1000, 1_000_000), 0) for i in range(50)]
    assert all(len(h) == 1 for h in hits)
    hits = [observe(det, 1, ENGINE, req(200 + i, 1000, 1_000_000), 0) for i in range(5)]
    assert all(len(h) == 1 for h in hits)


def test_a_per_request_constant_does_not_make_long_prompts_look_fast():
    """The soak's false alarm: short prompts' TTFT is mostly a fixed cost (scheduling, one
    step, queueing), so their time *per token* is high; a long prompt prefilled normally
    is slower in total and must not be flagged."""
    det = TTFTDetector(warmup=20)
    rng = random.Random(5)
    for i in range(300):
        n = rng.randint(32, 64)
        observe(det, 1, ENGINE, req(i, n, 40_000_000 + n * 20_000), 0)  # 40 ms fixed + 20 us/token
    assert observe(det, 1, ENGINE, req(999, 500, 40_000_000 + 500 * 20_000), 0) == []


def test_engines_learn_separately():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 1000, 50_000_000), 0)
    assert observe(det, 2, ENGINE, req(9, 1000, 1_000_000), 0) == []  # engine 2 is still warming up


def test_decode_engines_are_not_judged():
    det = TTFTDetector(warmup=1)
    decode = EngineRef("decode", 0, 2)
    for i in range(10):
        observe(det, 1, decode, req(i, 1000, 50_000_000), 0)
    assert observe(det, 1, decode, req(99, 1000, 1_000), 0) == []


def test_a_request_prefilled_twice_is_neither_judged_nor_learned():
    """SGLang 0.5.23's optimistic PD prefill retry re-prefills from the prefix cache the
    first attempt filled, so a 2,000-token prompt gets its first token in milliseconds;
    the engine flags it (REQ_END ``reprefilled``) and the detector leaves it alone."""
    det = TTFTDetector()
    rng = random.Random(3)
    for r in realistic_stream(rng, 200):
        observe(det, 1, ENGINE, r, 0)
    samples = len(det.models[1].samples)
    retried = req(998, 2000, 3_000_000)
    retried.reprefilled = True
    assert observe(det, 1, ENGINE, retried, 0) == []
    assert len(det.models[1].samples) == samples
    assert observe(det, 1, ENGINE, req(999, 2000, 3_000_000), 0) == []  # the same timing, not retried: suspect
    assert [f.reader.rid for f in later_requests(det, rng, 100)] == ["r999"]


# ---------------------------------------------------------------------- prefill evidence
def test_a_suspect_whose_forwards_wrote_its_prompt_is_explained_not_flagged():
    """The PD soak under concurrency: a prompt prefilled alone is 10x faster than its size
    class was while prompts overlapped. Its own forwards wrote every uncached prompt page:
    it was prefilled, just fast. Learned from, never flagged."""
    det = TTFTDetector(warmup=5)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 100, 100_000_000), 0, (25, 25))
    assert observe(det, 1, ENGINE, req(9, 100, 8_000_000), 7, (25, 25)) == []  # 12x below
    assert observe(det, 1, ENGINE, req(10, 100, 1_000_000), 8, (24, 25)) == []  # 100x below: it was written
    assert det.suspects_explained == 2 and det.suspects[1] == []
    assert len(det.models[1].samples) == 7


def test_a_suspect_whose_prompt_was_never_written_is_flagged_with_the_counts():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 600, 100_000_000), 0, (150, 150))
    (f,) = observe(det, 1, ENGINE, req(9, 600, 1_000_000), 7, (1, 150))  # the 1-token placeholder
    assert (f.evidence["prompt_pages_written"], f.evidence["uncached_prompt_pages"]) == (1, 150)
    assert det.suspects_explained == 0


def test_no_records_means_timing_alone():
    det = TTFTDetector(warmup=5)  # no counts: the request began before the sidecar attached
    for i in range(5):
        observe(det, 1, ENGINE, req(i, 600, 100_000_000), 0)
    (f,) = observe(det, 1, ENGINE, req(9, 600, 1_000_000), 7)
    assert f.evidence["prompt_pages_written"] is None and det.suspects_explained == 0


def test_the_pipeline_reads_the_prefill_evidence_from_its_records(tmp_path):
    """Real probes, ring and sidecar: 20 requests whose 64-token prompts take 64 ms, then
    one prefilled (its forward wrote its 16 pages) in 1.5 ms, and one that claims 64 prompt
    tokens but ran a one-token forward (the incident's placeholder prefill), in 1 ms. Only
    the second is a finding, and nothing else is raised."""
    import numpy as np

    from kvguard.engine_hooks.probes import Probes
    from kvguard.engine_hooks.ring import RingWriter
    from kvguard.sidecar.service import Sidecar
    from kvguard.sidecar.sinks.basic import MemorySink

    probes = Probes(RingWriter(str(tmp_path), 1 << 20))
    probes.hello("unified", 0, 4, 1024, 4096, 2048, 2048, "sglang", "0.5.23", "tiny")
    next_page = [1]

    def serve(rid, ttft_ns, prefilled_tokens=64):
        pages = np.arange(next_page[0], next_page[0] + 16)
        next_page[0] += 16
        slots = (pages[:, None] * 4 + np.arange(4)).reshape(-1)
        probes.request_begin(rid, "acme", None, 64, 0, False)
        probes.pages_allocated(slots)
        probes.rows_assigned(rid, 0, 64, 0, slots)
        probes.forward([rid], [prefilled_tokens], [slots[:prefilled_tokens]])
        probes.request_end(rid, "stop", ttft_ns, ttft_ns + 1_000_000, 1, "")
        probes.pages_freed(slots)

    for i in range(20):
        serve(f"warm-{i}", 64_000_000)
    serve("r-alone", 1_500_000)  # 42x below: flagged at once were it not for its writes
    serve("r-placeholder", 1_000_000, prefilled_tokens=1)
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0, ttft_anomaly=True)
    sidecar.run_once(flush=True)
    found = sink.findings
    assert [(f.kind, f.reader.rid) for f in found] == [("ttft_anomaly", "r-placeholder")], [f.summary for f in found]
    assert (found[0].evidence["prompt_pages_written"], found[0].evidence["uncached_prompt_pages"]) == (1, 16)
    assert sidecar.pipeline.detectors.get(TTFTDetector).suspects_explained == 1

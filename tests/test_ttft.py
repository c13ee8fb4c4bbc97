"""ttft_anomaly on realistic timing: cold start, queueing, cache hits, outliers; and the incident."""

import random

from sidecar.detectors.ttft import TTFTDetector
from sidecar.findings import EngineRef
from sidecar.tracker import RequestInfo

ENGINE = EngineRef("prefill", 0, 1)
US = 1_000


def req(i, prompt, ttft_ns, cached=0, finish="length"):
    return RequestInfo(i, f"r{i}", "acme", prompt_tokens=prompt, cached_tokens=cached, ttft_ns=int(ttft_ns),
                       finish=finish)


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
    findings = [f for r in realistic_stream(rng, 3000) for f in det.observe(1, ENGINE, r, 0)]
    assert findings == []


def test_the_incidents_placeholder_prefill_is_flagged_after_warmup():
    det = TTFTDetector()
    rng = random.Random(3)
    for r in realistic_stream(rng, 200):
        det.observe(1, ENGINE, r, 0)
    # 2,000 prompt tokens answered after a 1-token prefill: ~3 ms
    (f,) = det.observe(1, ENGINE, req(999, 2000, 3_000_000), 42)
    assert f.kind == "ttft_anomaly" and f.reader.rid == "r999"
    assert f.evidence["uncached_tokens"] == 2000 and f.evidence["ns_per_token"] == 1500.0


def test_cold_start_is_learned_not_judged():
    det = TTFTDetector(warmup=20)
    assert all(det.observe(1, ENGINE, req(i, 600, 3_000_000), 0) == [] for i in range(20))


def test_cache_hits_rejections_and_short_prompts_are_not_judged():
    det = TTFTDetector(warmup=1)
    det.observe(1, ENGINE, req(0, 1000, 50_000_000), 0)
    assert det.observe(1, ENGINE, req(1, 1000, 100_000, cached=990), 0) == []  # 10 uncached tokens
    assert det.observe(1, ENGINE, req(2, 1000, 100_000, finish="reject"), 0) == []
    assert det.observe(1, ENGINE, req(3, 20, 1_000), 0) == []


def test_flagged_samples_do_not_drag_the_floor_down():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        det.observe(1, ENGINE, req(i, 1000, 50_000_000), 0)
    hits = [det.observe(1, ENGINE, req(100 + i, 1000, 1_000_000), 0) for i in range(50)]
    assert all(len(h) == 1 for h in hits)
    hits = [det.observe(1, ENGINE, req(200 + i, 1000, 1_000_000), 0) for i in range(5)]
    assert all(len(h) == 1 for h in hits)


def test_a_per_request_constant_does_not_make_long_prompts_look_fast():
    """The soak's false alarm: short prompts' TTFT is mostly a fixed cost (scheduling, one
    step, queueing), so their time *per token* is high; a long prompt prefilled normally
    is slower in total and must not be flagged."""
    det = TTFTDetector(warmup=20)
    rng = random.Random(5)
    for i in range(300):
        n = rng.randint(32, 64)
        det.observe(1, ENGINE, req(i, n, 40_000_000 + n * 20_000), 0)  # 40 ms fixed + 20 us/token
    assert det.observe(1, ENGINE, req(999, 500, 40_000_000 + 500 * 20_000), 0) == []


def test_engines_learn_separately():
    det = TTFTDetector(warmup=5)
    for i in range(5):
        det.observe(1, ENGINE, req(i, 1000, 50_000_000), 0)
    assert det.observe(2, ENGINE, req(9, 1000, 1_000_000), 0) == []  # engine 2 is still warming up


def test_decode_engines_are_not_judged():
    det = TTFTDetector(warmup=1)
    decode = EngineRef("decode", 0, 2)
    for i in range(10):
        det.observe(1, decode, req(i, 1000, 50_000_000), 0)
    assert det.observe(1, decode, req(99, 1000, 1_000), 0) == []


def test_a_request_prefilled_twice_is_neither_judged_nor_learned():
    """SGLang 0.5.23's optimistic PD prefill retry re-prefills from the prefix cache the
    first attempt filled, so a 2,000-token prompt gets its first token in milliseconds;
    the engine flags it (REQ_END ``reprefilled``) and the detector leaves it alone."""
    det = TTFTDetector()
    rng = random.Random(3)
    for r in realistic_stream(rng, 200):
        det.observe(1, ENGINE, r, 0)
    samples = len(det.models[1].samples)
    retried = req(998, 2000, 3_000_000)
    retried.reprefilled = True
    assert det.observe(1, ENGINE, retried, 0) == []
    assert len(det.models[1].samples) == samples
    assert det.observe(1, ENGINE, req(999, 2000, 3_000_000), 0) != []  # the same timing, not retried: flagged

"""A sidecar watching real engines from inside a test, and the requests the engine tests
send: shared by the fault tests (tests/integration/test_faults_engine.py) and the HiCache tests
(tests/integration/test_hicache_engine.py)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from kvguard.demo.engines import Engine, start_engine
from kvguard.sidecar.findings import Finding
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.sidecar_settle import wait_until_applied

WAIT_S = 60.0


class Watch:
    """A sidecar on one ring folder, plus the fault plugin's event log."""

    def __init__(self, ring_dir: Path, events_dir: Path):
        self.memory = MemorySink()
        self.events_path = events_dir / "events.jsonl"
        self.sidecar = Sidecar(str(ring_dir), sinks=[self.memory], remove_dead_rings=False).start()
        self.checked = 0  # findings up to here were asserted by some test

    def stop(self) -> None:
        self.sidecar.stop()

    # -- findings
    def mark(self) -> int:
        return len(self.memory.findings)

    def since(self, mark: int) -> list[Finding]:
        """Every finding reported since ``mark`` (after the sidecar caught up)."""
        self.settle()
        found = list(self.memory.findings[mark:])
        self.checked = mark + len(found)
        for f in found:  # shown with -s
            reader = f.reader.rid if f.reader else "-"
            print(
                f"  finding {f.kind} [{f.severity}] on {f.engine.role}: reader {reader} pages {f.pages} "
                f"exposed {[(p.rid, p.tenant, p.pages) for p in f.exposed]} evidence {f.evidence}"
            )
        return found

    def unexplained(self) -> list[Finding]:
        """Findings no test has looked at (reported after the last scenario's check)."""
        self.settle()
        return list(self.memory.findings[self.checked :])

    def settle(self, quiet_s: float = 0.4, max_s: float = 10.0) -> None:
        wait_until_applied(self.sidecar, quiet_s, max_s)

    # -- plugin events
    def events(self, fault: str | None = None, event: str | None = None) -> list[dict]:
        try:
            lines = self.events_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = [json.loads(x) for x in lines if x.strip()]
        return [e for e in out if (fault is None or e["fault"] == fault) and (event is None or e["event"] == event)]

    def wait_event(self, fault: str, event: str, timeout_s: float = WAIT_S) -> dict:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            got = self.events(fault, event)
            if got:
                return got[0]
            errors = self.events("plugin", "error")
            assert not errors, f"the fault plugin failed: {errors}"
            time.sleep(0.02)
        raise AssertionError(f"no {fault}/{event} event within {timeout_s} s; events: {self.events()}")

    def engine_stats(self):
        """The sidecar's stats of the one engine it watches (``EngineStats``)."""
        with self.sidecar.lock:
            (engine,) = self.sidecar.pipeline.engine_stats()
        return engine

    def assert_plugin_ok(self) -> None:
        assert not self.events("plugin", "error"), self.events("plugin", "error")

    def assert_clean_end(self) -> None:
        """What every watched engine test ends with: the fault plugin raised nothing, every
        finding was explained by a fault the test caused, no record lost or failed to apply."""
        self.assert_plugin_ok()
        assert self.unexplained() == [], describe(self.unexplained())
        assert self.sidecar.rings.stats.records_lost == 0
        assert self.sidecar.pipeline.apply_errors == 0


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 255) for _ in range(n)]


def generate(url: str, rid: str, input_ids: list[int], max_new_tokens: int, tenant: str, **extra) -> dict:
    body = {
        "rid": rid,
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "routing_key": tenant,
        **extra,
    }
    r = httpx.post(url + "/generate", json=body, timeout=120.0)
    assert r.status_code == 200, (rid, r.status_code, r.text[:500])
    out = r.json()
    assert out["meta_info"]["completion_tokens"] == max_new_tokens, out["meta_info"]
    return out


def short_requests_and_aborts(engine: Engine, n: int, seed: int, phase: str, context_len: int, clients: int) -> dict:
    """``n`` short requests of tests/support/soak/workload.py, half of them aborted by the client (through
    the API or by closing the stream), on ``clients`` connections; each served or aborted as
    asked. Waits out SGLang's ~2 s delay before it aborts a closed stream, so that the frees
    reach the sidecar. Returns the outcomes' summary."""
    from tests.support.soak.workload import ABORT_KINDS, Limits, make_plan, outcome_summary, run_plan, send_unified

    limit = int(engine.server_info()["max_req_input_len"])
    mix = {"short": 0.5, "abort_api": 0.25, "abort_close": 0.25}
    plan = make_plan(n, Limits(context_len, limit), mix=mix, seed=seed, phase=phase)
    outcomes = run_plan(plan, send_unified(engine.url), concurrency=clients)
    for o in outcomes:
        if o.req.kind in ABORT_KINDS:
            assert o.status == 200 and o.error is None, o
        else:
            assert o.ok, (o, outcome_summary(outcomes))
    time.sleep(3.0)
    return outcome_summary(outcomes)


def describe(findings: list[Finding]) -> list[dict]:
    return [f.to_dict() for f in findings]


@contextmanager
def watched_sglang(work: Path, version: str, label: str, **start_kwargs) -> Iterator[tuple[Engine, Watch]]:
    """A real SGLang engine with kvguard's plugin writing into ``work/rings``, and a :class:`Watch`
    on them (the fault plugin's events in ``work/events``): yields ``(engine, watch)`` once the
    sidecar caught up with the start-up. On a clean exit, the checks every engine test ends with:
    the engine still running, no plugin error, no finding no test looked at, no record lost, no
    record the pipeline failed to apply. Both are stopped either way. ``start_kwargs`` go to
    :func:`start_engine` (after ``version``, the log folder and the ring folder)."""
    ring_dir, events_dir = work / "rings", work / "events"
    ring_dir.mkdir(exist_ok=True)
    events_dir.mkdir(exist_ok=True)
    watch = Watch(ring_dir, events_dir)
    t0 = time.monotonic()
    try:
        engine = start_engine(version, work / "logs", ring_dir=ring_dir, **start_kwargs)
    except BaseException:
        watch.stop()
        raise
    print(f"\n{label} (SGLang {version}) ready in {time.monotonic() - t0:.1f} s")
    watch.settle()
    try:
        yield engine, watch
        assert engine.is_running(), engine.log_tail()
        watch.assert_clean_end()
    finally:
        engine.stop()
        watch.stop()

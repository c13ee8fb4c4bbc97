"""Soak: zero false alarms on real SGLang 0.5.23 engines (CPU) under a varied, concurrent load.

Two module-scoped runs, each with the kvguard plugin loaded by SGLang itself and an
in-process sidecar (the real ``Sidecar``: ring ingest, tracker, detectors, incidents)
draining the engines' rings:

* a plain (unified) engine, KV pool 512 tokens = context length 512, chunked prefill
  64, ``KVGUARD_SOAK_REQUESTS`` (default 800; ``make soak`` runs 4,000) requests from 16 client threads and 3
  tenants: short and medium prompts, radix-cache hits on per-tenant and shared
  prefixes, prompts near the limits, over ``max_req_input_len`` (scheduler rejection)
  and over the context (tokenizer rejection), client aborts (``/abort_request``
  mid-stream and while queued, streams closed by the client), and bursts of longer
  generations that outgrow the pool: SGLang retracts requests (checked in its log);
* a prefill/decode pair over Mooncake TCP (prefill pool 512, decode pool 1024, context
  512) behind SGLang's own router (``sglang-router``), ``KVGUARD_SOAK_PD_REQUESTS``
  (default 200; ``make soak`` runs 600) requests from 8 client threads sent to the router as users send them,
  with no rid: each worker draws its own, so the sidecar must pair the two ends by
  bootstrap_room. Shared prefixes, rejections, client disconnects (the router passes
  them to both workers), aborts at decode by the rid the client learned, and clients
  that give up before the first chunk and retry (a new room).

What is asserted, per run: the clients saw what the engine should do; no record lost,
no ring or decode error, no probe error; every probe fired; the tracker judged page
reads with none unverified; and no finding at all. Findings that the records prove to
be known kvguard false alarms (tests/support/soak/known.py) raise ``KnownFalseAlarm`` with the
proof from the records; both known ones are fixed in the sidecar, so every finding fails.
docs/soak.md tells what it exercises, how long it takes and how to run it longer.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from kvguard.demo.engines import PDPair, start_engine
from kvguard.engine_hooks import wire
from tests.support.soak.known import KnownFalseAlarm, RecordIndex, known_false_alarm
from tests.support.soak.watch import Watch
from tests.support.soak.workload import (
    ABORT_KINDS,
    ROUTED_MIX,
    UNIFIED_MIX,
    Limits,
    Outcome,
    make_plan,
    mix_summary,
    outcome_summary,
    run_plan,
    send_routed,
    send_unified,
)

# the release soaked: 0.5.23 in `make test`; `make soak-versions` runs the soak on every supported
# release with the guard in full mode (KVGUARD_SOAK_SGLANG=0.5.20 ...)
VERSION = os.environ.get("KVGUARD_SOAK_SGLANG", "0.5.23")
# make test's size: every request kind, 4 pressure bursts (SGLang retracts), in ~2 min per
# run on two shared cores; `make soak` runs the long one (docs/soak.md)
REQUESTS = int(os.environ.get("KVGUARD_SOAK_REQUESTS", "800"))
PD_REQUESTS = int(os.environ.get("KVGUARD_SOAK_PD_REQUESTS", "200"))
CONCURRENCY = int(os.environ.get("KVGUARD_SOAK_CONCURRENCY", "16"))
PD_CONCURRENCY = int(os.environ.get("KVGUARD_SOAK_PD_CONCURRENCY", "8"))
SEED = int(os.environ.get("KVGUARD_SOAK_SEED", "1"))
# the unified engine with SGLang's hierarchical cache on (0.5.23: prefixes the device pool
# evicts are backed up to a host pool and loaded back on a hit; hooks_hicache.py)
HICACHE = os.environ.get("KVGUARD_SOAK_HICACHE", "1") not in ("0", "", "no", "false")
HICACHE_ARGS = ["--enable-hierarchical-cache", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first"]
REPORT = os.environ.get("KVGUARD_SOAK_REPORT")  # write the run summaries (JSON) here

POOL_TOKENS = 512  # = context length: no pool_smaller_than_context by design
CONTEXT_LEN = 512
PD_PREFILL_POOL, PD_DECODE_POOL = 512, 1024
CHUNKED_PREFILL = 64
# A client abort can reach prefill before the request itself (two HTTP calls): prefill
# then bootstraps a request decode has already dropped and waits for decode's KV
# indices until this timeout (SGLang's default is 300 s). 20 s, like the waiting
# timeout engines.py sets for decode.
# kvguard's guard on in every soak engine (docs/guard.md): on a healthy engine it must change no
# response and act on nothing (no GUARD record); "full", so that the transfer invariants and the
# read check (Tier 1, enforced: a false positive would fail a client's request) are both soaked;
# and the content check on every slot read (engine_hooks/content.py): a legitimate KV write it
# does not know of (chunked prefill, retraction, radix sharing, transfers) would be a finding;
# and every full page's content identity (engine_hooks/page_identity.py): a prefix hit whose
# pages' identity the engine recorded otherwise (eviction, reallocation, retraction, HiCache
# load-backs, chunked prefill) would be a prefix_content_mismatch
GUARD_ENV = {
    "KVGUARD_GUARD": os.environ.get("KVGUARD_SOAK_GUARD", "full"),
    "KVGUARD_CONTENT_CHECK": "all",
    "KVGUARD_PAGE_IDENTITY": "1",
}
GUARD_LOG_LINE = "kvguard guard: KVGUARD_GUARD=full"
TIER1_LOG_LINE = "kvguard tier1: first check ran"  # the read check did run on the soak's forwards
# The prefill/decode pair checks content through the device path (engine_hooks/content_device.py,
# what a GPU pool runs: fingerprints issued in stream order, read back later), here on host
# tensors, so a transfer's written slots reach it as the engine's own tensor slices; the unified
# and retraction engines check through the host path.
PD_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20", **GUARD_ENV, "KVGUARD_CONTENT_PATH": "device"}
# SGLang's admission reserves new_token_ratio x max_new_tokens per request; the ratio
# starts at 0.7 and decays to ~0.1 over 600 decode steps, then resets to 1.0 at each
# retraction. Starting lower and decaying faster makes the pool over-commit (and
# retract) several times per run instead of once or twice late in it.
RETRACTION_ENV = {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.3", "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": "150", **GUARD_ENV}
RETRACT_LINE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")

KNOWN_FALSE_ALARMS = (
    "known kvguard false alarms only (tests/support/soak/known.py, reported to the lead): ttft_anomaly's "
    "per-token floor is inflated by per-request constant time (queueing, one step per 64-token chunk), so a "
    "normally prefilled longer prompt looks 4x too fast; on PD, XFER_SEND is stamped after send_kv_chunk "
    "returns, after Mooncake completed and decode's XFER_DONE paired 0 sent tokens (transfer_size_mismatch, "
    "unwritten_read, use_after_free via transfer). Timing-dependent, hence not strict: remove once fixed"
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]


@dataclass
class SoakRun:
    name: str
    plan_mix: dict[str, Any]
    outcomes: list[Outcome]
    snapshot: dict[str, Any]
    findings: list  # sidecar.findings.Finding, delivered (first of each incident)
    explained: list[str]  # the records behind each finding (tests/support/soak/watch.py); "" past a budget
    known: list[str | None]  # known_false_alarm() per finding
    probe_errors: list[dict[str, Any]]
    req_end_finish: Counter
    rejects: list[tuple[str, str, str, str]]  # (engine role, rid, phase, reason)
    retractions: list[int] = field(default_factory=list)  # #retracted_reqs per log line
    timings_s: dict[str, float] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    prefill_evidence: dict[str, Any] = field(default_factory=dict)  # Watch.prefill_evidence()
    rids_by_room: dict[int, dict[str, set]] = field(default_factory=dict)  # room -> role -> rids (REQ_BEGIN)
    content_path: str = "host"  # KVGUARD_CONTENT_PATH of its engines

    def summary(self) -> dict[str, Any]:
        aborted = {o.req.rid for o in self.outcomes if o.req.kind in ABORT_KINDS}
        return {
            "run": self.name,
            "timings_s": {k: round(v, 1) for k, v in self.timings_s.items()},
            "mix": self.plan_mix,
            "clients": outcome_summary(self.outcomes),
            "slowest_s": sorted((round(o.latency_s, 1), o.req.kind) for o in self.outcomes)[-3:],
            "req_end_finish": dict(self.req_end_finish),
            "radix_hits": {
                kind: {
                    "requests": sum(o.req.kind == kind for o in self.outcomes),
                    "hits": sum(o.req.kind == kind and (o.cached_tokens or 0) > 0 for o in self.outcomes),
                    "cached_tokens": sum((o.cached_tokens or 0) for o in self.outcomes if o.req.kind == kind),
                }
                for kind in ("prefix", "system", "pressure")
            },
            "retractions": {"events": len(self.retractions), "requests": sum(self.retractions)},
            "prefill_evidence": {k: (v[:5] if isinstance(v, list) else v) for k, v in self.prefill_evidence.items()},
            "findings": [
                f"{f.kind}/{f.severity} {f.engine.role} {known or 'UNKNOWN'}: {f.summary} "
                f"{json.dumps(f.evidence, default=str)[:600]}"
                for f, known in zip(self.findings, self.known)
            ],
            "probe_errors": self.probe_errors,
            "rejects_of_aborted_requests": Counter(
                f"{role} {phase} {reason[:40]}" for role, rid, phase, reason in self.rejects if rid in aborted
            ),
            **self.snapshot,
        }


def _report(run: SoakRun) -> None:
    summary = run.summary()
    print(f"\n=== soak {run.name} ===\n" + json.dumps(summary, indent=1, default=str))
    # the records behind findings that are not known false alarms (the known ones are named above)
    unknown = [text for text, known in zip(run.explained, run.known) if known is None]
    for text in unknown[:3]:
        print(text[:30000])
    if REPORT:
        path = Path(REPORT)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[run.name] = summary
        path.write_text(json.dumps(data, indent=1, default=str))


def _finish(name: str, watch: Watch, plan, outcomes, timings, logs) -> SoakRun:
    """Everything read from the sidecar while the engines are still up."""
    watch.drain()
    watch.judge_waiting_ttft()
    snapshot = watch.snapshot()
    prefill_evidence = watch.prefill_evidence()
    records = list(watch.keeper.records)
    index = RecordIndex(records)
    findings = list(watch.memory.findings)
    known = [known_false_alarm(f, index) for f in findings]
    explained, budget = [], {True: 3, False: 10}  # explain up to 10 unknown and 3 known findings
    for f, k in zip(findings, known):
        budget[k is not None] -= 1
        explained.append(watch.explain(f) if budget[k is not None] >= 0 else "")
    roles = {r.engine_id: wire.Role(r.body.role).name.lower() for r in records if r.kind == wire.Kind.HELLO}
    rid = {r.body.req_key: r.body.rid for r in records if r.kind == wire.Kind.REQ_BEGIN}
    rids_by_room: dict[int, dict[str, set]] = {}
    for r in records:
        if r.kind == wire.Kind.REQ_BEGIN and r.body.room != wire.NO_ROOM and not r.body.warmup:
            rids_by_room.setdefault(r.body.room, {}).setdefault(roles.get(r.engine_id), set()).add(r.body.rid)
    return SoakRun(
        name=name,
        plan_mix=mix_summary(plan),
        outcomes=outcomes,
        snapshot=snapshot,
        findings=findings,
        explained=explained,
        known=known,
        probe_errors=watch.probe_errors(),
        req_end_finish=Counter(
            f"{roles.get(r.engine_id)}:{r.body.finish.name}" + (":reprefilled" if r.body.reprefilled else "")
            for r in records
            if r.kind == wire.Kind.REQ_END
        ),
        rejects=[
            (roles.get(r.engine_id), rid.get(r.body.req_key, "?"), r.body.phase.name, r.body.reason)
            for r in records
            if r.kind == wire.Kind.REJECT
        ],
        timings_s=timings,
        logs=logs,
        prefill_evidence=prefill_evidence,
        rids_by_room=rids_by_room,
    )


def _retractions(log_path: Path) -> list[int]:
    with open(log_path, errors="replace") as f:
        return [int(m.group(1)) for line in f if (m := RETRACT_LINE.search(line))]


# ---------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def unified_soak(tmp_path_factory, require_sglang) -> SoakRun:
    require_sglang(VERSION)
    work = tmp_path_factory.mktemp("soak-unified")
    ring_dir, log_dir = work / "rings", work / "logs"
    ring_dir.mkdir()
    t0 = time.monotonic()
    with Watch(ring_dir) as watch:
        engine = start_engine(
            VERSION,
            log_dir,
            max_total_tokens=POOL_TOKENS,
            context_length=CONTEXT_LEN,
            ring_dir=ring_dir,
            extra_args=["--chunked-prefill-size", str(CHUNKED_PREFILL), *(HICACHE_ARGS if HICACHE else [])],
            extra_env=RETRACTION_ENV,
        )
        try:
            t1 = time.monotonic()
            info = engine.server_info()
            limits = Limits(CONTEXT_LEN, int(info["max_req_input_len"]))
            plan = make_plan(REQUESTS, limits, mix=UNIFIED_MIX, seed=SEED, phase="uni", burst=CONCURRENCY)
            outcomes = run_plan(plan, send_unified(engine.url), CONCURRENCY)
            t2 = time.monotonic()
            run = _finish(
                "unified",
                watch,
                plan,
                outcomes,
                {"engine_startup": t1 - t0, "requests": t2 - t1},
                [str(engine.log_path)],
            )
            run.content_path = RETRACTION_ENV.get("KVGUARD_CONTENT_PATH", "host")
        finally:
            engine.stop()
    run.retractions = _retractions(engine.log_path)
    run.timings_s["total"] = time.monotonic() - t0
    run.timings_s["requests_per_s"] = REQUESTS / run.timings_s["requests"]
    _report(run)
    return run


@pytest.fixture(scope="module")
def pd_soak(tmp_path_factory, require_sglang) -> SoakRun:
    require_sglang(VERSION)
    if find_spec("mooncake") is None:
        pytest.skip("Mooncake (mooncake-transfer-engine-non-cuda) is not installed")
    work = tmp_path_factory.mktemp("soak-pd")
    ring_dir, log_dir = work / "rings", work / "logs"
    ring_dir.mkdir()
    t0 = time.monotonic()
    with Watch(ring_dir) as watch:
        with PDPair(
            VERSION,
            ring_dir,
            log_dir,
            prefill_pool_tokens=PD_PREFILL_POOL,
            decode_pool_tokens=PD_DECODE_POOL,
            context_length=CONTEXT_LEN,
            extra_env=PD_ENV,
        ) as pair:
            t1 = time.monotonic()
            info = pair.prefill.server_info()
            limits = Limits(CONTEXT_LEN, int(info["max_req_input_len"]))
            plan = make_plan(PD_REQUESTS, limits, mix=ROUTED_MIX, seed=SEED + 1, phase="pd-")
            outcomes = run_plan(plan, send_routed(pair.router.url, pair.decode.url), PD_CONCURRENCY)
            t2 = time.monotonic()
            run = _finish(
                "pd",
                watch,
                plan,
                outcomes,
                {"engine_startup": t1 - t0, "requests": t2 - t1},
                [str(pair.prefill.log_path), str(pair.decode.log_path), str(pair.router.log_path)],
            )
            run.content_path = PD_ENV["KVGUARD_CONTENT_PATH"]
    run.timings_s["total"] = time.monotonic() - t0
    run.timings_s["requests_per_s"] = PD_REQUESTS / run.timings_s["requests"]
    _report(run)
    return run


# ---------------------------------------------------------------------- shared checks

EXPECTED_KINDS = ("HELLO", "REQ_BEGIN", "REQ_END", "ALLOC", "ASSIGN", "FORWARD", "FREE", "REJECT")
PD_KINDS = ("XFER_RESERVE", "XFER_SEND", "XFER_DONE")


def check_clients(run: SoakRun, pd: bool, routed: bool = False) -> None:
    """Each kind of request got what the engine should give it (routed: what the router
    answered; prefill's own answer is not seen by the client)."""
    bad = []
    for o in run.outcomes:
        k = o.req.kind
        if k == "reject":
            good = o.status == 400 and "exceeds the maximum allowed length" in (o.error or "")
            if pd and not routed:
                good = good and o.prefill_status == 400
        elif k == "too_long":
            good = o.status == 400 and "context length" in (o.error or "")
        elif k in ABORT_KINDS:
            good = o.status == 200 and o.error is None and o.finish in ("abort", "closed", "length", "stop")
        else:
            good = o.ok and (not pd or routed or o.prefill_status == 200)
        if not good:
            bad.append(
                (k, o.req.rid, len(o.req.input_ids), o.status, o.finish, o.error, o.prefill_status, o.prefill_error)
            )
    assert not bad, f"{len(bad)} requests did not get what the engine should give them: {bad[:10]}"
    # the small pool evicts prefixes often; a good share must still hit the radix cache
    shared = [o for o in run.outcomes if o.req.kind in ("prefix", "system")]
    hits = [o for o in shared if (o.cached_tokens or 0) > 0]
    assert len(hits) >= max(3, 0.1 * len(shared)), f"only {len(hits)} of {len(shared)} shared-prefix requests hit"
    for kind in ("abort_api",) if routed else ("abort_api", "abort_queued"):
        assert any(o.req.kind == kind and o.finish == "abort" for o in run.outcomes), f"no {kind} request aborted"


def check_sidecar_health(run: SoakRun) -> None:
    s = run.snapshot
    assert s["records_lost_pipeline"] == 0 and s["records_lost_rings"] == 0 and s["dropped_before_attach"] == 0, s
    assert s["ring_errors"] == 0, s["ring_last_error"]
    assert not any(s["ring_decode_errors"].values()), s["ring_decode_errors"]
    assert s["apply_errors"] == 0, s
    assert s["records_by_kind"].get("PROBE_ERROR", 0) == 0 and not run.probe_errors, run.probe_errors
    # the guard was on in every engine (its start-up line) and acted on nothing
    engine_logs = [p for p in run.logs if "router" not in os.path.basename(p)]
    assert engine_logs and all(GUARD_LOG_LINE in Path(p).read_text(errors="replace") for p in engine_logs), engine_logs
    assert all(TIER1_LOG_LINE in Path(p).read_text(errors="replace") for p in engine_logs), engine_logs
    # the content check ran in every engine, through the path its env asked for
    content_lines = [_content_line(Path(p).read_text(errors="replace")) for p in engine_logs]
    assert all(content_lines), dict(zip(engine_logs, content_lines))
    deferred = [line.endswith("results read a step later") for line in content_lines]
    assert deferred == [run.content_path == "device"] * len(engine_logs), dict(zip(engine_logs, content_lines))
    assert s["records_by_kind"].get("GUARD", 0) == 0, s["records_by_kind"]


def _content_line(log_text: str) -> str:
    """The engine's content check start-up line (engine_hooks/sglang/content_hooks.py), or ''."""
    m = re.search(r"kvguard: content check on \(.*", log_text)
    return m.group(0).rstrip() if m else ""


def check_probes_fired(run: SoakRun, kinds) -> None:
    by_kind = run.snapshot["records_by_kind"]
    missing = [k for k in kinds if by_kind.get(k, 0) == 0]
    assert not missing, f"probes that never fired: {missing}; records_by_kind {by_kind}"


def check_reads_judged(run: SoakRun) -> None:
    engines = run.snapshot["engines"]
    assert sum(e["pages_read"] for e in engines.values()) > 0, engines
    unverified = {name: e["pages_unverified"] for name, e in engines.items() if e["pages_unverified"]}
    assert not unverified, f"reads not verified (the sidecar attached before the engines: none expected) {unverified}"


def check_rejects_routed(run: SoakRun) -> None:
    """check_rejects for rids the engines drew: the client never learns prefill's rid, nor decode's
    for a refused or early-closed request, so rejections are matched by count and cause: one
    admission REJECT on each engine per prompt over max_req_input_len, any other REJECT at most one
    per engine for each request the client aborted or closed early."""
    over = [r for r in run.rejects if r[2] == "ADMISSION" and "exceeds the maximum allowed length" in r[3]]
    n_over = sum(o.req.kind == "reject" for o in run.outcomes)
    assert Counter(r[0] for r in over) == Counter({"prefill": n_over, "decode": n_over}), over
    others = [r for r in run.rejects if r not in over]
    n_aborted = sum(o.req.kind in (*ABORT_KINDS, "retry") for o in run.outcomes)
    assert all(n <= n_aborted for n in Counter(r[0] for r in others).values()), (n_aborted, others[:10])


def check_rejects(run: SoakRun, engines: int) -> None:
    """One admission REJECT per engine for each prompt over max_req_input_len; any other
    REJECT only for requests the client aborted. (The adapter reports SGLang's
    ``prepare_abort`` / ``set_finish_with_abort`` as REJECT; SGLang also uses them for
    client aborts: an in-flight chunked prefill, 'Prefill bootstrap failed',
    'Decode handshake failed', ...)"""
    kind = {o.req.rid: o.req.kind for o in run.outcomes}
    over = [r for r in run.rejects if kind.get(r[1]) == "reject"]
    assert Counter(r[1] for r in over) == Counter(
        {o.req.rid: engines for o in run.outcomes if o.req.kind == "reject"}
    ), over
    assert all(r[2] == "ADMISSION" and "exceeds the maximum allowed length" in r[3] for r in over), over
    others = [r for r in run.rejects if kind.get(r[1]) not in ("reject", *ABORT_KINDS)]
    assert not others, others


def check_no_findings(run: SoakRun) -> None:
    unknown = [text or f.summary for f, known, text in zip(run.findings, run.known, run.explained) if known is None]
    assert not unknown, f"{len(unknown)} finding(s) on a healthy engine:\n" + "\n\n".join(unknown[:3])
    if run.findings:
        raise KnownFalseAlarm(
            f"{len(run.findings)} known false alarm(s): "
            f"{Counter(f'{f.kind}:{k}' for f, k in zip(run.findings, run.known))}"
        )


# ---------------------------------------------------------------------- unified


def test_unified_soak_clients_saw_the_engine_behave(unified_soak):
    check_clients(unified_soak, pd=False)
    kinds = Counter(o.req.kind for o in unified_soak.outcomes)
    assert sum(kinds.values()) == REQUESTS and set(kinds) == set(UNIFIED_MIX), kinds


def test_unified_soak_engine_retracted_under_pool_pressure(unified_soak):
    assert unified_soak.retractions, f"no 'Retract requests' line in {unified_soak.logs}"


def test_unified_soak_sidecar_lost_nothing_and_probes_all_fired(unified_soak):
    check_sidecar_health(unified_soak)
    check_probes_fired(unified_soak, EXPECTED_KINDS + (("KV_STORE", "KV_LOAD") if HICACHE else ()))
    check_rejects(unified_soak, engines=1)
    by_kind = unified_soak.snapshot["records_by_kind"]
    assert by_kind["REQ_BEGIN"] == by_kind["REQ_END"], by_kind  # every request that held KV ended
    assert unified_soak.req_end_finish["unified:ABORT"] > 0 and unified_soak.req_end_finish["unified:REJECT"] > 0


def test_unified_soak_reads_were_judged(unified_soak):
    check_reads_judged(unified_soak)


def test_unified_soak_no_findings(unified_soak):
    check_no_findings(unified_soak)
    # (prefix_probing was on and saw the tenants' hits on the shared system prompt: not a vacuous pass)
    probing = unified_soak.snapshot["prefix_probing"]
    assert probing["enabled"] and probing["cross_tenant_hits"] > 0, probing
    # (the content identity judged the hits on the shared system prompt: not a vacuous pass either)
    identity = unified_soak.snapshot["page_identity"]
    assert identity["recorded"] > 0 and identity["matched"] > 0 and identity["mismatched"] == 0, identity


def check_prefill_evidence(run: SoakRun) -> None:
    """ttft_anomaly's gate, on every request it could judge: the records show each one's
    forwards writing its whole uncached prompt (docs/detectors.md, "Prefill evidence")."""
    ev = run.prefill_evidence
    assert ev["judged"] > 0 and ev["not_in_history"] == 0 and ev["unexplained"] == [], ev
    assert ev["explained"] == ev["judged"]


def test_unified_soak_prefill_evidence_covers_every_prompt(unified_soak):
    check_prefill_evidence(unified_soak)


# ---------------------------------------------------------------------- prefill/decode


def test_pd_soak_clients_saw_the_engines_behave(pd_soak):
    check_clients(pd_soak, pd=True, routed=True)
    kinds = Counter(o.req.kind for o in pd_soak.outcomes)
    assert sum(kinds.values()) == PD_REQUESTS and set(kinds) == set(ROUTED_MIX), kinds


def test_pd_soak_sidecar_lost_nothing_and_probes_all_fired(pd_soak):
    check_sidecar_health(pd_soak)
    check_probes_fired(pd_soak, EXPECTED_KINDS + PD_KINDS)
    by_kind = pd_soak.snapshot["records_by_kind"]
    assert by_kind["HELLO"] == 2, by_kind
    check_rejects_routed(pd_soak)  # prefill and decode both refuse it at admission


def test_pd_soak_through_the_router_paired_every_transfer_although_the_rids_differed(pd_soak):
    """The proof that pairing by room was exercised: the workers drew different rids for one
    room (the client sent none), and every completed transfer was paired, none unpaired."""
    rooms = pd_soak.rids_by_room
    both = {room: ends for room, ends in rooms.items() if "prefill" in ends and "decode" in ends}
    assert len(both) >= 0.8 * PD_REQUESTS, (len(both), len(rooms))
    same = [(room, ends) for room, ends in both.items() if ends["prefill"] & ends["decode"]]
    assert not same, f"{len(same)} rooms had one rid on both ends (the client's?): {same[:3]}"
    t = pd_soak.snapshot["transfers"]
    assert t["paired"] >= 0.8 * PD_REQUESTS and t["unpaired"] == 0 and t["unverified"] == 0, t
    decode_rids = {o.engine_rid for o in pd_soak.outcomes if o.ok}
    assert decode_rids <= {rid for ends in both.values() for rid in ends["decode"]}  # what clients saw
    assert sum(o.attempts == 2 and o.ok for o in pd_soak.outcomes) > 0  # retried requests completed


def test_pd_soak_reads_were_judged(pd_soak):
    check_reads_judged(pd_soak)
    assert all(e["pages_read"] > 0 for e in pd_soak.snapshot["engines"].values()), pd_soak.snapshot["engines"]


def test_pd_soak_no_findings(pd_soak):
    check_no_findings(pd_soak)
    # (on, and nothing crossed: through the router the tenant rides in extra_key, which SGLang's
    # radix cache keys its entries by, so no tenant hits another's pages)
    probing = pd_soak.snapshot["prefix_probing"]
    assert probing["enabled"] and probing["cross_tenant_hits"] == 0, probing


def test_pd_soak_prefill_evidence_covers_every_prompt(pd_soak):
    check_prefill_evidence(pd_soak)

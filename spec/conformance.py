"""Conformance: every trace of the model (spec/model.py) up to a bound, turned into a
recording through the public recording API (``RecordingWriter`` + ``Probes``, as a
third-party adapter would), replayed by kvguard (``kvguard.sidecar.replay``), and kvguard's
findings compared with the model's verdicts for the same trace.

Agreement means, per trace: the set of ``(kind, reader)`` pairs is the same, and for each
pair the exposed parties kvguard names are the model's. A clean trace (no verdict) must
raise nothing at all. Requests are named by the model's request name: decode's rid is
``d-<name>``, prefill's ``p-<name>``, and both ends count as that request.

``python spec/conformance.py --bound small|full [--jobs N]`` prints the traces checked
(buggy and clean), the disagreements (each with its trace), and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvguard.engine_hooks.probes import Probes
from kvguard.sidecar.recorder import RecordingWriter
from kvguard.sidecar.replay import Replay
from spec.check import traces
from spec.model import (
    BUGGY,
    CAUSE_COMPLETION,
    CAUSE_SEND,
    FIXED,
    PAGE_TOKENS,
    PRIOR_NAME,
    PRIOR_TENANT,
    Config,
    Protocol,
    Req,
    Step,
    initial,
    successors,
)

PREFILL_ENGINE, DECODE_ENGINE = 1, 2
PREFILL_POOL_PAGES = 64
PREFILL_MODEL_BASE = 40  # the modelled prefill pool's page ids in the records (model page p: 40 + p)
STEP_NS = 1_000_000  # one action per millisecond: far inside every wait the sidecar has
END_TICK_NS = 3600 * 10**9  # an hour after the last action: every timer the sidecar has fires
# settings outside the model: TTFT (timing) and tenant isolation (prefix sharing) are not modelled
OPTIONS = {"isolate_tenants": False, "ttft_anomaly": False, "orphan_timeout_s": 120.0}

# Bounds. Each config is explored exhaustively under both protocols; the sweep is every
# maximal trace of each (spec/check.py counts them without building them). Two requests:
# three make every trace of this action set about 10^4 times more (268 million on the
# buggy protocol at three requests over two pages); spec/check.py's state search covers
# three requests instead. docs/spec.md says why two suffice for the conformance question.
ACME, GLOBEX = Req("a", "acme", 1), Req("b", "globex", 1)
INCIDENT = Req("c", "initech", 2, too_long=True)  # prefill rejects it; decode reserved 2 pages
BOUNDS = {
    # every trace with the incident's request over a pool it fills: 5,424 traces; and sends in
    # flight, one decode page, two prefill pages, b patient: 2,355 traces. (One prefill page
    # would deadlock: a's sender holding it, patient b holding decode's page, neither giving up.)
    "small": {
        "ac2": Config(2, (ACME, INCIDENT)),
        "abp1f2": Config(1, (ACME, Req("b", "globex", 1, patient=True)), prefill_pages=2),
    },
    # 111,906 traces with atomic sends (46,348 with a verdict, 65,558 clean), 22,603 with sends
    # in flight (the names ending in f: decode pages, f, prefill pages)
    "full": {
        "ac2": Config(2, (ACME, INCIDENT)),
        "ac3": Config(3, (ACME, INCIDENT)),  # room for both: reuse only after a release
        "ab3": Config(3, (Req("a", "acme", 2), GLOBEX)),  # two normal tenants: the races, and clean twins
        # sends in flight: each engine's pool holds one prompt, so every reuse is of a page in
        # flight or just completed; then room on prefill for both; then the incident's request
        "ab1f1": Config(1, (ACME, GLOBEX), prefill_pages=1),
        "ab1f2": Config(1, (ACME, GLOBEX), prefill_pages=2),
        "ac2f1": Config(2, (ACME, INCIDENT), prefill_pages=1),
    },
}

# Sends in flight are swept on the buggy protocol less its second release (the double free is
# the atomic configurations'): a page a double free hands out while a chunk into it is in
# flight, or after the chunk relayed another request's KV from a reused source page, is named
# by kvguard after the chunk's request (from its send on), by the model after whose bytes are
# there (from the completion on). docs/spec.md, "What the model does not cover".
BUGGY_IN_FLIGHT = replace(BUGGY, name="buggy-1r", release_once=True)


def protocols(cfg: Config) -> tuple[Protocol, Protocol]:
    return (BUGGY_IN_FLIGHT if cfg.in_flight else BUGGY), FIXED


# Three requests are sampled, not enumerated (tens of millions of traces even with two of
# them patient): random walks through the model, seeded, distinct action sequences only.
# They are what reaches foreign_read (a page freed under one request and handed to a third).
SAMPLED = {
    "abd2": Config(2, (Req("a", "acme", 1), Req("b", "globex", 1, patient=True), Req("d", "hooli", 1, patient=True))),
    "abc2": Config(
        2,
        (Req("a", "acme", 1), Req("b", "globex", 1, patient=True), Req("c", "initech", 1, too_long=True, patient=True)),
    ),
    # sends in flight with both reservations live at once on each engine (429,274 traces)
    "ab2f2": Config(2, (ACME, GLOBEX), prefill_pages=2),
}
# the share of --samples each sampled config takes (1: all of them)
SAMPLED_SHARE = {"ab2f2": 4}


def slots(pages) -> np.ndarray:
    if len(pages) == 0:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(p * PAGE_TOKENS, (p + 1) * PAGE_TOKENS) for p in pages])


class _Clock:
    def __init__(self):
        self.now = 10**12

    def __call__(self) -> int:
        self.now += STEP_NS
        return self.now


class TraceWriter:
    """One model trace as the engines' records, through the public recording API."""

    def __init__(self, path: str, cfg: Config):
        self.cfg = cfg
        self.clock = _Clock()
        self.rec = RecordingWriter(path, overwrite=True, clock_ns=self.clock)
        self.rec.set_options(OPTIONS)
        self.prefill = Probes(self.rec.engine(engine_id=PREFILL_ENGINE))
        self.decode = Probes(self.rec.engine(engine_id=DECODE_ENGINE))
        pool = cfg.pages + 1  # page 0 is the padding page
        self.prefill.hello(
            "prefill",
            0,
            PAGE_TOKENS,
            PREFILL_POOL_PAGES,
            PREFILL_POOL_PAGES * PAGE_TOKENS,
            256,
            256,
            "sglang",
            "0.5.19",
            "spec",
            pid=101,
        )
        self.decode.hello(
            "decode",
            0,
            PAGE_TOKENS,
            pool,
            pool * PAGE_TOKENS,
            pool * PAGE_TOKENS,
            pool * PAGE_TOKENS,
            "sglang",
            "0.5.19",
            "spec",
            pid=102,
        )
        self.prefill_pages: dict[int, list[int]] = {}
        self._prologue()

    # ------------------------------------------------------------------ naming
    def _req(self, i: int) -> Req:
        return self.cfg.reqs[i]

    @staticmethod
    def room(i: int) -> int:
        return 100 + i

    def _prefill_compute(self, rid: str, i: int, tokens: int) -> list[int]:
        n = -(-tokens // PAGE_TOKENS)
        pages = [8 + 8 * (i + 1) + k for k in range(n)]
        self.prefill_pages[i] = pages
        self._compute(rid, pages, tokens)
        return pages

    def _compute(self, rid: str, pages, tokens: int) -> None:
        """Prefill allocates ``pages`` for the prompt, assigns them to its row, computes it."""
        s = slots(pages)[:tokens]
        self.prefill.pages_allocated(slots(pages))
        self.prefill.rows_assigned(rid, 0, tokens, 0, s)
        self.prefill.forward([rid], [tokens], [s], None)

    @staticmethod
    def prefill_page(pid: int) -> int:
        """A modelled prefill page's id in the records (sends in flight): past the pages the
        prologue and the unmodelled senders use, so the modelled pool starts never written."""
        return PREFILL_MODEL_BASE + pid

    def _prologue(self) -> None:
        """Request z (tenant ``prior``) fills the whole decode pool through a normal transfer
        and ends: the stale KV the model's initial state holds."""
        p, d = self.prefill, self.decode
        pages = list(range(1, self.cfg.pages + 1))
        tokens, room = len(pages) * PAGE_TOKENS, 99
        drid, prid = f"d-{PRIOR_NAME}", f"p-{PRIOR_NAME}"
        d.request_begin(drid, PRIOR_TENANT, room, tokens, 0, False)
        d.pages_allocated(slots(pages))
        d.rows_assigned(drid, 0, tokens, 0, slots(pages))
        d.transfer_reserved(drid, room, tokens, slots(pages))
        p.request_begin(prid, PRIOR_TENANT, room, tokens, 0, False)
        ppages = self._prefill_compute(prid, -1, tokens)
        p.transfer_sent(prid, room, 0, tokens, ppages, True)
        p.transfer_done(prid, room, "sender", "success")
        p.request_end(prid, "length", 1_000_000, 2_000_000, 1, "")
        p.pages_freed(slots(ppages))
        d.transfer_done(drid, room, "receiver", "success")
        d.forward([drid], [tokens], [[]], [slots(pages)])
        d.request_end(drid, "length", 1_000_000, 2_000_000, 1, "")
        d.pages_freed(slots(pages))

    # ------------------------------------------------------------------ events
    def event(self, ev) -> None:
        i, req = ev.req, self._req(ev.req)
        drid, prid, room = f"d-{req.name}", f"p-{req.name}", self.room(i)
        p, d = self.prefill, self.decode
        op = ev.op
        if op == "d_admit":
            s = slots(ev.pages)
            d.request_begin(drid, req.tenant, room, ev.tokens, 0, False)
            d.pages_allocated(s)
            d.rows_assigned(drid, 0, ev.tokens, 0, s)
            d.transfer_reserved(drid, room, ev.tokens, s)
        elif op == "d_done":
            d.transfer_done(drid, room, "receiver", "success")
        elif op == "d_fail":
            d.transfer_done(drid, room, "receiver", "failed")
            d.request_end(drid, "abort", 0, 0, 0, "transfer failed")
            d.pages_freed(slots(ev.pages))
        elif op == "d_timeout":
            d.transfer_done(drid, room, "receiver", "failed")
            d.request_end(drid, "abort", 0, 0, 0, "waiting timeout")
            if ev.pages:
                d.pages_freed(slots(ev.pages))
        elif op == "d_release":
            d.pages_freed(slots(ev.pages), "deferred")
        elif op == "d_free_again":
            d.pages_freed(slots(ev.pages))
        elif op == "d_read":
            d.forward([drid], [ev.tokens], [[]], [slots(ev.pages)])
        elif op == "d_end":
            d.request_end(drid, "length", 1_000_000, 2_000_000, 1, "")
            d.pages_freed(slots(ev.pages))
        elif self.cfg.in_flight and op.startswith("p_"):
            self._sender_in_flight(ev, req, prid, room)
        elif op == "p_begin":
            p.request_begin(prid, req.tenant, room, ev.tokens, 0, False)
            if req.too_long:
                p.rejected(prid, "admission", "input too long")
            else:
                self._prefill_compute(prid, i, ev.tokens)
        elif op == "p_send":
            ppages = self.prefill_pages.get(i)
            if ppages is None:  # 0.5.19: the rejected request's placeholder is prefilled and sent
                ppages = self._prefill_compute(prid, i, ev.tokens)
            p.transfer_sent(prid, room, 0, ev.tokens, ppages[: -(-ev.tokens // PAGE_TOKENS)], True)
            p.transfer_done(prid, room, "sender", "success")
            p.request_end(prid, "reject" if req.too_long else "length", 1_000_000, 2_000_000, 1, "")
            p.pages_freed(slots(ppages))
        elif op == "p_fail":
            p.request_end(prid, "reject", 0, 0, 0, "input too long")
        elif op == "p_abort":
            p.request_end(prid, "abort", 0, 0, 0, "decode aborted the room")
            if i in self.prefill_pages:
                p.pages_freed(slots(self.prefill_pages[i]))
        else:
            raise ValueError(f"unknown event {op}")

    def _sender_in_flight(self, ev, req: Req, prid: str, room: int) -> None:
        """The sender's records when a send is in flight until it completes: its own pages are
        the model's (``ev.src``, prefill page ids), the send and its completion are apart."""
        p, op = self.prefill, ev.op
        src = [self.prefill_page(pid) for pid in ev.src]
        if op == "p_begin":
            p.request_begin(prid, req.tenant, room, ev.tokens, 0, False)
            if req.too_long:
                p.rejected(prid, "admission", "input too long")
            else:
                self._compute(prid, src, ev.tokens)
        elif op == "p_send":
            if req.too_long:  # 0.5.19: the rejected request's placeholder is prefilled and sent
                self._compute(prid, src, ev.tokens)
            p.transfer_sent(prid, room, 0, ev.tokens, src, True)
        elif op == "p_release":  # the buggy early release, while the transfer is in flight
            p.pages_freed(slots(src))
        elif op == "p_complete":
            p.transfer_done(prid, room, "sender", "success")
            p.request_end(prid, "reject" if req.too_long else "length", 1_000_000, 2_000_000, 1, "")
            if src:
                p.pages_freed(slots(src))
        elif op == "p_abort":
            p.request_end(prid, "abort", 0, 0, 0, "decode aborted the room")
            if src:
                p.pages_freed(slots(src))
        elif op == "p_fail":
            p.request_end(prid, "reject", 0, 0, 0, "input too long")
        else:
            raise ValueError(f"unknown event {op}")

    def close(self) -> None:
        self.rec.record_tick(self.clock.now + END_TICK_NS)
        self.rec.close()


# ---------------------------------------------------------------------------- comparison
def _name(rid: str | None) -> str | None:
    if rid is None:
        return None
    return rid[2:] if rid[:2] in ("d-", "p-") else rid


# kvguard's evidence.access values that are a finding of their own in the comparison: the
# invariants of a send in flight, judged at the sender's completion (docs/spec.md)
IN_FLIGHT_ACCESS = ("send", "completion")


def _key(kind: str, reader: str | None, access: str) -> tuple:
    return (kind, reader, access) if access in IN_FLIGHT_ACCESS else (kind, reader)


def expected(trace: list[Step]) -> dict:
    """(kind, reader) -> exposed names, from the model's verdicts; (kind, reader, access) for a
    send in flight's. A read's verdict is mapped by what put the KV there (``Verdict.cause``):

    * KV the reader's own transfer carried from a source page reused in flight: kvguard
      reports it once, at the sender's completion, as that send's ``use_after_free`` (access
      send), naming the same reader and exposed parties (the model has that verdict too);
    * KV another request's late completion landed: the overwrite is the ``late_write``
      (access completion) the model reports at that completion. Whether the owner's own KV
      landed before or after it the records cannot tell (both are somewhere between a send
      and its completion), so the owner's read is not a finding of its own."""
    out: dict = {}
    for step in trace:
        for v in step.verdicts:
            if v.cause == CAUSE_COMPLETION:
                continue
            key = (
                _key("use_after_free", v.reader, "send") if v.cause == CAUSE_SEND else _key(v.kind, v.reader, v.access)
            )
            out.setdefault(key, set()).update(v.exposed)
    return {k: frozenset(v) for k, v in out.items()}


def observed(findings) -> dict:
    out: dict = {}
    for f in findings:
        reader = _name(f.reader.rid) if f.reader is not None else None
        key = _key(f.kind, reader, f.evidence.get("access", ""))
        out.setdefault(key, set()).update(_name(p.rid) for p in f.exposed)
    return {k: frozenset(v) for k, v in out.items()}


def run_trace(path: str, cfg: Config, trace: list[Step]) -> tuple[dict, dict, dict]:
    w = TraceWriter(path, cfg)
    for step in trace:
        for ev in step.events:
            w.event(ev)
    w.close()
    run = Replay()
    run.plan([path])
    findings = run.replay_segment(path)
    summary = run.summary()
    return expected(trace), observed(findings), summary


@dataclass
class SweepResult:
    traces: int = 0
    sampled: int = 0  # of them, sampled three-request traces
    buggy: int = 0
    clean: int = 0
    disagreements: list = field(default_factory=list)  # (config, protocol, actions, expected, observed)
    kinds: Counter = field(default_factory=Counter)  # traces per expected kind
    replay_problems: int = 0


def sampled_traces(cfg: Config, proto, count: int, seed: int):
    """``count`` distinct maximal traces by uniform random walks (a choice among the enabled
    actions at each step), seeded: the same traces on every run."""
    rng = random.Random(seed)
    seen: set = set()
    attempts = 0
    while len(seen) < count and attempts < 20 * count:
        attempts += 1
        state, trace = initial(cfg), []
        while True:
            steps = list(successors(cfg, proto, state))
            if not steps:
                break
            step = rng.choice(steps)
            trace.append(step)
            state = step.state
        key = tuple(s.action for s in trace)
        if key not in seen:
            seen.add(key)
            yield trace


def _cases(bound: str, samples: int):
    for cname, cfg in BOUNDS[bound].items():
        for proto in protocols(cfg):
            for trace in traces(cfg, proto):
                yield cname, cfg, proto, trace
    if samples:
        for seed, (cname, cfg) in enumerate(SAMPLED.items()):
            count = samples // SAMPLED_SHARE.get(cname, 1)
            for proto in protocols(cfg):
                for trace in sampled_traces(cfg, proto, count, seed * 2 + (proto is FIXED)):
                    yield cname + "~", cfg, proto, trace


def sweep(bound: str, limit: int | None = None, shard: tuple[int, int] = (0, 1), samples: int = 0) -> SweepResult:
    """Every trace of every config at ``bound``, under both protocols, then ``samples``
    sampled traces per protocol of each three-request config. ``shard`` = (k, n): only
    traces whose running index is k modulo n (to split the sweep over processes)."""
    res = SweepResult()
    k, n = shard
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        path = os.path.join(tmp, "trace.kvgrec")
        for index, (cname, cfg, proto, trace) in enumerate(_cases(bound, samples)):
            if index % n != k:
                continue
            if limit is not None and res.traces >= limit:
                break
            exp, obs, summary = run_trace(path, cfg, trace)
            res.traces += 1
            if cname.endswith("~"):
                res.sampled += 1
            if exp:
                res.buggy += 1
                res.kinds.update({"/".join((k[0], *k[2:])) for k in exp})  # a send in flight's with its access
            else:
                res.clean += 1
            if summary.get("problems") or summary.get("apply_errors") or summary.get("probe_errors"):
                res.replay_problems += 1
            if exp != obs:
                res.disagreements.append((cname, proto.name, [s.action for s in trace], exp, obs))
    return res


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{'/'.join(map(str, k))}: {sorted(e)}" for k, e in sorted(d.items(), key=str)) + "}"


def _shard(args):
    bound, limit, k, n, samples = args
    return sweep(bound, limit, (k, n), samples)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound", choices=sorted(BOUNDS), default="small")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--limit", type=int, default=None, help="stop after this many traces per job (a quick look)")
    ap.add_argument("--show", type=int, default=10, help="disagreements to print in full")
    ap.add_argument(
        "--samples", type=int, default=0, help="sampled traces per protocol of each three-request config (default 0)"
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    jobs = max(1, args.jobs)
    if jobs == 1:
        parts = [sweep(args.bound, args.limit, samples=args.samples)]
    else:
        from multiprocessing import get_context

        with get_context("fork").Pool(jobs) as pool:
            parts = pool.map(_shard, [(args.bound, args.limit, k, jobs, args.samples) for k in range(jobs)])
    total = SweepResult()
    for p in parts:
        total.traces += p.traces
        total.sampled += p.sampled
        total.buggy += p.buggy
        total.clean += p.clean
        total.disagreements += p.disagreements
        total.kinds.update(p.kinds)
        total.replay_problems += p.replay_problems
    for cname, proto, actions, exp, obs in total.disagreements[: args.show]:
        print(f"DISAGREE {cname}/{proto}: {' '.join(actions)}")
        print(f"    model:   {_fmt(exp)}")
        print(f"    kvguard: {_fmt(obs)}")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(total.kinds.items()))
    print(
        f"conformance ({args.bound}): {total.traces} traces checked ({total.traces - total.sampled} exhaustively, "
        f"{total.sampled} sampled), {total.buggy} buggy ({kinds}), "
        f"{total.clean} clean, {total.replay_problems} with replay problems, "
        f"{time.monotonic() - t0:.0f} s"
    )
    print(f"{len(total.disagreements)} disagreements")
    return 1 if total.disagreements or total.replay_problems else 0


if __name__ == "__main__":
    sys.exit(main())

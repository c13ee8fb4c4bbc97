"""`make soak-memory`: the real ``kvguard sidecar`` beside 8 synthetic ranks at the reference
rate for 30 minutes; its RSS sampled every 30 s must be flat after warm-up and within budget.

Each rank is a process driving ``bench.workload.Workload`` (the reference workload: batch
256, 64-token pages, 32,768-page pool, 60 decode steps/s) through the project's own probes
into its ring. Requests are shorter than the reference's (``--output-tokens 128`` instead
of 1,920) so that the ended-request directories, the part of the sidecar's memory that
grows with traffic, fill within the warm-up instead of after hours: the plateau measured is
the one a node reaches after a day.

    python -m bench.soak_memory [--minutes 30] [--ranks 8] [--memory-budget 384M]

Prints one line per sample (elapsed, RSS, the sidecar's estimate by part, steps/s the ranks
achieved, records lost) and a verdict: after warm-up (the first third), RSS may grow by at
most 5% + 8 MiB beyond what the ended-request directories grew by the sidecar's estimate
(they fill to their share at the rate requests end: on a saturated node that loses
records, for longer than the warm-up), and never past the budget + 128 MiB (the 512Mi
limit). Exit 1 otherwise.
Not part of `make test`: it takes the machine for the whole run.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def engine_main(rank: int, output_tokens: int) -> int:
    """One synthetic rank: the reference workload, paced at its step rate, until SIGTERM."""
    from bench.workload import Workload, WorkloadParams
    from kvguard.engine_hooks.probes import get_probes

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    params = WorkloadParams(output_tokens=output_tokens)
    w = Workload(params, get_probes(), rank)
    w.setup()
    period = 1.0 / params.steps_per_s
    next_t = time.monotonic()
    while not stop:
        w.step()
        next_t += period
        delay = next_t - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_t = time.monotonic()  # behind: run as fast as we can, do not bank the debt
        if w.steps % 60 == 0:
            Path(os.environ["SOAK_STEPS_FILE"]).write_text(str(w.steps))
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) / 1024


def gauge(text: str, name: str) -> dict[str, float]:
    out = {}
    for labels, value in re.findall(r"^%s(\{[^}]*\})? (\S+)$" % re.escape(name), text, re.M):
        out[labels or ""] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--memory-budget", default="384M")
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    ap.add_argument("--engine", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine is not None:
        return engine_main(args.engine, args.output_tokens)

    work = Path(tempfile.mkdtemp(prefix="kvguard-soak-memory-"))
    ring_dir = work / "rings"
    ring_dir.mkdir()
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, KVGUARD_RING_DIR=str(ring_dir), PYTHONPATH=str(REPO))
    env.pop("KVGUARD_DISABLE", None)
    port = free_port()
    kvguard = Path(sys.executable).parent / "kvguard"
    try:
        sidecar = subprocess.Popen(
            [
                str(kvguard),
                "sidecar",
                "--ring-dir",
                str(ring_dir),
                "--listen",
                f"127.0.0.1:{port}",
                "--memory-budget",
                args.memory_budget,
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(work / "sidecar.log", "w"),
            env=env,
        )
        procs.append(sidecar)
        for rank in range(args.ranks):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.soak_memory",
                        "--engine",
                        str(rank),
                        "--output-tokens",
                        str(args.output_tokens),
                    ],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=dict(env, SOAK_STEPS_FILE=str(work / f"steps-{rank}")),
                )
            )
        print(
            f"soak-memory: {args.ranks} ranks, {args.minutes:g} min, --memory-budget {args.memory_budget}, "
            f"work dir {work}",
            flush=True,
        )
        print(
            f"{'min':>6} {'RSS MiB':>8} {'estimate MiB':>13} {'ended/engine':>13} {'steps/s/rank':>13} "
            f"{'lost':>10}  estimate by part (MiB)",
            flush=True,
        )
        samples: list[tuple[float, float, float]] = []  # (minutes, RSS MiB, ended-request estimate MiB)
        t0 = time.monotonic()
        last_steps, last_t = 0, t0
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(args.interval)
            if sidecar.poll() is not None:
                print(f"soak-memory: the sidecar exited ({sidecar.returncode}); its log: {work / 'sidecar.log'}")
                return 1
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
            parts = {k.split('"')[1]: v / MIB for k, v in gauge(text, "kvguard_memory_bytes").items()}
            steps = sum(
                int((work / f"steps-{r}").read_text() or 0) for r in range(args.ranks) if (work / f"steps-{r}").exists()
            )
            now = time.monotonic()
            rate = (steps - last_steps) / (now - last_t) / args.ranks
            last_steps, last_t = steps, now
            rss = rss_mib(sidecar.pid)
            elapsed = (now - t0) / 60
            samples.append((elapsed, rss, parts.get("ended_requests", 0.0)))
            ended = gauge(text, "kvguard_ended_requests_capacity").get("", 0)
            lost = gauge(text, "kvguard_records_lost_total").get("", 0)
            print(
                f"{elapsed:6.1f} {rss:8.1f} {sum(parts.values()):13.1f} {ended:13.0f} {rate:13.1f} {lost:10.0f}  "
                + " ".join(f"{k}={v:.1f}" for k, v in sorted(parts.items())),
                flush=True,
            )
        warm = [(r, e) for t, r, e in samples if t >= args.minutes / 3]
        if len(warm) < 2:
            print("soak-memory: too few samples after warm-up")
            return 1
        limit = (
            float(re.fullmatch(r"(\d+)M(i?)", args.memory_budget).group(1)) + 128
            if re.fullmatch(r"\d+Mi?", args.memory_budget)
            else float("inf")
        )
        # the ended-request directories fill up to their share at the rate requests end (on a
        # saturated node that loses records, over more than the warm-up): their growth is
        # bounded and expected. What else grows is a leak.
        growth = max(r - warm[0][0] - (e - warm[0][1]) for r, e in warm)
        filled = warm[-1][1] - warm[0][1]
        flat = growth <= 0.05 * warm[0][0] + 8
        peak = max(r for _t, r, _e in samples)
        print(
            f"soak-memory: RSS after warm-up {warm[0][0]:.1f} -> max {max(r for r, _e in warm):.1f} MiB; the ended-"
            f"request directories grew {filled:+.1f} MiB by the estimate, the rest {growth:+.1f}; peak {peak:.1f} "
            f"MiB; {'flat' if flat else 'GROWING'}; {'within' if peak <= limit else 'OVER'} budget + 128 MiB "
            f"({limit:.0f})"
        )
        return 0 if flat and peak <= limit else 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())

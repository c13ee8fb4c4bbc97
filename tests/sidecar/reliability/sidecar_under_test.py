"""The real ``kvguard sidecar`` process and a healthy synthetic engine beside it, for the
reliability tests of issue 14 items 3 and 4 (bad ring entries, oversized claims).

Not a test module: the tests of this folder import it as
``tests.sidecar.reliability.sidecar_under_test``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvguard.demo.engine_env import free_port

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "synthetic_engine.py"
KVGUARD = Path(sys.executable).parent / "kvguard"


def checked_reads(metrics: str, pid: int) -> float:
    m = re.search(r'^kvguard_page_reads_checked_total\{[^}]*pid="%d"[^}]*\} (\S+)$' % pid, metrics, re.M)
    return float(m.group(1)) if m else 0.0


def counter(metrics: str, name: str) -> float:
    """The sum of a metric's samples (one sample when it has no labels)."""
    values = re.findall(r"^%s(?:\{[^}]*\})? (\S+)$" % re.escape(name), metrics, re.M)
    return sum(float(v) for v in values)


def died_of(rc: int) -> str:
    return f"killed by {signal.Signals(-rc).name} (returncode {rc})" if rc < 0 else f"exit {rc}"


def vm_hwm_mb(pid: int) -> float:
    """Peak resident set size of a live process, MB."""
    m = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) / 1024


def freeze(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``proc`` and return once every one of its threads is stopped. The signal is
    asynchronous: a sidecar keeps draining its rings for a few milliseconds after kill()
    returns, and a test that fills a ring 'while the sidecar is stopped' then sees several
    gaps where it made one."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    tasks = Path(f"/proc/{proc.pid}/task")
    while True:
        states = []
        for task in tasks.iterdir():
            try:
                stat = (task / "stat").read_text()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            states.append(stat[stat.rindex(")") + 2])
        if states and all(state in "tT" for state in states):
            return
        assert time.monotonic() < deadline, f"pid {proc.pid} not stopped after SIGSTOP: thread states {states}"
        time.sleep(0.002)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sidecar:
    """``kvguard sidecar --ring-dir DIR --listen 127.0.0.1:PORT`` with its log in a file."""

    def __init__(self, ring_dir: Path, log: Path, procs: list, extra: tuple = (), nofile: int | None = None):
        self.port = free_port()
        self.log = log

        def limit_fds():  # in the child, before exec: the sidecar starts under this fd limit
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [str(KVGUARD), "sidecar", "--ring-dir", str(ring_dir), "--listen", f"127.0.0.1:{self.port}", *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=limit_fds if nofile else None,
            )
        procs.append(self.proc)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, cond, timeout: float):
        return wait_for(what, cond, timeout, self.proc, self.log)

    def reads_keep_being_checked(self, engine_pid: int, more: int = 50, timeout: float = 8) -> None:
        before = checked_reads(self.wait_for("a scrape", self.metrics, timeout), engine_pid)
        self.wait_for(
            "the healthy engine's reads to keep being checked",
            lambda: checked_reads(self.metrics(), engine_pid) > before + more,
            timeout,
        )


def wait_for(what: str, cond, timeout: float, proc: subprocess.Popen, log: Path):
    """cond()'s first truthy value; fails with the sidecar's log if it dies or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(
                f"the sidecar died while waiting for {what}: {died_of(proc.returncode)}\n"
                f"its log:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            value = cond()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out waiting for {what}; sidecar log:\n{log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.1)


def stop_all(started: list) -> None:
    for p in reversed(started):
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait(timeout=10)
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()


def start_engine(
    ring_dir: Path, procs: list, mode: str = "loop", ring_bytes: int = 1 << 20
) -> tuple[subprocess.Popen, str]:
    """A healthy synthetic engine (``loop``: one clean request cycle every few ms; ``flood``:
    as fast as it can); its ring path."""
    env = dict(os.environ, KVGUARD_RING_DIR=str(ring_dir), KVGUARD_RING_BYTES=str(ring_bytes))
    env.pop("KVGUARD_DISABLE", None)
    p = subprocess.Popen(
        [sys.executable, str(ENGINE), mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    procs.append(p)
    path = p.stdout.readline().strip()
    assert path, "the synthetic engine made no ring"
    return p, path


def healthy_setup(tmp_path: Path, procs: list, extra: tuple = (), nofile: int | None = None):
    """A ring dir with a healthy engine whose reads the sidecar already checks."""
    ring_dir = tmp_path / "rings"
    ring_dir.mkdir()
    engine, _ = start_engine(ring_dir, procs)
    sidecar = Sidecar(ring_dir, tmp_path / "sidecar.log", procs, extra=extra, nofile=nofile)
    sidecar.wait_for("the healthy engine's reads checked", lambda: checked_reads(sidecar.metrics(), engine.pid) > 0, 20)
    return ring_dir, engine, sidecar

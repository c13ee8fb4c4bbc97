"""One SGLang engine as a subprocess: :func:`start_engine`, the :class:`Engine` handle
(readiness, stop of its process group, /dev/shm clean-up) and :class:`EngineStartError`.
Re-exported by :mod:`kvguard.demo.engines`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvguard.demo.engine_env import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_WAITING_TIMEOUT_S,
    LOG_TAIL_LINES,
    default_model_dir,
    engine_args,
    engine_env,
    free_port,
)

logger = logging.getLogger("kvguard.demo.engines")  # the harness's logger name, as before the split


class EngineStartError(RuntimeError):
    """An engine exited or did not become ready; the message ends with its log tail."""


# ---------------------------------------------------------------- one engine


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=n))
    except OSError as exc:
        return f"(no log: {exc})"


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid`` (Linux /proc)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # NOTE: comm (field 2) may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            pids.append(int(entry.name))
    return pids


_SGLANG_SHM_PREFIXES = ("sglang_loads_", "sgl_shm_")


def _shm_files(pids: Iterable[int]) -> set[str]:
    """/dev/shm files that ``pids`` have mapped or open (Linux /proc)."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            pass
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                target = os.readlink(fd.path)
                if target.startswith("/dev/shm/"):
                    found.add(target)
        except OSError:
            pass
    return {f.removesuffix(" (deleted)") for f in found if f.startswith("/dev/shm/")}


@dataclass
class Engine:
    """One running ``sglang.launch_server`` process group."""

    version: str
    role: str | None
    port: int
    log_path: Path
    proc: subprocess.Popen
    bootstrap_port: int | None = None
    spawned_at: float = field(default_factory=time.monotonic)  # time.monotonic()
    tmp_dir: Path | None = None  # the engine's TMPDIR, removed by stop()
    startup_s: float | None = None  # spawn -> /health 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"sglang-{self.version}-{self.role or 'plain'}:{self.port}"

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, n)

    def wait_ready(self, timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> float:
        """Poll ``/health`` until 200 (SGLang answers 503 until warmup is done).

        Returns the start-up time (spawn -> ready). Raises EngineStartError with the
        log tail when the process exits or ``timeout_s`` passes; the engine is stopped.
        """
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    self.stop()
                    raise EngineStartError(
                        f"{self.name} exited with {self.proc.returncode} during start-up; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        self.startup_s = time.monotonic() - self.spawned_at
                        return self.startup_s
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineStartError(
                        f"{self.name} not ready after {timeout_s:.0f} s; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def server_info(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/server_info", timeout=10.0)
        r.raise_for_status()
        return r.json()

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``timeout_s``.

        Returns once no live process of the group remains (~6 s: SGLang's leader
        sees its scheduler exit and waits 5 s for crash diagnostics before it
        kills its tree; a SIGTERM to the leader alone drains for 5-20 s instead).
        Idempotent.
        """
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        # NOTE: SGLang leaves /dev/shm segments (sglang_loads_*) behind when its
        # processes die by signal; note the ones this engine holds, unlink them after.
        shm = _shm_files(_group_members(pgid))
        try:
            self._terminate(pgid, timeout_s)
        finally:
            for path in shm:
                # Only SGLang's own families: kvguard rings must outlive the engine.
                if os.path.basename(path).startswith(_SGLANG_SHM_PREFIXES) and not _group_members(pgid):
                    Path(path).unlink(missing_ok=True)
            if self.tmp_dir is not None and not _group_members(pgid):
                shutil.rmtree(self.tmp_dir, ignore_errors=True)

    def _terminate(self, pgid: int, timeout_s: float) -> None:
        _terminate_group(self.proc, self.name, timeout_s)


def _terminate_group(proc: subprocess.Popen, name: str, timeout_s: float) -> None:
    """SIGTERM the process group led by ``proc`` (start_new_session), SIGKILL after ``timeout_s``."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None and not _group_members(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader
            if proc.returncode is not None and not _group_members(pgid):
                return
            time.sleep(0.1)
        if sig == signal.SIGTERM:
            logger.warning("%s: still running %.0f s after SIGTERM; sending SIGKILL", name, wait_s)
    logger.error("%s: processes %s survived SIGKILL", name, _group_members(pgid))


def start_engine(
    version: str,
    log_dir: str | os.PathLike,
    *,
    role: str | None = None,
    model_dir: str | os.PathLike | None = None,
    max_total_tokens: int = 1024,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    port: int | None = None,
    bootstrap_port: int | None = None,
    ring_dir: str | os.PathLike | None = None,
    waiting_timeout_s: int = DEFAULT_WAITING_TIMEOUT_S,
    load_format: str = "dummy",
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    extra_pythonpath: Iterable[str | os.PathLike] = (),
    python: str = sys.executable,
    wait: bool = True,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> Engine:
    """Spawn one engine; with ``wait`` (default) return only once it serves.

    The log goes to ``<log_dir>/sglang-<version>-<role>-<port>.log``.
    """
    env = engine_env(
        version,
        ring_dir,
        waiting_timeout_s=waiting_timeout_s,
        extra_pythonpath=extra_pythonpath,
        extra_env=extra_env,
    )
    model_dir = model_dir or default_model_dir(context_length)
    port = port or free_port()
    if role is not None and bootstrap_port is None:
        bootstrap_port = free_port()
    args = engine_args(
        model_dir,
        port,
        role=role,
        max_total_tokens=max_total_tokens,
        context_length=context_length,
        bootstrap_port=bootstrap_port,
        load_format=load_format,
        extra_args=extra_args,
    )
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"sglang-{version}-{role or 'plain'}-{port}.log"
    # A private, short TMPDIR: SGLang leaves its ZMQ ipc:// socket files there
    # (short, because a Unix socket path must fit in 107 bytes).
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"kvg-sgl-{port}-"))
    env["TMPDIR"] = str(tmp_dir)
    t0 = time.monotonic()
    try:
        with open(log_path, "ab") as log:
            # NOTE: cwd is the log folder, not the repo: `python -m` puts cwd first on
            # sys.path, and a folder holding a package's source shadows the installed one.
            proc = subprocess.Popen(
                [python, "-m", "sglang.launch_server", *args],
                cwd=log_dir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    engine = Engine(version, role, port, log_path, proc, bootstrap_port=bootstrap_port, spawned_at=t0, tmp_dir=tmp_dir)
    logger.info("started %s (pid %d), log %s", engine.name, proc.pid, log_path)
    if wait:
        engine.wait_ready(startup_timeout_s)
        logger.info("%s ready in %.1f s", engine.name, engine.startup_s)
    return engine

"""SGLang's router (``sglang_router.launch_router``, PD mode) in front of a prefill and a
decode engine: :func:`start_router` and the :class:`Router` handle. Re-exported by
:mod:`kvguard.demo.engines`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvguard.demo.engine_env import LOG_TAIL_LINES, free_port
from kvguard.demo.engine_process import Engine, EngineStartError, _tail, _terminate_group
from kvguard.demo.engine_requests import _error_text

logger = logging.getLogger("kvguard.demo.engines")  # the harness's logger name, as before the split

# ---------------------------------------------------------------- the router

DEFAULT_ROUTER_STARTUP_TIMEOUT_S = 60.0
# A request the router forwards but both engines refuse before their schedulers see it
# (SGLang validates sampling parameters in the tokenizer manager: HTTP 400): it proves
# that the router admitted a prefill and a decode worker without putting a request into
# either KV cache or the kvguard rings (a real request would shift the page layout the
# demo relies on). Until its health checks admit the workers the router answers
# "No prefill workers available" (503) instead.
ROUTER_SMOKE_BODY: dict[str, Any] = {"input_ids": [3], "sampling_params": {"max_new_tokens": 1, "temperature": -1.0}}


def router_available() -> str | None:
    """Why the router cannot run here, or None when ``sglang_router`` is installed."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        return "sglang-router is not installed in this Python (run `make venv`: requirements/engine.lock)"
    return None


def router_args(
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    port: int,
    metrics_port: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``sglang_router.launch_router`` arguments (after ``-m sglang_router.launch_router``)."""
    return [
        "--pd-disaggregation",
        "--prefill", prefill_url, str(bootstrap_port),
        "--decode", decode_url,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--prometheus-port", str(metrics_port),
        "--prometheus-host", "127.0.0.1",
        *extra_args,
    ]  # fmt: skip


@dataclass
class Router:
    """One running ``sglang_router.launch_router`` (PD mode) process group."""

    port: int
    metrics_port: int
    log_path: Path
    proc: subprocess.Popen
    spawned_at: float = field(default_factory=time.monotonic)
    startup_s: float | None = None  # spawn -> the first request forwarded to the workers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def name(self) -> str:
        return f"sglang-router:{self.port}"

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        return _tail(self.log_path, n)

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = DEFAULT_ROUTER_STARTUP_TIMEOUT_S) -> float:
        """Post :data:`ROUTER_SMOKE_BODY` until an engine's answer comes back through the router.

        Returns the start-up time (spawn -> ready). Raises EngineStartError with the log
        tail when the router exits or ``timeout_s`` passes; the router is stopped.
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        with httpx.Client(timeout=10.0) as client:
            while True:
                if self.proc.poll() is not None:
                    self.stop()
                    raise EngineStartError(
                        f"{self.name} exited with {self.proc.returncode} during start-up; "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    r = client.post(self.url + "/generate", json=ROUTER_SMOKE_BODY)
                    # 400: an engine's validation error came back (forwarded); 200 only if an
                    # engine took the request anyway. 503 "No prefill workers available": not yet.
                    if r.status_code in (200, 400):
                        self.startup_s = time.monotonic() - self.spawned_at
                        return self.startup_s
                    last = f"HTTP {r.status_code}: {_error_text(r)[:200]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineStartError(
                        f"{self.name} did not forward a request after {timeout_s:.0f} s (last: {last}); "
                        f"last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the router's process group, SIGKILL what is left after ``timeout_s``; idempotent."""
        _terminate_group(self.proc, self.name, timeout_s)


def start_router(
    prefill: Engine,
    decode: Engine,
    log_dir: str | os.PathLike,
    *,
    port: int | None = None,
    metrics_port: int | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    wait: bool = True,
    startup_timeout_s: float = DEFAULT_ROUTER_STARTUP_TIMEOUT_S,
) -> Router:
    """Spawn SGLang's router in front of ``prefill`` and ``decode``; with ``wait`` (default)
    return only once it forwards requests to both.

    The log goes to ``<log_dir>/sglang-router-<port>.log``.
    """
    missing = router_available() if python == sys.executable else None
    if missing:
        raise FileNotFoundError(missing)
    if prefill.bootstrap_port is None:
        raise ValueError(f"{prefill.name} has no bootstrap port: is it a prefill engine?")
    port = port or free_port()
    metrics_port = metrics_port or free_port()
    args = router_args(prefill.url, prefill.bootstrap_port, decode.url, port, metrics_port, extra_args)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"sglang-router-{port}.log"
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        # cwd: the log folder, for the same reason as the engines' (no source folder shadows a package)
        proc = subprocess.Popen(
            [python, "-m", "sglang_router.launch_router", *args],
            cwd=log_dir,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    router = Router(port, metrics_port, log_path, proc, spawned_at=t0)
    logger.info(
        "started %s (pid %d) in front of %s and %s, log %s", router.name, proc.pid, prefill.name, decode.name, log_path
    )
    if wait:
        router.wait_ready(startup_timeout_s)
        logger.info("%s ready in %.1f s", router.name, router.startup_s)
    return router

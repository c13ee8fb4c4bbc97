"""Real SGLang HTTP servers on CPU, as subprocesses, for the demo and the tests.

Each engine is ``python -m sglang.launch_server`` with a tiny dummy-weight GPT-2
(:mod:`sidecar.demo.model`) or, with ``load_format="auto"``, a model with real weights
such as the echo GPT-2 (:mod:`sidecar.demo.echo_model`), for one SGLang version installed under
``.venv/sglang/<version>`` (``make venv``) and chosen by ``PYTHONPATH``, and one
role: ``"prefill"``, ``"decode"`` or ``None`` (a plain engine).

A prefill/decode pair (:class:`PDPair`) moves real KV bytes over Mooncake/TCP. By
default SGLang's own router (``sglang-router``, :class:`Router`) runs in front of it
and requests go to the router as a client sends them: no ``rid``, no bootstrap
fields. The router picks a ``bootstrap_room``, adds ``bootstrap_host/port/room`` to
the body and posts it to both engines, and each engine draws its own rid (prefill's
and decode's differ). The client learns decode's rid (``meta_info["id"]``), never
the room. ``router=False`` keeps the direct path: the same body, with an explicit
rid and room, posted to both engines by this process.

    with PDPair("0.5.19", ring_dir, log_dir) as pair:
        r = pair.generate([5, 6, 7] * 70, tenant="acme", max_new_tokens=8)

Every engine and the router run in their own session (process group); :meth:`Engine.stop`
sends SIGTERM to the group, then SIGKILL, and waits until no process of it is left.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvguard.demo.model import write_tiny_gpt2

logger = logging.getLogger(__name__)

SGLANG_VERSIONS = ("0.5.19", "0.5.23")
ROLES = (None, "prefill", "decode")
LEAKING_VERSION = "0.5.19"  # newest release with the incident's bug
FIXED_VERSION = "0.5.23"

DEFAULT_CONTEXT_LENGTH = 2048
DEFAULT_WAITING_TIMEOUT_S = 20
DEFAULT_STARTUP_TIMEOUT_S = 240.0
LOG_TAIL_LINES = 40

# Tenant label as sent in the /generate body. SGLang's `routing_key` reaches the
# scheduler's Req in 0.5.19..0.5.23 (custom_labels does not): the adapter reads it
# there (engine_hooks/sglang/README.md).
TENANT_FIELD = "routing_key"
# sglang-router 0.3.2 re-serialises a /generate body from its own request type, which
# has no `routing_key` (dropped, as is an x-smg-routing-key header on /generate) but
# has `extra_key`, which reaches Req on both workers. Routed requests carry the tenant
# in both fields, and the engines read `routing_key` first, then `extra_key`.
# NOTE: extra_key also scopes SGLang's prefix cache to the tenant (no cross-tenant
# prefix hits), which the demo's prompts never have anyway.
ROUTED_TENANT_FIELDS = ("routing_key", "extra_key")
# KVGUARD_SGLANG_TENANT_FIELDS of the engines started here (the plugin's default too; pinned
# because the harness relies on it)
ENGINE_TENANT_FIELDS = "routing_key,extra_key"


def tenant_payload(tenant: str | None, routed: bool = False) -> dict[str, Any]:
    """The /generate body fields that carry the tenant label (to an engine, or through the router)."""
    if tenant is None:
        return {}
    return {f: tenant for f in ROUTED_TENANT_FIELDS} if routed else {TENANT_FIELD: tenant}


class EngineStartError(RuntimeError):
    """An engine exited or did not become ready; the message ends with its log tail."""


# ---------------------------------------------------------------- paths, env, args


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def shim_dir() -> Path:
    """Folder with the test-only ``sitecustomize.py`` (torchvision op schemas)."""
    return Path(__file__).resolve().parent / "shim"


def sglang_dir(version: str, root: Path | None = None) -> Path:
    """``.venv/sglang/<version>``; ValueError for an unknown version, FileNotFoundError if absent."""
    if version not in SGLANG_VERSIONS:
        raise ValueError(f"SGLang version must be one of {SGLANG_VERSIONS}, got {version!r}")
    d = (root or repo_root()) / ".venv" / "sglang" / version
    if not (d / "sglang").is_dir():
        raise FileNotFoundError(f"SGLang {version} is not installed at {d}: run `make venv`")
    return d


def default_model_dir(context_length: int = DEFAULT_CONTEXT_LENGTH) -> Path:
    """The tiny model, cached under ``<repo>/.kvguard-cache/models``."""
    return write_tiny_gpt2(
        repo_root() / ".kvguard-cache" / "models" / f"tiny-gpt2-{context_length}",
        n_positions=context_length,
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(
    version: str,
    ring_dir: str | os.PathLike | None = None,
    *,
    waiting_timeout_s: int = DEFAULT_WAITING_TIMEOUT_S,
    extra_pythonpath: Iterable[str | os.PathLike] = (),
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of an engine subprocess."""
    env = dict(os.environ)
    paths = [str(sglang_dir(version)), str(shim_dir()), *map(str, extra_pythonpath)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        # 0.5.19's paged allocator calls Triton kernels even on CPU.
        TRITON_INTERPRET="1",
        MOONCAKE_PROTOCOL="tcp",
        MC_FORCE_TCP="1",
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(waiting_timeout_s),
        # /health answers from server state instead of running a 1-token request,
        # so readiness polls put no phantom requests into the KV cache.
        SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION="0",
        # Prefill's early send of radix-cached prefix pages records a torch.cuda.Event
        # under the overlap scheduler: no CUDA here. The regular final send still
        # transfers every page. (Override via extra_env, with --disable-overlap-schedule
        # in prefill_args, to exercise the early-send path on CPU.)
        SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",
        KVGUARD_SGLANG_CPU_COMPAT="1",
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("KVGUARD_SGLANG_TENANT_FIELDS", ENGINE_TENANT_FIELDS)
    if ring_dir is not None:
        Path(ring_dir).mkdir(parents=True, exist_ok=True)
        env["KVGUARD_RING_DIR"] = str(ring_dir)
    if extra_env:
        env.update(extra_env)
    return env


def engine_args(
    model_dir: str | os.PathLike,
    port: int,
    *,
    role: str | None = None,
    max_total_tokens: int = 1024,
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    bootstrap_port: int | None = None,
    load_format: str = "dummy",
    extra_args: Sequence[str] = (),
) -> list[str]:
    """``sglang.launch_server`` arguments (after ``-m sglang.launch_server``).

    ``load_format``: ``"dummy"`` (random weights, the tiny model) or ``"auto"`` (the
    checkpoint's own weights, e.g. the echo model).
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    args = [
        "--model-path", str(model_dir),
        "--load-format", load_format,
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--disable-cuda-graph",
        "--dtype", "bfloat16",
        "--page-size", "4",
        "--max-total-tokens", str(max_total_tokens),
        "--context-length", str(context_length),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if role is not None:
        if bootstrap_port is None:
            raise ValueError(f"role {role!r} needs bootstrap_port")
        args += [
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", "mooncake",
            "--disaggregation-bootstrap-port", str(bootstrap_port),
        ]  # fmt: skip
        if role == "decode":
            args += [
                "--num-reserved-decode-tokens", "32",
                "--disaggregation-decode-retraction-backup", "cpu_tensor",
            ]  # fmt: skip
    return args + list(extra_args)


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


# ---------------------------------------------------------------- requests


@dataclass
class GenerateResult:
    """The client-visible outcome of one request sent to a prefill/decode pair.

    Through the router (``routed``) the client gets one answer, the router's, which
    relays decode's: it is in ``decode_status`` / ``decode_json`` / ``error``, and
    ``prefill_status`` / ``prefill_error`` stay None. ``rid`` is then decode's rid
    (``meta_info["id"]``; from the error text when decode failed the request; the
    client's own when it sent one) and ``room`` is None unless the answer names it
    (decode's transfer errors do): the router chose it.
    """

    rid: str | None
    room: int | None
    tenant: str | None
    prompt_len: int
    prefill_status: int | None  # HTTP status; None: no response (connection error), or routed
    decode_status: int | None
    decode_json: dict[str, Any] | None = None  # decode's body when it is JSON
    error: str | None = None  # decode's error text (what the client sees)
    prefill_error: str | None = None
    latency_s: float = 0.0  # send -> decode's complete response
    ttft_s: float | None = None  # send -> first streamed chunk (stream=True only)
    prefill_latency_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    routed: bool = False  # sent to SGLang's router (one request), not to both engines
    chunks: int = 0  # streamed chunks received (stream=True only)
    disconnected: bool = False  # the client closed the stream after disconnect_after_chunks chunks

    @property
    def meta_info(self) -> dict[str, Any]:
        return (self.decode_json or {}).get("meta_info") or {}

    @property
    def prompt_tokens(self) -> int | None:
        return self.meta_info.get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self.meta_info.get("completion_tokens")

    @property
    def finish_reason(self) -> str | None:
        fr = self.meta_info.get("finish_reason")
        return fr.get("type") if isinstance(fr, dict) else fr

    @property
    def ok(self) -> bool:
        """What a status-code check sees: decode answered 200 with no error."""
        return self.decode_status == 200 and self.error is None

    def summary(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "room": self.room,
            "tenant": self.tenant,
            "prompt_len": self.prompt_len,
            "routed": self.routed,
            "prefill_status": self.prefill_status,
            "decode_status": self.decode_status,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "error": self.error,
            "prefill_error": self.prefill_error,
            "disconnected": self.disconnected,
            "latency_s": round(self.latency_s, 3),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 3),
        }


# What decode's transfer errors say about the request, e.g. "Decode transfer failed for
# request rank=0 decode_req.req.rid='798c...' decode_req.req.bootstrap_room=2504... with ...".
_ERROR_RID = re.compile(r"\brid='([^']+)'")
_ERROR_ROOM = re.compile(r"\bbootstrap_room=(\d+)")


def ids_from_error(error: str | None) -> tuple[str | None, int | None]:
    """(rid, bootstrap_room) named in an engine's error text, None for what it does not name."""
    if not error:
        return None, None
    rid, room = _ERROR_RID.search(error), _ERROR_ROOM.search(error)
    return (rid.group(1) if rid else None), (int(room.group(1)) if room else None)


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


@dataclass
class _Reply:
    status: int | None
    body: dict[str, Any] | None
    error: str | None
    latency_s: float
    ttft_s: float | None = None
    chunks: int = 0
    disconnected: bool = False


def _post(url: str, payload: dict[str, Any], timeout_s: float, t0: float) -> _Reply:
    try:
        r = httpx.post(url, json=payload, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return _Reply(None, None, f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    latency = time.monotonic() - t0
    if r.status_code != 200:
        return _Reply(r.status_code, None, _error_text(r), latency)
    try:
        return _Reply(200, r.json(), None, latency)
    except ValueError:
        return _Reply(200, None, f"non-JSON body: {r.text[:200]!r}", latency)


def _post_stream(
    url: str, payload: dict[str, Any], timeout_s: float, t0: float, disconnect_after_chunks: int | None = None
) -> _Reply:
    """SSE ``data: {...}`` chunks; SGLang reports errors in a chunk with HTTP 200.

    ``disconnect_after_chunks``: close the connection after that many chunks, as a
    client that goes away mid-stream (SGLang aborts the request when it notices).
    """
    ttft = None
    last: dict[str, Any] | None = None
    error = None
    chunks = 0
    cut = False
    try:
        with httpx.stream("POST", url, json=payload, timeout=timeout_s) as r:
            if r.status_code != 200:
                r.read()
                return _Reply(r.status_code, None, _error_text(r), time.monotonic() - t0)
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                chunks += 1
                if ttft is None:
                    ttft = time.monotonic() - t0
                if "error" in chunk:
                    err = chunk["error"]
                    error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
                else:
                    last = chunk
                if disconnect_after_chunks is not None and chunks >= disconnect_after_chunks:
                    cut = True
                    break  # leaving the block closes the connection
            status = r.status_code
    except (httpx.HTTPError, ValueError) as exc:
        return _Reply(None, last, f"{type(exc).__name__}: {exc}", time.monotonic() - t0, ttft, chunks)
    return _Reply(status, last, error, time.monotonic() - t0, ttft, chunks, cut)


# ---------------------------------------------------------------- prefill/decode pair


class PDPair:
    """A prefill engine and a decode engine of one SGLang version, Mooncake over TCP,
    with SGLang's router in front (``router=False``: none; requests go to both engines).

    Prefill starts first: its tokenizer manager hosts the bootstrap server that
    decode registers with; the router starts once both serve. All are stopped on
    exit: the router, then decode and prefill.

    ``router_args``: extra ``launch_router`` arguments (e.g. ``["--disable-retries"]``).
    ``progress``: called with one line per start-up step (the demo prints them).
    """

    def __init__(
        self,
        version: str,
        ring_dir: str | os.PathLike | None,
        log_dir: str | os.PathLike,
        prefill_pool_tokens: int = 256,
        decode_pool_tokens: int = 1024,
        *,
        model_dir: str | os.PathLike | None = None,
        context_length: int = DEFAULT_CONTEXT_LENGTH,
        waiting_timeout_s: int = DEFAULT_WAITING_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        extra_pythonpath: Iterable[str | os.PathLike] = (),
        load_format: str = "dummy",
        router: bool = True,
        router_args: Sequence[str] = (),
        progress: Callable[[str], None] | None = None,
    ) -> None:
        sglang_dir(version)  # fail early with the `make venv` hint
        if router and (missing := router_available()):
            raise FileNotFoundError(missing)
        self.version = version
        self.ring_dir = ring_dir
        self.log_dir = Path(log_dir)
        self.prefill_pool_tokens = prefill_pool_tokens
        self.decode_pool_tokens = decode_pool_tokens
        self.model_dir = model_dir
        self.context_length = context_length
        self.waiting_timeout_s = waiting_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.prefill_args = list(prefill_args)
        self.decode_args = list(decode_args)
        self.extra_env = dict(extra_env or {})
        self.extra_pythonpath = list(extra_pythonpath)
        self.load_format = load_format
        self.use_router = router
        self.router_args = list(router_args)
        self.progress = progress
        self.bootstrap_port: int | None = None
        self.prefill: Engine | None = None
        self.decode: Engine | None = None
        self.router: Router | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        """Where a client sends requests: the router (``router=False``: decode, which
        alone answers nothing without prefill; use :meth:`generate`)."""
        if self.router is not None:
            return self.router.url
        if self.decode is None:
            raise RuntimeError("PDPair is not started")
        return self.decode.url

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    # -- lifecycle

    def _start(self, role: str, pool_tokens: int, args: Sequence[str], wait: bool) -> Engine:
        return start_engine(
            self.version,
            self.log_dir,
            role=role,
            model_dir=self.model_dir,
            max_total_tokens=pool_tokens,
            context_length=self.context_length,
            bootstrap_port=self.bootstrap_port,
            ring_dir=self.ring_dir,
            waiting_timeout_s=self.waiting_timeout_s,
            load_format=self.load_format,
            extra_args=args,
            extra_env=self.extra_env,
            extra_pythonpath=self.extra_pythonpath,
            startup_timeout_s=self.startup_timeout_s,
            wait=wait,
        )

    def start(self) -> PDPair:
        """Start prefill; start decode once prefill's bootstrap server listens; wait for
        both; then start the router in front of them and wait until it forwards.

        NOTE: overlapping the two start-ups saves ~15 s on 2 cores. Decode needs
        the bootstrap server only when the first request arrives (its warmup uses
        SGLang's fake bootstrap host), but it is up long before then anyway.
        """
        t0 = time.monotonic()
        self.model_dir = self.model_dir or default_model_dir(self.context_length)
        self.bootstrap_port = free_port()
        try:
            self._say(f"starting the prefill engine (SGLang {self.version}, KV pool {self.prefill_pool_tokens} tokens)")
            self.prefill = self._start("prefill", self.prefill_pool_tokens, self.prefill_args, wait=False)
            self._wait_bootstrap_server(t0)
            self._say(f"starting the decode engine (KV pool {self.decode_pool_tokens} tokens)")
            self.decode = self._start("decode", self.decode_pool_tokens, self.decode_args, wait=False)
            self.prefill.wait_ready(max(0.0, t0 + self.startup_timeout_s - time.monotonic()))
            self._say(f"prefill engine ready in {self.prefill.startup_s:.0f} s")
            self.decode.wait_ready(max(0.0, t0 + self.startup_timeout_s - time.monotonic()))
            self._say(f"decode engine ready in {self.decode.startup_s:.0f} s")
            if self.use_router:
                self._say("starting SGLang's router in front of them")
                self.router = start_router(self.prefill, self.decode, self.log_dir, extra_args=self.router_args)
                self._say(f"router ready in {self.router.startup_s:.0f} s: it forwards requests to both engines")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        logger.info(
            "SGLang %s prefill/decode pair ready in %.1f s (prefill %.1f s, decode %.1f s%s)",
            self.version,
            self.startup_s,
            self.prefill.startup_s,
            self.decode.startup_s,
            f", router {self.router.startup_s:.1f} s" if self.router else "",
        )
        return self

    def _wait_bootstrap_server(self, t0: float) -> None:
        assert self.prefill is not None and self.bootstrap_port is not None
        deadline = t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.prefill.is_running():
                self.prefill.wait_ready(0)  # raises with the log tail
            try:
                with socket.create_connection(("127.0.0.1", self.bootstrap_port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.3)
        self.prefill.wait_ready(0)  # raises with the log tail unless ready

    def stop(self) -> None:
        """Stop the router, then both engines (in parallel); idempotent."""
        if self.router is not None:
            self.router.stop()
        engines = [e for e in (self.decode, self.prefill) if e is not None]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(Engine.stop, engines))

    def __enter__(self) -> PDPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        tenant: str | None = None,
        max_new_tokens: int = 8,
        room: int | None = None,
        rid: str | None = None,
        stream: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        disconnect_after_chunks: int | None = None,
    ) -> GenerateResult:
        """Send one request, as a client: to the router, or (``router=False``) to both
        engines concurrently, the router's way.

        ``prompt``: text, or token ids (ints in 3..255 with the tiny model: exact
        lengths). ``stream`` streams decode's answer (TTFT); ``disconnect_after_chunks``
        (with ``stream``) closes the connection after that many chunks, a client going
        away mid-stream. Through the router ``rid`` is left out unless given (each engine
        then draws its own) and ``room`` cannot be chosen (the router draws it). The
        default HTTP timeout outlasts decode's waiting timeout, so a request whose KV
        never arrives returns decode's own error rather than a client timeout.
        """
        if self.prefill is None or self.decode is None:
            raise RuntimeError("PDPair is not started")
        if disconnect_after_chunks is not None and not stream:
            raise ValueError("disconnect_after_chunks needs stream=True")
        timeout_s = timeout_s or self.waiting_timeout_s + 120.0
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **(sampling_params or {})},
        }
        if isinstance(prompt, str):
            body["text"] = prompt
            prompt_len = -1  # unknown without the tokenizer
        else:
            body["input_ids"] = [int(t) for t in prompt]
            prompt_len = len(body["input_ids"])
        if self.router is not None:
            if room is not None:
                raise ValueError("the router draws bootstrap_room itself: use PDPair(router=False) to choose it")
            return self._generate_routed(body, rid, tenant, prompt_len, stream, timeout_s, disconnect_after_chunks)
        room = random.randrange(1, 2**63) if room is None else room
        rid = rid or f"kvg-{uuid.uuid4().hex[:16]}"
        body.update(
            {
                "rid": rid,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": room,
                **tenant_payload(tenant),
            }
        )
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            fp = pool.submit(_post, self.prefill.url + "/generate", body, timeout_s, t0)
            d_body = {**body, "stream": stream}
            if stream:
                fd = pool.submit(
                    _post_stream, self.decode.url + "/generate", d_body, timeout_s, t0, disconnect_after_chunks
                )
            else:
                fd = pool.submit(_post, self.decode.url + "/generate", d_body, timeout_s, t0)
            p, d = fp.result(), fd.result()
        result = _result(d, rid, room, tenant, prompt_len)
        result.prefill_status, result.prefill_error, result.prefill_latency_s = p.status, p.error, p.latency_s
        return result

    def _generate_routed(
        self,
        body: dict[str, Any],
        rid: str | None,
        tenant: str | None,
        prompt_len: int,
        stream: bool,
        timeout_s: float,
        disconnect_after_chunks: int | None,
    ) -> GenerateResult:
        assert self.router is not None
        body = {**body, **tenant_payload(tenant, routed=True), "stream": stream}
        if rid is not None:
            body["rid"] = rid  # the router forwards it: both engines then use it
        t0 = time.monotonic()
        url = self.router.url + "/generate"
        reply = (
            _post_stream(url, body, timeout_s, t0, disconnect_after_chunks)
            if stream
            else _post(url, body, timeout_s, t0)
        )
        result = _result(reply, rid, None, tenant, prompt_len)
        result.routed = True
        result.prefill_status = None
        # decode's rid: the answer's meta_info id, else what decode's error names
        err_rid, err_room = ids_from_error(reply.error)
        result.rid = result.meta_info.get("id") or err_rid or rid
        result.room = err_room
        return result


def _result(d: _Reply, rid: str | None, room: int | None, tenant: str | None, prompt_len: int) -> GenerateResult:
    """A GenerateResult from decode's (or the router's) answer."""
    body_d = d.body or {}
    error = d.error
    fr = (body_d.get("meta_info") or {}).get("finish_reason")
    if error is None and isinstance(fr, dict) and fr.get("type") == "abort":
        # Streaming (and some abort paths) report a failure as HTTP 200 + abort.
        error = str(fr.get("message") or "aborted")
    return GenerateResult(
        rid=rid,
        room=room,
        tenant=tenant,
        prompt_len=prompt_len,
        prefill_status=None,
        decode_status=d.status,
        decode_json=d.body,
        error=error,
        latency_s=d.latency_s,
        ttft_s=d.ttft_s,
        output_ids=list(body_d.get("output_ids") or []),
        chunks=d.chunks,
        disconnected=d.disconnected,
    )

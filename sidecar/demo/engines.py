"""Real SGLang HTTP servers on CPU, as subprocesses, for the demo and the tests.

Each engine is ``python -m sglang.launch_server`` with a tiny dummy-weight GPT-2
(:mod:`sidecar.demo.model`) or, with ``load_format="auto"``, a model with real weights
such as the echo GPT-2 (:mod:`sidecar.demo.echo_model`), for one SGLang version installed under
``.venv/sglang/<version>`` (``make venv``) and chosen by ``PYTHONPATH``, and one
role: ``"prefill"``, ``"decode"`` or ``None`` (a plain engine).

A prefill/decode pair (:class:`PDPair`) moves real KV bytes over Mooncake/TCP.
Requests are sent the way SGLang's router does it: the same ``/generate`` body,
with one random ``bootstrap_room``, posted to both servers at once.

    with PDPair("0.5.19", ring_dir, log_dir) as pair:
        r = pair.generate([5, 6, 7] * 70, tenant="acme", max_new_tokens=8)

Every engine runs in its own session (process group); :meth:`Engine.stop` sends
SIGTERM to the group, then SIGKILL, and waits until no process of it is left.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import httpx

from sidecar.demo.model import write_tiny_gpt2

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


def tenant_payload(tenant: str | None) -> dict[str, Any]:
    """The /generate body fields that carry the tenant label."""
    return {} if tenant is None else {TENANT_FIELD: tenant}


class EngineStartError(RuntimeError):
    """An engine exited or did not become ready; the message ends with its log tail."""


# ---------------------------------------------------------------- paths, env, args


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


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
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None and not _group_members(pgid):
                return
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader
                if self.proc.returncode is not None and not _group_members(pgid):
                    return
                time.sleep(0.1)
            if sig == signal.SIGTERM:
                logger.warning("%s: still running %.0f s after SIGTERM; sending SIGKILL", self.name, wait_s)
        logger.error("%s: processes %s survived SIGKILL", self.name, _group_members(pgid))


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
    engine = Engine(
        version, role, port, log_path, proc, bootstrap_port=bootstrap_port, spawned_at=t0, tmp_dir=tmp_dir
    )
    logger.info("started %s (pid %d), log %s", engine.name, proc.pid, log_path)
    if wait:
        engine.wait_ready(startup_timeout_s)
        logger.info("%s ready in %.1f s", engine.name, engine.startup_s)
    return engine


# ---------------------------------------------------------------- requests


@dataclass
class GenerateResult:
    """The client-visible outcome of one request sent to a prefill/decode pair."""

    rid: str
    room: int
    tenant: str | None
    prompt_len: int
    prefill_status: int | None  # HTTP status; None: no response (connection error)
    decode_status: int | None
    decode_json: dict[str, Any] | None = None  # decode's body when it is JSON
    error: str | None = None  # decode's error text (what the client sees)
    prefill_error: str | None = None
    latency_s: float = 0.0  # send -> decode's complete response
    ttft_s: float | None = None  # send -> first streamed chunk (stream=True only)
    prefill_latency_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)

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
            "prefill_status": self.prefill_status,
            "decode_status": self.decode_status,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "error": self.error,
            "prefill_error": self.prefill_error,
            "latency_s": round(self.latency_s, 3),
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 3),
        }


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


def _post_stream(url: str, payload: dict[str, Any], timeout_s: float, t0: float) -> _Reply:
    """SSE ``data: {...}`` chunks; SGLang reports errors in a chunk with HTTP 200."""
    ttft = None
    last: dict[str, Any] | None = None
    error = None
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
                if ttft is None:
                    ttft = time.monotonic() - t0
                if "error" in chunk:
                    err = chunk["error"]
                    error = str(err.get("message", err)) if isinstance(err, dict) else str(err)
                else:
                    last = chunk
            status = r.status_code
    except (httpx.HTTPError, ValueError) as exc:
        return _Reply(None, last, f"{type(exc).__name__}: {exc}", time.monotonic() - t0, ttft)
    return _Reply(status, last, error, time.monotonic() - t0, ttft)


# ---------------------------------------------------------------- prefill/decode pair


class PDPair:
    """A prefill engine and a decode engine of one SGLang version, Mooncake over TCP.

    Prefill starts first: its tokenizer manager hosts the bootstrap server that
    decode registers with. Both are stopped on exit, decode first.
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
    ) -> None:
        sglang_dir(version)  # fail early with the `make venv` hint
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
        self.bootstrap_port: int | None = None
        self.prefill: Engine | None = None
        self.decode: Engine | None = None
        self.startup_s: float | None = None

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
        """Start prefill; start decode once prefill's bootstrap server listens; wait for both.

        NOTE: overlapping the two start-ups saves ~15 s on 2 cores. Decode needs
        the bootstrap server only when the first request arrives (its warmup uses
        SGLang's fake bootstrap host), but it is up long before then anyway.
        """
        t0 = time.monotonic()
        self.model_dir = self.model_dir or default_model_dir(self.context_length)
        self.bootstrap_port = free_port()
        try:
            self.prefill = self._start("prefill", self.prefill_pool_tokens, self.prefill_args, wait=False)
            self._wait_bootstrap_server(t0)
            self.decode = self._start("decode", self.decode_pool_tokens, self.decode_args, wait=False)
            self.prefill.wait_ready(max(0.0, t0 + self.startup_timeout_s - time.monotonic()))
            self.decode.wait_ready(max(0.0, t0 + self.startup_timeout_s - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        logger.info(
            "SGLang %s prefill/decode pair ready in %.1f s (prefill %.1f s, decode %.1f s)",
            self.version, self.startup_s, self.prefill.startup_s, self.decode.startup_s,
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
        """Stop both engines (in parallel); idempotent."""
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
    ) -> GenerateResult:
        """Post one request to both engines concurrently, like SGLang's router.

        ``prompt``: text, or token ids (ints in 3..255 with the tiny model: exact
        lengths). ``stream`` streams decode's answer to measure TTFT. The default
        HTTP timeout outlasts decode's waiting timeout, so a request whose KV never
        arrives returns decode's own error rather than a client timeout.
        """
        if self.prefill is None or self.decode is None:
            raise RuntimeError("PDPair is not started")
        room = random.randrange(1, 2**63) if room is None else room
        rid = rid or f"kvg-{uuid.uuid4().hex[:16]}"
        timeout_s = timeout_s or self.waiting_timeout_s + 120.0
        body: dict[str, Any] = {
            "rid": rid,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **(sampling_params or {})},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": room,
            **tenant_payload(tenant),
        }
        if isinstance(prompt, str):
            body["text"] = prompt
            prompt_len = -1  # unknown without the tokenizer
        else:
            body["input_ids"] = [int(t) for t in prompt]
            prompt_len = len(body["input_ids"])
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            fp = pool.submit(_post, self.prefill.url + "/generate", body, timeout_s, t0)
            decode_post = _post_stream if stream else _post
            fd = pool.submit(decode_post, self.decode.url + "/generate", {**body, "stream": stream}, timeout_s, t0)
            p, d = fp.result(), fd.result()
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
            prefill_status=p.status,
            decode_status=d.status,
            decode_json=d.body,
            error=error,
            prefill_error=p.error,
            latency_s=d.latency_s,
            ttft_s=d.ttft_s,
            prefill_latency_s=p.latency_s,
            output_ids=list(body_d.get("output_ids") or []),
        )

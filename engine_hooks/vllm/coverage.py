"""What the vLLM engine holds and what of it kvguard watches (COVERAGE, contract 1.5).

Read once in the EngineCore, after ``Scheduler.__init__`` (hooks_core.py), from the
scheduler's ``kv_cache_config`` (its KV cache groups and their specs), the speculative and
KV transfer configs and the parallel layout; and once in the Worker, before its first step
(hooks_worker.py), from its block tables. The decisions are by spec class (the kinds of
group the hooks follow, :data:`GROUP_KINDS`), never by a model name. A group kvguard cannot
follow makes the EngineCore send no page records (its HELLO and COVERAGE say so).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import coverage as cv
from .. import wire

# KV cache spec classes by what their blocks hold, most specific first (a subclass is looked
# up through its MRO: SinkFullAttentionSpec is a FullAttentionSpec, SlidingWindowMLASpec a
# SlidingWindowSpec). Other specs (chunked local attention, R-SWA, circular buffers, the
# HiSparse and encoder specs, a group of mixed specs such as DSA's latent + indexer) are not
# followed: each frees or reads blocks by rules the hooks do not know.
GROUP_KINDS = {
    "MLAAttentionSpec": "full_attention",
    "SlidingWindowSpec": "sliding_window",
    "MambaSpec": "state",
    "FullAttentionSpec": "full_attention",
}
NOT_FOLLOWED = ("RSWASpec", "ChunkedLocalAttentionSpec", "CircularBufferSpec", "HiddenStateCacheSpec")


@dataclass(frozen=True)
class Group:
    """One KV cache group as the hooks model it: its pool index (= group id), block size,
    what its blocks hold and the window of a sliding-window group (0: none)."""

    index: int
    block_size: int
    kind: str  # full_attention, sliding_window, state; "" when not followed
    window: int
    spec: str  # the spec's class name
    layers: int
    detail: str


def group_kind(spec) -> str:
    """What a spec's blocks hold, or "" when the hooks do not follow its kind."""
    names = [c.__name__ for c in type(spec).__mro__]
    for name in names:
        if name in NOT_FOLLOWED:
            return ""
        if name in GROUP_KINDS:
            return GROUP_KINDS[name]
    return ""


def describe_group(index: int, group) -> Group:
    spec = group.kv_cache_spec
    kind = group_kind(spec)
    window = int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding_window" else 0
    layers = len(getattr(group, "layer_names", ()) or ())
    bits = [type(spec).__name__, f"block {int(spec.block_size)} tokens", f"{layers} layer(s)"]
    if window:
        bits.append(f"window {window}")
    if kind == "state":
        mamba = getattr(spec, "mamba_type", None)
        bits.append(f"{getattr(mamba, 'name', mamba) or 'mamba'} state, mode {getattr(spec, 'mamba_cache_mode', '?')}")
    dtype = getattr(spec, "dtype", None)
    if dtype is not None:
        bits.append(str(dtype).replace("torch.", ""))
    cache_dtype = getattr(spec, "cache_dtype_str", None)
    if cache_dtype and cache_dtype != "auto":
        bits.append(f"cache dtype {cache_dtype}")
    return Group(index, int(spec.block_size), kind, window, type(spec).__name__, layers, ", ".join(bits))


def engine_core_items(scheduler, version: str, groups: list[Group]) -> list[wire.CoverageItem]:
    """The EngineCore's components (its KV cache groups, draft, connector, parallel layout)."""
    cfg = scheduler.vllm_config
    items = []
    model = cfg.model_config
    arch = ",".join(getattr(getattr(model, "hf_config", None), "architectures", None) or []) or "?"
    cache_dtype = getattr(cfg.cache_config, "cache_dtype", "?")
    items.append(
        cv.item(
            "model",
            cv.OWNERSHIP,
            0,
            f"{arch}{' (MLA)' if getattr(model, 'use_mla', False) else ''}, kv cache dtype {cache_dtype}, "
            f"prefix caching {'on' if getattr(cfg.cache_config, 'enable_prefix_caching', False) else 'off'}, "
            f"vLLM {version}",
        )
    )
    multi = len(groups) > 1
    for g in groups:
        component = f"kv_group_{g.index}"
        shared = " (one block pool and the same memory as the other groups)" if multi else ""
        if g.kind:
            items.append(cv.item(component, cv.OWNERSHIP, 0, g.detail + shared))
        else:
            items.append(cv.unwatched(component, f"{g.detail}: blocks of a {g.spec} are not followed"))
    spec = getattr(cfg, "speculative_config", None)
    if spec is not None:
        method = getattr(spec, "method", None) or "?"
        k = getattr(spec, "num_speculative_tokens", "?")
        if method == "ngram" or method == "suffix":
            detail = f"{method}, {k} tokens: no draft KV; drafted tokens are written and read as the target's own"
        else:
            detail = (
                f"{method}, {k} tokens: the draft layers' KV lives in the target's KV cache groups and blocks "
                "(reserved with lookahead, rolled back by position, never freed); the drafter's own forward "
                "is not hooked, the target's forwards read the same rows"
            )
        items.append(cv.item("draft", cv.OWNERSHIP, 0, detail))
    kv = getattr(cfg, "kv_transfer_config", None)
    connector = getattr(kv, "kv_connector", None) if kv is not None else None
    if connector:
        if multi:
            items.append(
                cv.unwatched(
                    "connector",
                    f"{connector} with {len(groups)} KV cache groups: loads into groups other than 0 are not followed",
                )
            )
        elif "Nixl" in str(connector):
            items.append(cv.unwatched("connector", f"{connector}: its transfers are not hooked (no transfer id)"))
        else:
            items.append(cv.item("connector", cv.OWNERSHIP, 0, f"{connector} ({getattr(kv, 'kv_role', '?')})"))
    par = cfg.parallel_config
    tp = int(getattr(par, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(par, "pipeline_parallel_size", 1) or 1)
    dp = int(getattr(par, "data_parallel_size", 1) or 1)
    layout = f"tp {tp}, pp {pp}, dp {dp}"
    # a data-parallel server of a dense model runs each engine core as an independent engine:
    # vLLM resets its data_parallel_size to 1 and keeps the core's rank only as data_parallel_index
    # (a MoE model's cores keep the server's size and their data_parallel_rank)
    dp_index = int(getattr(par, "data_parallel_index", 0) or 0)
    if dp > 1:
        layout += f" (engine core {int(getattr(par, 'data_parallel_rank', dp_index) or 0)})"
    elif dp_index:
        layout += f" (engine core {dp_index} of a data-parallel server, run as an independent engine)"
    how = (
        "the EngineCore's block tables; tensor-parallel rank 0's worker reports the forwards (every rank holds "
        "the same tables); each data-parallel engine core is its own engine and timeline"
    )
    # (vLLM 0.32's CPU build fails at --pipeline-parallel-size 2 in vLLM itself: never run with kvguard)
    items.append(cv.parallel(layout, pp, how, "pipeline parallelism is not verified with kvguard"))
    return items

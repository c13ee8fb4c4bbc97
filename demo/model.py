"""A tiny GPT-2 checkpoint *without weights* for running real SGLang on CPU.

SGLang serves it with ``--load-format dummy``: weights are random, outputs are
meaningless token ids, but the KV-cache machinery (allocator, pools, chunked
prefill, prefill/decode transfer) is the real one. GPT-2 is used because its
learned positions need no CUDA rotary kernel.

The directory holds:
  config.json            GPT2LMHeadModel, vocab 256, n_embd 64, 2 layers, 4 heads
  tokenizer.json         one token per character, built with ``tokenizers`` (no downloads)
  tokenizer_config.json  loads as ``PreTrainedTokenizerFast``
  special_tokens_map.json

Token ids: 0 ``<unk>``, 1 ``<s>`` (bos), 2 ``</s>`` (eos), 3..255 one character each
(printable ASCII first, then Latin-1). Demo prompts use ``input_ids`` in 3..255 so
prompt lengths are exact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

VOCAB_SIZE = 256
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
# NOTE: bumped whenever the files change, so cached directories are rebuilt.
_FORMAT_VERSION = 1


def tiny_gpt2_config(n_positions: int = 2048) -> dict:
    """The config.json contents (what ``GPT2Config(...).save_pretrained`` writes)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": VOCAB_SIZE,
        "n_positions": n_positions,
        "n_ctx": n_positions,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "kvguard_tiny_model_version": _FORMAT_VERSION,
    }


def tiny_llama_config(n_positions: int = 2048) -> dict:
    """A tiny Llama for vLLM on CPU (its CPU attention wants head_dim 32 or more; GPT-2's 16
    is refused): 2 layers, hidden 64, 2 heads of 32, the same 256-token vocabulary."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": n_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "kvguard_tiny_model_version": _FORMAT_VERSION,
    }


_CONFIGS: dict[str, Callable[[int], dict]] = {"gpt2": tiny_gpt2_config, "llama": tiny_llama_config}


def _versioned(config: Callable[[int], dict]) -> Callable[[int], dict]:
    def versioned(n_positions: int) -> dict:
        return {**config(n_positions), "kvguard_tiny_model_version": _FORMAT_VERSION}

    return versioned


def _arch_configs() -> None:
    """The tiny configs of other real architectures (demo/arch_models.py), written the same way."""
    from .arch_models import ARCH_CONFIGS

    for name, config in ARCH_CONFIGS.items():
        _CONFIGS.setdefault(name, _versioned(config))


_arch_configs()


def _vocab() -> dict[str, int]:
    chars = [chr(c) for c in range(32, 127)]  # printable ASCII, incl. space
    chars += [chr(c) for c in range(161, 1000) if chr(c).isprintable()]
    chars = chars[: VOCAB_SIZE - len(SPECIAL_TOKENS)]
    tokens = list(SPECIAL_TOKENS) + chars
    assert len(tokens) == VOCAB_SIZE, len(tokens)
    return {tok: i for i, tok in enumerate(tokens)}


def _build_tokenizer_json(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models

    # A BPE model with no merges splits any text into its characters; every
    # character of the vocab is one token, anything else is <unk>.
    tok = Tokenizer(models.BPE(vocab=_vocab(), merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


def _write_files(d: Path, n_positions: int, arch: str = "gpt2") -> None:
    (d / "config.json").write_text(json.dumps(_CONFIGS[arch](n_positions), indent=2))
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID}, indent=2)
    )
    _build_tokenizer_json(d / "tokenizer.json")
    specials = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>"}
    (d / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": n_positions,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                **specials,
            },
            indent=2,
        )
    )


def _is_current(d: Path, n_positions: int, arch: str = "gpt2") -> bool:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return cfg == _CONFIGS[arch](n_positions) and (d / "tokenizer.json").is_file()


def write_tiny_gpt2(out_dir: str | os.PathLike, n_positions: int = 2048) -> Path:
    """Write the tiny GPT-2 model directory at ``out_dir`` and return its path (SGLang's)."""
    return write_tiny_model(out_dir, n_positions, "gpt2")


def write_tiny_llama(out_dir: str | os.PathLike, n_positions: int = 512) -> Path:
    """Write the tiny Llama model directory at ``out_dir`` and return its path (vLLM's)."""
    return write_tiny_model(out_dir, n_positions, "llama")


def write_tiny_model(out_dir: str | os.PathLike, n_positions: int = 2048, arch: str = "gpt2") -> Path:
    """Write a tiny model directory (``arch``: gpt2 or llama) at ``out_dir`` and return its path.

    Idempotent: an existing directory with the same config is reused as is.
    Written into a temporary sibling and renamed, so concurrent callers (pytest
    workers, a demo next to a test run) never see a half-written directory.
    """
    if n_positions < 8:
        raise ValueError(f"n_positions must be >= 8, got {n_positions}")
    out = Path(out_dir)
    if arch not in _CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, got {arch!r}")
    if _is_current(out, n_positions, arch):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_files(tmp, n_positions, arch)
        if out.exists():
            if _is_current(out, n_positions, arch):  # another writer won the race
                return out
            shutil.rmtree(out)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _is_current(out, n_positions, arch):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

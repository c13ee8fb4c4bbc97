"""A hand-built GPT-2 whose greedy output copies the prompt token ``lag`` positions back.

With dummy weights (:mod:`sidecar.demo.model`) every completion is token 0, so a KV
leak is visible only page by page. This "echo" model has *real*, hand-set weights
(no training): at every position ``p`` it attends to position ``p - (lag - 1)`` and
predicts that position's token, so the greedy continuation of a prompt ``x`` is
``x[P - lag], x[P - lag + 1], ...`` (``P = len(x)``). When decode attention reads
stale KV pages, the completion contains the tokens the *earlier* requests wrote at
the looked-up positions: the leak becomes visible in words (docs/echo-model.md).

Construction (1 layer, 1 head, ``n_embd`` 1024, vocab 256, MLP zero):

* token embedding: dims 0..255 = +onehot(token), dims 256..511 = -onehot(token);
* position embedding: dims 512..1023 = [cos wp, sin wp, -cos wp, -sin wp] for 128
  frequencies w drawn from (0, pi); the seed with the smallest worst sidelobe
  ``max_{d>0} mean_k cos(w_k d)`` is kept. The negated copies make every
  token + position sum zero-mean with a fixed norm (sqrt(258)), so each LayerNorm
  (gain 1, bias 0) only divides by a constant ``sigma`` (~0.502): the weights that
  follow are scaled by ``sigma``;
* query = the position code rotated back by ``lag - 1`` steps (exactly linear in
  cos/sin), key = the position code, scaled so that softmax sees
  ``beta * mean_k cos(w_k d)`` with ``beta`` 40: the right key wins by
  ``beta * (1 - sidelobe)`` (~32 nats);
* value = the token one-hot; the output projection writes 8 * [onehot, -onehot]
  into the token dims; the output layer is tied to the token embedding (SGLang's
  GPT-2 always uses ``wte`` as ``lm_head``), so the copied token's logit is 8x that
  of the current token and every other logit is 0.

Limits: prompts must be at least ``lag`` tokens (earlier positions have nothing to
copy); generating more than ``lag`` tokens cycles (the model copies its own
output); a copied ``</s>`` (id 2) stops generation like any EOS. GPT-2 bakes
absolute positions into the keys, so a stale page shows another request's tokens
only where the looked-up positions were filled by earlier requests.

The directory is generated (never committed): ``config.json`` (with a
``kvguard_echo`` entry describing the construction), ``model.safetensors``,
``generation_config.json`` and the one-character-per-token tokenizer of
:mod:`sidecar.demo.model`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvguard.demo import model as tiny_model

VOCAB_SIZE = tiny_model.VOCAB_SIZE  # 256
N_EMBD = 1024
N_FREQS = 128
MLP_INNER = 4  # the MLP is all zeros: keep it small (files and CPU time)
BETA = 40.0  # softmax sharpness: score = BETA * mean_k cos(w_k * offset)
OUT_GAIN = 8.0  # the copied token's logit vs the current token's
LN_EPS = 1e-5
DEFAULT_N_POSITIONS = 2048
DEFAULT_SEED_SEARCH = 64
MAX_N_POSITIONS = 32768  # wpe is n_positions x 1024 (128 MiB in float32 at this size)
DTYPES = ("bfloat16", "float32")
DEFAULT_DTYPE = "bfloat16"
WEIGHTS_FILE = "model.safetensors"
# NOTE: bumped whenever the construction or the files change, so cached directories are rebuilt.
_FORMAT_VERSION = 1

# Dimension layout of the residual stream.
_TOK_POS, _TOK_NEG = 0, VOCAB_SIZE  # +onehot, -onehot
_COS, _SIN = 2 * VOCAB_SIZE, 2 * VOCAB_SIZE + N_FREQS  # 512.., 640..
_NCOS, _NSIN = _SIN + N_FREQS, _SIN + 2 * N_FREQS  # 768.., 896..
assert _NSIN + N_FREQS == N_EMBD


@dataclass(frozen=True)
class EchoSpec:
    """What the ``kvguard_echo`` entry of config.json records."""

    lag: int
    n_positions: int
    dtype: str
    seed: int  # numpy default_rng seed of the frequencies
    seed_search: int  # seeds 0..seed_search-1 were tried
    worst_sidelobe: float  # max over offsets 1..n_positions-1 of mean_k cos(w_k d); the peak is 1
    beta: float = BETA
    margin_nats: float = 0.0  # beta * (1 - worst_sidelobe)
    format_version: int = _FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------- validation


def validate(
    lag: int, n_positions: int = DEFAULT_N_POSITIONS, dtype: str = DEFAULT_DTYPE, seed_search: int = DEFAULT_SEED_SEARCH
) -> None:
    """ValueError naming the flag and the value for any unusable input."""
    if not isinstance(n_positions, int) or not 2 <= n_positions <= MAX_N_POSITIONS:
        raise ValueError(f"--n-positions must be an integer in 2..{MAX_N_POSITIONS}, got {n_positions!r}")
    if not isinstance(lag, int) or not 1 <= lag < n_positions:
        raise ValueError(f"--lag must be an integer >= 1 and < --n-positions ({n_positions}), got {lag!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not isinstance(seed_search, int) or seed_search < 1:
        raise ValueError(f"--seed-search must be an integer >= 1, got {seed_search!r}")


# ---------------------------------------------------------------- the construction


def frequencies(seed: int) -> np.ndarray:
    """The 128 position-code frequencies of ``seed``, uniform in (0, pi)."""
    return np.random.default_rng(seed).uniform(0.0, math.pi, N_FREQS)


def worst_sidelobe(freqs: np.ndarray, n_positions: int) -> float:
    """``max_{d=1..n_positions-1} mean_k cos(w_k d)``: the best score a wrong key gets
    (relative to the right key's 1). Only the positive side competes in the softmax."""
    offsets = np.arange(1, n_positions, dtype=np.float64)
    worst = -1.0
    for start in range(0, len(offsets), 4096):  # bounded memory for long contexts
        block = np.cos(np.outer(offsets[start : start + 4096], freqs)).mean(axis=1)
        worst = max(worst, float(block.max()))
    return worst


def choose_seed(n_positions: int, seed_search: int = DEFAULT_SEED_SEARCH) -> tuple[int, float]:
    """The seed in ``0..seed_search-1`` with the smallest worst sidelobe, and that sidelobe."""
    best = (0, math.inf)
    for seed in range(seed_search):
        s = worst_sidelobe(frequencies(seed), n_positions)
        if s < best[1]:
            best = (seed, s)
    return best


def layer_norm_sigma(n_embd: int = N_EMBD, eps: float = LN_EPS) -> float:
    """What LayerNorm divides every token + position embedding by: each is zero-mean
    with squared norm 2 (token +-onehot) + 2 * 128 (cos^2 + sin^2, twice)."""
    return math.sqrt((2.0 + 2.0 * N_FREQS) / n_embd + eps)


def echo_state_dict(lag: int, n_positions: int, freqs: np.ndarray, dtype: str = DEFAULT_DTYPE) -> dict:
    """The GPT-2 tensors (Hugging Face names, Conv1D layout ``[in, out]``), ``lm_head`` tied."""
    import torch

    sigma = layer_norm_sigma()
    shift = lag - 1  # query at p looks for the key at p - (lag - 1), whose token is the next output
    w = torch.tensor(freqs, dtype=torch.float64)
    k = torch.arange(N_FREQS)
    f64 = dict(dtype=torch.float64)

    wte = torch.zeros(VOCAB_SIZE, N_EMBD, **f64)
    tok = torch.arange(VOCAB_SIZE)
    wte[tok, _TOK_POS + tok] = 1.0
    wte[tok, _TOK_NEG + tok] = -1.0

    angle = torch.outer(torch.arange(n_positions, **f64), w)
    wpe = torch.zeros(n_positions, N_EMBD, **f64)
    wpe[:, _COS:_SIN] = torch.cos(angle)
    wpe[:, _SIN:_NCOS] = torch.sin(angle)
    wpe[:, _NCOS:_NSIN] = -torch.cos(angle)
    wpe[:, _NSIN:] = -torch.sin(angle)

    # SGLang and transformers divide q.k by sqrt(head_dim) = 32; q.k = qs * ks * sum_k cos(w_k d).
    # Want q.k / 32 = BETA * mean_k cos(w_k d)  =>  qs * ks = 32 * BETA / 128.
    qk = math.sqrt(math.sqrt(N_EMBD) * BETA / N_FREQS)
    c_attn = torch.zeros(N_EMBD, 3 * N_EMBD, **f64)
    q, kk, v = 0, N_EMBD, 2 * N_EMBD
    cs, sn = torch.cos(w * shift), torch.sin(w * shift)
    # cos(w(p-s)) = cos wp cos ws + sin wp sin ws;  sin(w(p-s)) = sin wp cos ws - cos wp sin ws.
    # The LayerNorm output is embedding / sigma: multiply by sigma to read cos wp, sin wp.
    c_attn[_COS + k, q + k] = qk * sigma * cs
    c_attn[_SIN + k, q + k] = qk * sigma * sn
    c_attn[_SIN + k, q + N_FREQS + k] = qk * sigma * cs
    c_attn[_COS + k, q + N_FREQS + k] = -qk * sigma * sn
    c_attn[_COS + k, kk + k] = qk * sigma
    c_attn[_SIN + k, kk + N_FREQS + k] = qk * sigma
    c_attn[_TOK_POS + tok, v + tok] = sigma  # value = onehot(token)

    c_proj = torch.zeros(N_EMBD, N_EMBD, **f64)
    c_proj[tok, _TOK_POS + tok] = OUT_GAIN
    c_proj[tok, _TOK_NEG + tok] = -OUT_GAIN

    ones, zeros = torch.ones(N_EMBD, **f64), torch.zeros(N_EMBD, **f64)
    sd = {
        "transformer.wte.weight": wte,
        "transformer.wpe.weight": wpe,
        "transformer.h.0.ln_1.weight": ones,
        "transformer.h.0.ln_1.bias": zeros,
        "transformer.h.0.attn.c_attn.weight": c_attn,
        "transformer.h.0.attn.c_attn.bias": torch.zeros(3 * N_EMBD, **f64),
        "transformer.h.0.attn.c_proj.weight": c_proj,
        "transformer.h.0.attn.c_proj.bias": zeros,
        "transformer.h.0.ln_2.weight": ones,
        "transformer.h.0.ln_2.bias": zeros,
        "transformer.h.0.mlp.c_fc.weight": torch.zeros(N_EMBD, MLP_INNER, **f64),
        "transformer.h.0.mlp.c_fc.bias": torch.zeros(MLP_INNER, **f64),
        "transformer.h.0.mlp.c_proj.weight": torch.zeros(MLP_INNER, N_EMBD, **f64),
        "transformer.h.0.mlp.c_proj.bias": zeros,
        "transformer.ln_f.weight": ones,
        "transformer.ln_f.bias": zeros,
    }
    target = getattr(torch, dtype)
    return {name: t.to(target).contiguous() for name, t in sd.items()}


def echo_config(spec: EchoSpec) -> dict[str, Any]:
    """config.json: the tiny model's GPT-2 config, reshaped for the echo construction."""
    cfg = tiny_model.tiny_gpt2_config(spec.n_positions)
    cfg.pop("kvguard_tiny_model_version", None)
    cfg.update(
        n_embd=N_EMBD,
        n_layer=1,
        n_head=1,
        n_inner=MLP_INNER,
        layer_norm_epsilon=LN_EPS,
        torch_dtype=spec.dtype,
        kvguard_echo=spec.to_dict(),
    )
    return cfg


# ---------------------------------------------------------------- writing


def read_spec(model_dir: str | os.PathLike) -> EchoSpec | None:
    """The ``kvguard_echo`` entry of ``model_dir``/config.json, or None."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return EchoSpec(**cfg["kvguard_echo"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_current(d: Path, lag: int, n_positions: int, dtype: str, seed_search: int) -> bool:
    spec = read_spec(d)
    return (
        spec is not None
        and (spec.lag, spec.n_positions, spec.dtype, spec.seed_search, spec.format_version)
        == (lag, n_positions, dtype, seed_search, _FORMAT_VERSION)
        and (d / WEIGHTS_FILE).is_file()
        and (d / "tokenizer.json").is_file()
    )


def check_writable(out_dir: str | os.PathLike) -> Path:
    """Create ``out_dir`` if needed and prove it takes a file; ValueError naming it otherwise."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvguard-write-test-", dir=out)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"OUT_DIR {str(out_dir)!r} is not a writable directory: {exc.strerror or exc}") from exc
    return out


def write_echo_gpt2(
    out_dir: str | os.PathLike,
    lag: int,
    *,
    n_positions: int = DEFAULT_N_POSITIONS,
    dtype: str = DEFAULT_DTYPE,
    seed_search: int = DEFAULT_SEED_SEARCH,
    reuse: bool = True,
) -> EchoSpec:
    """Write the echo GPT-2 into ``out_dir`` (created if needed) and return its spec.

    Files are written into a temporary folder inside ``out_dir`` and moved into place
    one by one, ``config.json`` last (readers that find a current config find the
    weights too). Other files in ``out_dir`` are left alone. With ``reuse`` an
    ``out_dir`` already holding the same model is returned as is.
    ValueError (naming the flag) for bad inputs or an unwritable ``out_dir``.
    """
    validate(lag, n_positions, dtype, seed_search)
    out = Path(out_dir)
    if reuse and _is_current(out, lag, n_positions, dtype, seed_search):
        spec = read_spec(out)
        assert spec is not None
        return spec
    check_writable(out)
    from safetensors.torch import save_file

    seed, sidelobe = choose_seed(n_positions, seed_search)
    spec = EchoSpec(
        lag=lag, n_positions=n_positions, dtype=dtype, seed=seed, seed_search=seed_search,
        worst_sidelobe=round(sidelobe, 6), margin_nats=round(BETA * (1.0 - sidelobe), 3),
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix=".echo-", dir=out))
    try:
        tiny_model._write_files(tmp, n_positions)  # tokenizer + generation config (+ a config replaced below)
        save_file(
            echo_state_dict(lag, n_positions, frequencies(seed), dtype),
            str(tmp / WEIGHTS_FILE),
            metadata={"format": "pt"},
        )
        (tmp / "config.json").write_text(json.dumps(echo_config(spec), indent=2))
        names = sorted(p.name for p in tmp.iterdir() if p.name != "config.json") + ["config.json"]
        for name in names:
            os.chmod(tmp / name, 0o644)  # mkstemp-style 0600 files would lock out other users of a shared cache
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return spec


def echo_model_dir(lag: int, n_positions: int = DEFAULT_N_POSITIONS, dtype: str = DEFAULT_DTYPE) -> Path:
    """The echo model for ``lag``, cached under ``<repo>/.kvguard-cache/models``."""
    root = Path(__file__).resolve().parents[1]
    d = root / ".kvguard-cache" / "models" / f"echo-gpt2-lag{lag}-{n_positions}-{dtype}"
    write_echo_gpt2(d, lag, n_positions=n_positions, dtype=dtype)
    return d


# ---------------------------------------------------------------- text <-> token ids


def encode_text(text: str) -> list[int]:
    """Token ids of ``text`` (one per character; printable ASCII is ids 3..97).
    ValueError for a character outside the vocabulary."""
    vocab = tiny_model._vocab()
    try:
        return [vocab[c] for c in text]
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None


def decode_text(ids: Sequence[int], special: str = "\u00b7") -> str:
    """``ids`` as text; the special ids 0..2 (and unknown ids) print as ``special``."""
    inv = {i: t for t, i in tiny_model._vocab().items()}
    return "".join(inv[i] if 2 < i < VOCAB_SIZE else special for i in map(int, ids))


# ---------------------------------------------------------------- what to expect


def expected_echo(prompt: Sequence[int], lag: int, max_new_tokens: int) -> list[int]:
    """The echo model's greedy completion of ``prompt`` (``len(prompt) >= lag``):
    token ``i`` is ``seq[len(prompt) + i - lag]`` of the growing sequence, so it cycles
    after ``lag`` tokens."""
    if len(prompt) < lag:
        raise ValueError(f"the prompt must have at least lag={lag} tokens, got {len(prompt)}")
    seq = [int(t) for t in prompt]
    for _ in range(max_new_tokens):
        seq.append(seq[len(seq) - lag])
    return seq[len(prompt) :]


@dataclass
class EchoedToken:
    """One generated token of a request that may have read stale KV, and where it came from."""

    index: int  # in the completion
    token: int
    position: int  # the position the query looked up: prompt_len + index - lag
    own: int | None  # the request's own token there (prompt or earlier output); None: no such position
    sources: list[str]  # labels of earlier sequences holding ``token`` at ``position``

    @property
    def leaked(self) -> bool:
        """Not the request's own token, but one an earlier request had at that position."""
        return self.token != self.own and bool(self.sources)


def attribute_echo(
    output_ids: Sequence[int],
    prompt: Sequence[int],
    lag: int,
    earlier: Sequence[tuple[str, Sequence[int]]],
) -> list[EchoedToken]:
    """For each generated token: the position the echo model looked up, the request's own
    token there, and which ``earlier`` sequences (label, prompt + completion tokens) had
    exactly that token at that position. Ambiguous when two earlier sequences agree."""
    seq = [int(t) for t in prompt] + [int(t) for t in output_ids]
    out = []
    for i, token in enumerate(output_ids):
        pos = len(prompt) + i - lag
        own = seq[pos] if 0 <= pos < len(seq) else None
        sources = [label for label, s in earlier if 0 <= pos < len(s) and int(s[pos]) == int(token)]
        out.append(EchoedToken(i, int(token), pos, own, sources))
    return out

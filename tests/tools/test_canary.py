"""``kvguard canary`` against a fake engine served over real HTTP (no SGLang here).

The fake keeps what a real engine would: a KV "pool" of 256 tokens (one character
is one token), a context of 2048, and the last victim prompt it saw. In ``leaky``
mode it answers prompts longer than the pool, as SGLang 0.5.19's prefill/decode
pair did, with text from that stale prompt (the echo model's behaviour); in
``healthy`` mode it rejects them. Every request it receives is counted, so the
budget tests compare with what actually arrived.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvguard.sidecar.canary.markers import MarkerSet, filler_text, find_leak, normalize
from kvguard.sidecar.canary.plan import Sizing, build_plan
from kvguard.sidecar.cli import main

POOL, CTX, MAX_INPUT = 256, 2048, 250


class FakeEngine:
    """State and behaviour of one fake server; ``mode`` picks the behaviour."""

    def __init__(
        self,
        mode: str = "healthy",
        role: str = "null",
        native: bool = True,
        bootstrap_port: int = 9001,
        status: int = 200,
        delay_s: float = 0.0,
        spaced: bool = False,
        victim_ttft_s: float = 0.0,
        wordy: bool = False,
        ttft_per_token_s: float = 0.0,
        served_port: int | None = None,
    ):
        self.mode, self.role, self.native, self.bootstrap_port = mode, role, native, bootstrap_port
        self.status, self.delay_s, self.spaced, self.victim_ttft_s = status, delay_s, spaced, victim_ttft_s
        self.ttft_per_token_s = ttft_per_token_s  # a plausible engine: prefill time grows with the prompt
        self.served_port = served_port  # server_info "port": another port means a router answered for a worker
        self.wordy = wordy  # a tokenizer that takes up to 4 lowercase letters per token (others: 1 per character)
        self.requests: list[tuple[str, str, dict, dict]] = []  # (method, path, body, headers)
        self.stale = ""  # the last victim prompt: what a reused page would hold
        self.lock = threading.Lock()

    def server_info(self) -> dict:
        port = {} if self.served_port is None else {"port": self.served_port}
        return {
            **port,
            "version": "0.5.19",
            "max_total_num_tokens": POOL,
            "context_length": CTX,
            "page_size": 4,
            "max_req_input_len": MAX_INPUT,
            "chunked_prefill_size": 2048,
            "disaggregation_mode": self.role,
            "disaggregation_bootstrap_port": self.bootstrap_port,
        }

    def tokens(self, prompt: str) -> int:
        return len(re.findall(r"[a-z]{1,4}|.", prompt, re.S)) if self.wordy else len(prompt)

    def answer(self, prompt: str, max_new: int, tenant: str) -> tuple[int, str, str | None]:
        """(status, output text, error) for one prompt."""
        n = self.tokens(prompt)
        if "a0" in prompt[:12] or tenant.endswith("-a"):  # a victim request
            with self.lock:
                self.stale = prompt
        if n > CTX and self.mode != "accepts_over_context":
            return 400, "", f"The input ({n} tokens) is longer than the model's context length ({CTX} tokens)."
        if POOL < n <= CTX:
            if self.mode in ("healthy", "accepts_over_context"):
                return 400, "", f"Input length ({n} tokens) exceeds the maximum allowed length ({MAX_INPUT} tokens)."
            if self.mode == "leaky":
                text = self.stale[60 : 60 + max_new]
                if self.spaced:  # a tokenizer that splits and spaces the marker
                    text = " ".join(text[i : i + 3] for i in range(0, len(text), 3))
                return 200, text, None
        return 200, prompt[-max_new:].lower(), None  # an honest answer from the request's own prompt


def _handler(engine: FakeEngine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *a):  # quiet
            pass

        def _json(self, status: int, body) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            engine.requests.append(("GET", self.path, {}, dict(self.headers)))
            if self.path in ("/server_info", "/get_server_info") and engine.native:
                if engine.mode == "old_sglang" and self.path == "/server_info":
                    return self._json(404, {"detail": "Not Found"})
                return self._json(200, engine.server_info())
            if self.path == "/v1/models":
                card = {"id": "fake/echo-model" if engine.native else "fake-llm", "object": "model"}
                if engine.native:
                    card["max_model_len"] = CTX
                return self._json(200, {"object": "list", "data": [card]})
            self._json(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            engine.requests.append(("POST", self.path, body, dict(self.headers)))
            if engine.delay_s:
                time.sleep(engine.delay_s)
            if engine.status != 200:
                return self._json(engine.status, {"error": {"message": "internal server error (fake)"}})
            if self.path == "/generate":
                if engine.role == "prefill":  # prefill answers once, the client reads decode's stream
                    return self._json(200, {"text": "", "meta_info": {}})
                prompt, max_new = body["text"], body["sampling_params"]["max_new_tokens"]
                tenant = body.get("routing_key", "")
            elif self.path == "/v1/completions":
                prompt, max_new, tenant = body["prompt"], body["max_tokens"], self.headers.get("x-smg-routing-key", "")
            else:
                return self._json(404, {"detail": "Not Found"})
            status, text, error = engine.answer(prompt, max_new, tenant)
            if status != 200:
                return self._json(status, {"error": {"message": error}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            if tenant.endswith("-a") and engine.victim_ttft_s:
                time.sleep(engine.victim_ttft_s)
            time.sleep(engine.ttft_per_token_s * engine.tokens(prompt))
            try:
                self._stream(prompt, text)
            except (BrokenPipeError, ConnectionResetError):  # the canary cancelled the stream
                pass

        def _stream(self, prompt: str, text: str):
            for i in range(1, len(text) + 1):
                last = i == len(text)
                if self.path == "/generate":
                    meta = {
                        "prompt_tokens": engine.tokens(prompt),
                        "completion_tokens": i,
                        "cached_tokens": 0,
                        "finish_reason": {"type": "length"} if last else None,
                    }
                    chunk = {"text": text[:i], "meta_info": meta}
                else:
                    choice = {"index": 0, "text": text[i - 1], "finish_reason": "length" if last else None}
                    chunk = {"choices": [choice]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            if self.path == "/v1/completions":
                usage = {
                    "choices": [],
                    "usage": {"prompt_tokens": engine.tokens(prompt), "completion_tokens": len(text)},
                }
                self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return Handler


@pytest.fixture
def serve():
    servers = []

    def start(engine: FakeEngine) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(engine))
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def run_cli(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["canary", *argv, "--json", "--seed", "7"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


# ---------------------------------------------------------------- verdicts


def test_leak_through_the_over_pool_path_exits_3_and_names_the_marker(serve, capsys):
    engine = FakeEngine("leaky")
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 3 and rep["verdict"] == "leak" and rep["exit_code"] == 3
    leaks = [f for f in rep["findings"] if f["kind"] == "marker_leak"]
    assert leaks, rep["findings"]
    leaked = [r for r in rep["requests"] if r["leak"]]
    assert (
        leaked
        and {r["phase"] for r in leaked} == {"over_pool"}
        and {r["tenant"] for r in leaked} == {"kvguard-canary-b"}
    )
    victims = [e for e in engine.requests if e[0] == "POST" and e[2]["routing_key"] == "kvguard-canary-a"]
    for r in leaked:
        frag = r["leak"]["fragment"]
        assert len(frag) >= 10 and any(frag in normalize(v[2]["text"]) for v in victims)
        assert r["leak"]["blocks"] and all(
            b.startswith(("#" + rep["marker_run"], "[" + rep["marker_run"])) for b in r["leak"]["blocks"]
        )
        assert r["leak"]["blocks"][0] in leaks[0]["message"] or r["leak"]["blocks"][0] in " ".join(
            f["message"] for f in leaks
        )
    # the over-length prompts were also answered 200: a finding of its own
    assert any(f["kind"] == "should_have_been_error" for f in rep["findings"])
    assert rep["requests_sent"] == len(engine.requests) <= rep["budget"] == 64


def test_healthy_engine_is_clean_and_rejections_are_what_it_expects(serve, capsys):
    engine = FakeEngine("healthy")
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 0 and rep["verdict"] == "clean" and rep["findings"] == [] and rep["reason"] is None
    by_phase = {}
    for r in rep["requests"]:
        by_phase.setdefault(r["phase"], []).append(r)
    assert {"victim", "over_pool", "over_context", "near_pool", "shared_prefix", "abort", "concurrent"} <= set(by_phase)
    assert all(r["status"] == 400 and not r["ok"] for r in by_phase["over_pool"] + by_phase["over_context"])
    assert all(r["ok"] for r in by_phase["victim"] + by_phase["near_pool"] + by_phase["concurrent"])
    assert by_phase["abort"][0]["aborted_by_client"] and by_phase["abort"][0]["completion_tokens"] == 1
    # the plan used what the server reported
    assert rep["limits"] == {
        "pool_tokens": POOL,
        "decode_pool_tokens": POOL,
        "context_len": CTX,
        "max_req_input_len": MAX_INPUT,
    }
    assert max(r["prompt_tokens"] or 0 for r in by_phase["victim"]) <= MAX_INPUT
    assert all(POOL < r["prompt_tokens_planned"] <= CTX for r in by_phase["over_pool"])
    assert by_phase["over_context"][0]["prompt_tokens_planned"] > CTX
    # tenants are labelled the way kvguard's SGLang adapter reads them
    tenants = {e[2].get("routing_key") for e in engine.requests if e[0] == "POST"}
    assert tenants == {"kvguard-canary-a", "kvguard-canary-b"}
    assert "echo" in rep["model_note"] and rep["model"] == "fake/echo-model"


def test_text_report_names_model_findings_and_exit(serve, capsys):
    rc = main(["canary", "--url", serve(FakeEngine("leaky")), "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 3
    assert "FINDING [marker_leak]" in out and "verdict: LEAK SEEN; exit 3" in out
    assert "model: fake/echo-model" in out and "requests sent:" in out and "over_pool" in out


def test_prompt_sizes_follow_each_tenants_measured_tokenization(serve, capsys):
    engine = FakeEngine("healthy", wordy=True)  # B's words take ~2 characters a token, A's markers 1
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 0, rep
    assert rep["chars_per_token"]["kvguard-canary-a"] == 1.0 and rep["chars_per_token"]["kvguard-canary-b"] > 1.5
    sent = {e[2]["rid"]: engine.tokens(e[2]["text"]) for e in engine.requests if e[0] == "POST"}
    over = [sent[r["rid"]] for r in rep["requests"] if r["phase"] == "over_pool"]
    assert over and all(POOL < n <= CTX for n in over), over  # sized in B's tokens, not A's
    (ctx,) = [sent[r["rid"]] for r in rep["requests"] if r["phase"] == "over_context"]
    assert ctx > CTX


def test_tokenized_marker_is_still_found(serve, capsys):
    rc, rep = run_cli(capsys, "--url", serve(FakeEngine("leaky", spaced=True)))
    assert rc == 3 and any(r["leak"] for r in rep["requests"])


def test_status_that_should_have_been_an_error_is_a_finding(serve, capsys):
    engine = FakeEngine("accepts_over_context")  # over-pool rejected, over-context served with its own text
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 3 and rep["verdict"] == "should_have_been_error"
    (f,) = rep["findings"]
    assert f["kind"] == "should_have_been_error" and rep["requests"][f["request"]]["phase"] == "over_context"
    assert "longer than the context length" in f["message"]


def test_ttft_too_short_for_the_prompt_is_a_warning_not_a_leak(serve, capsys):
    # victims take 0.3 s to their first token; the prober's longer prompts answer at once
    engine = FakeEngine("healthy", victim_ttft_s=0.3)
    rc, rep = run_cli(capsys, "--url", serve(engine), "--budget", "16")
    assert rc == 0 and rep["findings"] == []
    assert any("time to first token" in w for w in rep["warnings"]), rep["warnings"]


def test_no_ttft_warning_when_timing_is_plausible(serve, capsys):
    # first tokens after 1 ms per prompt token for everyone: noise would need to be ~1 s to warn
    rc, rep = run_cli(capsys, "--url", serve(FakeEngine("healthy", ttft_per_token_s=0.001)), "--budget", "16")
    assert rc == 0 and rep["warnings"] == []


# ---------------------------------------------------------------- API flavours, discovery


def test_openai_endpoint_leak_and_clean(serve, capsys):
    leaky = FakeEngine("leaky", native=False)
    rc, rep = run_cli(capsys, "--url", serve(leaky), "--context-length", str(CTX), "--pool-tokens", str(POOL))
    assert rc == 3 and rep["api"] == "openai" and rep["model"] == "fake-llm"
    posts = [e for e in leaky.requests if e[0] == "POST"]
    assert {e[1] for e in posts} == {"/v1/completions"} and all(e[2]["model"] == "fake-llm" for e in posts)
    assert {e[3].get("x-smg-routing-key") for e in posts} == {"kvguard-canary-a", "kvguard-canary-b"}
    # it says what it could not read, and that it used the flags
    assert any("/server_info" in u for u in rep["unread"]) and rep["limits"]["context_len"] == CTX
    assert "weak evidence" in rep["model_note"]

    rc, rep = run_cli(
        capsys,
        "--url",
        serve(FakeEngine("healthy", native=False)),
        "--context-length",
        str(CTX),
        "--pool-tokens",
        str(POOL),
    )
    assert rc == 0 and rep["verdict"] == "clean"


def test_openai_endpoint_without_limits_cannot_run(serve, capsys):
    engine = FakeEngine("healthy", native=False)
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 1 and "--context-length" in rep["reason"]
    assert [e for e in engine.requests if e[0] == "POST"] == []


def test_native_flag_and_old_server_info_path(serve, capsys):
    engine = FakeEngine("old_sglang")  # only /get_server_info; over-pool prompts are served honestly
    rc, rep = run_cli(capsys, "--url", serve(engine), "--api", "native")
    assert rep["api"] == "native" and rep["limits"]["pool_tokens"] == POOL
    assert any(e[1] == "/get_server_info" for e in engine.requests)


def test_prefill_decode_pair_is_driven_like_the_router(serve, capsys):
    decode = FakeEngine("leaky", role="decode")
    prefill = FakeEngine("leaky", role="prefill", bootstrap_port=8123)
    d_url, p_url = serve(decode), serve(prefill)
    rc, rep = run_cli(capsys, "--url", d_url, "--prefill-url", p_url)
    assert rc == 3 and rep["api"].startswith("native (prefill/decode")
    d_posts = [e[2] for e in decode.requests if e[0] == "POST"]
    p_posts = [e[2] for e in prefill.requests if e[0] == "POST"]
    assert len(d_posts) == len(p_posts) > 0
    assert sorted(b["bootstrap_room"] for b in d_posts) == sorted(b["bootstrap_room"] for b in p_posts)
    assert len({b["bootstrap_room"] for b in d_posts}) == len(d_posts)  # one room per request
    assert {b["bootstrap_port"] for b in d_posts} == {8123} and {b["bootstrap_host"] for b in d_posts} == {"127.0.0.1"}
    assert rep["requests_sent"] == len(decode.requests) + len(prefill.requests) <= 64


def test_a_router_is_recognised_by_the_decode_info_it_relays(serve, capsys):
    # SGLang's PD router answers /get_server_info with its first decode server's, port included
    router = FakeEngine("leaky", role="decode", served_port=1)
    url = serve(router)
    rc, rep = run_cli(capsys, "--url", url)
    assert "router" in rep["api"] and any("decode server on port 1" in n for n in rep["notes"])
    assert any("prefill pool" in u for u in rep["unread"])  # it says what it cannot know through a router
    # with the prefill server's pool read from --prefill-url, requests still go through the router only
    prefill = FakeEngine(role="prefill", bootstrap_port=8123)
    rc, rep = run_cli(capsys, "--url", url, "--prefill-url", serve(prefill))
    assert rc == 3 and rep["verdict"] == "leak" and rep["limits"]["pool_tokens"] == POOL
    assert [e for e in prefill.requests if e[0] == "POST"] == []
    assert all("bootstrap_room" not in e[2] for e in router.requests if e[0] == "POST")


def test_a_pair_member_alone_is_refused_with_the_way_out(serve, capsys):
    engine = FakeEngine(role="decode")
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 1 and "router" in rep["reason"] and "--prefill-url" in rep["reason"]
    assert [e for e in engine.requests if e[0] == "POST"] == []


# ---------------------------------------------------------------- budget


@pytest.mark.parametrize("budget", [3, 6, 9, 14, 20, 33, 64, 200])
@pytest.mark.parametrize("mode", ["leaky", "healthy"])
def test_the_budget_is_never_exceeded(serve, capsys, budget, mode):
    engine = FakeEngine(mode)
    rc, rep = run_cli(capsys, "--url", serve(engine), "--budget", str(budget))
    assert len(engine.requests) <= budget and rep["requests_sent"] == len(engine.requests)
    if budget < 6:  # discovery (2 GETs) + 2 victims + 1 probe
        assert rc == 1 and "budget" in rep["reason"]
    else:
        assert rc == (3 if mode == "leaky" else 0), rep
        assert any("not enough budget" in s for s in rep["skipped"]) == (budget < 30)


def test_budget_counts_both_servers_of_a_pair(serve, capsys):
    decode, prefill = FakeEngine("healthy", role="decode"), FakeEngine("healthy", role="prefill")
    rc, rep = run_cli(capsys, "--url", serve(decode), "--prefill-url", serve(prefill), "--budget", "17")
    assert rc == 0 and len(decode.requests) + len(prefill.requests) == rep["requests_sent"] <= 17


# ---------------------------------------------------------------- could not run


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_refused_connection_exits_1_with_the_reason(capsys):
    rc, rep = run_cli(capsys, "--url", f"http://127.0.0.1:{_closed_port()}")
    assert rc == 1 and rep["verdict"] == "could_not_run" and "cannot connect" in rep["reason"]


def test_server_errors_exit_1_with_the_reason(serve, capsys):
    engine = FakeEngine(status=500)
    rc, rep = run_cli(capsys, "--url", serve(engine))
    assert rc == 1 and "first victim request failed" in rep["reason"] and "HTTP 500" in rep["reason"]
    assert len([e for e in engine.requests if e[0] == "POST"]) == 1  # it stops instead of hammering


def test_timeouts_exit_1_with_the_reason(serve, capsys):
    engine = FakeEngine(delay_s=2.0)
    rc, rep = run_cli(capsys, "--url", serve(engine), "--timeout", "0.3")
    assert rc == 1 and "Timeout" in rep["reason"]


def test_time_limit_stops_sending(serve, capsys):
    engine = FakeEngine("healthy", delay_s=0.2)
    rc, rep = run_cli(capsys, "--url", serve(engine), "--time-limit", "1")
    posts = [e for e in engine.requests if e[0] == "POST"]
    assert any("--time-limit" in s for s in rep["skipped"]) and len(posts) < 20


def test_bad_url_and_usage_errors_exit_1(capsys):
    rc, rep = run_cli(capsys, "--url", "localhost:30000")
    assert rc == 1 and "no scheme" in rep["reason"]
    with pytest.raises(SystemExit) as exc:
        main(["canary", "--url", "http://x", "--budget", "0"])
    assert exc.value.code == 1


# ---------------------------------------------------------------- markers and plan


def test_marker_search_whole_partial_tokenized_and_own_text():
    import random

    m = MarkerSet.new(random.Random(1))
    victims = [m.victim_text(i, 230) for i in range(3)]
    assert victims[0][20:] == victims[2][20:]  # same body at the same positions: ties do not scramble
    whole = victims[1][100:140]
    leak = find_leak("noise " + whole + " noise", "the fox", victims, m)
    assert leak and leak.fragment == normalize(whole) and leak.victims == [0, 1, 2] and leak.blocks
    spaced = " ".join(whole[i : i + 2] for i in range(0, len(whole), 2))  # split across tokens
    assert find_leak(spaced, "", victims, m).fragment == normalize(whole)
    assert find_leak(victims[1][100:109], "", victims, m) is None  # 9 characters: below the threshold
    assert find_leak(victims[1][100:109], "", victims, m, min_overlap=5) is not None
    header = victims[1][:12]  # the per-request header names one victim
    named = find_leak(header, "", victims, m, min_overlap=6)
    assert named.victims == [1] and named.blocks == [header.strip()]
    # B's own prompt text is never blamed on A, and B's filler never matches A
    assert find_leak(whole, whole, victims, m) is None
    import random as r2

    assert find_leak(filler_text(400, r2.Random(2)), "", victims, m) is None


def test_plan_follows_the_limits():
    pd = build_plan(Sizing(pool_in=256, pool_decode=1024, context_len=2048, max_input=250), 58, 2)
    over = [p.prompt_tokens for p in pd.probes if p.phase == "over_pool"]
    assert over and all(256 < n <= 1024 * 0.95 for n in over)
    # a pool that holds the context has no over-pool path
    big = build_plan(Sizing(pool_in=500_000, pool_decode=500_000, context_len=8192, max_input=None), 60, 1)
    assert not [p for p in big.probes if p.phase == "over_pool"] and any("over_pool" in s for s in big.skipped)
    assert max(p.prompt_tokens for p in big.probes if p.tenant == "A") <= 2048
    with pytest.raises(ValueError, match="no KV pool size or context length"):
        build_plan(Sizing(None, None, None, None), 60, 1)

"""The demo harness: tiny model files, engine and router command lines, routed requests against a
fake router, the demo report, and one real engine."""

from __future__ import annotations

import json
import time

import pytest

from kvguard.demo import engines
from kvguard.demo.model import VOCAB_SIZE, write_tiny_gpt2


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
        assert "--sleep-on-idle" in args  # an idle scheduler would spin a core
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill"
    assert prefill[prefill.index("--max-total-tokens") + 1] == "256"
    assert decode[decode.index("--disaggregation-bootstrap-port") + 1] == "999"
    assert "--num-reserved-decode-tokens" in decode and "--num-reserved-decode-tokens" not in prefill
    assert "--disaggregation-mode" not in plain
    with pytest.raises(ValueError, match="bootstrap_port"):
        engines.engine_args(tmp_path, 1, role="decode")
    with pytest.raises(ValueError, match="role"):
        engines.engine_args(tmp_path, 1, role="router")


def test_engine_args_pin_the_rendezvous_port(tmp_path):
    # SGLang picks torch.distributed's port by bind-0-and-release unless told one
    args = engines.engine_args(tmp_path, 1236)
    assert int(args[args.index("--nccl-port") + 1]) != 1236


def test_free_port_stays_out_of_the_kernels_range_and_this_workers_neighbours(monkeypatch):
    from kvguard.demo import engine_env

    floor = engine_env._ephemeral_floor()
    monkeypatch.setattr(engine_env, "_port_cursor", [])
    monkeypatch.setattr(engine_env, "_ports_handed_out", set())
    slices = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        engine_env._port_cursor.clear()
        ports = [engines.free_port() for _ in range(50)]
        assert len(set(ports)) == 50  # never the same port twice in one process
        if floor - engine_env._PORTS_FLOOR >= 2 * engine_env._PORT_SLICES * 64:
            assert all(engine_env._PORTS_FLOOR <= p < floor for p in ports), ports
        slices[worker] = set(ports)
    assert not slices["gw0"] & slices["gw1"]
    # a port something listens on is not handed out
    import socket

    if floor - engine_env._PORTS_FLOOR < 2 * engine_env._PORT_SLICES * 64:
        return  # this machine's ephemeral range leaves no room: the kernel's choice is used
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    low, _high = engine_env._worker_slice(engine_env._PORTS_FLOOR, floor)
    engine_env._port_cursor[:] = [low + 10]
    first = engines.free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", first + 1))
        held.listen()
        assert engines.free_port() == first + 2


def test_engine_env(tmp_path, require_sglang):
    require_sglang("0.5.23")
    env = engines.engine_env("0.5.23", tmp_path / "ring", waiting_timeout_s=7)
    assert env["PYTHONPATH"].split(":")[:2] == [str(engines.sglang_dir("0.5.23")), str(engines.shim_dir())]
    assert env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "7"
    assert env["KVGUARD_RING_DIR"] == str(tmp_path / "ring") and (tmp_path / "ring").is_dir()
    assert env["KVGUARD_SGLANG_CPU_COMPAT"] == "1" and env["TRITON_INTERPRET"] == "1"
    # the tenant through the router arrives as extra_key (tenant_payload(routed=True))
    assert env["KVGUARD_SGLANG_TENANT_FIELDS"] == "routing_key,extra_key"
    with pytest.raises(ValueError, match="version"):
        engines.sglang_dir("0.4.0")


# A plain engine started, asked and stopped by the harness: tests/tools/test_echo_model.py's engine
# test checks that contract on the engine it starts anyway (one start fewer).


# ---------------------------------------------------------------- the router and routed requests


def test_router_args_and_tenant_fields():
    args = engines.router_args("http://127.0.0.1:1", 998, "http://127.0.0.1:2", 3, 4, ["--disable-retries"])
    assert args[:5] == ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "998", "--decode"]
    assert args[args.index("--port") + 1] == "3" and args[args.index("--prometheus-port") + 1] == "4"
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[-1] == "--disable-retries"
    # the router drops routing_key from a /generate body but forwards extra_key (engine_hooks/sglang/README.md)
    assert engines.tenant_payload("acme") == {"routing_key": "acme"}
    assert engines.tenant_payload("acme", routed=True) == {"routing_key": "acme", "extra_key": "acme"}
    assert engines.tenant_payload(None, routed=True) == {}


def test_ids_from_decode_error():
    err = (
        "Decode transfer failed for request rank=0 decode_req.req.rid='341174a0b48344f0' "
        "decode_req.req.bootstrap_room=1296586503722359421 with exception KVTransferError(bootstrap_room="
        "1296586503722359421): Request 1296586503722359421 timed out after 20.0s in KVPoll.WaitingForInput"
    )
    assert engines.ids_from_error(err) == ("341174a0b48344f0", 1296586503722359421)
    assert engines.ids_from_error("No prefill workers available") == (None, None)
    assert engines.ids_from_error(None) == (None, None)


class FakeRouter:
    """A local HTTP server answering /generate the way SGLang's router does: 503 for the
    first ``unready`` requests, 400 for the smoke body, decode's JSON or SSE stream otherwise."""

    def __init__(self, unready: int = 2, chunks: int = 50):
        import http.server
        import threading

        self.bodies: list[dict] = []
        self.stream_closed_after: list[int] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                fake.bodies.append(body)
                if len(fake.bodies) <= unready:
                    return self._send(503, {"error": {"message": "No prefill workers available"}})
                if body["sampling_params"].get("temperature", 0) < 0:
                    return self._send(400, {"error": {"message": "temperature must be a non-negative number"}})
                meta = {"id": body.get("rid", "decode-rid-1"), "prompt_tokens": len(body["input_ids"])}
                if not body.get("stream"):
                    return self._send(
                        200,
                        {
                            "output_ids": [0, 0],
                            "meta_info": {**meta, "completion_tokens": 2, "finish_reason": {"type": "length"}},
                        },
                    )
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                sent = 0
                try:
                    for i in range(chunks):
                        chunk = {"output_ids": [0] * (i + 1), "meta_info": {**meta, "completion_tokens": i + 1}}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        sent += 1
                        time.sleep(0.02)
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                fake.stream_closed_after.append(sent)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_router(tmp_path):
    import subprocess
    import sys

    fake = FakeRouter()
    # a stand-in process group for the router's, stopped like the real one
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    router = engines.Router(fake.port, 0, tmp_path / "router.log", proc)
    try:
        yield fake, router
    finally:
        router.stop(timeout_s=5)
        fake.close()


def test_router_is_ready_once_a_request_comes_back_from_an_engine(fake_router):
    fake, router = fake_router
    assert router.wait_ready(10) > 0
    # two 503s ("No prefill workers available"), then the engines' 400 for the smoke body
    assert len(fake.bodies) == 3 and all(b == engines.ROUTER_SMOKE_BODY for b in fake.bodies)
    router.stop(timeout_s=5)
    assert not router.is_running() and engines._group_members(router.proc.pid) == []


def _routed_pair(router, require_sglang, tmp_path) -> engines.PDPair:
    require_sglang("0.5.23")
    pair = engines.PDPair("0.5.23", None, tmp_path / "logs")
    pair.prefill = pair.decode = object()  # not used through the router
    pair.router = router
    return pair


def test_routed_generate_sends_no_rid_and_reads_decodes_rid(fake_router, require_sglang, tmp_path):
    fake, router = fake_router
    router.wait_ready(10)
    pair = _routed_pair(router, require_sglang, tmp_path)
    r = pair.generate([5, 6, 7], tenant="acme", max_new_tokens=2)
    body = fake.bodies[-1]
    assert "rid" not in body and not any(k.startswith("bootstrap_") for k in body)
    assert body["routing_key"] == body["extra_key"] == "acme" and body["stream"] is False
    assert r.ok and r.routed and r.rid == "decode-rid-1" and r.room is None and r.prefill_status is None
    assert (r.prompt_tokens, r.completion_tokens, r.output_ids) == (3, 2, [0, 0])
    # a client rid goes through (both engines then use it); a room cannot be chosen
    assert pair.generate([5, 6], rid="mine").rid == "mine" and fake.bodies[-1]["rid"] == "mine"
    with pytest.raises(ValueError, match="bootstrap_room"):
        pair.generate([5], room=7)
    with pytest.raises(ValueError, match="stream"):
        pair.generate([5], disconnect_after_chunks=2)


def test_routed_stream_cut_mid_way_closes_the_connection(fake_router, require_sglang, tmp_path):
    fake, router = fake_router
    router.wait_ready(10)
    pair = _routed_pair(router, require_sglang, tmp_path)
    full = pair.generate([5, 6, 7], tenant="acme", stream=True)
    assert full.ok and full.chunks == 50 and not full.disconnected and full.ttft_s is not None
    cut = pair.generate([5, 6, 7], tenant="acme", stream=True, disconnect_after_chunks=3)
    assert cut.disconnected and cut.chunks == 3 and cut.completion_tokens == 3 and cut.rid == "decode-rid-1"
    deadline = time.monotonic() + 5
    while len(fake.stream_closed_after) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.stream_closed_after[0] == 50 and fake.stream_closed_after[1] < 50  # the server saw the client go


# ---------------------------------------------------------------- the demo's report


def _scenario(long_rid="dec-long", long_ok=True):
    from kvguard.demo.scenario import ScenarioRequest, ScenarioResult

    def result(rid, tenant, n, ok=True):
        return engines.GenerateResult(
            rid=rid,
            room=None,
            tenant=tenant,
            prompt_len=n,
            prefill_status=None,
            decode_status=200 if ok else 500,
            routed=True,
            error=None if ok else "timed out in KVPoll.WaitingForInput",
            decode_json={
                "meta_info": {"id": rid, "prompt_tokens": n, "completion_tokens": 8, "finish_reason": "length"}
            },
        )

    reqs = [ScenarioRequest("normal", result(f"dec-{i}", ("acme", "globex")[i % 2], 200), [5] * 200) for i in range(2)]
    reqs.append(ScenarioRequest("long", result(long_rid, "initech", 600, long_ok), [5] * 600))
    return ScenarioResult("0.5.19", 256, 1024, 250, reqs, 1.0)


def test_report_maps_findings_to_client_requests_by_decodes_rid():
    import io

    from kvguard.demo.run import DemoRun, tell_story
    from kvguard.sidecar.findings import EngineRef, Finding, Party

    read = Finding(
        "unwritten_read",
        "critical",
        EngineRef("decode", 0, 42),
        Party("dec-long", "initech", 77),
        [2, 3, 4],
        [Party("dec-0", "acme", pages=[2, 3]), Party("dec-1", "globex", pages=[4])],
        0,
        "read unwritten",
        {"sender_rid": "pre-long", "sender_tenant": "initech"},
    )
    out = io.StringIO()
    tell_story(DemoRun("0.5.19", _scenario(), [read], {}, 0), out)
    text = out.getvalue()
    assert "behind SGLang's router" in text and "(client request 3)" in text
    assert "reader:  request dec-long of tenant initech (bootstrap_room 77)" in text
    assert "= client request 3: initech's 600-token prompt" in text
    assert "prefill knew that room as request pre-long" in text
    assert "request dec-0 = client request 1: 2 pages (2-3)" in text and "dec-1 = client request 2" in text
    assert "Whom to notify: tenant(s) acme, globex" in text


def test_library_logs_go_to_the_demo_log_not_the_terminal(tmp_path, capsys):
    import logging

    from kvguard.demo.run import library_logs_to

    root = logging.getLogger()
    handler = logging.StreamHandler()  # what `kvguard`'s basicConfig installs: stderr
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    httpx_log = logging.getLogger("httpx")
    httpx_level = httpx_log.level  # another test's CLI (preflight, canary) may have quietened httpx
    httpx_log.setLevel(logging.NOTSET)
    try:
        with library_logs_to(str(tmp_path / "demo.log")):
            logging.getLogger("httpx").info('HTTP Request: POST http://127.0.0.1:1/generate "HTTP/1.1 200 OK"')
        logging.getLogger("kvguard.test").info("after the demo")
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        httpx_log.setLevel(httpx_level)
    err = capsys.readouterr().err
    assert "HTTP Request" not in err and "after the demo" in err  # the terminal's handler is back afterwards
    assert "httpx: HTTP Request: POST" in (tmp_path / "demo.log").read_text()

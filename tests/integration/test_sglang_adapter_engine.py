"""The SGLang adapter on real engines (CPU): SGLang 0.5.19 through 0.5.23.

One driver subprocess per SGLang version (that version on PYTHONPATH) starts the
scenarios' engines one after the other (SGLang is imported once, not once per engine); the
plugin is discovered through the ``sglang.srt.plugins`` entry point in each engine's
spawned scheduler process and writes to a real ring in that engine's own
``KVGUARD_RING_DIR``, which this process reads back. Before its engines, the driver checks
the adapter's version table against that SGLang (test_real_targets_resolve).

Scenarios: a unified engine (radix prefix hit, concurrent batch, chunked prefill, an
over-length prompt rejected at admission); a decode-role engine with the fake
transfer backend (pre-allocation, receiver completion); a prefill-role engine
(Mooncake over TCP, fake bootstrap host) sending an over-length prompt: on 0.5.19 the
incident's bug path (1 page sent for a rejected 300-token prompt), on 0.5.23 no send.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections import defaultdict
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from kvguard.demo.engine_env import free_port as _free_port
from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import RingReader
from kvguard.engine_hooks.sglang import plugin

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
PAGE = 4

TORCHVISION_SHIM = """
try:
    import torch
    _lib = torch.library.Library("torchvision", "DEF")
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:
    pass
"""

DRIVER = r"""
import asyncio, json, os, sys, tempfile

def build_model(d):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, PreTrainedTokenizerFast
    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=2048, bos_token_id=1,
                     eos_token_id=2)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.torch_dtype = "bfloat16"
    cfg.save_pretrained(d)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, 256)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(d)

def plan_check():
    # what test_real_targets_resolve reads: the version table against this SGLang, and SGLang's
    # own plugin loader finding kvguard's entry point
    from kvguard.engine_hooks.sglang import plugin
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    v = plugin.sglang_version()
    ok, skipped = plugin.plan(v, guard_full=True)  # every target, the guard's included
    func, dist = load_plugins_by_group(GENERAL_PLUGINS_GROUP)["kvguard"]
    print("KVG_PLAN " + json.dumps({"version": v, "ok": len(ok), "skipped": [[s.target, why] for s, why in skipped],
                                   "plugin": [func.__module__, func.__name__, str(dist)]}), flush=True)

NCCL_PORTS = [int(p) for p in os.environ["KVG_NCCL_PORTS"].split(",")]

def run_mode(label, model_dir):
    mode = label.split("-")[0]  # decode-off: the decode engine, with the plugin switched off
    import sglang
    from sglang.srt.managers.io_struct import GenerateReqInput
    kw = dict(model_path=model_dir, load_format="dummy", device="cpu", attention_backend="torch_native",
              disable_cuda_graph=True, dtype="bfloat16", page_size=4, max_running_requests=4, random_seed=0,
              log_level="error", nccl_port=NCCL_PORTS.pop(0))  # see kvguard.demo.engine_env.free_port
    if mode == "unified":
        kw.update(max_total_tokens=256, chunked_prefill_size=16)
    elif mode == "prefill":
        kw.update(max_total_tokens=256, disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
                  disaggregation_bootstrap_port=int(os.environ["KVG_BOOTSTRAP_PORT"]), host="127.0.0.1")
    else:
        kw.update(max_total_tokens=1024, disaggregation_mode="decode", disaggregation_transfer_backend="fake",
                  num_reserved_decode_tokens=32, disaggregation_decode_retraction_backup="cpu_tensor")
    eng = sglang.Engine(**kw)
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def one(ids, **extra):
        obj = GenerateReqInput(input_ids=ids, sampling_params=sp, **extra)
        try:
            out = await eng.tokenizer_manager.generate_request(obj, None).__anext__()
        except Exception as e:
            return {"error": str(e)}
        m = out.get("meta_info", {})
        fr = m.get("finish_reason")
        return {"finish": fr.get("type") if isinstance(fr, dict) else str(fr),
                "prompt_tokens": m.get("prompt_tokens"), "completion_tokens": m.get("completion_tokens"),
                "cached_tokens": m.get("cached_tokens")}

    run = eng.loop.run_until_complete
    out = {}
    fake = dict(bootstrap_host="2.2.2.2", bootstrap_port=8998)
    if mode == "unified":
        base = [3 + (i % 200) for i in range(40)]
        out["req-a"] = run(one(base, routing_key="tenant-a", rid="req-a"))
        out["req-b"] = run(one(base[:32] + [250] * 8, routing_key="tenant-b", rid="req-b"))
        out["req-c"], out["req-d"] = run(asyncio.gather(one([60] * 12, rid="req-c"), one([61] * 9, rid="req-d")))
        out["req-long"] = run(one([5] * 300, rid="req-long"))
    elif mode == "prefill":
        out["preq-0"] = run(one([9] * 30, rid="preq-0", bootstrap_room=2000, **fake))
        out["preq-long"] = run(one([5] * 300, rid="preq-long", bootstrap_room=2001, **fake))
    else:
        for i in range(2):
            out[f"dreq-{i}"] = run(one([7 + i] * 30, rid=f"dreq-{i}", bootstrap_room=1000 + i, **fake))
    print(f"KVG_RESULT {label} " + json.dumps(out), flush=True)
    eng.shutdown()

def main(modes, model_dir, ring_root):
    # one process, the engines one after the other: each sglang.Engine spawns its own scheduler,
    # whose kvguard plugin reads KVGUARD_RING_DIR and KVGUARD_DISABLE from the environment at spawn
    build_model(model_dir)
    plan_check()
    for mode in modes.split(","):
        os.environ["KVGUARD_RING_DIR"] = os.path.join(ring_root, mode)
        if mode == "decode-off":
            os.environ["KVGUARD_DISABLE"] = "1"
        else:
            os.environ.pop("KVGUARD_DISABLE", None)
        run_mode(mode, model_dir)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
"""


def _sglang_dir(version: str) -> Path:
    d = REPO / ".venv" / "sglang" / version
    if not (d / "sglang").is_dir():
        pytest.skip(f"SGLang {version} not installed in {d}")
    if not any(ep.name == "kvguard" for ep in entry_points(group="sglang.srt.plugins")):
        pytest.skip("kvguard entry point not installed (pip install -e .)")
    return d


class DriverRun:
    """One driver process for one SGLang version: the plan check, then each mode's engine in
    turn (the driver's ``main``), each engine's ring in its own folder."""

    def __init__(self, version: str, work: Path) -> None:
        sglang_dir = _sglang_dir(version)
        self.modes = ["unified", "decode"]
        self.no_prefill = None
        try:
            import mooncake.engine  # noqa: F401
        except ImportError:
            self.no_prefill = "Mooncake (mooncake-transfer-engine-non-cuda) not installed"
        else:
            self.modes.append("prefill")
        if version == "0.5.23":
            self.modes.append("decode-off")  # last: no later engine depends on the main process's plugin
        shim = work / "shim"
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(TORCHVISION_SHIM)
        (work / "driver.py").write_text(DRIVER)
        self.ring_root = work / "rings"
        self.ring_root.mkdir()
        env = dict(os.environ)
        env.update(
            PYTHONPATH=f"{shim}{os.pathsep}{sglang_dir}",
            TRITON_INTERPRET="1",
            MOONCAKE_PROTOCOL="tcp",
            MC_FORCE_TCP="1",
            KVGUARD_SGLANG_CPU_COMPAT="1",
            KVG_BOOTSTRAP_PORT=str(_free_port()),
            KVG_NCCL_PORTS=",".join(str(_free_port()) for _ in self.modes),
            SGLANG_DISAGGREGATION_WAITING_TIMEOUT="20",
            KVGUARD_ROW_SAMPLE_EVERY="1",  # every forward carries its rows: the replay below checks them all
            # every engine watched runs the guard's strictest mode: each version's exact results
            # below, and decode-off's equal to decode's, show it changes no clean response
            KVGUARD_GUARD="full",
        )
        env.pop("KVGUARD_DISABLE", None)
        self.proc = subprocess.run(
            [sys.executable, str(work / "driver.py"), ",".join(self.modes), str(work / "model"), str(self.ring_root)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        self.results = {}
        self.plan = None
        for line in self.proc.stdout.splitlines():
            if line.startswith("KVG_RESULT "):
                mode, _, body = line[len("KVG_RESULT ") :].partition(" ")
                self.results[mode] = json.loads(body)
            elif line.startswith("KVG_PLAN "):
                self.plan = json.loads(line[len("KVG_PLAN ") :])

    def failure(self) -> tuple[str, str]:
        return self.proc.stdout[-3000:], self.proc.stderr[-5000:]

    def mode(self, mode: str) -> tuple[list, dict]:
        """That engine's ring records and the driver's view of its requests."""
        if mode == "prefill" and self.no_prefill:
            pytest.skip(self.no_prefill)
        assert self.proc.returncode == 0 and mode in self.results, self.failure()
        rings = glob.glob(str(self.ring_root / mode / "*.ring"))
        assert len(rings) == 1, f"expected one ring (the scheduler's), got {rings}"
        reader = RingReader(rings[0])
        records = []
        while True:
            got = reader.poll().records
            if not got:
                break
            records.extend(got)
        reader.close()
        return records, self.results[mode]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """``driver(version)``: that version's DriverRun, started by the first test that asks (each
    process imports SGLang once for all its engines: ~15 s of a core saved per engine)."""
    runs: dict[str, DriverRun] = {}

    def get(version: str) -> DriverRun:
        if version not in runs:
            runs[version] = DriverRun(version, tmp_path_factory.mktemp(f"sglang-{version}"))
        return runs[version]

    return get


class Trace:
    """Records with request keys resolved to rids, plus an ownership replay."""

    def __init__(self, records):
        self.records = records
        self.rid = {}
        for r in records:
            if r.kind == wire.Kind.REQ_BEGIN:
                self.rid[r.body.req_key] = r.body.rid

    def of(self, kind, rid=None):
        out = [r.body for r in self.records if r.kind == kind]
        if rid is not None:
            out = [b for b in out if self.rid.get(b.req_key) == rid]
        return out

    def forwards(self, rid):
        """(seq_len, written pages, read pages) per forward of this request."""
        out = []
        for f in self.of(wire.Kind.FORWARD):
            wo = ro = 0
            for i, key in enumerate(f.req_keys.tolist()):
                wc, rc = int(f.write_counts[i]), int(f.read_counts[i])
                if self.rid.get(key) == rid:
                    out.append(
                        (int(f.seq_lens[i]), f.write_pages[wo : wo + wc].tolist(), f.read_pages[ro : ro + rc].tolist())
                    )
                wo, ro = wo + wc, ro + rc
        return out

    def check_consistency(self):
        """Replay: no page allocated twice or freed while free, page 0 never used, every
        forward reads exactly the rows ASSIGNed to it and writes inside them."""
        allocated = set()
        rows = defaultdict(dict)  # req_key -> {page index: page}
        for r in self.records:
            b = r.body
            if r.kind == wire.Kind.ALLOC:
                pages = set(b.pages.tolist())
                assert 0 not in pages
                assert not pages & allocated, f"seq {r.seq}: pages allocated twice: {pages & allocated}"
                allocated |= pages
            elif r.kind == wire.Kind.FREE:
                pages = set(b.pages.tolist())
                assert pages <= allocated, f"seq {r.seq}: freeing free pages {pages - allocated}"
                allocated -= pages
            elif r.kind == wire.Kind.ASSIGN:
                first = b.row_start // PAGE
                for k, page in enumerate(b.pages.tolist()):
                    rows[b.req_key][first + k] = page
                    assert page in allocated, f"seq {r.seq}: row bound to unallocated page {page}"
            elif r.kind == wire.Kind.FORWARD:
                wo = ro = 0
                for i, key in enumerate(b.req_keys.tolist()):
                    wc, rc = int(b.write_counts[i]), int(b.read_counts[i])
                    read = b.read_pages[ro : ro + rc].tolist()
                    written = b.write_pages[wo : wo + wc].tolist()
                    n_pages = -(-int(b.seq_lens[i]) // PAGE)
                    expect = [rows[key].get(j) for j in range(n_pages)]
                    assert read == expect, f"seq {r.seq} {self.rid.get(key)}: read {read} != rows {expect}"
                    assert set(written) <= set(read)
                    wo, ro = wo + wc, ro + rc
            elif r.kind == wire.Kind.REQ_END:
                rows.pop(b.req_key, None)
        assert not self.of(wire.Kind.PROBE_ERROR), self.of(wire.Kind.PROBE_ERROR)


def _hello(trace, version, role, pool_tokens):
    first = trace.records[0]
    assert first.kind == wire.Kind.HELLO
    h = first.body
    assert (h.engine_name, h.engine_version, h.role, h.page_size) == ("sglang", version, role, PAGE)
    assert (h.pool_tokens, h.pool_pages, h.context_len) == (pool_tokens, pool_tokens // PAGE, 2048)
    assert len(trace.of(wire.Kind.HELLO)) == 1
    return h


# every release the adapter supports (engine_hooks/sglang/plugin.py SUPPORTED). `make test`
# (CI) runs the fixed 0.5.23; the others are the ``sweep`` marker's: `make test-versions`
# installs them and runs all five (each version boots its own engines, 50-80 s of a 2-core CI
# machine). 0.5.19, the leaking release, is in make test's other engine tests all the same: the
# incident, the canary, the GLM-5 leak and the two-pod ledger run its prefill/decode hooks.
VERSIONS = [*(pytest.param(v, marks=pytest.mark.sweep) for v in ("0.5.19", "0.5.20", "0.5.21", "0.5.22")), "0.5.23"]


@pytest.mark.parametrize("version", VERSIONS)
def test_unified_engine(version, driver):
    records, result = driver(version).mode("unified")
    for rid in ("req-a", "req-b", "req-c", "req-d"):
        assert result[rid]["finish"] == "length" and result[rid]["completion_tokens"] == 6, result
    assert result["req-b"]["cached_tokens"] == 32
    t = Trace(records)
    h = _hello(t, version, wire.Role.UNIFIED, 256)
    assert h.max_req_input_len == 250
    t.check_consistency()

    begins = {b.rid: b for b in t.of(wire.Kind.REQ_BEGIN)}
    assert set(begins) == {"req-a", "req-b", "req-c", "req-d", "req-long"}
    assert (begins["req-a"].tenant, begins["req-a"].prompt_tokens, begins["req-a"].cached_tokens) == ("tenant-a", 40, 0)
    assert (begins["req-b"].tenant, begins["req-b"].cached_tokens) == ("tenant-b", 32)
    assert begins["req-long"].prompt_tokens == 300 and not any(b.warmup for b in begins.values())

    # chunked prefill (16 tokens): req-a's prompt is assigned chunk by chunk
    a_assign = [(x.row_start, x.row_end, x.shared_until) for x in t.of(wire.Kind.ASSIGN, "req-a")]
    assert a_assign[0] == (0, 16, 0) and (16, 32, 16) in a_assign and (32, 40, 32) in a_assign
    a_fwd = t.forwards("req-a")
    assert [s for s, _w, _r in a_fwd[:3]] == [16, 32, 40]
    assert len(a_fwd[0][1]) == 4 and a_fwd[0][1] == a_fwd[0][2]  # first chunk writes what it reads
    assert all(len(w) == 1 for _s, w, _r in a_fwd[3:])  # decode: one slot per step
    a_pages = a_fwd[2][2]

    # radix prefix hit: req-b's first 32 positions are req-a's pages, marked shared
    b_first = t.of(wire.Kind.ASSIGN, "req-b")[0]
    assert (b_first.row_start, b_first.row_end, b_first.shared_until) == (0, 40, 32)
    assert b_first.pages.tolist()[:8] == a_pages[:8]
    assert not set(b_first.pages.tolist()[8:]) & set(a_pages)

    # c and d prefill in the same forward
    assert any({t.rid.get(k) for k in f.req_keys.tolist()} == {"req-c", "req-d"} for f in t.of(wire.Kind.FORWARD))

    ends = {t.rid[e.req_key]: e for e in t.of(wire.Kind.REQ_END)}
    assert set(ends) == {"req-a", "req-b", "req-c", "req-d", "req-long"}
    for rid in ("req-a", "req-b", "req-c", "req-d"):
        assert ends[rid].finish == wire.Finish.LENGTH and ends[rid].output_tokens == 6
        assert 0 < ends[rid].ttft_ns <= ends[rid].e2e_ns
    # the over-length prompt: rejected at admission, runs a 1-token placeholder, ends "reject"
    (rej,) = t.of(wire.Kind.REJECT, "req-long")
    assert rej.phase == wire.Phase.ADMISSION and "exceeds the maximum allowed length" in rej.reason
    assert ends["req-long"].finish == wire.Finish.REJECT
    # its placeholder prefill runs once; with the overlap scheduler the next decode batch
    # may already be built before the abort is processed, so one decode step can follow
    assert [s for s, _w, _r in t.forwards("req-long")] in ([1], [1, 2])
    assert any(f.free_kind == wire.FreeKind.GROUP for f in t.of(wire.Kind.FREE))


@pytest.mark.parametrize("version", VERSIONS)
def test_decode_engine_fake_transfer(version, driver):
    records, result = driver(version).mode("decode")
    assert all(r["completion_tokens"] == 6 for r in result.values()), result
    t = Trace(records)
    _hello(t, version, wire.Role.DECODE, 1024)
    t.check_consistency()
    for i in range(2):
        rid, room = f"dreq-{i}", 1000 + i
        (begin,) = t.of(wire.Kind.REQ_BEGIN, rid)
        assert begin.warmup and begin.room == room and begin.prompt_tokens == 30
        (res,) = t.of(wire.Kind.XFER_RESERVE, rid)
        assert (res.room, res.tokens, len(res.pages)) == (room, 30, 8)
        (done,) = t.of(wire.Kind.XFER_DONE, rid)
        assert (done.side, done.status) == (wire.Side.RECEIVER, wire.XferStatus.SUCCESS)
        fwd = t.forwards(rid)
        assert fwd[0][0] == 31 and fwd[0][2] == res.pages.tolist()  # attention reads the reserved pages
        (end,) = t.of(wire.Kind.REQ_END, rid)
        assert end.finish == wire.Finish.LENGTH

        def first_seq(kind, begin=begin):
            return min(
                r.seq
                for r in records
                if r.kind == kind
                and (
                    begin.req_key in r.body.req_keys.tolist()
                    if kind == wire.Kind.FORWARD
                    else r.body.req_key == begin.req_key
                )
            )

        assert first_seq(wire.Kind.XFER_RESERVE) < first_seq(wire.Kind.XFER_DONE) < first_seq(wire.Kind.FORWARD)


@pytest.mark.parametrize("version", VERSIONS)
def test_prefill_engine_over_length_prompt(version, driver):
    records, result = driver(version).mode("prefill")
    t = Trace(records)
    _hello(t, version, wire.Role.PREFILL, 256)
    t.check_consistency()
    (send,) = t.of(wire.Kind.XFER_SEND, "preq-0")
    assert (send.room, send.token_start, send.token_end, send.is_last, len(send.pages)) == (2000, 0, 30, True, 8)
    (done,) = t.of(wire.Kind.XFER_DONE, "preq-0")
    assert (done.side, done.status) == (wire.Side.SENDER, wire.XferStatus.SUCCESS)
    (rej,) = t.of(wire.Kind.REJECT, "preq-long")
    assert rej.phase == wire.Phase.ADMISSION
    (begin,) = t.of(wire.Kind.REQ_BEGIN, "preq-long")
    assert begin.prompt_tokens == 300 and begin.room == 2001
    if version == "0.5.19":
        # the incident's bug path: the rejected request still sends 1 page for 1 token,
        # reports success, and its client gets a normal completion
        assert "error" not in result["preq-long"], result
        (send,) = t.of(wire.Kind.XFER_SEND, "preq-long")
        assert (send.token_start, send.token_end, send.is_last, len(send.pages)) == (0, 1, True, 1)
        (done,) = t.of(wire.Kind.XFER_DONE, "preq-long")
        assert done.status == wire.XferStatus.SUCCESS
        (end,) = t.of(wire.Kind.REQ_END, "preq-long")
        assert end.finish == wire.Finish.LENGTH  # SGLang replaced the pending abort
    elif version == "0.5.20":
        # 0.5.20 still runs the 1-token placeholder prefill, but no longer sends it: the
        # client gets the error
        assert "error" in result["preq-long"], result
        assert not t.of(wire.Kind.XFER_SEND, "preq-long")
        assert [(a.row_start, a.row_end) for a in t.of(wire.Kind.ASSIGN, "preq-long")] == [(0, 1)]
    else:
        # 0.5.21 on retire it before bootstrap: nothing is allocated or sent for it
        assert "error" in result["preq-long"], result
        assert not t.of(wire.Kind.XFER_SEND, "preq-long") and not t.of(wire.Kind.ASSIGN, "preq-long")


def test_plugin_off_engine_unchanged(driver):
    """KVGUARD_DISABLE=1: no hooks, no ring (the same driver's decode engine, 0.5.23), and the
    same responses as the decode engine watched with KVGUARD_GUARD=full."""
    run = driver("0.5.23")
    assert run.proc.returncode == 0, run.failure()
    assert run.results["decode-off"] == run.results["decode"]  # served the same, unwatched
    assert not glob.glob(str(run.ring_root / "decode-off" / "*.ring"))
    assert glob.glob(str(run.ring_root / "decode" / "*.ring"))  # where the plugin was on, it wrote


@pytest.mark.parametrize("version", VERSIONS)
def test_real_targets_resolve(version, driver):
    """Every hook target of the version table exists with the expected parameters in the
    installed SGLang, and SGLang's own plugin loader finds kvguard's entry point in the
    installed distribution (checked in the driver process before its engines start)."""
    run = driver(version)
    assert run.plan is not None, run.failure()
    assert run.plan["version"] == version and run.plan["skipped"] == [], run.plan
    assert run.plan["ok"] == len(plugin.SUPPORTED[version][1]) + len(plugin._GUARD_FULL) + len(plugin._GUARD_TRANSFER)
    assert run.plan["plugin"] == ["kvguard.engine_hooks.sglang.plugin", "load", "kvguard"], run.plan

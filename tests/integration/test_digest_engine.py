"""Transfer digests on a real SGLang 0.5.23 prefill/decode pair (Mooncake over TCP, CPU).

One pair for every case (module fixture). Prefill runs chunked prefill with 64-token
chunks, so longer prompts are sent in several chunks and the sender's streaming digest
is exercised. The sidecar runs in this process with a recorder, and the test reads
the raw XFER_DIGEST records from the recording (engine_hooks/digest.py,
docs/wire-format.md "Transfer digests"):

* normal requests: for every room, one sender and one receiver digest over the same
  tokens, equal; the sidecar reports nothing;
* the test-only ``flip_received_page`` fault (tests/faults/kvguard_faults) flips one
  byte of one page decode received, after the transfer arrived and before kvguard
  hashes it: the two digests differ for that room only, decode's guard fails that
  request before its first decode step (HTTP 500; prefill's digest travelled in the
  transfer's metadata row, engine_hooks/sglang/guard_marker.py), and the sidecar reports
  one ``checksum_mismatch`` for it (sidecar/detectors/transfers.py) with ``action:
  aborted``.

The pair runs with the guard's ``full`` mode (docs/guard.md: the transfer rules and the
read check), so the normal requests above (one to four chunks each) also show that
neither its page-count rule nor its digest rule fails a healthy transfer, and:

* the test-only ``send_truncated`` fault initialises prefill's sender for 1 page of the
  50 decode reserved (SGLang would report the transfer complete after that page, and
  decode's first step would read 49 reserved pages nothing wrote: an unwritten read):
  the guard fails the transfer before its first chunk, decode answers HTTP 500 and never
  reads the reserved pages, the next request is served, and the sidecar reports one
  ``transfer_size_mismatch`` with ``action: aborted`` and nobody exposed.

Decode runs with its own radix cache (``--disaggregation-decode-enable-radix-cache``):
three prompts sharing a 64-token prefix, the later two reserved and sent from after the
prefix, raise nothing and abort nothing (before the ledger counted a transfer's rows from
where the reservation starts, each of them raised false ``unwritten_read`` findings).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvguard.demo.engines import PDPair
from kvguard.engine_hooks import wire
from kvguard.sidecar.recorder import Recorder, SegmentReader
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.fault_plugin import FAULTS_DIR, make_rid
from tests.support.sidecar_settle import wait_until_applied

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

VERSION = "0.5.23"
PAGE = 4
CONTEXT = 256
CHUNK = 64  # --chunked-prefill-size on prefill: a 233-token prompt goes out in 4 chunks
LAYERS, KV_HEADS = 2, 4  # the tiny GPT-2 (demo/model.py)
WAIT_S = 60.0


class Watch:
    """An in-process sidecar that also records every record it reads."""

    def __init__(self, ring_dir: Path, rec_dir: Path, events_path: Path):
        self.memory = MemorySink()
        self.recorder = Recorder(rec_dir)
        self.events_path = events_path
        self.sidecar = Sidecar(
            str(ring_dir), sinks=[self.memory], remove_dead_rings=False, recorder=self.recorder
        ).start()

    def stop(self) -> None:
        self.sidecar.stop()

    def settle(self, quiet_s: float = 0.4, max_s: float = 10.0) -> None:
        wait_until_applied(self.sidecar, quiet_s, max_s)

    def digests(self) -> dict[int, dict[str, wire.XferDigest]]:
        """room -> side name -> its XFER_DIGEST (one per side per room, asserted)."""
        self.settle()
        self.recorder.flush()
        out: dict[int, dict[str, wire.XferDigest]] = {}
        self.sends: dict[int, list[tuple[int, int]]] = {}  # room -> the chunks prefill sent
        for path in self.recorder.segments:
            with SegmentReader(path) as r:
                for rec, carried in r:
                    if not carried and rec.kind == wire.Kind.XFER_SEND:
                        self.sends.setdefault(rec.body.room, []).append((rec.body.token_start, rec.body.token_end))
                    if carried or rec.kind != wire.Kind.XFER_DIGEST:
                        continue
                    x = rec.body
                    side = x.side.name.lower()
                    assert side not in out.get(x.room, {}), f"two {side} digests for room {x.room}"
                    out.setdefault(x.room, {})[side] = x
        return out

    def events(self, event: str) -> list[dict]:
        import json

        try:
            lines = self.events_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [e for e in map(json.loads, filter(None, lines)) if e["event"] == event]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    pytest.importorskip("mooncake.engine", reason="Mooncake (mooncake-transfer-engine-non-cuda) not installed")
    work = tmp_path_factory.mktemp("digest-pd")
    ring_dir, events_dir = work / "rings", work / "events"
    ring_dir.mkdir()
    events_dir.mkdir()
    watch = Watch(ring_dir, work / "recording", events_dir / "events.jsonl")
    t0 = time.monotonic()
    pair = PDPair(
        VERSION,
        ring_dir,
        work / "logs",
        prefill_pool_tokens=512,
        decode_pool_tokens=512,
        context_length=CONTEXT,
        prefill_args=["--chunked-prefill-size", str(CHUNK)],
        # decode keeps its own radix cache: a prompt whose prefix decode already holds is
        # reserved and sent from after it (the last test)
        decode_args=["--disaggregation-decode-enable-radix-cache"],
        extra_env={
            "KVGUARD_FAULT": "flip_received_page,send_truncated",
            "KVGUARD_FAULT_DIR": str(events_dir),
            # full: the transfer rules and the read check (Tier 1) in both engines
            "KVGUARD_GUARD": "full",
        },
        extra_pythonpath=[FAULTS_DIR],
        # direct: each case looks its digests up by the room the client chose
        router=False,
    )
    try:
        pair.start()
    except BaseException:
        watch.stop()
        raise
    print(f"\nprefill/decode pair ready in {time.monotonic() - t0:.1f} s")
    try:
        yield pair, watch
        assert pair.prefill.is_running() and pair.decode.is_running()
        assert not watch.events("error"), watch.events("error")
        assert watch.sidecar.rings.stats.records_lost == 0
        assert watch.sidecar.pipeline.apply_errors == 0
    finally:
        pair.stop()
        watch.stop()


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 255) for _ in range(n)]


def check_pair(rooms: dict, room: int, tokens: int) -> tuple[wire.XferDigest, wire.XferDigest]:
    assert set(rooms.get(room, {})) == {"sender", "receiver"}, rooms.get(room)
    s, r = rooms[room]["sender"], rooms[room]["receiver"]
    for x in (s, r):
        assert (x.token_start, x.token_end) == (0, tokens)
        assert (x.layers, x.head_start, x.head_count, x.total_heads) == (LAYERS, 0, KV_HEADS, KV_HEADS)
        assert x.alg == wire.DigestAlg.XXH3_HEAD_STREAMS  # CPU pools
        assert x.req_key == s.req_key
    return s, r


def test_normal_transfers_digests_match_and_nothing_is_reported(pd):
    pair, watch = pd
    rng = random.Random(1)
    lengths = (3, 64, 150, 233, 17)  # under a page .. four 64-token chunks
    results = [pair.generate(prompt(rng, n), tenant="acme", max_new_tokens=4) for n in lengths]
    for r, n in zip(results, lengths):
        assert r.ok and r.prompt_tokens == n, r.summary()
    rooms = watch.digests()
    for r, n in zip(results, lengths):
        s, d = check_pair(rooms, r.room, n)
        assert s.digest == d.digest, (n, hex(s.digest), hex(d.digest))
    assert len({rooms[r.room]["sender"].digest for r in results}) == len(results)  # different KV, different digests
    # the longer prompts really went out in several chunks (the streaming sender digest)
    chunks = {n: watch.sends[r.room] for r, n in zip(results, lengths)}
    assert chunks[3] == [(0, 3)], chunks
    for n in (150, 233):
        starts, ends = [a for a, _ in chunks[n]], [b for _, b in chunks[n]]
        assert len(chunks[n]) >= 2 and starts == [0] + ends[:-1] and ends[-1] == n, chunks
    assert watch.memory.findings == [], [f.to_dict() for f in watch.memory.findings]
    # both engines hashed with the compiled routine (`make test` builds it), not the numpy path
    for engine in (pair.prefill, pair.decode):
        lines = [ln for ln in engine.log_path.read_text(errors="replace").splitlines() if "transfer digests:" in ln]
        assert lines and all("libkvguard_digest" in ln and "in place" in ln for ln in lines), lines


def test_flipped_received_page_digests_differ_for_that_room_only(pd):
    pair, watch = pd
    rng = random.Random(2)
    watch.settle()
    mark = len(watch.memory.findings)
    before = pair.generate(prompt(rng, 90), tenant="acme", max_new_tokens=4)
    rid = make_rid("flip_received_page", "r", "1")
    flipped = pair.generate(prompt(rng, 90), tenant="globex", max_new_tokens=4, rid=rid)
    after = pair.generate(prompt(rng, 90), tenant="acme", max_new_tokens=4)
    for r in (before, after):
        assert r.ok and r.prompt_tokens == 90, r.summary()
    # decode's guard failed it before any decode step: an error, no token
    assert not flipped.ok and flipped.decode_status == 500 and not flipped.output_ids, flipped.summary()
    assert "differs from what prefill sent" in flipped.error, flipped.error
    t_end = time.monotonic() + WAIT_S
    while not watch.events("flipped") and time.monotonic() < t_end:
        time.sleep(0.05)
    (ev,) = watch.events("flipped")
    assert ev["rid"] == rid and ev["room"] == flipped.room and ev["byte_before"] != ev["byte_after"]
    assert ev["row_page_index"] == 1 and ev["position"] == PAGE
    rooms = watch.digests()
    s, d = check_pair(rooms, flipped.room, 90)
    assert s.digest != d.digest
    assert s.req_key == wire.request_key(rid)
    for r in (before, after):
        same_s, same_d = check_pair(rooms, r.room, 90)
        assert same_s.digest == same_d.digest
    # the sidecar pairs the two ends: one checksum_mismatch naming the request, its
    # reserved pages (the flipped one among them: one digest per transfer cannot say
    # which page), both digests and what the guard did; nothing else
    # (the recorder holds what the sidecar read; applying it can trail under load: the rings are
    # merged in time order, and a record waits for the other rings to catch up)
    t_end = time.monotonic() + WAIT_S
    while "checksum_mismatch" not in {f.kind for f in watch.memory.findings[mark:]} and time.monotonic() < t_end:
        time.sleep(0.05)
    watch.settle()
    found = watch.memory.findings[mark:]
    assert [f.kind for f in found if f.kind != "orphan_transfer"] == ["checksum_mismatch"], [f.to_dict() for f in found]
    found = [f for f in found if f.kind == "checksum_mismatch"]
    f = found[0]
    assert f.severity == "critical" and f.engine.role == "decode"
    assert (f.reader.rid, f.reader.tenant, f.reader.bootstrap_room) == (rid, "globex", flipped.room)
    assert ev["page"] in f.pages and len(f.pages) == 90 // PAGE + 1
    assert f.evidence["sender_digest"] == f"{s.digest:016x}" and f.evidence["receiver_digest"] == f"{d.digest:016x}"
    assert f.evidence["sender_tokens"] == [0, 90] and f.evidence["receiver_tokens"] == [0, 90]
    assert f.evidence["action"] == "aborted" and "before its first decode step" in f.summary
    assert watch.sidecar.pipeline_stats().guard_aborts["checksum_mismatch"] == 1


def test_the_guard_fails_a_send_of_fewer_pages_than_decode_reserved(pd):
    pair, watch = pd
    rng = random.Random(3)
    watch.settle()
    mark = len(watch.memory.findings)
    rid = make_rid("send_truncated", "g", "1")
    short = pair.generate(prompt(rng, 200), tenant="initech", max_new_tokens=8, rid=rid)
    after = pair.generate(prompt(rng, 90), tenant="acme", max_new_tokens=4)
    # the client gets decode's error, not tokens computed over 49 pages nobody wrote
    assert not short.ok and short.decode_status == 500 and not short.output_ids, short.summary()
    assert "KVTransferError" in short.error or "Failed to get kvcache" in short.error, short.error
    assert after.ok and after.prompt_tokens == 90, after.summary()
    (init,) = [e for e in watch.events("sender_init") if e["rid"] == rid]
    assert (init["engine_pages"], init["pages"], init["room"]) == (50, 1, short.room)
    log = pair.prefill.log_path.read_text(errors="replace")
    assert "kvguard guard: KVGUARD_GUARD=full: transfer invariants and the read check" in log
    assert (
        f"request {rid} (bootstrap room {short.room}): prefill was about to send 1 KV page(s) where decode reserved 50"
        in log
    )
    watch.settle()
    found = watch.memory.findings[mark:]
    kinds = sorted(f.kind for f in found if f.kind != "orphan_transfer")
    assert kinds == ["transfer_size_mismatch"], [f.to_dict() for f in found]
    (prevented,) = [f for f in found if f.kind == "transfer_size_mismatch"]
    assert prevented.engine.role == "prefill" and prevented.severity == "critical"
    assert (prevented.reader.rid, prevented.reader.tenant, prevented.reader.bootstrap_room) == (
        rid,
        "initech",
        short.room,
    )
    assert prevented.exposed == [] and prevented.evidence["action"] == "aborted"
    assert prevented.evidence["rule"] == "send_size" and prevented.evidence["reserved_pages"] == 50
    assert (prevented.evidence["prompt_tokens"], prevented.evidence["sent_tokens"]) == (200, PAGE)
    assert watch.sidecar.pipeline_stats().guard_aborts["transfer_size_mismatch"] >= 1


def test_a_transfer_after_decodes_own_cached_prefix_is_judged_from_where_it_starts(pd):
    """Decode's radix cache holds a 64-token prefix: it reserves, and prefill sends, only
    what follows. The sidecar counts the transfer's rows from the reservation's start (no
    false unwritten_read), both ends' digests cover the same tokens after the prefix, and
    the guard's page-count and digest rules agree: nothing is reported, nothing aborted."""
    pair, watch = pd
    rng = random.Random(4)
    watch.settle()
    mark = len(watch.memory.findings)
    prefix = prompt(rng, 64)
    results = [pair.generate(prefix + prompt(rng, 10 + i), tenant="acme", max_new_tokens=4) for i in range(3)]
    for r in results:
        assert r.ok and r.completion_tokens == 4, r.summary()
    rooms = watch.digests()
    later = [rooms[r.room] for r in results[1:]]
    # decode served the later two from its own cache: their transfers start at the prefix
    for r, ends in zip(results[1:], later):
        s, d = ends["sender"], ends["receiver"]
        assert (s.token_start, s.token_end) == (d.token_start, d.token_end) == (64, r.prompt_tokens), (s, d)
        assert s.digest == d.digest
    found = watch.memory.findings[mark:]
    assert found == [], [f.to_dict() for f in found]
    log = pair.decode.log_path.read_text(errors="replace") + pair.prefill.log_path.read_text(errors="replace")
    guarded = [ln for ln in log.splitlines() if "kvguard guard: request" in ln]
    assert not [ln for ln in guarded for r in results if f"(bootstrap room {r.room})" in ln], guarded

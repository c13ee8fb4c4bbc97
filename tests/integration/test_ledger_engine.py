"""The incident across two pods on the real engine: the shared (Redis) ledger lets decode's sidecar catch it.

A real SGLang 0.5.19 prefill/decode pair (Mooncake over TCP, CPU) behind SGLang's
router, with each engine's ring in its own directory, as in a multi-pod deployment, and
one sidecar per directory; the two sidecars share only a real redis-server. Clients send
no rid (each engine draws its own), so the two pods' facts meet in Redis by room alone.
Before the shared ledger, decode's sidecar could not pair the transfer (no prefill in
view) and counted it as unverified: the leak went unseen. ~1-2 minutes.
"""

from __future__ import annotations

import time

import pytest

from kvguard.demo.engines import PDPair
from kvguard.demo.scenario import run_incident_scenario
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink

pytestmark = [pytest.mark.engine, pytest.mark.timeout(420)]


class TwoPodPair(PDPair):
    """A PDPair whose prefill and decode write their rings into different directories."""

    def __init__(self, version: str, log_dir, ring_dirs: dict[str, str], **kwargs):
        super().__init__(version, None, log_dir, **kwargs)
        self.ring_dirs = ring_dirs

    def _start(self, role, pool_tokens, args, wait):
        self.ring_dir = self.ring_dirs[role]
        return super()._start(role, pool_tokens, args, wait)


def test_the_0_5_19_leak_across_two_pods_is_caught_by_the_decode_sidecar(
    tmp_path,
    redis_server,
    require_sglang,
):
    require_sglang("0.5.19")
    dirs = {role: tmp_path / role for role in ("prefill", "decode")}
    for d in dirs.values():
        d.mkdir()
    sinks = {role: MemorySink() for role in dirs}
    sidecars = {
        role: Sidecar(
            str(d), sinks=[sinks[role]], remove_dead_rings=False, ledger=redis_server.url, ledger_cluster="pd-test"
        ).start()
        for role, d in dirs.items()
    }
    try:
        with TwoPodPair("0.5.19", tmp_path / "logs", ring_dirs={k: str(v) for k, v in dirs.items()}) as pair:
            scenario = run_incident_scenario(pair)
            deadline = time.monotonic() + 30  # the decode sidecar pairs through Redis within a few cycles
            while time.monotonic() < deadline and "checksum_mismatch" not in {f.kind for f in sinks["decode"].findings}:
                time.sleep(0.2)
    finally:
        for s in sidecars.values():
            s.stop()
    long = scenario.long.result
    assert long.ok and long.prompt_tokens == 600  # what a status-code check sees: success
    assert long.routed and long.room is None  # decode's rid came back; the router chose the room

    decode = sorted(f.kind for f in sinks["decode"].findings)
    assert decode == ["checksum_mismatch", "pool_smaller_than_context", "transfer_size_mismatch", "unwritten_read"], [
        f.to_dict() for f in sinks["decode"].findings
    ]
    # the prefill pod's sidecar only published: its own engine's config finding, no transfer finding
    assert sorted(f.kind for f in sinks["prefill"].findings) == ["pool_smaller_than_context"]
    rooms, sender_rids = set(), set()
    for f in sinks["decode"].findings:
        if f.kind != "pool_smaller_than_context":
            assert (f.reader.rid, f.reader.tenant) == (long.rid, "initech")
            rooms.add(f.reader.bootstrap_room)
            # the prefill pod's own rid for the room, learnt through Redis
            sender_rids.add(f.evidence.get("sender_rid"))
    assert len(rooms) == 1 and None not in rooms
    assert len(sender_rids) == 1 and not sender_rids & {None, long.rid}
    size = next(f for f in sinks["decode"].findings if f.kind == "transfer_size_mismatch")
    assert {k: size.evidence[k] for k in ("sent_tokens", "reserved_tokens", "sent_pages", "reserved_pages")} == {
        "sent_tokens": 1,
        "reserved_tokens": 600,
        "sent_pages": 1,
        "reserved_pages": 150,
    }
    read = next(f for f in sinks["decode"].findings if f.kind == "unwritten_read")
    # whose KV the stale pages held: the earlier requests of acme and globex, and sometimes (about
    # 1 run in 3, more under load) a request with no tenant that decode also served between them
    # (seen: a router-generated rid with no extra_key; its KV is as exposed as theirs, just unlabelled)
    assert len(read.pages) == 149 and read.exposed, read.to_dict()
    exposed = [(p.rid, p.tenant, len(p.pages)) for p in read.exposed]
    assert {p.tenant for p in read.exposed} <= {"acme", "globex", ""}, exposed
    assert {"acme", "globex"} & {p.tenant for p in read.exposed}, exposed
    assert not any(p.rid.startswith("key:") for p in read.exposed), exposed  # every one a request decode saw begin
    ledger = sidecars["decode"].pipeline.ledger
    assert ledger.unverified == 0 and ledger.paired >= 9  # 8 normal transfers and the incident's
    # a Redis round trip may time out (1 s) on a starved 2-core machine: seen once in CI, 2 of
    # them, with a vLLM pair spinning beside this test. The link retries; the verdicts above,
    # every transfer paired through Redis, are what the test is about
    link = sidecars["decode"].shared_ledger
    print(f"  decode's ledger link: {link.errors} failed round trips")
    assert link.bad_facts == 0

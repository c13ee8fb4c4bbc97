"""The shared ledger's store protocol (sidecar/ledger/shared.py, schema v3) against real stores:
a single redis-server and a Redis Cluster of 3 masters + 3 replicas (tests/support/redis_cluster.py).

Two ``SharedLedger`` links stand for a prefill pod's sidecar (it publishes sender facts) and a
decode pod's (it publishes receiver facts and waits on the room's senders); their threads run
for real. What is checked is what the decode side is handed (``take_results``) and what the
store holds and counted. Waits poll a condition with a deadline; nothing here is timed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvguard.sidecar.ledger.shared import SharedLedger, inbox_key, room_key

FOREVER = 1 << 62  # a watch that only an unwatch ends
# the client requests the ledger sends (commands its Lua scripts run inside count apart)
REQUESTS = ("evalsha", "eval", "xread", "xtrim", "ping")


def wait_for(cond: Callable[[], bool], limit_s: float = 20.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > deadline:
            return cond()
        time.sleep(0.01)
    return True


def sender_fact(chunks=(), began=True, rid="r", gave_up="", ended=False) -> dict:
    return {
        "began": began,
        "warmup": False,
        "gave_up": gave_up,
        "ended": ended,
        "rid": rid,
        "tenant": "acme",
        "chunks": [list(c) for c in chunks],
        "digests": [],
    }


def receiver_fact(tokens=8) -> dict:
    return {"reserved_tokens": tokens, "reserved_pages": 2, "status": 0, "digests": []}


@dataclass
class Store:
    kind: str
    url: str
    client: Any  # a redis client reading what the ledger wrote
    masters_info: Callable[[], list[dict]]
    cluster: Any = None

    def requests(self) -> dict[str, int]:
        """Calls per command of the ledger's kind, summed over the masters (INFO commandstats)."""
        out = dict.fromkeys(REQUESTS, 0)
        for info in self.masters_info():
            for name in REQUESTS:
                out[name] += info.get(f"cmdstat_{name}", {}).get("calls", 0)
        return out


@pytest.fixture(params=["redis", "cluster"])
def store(request):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        yield Store("redis", server.url, server.client(), lambda: [server.client().info("commandstats")])
        return
    from redis.cluster import ClusterNode, RedisCluster

    cluster = request.getfixturevalue("redis_cluster")
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in cluster.nodes], socket_timeout=2)
    yield Store("cluster", cluster.url, client, lambda: cluster.info("commandstats"), cluster)
    client.close()


class Pair:
    """A prefill pod's link and a decode pod's, under a ledger cluster name of the test's own
    (tests share the session's Redis Cluster)."""

    def __init__(self, url: str, **kwargs):
        self.name = f"t{uuid.uuid4().hex[:10]}"
        opts = {"poll_interval_s": 0.02, **kwargs}
        self.sender = SharedLedger(url, cluster=self.name, pod="prefill-0", **opts).start()
        self.receiver = SharedLedger(url, cluster=self.name, pod="decode-0", **opts).start()
        self.got: dict[int, list[dict]] = {}  # room -> the senders' facts last handed to decode
        self.handed = 0

    def collect(self) -> None:
        for room, side, facts in self.receiver.take_results():
            assert side == "sender"
            self.got[room] = facts
            self.handed += 1

    def reserve(self, room: int, req_key: int) -> None:
        self.receiver.publish("receiver", room, req_key, receiver_fact())
        self.receiver.watch(room, "sender", FOREVER)

    def send(self, room: int, req_key: int, chunks=((0, 8, 1, 2),), **kw) -> None:
        self.sender.publish("sender", room, req_key, sender_fact(chunks, **kw))

    def has(self, room: int, req_key: int, chunks=None, last=True) -> bool:
        """decode was handed this sending request's facts of the room (with its last chunk / these chunks)."""
        self.collect()
        for f in self.got.get(room, []):
            if f["req_key"] == f"{req_key:016x}":
                if chunks is not None:
                    return f["chunks"] == [list(c) for c in chunks]
                return not last or any(c[2] for c in f["chunks"])
        return False

    def settled(self) -> bool:
        return not self.sender.pending_publishes and not self.receiver.pending_publishes

    def stop(self) -> None:
        self.sender.stop(flush_s=0.5)
        self.receiver.stop(flush_s=0.5)


def _pairs(url: str):
    made: list[Pair] = []

    def make(**kwargs) -> Pair:
        made.append(Pair(url, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.stop()


@pytest.fixture
def pair(store):
    """Pairs of links on the test's store: a single Redis, then the Redis Cluster."""
    yield from _pairs(store.url)


@pytest.fixture
def cluster_pair(redis_cluster):
    """Pairs of links on the Redis Cluster (for the tests that kill its nodes)."""
    yield from _pairs(redis_cluster.url)


def test_pairing_either_order_chunked_and_a_reused_room_number(store, pair):
    p = pair()
    # receiver first (decode reserved before prefill sent): the sender's write finds it and pushes
    p.reserve(1, 0xA1)
    assert wait_for(lambda: p.receiver.published >= 1)
    p.send(1, 0x51)
    assert wait_for(lambda: p.has(1, 0x51))
    assert p.sender.pushed >= 1
    # sender first: decode's own write is answered with what prefill wrote
    p.send(2, 0x52, chunks=[(0, 8, 1, 2)])
    assert wait_for(lambda: p.sender.published >= 2)
    pushed = p.sender.pushed
    p.reserve(2, 0xA2)
    assert wait_for(lambda: p.has(2, 0x52))
    assert p.sender.pushed == pushed  # nothing to push: the receiver read it in its reply
    # chunked: each snapshot of the sender's chunks reaches decode
    p.reserve(3, 0xA3)
    assert wait_for(lambda: p.receiver.published >= 3)
    p.send(3, 0x53, chunks=[(0, 4, 0, 1)])
    assert wait_for(lambda: p.has(3, 0x53, chunks=[(0, 4, 0, 1)]))
    p.send(3, 0x53, chunks=[(0, 4, 0, 1), (4, 8, 1, 1)])
    assert wait_for(lambda: p.has(3, 0x53, chunks=[(0, 4, 0, 1), (4, 8, 1, 1)]))
    # a room number reused after its first transfer was decided: the second pairs on its own
    p.reserve(4, 0xA4)
    p.send(4, 0x54)
    assert wait_for(lambda: p.has(4, 0x54))
    p.receiver.unwatch(4, "sender")
    assert wait_for(lambda: p.receiver.closed_rooms == 1)
    assert store.client.hkeys(room_key(p.name, 4)) == [f"d:{0x54:016x}".encode()]  # the first's tombstone
    p.got.pop(4)
    p.reserve(4, 0xB4)
    p.send(4, 0x64)
    assert wait_for(lambda: p.has(4, 0x64))
    assert [f["req_key"] for f in p.got[4]] == [f"{0x64:016x}"]  # the first sender's facts went with its key
    assert p.receiver.bad_facts == 0 and p.sender.errors == 0 and p.receiver.errors == 0


def test_a_decided_room_leaves_no_key_and_a_late_fact_does_not_bring_it_back(store, pair):
    p = pair(closed_ttl_s=2)
    p.reserve(7, 0xA7)
    assert wait_for(lambda: p.receiver.published >= 1)
    p.send(7, 0x57, chunks=[(0, 8, 0, 2)])  # after decode's: pushed to its inbox
    assert wait_for(lambda: p.has(7, 0x57, last=False))
    key = room_key(p.name, 7)
    assert 0 < store.client.ttl(key) <= 900  # the backstop for a room never decided
    p.receiver.unwatch(7, "sender")
    assert wait_for(lambda: p.receiver.closed_rooms == 1)
    # the facts are gone; a tombstone of the decided sending request stays for closed_ttl_s
    assert store.client.hkeys(key) == [f"d:{0x57:016x}".encode()] and 0 < store.client.ttl(key) <= 2
    # prefill writes again for the same request (its last chunk, after decode decided): not stored
    p.send(7, 0x57, chunks=[(0, 8, 0, 2), (8, 16, 1, 2)])
    assert wait_for(lambda: p.sender.late_dropped == 1)
    # decode's own later write for the decided request is not sent either
    p.receiver.publish("receiver", 7, 0xA7, receiver_fact())
    assert wait_for(p.settled)
    assert store.client.hkeys(key) == [f"d:{0x57:016x}".encode()]
    assert wait_for(lambda: not store.client.exists(key))  # and then nothing at all
    # the receiver's inbox lives while it reads it, with a TTL for when it no longer does
    assert 0 < store.client.ttl(inbox_key(p.name, "decode-0")) <= 900


def test_what_a_bundle_reads_of_a_room_is_what_each_pod_wrote(store, pair):
    """``kvguard bundle`` reads the incident's rooms from the store (sidecar/bundle.py
    ``add_shared_facts``): each side's pods and values, and a decided room's tombstone."""
    p = pair()
    p.reserve(5, 0xA5)
    p.send(5, 0x55)
    assert wait_for(lambda: p.has(5, 0x55) and p.settled())
    p.reserve(6, 0xA6)
    p.send(6, 0x56)
    assert wait_for(lambda: p.has(6, 0x56))
    p.receiver.unwatch(6, "sender")
    assert wait_for(lambda: p.receiver.closed_rooms == 1)
    live, decided, unknown = p.receiver.read_rooms([5, 6, 99])
    assert [pod for pod, _raw in live["sender"]] == ["prefill-0"]
    assert [pod for pod, _raw in live["receiver"]] == ["decode-0"]
    assert json.loads(live["sender"][0][1])["req_key"] == f"{0x55:016x}"
    assert decided == {"sender": [], "receiver": [], "decided": [f"{0x56:016x}"]}
    assert unknown == {"sender": [], "receiver": [], "decided": []}


def _run_transfers(p: Pair, rooms: range, wait_s: float) -> None:
    """Reserve every room, let decode wait ``wait_s``, then send and decide each."""
    for room in rooms:
        p.reserve(room, 0xA000 + room)
    assert wait_for(lambda: p.receiver.published >= rooms.stop - 1 and p.settled())
    time.sleep(wait_s)  # the transfers wait for their sender: what is measured is what waiting costs
    for room in rooms:
        p.send(room, 0x5000 + room)
    assert wait_for(lambda: all(p.has(room, 0x5000 + room) for room in rooms))
    for room in rooms:
        p.receiver.unwatch(room, "sender")
    assert wait_for(lambda: p.receiver.closed_rooms >= rooms.stop - 1 and p.settled())


def test_store_requests_per_transfer_do_not_grow_with_waiting(store, pair):
    """Polling read every waiting room every 50 ms (an HGETALL each): 20 transfers waiting 1.5 s
    cost 600 reads. Pushed, a transfer costs the same few requests however long it waits."""
    p = pair()
    n = 20
    before = store.requests()
    _run_transfers(p, range(1, n + 1), wait_s=0.0)
    quick = store.requests()
    _run_transfers(p, range(n + 1, 2 * n + 1), wait_s=1.5)
    waited = store.requests()

    def per_transfer(a, b) -> float:
        # the idle PINGs (every 5 s) and inbox XREAD timeouts (every 2 s) are a few per pod, not per room
        return sum(b[k] - a[k] for k in ("evalsha", "eval", "xread", "xtrim")) / n

    quick_ops, waited_ops = per_transfer(before, quick), per_transfer(quick, waited)
    print(f"  {store.kind}: {quick_ops:.2f} requests per transfer, {waited_ops:.2f} when each waited 1.5 s")
    assert quick_ops <= 6 and waited_ops <= quick_ops + 0.5


def test_a_killed_master_loses_no_pairing_outside_the_counted_window(redis_cluster, cluster_pair):
    """SIGKILL the master that serves decode's inbox (and a third of the rooms) while transfers are
    in flight, some of their last facts written just before: its replica takes over, and every
    transfer still reaches decode; what had to be sent again is counted."""
    p = cluster_pair()
    rooms = range(1, 31)
    for room in rooms:
        p.reserve(room, 0xA000 + room)
        p.send(room, 0x5000 + room, chunks=[(0, 4, 0, 1)])
    assert wait_for(lambda: all(p.has(room, 0x5000 + room, last=False) for room in rooms) and p.settled())
    for room in rooms[:15]:  # their last chunk in flight as the master dies
        p.send(room, 0x5000 + room)
    victim = redis_cluster.kill_master_and_wait_failover(inbox_key(p.name, "decode-0"))
    for room in rooms[15:]:
        p.send(room, 0x5000 + room)
    assert wait_for(lambda: all(p.has(room, 0x5000 + room) for room in rooms), limit_s=30)
    links = (p.sender, p.receiver)
    assert sum(link.errors for link in links) >= 1  # the dead master refused some round trips
    assert sum(link.resynced for link in links) >= 1  # and what it may have lost was sent again
    assert sum(link.stats().failovers for link in links) >= 1
    assert victim.port not in redis_cluster.master_ports()
    assert not p.receiver.degraded or wait_for(lambda: not p.receiver.degraded)


def test_a_cluster_with_a_shard_gone_degrades_and_pairing_resumes_when_it_returns(redis_cluster, cluster_pair):
    """A master and its replica both gone: the cluster refuses every command (its slots are not
    covered), the links go degraded, facts wait in the outbox; restarted (empty: no persistence),
    the receiver registers its rooms again and the sender's buffered facts pair."""
    p = cluster_pair(degrade_after_s=0.5)
    p.reserve(1, 0xA1)
    p.reserve(2, 0xA2)
    assert wait_for(lambda: p.receiver.published >= 2 and p.settled())
    master = redis_cluster.master_of(room_key(p.name, 1))
    replicas = [
        n for n in redis_cluster.nodes if n is not master and n.alive and redis_cluster.replica_of(n) == master.port
    ]
    for node in [master, *replicas]:
        redis_cluster.kill(node)
    p.send(1, 0x51)
    p.send(2, 0x52)
    assert wait_for(lambda: p.receiver.degraded and p.sender.degraded)
    assert p.sender.pending_publishes >= 1  # buffered, bounded
    redis_cluster.heal()
    assert wait_for(lambda: p.has(1, 0x51) and p.has(2, 0x52), limit_s=30)
    assert wait_for(lambda: not p.receiver.degraded and not p.sender.degraded)
    assert p.receiver.recoveries >= 1 and p.receiver.resynced >= 1


@pytest.fixture
def redis_sentinel(tmp_path):
    from tests.support.redis_cluster import ClusterStartError, RedisSentinel

    try:
        sentinel = RedisSentinel(tmp_path / "sentinel").start()
    except ClusterStartError as exc:
        pytest.fail(str(exc))
    yield sentinel
    sentinel.stop()


def test_pairing_through_sentinel_survives_a_failover(redis_sentinel):
    """``redis+sentinel://``: the links find the master through Sentinel, and after SENTINEL FAILOVER
    (the master demoted to a replica: its writes refused) they follow the new one."""
    made = _pairs(redis_sentinel.url)
    p = next(made)()
    try:
        p.reserve(1, 0xA1)
        p.send(1, 0x51)
        assert wait_for(lambda: p.has(1, 0x51))
        p.reserve(2, 0xA2)
        assert wait_for(lambda: p.receiver.published >= 2 and p.settled())
        before = redis_sentinel.master()
        redis_sentinel.failover()
        p.send(2, 0x52)
        p.reserve(3, 0xA3)
        p.send(3, 0x53)
        assert wait_for(lambda: p.has(2, 0x52) and p.has(3, 0x53), limit_s=30)
        assert redis_sentinel.master() != before
        assert sum(link.stats().failovers for link in (p.sender, p.receiver)) >= 1
    finally:
        next(made, None)

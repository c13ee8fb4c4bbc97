"""A throwaway real Redis Cluster: 3 masters + 3 replicas of Debian's redis-server, in a tmp dir.

Used by the ledger's cluster tests (tests/conftest.py makes it the session-scoped
``redis_cluster`` fixture) and by ``make fleet-sim`` (bench/fleet_sim.py). The nodes are
started the way users run a cluster (``cluster-enabled yes``, then ``redis-cli --cluster
create ... --cluster-replicas 1``), with no persistence and a short ``cluster-node-timeout``
so that a killed master's replica takes over in a couple of seconds instead of 15.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REDIS_SERVER = "/usr/bin/redis-server"
REDIS_CLI = "/usr/bin/redis-cli"
NODE_TIMEOUT_MS = 1000  # failure detection; the election adds up to ~1 s more


class ClusterStartError(RuntimeError):
    pass


def free_ports(n: int) -> list[int]:
    """``n`` free TCP ports whose +10000 cluster-bus ports are free too."""
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                s.close()
                continue
            with socket.socket() as bus:
                try:
                    bus.bind(("127.0.0.1", port + 10000))
                except OSError:
                    s.close()
                    continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class Node:
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class RedisCluster:
    """Six redis-server processes forming a cluster; nodes can be killed and restarted."""

    def __init__(self, workdir, masters: int = 3, replicas: int = 1, node_timeout_ms: int = NODE_TIMEOUT_MS):
        for binary in (REDIS_SERVER, REDIS_CLI):
            if not os.path.exists(binary):
                raise ClusterStartError(f"{binary} is missing: run `make apt` (installs redis-server; CI has it)")
        self.workdir = Path(workdir)
        self.node_timeout_ms = node_timeout_ms
        self.masters, self.replicas = masters, replicas
        self.nodes = [Node(p, self.workdir / str(p)) for p in free_ports(masters * (1 + replicas))]
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3])

    # ---------------------------------------------------------------- processes
    def _start_node(self, node: Node) -> None:
        node.workdir.mkdir(parents=True, exist_ok=True)
        node.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(node.port),
                "--bind",
                "127.0.0.1",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                str(self.node_timeout_ms),
                # a replica whose master is gone takes over however long it was cut off: the
                # tests kill masters on purpose and want the failover, not a stale-data guard
                "--cluster-replica-validity-factor",
                "0",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(node.workdir),
                "--enable-debug-command",
                "local",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _client(self, port: int, timeout_s: float = 1.0):
        import redis

        return redis.Redis(port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _wait(self, cond, what: str, limit_s: float = 30.0) -> None:
        deadline = time.monotonic() + limit_s
        while True:
            try:
                if cond():
                    return
            except Exception:  # noqa: BLE001 - a node not answering yet is "not yet"
                pass
            if time.monotonic() > deadline:
                raise ClusterStartError(f"redis cluster in {self.workdir}: {what} not within {limit_s:.0f} s")
            time.sleep(0.05)

    def start(self) -> RedisCluster:
        for node in self.nodes:
            self._start_node(node)
        for node in self.nodes:
            self._wait(lambda n=node: self._client(n.port).ping(), f"node {node.port} answering")
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        # with --cluster-replicas 1, redis-cli makes the first three the masters
        out = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            self.stop()
            raise ClusterStartError(f"redis-cli --cluster create failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        try:
            self.wait_healthy()
        except ClusterStartError:
            self.stop()
            raise
        return self

    def wait_healthy(self, limit_s: float = 30.0) -> None:
        """Every live node says cluster_state:ok, and every slot has a live master."""

        def ok() -> bool:
            for node in self.nodes:
                if node.alive and self._client(node.port).cluster("info").get("cluster_state") != "ok":
                    return False
            return len(self.master_ports()) == self.masters

        self._wait(ok, "cluster_state:ok on every node", limit_s)

    def master_ports(self) -> list[int]:
        """Ports of the live masters that serve slots, as a live node sees them."""
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                slots = self._client(node.port).execute_command("CLUSTER SLOTS")  # [[start, end, [host, port, id]...]]
            except Exception:  # noqa: BLE001
                continue
            live = {n.port for n in self.nodes if n.alive}
            return sorted({int(s[2][1]) for s in slots if int(s[2][1]) in live})
        return []

    def master_of(self, key: str) -> Node:
        """The node that serves ``key``'s slot now."""
        import redis

        for node in self.nodes:
            if not node.alive:
                continue
            slot = self._client(node.port).execute_command("CLUSTER KEYSLOT", key)
            for start, end, master, *_ in self._client(node.port).execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    port = int(master[1])
                    return next(n for n in self.nodes if n.port == port)
        raise redis.RedisError("no live node")

    def replica_of(self, node: Node) -> int | None:
        """The port of the master ``node`` replicates (None: it is a master)."""
        info = self._client(node.port).info("replication")
        return int(info["master_port"]) if info["role"] == "slave" else None

    def kill(self, node: Node) -> None:
        """SIGKILL: the master is gone without a word, as a crashed pod is."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait()

    def kill_master_and_wait_failover(self, key: str, limit_s: float = 30.0) -> Node:
        """Kill the master serving ``key`` and wait until its replica serves the slot."""
        victim = self.master_of(key)
        self.kill(victim)
        self._wait(
            lambda: self.master_of(key).port != victim.port and len(self.master_ports()) == self.masters,
            f"a replica taking over from {victim.port}",
            limit_s,
        )
        self.wait_healthy(limit_s)
        return victim

    def restart(self, node: Node) -> None:
        """Bring a killed node back: it rejoins (nodes.conf kept) as a replica of its successor."""
        self._start_node(node)
        self._wait(lambda: self._client(node.port).ping(), f"node {node.port} answering")
        self.wait_healthy()

    def heal(self) -> None:
        """Restart what a test killed (it rejoins as a replica) and wait for a healthy 3 + 3."""
        for node in self.nodes:
            if not node.alive:
                self._start_node(node)
        for node in self.nodes:
            self._wait(lambda n=node: self._client(n.port).ping(), f"node {node.port} answering")
        self.wait_healthy()

        def all_replicated() -> bool:
            roles = [self._client(n.port).info("replication") for n in self.nodes]
            return sum(r["role"] == "master" for r in roles) == self.masters and all(
                r.get("master_link_status", "up") == "up" for r in roles
            )

        self._wait(all_replicated, "every replica linked to its master")

    def info(self, section: str | None = None) -> list[dict]:
        """INFO of every live master (commandstats, cpu)."""
        out = []
        for port in self.master_ports():
            c = self._client(port)
            out.append(c.info(section) if section else c.info())
        return out

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _fields(entry) -> dict[str, str]:
    """One SENTINEL REPLICAS entry (redis-py gives a dict; RESP a flat name, value, ... list) as str."""
    pairs = entry.items() if isinstance(entry, dict) else zip(entry[::2], entry[1::2])
    text = lambda v: v.decode() if isinstance(v, bytes) else str(v)
    return {text(k): text(v) for k, v in pairs}


class RedisSentinel:
    """A master, its replica and one Sentinel watching them (Debian's redis-server --sentinel)."""

    def __init__(self, workdir, name: str = "kvguard"):
        self.workdir = Path(workdir)
        self.name = name
        self.master_port, self.replica_port, self.sentinel_port = free_ports(3)
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{name}"
        self.procs: list[subprocess.Popen] = []

    def _redis(self, port: int, *extra: str) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs.append(
            subprocess.Popen(
                [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                + ["--dir", str(d), *extra],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )

    def start(self) -> RedisSentinel:
        import redis

        self._redis(self.master_port)
        self._redis(self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port))
        conf = self.workdir / "sentinel.conf"  # Sentinel rewrites its file: one of its own
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.workdir}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {self.name} 1000\nsentinel failover-timeout {self.name} 5000\n"
        )
        self.procs.append(
            subprocess.Popen(
                [REDIS_SERVER, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        sentinel = redis.Redis(port=self.sentinel_port, socket_timeout=1)

        def ready() -> bool:
            # Sentinel must have heard the replica itself (not only of it, from the master's INFO):
            # until then it finds no replica it may promote (NOGOODSLAVE)
            replicas = [_fields(r) for r in sentinel.execute_command("SENTINEL", "REPLICAS", self.name)]
            link = redis.Redis(port=self.replica_port, socket_timeout=1).info("replication")
            return (
                any(r.get("flags") == "slave" and r.get("master-link-status") == "ok" for r in replicas)
                and link.get("master_link_status") == "up"
            )

        deadline = time.monotonic() + 30
        while True:
            try:
                if ready():
                    return self
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterStartError("redis sentinel: master, replica and sentinel not ready within 30 s")
            time.sleep(0.1)

    def master(self) -> tuple[str, int]:
        import redis

        host, port = redis.Redis(port=self.sentinel_port, socket_timeout=1).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.name
        )
        return host.decode(), int(port)

    def failover(self, limit_s: float = 30.0) -> None:
        """SENTINEL FAILOVER: the replica is promoted, the old master becomes its replica."""
        import redis

        before = self.master()
        deadline = time.monotonic() + limit_s
        while True:  # NOGOODSLAVE: Sentinel has not refreshed the replica's state yet (it asks every 10 s)
            try:
                redis.Redis(port=self.sentinel_port, socket_timeout=2).execute_command(
                    "SENTINEL", "FAILOVER", self.name
                )
                break
            except redis.ResponseError as exc:
                if "NOGOODSLAVE" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        old = redis.Redis(port=before[1], socket_timeout=1)
        # done when Sentinel names the other one and the old master has been made its replica
        while self.master() == before or old.info("replication")["role"] != "slave":
            if time.monotonic() > deadline:
                raise ClusterStartError(f"redis sentinel: no failover within {limit_s} s")
            time.sleep(0.1)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

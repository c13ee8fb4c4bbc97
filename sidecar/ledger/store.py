"""Where the shared ledger lives: one Redis, a Sentinel-managed master, or a Redis Cluster.

``parse_target`` reads the ``--ledger`` URL (a bad one raises LedgerConfigError naming the
flag and the value); ``open_store`` makes a :class:`Store` for it. A store runs a batch of
commands pipelined, one round trip per node that serves their keys, and hands back each
command's reply or the exception it met, so that one shard failing over does not hold up
the others. Every key the ledger writes carries a hash tag, so a command's keys are always
in one slot, and the Lua scripts (EVALSHA, EVAL once after a NOSCRIPT: a new or failed-over
node starts with an empty script cache) run on the node that serves that slot.

Clients are made on the ledger's own threads (``connect``), never on the ingest thread and
never at start-up: a cluster client reads the slot map when made, and a sidecar starts (and
stays degraded) while the store is away.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_PORT = {"redis": 6379, "cluster": 6379, "sentinel": 26379}
SCHEMES = {
    "redis": ("redis", False),
    "rediss": ("redis", True),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
FORMS = "'memory', redis://HOST:PORT/DB, redis+cluster://HOST:PORT[,HOST:PORT...] or redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]"


class LedgerConfigError(ValueError):
    pass


@dataclass(frozen=True)
class LedgerTarget:
    """A parsed ``--ledger`` URL."""

    kind: str  # "redis" (one server), "cluster" or "sentinel"
    url: str  # as given
    hosts: tuple[tuple[str, int], ...]  # the server; the cluster's seed nodes; the sentinels
    db: int = 0
    master: str = ""  # the master's name the sentinels know it by
    tls: bool = False
    username: str | None = None
    password: str | None = None  # from the URL (deployments put it in KVGUARD_LEDGER_PASSWORD instead)

    @property
    def display(self) -> str:
        """The URL without any password (logs, findings, exit messages)."""
        scheme = self.url.partition("://")[0]
        hosts = ",".join(f"{h}:{p}" if ":" not in h else f"[{h}]:{p}" for h, p in self.hosts)
        if self.kind == "cluster":
            return f"{scheme}://{hosts}"
        if self.kind == "sentinel":
            return f"{scheme}://{hosts}/{self.master}/{self.db}"
        return f"{scheme}://{hosts}/{self.db}"


def _host_port(item: str, default_port: int, flag: str, value: str) -> tuple[str, int]:
    if item.startswith("["):  # [v6 address]:port
        host, sep, rest = item[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise LedgerConfigError(f"{flag}: bad address {item!r} in {value!r}")
        port_s = rest[1:]
    else:
        host, _, port_s = item.partition(":")
    if not host:
        raise LedgerConfigError(f"{flag}: no host in {value!r}")
    if not port_s:
        return host, default_port
    if not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise LedgerConfigError(f"{flag}: bad port {port_s!r} in {value!r}")
    return host, int(port_s)


def parse_target(value: str, flag: str = "--ledger") -> LedgerTarget | None:
    """``memory`` (or empty) -> None; else the store the URL names. A bad value raises
    LedgerConfigError naming ``flag`` and the value."""
    value = (value or "").strip()
    if value in ("", "memory"):
        return None
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in SCHEMES:
        raise LedgerConfigError(f"{flag}: expected {FORMS}, got {value!r}")
    kind, tls = SCHEMES[scheme]
    if kind == "redis":
        return _parse_standalone(value, flag, tls)
    netloc, _, path = rest.partition("/")
    if "?" in rest or "#" in rest:
        raise LedgerConfigError(f"{flag}: no query or fragment expected in {value!r}")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, has_pw, pw = userinfo.partition(":")
        username, password = (user or None, pw) if has_pw else (None, user)
    if not netloc:
        raise LedgerConfigError(f"{flag}: no host in {value!r}")
    hosts = tuple(_host_port(h, DEFAULT_PORT[kind], flag, value) for h in netloc.split(","))
    if kind == "cluster":
        if path not in ("", "0"):  # a cluster has database 0 only
            raise LedgerConfigError(f"{flag}: a Redis Cluster has no database {path!r} (only 0) in {value!r}")
        return LedgerTarget(kind, value, hosts, 0, "", tls, username, password)
    master, _, db_s = path.partition("/")
    if not master:
        raise LedgerConfigError(f"{flag}: no master name (redis+sentinel://HOST:PORT/MASTER) in {value!r}")
    db_s = db_s.strip("/") or "0"
    if not db_s.isdigit():
        raise LedgerConfigError(f"{flag}: database must be a number, got {db_s!r} in {value!r}")
    return LedgerTarget(kind, value, hosts, int(db_s), master, tls, username, password)


def _parse_standalone(value: str, flag: str, tls: bool) -> LedgerTarget:
    from urllib.parse import urlparse

    try:
        url = urlparse(value)
        port = url.port
    except ValueError as exc:
        raise LedgerConfigError(f"{flag}: {exc} in {value!r}") from exc
    if not url.hostname:
        raise LedgerConfigError(f"{flag}: no host in {value!r}")
    db = url.path.lstrip("/") or "0"
    if not db.isdigit():
        raise LedgerConfigError(f"{flag}: database must be a number, got {db!r} in {value!r}")
    if port is not None and not 0 < port < 65536:
        raise LedgerConfigError(f"{flag}: bad port in {value!r}")
    return LedgerTarget("redis", value, ((url.hostname, port or 6379),), int(db), "", tls, url.username, url.password)


# ---------------------------------------------------------------------------------- scripts
@dataclass(frozen=True)
class Script:
    body: str

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.body.encode()).hexdigest()

    def cmd(self, key: str, *argv) -> tuple[str, tuple]:
        """(the key that routes it, the EVALSHA command)."""
        return key, ("EVALSHA", self.sha, 1, key, *argv)


# Write one side's facts of a room and answer with the other side's, atomically: whichever
# side writes second sees the first. ARGV: own field ("s:POD" / "r:POD"), own facts (""
# = only "I wait here"), TTL seconds, the other side's field prefix, and for a sender its
# request key: a room whose receiver decided on that sending request keeps a tombstone
# ("d:REQ") for a while, and a late fact of it is not written (it would leave a key nobody
# reads until the TTL). A sender needs only the receivers' names (whose inbox to push to);
# a receiver gets the senders' facts.
PUBLISH = Script(
    """
if ARGV[5] ~= "" and redis.call("HEXISTS", KEYS[1], "d:" .. ARGV[5]) == 1 then return false end
if ARGV[2] == "" then redis.call("HSETNX", KEYS[1], ARGV[1], "") else redis.call("HSET", KEYS[1], ARGV[1], ARGV[2]) end
redis.call("EXPIRE", KEYS[1], ARGV[3])
local out, n = {}, string.len(ARGV[4])
local all = redis.call("HGETALL", KEYS[1])
for i = 1, #all, 2 do
  if string.sub(all[i], 1, n) == ARGV[4] then
    out[#out + 1] = all[i]
    if ARGV[4] == "s:" then out[#out + 1] = all[i + 1] end
  end
end
return out
"""
)

# The receiver decided the room: drop its field; unless another receiver (a reused room
# number, another decode pod) still waits there, the key goes, and what is left is a
# tombstone naming the sending requests it decided on, for ARGV[2] seconds.
# ARGV: own field, tombstone TTL seconds, the decided sending requests' keys.
CLOSE = Script(
    """
redis.call("HDEL", KEYS[1], ARGV[1])
for _, f in ipairs(redis.call("HKEYS", KEYS[1])) do
  if string.sub(f, 1, 2) == "r:" then return 0 end
end
redis.call("DEL", KEYS[1])
if #ARGV > 2 then
  for i = 3, #ARGV do redis.call("HSET", KEYS[1], "d:" .. ARGV[i], "1") end
  redis.call("EXPIRE", KEYS[1], ARGV[2])
end
return 1
"""
)

# A sender's facts into a receiver pod's inbox (a stream, bounded by MAXLEN ~). The TTL is set
# only on a new stream: the living reader refreshes it; a dead pod's inbox expires.
# ARGV: maxlen, TTL seconds, room, the sender's field, its facts.
PUSH = Script(
    """
local id = redis.call("XADD", KEYS[1], "MAXLEN", "~", ARGV[1], "*", "room", ARGV[3], "field", ARGV[4], "fact", ARGV[5])
if redis.call("TTL", KEYS[1]) == -1 then redis.call("EXPIRE", KEYS[1], ARGV[2]) end
return id
"""
)

SCRIPTS = {s.sha: s for s in (PUBLISH, CLOSE, PUSH)}


# ---------------------------------------------------------------------------------- stores
def is_routing_error(reply) -> bool:
    """A reply that says the slot moved or the cluster is between two states: refresh the map."""
    from redis.exceptions import AskError, ClusterDownError, MovedError, ReadOnlyError, TryAgainError

    return isinstance(reply, (MovedError, AskError, ClusterDownError, TryAgainError, ReadOnlyError))


class Store:
    """One kind of deployment; ``client_for(key)`` is the plain redis client that serves a key."""

    def __init__(self, target: LedgerTarget, timeout_s: float, password: str | None = None, client=None):
        self.target = target
        self.timeout_s = timeout_s
        self.password = password or target.password
        self.client: Any = client  # a ready client (tests); else made by connect()
        self.failovers = 0  # times the master serving some of our keys changed
        self._loaded: set[int] = set()  # node clients the scripts were loaded on

    def _kwargs(self) -> dict:
        kw: dict = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
        if self.password:
            kw["password"] = self.password
        if self.target.username:
            kw["username"] = self.target.username
        return kw

    def connect(self) -> None:
        import redis

        if self.client is None:
            self.client = redis.Redis.from_url(self.target.url, **self._kwargs())

    def client_for(self, key: str):
        return self.client

    def groups(self, cmds: list[tuple[str, tuple]]) -> list[tuple[Any, list[int]]]:
        return [(self.client, list(range(len(cmds))))]

    def refresh(self) -> None:
        """After a failed round trip: learn where the keys live now (nothing to learn for one server)."""

    def take_suspect(self):
        """A predicate: may the store have lost what was written under this key since the last call
        (its node failed, or its slot moved)? One server or one master: anything may have been."""
        return lambda _key: True

    def _failed(self, client, idxs: list[int], cmds, out: list) -> None:
        """Note what failed (ClusterStore: which nodes and slots)."""

    def ping(self) -> None:
        self.client.ping()

    def execute(self, cmds: list[tuple[str, tuple]]) -> list:
        """Each command's reply, or the exception it met (a refused node: every command it serves)."""
        from redis.exceptions import ConnectionError, NoScriptError, TimeoutError

        replies: list = [None] * len(cmds)
        try:
            groups = self.groups(cmds)
        except Exception as exc:  # noqa: BLE001 - e.g. a slot no live master serves (mid-failover)
            return [exc] * len(cmds)
        for client, idxs in groups:
            commands = [cmds[i][1] for i in idxs]
            first = id(client) not in self._loaded
            if first:  # the first contact with this node: load the scripts ahead of their first EVALSHA
                commands = [("SCRIPT", "LOAD", s.body) for s in SCRIPTS.values()] + commands
            out = self._run(client, commands)
            if first:
                out = out[len(SCRIPTS) :]
                if not any(isinstance(r, (ConnectionError, TimeoutError, OSError)) for r in out):
                    self._loaded.add(id(client))
            again = [(i, r) for i, r in zip(idxs, out) if isinstance(r, NoScriptError)]
            if again:  # a node that never ran the script (new, restarted, promoted): one EVAL loads it
                redo, loaded = [], set()
                for i, _ in again:
                    sha = cmds[i][1][1]
                    redo.append(cmds[i][1] if sha in loaded else ("EVAL", SCRIPTS[sha].body, *cmds[i][1][2:]))
                    loaded.add(sha)
                for (i, _), r in zip(again, self._run(client, redo)):
                    out[idxs.index(i)] = r
            for i, r in zip(idxs, out):
                replies[i] = r
            if any(isinstance(r, Exception) for r in out):
                self._failed(client, idxs, cmds, out)
        return replies

    @staticmethod
    def _run(client, commands: list[tuple]) -> list:
        pipe = client.pipeline(transaction=False)
        for c in commands:
            pipe.execute_command(*c)
        try:
            return pipe.execute(raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - the node is unreachable: every command failed
            return [exc] * len(commands)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass


class SentinelStore(Store):
    """The master a set of Sentinels names; a failover shows as a changed master address."""

    def __init__(self, target: LedgerTarget, timeout_s: float, password: str | None = None, client=None):
        super().__init__(target, timeout_s, password, client)
        self.sentinel: Any = None
        self.master_addr: tuple | None = None

    def connect(self) -> None:
        from redis.sentinel import Sentinel

        if self.client is not None:
            return
        skw: dict = {"socket_timeout": self.timeout_s, "socket_connect_timeout": self.timeout_s}
        sentinel_password = os.environ.get("KVGUARD_LEDGER_SENTINEL_PASSWORD")
        if sentinel_password:
            skw["password"] = sentinel_password
        if self.target.tls:
            skw["ssl"] = True
        self.sentinel = Sentinel(list(self.target.hosts), sentinel_kwargs=skw, **self._tls())
        self.master_addr = self.sentinel.discover_master(self.target.master)  # raises while none is known
        self.client = self.sentinel.master_for(self.target.master, db=self.target.db, **self._kwargs(), **self._tls())

    def _tls(self) -> dict:
        return {"ssl": True} if self.target.tls else {}

    def refresh(self) -> None:
        if self.sentinel is None:
            return
        self._saw(self.sentinel.discover_master(self.target.master))

    def _saw(self, addr) -> None:
        if addr is not None and self.master_addr is not None and addr != self.master_addr:
            self.failovers += 1
        self.master_addr = addr or self.master_addr

    def execute(self, cmds: list[tuple[str, tuple]]) -> list:
        replies = super().execute(cmds)
        # redis-py's Sentinel pool follows a failover by itself (a demoted master's READONLY is a
        # reconnect to the one Sentinel names): what it connected to last is the master now
        self._saw(getattr(self.client.connection_pool, "master_address", None))
        return replies


class ClusterStore(Store):
    """A Redis Cluster: commands grouped by the master serving their slot, one pipeline per node.

    redis-py's cluster pipeline refuses EVALSHA, so the grouping is done here, on redis-py's slot
    map (``NodesManager``: CLUSTER SLOTS, a plain client per node), refreshed after any refused
    node or MOVED/ASK/CLUSTERDOWN reply. Not ``RedisCluster`` itself: each one fetches and parses
    COMMAND when made, ~40 ms of CPU per sidecar thread for a routing table this code never uses."""

    def __init__(self, target: LedgerTarget, timeout_s: float, password: str | None = None, client=None):
        super().__init__(target, timeout_s, password, client)
        self._map: dict[int, str] = {}
        self._map_at_resync: dict[int, str] = {}  # the slot map when take_suspect last ran
        self._suspect_nodes: set[str] = set()
        self._suspect_slots: set[int] = set()
        self._clients: dict[str, Any] = {}  # node name -> its client, for the last batch

    def connect(self) -> None:
        from redis.cluster import ClusterNode, NodesManager

        if self.client is not None:
            return
        kwargs = self._kwargs()
        if self.target.tls:
            kwargs["ssl"] = True
        self.client = NodesManager(
            startup_nodes=[ClusterNode(h, p) for h, p in self.target.hosts],
            require_full_coverage=False,  # mid-failover some slots have no master yet: serve the rest
            **kwargs,
        )
        self._map = self._masters()
        self._map_at_resync = dict(self._map)

    def _masters(self) -> dict[int, str]:
        """slot -> the name of the master serving it."""
        return {slot: nodes[0].name for slot, nodes in self.client.slots_cache.items() if nodes}

    def _node_client(self, node):
        if node.redis_connection is None:
            self.client.create_redis_connections([node])
        return node.redis_connection

    def client_for(self, key: str):
        from redis.crc import key_slot

        return self._node_client(self.client.get_node_from_slot(key_slot(key.encode())))

    def groups(self, cmds: list[tuple[str, tuple]]) -> list[tuple[Any, list[int]]]:
        from redis.crc import key_slot

        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, (key, _c) in enumerate(cmds):
            node = self.client.get_node_from_slot(key_slot(key.encode()))
            by_node.setdefault(node.name, (node, []))[1].append(i)
        self._clients = {name: self._node_client(node) for name, (node, _i) in by_node.items()}
        return [(self._clients[name], idxs) for name, (_node, idxs) in by_node.items()]

    def refresh(self) -> None:
        if self.client is None:
            return
        # keep the connections that work: redis-py's default drops every pooled connection of the
        # node it asked, and a fleet of sidecars reconnecting at once is a storm of its own
        self.client.initialize(disconnect_startup_nodes_pools=False)
        new = self._masters()
        if any(new.get(slot) not in (None, name) for slot, name in self._map.items()):
            self.failovers += 1
        self._map = new

    def _failed(self, client, idxs: list[int], cmds, out: list) -> None:
        from redis.crc import key_slot
        from redis.exceptions import ConnectionError, TimeoutError

        for i, r in zip(idxs, out):
            if isinstance(r, (ConnectionError, TimeoutError, OSError)):
                name = next((n for n, c in self._clients.items() if c is client), None)
                if name is not None:
                    self._suspect_nodes.add(name)
            elif is_routing_error(r):
                self._suspect_slots.add(key_slot(cmds[i][0].encode()))

    def take_suspect(self):
        """The slots of the nodes that failed, and those whose master changed, since the last call."""
        from redis.crc import key_slot

        if self.client is None:
            return lambda _key: True
        old = self._map_at_resync
        slots = {slot for slot, name in old.items() if name in self._suspect_nodes or self._map.get(slot) != name}
        slots |= self._suspect_slots
        self._map_at_resync = dict(self._map)
        self._suspect_nodes.clear()
        self._suspect_slots.clear()
        return lambda key: key_slot(key.encode()) in slots

    def ping(self) -> None:
        for node in self.client.get_nodes_by_server_type("primary"):
            self._node_client(node).ping()

    def close(self) -> None:
        if self.client is not None:
            for node in list(self.client.nodes_cache.values()):
                if node.redis_connection is not None:
                    try:
                        node.redis_connection.close()
                    except Exception:  # noqa: BLE001
                        pass


def open_store(target: LedgerTarget, timeout_s: float, client=None) -> Store:
    """A store for ``target``; its clients are made by ``connect()`` on the thread that uses it.
    The password comes from $KVGUARD_LEDGER_PASSWORD (a Secret), else from the URL."""
    password = os.environ.get("KVGUARD_LEDGER_PASSWORD") or None
    cls = {"redis": Store, "cluster": ClusterStore, "sentinel": SentinelStore}[target.kind]
    return cls(target, timeout_s, password, client)

"""The shared transfer ledger in Redis: prefill and decode pods, each with its own sidecar.

Each sidecar publishes its side's facts per transfer and fetches the other side's;
the facts it fetches are applied to its in-memory ledger (sidecar/ledger/memory.py)
exactly like local records. Who raises what (so one incident is never raised by two
sidecars): the sidecar that sees the **receiver** (decode) owns every transfer finding
(transfer_size_mismatch, checksum_mismatch, orphan_transfer and the reads they
explain), because the pages are decode's. A sender's sidecar only publishes.

Keys: ``kvguard:ledger:v2:{cluster}:{room}:{side}``, a hash with one field per
publishing sidecar (its pod id) holding that sidecar's JSON facts for the side; every
write refreshes the key's TTL. ``cluster`` keeps two deployments that share one Redis
apart. The key holds only what both ends share, the ``bootstrap_room``: behind
SGLang's router a client that sends no rid gets a different rid on each engine, so a
rid-derived key would never meet its other half. Each fact carries its side's request
key (and the sender's rid and tenant, for reporting); the receiving sidecar uses it to
keep to one sending request when a room number was reused within the TTL
(sidecar/pipeline.py ``_apply_remote_sender``). A value that does not parse, has
another schema version ``v`` or contradicts its key is counted (``bad_facts``) and
ignored. (v1 keys also held the rid's hash; the two versions never pair.)

Threading: the ingest thread only calls the non-blocking ``publish`` / ``watch`` /
``unwatch`` (a bounded queue; a full queue drops and counts) and ``take_results``.
One background thread does all Redis I/O, one pipelined round trip per cycle: it
coalesces publishes per key into a bounded outbox that survives a Redis outage
(oldest dropped first, counted), and polls the watched keys of the other side.
Redis unreachable or slow (``socket_timeout``) for ``degrade_after_s`` in a row ->
``degraded``: one slow round trip on a loaded node (a 2-core machine running two engines
answered one poll after more than 0.5 s) is a retry, not an outage worth a finding. The
thread retries with backoff and flips back after the first good round trip.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict, deque
from urllib.parse import urlparse

from ..stats import SharedLedgerStats

log = logging.getLogger("kvguard.ledger")

SCHEMA = 2
KEY_PREFIX = "kvguard:ledger:v2"
MAX_LABEL_CHARS = 256  # a rid or tenant label in a fact
SIDES = ("sender", "receiver")
MAX_U64 = (1 << 64) - 1
IDLE_PING_NS = 5_000_000_000  # with nothing to publish or fetch, check Redis this often


class LedgerConfigError(ValueError):
    pass


def parse_ledger_url(value: str, flag: str = "--ledger") -> str | None:
    """``memory`` -> None; ``redis://host:port/db`` (or ``rediss://``) -> the URL. A bad value raises
    LedgerConfigError naming the flag and the value."""
    value = (value or "").strip()
    if value in ("", "memory"):
        return None
    try:
        url = urlparse(value)
        port = url.port
    except ValueError as exc:
        raise LedgerConfigError(f"{flag}: {exc} in {value!r}") from exc
    if url.scheme not in ("redis", "rediss"):
        raise LedgerConfigError(f"{flag}: expected 'memory' or redis://HOST:PORT/DB, got {value!r}")
    if not url.hostname:
        raise LedgerConfigError(f"{flag}: no host in {value!r}")
    db = url.path.lstrip("/") or "0"
    if not db.isdigit():
        raise LedgerConfigError(f"{flag}: database must be a number, got {db!r} in {value!r}")
    if port is not None and not 0 < port < 65536:
        raise LedgerConfigError(f"{flag}: bad port in {value!r}")
    return value


def room_key(cluster: str, room: int, side: str) -> str:
    return f"{KEY_PREFIX}:{cluster}:{room}:{side}"


def _hex_key(value) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def _label(value) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LABEL_CHARS


def valid_fact(fact, side: str, room: int) -> bool:
    """A fact as this version writes it, for the key it was read from."""
    if not isinstance(fact, dict) or fact.get("v") != SCHEMA or fact.get("side") != side:
        return False
    if fact.get("room") != room or not _hex_key(fact.get("req_key")):
        return False
    if side == "sender" and not (_label(fact.get("rid", "")) and _label(fact.get("tenant", ""))):
        return False
    from .digests import DigestSum

    digests = fact.get("digests", [])
    if not isinstance(digests, list) or not all(DigestSum.entry_ok(e) for e in digests):
        return False
    if side == "sender":
        chunks = fact.get("chunks", [])
        ok_chunks = isinstance(chunks, list) and all(
            isinstance(c, list)
            and len(c) == 4
            and all(type(v) is int and 0 <= v <= MAX_U64 for v in c)
            and c[0] <= c[1]
            for c in chunks
        )
        return (
            ok_chunks
            and isinstance(fact.get("began"), bool)
            and isinstance(fact.get("warmup"), bool)
            and isinstance(fact.get("ended"), bool)
            and fact.get("gave_up") in ("", "reject", "abort")
        )
    return type(fact.get("reserved_tokens")) is int and type(fact.get("status")) is int


def ping_ledger(url: str, timeout_s: float = 5.0) -> str | None:
    """One round trip to the shared ledger at ``url`` (``--ledger-required``): None when it
    answered, else why not (the URL shown without its password)."""
    import redis

    parsed = urlparse(url)
    shown = f"{parsed.scheme}://{parsed.hostname}:{parsed.port or 6379}{parsed.path or '/0'}"
    password = os.environ.get("KVGUARD_LEDGER_PASSWORD") or None
    client = redis.Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **({"password": password} if password else {})
    )
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001 - refused, timed out, auth, a non-Redis server: all "not reachable"
        return f"{shown}: {type(exc).__name__}: {exc}"
    finally:
        client.close()
    return None


class SharedLedger:
    def __init__(
        self,
        url: str,
        cluster: str = "default",
        pod: str | None = None,
        ttl_s: int = 900,
        max_outbox: int = 20_000,
        max_watch: int = 50_000,
        queue_size: int = 100_000,
        poll_interval_s: float = 0.05,
        timeout_s: float = 1.0,
        degrade_after_s: float = 2.0,
        client=None,
    ):
        import redis

        if not cluster or any(c in cluster for c in ": \n"):
            raise LedgerConfigError(f"--ledger-cluster: expected a name without ':' or spaces, got {cluster!r}")
        self.url = url
        parsed = urlparse(url)  # shown in logs and findings without any password
        self.display_url = f"{parsed.scheme}://{parsed.hostname}:{parsed.port or 6379}{parsed.path or '/0'}"
        self.cluster = cluster
        self.pod = pod or f"{socket.gethostname()}:{os.getpid()}"
        self.ttl_s = ttl_s
        # a password from the environment (a Secret), so that the URL in the ConfigMap carries none
        password = os.environ.get("KVGUARD_LEDGER_PASSWORD") or None
        self.client = client or redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            **({"password": password} if password else {}),
        )
        self.poll_interval_s = poll_interval_s
        self.degrade_after_ns = int(degrade_after_s * 1e9)
        self.max_outbox, self.max_watch = max_outbox, max_watch
        self._commands: queue.Queue = queue.Queue(maxsize=queue_size)
        self._results: deque = deque()  # (room, side, [facts]) for take_results
        self._outbox: OrderedDict[str, str] = OrderedDict()  # key -> JSON, newest snapshot per key
        self._watching: dict[str, list] = {}  # key -> [room, side, until_ns, last_raw]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.degraded = False
        self.last_error = ""
        self._last_io_ns = 0
        # counters (exported as metrics)
        self.errors = 0
        self.queue_dropped = 0
        self.outbox_dropped = 0
        self.published = 0
        self.fetched = 0
        self.bad_facts = 0
        self.recoveries = 0

    # ------------------------------------------------------------------ ingest thread (never blocks)
    def _put(self, item) -> None:
        try:
            self._commands.put_nowait(item)
        except queue.Full:
            self.queue_dropped += 1

    def publish(self, side: str, room: int, req_key: int, fact: dict) -> None:
        """This side's facts of a room; ``req_key`` is this side's own request key (its rid's hash)."""
        fact = {"v": SCHEMA, "side": side, "pod": self.pod, "room": room, "req_key": f"{req_key:016x}", **fact}
        self._put(("pub", room_key(self.cluster, room, side), json.dumps(fact, separators=(",", ":"))))

    def watch(self, room: int, side: str, until_ns: int) -> None:
        """Fetch the ``side`` facts of this room every cycle until ``until_ns`` (monotonic) or unwatch."""
        self._put(("watch", room_key(self.cluster, room, side), [room, side, until_ns, None]))

    def unwatch(self, room: int, side: str) -> None:
        self._put(("unwatch", room_key(self.cluster, room, side), None))

    def take_results(self) -> list[tuple[int, str, list[dict]]]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    @property
    def pending_publishes(self) -> int:
        return len(self._outbox) + self._commands.qsize()

    def stats(self) -> SharedLedgerStats:
        """The link's health (sidecar/stats.py): single reads of what the ledger's thread counts."""
        return SharedLedgerStats(
            degraded=self.degraded,
            errors=self.errors,
            queue_dropped=self.queue_dropped,
            outbox_dropped=self.outbox_dropped,
            bad_facts=self.bad_facts,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SharedLedger:
        self._thread = threading.Thread(target=self._run, name="kvguard-ledger", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_s: float = 2.0) -> None:
        """Stop the thread after one last attempt to publish what is buffered (bounded by flush_s)."""
        deadline = time.monotonic() + flush_s
        while self.pending_publishes and not self.degraded and time.monotonic() < deadline:
            time.sleep(self.poll_interval_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=flush_s + 5)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ background thread
    def _drain_commands(self) -> None:
        while True:
            try:
                op, key, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "pub":
                self._outbox[key] = arg
                self._outbox.move_to_end(key)
                while len(self._outbox) > self.max_outbox:
                    self._outbox.popitem(last=False)
                    self.outbox_dropped += 1
            elif op == "watch":
                if key in self._watching:
                    self._watching[key][2] = max(self._watching[key][2], arg[2])
                elif len(self._watching) < self.max_watch:
                    self._watching[key] = arg
            else:
                self._watching.pop(key, None)

    def _run(self) -> None:
        backoff = self.poll_interval_s
        failing_since_ns = 0  # first failure of the current run of failures; 0 while Redis answers
        while not self._stop.is_set():
            self._drain_commands()
            try:
                self._cycle()
            except Exception as exc:  # noqa: BLE001 - redis errors, timeouts, refused connections
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                now = time.monotonic_ns()
                failing_since_ns = failing_since_ns or now
                if not self.degraded and now - failing_since_ns < self.degrade_after_ns:
                    log.info("shared ledger %s: round trip failed (%s), retrying", self.display_url, self.last_error)
                    backoff = min(backoff * 2, 0.5)  # retried within the grace period
                    self._stop.wait(backoff)
                    continue
                if not self.degraded:
                    log.warning(
                        "shared ledger %s unreachable (%s): pairing with the other pod is degraded",
                        self.display_url,
                        self.last_error,
                    )
                self.degraded = True
                backoff = min(backoff * 2, 2.0)
                self._stop.wait(backoff)
                continue
            failing_since_ns = 0
            if self.degraded:
                self.degraded = False  # after the results of this good round trip were queued
                self.recoveries += 1
                log.warning("shared ledger %s reachable again: pairing resumes", self.display_url)
            backoff = self.poll_interval_s
            self._stop.wait(self.poll_interval_s)

    def _cycle(self) -> None:
        now = time.monotonic_ns()
        for key in [k for k, w in self._watching.items() if w[2] < now]:
            del self._watching[key]
        sending = list(self._outbox.items())
        watched = list(self._watching.items())
        if not sending and not watched:
            if self.degraded or now - self._last_io_ns >= IDLE_PING_NS:
                self.client.ping()  # is it (still / again) there? keeps kvguard_ledger_degraded honest when idle
                self._last_io_ns = now
            return
        self._last_io_ns = now
        pipe = self.client.pipeline(transaction=False)
        for key, value in sending:
            pipe.hset(key, self.pod, value)
            pipe.expire(key, self.ttl_s)
        for key, _w in watched:
            pipe.hgetall(key)
        replies = pipe.execute()
        for key, value in sending:
            if self._outbox.get(key) == value:  # not replaced by a newer snapshot meanwhile
                del self._outbox[key]
            self.published += 1
        for (key, w), raw in zip(watched, replies[2 * len(sending) :]):
            if not raw or raw == w[3]:
                continue
            w[3] = raw
            facts = []
            for field, value in raw.items():
                try:
                    fact = json.loads(value)
                except (ValueError, UnicodeDecodeError):
                    fact = None
                if valid_fact(fact, w[1], w[0]):
                    facts.append(fact)
                else:
                    self.bad_facts += 1
                    log.warning(
                        "shared ledger: ignoring a value in %s field %r that this version did not write",
                        key,
                        field[:64],
                    )
            if facts:
                self.fetched += 1
                self._results.append((w[0], w[1], facts))

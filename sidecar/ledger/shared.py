"""The shared transfer ledger in Redis: prefill and decode pods, each with its own sidecar.

Each sidecar publishes its side's facts per transfer; the facts the receiving sidecar gets
from the other side are applied to its in-memory ledger (sidecar/ledger/memory.py) exactly
like local records. Who raises what (so one incident is never raised by two sidecars): the
sidecar that sees the **receiver** (decode) owns every transfer finding
(transfer_size_mismatch, checksum_mismatch, orphan_transfer and the reads they explain),
because the pages are decode's. A sender's sidecar only publishes.

Pushed, not polled (schema v3; docs/architecture.md, "The shared ledger: pushed, not
polled"). A room is one hash, ``kvguard:ledger:v3:{CLUSTER:ROOM}``, with a field per side
and pod (``s:POD`` holds that prefill pod's JSON facts, ``r:POD`` that decode pod's); the
hash tag keeps a room in one Redis Cluster slot. Each write is one Lua script (store.py
``PUBLISH``) that sets the writer's field and the TTL and answers, atomically, with the other
side: whichever side writes second sees the first. A receiver writing second gets the
senders' facts in the reply; a sender writing second gets the receivers' pod ids and appends
its facts to each one's inbox, a Redis Stream ``kvguard:inbox:v3:{CLUSTER:POD}`` (``PUSH``:
XADD, MAXLEN ~ bound). Each receiving sidecar reads its own inbox with a blocking XREAD on
a connection of its own and trims what it read. When the receiver has decided a room
(``unwatch``, or its wait ran out) it deletes its field and, with no other receiver
waiting there, the key (``CLOSE``), leaving for ``closed_ttl_s`` (30 s) only a tombstone
naming the sending requests it decided on, so that a late fact of one of them is not
written (it would leave a key nobody reads); the TTL (900 s, refreshed on every write) is
only the backstop for rooms never decided.
The store operations per transfer are a constant: a few writes per side, a push per
sender write after the receiver came, a share of one XREAD, one close; none grows with
the time a transfer waits.

``cluster`` keeps two deployments that share one store apart. The key holds only what
both ends share, the ``bootstrap_room``: behind SGLang's router a client that sends no rid
gets a different rid on each engine, so a rid-derived key would never meet its other half.
Each fact carries its side's request key (and the sender's rid and tenant, for
reporting); the receiving sidecar uses it to keep to one sending request when a room
number was reused (sidecar/transfer_flow.py ``_apply_remote_sender``). A value that does
not parse, has another schema version ``v`` or contradicts its key is counted
(``bad_facts``) and ignored. Versions never pair: v1 keys also held the rid's hash, v2
keys were one per room and side, polled; a v2 and a v3 sidecar never see each other's facts.

Threading: the ingest thread only calls the non-blocking ``publish`` / ``watch`` /
``unwatch`` (a bounded queue; a full queue drops and counts) and ``take_results``. One
background thread does the writes: it coalesces publishes per room and side into a
bounded outbox that survives an outage (oldest dropped first, counted) and sends them
pipelined, one round trip per store node at most every ``poll_interval_s``; a receiving
sidecar has a second thread, blocked in XREAD on its inbox, that hands what arrives to the
first. An idle sidecar does nothing but a PING every 5 s (and an XREAD per
``inbox_block_s`` if it receives). Store unreachable or slow (``socket_timeout``) for
``degrade_after_s`` in a row -> ``degraded``: one slow round trip on a loaded node (a
2-core machine running two engines answered one poll after more than 0.5 s) is a retry,
not an outage worth a finding. The threads retry with backoff; the first good round trip
after failures re-registers every room the receiver waits on and re-publishes what this
sidecar wrote in the last ``resync_window_s`` (``resynced``): a master that fails over
may lose the writes it had acknowledged and not yet replicated, and this is what puts
them back. Redis Cluster (``redis+cluster://``) and Sentinel (``redis+sentinel://``)
deployments: sidecar/ledger/store.py.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from ..stats import SharedLedgerStats
from .store import CLOSE, PUBLISH, PUSH, LedgerConfigError, Store, is_routing_error, open_store, parse_target

log = logging.getLogger("kvguard.ledger")

__all__ = ["LedgerConfigError", "SharedLedger", "parse_ledger_url", "ping_ledger", "room_key", "inbox_key"]

SCHEMA = 3
KEY_PREFIX = "kvguard:ledger:v3"
INBOX_PREFIX = "kvguard:inbox:v3"
MAX_LABEL_CHARS = 256  # a rid or tenant label in a fact
SIDES = ("sender", "receiver")
FIELD_PREFIX = {"sender": "s:", "receiver": "r:"}
MAX_U64 = (1 << 64) - 1
IDLE_PING_NS = 5_000_000_000  # with nothing to write, check the store this often
INBOX_BATCH = 1024  # entries one XREAD takes at most
GATHER_NS = 5_000_000  # after a quiet spell, the first fact waits this long for the ones right behind it
PARTIAL_BACKOFF_S = 0.2  # the retry delay while only some of the store's nodes refuse
REFRESH_EVERY_NS = 1_000_000_000  # a failing thread re-reads the store's topology at most this often
TRIM_EVERY = 64  # entries read between two trims of the inbox (and at every idle XREAD timeout)


def parse_ledger_url(value: str, flag: str = "--ledger") -> str | None:
    """``memory`` -> None; a store URL (store.py ``parse_target``: ``redis://HOST:PORT/DB``,
    ``rediss://``, ``redis+cluster://HOST:PORT[,HOST:PORT...]``,
    ``redis+sentinel://HOST:PORT[,...]/MASTER[/DB]``) -> the URL. A bad value raises
    LedgerConfigError naming the flag and the value."""
    target = parse_target(value, flag)
    return None if target is None else target.url


def room_key(cluster: str, room: int) -> str:
    """The room's hash; ``{cluster:room}`` is its Redis Cluster hash tag."""
    return f"{KEY_PREFIX}:{{{cluster}:{room}}}"


def inbox_key(cluster: str, pod: str) -> str:
    """A receiving pod's inbox stream."""
    return f"{INBOX_PREFIX}:{{{cluster}:{pod}}}"


def fact_field(side: str, pod: str) -> str:
    return FIELD_PREFIX[side] + pod


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
    target = parse_target(url)
    if target is None:
        return "not a shared ledger URL"
    store = open_store(target, timeout_s)
    try:
        store.connect()
        store.ping()
    except Exception as exc:  # noqa: BLE001 - refused, timed out, auth, a non-Redis server: all "not reachable"
        return f"{target.display}: {type(exc).__name__}: {exc}"
    finally:
        store.close()
    return None


def _next_id(stream_id: bytes | str) -> str:
    """The smallest stream id after ``stream_id`` (XTRIM MINID keeps ids >= it)."""
    text = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    ms, _, seq = text.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Watch:
    """A room the receiver waits on: until when, and the senders' facts it has (field -> raw value)."""

    __slots__ = ("until_ns", "raw", "facts")

    def __init__(self, until_ns: int):
        self.until_ns = until_ns
        self.raw: dict[str, bytes] = {}
        self.facts: dict[str, dict] = {}  # the same, parsed


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
        inbox_block_s: float = 2.0,
        inbox_maxlen: int = 10_000,
        resync_window_s: float = 10.0,
        closed_ttl_s: int = 30,
    ):
        if not cluster or any(c in cluster for c in ": \n{}"):
            raise LedgerConfigError(
                f"--ledger-cluster: expected a name without ':', '{{', '}}' or spaces, got {cluster!r}"
            )
        target = parse_target(url)
        if target is None:
            raise LedgerConfigError(f"--ledger: {url!r} is not a shared ledger URL")
        self.url = url
        self.target = target
        self.display_url = target.display  # shown in logs and findings without any password
        self.cluster = cluster
        self.pod = pod or f"{socket.gethostname()}:{__import__('os').getpid()}"
        if any(c in self.pod for c in "{}\n"):
            raise LedgerConfigError(f"shared ledger pod id: no '{{', '}}' or newline expected, got {self.pod!r}")
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.store = open_store(target, timeout_s, client)
        self.inbox = inbox_key(cluster, self.pod)
        self.inbox_block_s = inbox_block_s
        self.inbox_maxlen = inbox_maxlen
        self.resync_window_ns = int(resync_window_s * 1e9)
        self.closed_ttl_s = closed_ttl_s  # how long a decided room's tombstone turns late facts away
        self.poll_interval_s = poll_interval_s
        self.degrade_after_ns = int(degrade_after_s * 1e9)
        self.max_outbox, self.max_watch = max_outbox, max_watch
        self._commands: queue.Queue = queue.Queue(maxsize=queue_size)
        self._results: deque = deque()  # (room, side, [facts]) for take_results
        self._wake = threading.Event()  # something to do for the writer thread
        # the writer thread's own state (no other thread touches it)
        self._outbox: OrderedDict[tuple[int, str], list] = OrderedDict()  # (room, side) -> [req, json]
        self._recent: OrderedDict[tuple[int, str], tuple[str, str, int]] = OrderedDict()  # written: req, json, when
        self._pushes: OrderedDict[tuple[str, int, str], str] = OrderedDict()  # (inbox, room, field) -> json
        self._joins: set[int] = set()  # rooms whose receiver registration is to be (re)sent
        self._closes: OrderedDict[int, list[str]] = OrderedDict()  # rooms decided -> the sending requests
        self._closed: OrderedDict[int, str] = OrderedDict()  # room -> the receiver request that decided it
        self._receiver_req: OrderedDict[int, str] = OrderedDict()  # room -> this side's request key (hex)
        self._watching: dict[int, _Watch] = {}
        # from the inbox thread: lists of stream entries; read by the writer thread
        self._inbox_entries: deque = deque()
        self._inbox_thread: threading.Thread | None = None
        self._inbox_store: Store | None = None
        self._inbox_failing_since_ns = 0
        self._inbox_failed_ns = 0  # the inbox read's last failure
        self._io_ok_ns = 0  # the writer's last good round trip
        self._partial_ok = False  # some command of the current cycle went through
        self._new_pushes = False  # the last batch's writes found receivers to push to
        self._refresh_at = [0]  # the writer's last topology refresh (the inbox reader keeps its own)
        # after failures, done once the store answers again: the writer's (rooms on a node that failed
        # or moved: write again, register again) and the inbox reader's (register every room again)
        self._resync = False
        self._rejoin = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        self.degraded = False
        self.last_error = ""
        self._last_io_ns = 0
        # counters (exported as metrics)
        self.errors = 0
        self.queue_dropped = 0
        self.outbox_dropped = 0
        self.published = 0
        self.pushed = 0
        self.fetched = 0
        self.bad_facts = 0
        self.recoveries = 0
        self.resynced = 0
        self.closed_rooms = 0
        self.late_dropped = 0  # facts not written: their room was decided (deleted) by its receiver

    # ------------------------------------------------------------------ ingest thread (never blocks)
    def _put(self, item) -> None:
        try:
            self._commands.put_nowait(item)
        except queue.Full:
            self.queue_dropped += 1
            return
        if not self._wake.is_set():
            self._wake.set()

    def publish(self, side: str, room: int, req_key: int, fact: dict) -> None:
        """This side's facts of a room; ``req_key`` is this side's own request key (its rid's hash)."""
        req = f"{req_key:016x}"
        fact = {"v": SCHEMA, "side": side, "pod": self.pod, "room": room, "req_key": req, **fact}
        self._put(("pub", room, side, req, json.dumps(fact, separators=(",", ":"))))

    def watch(self, room: int, side: str, until_ns: int) -> None:
        """Receive the ``side`` facts of this room as they arrive, until ``until_ns`` (monotonic)
        or ``unwatch``. Only a receiver waits, on its senders: ``side`` is ``"sender"``."""
        if side != "sender":
            raise ValueError(f"only a receiver waits on the other side's facts (side 'sender'), got {side!r}")
        self._put(("watch", room, side, until_ns, None))

    def unwatch(self, room: int, side: str) -> None:
        """The receiver decided the room: stop waiting and delete its key."""
        self._put(("unwatch", room, side, None, None))

    def take_results(self) -> list[tuple[int, str, list[dict]]]:
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    @property
    def pending_publishes(self) -> int:
        return len(self._outbox) + len(self._pushes) + self._commands.qsize()

    def stats(self) -> SharedLedgerStats:
        """The link's health (sidecar/stats.py): single reads of what the ledger's threads count."""
        return SharedLedgerStats(
            degraded=self.degraded,
            errors=self.errors,
            queue_dropped=self.queue_dropped,
            outbox_dropped=self.outbox_dropped,
            bad_facts=self.bad_facts,
            resynced=self.resynced,
            failovers=self.store.failovers + (self._inbox_store.failovers if self._inbox_store is not None else 0),
        )

    def read_rooms(self, rooms: list[int], timeout_s: float | None = None) -> list[dict[str, list]]:
        """What the store holds for each room now, for a person (``kvguard bundle``): per side the
        (pod, raw value) of each publishing sidecar, and the sending requests a decided room's
        tombstone names. One pipelined HGETALL per room, on a client of its own (the caller's
        thread, not the ledger's); raises what the store raised."""
        store = open_store(self.target, timeout_s or self.timeout_s)
        try:
            store.connect()
            keys = [room_key(self.cluster, room) for room in rooms]
            replies = store.execute([(key, ("HGETALL", key)) for key in keys])
        finally:
            store.close()
        out = []
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
            entry: dict[str, list] = {"sender": [], "receiver": [], "decided": []}
            for field, raw in sorted((reply or {}).items()):
                field = _text(field)
                kind, _, who = field.partition(":")
                if kind == "d":
                    entry["decided"].append(who)
                elif kind in ("s", "r"):
                    entry["sender" if kind == "s" else "receiver"].append((who, raw))
            out.append(entry)
        return out

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> SharedLedger:
        self._thread = threading.Thread(target=self._run, name="kvguard-ledger", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_s: float = 2.0) -> None:
        """Stop the threads after one last attempt to publish what is buffered (bounded by flush_s)."""
        deadline = time.monotonic() + flush_s
        while self.pending_publishes and not self.degraded and time.monotonic() < deadline:
            self._wake.set()
            time.sleep(min(self.poll_interval_s, 0.05))
        self._stop.set()
        self._wake.set()
        inbox_store = self._inbox_store
        if inbox_store is not None:
            inbox_store.close()  # wakes the reader out of its blocking XREAD
        for t in (self._thread, self._inbox_thread):
            if t is not None:
                t.join(timeout=flush_s + self.timeout_s + self.inbox_block_s + 5)
        self.store.close()

    # ------------------------------------------------------------------ writer thread
    def _drain_commands(self) -> None:
        while True:
            try:
                op, room, side, a, b = self._commands.get_nowait()
            except queue.Empty:
                return
            if op == "pub":
                if side == "receiver" and self._closed.get(room) == a:
                    continue  # decided already: nobody reads it, and it would bring the key back
                if side == "receiver":
                    self._receiver_req[room] = a
                    self._receiver_req.move_to_end(room)
                    while len(self._receiver_req) > self.max_watch:
                        self._receiver_req.popitem(last=False)
                self._outbox[(room, side)] = [a, b]
                self._outbox.move_to_end((room, side))
                while len(self._outbox) > self.max_outbox:
                    self._outbox.popitem(last=False)
                    self.outbox_dropped += 1
            elif op == "watch":
                w = self._watching.get(room)
                if w is not None:
                    w.until_ns = max(w.until_ns, a)
                elif len(self._watching) < self.max_watch:
                    self._watching[room] = _Watch(a)
                    self._closed.pop(room, None)  # a new wait on a reused room number
                    if (room, "receiver") not in self._outbox:
                        # the receiver's write already went (or never will): say "I wait here" and get the facts
                        self._joins.add(room)
                    self._start_inbox()
            else:
                self._decide(room)

    def _decide(self, room: int) -> None:
        """The receiver is done with the room: delete its part of the key (and the key)."""
        w = self._watching.pop(room, None)
        if w is None:
            return
        decided = sorted({f["req_key"] for f in w.facts.values()})
        self._joins.discard(room)
        self._closed[room] = self._receiver_req.pop(room, "")
        while len(self._closed) > self.max_watch:
            self._closed.popitem(last=False)
        self._closes[room] = decided
        while len(self._closes) > self.max_outbox:
            self._closes.popitem(last=False)  # left to the TTL

    def _deliver_inbox(self) -> None:
        """What the inbox thread read: each entry one sender's facts of one room."""
        while self._inbox_entries:
            for _id, fields in self._inbox_entries.popleft():
                try:
                    room = int(fields[b"room"])
                    field = _text(fields[b"field"])
                    value = fields[b"fact"]
                except (KeyError, ValueError, TypeError):
                    self.bad_facts += 1
                    continue
                w = self._watching.get(room)
                if w is not None:
                    self._merge(room, w, {field: value})

    def _merge(self, room: int, w: _Watch, raw: dict) -> None:
        """Senders' facts (field -> raw JSON) of a watched room: hand over the room's whole set when
        any changed (the pipeline tells two sending requests of one room apart, or sets them aside)."""
        changed = False
        for field, value in raw.items():
            field = _text(field)
            value = value.encode() if isinstance(value, str) else value
            if w.raw.get(field) == value:
                continue
            try:
                fact = json.loads(value)
            except (ValueError, UnicodeDecodeError):
                fact = None
            if not field.startswith("s:") or not valid_fact(fact, "sender", room):
                self.bad_facts += 1
                log.warning(
                    "shared ledger: ignoring a value in room %d field %r that this version did not write",
                    room,
                    field[:64],
                )
                continue
            w.raw[field] = value
            w.facts[field] = fact
            changed = True
        if changed:
            self.fetched += 1
            self._results.append((room, "sender", list(w.facts.values())))

    def _has_work(self) -> bool:
        return bool(self._outbox or self._pushes or self._joins or self._closes)

    def _run(self) -> None:
        backoff = self.poll_interval_s
        failing_since_ns = 0  # first failure of the current run of failures; 0 while the store answers
        next_io_ns = 0  # no round trip before this (the batching window; the backoff after a failure)
        work_since_ns = 0  # when the work now waiting first came
        next_expiry_ns = 0
        while not self._stop.is_set():
            self._wake.clear()
            self._drain_commands()
            self._deliver_inbox()
            now = time.monotonic_ns()
            if now >= next_expiry_ns:
                self._expire_watches(now)
                next_expiry_ns = now + 1_000_000_000
            work = self._has_work() or self._resync or self._rejoin
            if work and not work_since_ns:
                # the first fact after a quiet spell: wait GATHER_NS for the ones the ingest
                # cycle is handing over with it (a sender's begin, chunk and digest come together)
                work_since_ns = now
            due = max(next_io_ns, work_since_ns + GATHER_NS) if work else next_io_ns
            idle_check = now - self._last_io_ns >= IDLE_PING_NS or failing_since_ns or self.degraded
            if now >= due and (work or idle_check):
                self._partial_ok = False
                try:
                    ok = self._cycle(now)
                except Exception as exc:  # noqa: BLE001 - connect failures, timeouts, refused connections
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    ok = False
                if ok:
                    failing_since_ns = 0
                    self._io_ok_ns = time.monotonic_ns()
                    backoff = self.poll_interval_s
                else:
                    self.errors += 1
                    self._resync = True
                    failing_since_ns = failing_since_ns or now
                    if not self.degraded and now - failing_since_ns < self.degrade_after_ns:
                        log.info(
                            "shared ledger %s: round trip failed (%s), retrying", self.display_url, self.last_error
                        )
                        backoff = min(backoff * 2, 0.5)  # retried within the grace period
                    else:
                        backoff = min(backoff * 2, 2.0)
                    if self._partial_ok:
                        # one node (a failing-over master) refused, the others answered: their new work
                        # should not wait out an outage's backoff
                        backoff = min(backoff, PARTIAL_BACKOFF_S)
                    self._refresh()
                now = time.monotonic_ns()
                next_io_ns = now + int(backoff * 1e9)
                work_since_ns = now if (self._has_work() or self._resync or self._rejoin) else 0
            self._update_degraded(failing_since_ns, now)
            if self._has_work() or self._resync or self._rejoin or failing_since_ns:
                until = max(next_io_ns, work_since_ns + GATHER_NS)
            else:
                until = min(self._last_io_ns + IDLE_PING_NS, next_expiry_ns if self._watching else 1 << 62)
            self._wake.wait(max(0.0, (until - now) / 1e9))

    def _update_degraded(self, failing_since_ns: int, now: int) -> None:
        inbox_since = self._inbox_failing_since_ns
        if inbox_since and self._inbox_failed_ns < self._io_ok_ns:
            inbox_since = 0  # the store answered the writer since the inbox's last failure (it is in its backoff)
        since = [s for s in (failing_since_ns, inbox_since) if s]
        if since and (self.degraded or now - min(since) >= self.degrade_after_ns):
            if not self.degraded:
                log.warning(
                    "shared ledger %s unreachable (%s): pairing with the other pod is degraded",
                    self.display_url,
                    self.last_error,
                )
            self.degraded = True
        elif not since and self.degraded:
            self.degraded = False  # after the results of the good round trip were queued
            self.recoveries += 1
            log.warning("shared ledger %s reachable again: pairing resumes", self.display_url)

    def _refresh(self, store=None, last=None) -> None:
        """Re-read where the keys live, at most every REFRESH_EVERY_NS per thread (a whole fleet
        retrying through an outage is a load of its own on the store)."""
        store = store or self.store
        last = last if last is not None else self._refresh_at
        now = time.monotonic_ns()
        if now - last[0] < REFRESH_EVERY_NS:
            return
        last[0] = now
        try:
            store.refresh()
        except Exception as exc:  # noqa: BLE001 - no node answers yet: the next failure tries again
            log.debug("shared ledger %s: topology refresh failed: %s", self.display_url, exc)

    def _expire_watches(self, now: int) -> None:
        for room in [r for r, w in self._watching.items() if w.until_ns < now]:
            self._decide(room)  # its wait is over: the pipeline has judged it without the sender

    def _do_resync(self, now: int, suspect, rejoin_all: bool) -> None:
        """After failures, once the store answers: what this sidecar wrote lately to a node that
        failed or lost its slots (``suspect(key)``) is written again, since a master that failed
        over may have lost it (acknowledged, not replicated), and the rooms waited on there register
        again (and get their senders' facts); after the inbox failed, every room waited on does."""
        for key in [k for k, (_r, _j, at) in self._recent.items() if now - at > self.resync_window_ns]:
            del self._recent[key]
        n = 0
        for (room, side), (req, value, _at) in self._recent.items():
            if (room, side) in self._outbox or (side == "receiver" and room not in self._watching):
                continue
            if suspect(room_key(self.cluster, room)):
                self._outbox[(room, side)] = [req, value]
                n += 1
        for room in self._watching:
            if (room, "receiver") not in self._outbox and (rejoin_all or suspect(room_key(self.cluster, room))):
                self._joins.add(room)
                n += 1
        self.resynced += n
        if n:
            log.info("shared ledger %s: %d rooms written again after a failed round trip", self.display_url, n)

    def _cycle(self, now: int) -> bool:
        """One pipelined round trip per store node (two when a sender's write found a receiver to push to)."""
        if not self._connected:
            self.store.connect()
            self._connected = True
        ok = self._round_trip(now)
        if ok and (self._resync or self._rejoin):  # the store answers again: put back what it may have lost
            suspect = self.store.take_suspect() if self._resync else (lambda _key: False)
            rejoin_all, self._resync, self._rejoin = self._rejoin, False, False
            self._do_resync(now, suspect, rejoin_all)
            if self._has_work():
                ok = self._round_trip(now)
        return ok

    def _round_trip(self, now: int) -> bool:
        self._last_io_ns = now
        if not self._has_work():
            self.store.ping()  # is it (still / again) there? keeps kvguard_ledger_degraded honest when idle
            return True
        ok = self._batch(now)
        if self._pushes and self._new_pushes:  # pushes the writes just found: sent now, not a cycle later
            ok = self._batch(now, pushes_only=True) and ok
        return ok

    def _batch(self, now: int, pushes_only: bool = False) -> bool:
        cmds: list[tuple[str, tuple]] = []
        what: list[tuple] = []
        if not pushes_only:
            for (room, side), (req, value) in self._outbox.items():
                key = room_key(self.cluster, room)
                other, own_req = ("r:", req) if side == "sender" else ("s:", "")
                cmds.append(PUBLISH.cmd(key, fact_field(side, self.pod), value, self.ttl_s, other, own_req))
                what.append(("pub", room, side, req, value))
            for room in self._joins:
                if (room, "receiver") in self._outbox:
                    continue
                cmds.append(
                    PUBLISH.cmd(
                        room_key(self.cluster, room), fact_field("receiver", self.pod), "", self.ttl_s, "s:", ""
                    )
                )
                what.append(("join", room, None, None, None))
            for room, decided in self._closes.items():
                own = fact_field("receiver", self.pod)
                cmds.append(CLOSE.cmd(room_key(self.cluster, room), own, self.closed_ttl_s, *decided))
                what.append(("close", room, None, None, None))
        for (inbox, room, field), value in self._pushes.items():
            cmds.append(PUSH.cmd(inbox, self.inbox_maxlen, self.ttl_s, room, field, value))
            what.append(("push", room, inbox, field, value))
        if not cmds:
            return True
        replies = self.store.execute(cmds)
        failed = None
        self._new_pushes = False
        for (op, room, a, b, value), reply in zip(what, replies):
            if isinstance(reply, Exception):
                failed = reply
                continue
            self._partial_ok = True
            if op == "pub":
                entry = self._outbox.get((room, a))
                if entry is not None and entry[1] == value:  # not replaced by a newer snapshot meanwhile
                    del self._outbox[(room, a)]
                self._wrote(room, a, b, value, now, reply)
            elif op == "join":
                self._joins.discard(room)
                w = self._watching.get(room)
                if w is not None and reply:
                    self._merge(room, w, dict(zip(reply[::2], reply[1::2])))
            elif op == "close":
                self._closes.pop(room, None)
                self.closed_rooms += 1
            else:
                if self._pushes.get((a, room, b)) == value:  # not replaced by a newer snapshot in this batch
                    del self._pushes[(a, room, b)]
                self.pushed += 1
        if failed is not None:
            self.last_error = f"{type(failed).__name__}: {failed}"
            if not is_routing_error(failed):
                log.debug("shared ledger %s: %s", self.display_url, self.last_error)
            return False
        return True

    def _wrote(self, room: int, side: str, req: str, value: str, now: int, reply) -> None:
        """A write went through; ``reply`` is the other side (store.py PUBLISH)."""
        if reply is None:  # a sending request its receiver decided on (store.py PUBLISH: the tombstone)
            self.late_dropped += 1
            return
        self.published += 1
        self._recent[(room, side)] = (req, value, now)
        self._recent.move_to_end((room, side))
        while len(self._recent) > self.max_outbox:
            self._recent.popitem(last=False)
        if side == "receiver":
            w = self._watching.get(room)
            self._joins.discard(room)
            if w is not None and reply:
                self._merge(room, w, dict(zip(reply[::2], reply[1::2])))
            return
        fields = tuple(_text(f) for f in reply)
        own = fact_field("sender", self.pod)
        self._new_pushes = self._new_pushes or bool(fields)
        for field in fields:
            pod = field[2:]
            self._pushes[(inbox_key(self.cluster, pod), room, own)] = value
            self._pushes.move_to_end((inbox_key(self.cluster, pod), room, own))
        while len(self._pushes) > self.max_outbox:
            self._pushes.popitem(last=False)
            self.outbox_dropped += 1

    # ------------------------------------------------------------------ inbox thread (receivers only)
    def _start_inbox(self) -> None:
        if self._inbox_thread is None:
            self._inbox_thread = threading.Thread(target=self._read_inbox, name="kvguard-ledger-inbox", daemon=True)
            self._inbox_thread.start()

    def _read_inbox(self) -> None:
        """Blocked in XREAD on this pod's inbox; what comes is handed to the writer thread. Read
        entries are trimmed (every TRIM_EVERY, and when idle); after a failure the stream is
        read from its start (what is left of it: unread or untrimmed entries) and the writer
        thread re-registers every room it waits on, since a failed-over inbox may lack entries."""
        store = open_store(self.target, self.timeout_s + self.inbox_block_s)
        self._inbox_store = store
        last: Any = "0-0"
        untrimmed = 0
        refreshed = [0]
        backoff = 0.05
        block_ms = int(self.inbox_block_s * 1000)
        while not self._stop.is_set():
            try:
                store.connect()
                client = store.client_for(self.inbox)
                if untrimmed >= TRIM_EVERY:
                    self._trim(client, last)
                    untrimmed = 0
                reply = client.xread({self.inbox: last}, count=INBOX_BATCH, block=block_ms)
                if not reply and untrimmed:
                    self._trim(client, last)
                    untrimmed = 0
            except Exception as exc:  # noqa: BLE001 - refused, timed out, moved, failed over
                if self._stop.is_set():
                    return
                self.errors += 1
                self.last_error = f"inbox: {type(exc).__name__}: {exc}"
                self._inbox_failed_ns = time.monotonic_ns()
                self._inbox_failing_since_ns = self._inbox_failing_since_ns or self._inbox_failed_ns
                self._rejoin = True
                last, untrimmed = "0-0", 0
                self._refresh(store, refreshed)
                self._wake.set()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            if self._inbox_failing_since_ns:
                self._inbox_failing_since_ns = 0
                self._wake.set()
            if reply:
                entries = reply[0][1]
                last = entries[-1][0]
                untrimmed += len(entries)
                self._inbox_entries.append(entries)
                self._wake.set()

    def _trim(self, client, last) -> None:
        """Drop what was read (entries up to ``last``) and keep the living inbox from expiring."""
        pipe = client.pipeline(transaction=False)
        pipe.xtrim(self.inbox, minid=_next_id(last), approximate=False)
        pipe.expire(self.inbox, self.ttl_s)
        pipe.execute()

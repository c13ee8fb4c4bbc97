"""``make fleet-sim``: the shared transfer ledger (sidecar/ledger/shared.py) at fleet scale.

Starts a real Redis Cluster (3 masters + 3 replicas of Debian's redis-server,
tests/support/redis_cluster.py) and drives it from N simulated pods, each with the real
``SharedLedger`` (its threads, its store code, its Lua scripts); only the engines are
simulated. Half the pods are prefill pods: per transfer they publish the sender's facts
when the request begins and again, with the last chunk and digest, when the transfer is
sent. The other half are decode pods: they publish the receiver's facts and wait on the
room when they reserve, publish again when the transfer is done, and decide (unwatch)
the room once the sender's last chunk reached them, as the sidecar's pipeline does. Each
pod count runs a steady phase and a phase in which a master is SIGKILLed one second in
(its replica takes over).

Per pod count and phase it prints (and writes to ``fleet-sim-results.json``): transfers
per second done; store requests per transfer (client requests: EVALSHA, EVAL, XREAD,
XTRIM, PING, from INFO commandstats deltas of every node) and commands per transfer (the
requests plus what the Lua scripts run inside); pairing latency p50/p99 (from the later
of the two sides' last writes to decode being handed the sender's last facts; decode's
"ingest" polls every 5 ms); store CPU per 1,000 transfers/s (used_cpu_sys + user of all
six nodes, in cores); sidecar CPU per 1,000 transfers/s (the ledger's threads, and the
whole simulating process with its fake engines, in cores); transfers never paired, and
what the links counted (errors, rooms resynced, failovers).

Many SharedLedger instances share a process (a writer thread each, an inbox thread per
decode pod); ``--procs`` (default: one process per 128 pods, at most one per CPU) spreads them. Transfers go
between a prefill and a decode pod of the same process: they still meet only in Redis.

    python -m bench.fleet_sim                       # 8, 64 and 512 pods, ~3 minutes
    python -m bench.fleet_sim --pods 64 --rate 2000 # one size, another fleet rate
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "fleet-sim-results.json"
REQUESTS = ("evalsha", "eval", "xread", "xtrim", "ping")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------- a worker
def _thread_cpu_s(prefix: str) -> float:
    """CPU seconds of this process's threads whose name starts with ``prefix`` (from /proc)."""
    total = 0
    for t in threading.enumerate():
        if not t.name.startswith(prefix) or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / CLK_TCK


def _sender_fact(rid: str, last: bool) -> dict:
    chunks = [[0, 512, 1, 32]] if last else []
    digests = (
        [[3, 0, 8, random.getrandbits(64), 0, 512, 32, 8]] if last else []
    )  # alg, heads, digest, tokens, layers, total
    return {
        "began": True,
        "warmup": False,
        "gave_up": "",
        "ended": False,
        "rid": rid,
        "tenant": "acme",
        "chunks": chunks,
        "digests": digests,
    }


def _receiver_fact(done: bool) -> dict:
    return {"reserved_tokens": 512, "reserved_pages": 32, "status": 1 if done else 0, "digests": []}


def worker(idx: int, url: str, cluster: str, pairs: int, rate: float, plan: dict, conn) -> None:
    """``pairs`` prefill and ``pairs`` decode pods; transfers start at ``rate`` per second (Poisson)
    from ``plan['t0']`` (CLOCK_MONOTONIC, shared by every process) until the phases end."""
    sys.path.insert(0, str(REPO))
    from kvguard.sidecar.ledger.shared import SharedLedger

    logging_quiet()
    prefill = [SharedLedger(url, cluster=cluster, pod=f"w{idx}-prefill-{i}") for i in range(pairs)]
    decode = [SharedLedger(url, cluster=cluster, pod=f"w{idx}-decode-{i}") for i in range(pairs)]
    for link in prefill + decode:
        link.start()
    for link in decode:
        link._start_inbox()  # what its first watch does: the reader connects now, not in the measured phases
    # every link connected (a writer connects on its first idle PING, right away) before the clock starts
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not all(
        link._connected and (link not in decode or (link._inbox_store and link._inbox_store.client))
        for link in prefill + decode
    ):
        time.sleep(0.1)
    conn.send("ready")
    t0 = conn.recv()
    rng = random.Random(idx)
    bounds = [t0 + b for b in plan["bounds"]]  # phase edges: warm-up | steady | master killed | end
    samples = []  # (time, ledger-thread CPU s, process CPU s) at each edge
    open_rooms: dict[int, list] = {}  # room -> [pair, started, final_due, final_at]
    finals: list[tuple[float, int]] = []  # (due, room): a heap
    done: list[tuple[float, float | None, float | None]] = []  # (started, latency s or None, lag s or None)
    next_start = t0
    edge = 0
    while time.monotonic() < t0:
        time.sleep(0.001)
    while True:
        now = time.monotonic()
        while edge < len(bounds) and now >= bounds[edge]:
            samples.append((now, _thread_cpu_s("kvguard-ledger"), time.process_time()))
            edge += 1
        if edge == len(bounds):
            break
        while next_start <= now and next_start < bounds[-2]:  # no new transfers in the drain
            room = rng.getrandbits(63)
            i = rng.randrange(pairs)
            decode[i].publish("receiver", room, room ^ 1, _receiver_fact(False))
            decode[i].watch(room, "sender", int((now + 120) * 1e9))
            prefill[i].publish("sender", room, room, _sender_fact(f"r{room}", False))
            due = now + rng.uniform(plan["transfer_s"][0], plan["transfer_s"][1])
            open_rooms[room] = [i, next_start, due, None]
            heapq.heappush(finals, (due, room))
            next_start += rng.expovariate(rate)
        while finals and finals[0][0] <= now:
            _due, room = heapq.heappop(finals)
            t = open_rooms.get(room)
            if t is None:
                continue
            prefill[t[0]].publish("sender", room, room, _sender_fact(f"r{room}", True))
            decode[t[0]].publish("receiver", room, room ^ 1, _receiver_fact(True))
            t[3] = time.monotonic()
            t.append(t[3] - _due)  # how late the simulator was (a starved machine shows here)
        for link in decode:
            for room, _side, facts in link.take_results():
                t = open_rooms.get(room)
                if t is None or t[3] is None or not any(f["chunks"] for f in facts):
                    continue
                done.append((t[1], time.monotonic() - t[3], t[4]))
                del open_rooms[room]
                link.unwatch(room, "sender")
        time.sleep(0.005)  # the sidecar's ingest polls every 10 ms; half that here
    # never paired: after both sides wrote (a lag), or the simulator never got to write (no lag)
    done.extend((t[1], None, t[4] if len(t) > 4 else None) for t in open_rooms.values())
    links = prefill + decode
    counters = {
        name: sum(getattr(link, name) for link in links)
        for name in ("errors", "resynced", "published", "pushed", "fetched", "bad_facts", "late_dropped")
    }
    counters["failovers"] = sum(link.stats().failovers for link in links)
    counters["queue_dropped"] = sum(link.queue_dropped for link in links)
    counters["outbox_dropped"] = sum(link.outbox_dropped for link in links)
    conn.send({"samples": samples, "done": done, "counters": counters, "threads": threading.active_count()})
    stoppers = [threading.Thread(target=link.stop, kwargs={"flush_s": 0.5}) for link in links]
    for s in stoppers:
        s.start()
    for s in stoppers:
        s.join()
    conn.close()


def logging_quiet() -> None:
    import logging

    logging.getLogger("kvguard.ledger").setLevel(logging.ERROR)  # a failover logs per link otherwise


# ---------------------------------------------------------------------------------- the store side
def _node_sample(cluster) -> dict[int, dict]:
    """port -> INFO (commandstats, cpu, role) of every live node."""
    import redis

    out = {}
    for node in cluster.nodes:
        if not node.alive:
            continue
        try:
            out[node.port] = redis.Redis(port=node.port, socket_timeout=1).info("all")
        except redis.RedisError:
            pass
    return out


def _requests(info: dict) -> tuple[int, int]:
    """(client requests of the ledger's kinds, every command run incl. inside scripts)."""
    stats = {k[8:]: v["calls"] for k, v in info.items() if k.startswith("cmdstat_")}
    requests = sum(stats.get(k, 0) for k in REQUESTS) + stats.get("script|load", 0)
    everything = sum(v for k, v in stats.items() if k not in ("info", "cluster|slots", "cluster|info", "cluster|nodes"))
    return requests, everything


def _store_delta(first: dict[int, dict], last: dict[int, dict]) -> dict:
    """Requests, commands and CPU seconds between two samples, over every node in ``first`` (a node
    dead by ``last`` counts up to its last sample). Requests are never replicated, so every node's
    count is its own clients'; commands (those scripts run included) are counted on the nodes that
    were masters at either end, so a replica's applying of its master's writes is left out (a
    promoted one's, before it took over, is in: about a second's worth of a third of the writes)."""
    req = cmds = cpu = 0.0
    for port, a in first.items():
        b = last.get(port, a)
        ra, ca = _requests(a)
        rb, cb = _requests(b)
        req += rb - ra
        if "master" in (a["role"], b["role"]):
            cmds += cb - ca
        cpu += (b["used_cpu_sys"] + b["used_cpu_user"]) - (a["used_cpu_sys"] + a["used_cpu_user"])
    return {"requests": req, "commands": cmds, "cpu_s": cpu}


def _per_1k(cpu_s: float, wall_s: float, tps: float) -> float | None:
    """CPU cores busy per 1,000 transfers/s."""
    return round(cpu_s / wall_s / (tps / 1000), 3) if tps else None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_case(cluster, pods: int, rate: float, procs: int, plan: dict, tmp: Path) -> dict:
    """One pod count: warm-up, a steady phase, a phase with a master killed; figures per phase."""
    pairs_total = pods // 2
    procs = max(1, min(procs, pairs_total))
    share = [pairs_total // procs + (1 if i < pairs_total % procs else 0) for i in range(procs)]
    name = f"fleet{pods}x{int(time.time())}"
    ctx = mp.get_context("spawn")  # a fresh interpreter each: no inherited locks or threads
    conns, workers = [], []
    for i, n in enumerate(share):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=worker, args=(i, cluster.url, name, n, rate * n / pairs_total, plan, theirs))
        p.start()
        conns.append(mine)
        workers.append(p)
    for c in conns:
        if not c.poll(120):
            raise RuntimeError("a fleet-sim worker did not start within 120 s")
        assert c.recv() == "ready"
    t0 = time.monotonic() + 1.0
    for c in conns:
        c.send(t0)
    bounds = [t0 + b for b in plan["bounds"]]
    info_at: list[dict[int, dict]] = []  # at each edge: port -> INFO (a dead node: its last sample)
    last_seen: dict[int, dict] = {}
    killed = None
    kill_at = bounds[1] + plan["kill_after_s"]
    for i, edge in enumerate(bounds):
        while True:  # sample the nodes every 0.5 s: a killed node's last sample stands for it
            now = time.monotonic()
            if killed is None and i == 2 and now >= kill_at:
                # the master of the first decode pod's inbox (and of a third of the rooms)
                victim = cluster.master_of(f"kvguard:inbox:v3:{{{name}:w0-decode-0}}")
                cluster.kill(victim)
                killed = (victim.port, now - t0)
            if now >= edge:
                break
            last_seen.update(_node_sample(cluster))
            time.sleep(min(0.5, max(0.0, edge - now)))
        last_seen.update(_node_sample(cluster))
        info_at.append(dict(last_seen))
    results = [c.recv() for c in conns]
    for p in workers:
        p.join(60)
    phases = []
    for k, phase in enumerate(("steady", "master killed")):
        lo, hi = bounds[k], bounds[k + 1]
        store = _store_delta(info_at[k], info_at[k + 1])
        started = [(s, lat, lag) for r in results for s, lat, lag in r["done"] if lo <= s < hi]
        lat = [x * 1000 for _, x, _l in started if x is not None]
        lags = [x * 1000 for _, _x, x in started if x is not None]
        wall = hi - lo
        n = len(started)
        tps = n / wall
        ledger_cpu = sum(r["samples"][k + 1][1] - r["samples"][k][1] for r in results)
        proc_cpu = sum(r["samples"][k + 1][2] - r["samples"][k][2] for r in results)
        phases.append(
            {
                "phase": phase,
                "seconds": round(wall, 1),
                "transfers": n,
                "transfers_per_s": round(tps, 1),
                "unpaired": sum(1 for _, x, lag in started if x is None and lag is not None),
                "not_sent": sum(1 for _, x, lag in started if x is None and lag is None),
                "sim_lag_ms_p99": round(_pct(lags, 0.99) or 0, 1),
                "requests_per_transfer": round(store["requests"] / n, 2) if n else None,
                "commands_per_transfer": round(store["commands"] / n, 2) if n else None,
                "pairing_ms_p50": round(_pct(lat, 0.5) or 0, 1),
                "pairing_ms_p99": round(_pct(lat, 0.99) or 0, 1),
                "pairing_ms_max": round(max(lat), 1) if lat else None,
                "store_cores_per_1k_tps": _per_1k(store["cpu_s"], wall, tps),
                "ledger_cores_per_1k_tps": _per_1k(ledger_cpu, wall, tps),
                "process_cores_per_1k_tps": _per_1k(proc_cpu, wall, tps),
            }
        )
    counters: dict[str, int] = {}
    for r in results:
        for k, v in r["counters"].items():
            counters[k] = counters.get(k, 0) + v
    return {
        "pods": pods,
        "procs": procs,
        "fleet_rate": rate,
        "threads_per_proc": max(r["threads"] for r in results),
        "killed_master": {"port": killed[0], "at_s": round(killed[1], 2)} if killed else None,
        "phases": phases,
        "links": counters,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, nargs="+", default=[8, 64, 512], help="simulated pods (half prefill)")
    ap.add_argument("--rate", type=float, default=500.0, help="transfers per second, the whole fleet")
    ap.add_argument("--phase-s", type=float, default=10.0, help="length of each measured phase")
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--drain-s", type=float, default=8.0, help="after the phases: time for the last transfers to pair")
    ap.add_argument("--procs", type=int, default=0, help="worker processes (0: one per 128 pods, at most one per CPU)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from tests.support.redis_cluster import RedisCluster

    w, p, d = args.warmup_s, args.phase_s, args.drain_s
    plan = {"bounds": [w, w + p, w + 2 * p, w + 2 * p + d], "transfer_s": (0.02, 0.5), "kill_after_s": 1.0}
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-fleet-"))
    started = time.monotonic()
    load_before = os.getloadavg()
    cluster = RedisCluster(tmp / "cluster").start()
    cases = []
    try:
        for pods in args.pods:
            procs = args.procs or min(os.cpu_count() or 1, -(-pods // 128))
            print(f"fleet-sim: {pods} pods in {procs} process(es), {args.rate:.0f} transfers/s ...", flush=True)
            cases.append(run_case(cluster, pods, args.rate, procs, plan, tmp))
            cluster.heal()  # the killed master back (as a replica) before the next size
    finally:
        cluster.remove()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs ({os.sched_getaffinity(0).__len__()} usable)"
    out = {
        "machine": machine,
        "python": platform.python_version(),
        "redis": "Redis Cluster 3 masters + 3 replicas, redis-server " + _redis_version(),
        "fleet_rate": args.rate,
        "plan": plan,
        "cases": cases,
        "wall_s": round(time.monotonic() - started, 1),
        "loadavg_1m": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print_table(out)
    print(f"wrote {args.out} ({out['wall_s']:.0f} s)")
    return 0 if all(ph["transfers"] for c in cases for ph in c["phases"]) else 1


def _redis_version() -> str:
    import subprocess

    from tests.support.redis_cluster import REDIS_SERVER

    text = subprocess.run([REDIS_SERVER, "--version"], capture_output=True, text=True).stdout
    return next((w[2:] for w in text.split() if w.startswith("v=")), "?")


def print_table(out: dict) -> None:
    cols = [
        ("pods", 5),
        ("phase", 14),
        ("tps", 6),
        ("req/xfer", 8),
        ("cmd/xfer", 8),
        ("p50 ms", 7),
        ("p99 ms", 8),
        ("store", 6),
        ("ledger", 6),
        ("process", 7),
        ("unpaired", 8),
        ("lag p99", 7),
    ]
    print(f"\n{out['machine']}; {out['redis']}; fleet rate {out['fleet_rate']:.0f} transfers/s")
    print(f"load average (1 min) {out['loadavg_1m']['before']} before, {out['loadavg_1m']['after']} after")
    print("CPU columns: cores per 1,000 transfers/s (store: all six nodes; ledger: the SharedLedger threads;")
    print("process: the simulating processes, fake engines included). lag p99: how late the simulator wrote a")
    print("transfer's last facts (ms): large means the machine, not the ledger, was the bottleneck")
    print(" ".join(f"{name:>{w}}" for name, w in cols))
    for case in out["cases"]:
        for ph in case["phases"]:
            row = [
                case["pods"],
                ph["phase"],
                ph["transfers_per_s"],
                ph["requests_per_transfer"],
                ph["commands_per_transfer"],
                ph["pairing_ms_p50"],
                ph["pairing_ms_p99"],
                ph["store_cores_per_1k_tps"],
                ph["ledger_cores_per_1k_tps"],
                ph["process_cores_per_1k_tps"],
                ph["unpaired"],
                ph["sim_lag_ms_p99"],
            ]
            print(" ".join(f"{str(v):>{w}}" for v, (_n, w) in zip(row, cols)))
        links = case["links"]
        print(
            f"      {case['pods']} pods: {case['procs']} process(es), {case['threads_per_proc']} threads each; links counted "
            f"{links['errors']} failed round trips, {links['resynced']} rooms resynced, {links['failovers']} failovers, "
            f"{links['late_dropped']} late facts refused, {links['queue_dropped'] + links['outbox_dropped']} dropped"
        )


if __name__ == "__main__":
    sys.exit(main())

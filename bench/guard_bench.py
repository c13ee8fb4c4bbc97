"""The guard's cost on prefill's send path (KVGUARD_GUARD=transfer, docs/guard.md), and
what KVGUARD_GUARD=full adds per step besides the Tier 1 check.

``guard.before_send`` runs once per transfer chunk before SGLang's ``send_kv_chunk``.
For a request the engine did not reject (every healthy request), before its first chunk,
it compares the pages its sender will send with the pages decode reserved (the
``send_size`` rule; later chunks skip it); for a rejected one it decides, fails the room
through the transfer manager (a no-op stand-in here, so the figure is the guard's own
work) and writes the GUARD record into a real ring. The digest rule's own work (the
marker packed on prefill, unpacked and compared on decode; the hashing is the transfer
digest's, made anyway) is ``guard_marker_us_per_request``. CPU time of the calling
thread, median of repeats.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import tempfile
import time
import types

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.engine_hooks.sglang import _runtime as rt
from kvguard.engine_hooks.sglang import guard
from kvguard.engine_hooks.sglang._runtime import State


class _Manager:
    """0.5.23's manager shape; its failure call does nothing (what the engine's own costs)."""

    def __init__(self) -> None:
        info = types.SimpleNamespace(dst_kv_indices=np.arange(150), is_dummy=False)
        self.transfer_infos = {7: {"s": info}}

    def conclude_failure(self, *, bootstrap_room, failure_reason) -> None:
        pass


def _req(rid: str, mgr) -> types.SimpleNamespace:
    # before its first chunk (curr_idx 0), its sender set for the 150 pages decode reserved
    sender = types.SimpleNamespace(kv_mgr=mgr, curr_idx=0, num_kv_indices=150)
    return types.SimpleNamespace(
        rid=rid,
        bootstrap_room=7,
        bootstrap_host="10.0.0.2",
        disagg_kv_sender=sender,
        origin_input_ids=[5] * 600,
        disagg_decode_prefix_len=0,
    )


def marker_us_per_request(calls: int) -> float:
    """The digest rule's own work per transfer: prefill packs the marker into its metadata
    row, decode unpacks it for the room and compares the digests."""
    from kvguard.engine_hooks.wire import marker as wm

    row = np.zeros(wm.SLOTS, np.int32)

    def one(i: int) -> None:
        row[:] = wm.pack(wm.Marker(i, 0, 600, 0, 8, 3, 0x1234_5678_9ABC_DEF0 + i))
        got = wm.unpack(row, i)
        assert got is not None and got.digest == 0x1234_5678_9ABC_DEF0 + i

    return _per_call_us(one, calls)


def _per_call_us(fn, calls: int, repeats: int = 5) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        for i in range(calls):
            fn(i)
        runs.append((time.thread_time_ns() - t0) / calls / 1e3)
    return statistics.median(runs)


def bench(calls: int = 20_000) -> dict:
    # the guard's log line per rejected request is formatted and written, to memory (an
    # engine writes it to its log; a terminal here would measure the terminal)
    logger = logging.getLogger("kvguard.sglang")
    handler = logging.StreamHandler(io.StringIO())
    saved_handlers, saved_propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    saved = rt.probes
    with tempfile.TemporaryDirectory() as d:
        probes = Probes(RingWriter(d, 1 << 22))
        rt.probes = lambda: probes
        try:
            State.reset()
            State.hello_done = True
            guard.Guard.reset(guard.GuardConfig("transfer"))
            mgr, sched = _Manager(), object()
            healthy = [_req(f"ok-{i}", mgr) for i in range(calls)]
            per_request = _per_call_us(lambda i: guard.before_send(sched, healthy[i], True), calls)
            rejected = [_req(f"rej-{i}", mgr) for i in range(calls)]

            def reject_and_send(i: int) -> None:
                State.rejected[rejected[i].rid] = 600
                guard.Guard.acted.pop(rejected[i].rid, None)
                guard.before_send(sched, rejected[i], True)

            per_rejected = _per_call_us(reject_and_send, calls // 10)
            guard.Guard.reset(guard.GuardConfig("off"))
            off = _per_call_us(lambda i: guard.before_send(sched, healthy[i], True), calls)
        finally:
            rt.probes = saved
            logger.handlers, logger.propagate = saved_handlers, saved_propagate
            guard.Guard.reset()
            State.reset()
    return {
        "guard_transfer_us_per_request": per_request,
        "guard_transfer_us_rejected": per_rejected,
        "guard_off_us_per_request": off,
        "guard_full_hooks_us_per_step_b256": full_hooks_us_per_step(256, max(calls // 20, 200)),
        "guard_marker_us_per_request": marker_us_per_request(max(calls // 4, 500)),
    }


@contextlib.contextmanager
def full_hooks(batch_size: int, tier1=None):
    """KVGUARD_GUARD=full's two per-step hooks on a healthy batch of ``batch_size``, as SGLang
    calls them (``process_batch_result`` and ``stream_output``, each through the adapter's
    AROUND wrapper around a no-op original): yields ``step()``. With ``tier1`` (a real Tier 1)
    the result hook looks at its checks in flight, as in the engine (on a GPU: waits for them,
    where the scheduler waits for the step's sampled tokens anyway)."""
    State.reset()
    State.hello_done = True
    guard.Guard.reset(guard.GuardConfig("full"))
    saved = rt.probes
    probes = types.SimpleNamespace(tier1=tier1)
    rt.probes = lambda: probes
    try:
        result = guard.result_hook("Scheduler.process_batch_result")
        stream = guard.stream_hook("SchedulerOutputStreamer.stream_output")
        reqs = [types.SimpleNamespace(rid=f"r{i}", output_ids=[1, 2], to_finish=None) for i in range(batch_size)]
        batch, noop = types.SimpleNamespace(reqs=reqs), (lambda *a, **k: None)

        def step() -> None:
            result(noop, object(), batch, None)
            stream(noop, object(), reqs, False)

        yield step
    finally:
        rt.probes = saved
        guard.Guard.reset()
        State.reset()


def full_hooks_us_per_step(batch_size: int, steps: int) -> float:
    """What ``full`` adds to each step besides the Tier 1 check itself, which the engine part
    measures (``engine.part_tier1_check_us_b256``): its two hooks, no check in flight."""
    with full_hooks(batch_size) as step:
        return _per_call_us(lambda _i: step(), steps)


if __name__ == "__main__":
    print(bench())

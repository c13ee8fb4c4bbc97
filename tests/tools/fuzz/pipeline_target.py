#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris, libFuzzer) of what one engine's ring can make the
sidecar do: a record stream, decoded by ``wire.decode_stream`` (back-to-back one-page
ASSIGNs as runs, as the ring reader does) and applied to a real ``Pipeline`` record by
record, as the ingest loop does.

Each input is a sequence of records. Most are built from typed fields the fuzzer chooses
(every kind, page ids and positions from small, interacting values to 2**31 and past,
request keys and rooms from a small set so that records meet), encoded with the
project's own encoders; the rest carry raw payload bytes under a valid header. Every
input starts with one HELLO (a 256-page pool) as a ring does, and may carry more.

What must hold, whatever the input (a failure is a crash libFuzzer saves and reports):

* nothing raises: not the decoder, not ``Pipeline.apply`` (which would catch and count
  it: ``apply_errors`` must stay 0, a bad record is refused by validation, never by an
  exception half way through an update);
* memory follows the announced pool, not numbers records claim: every page model stays
  within its limit, every row within the engine's row limit, the transfer ledger's rooms
  within their caps.

Run by ``tests/tools/test_fuzz_pipeline.py`` (bounded, in CI) and ``make fuzz`` (longer, with a
corpus kept in ``.kvguard-cache/fuzz-corpus``):

    python tests/tools/fuzz/pipeline_target.py [libFuzzer flags] [corpus dir]
"""

from __future__ import annotations

import logging
import sys

import atheris


def _instrumented():
    """Edge coverage of kvguard's modules as they are imported, without atheris's comparison
    tracing: it keeps every numpy array a traced comparison makes alive (seen: 3 KB per input,
    2 GB and libFuzzer's rss limit within 7 minutes of `make fuzz`), and the record path
    compares arrays everywhere. ``instrument_imports`` always traces comparisons, so its hook
    manager is made directly (atheris 3.0, pinned)."""
    from atheris.import_hook import HookManager

    return HookManager({"kvguard"}, set(), enable_loader_override=True, trace_dataflow=False)


with _instrumented():
    import numpy as np

    from kvguard.engine_hooks import wire
    from kvguard.sidecar import native
    from kvguard.sidecar.ledger.memory import MAX_CHUNKS_PER_ROOM
    from kvguard.sidecar.memory_budget import MIB, MemoryBudget
    from kvguard.sidecar.pipeline import Pipeline

ENGINE = 1234
RIDS = ["a", "b", "c", "d", "e"]
KEYS = [wire.request_key(r) for r in RIDS]
ROOMS = [wire.NO_ROOM, 1, 2, 3]
KINDS = [k for k in wire.Kind if k not in (wire.Kind.PAD, wire.Kind.LOST)]
HELLO = wire.Hello(wire.Role.DECODE, 0, 4242, 4, 256, 1024, 2048, 2000, "sglang", "0.5.23", "m", "0")


def _page(fdp: atheris.FuzzedDataProvider) -> int:
    pick = fdp.ConsumeIntInRange(0, 15)
    if pick == 15:
        return fdp.ConsumeIntInRange(-(1 << 31), (1 << 31) - 1)  # anything an int32 holds
    if pick == 14:
        return fdp.ConsumeIntInRange(250, 1400)  # around the pool's end and its slack
    return fdp.ConsumeIntInRange(0, 40)  # pages that requests share and fight over


def _pages(fdp, most: int = 12) -> np.ndarray:
    return np.array([_page(fdp) for _ in range(fdp.ConsumeIntInRange(0, most))], np.int64)


def _position(fdp) -> int:
    return fdp.ConsumeIntInRange(0, 200) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, (1 << 32) - 1)


def _typed(fdp, kind: wire.Kind) -> bytes | None:
    key = KEYS[fdp.ConsumeIntInRange(0, len(KEYS) - 1)]
    room = ROOMS[fdp.ConsumeIntInRange(0, len(ROOMS) - 1)]
    if kind == wire.Kind.HELLO:
        pool = fdp.ConsumeIntInRange(1, 4096) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, (1 << 32) - 1)
        return wire.hello_payload(
            wire.Hello(
                wire.Role(fdp.ConsumeIntInRange(0, 2)),
                0,
                4242,
                fdp.ConsumeIntInRange(0, 64),
                pool,
                pool * 4 & 0xFFFFFFFF,
                fdp.ConsumeIntInRange(0, 1 << 20),
                2000,
                "sglang",
                "0.5.23",
                "m",
                "0",
            )
        )
    if kind == wire.Kind.REQ_BEGIN:
        rid = RIDS[KEYS.index(key)]
        return wire.req_begin_payload(
            wire.ReqBegin(
                key, room, _position(fdp), _position(fdp), fdp.ConsumeBool(), rid, fdp.ConsumeUnicodeNoSurrogates(8)
            )
        )
    if kind == wire.Kind.REQ_END:
        return wire.req_end_payload(
            wire.ReqEnd(
                key,
                fdp.ConsumeIntInRange(0, 1 << 40),
                fdp.ConsumeIntInRange(0, 1 << 40),
                _position(fdp),
                wire.Finish(fdp.ConsumeIntInRange(0, len(wire.Finish) - 1)),
                "",
                fdp.ConsumeBool(),
            )
        )
    if kind in (wire.Kind.ALLOC, wire.Kind.FREE):
        return wire.pages_payload(_pages(fdp, 24), wire.FreeKind(fdp.ConsumeIntInRange(0, len(wire.FreeKind) - 1)))
    if kind == wire.Kind.ASSIGN:
        start = _position(fdp)
        return wire.assign_payload(
            wire.Assign(key, start, start + fdp.ConsumeIntInRange(0, 64), _position(fdp), _pages(fdp))
        )
    if kind == wire.Kind.FORWARD:
        n = fdp.ConsumeIntInRange(1, 4)
        keys = np.array([KEYS[fdp.ConsumeIntInRange(0, len(KEYS) - 1)] for _ in range(n)], np.uint64)
        seq = np.array([fdp.ConsumeIntInRange(0, 300) for _ in range(n)], np.uint32)
        writes = [_pages(fdp, 3) for _ in range(n)]
        with_rows = fdp.ConsumeBool()
        reads = [_pages(fdp, 8) for _ in range(n)] if with_rows else None
        return wire.forward_payload(
            wire.Forward(
                keys,
                seq,
                np.array([len(w) for w in writes], np.uint32),
                np.concatenate(writes).astype(np.int32),
                np.array([len(r) for r in reads], np.uint32) if reads else None,
                np.concatenate(reads).astype(np.int32) if reads else None,
            )
        )
    if kind == wire.Kind.XFER_RESERVE:
        return wire.xfer_reserve_payload(wire.XferReserve(key, room, _position(fdp), _pages(fdp)))
    if kind == wire.Kind.XFER_SEND:
        start = _position(fdp)
        return wire.xfer_send_payload(
            wire.XferSend(
                key,
                room,
                fdp.ConsumeIntInRange(0, (1 << 64) - 1),
                start,
                start + fdp.ConsumeIntInRange(0, 64),
                fdp.ConsumeBool(),
                _pages(fdp),
            )
        )
    if kind == wire.Kind.XFER_DONE:
        return wire.xfer_done_payload(
            wire.XferDone(
                key,
                room,
                wire.Side(fdp.ConsumeIntInRange(0, 1)),
                wire.XferStatus(fdp.ConsumeIntInRange(0, len(wire.XferStatus) - 1)),
            )
        )
    if kind == wire.Kind.XFER_DIGEST:
        return wire.xfer_digest_payload(
            wire.XferDigest(
                key,
                room,
                wire.Side(fdp.ConsumeIntInRange(0, 1)),
                wire.DigestAlg(fdp.ConsumeIntInRange(1, 3)),
                fdp.ConsumeIntInRange(0, (1 << 64) - 1),
                _position(fdp),
                _position(fdp),
                fdp.ConsumeIntInRange(0, 80),
                fdp.ConsumeIntInRange(0, 1 << 20),
                fdp.ConsumeIntInRange(0, 1 << 20),
                fdp.ConsumeIntInRange(0, 1 << 20),
            )
        )
    if kind == wire.Kind.REJECT:
        return wire.reject_payload(wire.Reject(key, wire.Phase(fdp.ConsumeIntInRange(0, len(wire.Phase) - 1)), "r"))
    scope = fdp.ConsumeIntInRange(0, 3)  # a few scopes, so that they meet
    if kind == wire.Kind.REQ_SCOPE:
        return wire.req_scope_payload(wire.ReqScope(key, scope))
    if kind == wire.Kind.CONTENT_CHANGED:
        return wire.content_changed_payload(wire.ContentChanged(fdp.ConsumeIntInRange(0, 1 << 20), _pages(fdp)))
    obj = fdp.ConsumeIntInRange(0, 3)
    if kind == wire.Kind.KV_STORE:
        return wire.kv_store_payload(wire.KvStore(key if fdp.ConsumeBool() else 0, obj, scope, scope, _pages(fdp)))
    if kind == wire.Kind.KV_LOAD:
        phase = wire.LoadPhase(fdp.ConsumeIntInRange(1, 3))
        return wire.kv_load_payload(wire.KvLoad(key if fdp.ConsumeBool() else 0, obj, scope, scope, phase, _pages(fdp)))
    if kind == wire.Kind.KV_DIGEST:
        side = wire.TierSide(fdp.ConsumeIntInRange(1, 2))
        return wire.kv_digest_payload(wire.KvDigest(key if fdp.ConsumeBool() else 0, obj, scope, side))
    if kind == wire.Kind.ENGINE_PART:  # the engine's own pid (routes to itself) or one never seen
        pid = HELLO.pid if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 9)
        return wire.engine_part_payload(wire.EnginePart(pid, wire.PartRole.WORKER, fdp.ConsumeIntInRange(0, 3)))
    if kind == wire.Kind.PAGE_IDENTITY:  # a few ids, so that a hit meets what was written (and differs)
        phase = wire.IdentityPhase(fdp.ConsumeIntInRange(1, 2))
        ids = np.array([fdp.ConsumeIntInRange(0, 3) for _ in range(fdp.ConsumeIntInRange(0, 12))], np.uint64)
        first = fdp.ConsumeIntInRange(0, 8) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, (1 << 32) - 1)
        return wire.page_identity_payload(wire.PageIdentity(key, first, phase, ids))
    return None  # the other kinds: raw payload bytes


def records(data: bytes) -> bytes:
    fdp = atheris.FuzzedDataProvider(data)
    out = [wire.encode(wire.Kind.HELLO, 0, 1, ENGINE, wire.hello_payload(HELLO))]
    seq, ts = 1, 1_000
    while fdp.remaining_bytes() and len(out) < 64:
        kind = KINDS[fdp.ConsumeIntInRange(0, len(KINDS) - 1)]
        payload = None
        try:
            if fdp.ConsumeIntInRange(0, 3):
                payload = _typed(fdp, kind)
        except (ValueError, OverflowError, struct_error):  # a field the encoder refuses: raw bytes instead
            payload = None
        if payload is None:
            payload = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 96))
        ts += fdp.ConsumeIntInRange(0, 1 << 34)  # up to ~17 s between records: timers fire
        out.append(wire.encode(kind, seq, ts, ENGINE, payload))
        seq += 1
    return b"".join(out)


struct_error = __import__("struct").error


def check(pipeline: Pipeline, peak_limit: dict) -> None:
    assert pipeline.apply_errors == 0, "a record raised inside Pipeline.apply (see the log above)"
    for eid, t in pipeline.engines.items():
        peak = peak_limit[eid] = max(peak_limit.get(eid, 0), t.pool.limit)
        # a later HELLO may announce a smaller pool: what the earlier one allowed stays allocated
        assert t.pool.num_pages <= peak, (t.pool.num_pages, peak)
        for row in t.rows.values():
            assert len(row.pages) <= t.row_limit, (len(row.pages), t.row_limit)
    ledger = pipeline.ledger
    assert ledger.nbytes <= ledger.max_bytes, (ledger.nbytes, ledger.max_bytes)
    for table in (ledger.rooms, ledger.pending, ledger.closed):
        for state in table.values():
            assert len(state.chunks) <= MAX_CHUNKS_PER_ROOM


def TestOneInput(data: bytes) -> None:
    stream = records(data)
    stats = wire.DecodeStats()
    # as the sidecar's ring reader decodes: runs, their length by the compiled kernels where built
    run_length = native.KERNELS.assign_run_length if native.KERNELS is not None else None
    decoded = wire.decode_stream(stream, stats, runs=True, run_length=run_length)
    pipeline = Pipeline([], history_events=1 << 10, memory_budget=MemoryBudget(160 * MIB, 1 << 10))
    peak_limit: dict = {}
    for rec in decoded:
        pipeline.apply(rec)
        check(pipeline, peak_limit)
    pipeline.tick(decoded[-1].ts_ns + (1 << 40) if decoded else 0)  # every timer due
    check(pipeline, peak_limit)


class _OnlyTracebacks(logging.Filter):
    """The sidecar logs what bad records it refuses (expected here, thousands a second); what a
    record raised inside ``Pipeline.apply`` is logged with its traceback, and that is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.exc_info is not None


def main() -> None:
    handler = logging.StreamHandler()
    handler.addFilter(_OnlyTracebacks())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

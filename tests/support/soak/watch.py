"""An in-process sidecar for the soak: the real ``Sidecar`` draining a ring directory
into the real pipeline, plus what the test needs to judge and explain a run.

* :class:`RecordKeeper` is passed as the sidecar's ``recorder``: it keeps the raw
  records (bounded) so that a finding can be explained record by record.
* :meth:`Watch.snapshot` reads the counters the test asserts on, under the
  sidecar's lock, while the engines are still up (a retired engine's tracker is
  dropped by the pipeline).
* :meth:`Watch.explain` dumps, for a finding, the reader's records and every record
  that names one of its pages (ALLOC/ASSIGN/FREE/XFER_*, FORWARD writes and reads).
"""

from __future__ import annotations

import os
import time
from collections import Counter, deque
from pathlib import Path
from typing import Any

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.sidecar.detectors.probing import PrefixProbingDetector
from kvguard.sidecar.detectors.ttft import TTFTDetector
from kvguard.sidecar.findings import Finding
from kvguard.sidecar.history import Event
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from kvguard.sidecar.tracker import STATE_NAMES, RequestInfo


class RecordKeeper:
    """``Sidecar(recorder=...)`` look-alike that keeps the last ``max_records`` records."""

    def __init__(self, max_records: int = 1_000_000):
        self.records: deque = deque(maxlen=max_records)
        self.total = 0

    def record_batch(self, records) -> None:
        self.records.extend(records)
        self.total += len(records)

    def record_tick(self, now_ns: int) -> None:
        pass

    def record_engine_gone(self, engine_id: int, ts_ns: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Watch:
    def __init__(self, ring_dir: str | Path, max_records: int = 1_000_000):
        self.memory = MemorySink()
        self.keeper = RecordKeeper(max_records)
        # the sidecar's defaults, ttft_anomaly included (KVGUARD_SOAK_TTFT=0 turns it off), and
        # the prefix-probing detector on: every tenant shares the soak's 48-token system prompt,
        # which it must not take for one tenant walking another's prompt
        self.sidecar = Sidecar(
            str(ring_dir),
            sinks=[self.memory],
            remove_dead_rings=False,
            recorder=self.keeper,
            ttft_anomaly=os.environ.get("KVGUARD_SOAK_TTFT", "1") == "1",
            detect_prefix_probing=True,
        )
        self.pipeline = self.sidecar.pipeline

    def __enter__(self) -> Watch:
        self.sidecar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sidecar.stop()

    # ------------------------------------------------------------------ draining
    def drain(self, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
        """Wait until the sidecar has applied everything the engines wrote so far
        (no new record for ``quiet_s`` and nothing pending in the merge buffer)."""
        deadline = time.monotonic() + timeout_s
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            with self.sidecar.lock:
                n = self.keeper.total
                pending = self.sidecar.rings.pending
                backlog = sum(r.backlog_bytes for r in self.sidecar.rings.readers.values())
            if n != last or pending or backlog:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.1)

    def judge_waiting_ttft(self) -> None:
        """End of the run: TTFT suspects still waiting for later requests are judged now
        (as when their engine goes), so the soak cannot end with a verdict outstanding."""
        with self.sidecar.lock:
            p = self.pipeline
            self.ttft_waiting_at_end = sum(len(w) for w in p.detectors.get(TTFTDetector).suspects.values())
            for eid in list(p.engines):
                p.out.emit(p.detectors.get(TTFTDetector).judge_waiting(eid, time.monotonic_ns()))

    def prefill_evidence(self) -> dict[str, Any]:
        """ttft_anomaly's gate on every request it could judge: for each normally finished,
        not re-prefilled request with >= 32 uncached prompt tokens on a unified or prefill
        engine, do the sidecar's records show its forwards writing its whole uncached
        prompt? On a healthy engine they must, or the gate would let a timing false alarm
        through (and would misreport the evidence of a real one)."""
        with self.sidecar.lock:
            p = self.pipeline
            begins = {}
            out = {"judged": 0, "explained": 0, "not_in_history": 0, "unexplained": []}
            for r in self.keeper.records:
                if r.kind == wire.Kind.REQ_BEGIN:
                    begins[(r.engine_id, r.body.req_key)] = r.body
                    continue
                if (
                    r.kind != wire.Kind.REQ_END
                    or r.body.reprefilled
                    or r.body.finish not in (wire.Finish.LENGTH, wire.Finish.STOP)
                ):
                    continue
                b = begins.get((r.engine_id, r.body.req_key))
                t = p.engines.get(r.engine_id)
                if b is None or b.warmup or t is None or t.hello is None or t.hello.role == wire.Role.DECODE:
                    continue
                if b.prompt_tokens - b.cached_tokens < p.detectors.get(TTFTDetector).min_tokens:
                    continue
                info = RequestInfo(
                    b.req_key, b.rid, b.tenant, prompt_tokens=b.prompt_tokens, cached_tokens=b.cached_tokens
                )
                got = prompt_pages_from_history(p, r.engine_id, info)
                out["judged"] += 1
                if got is None:
                    out["not_in_history"] += 1
                elif got[0] + 1 >= got[1]:
                    out["explained"] += 1
                else:
                    out["unexplained"].append(
                        (b.rid, b.prompt_tokens, b.cached_tokens, *got, self._request_trace(r.engine_id, b.req_key))
                    )
            return out

    def _request_trace(self, engine_id: int, key: int, limit: int = 40) -> list[str]:
        """What the records say about one request: its rows, forwards, end (for a failure message)."""
        out = []
        for r in self.keeper.records:
            b = r.body
            if r.engine_id != engine_id:
                continue
            if r.kind == wire.Kind.ASSIGN and b.req_key == key:
                out.append(
                    f"#{r.seq} ASSIGN [{b.row_start},{b.row_end}) shared_until={b.shared_until} "
                    f"pages={b.pages.tolist()[:16]}"
                )
            elif r.kind == wire.Kind.FORWARD and key in b.req_keys.tolist():
                keys, wo = b.req_keys.tolist(), 0
                for i, k in enumerate(keys):
                    wc = int(b.write_counts[i])
                    if k == key:
                        out.append(
                            f"#{r.seq} FORWARD seq_len={int(b.seq_lens[i])} wrote={b.write_pages[wo : wo + wc].tolist()} "
                            f"batch={len(keys)}"
                        )
                    wo += wc
            elif r.kind in (wire.Kind.REQ_BEGIN, wire.Kind.REQ_END, wire.Kind.REJECT) and b.req_key == key:
                out.append(f"#{r.seq} {r.kind.name} {b}")
        return out[:limit]

    # ------------------------------------------------------------------ counters
    def snapshot(self) -> dict[str, Any]:
        with self.sidecar.lock:
            p, rings = self.pipeline, self.sidecar.rings
            engines = {}
            for eid, t in p.engines.items():
                h = t.hello
                name = f"{wire.Role(h.role).name.lower()}:{h.pid}" if h is not None else f"engine:{eid}"
                engines[name] = {
                    "engine_id": eid,
                    "pages_read": t.judge.pages_read,
                    "pages_unverified": t.judge.pages_unverified,
                    "live_requests": len(t.requests.live),
                    "rows": len(t.rows),
                    "page_states": t.pool.counts_by_state(),
                    "pool_tokens": getattr(h, "pool_tokens", None),
                    "context_len": getattr(h, "context_len", None),
                    "max_req_input_len": getattr(h, "max_req_input_len", None),
                }
            decode = Counter()
            for r in rings.readers.values():
                for f in ("unknown_kind", "bad_version", "bad_payload", "corrupt_bytes"):
                    decode[f] += getattr(r.stats, f)
            return {
                "records_by_kind": dict(sorted(p.records_by_kind.items())),
                "findings_by_kind": {f"{k}/{s}": n for (k, s), n in sorted(p.findings_by_kind.items())},
                "findings_delivered": len(self.memory.findings),
                "findings_suppressed": p.findings_suppressed,
                "records_lost_pipeline": p.records_lost,
                "records_lost_rings": rings.stats.records_lost,
                "dropped_before_attach": sum(rings.stats.dropped_before_attach.values()),
                "ring_errors": rings.stats.ring_errors,
                "ring_last_error": rings.stats.last_error,
                "ring_decode_errors": dict(decode),
                "apply_errors": p.apply_errors,
                "ttft": {
                    "enabled": p.detectors.get(TTFTDetector).enabled,
                    "suspects_cleared": p.detectors.get(TTFTDetector).suspects_cleared,
                    "suspects_explained": p.detectors.get(TTFTDetector).suspects_explained,
                    "suspects_waiting_at_end": getattr(self, "ttft_waiting_at_end", None),
                    "samples": {eid: len(m.samples) for eid, m in p.detectors.get(TTFTDetector).models.items()},
                },
                # the probing detector's view of the shared system prompt: hits crossed tenants,
                # some with prompts just past the hit, and none of it was a walk
                "prefix_probing": {
                    "enabled": p.detectors.get(PrefixProbingDetector).enabled,
                    "cross_tenant_hits": p.detectors.get(PrefixProbingDetector).cross_tenant_hits,
                    "tenant_pairs": len(p.detectors.get(PrefixProbingDetector).pairs),
                },
                # content identity (KVGUARD_PAGE_IDENTITY): pages recorded and prefix-hit pages judged
                "page_identity": dict(p.pages.identity.as_dict()),
                "records_read": rings.stats.records_read,
                "transfers": {
                    "paired": p.ledger.paired,
                    "unverified": p.ledger.unverified,
                    "unpaired": p.ledger.unpaired,
                    "warmup": p.ledger.warmups,
                    "rooms_reused": p.ledger.rooms_reused,
                    "digests_compared": p.ledger.digests_compared,
                },
                "engines": engines,
            }

    def probe_errors(self) -> list[dict[str, Any]]:
        return [
            {"engine_id": r.engine_id, "probe": r.body.probe, "error": r.body.error, "count": r.body.count}
            for r in self.keeper.records
            if r.kind == wire.Kind.PROBE_ERROR
        ]

    # ------------------------------------------------------------------ explaining
    def rid_of(self, key: int) -> str:
        for r in self.keeper.records:
            if r.kind == wire.Kind.REQ_BEGIN and r.body.req_key == key:
                return r.body.rid
        return f"key:{key:016x}"

    def _describe(self, rec: wire.Record, pages: set[int], keys: set[int], names: dict[int, str]) -> str | None:
        b, k = rec.body, rec.kind
        head = f"{rec.ts_ns} e{rec.engine_id} #{rec.seq} {k.name}"
        name = lambda key: names.get(key, f"{key:016x}")
        if k == wire.Kind.FORWARD:
            parts, wo, ro = [], 0, 0
            for i, key in enumerate(b.req_keys.tolist()):
                wc = int(b.write_counts[i])
                rc = int(b.read_counts[i]) if b.read_counts is not None else 0
                w = b.write_pages[wo : wo + wc].tolist()
                rd = b.read_pages[ro : ro + rc].tolist() if b.read_pages is not None else []
                wo, ro = wo + wc, ro + rc
                hit_w = sorted(set(w) & pages)
                hit_r = sorted(set(rd) & pages)
                if key in keys or hit_w or hit_r:
                    parts.append(
                        f"{name(key)} seq_len={int(b.seq_lens[i])} writes={sorted(set(w))} "
                        f"reads[{len(rd)}]={rd if key in keys else hit_r}"
                    )
            return f"{head} " + "; ".join(parts) if parts else None
        key = getattr(b, "req_key", None)
        bp = getattr(b, "pages", None)
        touched = sorted(set(bp.tolist()) & pages) if bp is not None else []
        if key not in keys and not touched:
            return None
        if k == wire.Kind.ASSIGN:
            return (
                f"{head} {name(b.req_key)} rows [{b.row_start},{b.row_end}) shared_until={b.shared_until} "
                f"pages={b.pages.tolist()}"
            )
        if k in (wire.Kind.ALLOC, wire.Kind.FREE):
            extra = f" ({b.free_kind.name})" if k == wire.Kind.FREE else ""
            return f"{head}{extra} pages involved={touched} of {len(bp)}"
        if k == wire.Kind.REQ_BEGIN:
            return (
                f"{head} {b.rid} tenant={b.tenant} prompt={b.prompt_tokens} cached={b.cached_tokens} "
                f"room={b.room} warmup={b.warmup}"
            )
        if k == wire.Kind.REQ_END:
            return f"{head} {name(b.req_key)} finish={b.finish.name} out={b.output_tokens} reason={b.reason!r}"
        if k == wire.Kind.REJECT:
            return f"{head} {name(b.req_key)} phase={b.phase.name} reason={b.reason!r}"
        fields = {f: getattr(b, f) for f in getattr(b, "__slots__", ()) if f != "pages"}
        return f"{head} {fields} pages={bp.tolist() if bp is not None else None}"

    def explain(self, finding: Finding, max_pages: int = 6, max_lines: int = 200) -> str:
        """The finding, the pages' tracker state and history events, then the raw records:
        first every record of the reader and of the exposed requests, then the records
        that name one of the pages (the last ``max_lines`` up to the finding, a few after)."""
        d = finding.to_dict()
        pages = set(int(x) for x in list(finding.pages)[:max_pages])
        names: dict[int, str] = {}
        for r in self.keeper.records:
            if r.kind == wire.Kind.REQ_BEGIN:
                names[r.body.req_key] = r.body.rid
        keys = set()
        if (d.get("reader") or {}).get("rid"):
            keys.add(wire.request_key(d["reader"]["rid"]))
        for party in d.get("exposed") or []:
            if not str(party["rid"]).startswith("key:"):
                keys.add(wire.request_key(party["rid"]))
        lines = [f"FINDING {d}"]
        with self.sidecar.lock:
            hist = self.pipeline.history
            for t in self.pipeline.engines.values():
                for page in sorted(pages):
                    if page >= t.pool.num_pages:
                        continue
                    pool = t.pool
                    lines.append(
                        f"  engine {t.engine_id} page {page} now: state={STATE_NAMES[int(pool.state[page])]} "
                        f"gen={int(pool.gen[page])} written_gen={int(pool.written_gen[page])} "
                        f"owner={names.get(int(pool.owner[page]), int(pool.owner[page]))} "
                        f"last_writer={names.get(int(pool.last_writer[page]), int(pool.last_writer[page]))}"
                    )
                    if hist is not None:
                        for ev in hist.page_events(t.engine_id, page, limit=12):
                            lines.append(
                                f"    hist {int(ev['ts_ns'])} {Event(int(ev['event'])).name} "
                                f"{names.get(int(ev['req_key']), int(ev['req_key']))} gen={int(ev['gen'])} "
                                f"aux={int(ev['aux'])}"
                            )
        mine, around = [], []
        for r in self.keeper.records:
            s = self._describe(r, set(), keys, names)
            if s is not None:
                mine.append("    " + s)
            elif pages:
                s = self._describe(r, pages, set(), names)
                if s is not None:
                    around.append((r.ts_ns, "    " + s))
        lines.append(f"  records of the reader and the exposed requests ({len(mine)}):")
        lines += mine[:max_lines]
        before = [s for ts, s in around if ts <= d["first_seen_ns"]][-max_lines:]
        after = [s for ts, s in around if ts > d["first_seen_ns"]][:20]
        lines.append(
            f"  records naming pages {sorted(pages)} (last {len(before)} up to the finding, {len(after)} after):"
        )
        return "\n".join(lines + before + ["    -- finding --"] + after)

    def pages_of(self, finding: Finding) -> np.ndarray:
        return np.asarray(finding.pages, np.int64)


def prompt_pages_from_history(pipeline, engine_id: int, info: RequestInfo) -> tuple[int, int] | None:
    """The soak's reference for ttft_anomaly's prefill evidence, from the sidecar's bounded
    event history rather than from the tracker's counts: (pages this request's own forwards
    wrote while its seq_len was within its prompt, pages its uncached prompt spans); None
    when the history no longer holds its REQ_BEGIN. Counted per forward, as the tracker
    counts (tracker.count_prompt_writes)."""
    t = pipeline.engines.get(engine_id)
    if t is None or pipeline.history is None:
        return None
    ev = pipeline.history.request_events(info.key, limit=pipeline.history.capacity)
    ev = ev[ev["engine"] == engine_id]
    if not (ev["event"] == Event.REQ_BEGIN).any():
        return None
    prompt = info.prompt_tokens
    prefill_ts = ev["ts_ns"][(ev["event"] == Event.READ) & (ev["aux"] <= prompt)]
    writes = ev[(ev["event"] == Event.WRITE) & np.isin(ev["ts_ns"], prefill_ts)]
    ps = max(t.page_size, 1)
    per_forward = np.unique(writes[["ts_ns", "page"]]) if len(writes) else writes
    return len(per_forward), -(-prompt // ps) - info.cached_tokens // ps

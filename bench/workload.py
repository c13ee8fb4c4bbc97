"""The reference workload as a synthetic record stream, written through the public probe API.

What it models (one H200 decode rank of a GLM-class MLA model, see the brief's
"Performance" section and docs/performance.md):

* page 64 tokens, pool 32,768 pages (2,097,152 tokens), decode batch 256, mean context
  32k tokens (512 pages per request), 60 decode steps/s.
* 256 x 512 = 131,072 page reads per step is four times the pool, so the model needs
  prefix sharing: 4 prefix groups, each a 26,624-token (416-page) prefix written once by
  a seed request and then kept by the prefix cache (shared, read-only); every request
  has one of them, then a private prompt of 5,184 tokens (81 pages) and generates 1,920
  tokens (30 pages). Mean context: 26,624 + 5,184 + 960 = 32,768 tokens. Live pages:
  1,664 shared + 256 x ~96 private = ~26k of 32,768.
* Each decode step is what the SGLang adapter (engine_hooks/sglang) emits for one
  ``alloc_for_decode`` + ``ModelRunner.forward``: one ALLOC with the pages the batch
  starts this step (~4: 256 requests cross a page boundary every 64 steps), ASSIGNs
  (``assign="page"``, what ``alloc_for_decode``'s hook sends: one per request whose
  token starts a new page, ~4 per step; or ``assign="token"``: one per request per
  step, what the adapter sent before), and one FORWARD with 256 requests, each writing
  1 slot and reading its first ``seq_len`` tokens. Every ``rows_every``-th FORWARD
  (counting every forward, prefills included, as the adapter's fixed interval does:
  ``engine_hooks/sglang/row_sampler.py``, ``KVGUARD_ROW_SAMPLE_EVERY``) also carries the
  engine's actual rows (256 x 512 x 4 bytes = 512 KiB at the reference shape); the
  others carry seq_lens only and the sidecar judges its own model of each row.
  ``rows_every=1`` is a row table with every FORWARD (the adapter before it sampled),
  ``0`` never. The defaults (``rows_every=16``, ``assign="page"``) are what the adapter
  sends with ``KVGUARD_ROW_SAMPLE_EVERY=16``; under its default CPU budget
  (``KVGUARD_ROW_SAMPLE_BUDGET_US=30``) a batch of 256 at 32k context gets rows about
  every 25th forward instead (measured cost, not modelled here), so 16 errs on the side
  of more sidecar work.
* Initial requests are staggered (request i has generated i * 1,920 / 256 tokens), so
  one request finishes every 7.5 steps (8 requests/s): FREE of its private pages, REQ_END,
  then a new request arrives: REQ_BEGIN, ALLOC, ASSIGN of its whole row (prefix shared),
  and an extend FORWARD writing its private prompt. Allocations and frees come to
  ~8 x 111 = ~890 pages/s each (the brief's ~1k/s).
* An 8-rank node is 8 rings carrying this stream (``bench.sidecar_bench`` replays one
  captured stream into each ring; each ring is its own engine to the sidecar).

Everything goes through ``engine_hooks.probes.Probes`` (slot -> page conversion, request
keys, payload encoding), so the bytes are exactly what an engine's probes produce. A
``CaptureWriter`` (a ``RingWriter`` look-alike) keeps the records so that a stream is
generated once and then replayed into real rings (``publish``), where each record gets a
fresh sequence number and timestamp.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes


@dataclass(frozen=True)
class WorkloadParams:
    page_size: int = 64
    pool_tokens: int = 32_768 * 64
    batch: int = 256
    prefix_groups: int = 4
    prefix_tokens: int = 26_624  # shared by the requests of a group; a multiple of page_size
    prompt_tokens: int = 5_184  # private part of each prompt
    output_tokens: int = 1_920  # decode tokens per request
    steps_per_s: float = 60.0
    # the engine's rows ride on every Nth FORWARD (all forwards counted, as the adapter's
    # fixed KVGUARD_ROW_SAMPLE_EVERY); 1 = every FORWARD, 0 = never
    rows_every: int = 16
    # "page": an ASSIGN only for requests whose token starts a page (the adapter today);
    # "token": one per request per step (the adapter before, the worst case)
    assign: str = "page"

    def __post_init__(self):
        if self.prefix_tokens % self.page_size:
            raise ValueError(f"prefix_tokens {self.prefix_tokens} must be a multiple of page_size {self.page_size}")
        if self.assign not in ("token", "page"):
            raise ValueError(f"assign must be 'token' or 'page', got {self.assign!r}")
        if self.rows_every < 0:
            raise ValueError(f"rows_every must be >= 0 (0 = never), got {self.rows_every}")
        if self.batch < 1 or self.output_tokens < 1:
            raise ValueError("batch and output_tokens must be >= 1")

    @property
    def pool_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def mean_context_tokens(self) -> float:
        return self.prefix_tokens + self.prompt_tokens + self.output_tokens / 2

    @property
    def mean_context_pages(self) -> float:
        return self.mean_context_tokens / self.page_size

    @property
    def page_reads_per_s(self) -> float:
        return self.batch * self.mean_context_pages * self.steps_per_s

    def with_context(self, tokens: int) -> WorkloadParams:
        """The same mix (prefix : prompt : output) scaled to a mean context of ``tokens``."""
        f = tokens / 32_768
        ps = self.page_size
        prefix = max(ps, round(26_624 * f / ps) * ps)
        return replace(
            self, prefix_tokens=prefix, prompt_tokens=max(1, round(5_184 * f)), output_tokens=max(2, round(1_920 * f))
        )

    def describe(self) -> str:
        return (
            f"page {self.page_size}, pool {self.pool_pages} pages, batch {self.batch}, mean context "
            f"{self.mean_context_tokens:.0f} tokens ({self.mean_context_pages:.0f} pages), "
            f"{self.rows_label()}, assign per {self.assign}"
        )

    def rows_label(self) -> str:
        if self.rows_every == 0:
            return "no rows"
        return "rows every forward" if self.rows_every == 1 else f"rows every {self.rows_every}th forward"


class CaptureWriter:
    """A ``RingWriter`` look-alike that keeps ``(kind, payload, flags)`` for later replay."""

    def __init__(self):
        self.items: list[tuple[int, bytes, int]] = []
        self.records_written = 0
        self.dropped_records = 0

    def write(self, kind, payload: bytes, pool: int = 0, flags: int = 0) -> bool:
        self.items.append((int(kind), payload, flags))
        self.records_written += 1
        return True

    def write_sticky(self, kind, payload: bytes) -> bool:
        return self.write(kind, payload)


@dataclass
class _Req:
    rid: str
    slots: np.ndarray  # int64 token slots of positions 0..cap-1 (filled up to seq)
    seq: int
    cap: int
    private_pages: list = field(default_factory=list)


class Workload:
    """Drives ``Probes`` with the reference workload of one decode rank."""

    def __init__(self, params: WorkloadParams, probes: Probes, rank: int = 0, reserve_pages: int = 0):
        self.p = params
        self.probes = probes
        self.rank = rank
        # page 0 is SGLang's padding page; the top ``reserve_pages`` are left to the caller (latency injections)
        self.free = deque(range(1, params.pool_pages - reserve_pages))
        self.prefixes: list[np.ndarray] = []
        self.live: list[_Req] = []
        self.admitted = 0
        self.page_reads = 0  # pages read in FORWARD records so far (sum of ceil(seq_len / page_size))
        self.steps = 0
        self.forwards = 0  # FORWARDs sent so far (the adapter's row-sample counter)

    # ------------------------------------------------------------------ pages
    def _take_pages(self, n: int) -> list:
        if n > len(self.free):
            raise RuntimeError(f"workload model ran out of pages ({n} wanted, {len(self.free)} free): pool too small")
        return [self.free.popleft() for _ in range(n)]

    def _page_slots(self, pages: list, tokens: int) -> np.ndarray:
        ps = self.p.page_size
        base = np.repeat(np.asarray(pages, np.int64) * ps, ps)
        return (base + np.tile(np.arange(ps, dtype=np.int64), len(pages)))[:tokens]

    def _forward(self, rids, seq_lens, writes, rows) -> None:
        """One FORWARD; the rows go with every ``rows_every``-th (the adapter's ``RowSampler``, fixed interval)."""
        self.forwards += 1
        every = self.p.rows_every
        self.probes.forward(rids, seq_lens, writes, rows() if every and self.forwards % every == 0 else None)

    def _reads(self, seq: int) -> int:
        return -(-seq // self.p.page_size)

    # ------------------------------------------------------------------ phases
    def setup(self) -> None:
        """HELLO, the prefix seeds (written, then kept by the prefix cache), the initial batch."""
        p, pr = self.p, self.probes
        context = min(131_072, p.pool_tokens)  # a pool smaller than the context is a finding of its own
        pr.hello(
            "decode",
            self.rank,
            p.page_size,
            p.pool_pages,
            p.pool_tokens,
            context,
            context,
            "sglang",
            "0.5.23",
            "bench-glm-mla",
        )
        ps = p.page_size
        for g in range(p.prefix_groups):
            rid = f"seed-{self.rank}-{g}"
            pages = self._take_pages(p.prefix_tokens // ps)
            slots = self._page_slots(pages, p.prefix_tokens)
            pr.request_begin(rid, "system", None, p.prefix_tokens, 0, False)
            pr.pages_allocated(slots[::ps])
            pr.rows_assigned(rid, 0, p.prefix_tokens, 0, slots)
            self._forward([rid], [p.prefix_tokens], [slots], lambda slots=slots: [slots])
            self.page_reads += self._reads(p.prefix_tokens)
            pr.request_end(rid, "length", 1_000_000, 1_000_000, 1, "")
            self.prefixes.append(slots)
        for i in range(p.batch):
            self._admit(generated=(i * p.output_tokens) // p.batch)

    def _admit(self, generated: int = 0) -> None:
        p, pr, ps = self.p, self.probes, self.p.page_size
        n = self.admitted
        self.admitted += 1
        rid = f"req-{self.rank}-{n}"
        prefix = self.prefixes[n % len(self.prefixes)]
        seq = p.prefix_tokens + p.prompt_tokens + generated
        cap = p.prefix_tokens + p.prompt_tokens + p.output_tokens
        slots = np.zeros(cap, np.int64)
        slots[: p.prefix_tokens] = prefix
        private = seq - p.prefix_tokens
        pages = self._take_pages(math.ceil(private / ps))
        slots[p.prefix_tokens : seq] = self._page_slots(pages, private)
        pr.request_begin(rid, f"tenant-{n % 8}", None, p.prefix_tokens + p.prompt_tokens, p.prefix_tokens, False)
        pr.pages_allocated(np.asarray(pages, np.int64) * ps)
        pr.rows_assigned(rid, 0, seq, p.prefix_tokens, slots[:seq])
        self._forward([rid], [seq], [slots[p.prefix_tokens : seq]], lambda: [slots[:seq]])
        self.page_reads += self._reads(seq)
        self.live.append(_Req(rid, slots, seq, cap, pages))

    def _finish(self, r: _Req) -> None:
        p, pr = self.p, self.probes
        pr.pages_freed(r.slots[p.prefix_tokens : r.seq])
        pr.request_end(r.rid, "length", 50_000_000, 30_000_000_000, p.output_tokens, "")
        self.free.extend(r.private_pages)

    def step(self) -> None:
        """One decode step of the whole batch, then finished requests leave and new ones arrive."""
        p, pr, ps = self.p, self.probes, self.p.page_size
        new_page_slots = []
        positions = []
        for r in self.live:
            s = r.seq
            if s % ps == 0:
                (page,) = self._take_pages(1)
                r.private_pages.append(page)
                r.slots[s] = page * ps
                new_page_slots.append(page * ps)
            else:
                r.slots[s] = r.slots[s - 1] + 1
            positions.append(s)
        if new_page_slots:
            pr.pages_allocated(np.asarray(new_page_slots, np.int64))
        for r, s in zip(self.live, positions):
            if p.assign == "token" or s % ps == 0:
                pr.rows_assigned(r.rid, s, s + 1, s, r.slots[s : s + 1])
        for r in self.live:
            r.seq += 1
        seq_lens = [r.seq for r in self.live]
        self._forward(
            [r.rid for r in self.live],
            seq_lens,
            [r.slots[s : s + 1] for r, s in zip(self.live, positions)],
            lambda: [r.slots[: r.seq] for r in self.live],
        )
        self.page_reads += sum(self._reads(s) for s in seq_lens)
        self.steps += 1
        done = [r for r in self.live if r.seq >= r.cap]
        if done:
            self.live = [r for r in self.live if r.seq < r.cap]
            for r in done:
                self._finish(r)
                self._admit()


@dataclass
class Stream:
    """A captured record stream: setup records, then one list of records per decode step."""

    params: WorkloadParams
    setup: list
    steps: list
    setup_page_reads: int
    step_page_reads: list

    @property
    def page_reads(self) -> int:
        return self.setup_page_reads + sum(self.step_page_reads)

    def step_bytes(self) -> float:
        """Mean ring bytes per decode step (records padded to 8, 32-byte headers)."""
        total = sum(wire.HEADER_SIZE + ((len(pl) + 7) & ~7) for step in self.steps for _k, pl, _f in step)
        return total / max(len(self.steps), 1)

    def step_records(self) -> float:
        return sum(len(s) for s in self.steps) / max(len(self.steps), 1)


def capture(params: WorkloadParams, steps: int, rank: int = 0, reserve_pages: int = 0) -> Stream:
    """Generate ``steps`` decode steps of the workload through Probes into memory."""
    writer = CaptureWriter()
    probes = Probes(writer, page_size=params.page_size)
    w = Workload(params, probes, rank, reserve_pages)
    w.setup()
    setup = writer.items
    setup_reads = w.page_reads
    out, reads = [], []
    for _ in range(steps):
        writer.items = []
        before = w.page_reads
        w.step()
        out.append(writer.items)
        reads.append(w.page_reads - before)
    if probes.probe_errors:
        raise RuntimeError(
            f"workload generation hit {probes.probe_errors} probe errors (disabled: {sorted(probes.disabled_probes)})"
        )
    return Stream(params, setup, out, setup_reads, reads)


def publish(writer, items) -> int:
    """Replay captured records into a real ``RingWriter``; returns how many were dropped."""
    dropped = 0
    for kind, payload, flags in items:
        if kind == wire.Kind.HELLO:
            ok = writer.write_sticky(wire.Kind(kind), payload)
        else:
            ok = writer.write(wire.Kind(kind), payload, flags=flags)
        dropped += not ok
    return dropped

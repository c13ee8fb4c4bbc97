"""Tier 1, the engine's own read check (engine_hooks/tier1.py).

Three layers:
  * the tag model on its own (torch on CPU): every engine behaviour that must not
    alarm (radix prefix sharing, chunked prefill, retraction and re-admission, PD
    decode reservations, padding slot 0, rows of unknown requests, padded batch
    entries) and every bug it must catch (a row entry naming another request's
    page, a freed page, a page handed out but never assigned), with the request
    and page named in the log line, the counter and the ring record;
  * bad input (a tensor of an unexpected dtype or device): logged once, counted,
    Tier 1 off, the engine's forward unaffected;
  * the adapter's real hook functions on real SGLang 0.5.23 objects (a paged
    allocator, a ReqToTokenPool, alloc_for_decode, a ForwardBatch), in a
    subprocess because importing SGLang takes 10-20 s (marked ``engine``).
The same check on a CUDA device is marked ``gpu`` and skipped without one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvguard.engine_hooks import probes as probes_mod  # noqa: E402
from kvguard.engine_hooks import tier1 as t1  # noqa: E402
from kvguard.engine_hooks import wire  # noqa: E402
from kvguard.engine_hooks.ring import RingReader, RingWriter  # noqa: E402
from kvguard.engine_hooks.row_sampler import RowSampler  # noqa: E402
from kvguard.engine_hooks.sglang import _runtime as rt  # noqa: E402
from kvguard.engine_hooks.sglang import hooks_rows as hr  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PS = 4  # page size
ROWS, CTX = 8, 64


class Engine:
    """The pieces of an engine Tier 1 looks at: req_to_token rows, the batch's row
    indices and lengths, on ``device``; and the Tier1 object fed as the hooks feed it."""

    def __init__(self, device="cpu", pages=64):
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((ROWS, CTX), dtype=torch.int32, device=self.device)
        self.found: list[t1.Violation] = []
        self.t = t1.Tier1(pages, PS, on_violation=lambda v, total: self.found.append(v))
        self.rows: dict[str, int] = {}

    def admit(self, rid, row):
        self.rows[rid] = row
        self.t.bind_row(row, rid)

    def write_row(self, rid, start, pages, shared_until=0, tokens=None):
        """Row positions [start, start + len(pages) * PS) onto ``pages`` (whole pages),
        as alloc_for_extend / decode / the radix cache write them, and tell Tier 1."""
        slots = np.concatenate([np.arange(p * PS, p * PS + PS) for p in pages])
        if tokens is not None:
            slots = slots[:tokens]
        row = self.rows[rid]
        self.req_to_token[row, start : start + len(slots)] = torch.as_tensor(slots, dtype=torch.int32)
        self.t.assigned(rid, start, shared_until, np.asarray(pages))

    def check(self, batch: dict[str, int], pad: int = 0):
        """One forward over ``{rid: seq_len}``; ``pad`` extra padding entries (row 0)."""
        rids = list(batch)
        idx = [self.rows[r] for r in rids] + [0] * pad
        seq = list(batch.values()) + [1] * pad
        n = self.t.check(
            self.req_to_token, torch.tensor(idx, device=self.device), torch.tensor(seq, device=self.device), rids
        )
        self.t.flush()
        return n


# --------------------------------------------------------------------------- healthy engine behaviour
def test_private_rows_decode_and_padding_are_clean():
    e = Engine()
    e.t.allocated([1, 2, 3, 4])
    e.admit("a", 1)
    e.admit("b", 2)
    e.write_row("a", 0, [1, 2])
    e.write_row("b", 0, [3, 4], tokens=6)
    assert e.check({"a": 8, "b": 6}, pad=2) == 0  # padded entries (row 0, slot 0) are not requests
    # decode: b's token 7 lands in its last page (no assignment); a's token 9 starts a new page
    e.t.allocated([5])
    e.write_row("a", 8, [5], shared_until=8, tokens=1)
    assert e.check({"a": 9, "b": 7}) == 0
    # stale entries past seq_len are never read: a's row beyond 9 may hold anything
    e.req_to_token[1, 12:16] = 3 * PS
    assert e.check({"a": 9}) == 0
    assert e.found == [] and e.t.checks == 3


def test_radix_prefix_sharing_chunked_prefill_and_the_cache_keeping_pages_are_clean():
    e = Engine()
    e.t.allocated([1, 2, 3])
    e.admit("a", 1)
    # chunked prefill: two chunks; the second is assigned from where the first ended
    e.write_row("a", 0, [1, 2])
    e.write_row("a", 8, [3], shared_until=8)
    assert e.check({"a": 12}) == 0
    # b matches a's first two pages in the radix cache and adds its own page
    e.t.allocated([4])
    e.admit("b", 2)
    e.write_row("b", 0, [1, 2], shared_until=8)
    e.write_row("b", 8, [4], shared_until=8)
    assert e.check({"a": 12, "b": 12}) == 0
    # a finishes: its private page goes back, the shared ones stay in the cache; c reuses them
    e.t.freed([3])
    e.t.unbind_row(1)
    e.t.allocated([3])
    e.admit("c", 1)
    e.write_row("c", 0, [1, 2], shared_until=8)
    e.write_row("c", 8, [3], shared_until=8)
    assert e.check({"b": 12, "c": 12}) == 0
    assert e.found == []


def test_retraction_and_readmission_are_clean():
    e = Engine()
    e.t.allocated([1, 2])
    e.admit("a", 3)
    e.write_row("a", 0, [1, 2])
    assert e.check({"a": 8}) == 0
    # retracted: its pages are released (page 1 kept by the radix cache), its row freed
    e.t.freed([2])
    e.t.unbind_row(3)
    # re-admitted on another row: page 1 from the cache as prefix, a fresh page for the rest
    e.t.allocated([7])
    e.admit("a", 5)
    e.write_row("a", 0, [1], shared_until=4)
    e.write_row("a", 4, [7], shared_until=4)
    assert e.check({"a": 8}) == 0 and e.found == []


def test_pd_decode_reserved_pages_are_clean():
    """DecodePreallocQueue: the decode-side radix prefix as shared, then the pages the
    transfer fills as the request's own (hooks_disagg reports both through rows_assigned)."""
    e = Engine()
    e.t.allocated([9, 10, 11])
    e.admit("pd-1", 2)
    e.write_row("pd-1", 0, [9], shared_until=4)  # prefix already in decode's cache
    e.write_row("pd-1", 4, [10, 11], shared_until=4)
    assert e.check({"pd-1": 12}) == 0 and e.found == []


def test_rows_of_requests_tier1_never_saw_bound_are_not_judged():
    e = Engine()
    e.req_to_token[4, :4] = torch.arange(8, 12, dtype=torch.int32)  # page 2, tagged nothing
    e.t.freed([2])
    e.rows["stranger"] = 4  # bound before Tier 1 started: no row tag
    assert e.check({"stranger": 4}) == 0


# --------------------------------------------------------------------------- bugs it catches
def test_a_row_entry_naming_another_requests_page_is_a_violation_naming_both(caplog):
    e = Engine()
    e.t.allocated([1, 2, 3, 4])
    e.admit("reader", 1)
    e.admit("owner", 2)
    e.write_row("reader", 0, [1, 2])
    e.write_row("owner", 0, [3, 4])
    e.req_to_token[1, PS : 2 * PS] = e.req_to_token[2, PS : 2 * PS]  # row page 1 -> owner's page 4
    with caplog.at_level(logging.ERROR, logger="kvguard.tier1"):
        assert e.check({"reader": 8, "owner": 8}) == 1
    (v,) = e.found
    assert (v.rid, v.pages, v.row_indices, v.owners, v.tags) == ("reader", [4], [1], ["owner"], [t1.TAG_OTHER])
    assert e.t.violations == 1 and e.t.reported == 1
    (line,) = [r.getMessage() for r in caplog.records if "VIOLATION" in r.getMessage()]
    assert "request reader" in line and "page 4" in line and "request owner" in line
    # the corrupt row read again next step: counted, not logged again
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kvguard.tier1"):
        assert e.check({"reader": 8}) == 1
    assert e.t.violations == 2 and e.t.reported == 1 and len(e.found) == 1
    assert not [r for r in caplog.records if "VIOLATION" in r.getMessage()]


def test_a_freed_page_still_in_a_row_and_a_page_never_assigned_are_violations():
    e = Engine()
    e.t.allocated([1, 2, 3])
    e.admit("a", 1)
    e.write_row("a", 0, [1, 2])
    e.t.freed([2])  # freed early while a still reads it (use after free)
    e.req_to_token[1, 2 * PS : 3 * PS] = torch.arange(3 * PS, 4 * PS, dtype=torch.int32)  # allocated, not a's
    assert e.check({"a": 12}) == 2
    (v,) = e.found
    assert sorted(zip(v.pages, v.tags)) == [(2, t1.TAG_FREE), (3, t1.TAG_ALLOCATED)]
    assert v.owners == [None, None]


def test_an_own_assignment_does_not_take_another_requests_page():
    """The allocator hands b a page a still owns (a double allocation): b's assignment
    does not make the page b's, so b reading it is caught (and so is a, once the
    allocator's hand-out marks it ALLOCATED)."""
    e = Engine()
    e.t.allocated([1])
    e.admit("a", 1)
    e.admit("b", 2)
    e.write_row("a", 0, [1])
    e.write_row("b", 0, [1])  # no alloc seen for b: page 1 is a's
    assert e.check({"a": 4, "b": 4}) == 1
    assert [(v.rid, v.owners) for v in e.found] == [("b", ["a"])]


# --------------------------------------------------------------------------- through the probes and the ring
def _probes(tmp_path, monkeypatch, on: str = "1"):
    monkeypatch.setenv(t1.ENV, on)
    p = probes_mod.Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, PS, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    return p


def test_the_probes_feed_tier1_and_a_violation_becomes_a_ring_record(tmp_path, monkeypatch):
    p = _probes(tmp_path, monkeypatch)
    assert p.tier1 is not None and p.tier1.page_size == PS
    req_to_token = torch.zeros((ROWS, CTX), dtype=torch.int64)
    req_to_token[1, :8] = torch.arange(4, 12)  # reader: pages 1, 2
    req_to_token[2, :8] = torch.arange(12, 20)  # owner: pages 3, 4
    p.pages_allocated(torch.arange(4, 20, 4))
    p.tier1.bind_row(1, "reader")
    p.tier1.bind_row(2, "owner")
    p.rows_assigned("reader", 0, 8, 0, req_to_token[1, :8])
    p.rows_assigned("owner", 0, 8, 0, req_to_token[2, :8])
    idx, seq = torch.tensor([1, 2]), torch.tensor([8, 8])
    assert p.tier1.check(req_to_token, idx, seq, ["reader", "owner"]) == 0
    req_to_token[1, 4] = 16  # reader's row page 1 -> page 4, the owner's
    assert p.tier1.check(req_to_token, idx, seq, ["reader", "owner"]) == 1
    recs = [r for r in RingReader(p.writer.path).poll().records if r.kind == wire.Kind.TIER1_VIOLATION]
    (rec,) = recs
    v = rec.body
    assert v.reader_key == wire.request_key("reader") and v.owner_keys.tolist() == [wire.request_key("owner")]
    assert v.pages.tolist() == [4] and v.row_indices.tolist() == [1] and v.seq_len == 8
    assert v.tags.tolist() == [wire.Tier1Tag.OTHER_REQUEST] and v.violations_total == 1


def test_tier1_is_off_by_default_and_a_bad_setting_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(t1.ENV, raising=False)
    assert t1.enabled_from_env() is False
    assert t1.enabled_from_env({t1.ENV: "true"}) is True
    with caplog.at_level(logging.ERROR, logger="kvguard.tier1"):
        assert t1.enabled_from_env({t1.ENV: "maybe"}) is False
    assert any("KVGUARD_TIER1='maybe'" in r.getMessage() for r in caplog.records)
    assert _probes(tmp_path / "a", monkeypatch, "0").tier1 is None


def test_wire_record_round_trips_and_unknown_tags_are_refused():
    v = wire.Tier1Violation(
        7, 3, 40, np.array([4, 9]), np.array([1, 2]), np.array([8, 0], np.uint64), np.array([3, 1], np.uint8)
    )
    payload = wire.tier1_violation_payload(v)
    raw = wire.encode(wire.Kind.TIER1_VIOLATION, 1, 1, 1, payload)
    (rec,) = wire.decode_stream(raw, wire.DecodeStats())
    b = rec.body
    assert (
        b.reader_key,
        b.violations_total,
        b.seq_len,
        b.pages.tolist(),
        b.row_indices.tolist(),
        b.owner_keys.tolist(),
        b.tags.tolist(),
    ) == (7, 3, 40, [4, 9], [1, 2], [8, 0], [3, 1])
    bad = wire.Tier1Violation(7, 3, 40, np.array([4]), np.array([1]), np.array([0], np.uint64), np.array([9], np.uint8))
    stats = wire.DecodeStats()
    assert (
        wire.decode_stream(wire.encode(wire.Kind.TIER1_VIOLATION, 1, 1, 1, wire.tier1_violation_payload(bad)), stats)
        == []
    )


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", ["float_rows", "float_indices", "other_device"])
def test_bad_input_is_logged_once_counted_and_turns_tier1_off(bad, caplog):
    e = Engine()
    e.t.allocated([1])
    e.admit("a", 1)
    e.write_row("a", 0, [1])
    assert e.check({"a": 4}) == 0
    rows, idx, seq = e.req_to_token, torch.tensor([1]), torch.tensor([4])
    if bad == "float_rows":
        rows = rows.float()
    elif bad == "float_indices":
        idx = idx.float()
    else:
        e.t.device = torch.device("meta")  # as if Tier 1 had bound to another device
    with caplog.at_level(logging.ERROR, logger="kvguard.tier1"):
        assert e.t.check(rows, idx, seq, ["a"]) is None
        assert e.t.check(rows, idx, seq, ["a"]) is None  # off now: not tried again
        e.t.allocated([2])  # nor fed
    assert e.t.enabled is False and e.t.errors == 1 and "check" in e.t.disabled_reason
    assert sum("Tier 1 is off" in r.getMessage() for r in caplog.records) == 1


def test_a_tier1_failure_never_reaches_the_engines_forward(tmp_path, monkeypatch):
    """The adapter's real forward hook with Tier 1 on and a float req_to_token: the
    engine's forward still runs and returns its result; the FORWARD record still goes out."""
    p = _probes(tmp_path, monkeypatch)
    probes_mod.reset_probes_for_tests(p)
    rt.State.reset()
    rt.State.hello_done, rt.State.page_size, rt.State.row_sampler = True, PS, RowSampler(every=0)
    try:
        pool = types.SimpleNamespace(req_to_token=torch.zeros((ROWS, CTX), dtype=torch.float32))
        runner = types.SimpleNamespace(req_to_token_pool=pool, is_draft_worker=False)
        mode = types.SimpleNamespace(is_idle=lambda: False, is_extend=lambda: False)
        fb = types.SimpleNamespace(
            forward_mode=mode,
            rids=["a"],
            seq_lens_cpu=torch.tensor([4]),
            seq_lens=torch.tensor([4]),
            out_cache_loc=torch.tensor([7]),
            extend_seq_lens_cpu=None,
            req_pool_indices=torch.tensor([1]),
        )
        hook = hr.forward_hook("forward")
        assert hook(lambda self, fb: "logits", runner, fb) == "logits"
        assert hook(lambda self, fb: "logits", runner, fb) == "logits"
        assert p.tier1.enabled is False and p.tier1.errors == 1
        assert rt.disabled_hooks() == set() and "forward" not in p.disabled_probes
        recs = RingReader(p.writer.path).poll().records
        assert [r.kind for r in recs].count(wire.Kind.FORWARD) == 2
        # the sidecar hears that Tier 1 is off (counted like any failed probe)
        (err,) = [r.body for r in recs if r.kind == wire.Kind.PROBE_ERROR]
        assert (err.probe, err.error, p.probe_errors) == ("tier1.check", "Tier1InputError", 1)
    finally:
        probes_mod.reset_probes_for_tests(None)
        rt.State.reset()


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_the_same_check_on_a_cuda_device_reads_the_count_back_asynchronously():
    e = Engine("cuda")
    e.t.allocated([1, 2, 3, 4])
    e.admit("reader", 1)
    e.admit("owner", 2)
    e.write_row("reader", 0, [1, 2])
    e.write_row("owner", 0, [3, 4])
    idx, seq = torch.tensor([1, 2], device="cuda"), torch.tensor([8, 8], device="cuda")
    assert e.t.check(e.req_to_token, idx, seq, ["reader", "owner"]) is None  # not waited for
    e.t.flush()
    assert e.found == []
    e.req_to_token[1, PS : 2 * PS] = e.req_to_token[2, PS : 2 * PS]
    e.t.check(e.req_to_token, idx, seq, ["reader", "owner"])
    e.t.flush()
    (v,) = e.found
    assert (v.rid, v.pages, v.owners) == ("reader", [4], ["owner"])
    # tags changed on the host reach the device copy before the next check
    e.t.freed([1])
    e.t.check(e.req_to_token, idx, seq, ["reader", "owner"])
    e.t.flush()
    assert e.found[-1].pages == [1] and e.found[-1].tags == [t1.TAG_FREE]


# --------------------------------------------------------------------------- real SGLang objects
@pytest.mark.engine
@pytest.mark.timeout(300)
def test_real_sglang_objects_clean_steps_a_corrupt_row_and_bad_input(require_sglang):
    """The adapter's hooks on a real PagedTokenToKVPoolAllocator, ReqToTokenPool,
    alloc_for_decode and ForwardBatch (tests/engine_side/tier1_real_objects.py, in a subprocess)."""
    require_sglang("0.5.23")
    sg = REPO / ".venv" / "sglang" / "0.5.23"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(sg), str(REPO / "demo" / "shim")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent / "tier1_real_objects.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # healthy: every step checked, 70 steps cross page boundaries (decode ASSIGNs), zero violations
    assert r["clean"]["checks"] == r["clean"]["steps"] and r["clean"]["violations"] == 0
    assert r["clean"]["assigns"] > 0 and r["clean"]["probe_errors"] == 0
    # a corrupt row entry: caught on the next step, naming the reader, the page and its owner
    c = r["corrupt"]
    assert c["count"] == 1 and c["violation"] == {
        "rid": "bench-req-0",
        "pages": [c["owner_page"]],
        "owners": ["bench-req-1"],
        "tags": [t1.TAG_OTHER],
    }
    assert c["record"] == {
        "reader_key": wire.request_key("bench-req-0"),
        "pages": [c["owner_page"]],
        "owner_keys": [wire.request_key("bench-req-1")],
    }
    # a float req_to_token: Tier 1 off, counted; the hooks and the engine carry on
    b = r["bad_input"]
    assert b["enabled"] is False and b["errors"] == 1 and b["forward_result"] == "ran"
    assert b["disabled_hooks"] == [] and b["probe_errors"] == 1  # reported once, as tier1.check


# --------------------------------------------------------------------------- the sidecar's side
def test_the_sidecar_raises_the_engines_tier1_record_as_a_finding(tmp_path, monkeypatch):
    from kvguard.sidecar.service import Sidecar
    from kvguard.sidecar.sinks.basic import MemorySink

    p = _probes(tmp_path, monkeypatch)
    p.request_begin("reader", "initech", None, 8, 0, False)
    p.request_begin("owner", "globex", None, 8, 0, False)
    p.request_begin("warm", "", None, 8, 0, True)
    req_to_token = torch.zeros((ROWS, CTX), dtype=torch.int32)
    for row, rid, first in ((1, "reader", 1), (2, "owner", 3), (3, "warm", 5)):
        req_to_token[row, :8] = torch.arange(first * PS, first * PS + 8, dtype=torch.int32)
        p.pages_allocated(req_to_token[row, :8:PS])
        p.tier1.bind_row(row, rid)
        p.rows_assigned(rid, 0, 8, 0, req_to_token[row, :8])
    req_to_token[1, 4:8] = req_to_token[2, 4:8]  # reader -> owner's page 4
    req_to_token[3, 4:8] = req_to_token[2, 4:8]  # a warmup request reading it is never alarmed
    p.pages_freed(torch.tensor([2 * PS]))  # reader's own page 2 is freed (and no longer in its row)
    req_to_token[1, 0:4] = 2 * PS  # ... but its row page 0 now names it: a use after free
    assert p.tier1.check(req_to_token, torch.tensor([1, 3]), torch.tensor([8, 8]), ["reader", "warm"]) == 3
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    try:
        sidecar.run_once(flush=True)
    finally:
        sidecar.stop()
    by_kind = {f.kind: f for f in sink.findings}
    assert sorted(by_kind) == ["foreign_read", "use_after_free"], [f.to_dict() for f in sink.findings]
    f = by_kind["foreign_read"]
    assert (f.reader.rid, f.reader.tenant, f.pages, f.severity) == ("reader", "initech", [4], "critical")
    assert [(x.rid, x.tenant, x.pages) for x in f.exposed] == [("owner", "globex", [4])]
    assert f.evidence["source"] == "engine_tier1" and f.evidence["row_page_indices"] == [1]
    u = by_kind["use_after_free"]
    assert (u.reader.rid, u.pages, u.evidence["row_page_indices"]) == ("reader", [2], [0])


def test_the_radix_cache_reasserting_a_rows_own_pages_keeps_them_its_own():
    """SGLang rewrites a request's prefilled positions with the tree's pages (the same
    pages) after each chunk and at release, reported as shared. They stay the
    request's, so another request's row naming them is still a foreign read."""
    e = Engine()
    e.t.allocated([1, 2, 3, 4])
    e.admit("reader", 1)
    e.admit("owner", 2)
    e.write_row("reader", 0, [1, 2])
    e.write_row("owner", 0, [3, 4])
    e.write_row("owner", 0, [3, 4], shared_until=8)  # the tree re-asserts owner's row
    e.write_row("reader", 0, [1, 2], shared_until=8)
    assert e.check({"reader": 8, "owner": 8}) == 0
    e.req_to_token[1, PS : 2 * PS] = e.req_to_token[2, PS : 2 * PS]
    assert e.check({"reader": 8, "owner": 8}) == 1
    assert [(v.rid, v.pages, v.owners) for v in e.found] == [("reader", [4], ["owner"])]

"""``unwritten_send``: a sender ships source pages its request never wrote.

Recordings made through the public recording API (Probes into a RecordingWriter, then
``kvguard replay``), each bug next to the clean twin that must stay silent. The prefill
pool has pages 1..63 (page_size 4); decode reserves pages 5, 6 for room 7.
"""

from __future__ import annotations

import json

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.sidecar.cli import main
from kvguard.sidecar.recorder import RecordingWriter
from kvguard.sidecar.replay import replay

PS = 4
MS = 1_000_000


def slots(*pages):
    return np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages])


class Pair:
    """A prefill/decode pair recording into one file; decode has reserved pages 5, 6 for
    ``d-7`` (tenant globex) in room 7, prefill's ``p-7`` holds pages 9, 10 for the prompt."""

    def __init__(self, path, tokens=8):
        self.rec = RecordingWriter(path, overwrite=True)
        self.pre = Probes(self.rec.engine(engine_id=2))
        self.dec = Probes(self.rec.engine(engine_id=3))
        self.pre.hello("prefill", 0, PS, 64, 64 * PS, 256, 256, "myengine", "1.0", "tiny", pid=2001)
        self.dec.hello("decode", 0, PS, 64, 64 * PS, 256, 256, "myengine", "1.0", "tiny", pid=3001)
        self.tokens = tokens

    def earlier_request(self, rid, tenant, pages):
        """A finished prefill request that wrote ``pages`` (and freed them: their KV stays)."""
        pre = self.pre
        pre.request_begin(rid, tenant, None, PS * len(pages), 0, False)
        pre.pages_allocated(slots(*pages))
        pre.rows_assigned(rid, 0, PS * len(pages), 0, slots(*pages))
        pre.forward([rid], [PS * len(pages)], [slots(*pages)])
        pre.request_end(rid, "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
        pre.pages_freed(slots(*pages))

    def begin(self, warmup=False, shared_until=0, src=(9, 10)):
        dec, pre, n = self.dec, self.pre, self.tokens
        dec.request_begin("d-7", "globex", 7, n, 0, warmup)
        dec.pages_allocated(slots(5, 6))
        dec.rows_assigned("d-7", 0, n, 0, slots(5, 6))
        dec.transfer_reserved("d-7", 7, n, slots(5, 6))
        pre.request_begin("p-7", "globex", 7, n, shared_until, warmup)
        own = src[shared_until // PS :]
        pre.pages_allocated(slots(*own))
        pre.rows_assigned("p-7", 0, n, shared_until, slots(*src))

    def write(self, start, end, pages):
        """p-7's forward over positions [start, end) writing ``pages``' slots."""
        self.pre.forward(["p-7"], [end], [slots(*pages)[: end - start]])

    def send(self, start, end, pages, last):
        self.pre.transfer_sent("p-7", 7, start, end, list(pages), last)

    def finish(self):
        pre, dec = self.pre, self.dec
        pre.transfer_done("p-7", 7, "sender", "success")
        pre.request_end("p-7", "length", ttft_ns=25 * MS, e2e_ns=25 * MS, output_tokens=1, reason="")
        pre.pages_freed(slots(9, 10))
        dec.transfer_done("d-7", 7, "receiver", "success")
        dec.pages_allocated([28])
        dec.decode_rows_assigned(["d-7"], [self.tokens], [28])
        dec.forward(["d-7"], [self.tokens + 1], [[28]])
        dec.request_end("d-7", "length", ttft_ns=30 * MS, e2e_ns=50 * MS, output_tokens=1, reason="")
        dec.pages_freed(slots(5, 6, 7))
        self.rec.close()


def sends(findings):
    return [f for f in findings if f.kind == "unwritten_send"]


def test_a_chunk_sent_before_its_forward_ships_what_the_page_held_before(tmp_path):
    """Chunked prefill: the first chunk (positions 0..3, page 9) is computed, and the sender
    ships positions 0..7 (pages 9, 10) before the second chunk's forward wrote page 10,
    whose KV is still acme's (SGLang #33970's shape)."""
    pair = Pair(tmp_path / "r.kvgrec")
    pair.earlier_request("p-acme", "acme", [10])
    pair.begin()
    pair.write(0, 4, [9])
    pair.send(0, 8, [9, 10], last=True)  # ahead of the forward of positions 4..7
    pair.write(4, 8, [10])
    pair.finish()
    findings, _ = replay([tmp_path / "r.kvgrec"])
    assert [f.kind for f in findings] == ["unwritten_send"], [f.to_dict() for f in findings]
    (f,) = findings
    assert (f.severity, f.engine.role, f.reader.rid, f.reader.tenant) == ("critical", "prefill", "p-7", "globex")
    assert f.pages == [10]
    assert [(p.rid, p.tenant, p.pages) for p in f.exposed] == [("p-acme", "acme", [10])]
    assert f.evidence["unwritten_pages"] == [10] and f.evidence["foreign_pages"] == []
    assert f.evidence["receiver"] == {"rid": "d-7", "tenant": "globex"}
    assert (f.evidence["token_start"], f.evidence["token_end"], f.evidence["bootstrap_room"]) == (0, 8, 7)
    assert "sent 1 page(s) it never wrote" in f.summary and "decode request d-7" in f.summary
    assert "tenant(s) acme" in f.summary


def test_chunks_sent_after_their_forwards_are_clean_with_a_partial_page_at_the_boundary(tmp_path):
    """The clean twin: each chunk is sent after its forward; the first chunk ends inside
    page 10 (positions 0..5), which the next chunk's send starts from."""
    pair = Pair(tmp_path / "r.kvgrec")
    pair.earlier_request("p-acme", "acme", [10])
    pair.begin()
    pair.write(0, 6, [9, 10])
    pair.send(0, 6, [9, 10], last=False)
    pair.write(6, 8, [10])
    pair.pre.transfer_sent("p-7", 7, 6, 8, slots(10)[2:], True, unit="slots")
    pair.finish()
    findings, run = replay([tmp_path / "r.kvgrec"])
    assert findings == [], [f.to_dict() for f in findings]
    assert run.summary()["problems"] == 0 and run.summary()["apply_errors"] == 0


def test_a_source_page_reused_by_another_request_before_the_send_is_critical(tmp_path):
    """The pages changed hands before a background sender read them (TensorRT-LLM
    #12542): page 10 left p-7's row (a buggy eviction), went to initech's request, which
    wrote it; the sender then ships it as p-7's."""
    pair = Pair(tmp_path / "r.kvgrec")
    pair.begin()
    pair.write(0, 8, [9, 10])
    pre = pair.pre
    pre.pages_freed(slots(10))  # the bug: freed while the transfer still has to read it
    pre.request_begin("p-ini", "initech", None, 4, 0, False)
    pre.pages_allocated(slots(10))
    pre.rows_assigned("p-ini", 0, 4, 0, slots(10))
    pre.forward(["p-ini"], [4], [slots(10)])
    pair.send(0, 8, [9, 10], last=True)
    pair.finish()
    findings, _ = replay([tmp_path / "r.kvgrec"])
    (f,) = sends(findings)
    assert f.severity == "critical" and f.pages == [10]
    assert f.evidence["foreign_pages"] == [10] and f.evidence["unwritten_pages"] == []
    assert [(p.rid, p.tenant) for p in f.exposed] == [("p-ini", "initech")]


def test_a_free_source_page_is_critical_even_when_nobody_wrote_it_before(tmp_path):
    pair = Pair(tmp_path / "r.kvgrec")
    pair.begin()
    pair.write(0, 8, [9, 10])
    pair.pre.pages_freed(slots(10))
    pair.send(0, 8, [9, 10], last=True)
    pair.finish()
    findings, _ = replay([tmp_path / "r.kvgrec"])
    (f,) = sends(findings)
    assert f.severity == "critical" and f.evidence["freed_pages"] == [10]


def test_a_page_nobody_ever_wrote_is_a_warning(tmp_path):
    pair = Pair(tmp_path / "r.kvgrec")
    pair.begin()
    pair.send(0, 8, [9, 10], last=True)  # no forward at all: fresh pool pages
    pair.finish()
    findings, _ = replay([tmp_path / "r.kvgrec"])
    (f,) = sends(findings)
    assert (f.severity, f.pages, f.exposed) == ("warning", [9, 10], [])


def test_a_prefix_cache_page_written_by_another_request_is_the_senders_to_send(tmp_path):
    """Radix sharing: p-7's first 4 positions come from the prefix cache (page 9, written by
    acme's earlier request, kept by the cache); the sender ships it with its own page 10."""
    pair = Pair(tmp_path / "r.kvgrec")
    pre = pair.pre
    pre.request_begin("p-acme", "globex", None, 4, 0, False)
    pre.pages_allocated(slots(9))
    pre.rows_assigned("p-acme", 0, 4, 0, slots(9))
    pre.forward(["p-acme"], [4], [slots(9)])
    pre.request_end("p-acme", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
    pair.begin(shared_until=4)
    pair.write(4, 8, [10])
    pair.send(0, 8, [9, 10], last=True)
    pair.pre.transfer_done("p-7", 7, "sender", "success")
    pair.rec.close()
    findings, _ = replay([tmp_path / "r.kvgrec"])
    assert sends(findings) == [], [f.to_dict() for f in findings]


def test_warmup_senders_are_not_alarmed(tmp_path):
    pair = Pair(tmp_path / "r.kvgrec")
    pair.begin(warmup=True)
    pair.send(0, 8, [9, 10], last=True)
    pair.finish()
    findings, _ = replay([tmp_path / "r.kvgrec"])
    assert findings == [], [f.to_dict() for f in findings]


def test_replay_json_prints_the_finding_with_the_receiver(tmp_path, capsys):
    pair = Pair(tmp_path / "r.kvgrec")
    pair.earlier_request("p-acme", "acme", [10])
    pair.begin()
    pair.write(0, 4, [9])
    pair.send(0, 8, [9, 10], last=True)
    pair.finish()
    assert main(["replay", "--json", str(tmp_path / "r.kvgrec")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"kind"')]
    (f,) = [x for x in lines if x["kind"] == "unwritten_send"]
    assert f["evidence"]["receiver"] == {"rid": "d-7", "tenant": "globex"}
    assert [(p["rid"], p["tenant"]) for p in f["exposed"]] == [("p-acme", "acme")]

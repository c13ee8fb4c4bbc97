"""``prefix_content_mismatch``: a prefix-cache hit handing a request pages that hold another
prefix or other positions (PAGE_IDENTITY, sidecar/page_identity.py).

Recordings made through the public recording API, then ``kvguard replay``, with identities
computed by the engine's own chain (engine_hooks/page_identity.py). A unified engine,
page_size 4: a first request writes pages 1, 2, 3 (12 tokens) and finishes, the prefix cache
keeps pages 1 and 2; a second request is handed two pages from the cache as its first 8
positions and writes its own page 4.
"""

from __future__ import annotations

import numpy as np

from kvguard.engine_hooks.page_identity import PageIdentity
from kvguard.engine_hooks.probes import Probes
from kvguard.sidecar.recorder import RecordingWriter
from kvguard.sidecar.replay import replay

PS = 4
MS = 1_000_000
IDENT = PageIdentity(PS, salt=0x5EED)
WRITER_TOKENS = np.arange(1000, 1012)


def slots(*pages):
    return np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages])


def record(path, reader_tokens, handed=(1, 2), warmup=False, reallocate_first=False, identities=True):
    """The writer's 12 tokens fill pages 1-3; the reader (``reader_tokens``, 12) is handed
    ``handed`` as row pages 0 and 1. ``reallocate_first``: page 1 is freed, reallocated and
    written by a request that reports no identity before the reader's hit."""
    with RecordingWriter(path, overwrite=True) as rec:
        eng = Probes(rec.engine(engine_id=1))
        eng.hello("unified", 0, PS, 64, 64 * PS, 256, 256, "sglang", "0.5.23", "tiny", pid=1001)
        eng.request_begin("r-acme", "acme", None, 12, 0, False)
        eng.pages_allocated(slots(1, 2, 3))
        eng.rows_assigned("r-acme", 0, 12, 0, slots(1, 2, 3))
        if identities:
            eng.page_identity("r-acme", 0, "written", IDENT.chain(WRITER_TOKENS, 0, 3))
        eng.forward(["r-acme"], [12], [slots(1, 2, 3)])
        eng.request_end("r-acme", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
        eng.pages_freed(slots(3))  # the cache keeps pages 1 and 2
        if reallocate_first:
            eng.pages_freed(slots(1))  # evicted, then another request's
            eng.request_begin("r-other", "other", None, 4, 0, False)
            eng.pages_allocated(slots(1))
            eng.rows_assigned("r-other", 0, 4, 0, slots(1))
            eng.forward(["r-other"], [4], [slots(1)])
            eng.request_end("r-other", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
        eng.request_begin("r-ini", "initech", None, 12, 8, warmup)
        eng.pages_allocated(slots(4))
        eng.rows_assigned("r-ini", 0, 12, 8, slots(*handed, 4))  # positions < 8: from the cache
        if identities:
            ids = IDENT.chain(np.asarray(reader_tokens), 0, 3)
            eng.page_identity("r-ini", 0, "hit", ids[:2])
            eng.page_identity("r-ini", 2, "written", ids[2:])
        eng.forward(["r-ini"], [12], [slots(4)])
        eng.request_end("r-ini", "stop", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
    return replay([path])


def identity_counts(run) -> dict:
    return run.pipeline.stats().page_identity


def test_a_hit_on_pages_holding_the_readers_own_prefix_is_quiet(tmp_path):
    reader = np.concatenate((WRITER_TOKENS[:8], [7, 7, 7, 7]))  # the same first 8 tokens, its own tail
    findings, run = record(tmp_path / "r.kvgrec", reader)
    assert findings == [], [f.to_dict() for f in findings]
    assert identity_counts(run) == {"recorded": 4, "loaded": 0, "matched": 2, "mismatched": 0, "unknown": 0}
    assert run.summary()["apply_errors"] == 0


def test_a_hit_on_pages_of_another_prefix_is_critical_and_names_whose_kv_they_hold(tmp_path):
    reader = np.concatenate(([999], WRITER_TOKENS[1:8], [7, 7, 7, 7]))  # one token differs, in page 0
    findings, run = record(tmp_path / "r.kvgrec", reader)
    (f,) = findings
    assert (f.kind, f.severity, f.reader.rid, f.pages) == ("prefix_content_mismatch", "critical", "r-ini", [1, 2])
    assert [(p.rid, p.tenant, p.pages) for p in f.exposed] == [("r-acme", "acme", [1, 2])]
    # the chain: page 1's own tokens are the same, but its prefix is not
    assert f.evidence == {"via": "prefix_hit", "row_pages": [0, 1], "pages_judged": 2}
    assert "r-acme" in f.summary and "r-ini" in f.summary
    assert identity_counts(run)["mismatched"] == 2


def test_a_page_of_the_readers_prefix_at_another_position_is_caught(tmp_path):
    """A block-boundary error: the reader's tokens are the writer's positions 4-7 twice, and
    both its row pages name page 2, which holds those tokens' KV at positions 4-7 (after 0-3):
    row page 0 has the same tokens at another position, row page 1 the same tokens and
    position after another prefix. Both differ; the page is named once."""
    reader = np.concatenate((WRITER_TOKENS[4:8], WRITER_TOKENS[4:8], [7, 7, 7, 7]))
    findings, _ = record(tmp_path / "r.kvgrec", reader, handed=(2, 2))
    assert [(f.kind, f.pages, f.evidence["row_pages"]) for f in findings] == [("prefix_content_mismatch", [2], [0, 1])]


def test_an_identity_recorded_for_an_older_allocation_is_not_judged(tmp_path):
    reader = np.concatenate(([999], WRITER_TOKENS[1:8], [7, 7, 7, 7]))
    findings, run = record(tmp_path / "r.kvgrec", reader, reallocate_first=True)
    assert [(f.kind, f.pages) for f in findings] == [("prefix_content_mismatch", [2])]  # page 1: unknown
    counts = identity_counts(run)
    assert (counts["unknown"], counts["mismatched"]) == (1, 1)


def test_a_warmup_reader_is_never_alarmed(tmp_path):
    reader = np.concatenate(([999], WRITER_TOKENS[1:8], [7, 7, 7, 7]))
    findings, run = record(tmp_path / "r.kvgrec", reader, warmup=True)
    assert findings == []
    assert identity_counts(run)["mismatched"] == 2  # judged and counted, not alarmed


def test_an_engine_without_identities_keeps_no_identity_column_and_judges_nothing(tmp_path):
    reader = np.concatenate(([999], WRITER_TOKENS[1:8], [7, 7, 7, 7]))
    findings, run = record(tmp_path / "r.kvgrec", reader, identities=False)
    assert findings == []
    (tracker,) = run.pipeline.engines.values()
    assert tracker.pool.identity is None
    assert identity_counts(run) == {"recorded": 0, "loaded": 0, "matched": 0, "mismatched": 0, "unknown": 0}


def test_the_identity_columns_count_in_the_pools_memory(tmp_path):
    reader = np.concatenate((WRITER_TOKENS[:8], [7, 7, 7, 7]))
    _, without = record(tmp_path / "a.kvgrec", reader, identities=False)
    _, with_ids = record(tmp_path / "b.kvgrec", reader)
    (a,) = without.pipeline.engines.values()
    (b,) = with_ids.pipeline.engines.values()
    assert b.pool.nbytes - a.pool.nbytes == 20 * b.pool.num_pages
    b.pool.ensure(np.array([b.pool.num_pages * 2], np.int64))  # grown with the other columns
    assert b.pool.identity is not None and len(b.pool.identity) == b.pool.num_pages == len(b.pool.identity_gen)


# ---------------------------------------------------------------------- through a tier and back
ACME, GLOBEX = np.arange(2000, 2008), np.arange(3000, 3008)  # two 8-token prompts: 2 full pages each
OBJ_ACME, OBJ_GLOBEX = 0xA, 0xB


def record_tier(path, loaded_object: int, load_pages=(5, 6)):
    """acme's and globex's prompts fill pages 1-2 and 3-4, the prefix cache backs each up to
    the host (one object each, as SGLang's HiCache does) and the device copies are evicted;
    initech's request, with acme's 8 tokens as its prefix, is handed ``loaded_object`` loaded
    back into ``load_pages`` (issued, its hit, then the copy completed, as on the engine)."""
    with RecordingWriter(path, overwrite=True) as rec:
        eng = Probes(rec.engine(engine_id=1))
        eng.hello("unified", 0, PS, 64, 64 * PS, 256, 256, "sglang", "0.5.23", "tiny", pid=1001)
        for rid, tenant, tokens, pages, obj in (
            ("r-acme", "acme", ACME, (1, 2), OBJ_ACME),
            ("r-globex", "globex", GLOBEX, (3, 4), OBJ_GLOBEX),
        ):
            eng.request_begin(rid, tenant, None, 8, 0, False)
            eng.pages_allocated(slots(*pages))
            eng.rows_assigned(rid, 0, 8, 0, slots(*pages))
            eng.page_identity(rid, 0, "written", IDENT.chain(tokens, 0, 2))
            eng.forward([rid], [8], [slots(*pages)])
            eng.request_end(rid, "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
            eng.kv_stored(None, obj, list(pages))  # the radix node's backup (no request's)
        eng.pages_freed(slots(1, 2, 3, 4))  # evicted from the device: the host holds both
        n = len(load_pages)  # the prefix pages loaded back and handed: acme's first 4n tokens
        reader = np.concatenate((ACME[: n * PS], [7, 7, 7, 7]))
        eng.request_begin("r-ini", "initech", None, len(reader), n * PS, False)
        eng.pages_allocated(slots(*load_pages, 7))
        eng.kv_loaded("r-ini", loaded_object, list(load_pages), "issued")
        eng.rows_assigned("r-ini", 0, len(reader), n * PS, slots(*load_pages, 7))
        ids = IDENT.chain(reader, 0, n + 1)
        eng.page_identity("r-ini", 0, "hit", ids[:n])
        eng.page_identity("r-ini", n, "written", ids[n:])
        eng.kv_loaded("r-ini", loaded_object, list(load_pages), "completed")
        eng.forward(["r-ini"], [len(reader)], [slots(7)])
        eng.request_end("r-ini", "stop", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
    return replay([path])


def test_a_prefix_loaded_back_from_the_host_carries_its_identity_and_a_hit_on_it_is_quiet(tmp_path):
    findings, run = record_tier(tmp_path / "r.kvgrec", OBJ_ACME)
    assert findings == [], [f.to_dict() for f in findings]
    counts = identity_counts(run)
    assert (counts["loaded"], counts["matched"], counts["mismatched"], counts["unknown"]) == (2, 2, 0, 0)


def test_a_lookup_handing_another_prefixs_stored_object_names_whose_tokens_it_holds(tmp_path):
    """The tree (or a tier) serves globex's backup under acme's prefix: the object is intact
    (its digest would match), the bytes are globex's prompt, read by initech as acme's."""
    findings, run = record_tier(tmp_path / "r.kvgrec", OBJ_GLOBEX)
    (f,) = findings
    assert (f.kind, f.severity, f.reader.rid, f.pages) == ("prefix_content_mismatch", "critical", "r-ini", [5, 6])
    assert [(p.rid, p.tenant, p.pages) for p in f.exposed] == [("r-globex", "globex", [5, 6])]
    assert identity_counts(run)["mismatched"] == 2


def test_a_load_of_part_of_an_object_gives_no_identity_and_is_not_judged(tmp_path):
    """(Which of the object's pages a part is is not in the record: its first page is
    globex's first here, another prefix, and still not judged.)"""
    findings, run = record_tier(tmp_path / "r.kvgrec", OBJ_GLOBEX, load_pages=(5,))
    assert findings == []
    counts = identity_counts(run)
    assert counts["loaded"] == 0 and counts["mismatched"] == 0

"""Host / storage tiers (KV_STORE, KV_LOAD; sidecar/offload.py), through the public
recording API and ``kvguard replay``: each bug next to its clean twin.

A unified engine, page_size 4. ``r-acme`` writes pages 1, 2; the cache stores them to
object 0xA and evicts them; ``r-ini`` hits the object: it is loaded into pages 5, 6,
which become ``r-ini``'s cached prefix (positions 0..7), and ``r-ini`` reads them.
"""

from __future__ import annotations

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.sidecar.recorder import RecordingWriter
from kvguard.sidecar.replay import replay

PS = 4
MS = 1_000_000
OBJ = 0xA


def slots(*pages):
    return np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages])


def engine(rec, engine_id=1, model="tiny"):
    eng = Probes(rec.engine(engine_id=engine_id))
    eng.hello("unified", 0, PS, 64, 64 * PS, 256, 256, "sglang", "0.5.23", model, pid=1000 + engine_id)
    return eng


def store_from_acme(eng, write=True, salt=None, digest=0):
    eng.request_begin("r-acme", "acme", None, 8, 0, False, cache_salt=salt)
    eng.pages_allocated(slots(1, 2))
    eng.rows_assigned("r-acme", 0, 8, 0, slots(1, 2))
    if write:
        eng.forward(["r-acme"], [8], [slots(1, 2)])
    eng.request_end("r-acme", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
    eng.kv_stored(None, OBJ, [1, 2], digest=digest, cache_salt=salt)  # the cache backs its node up ...
    eng.pages_freed(slots(1, 2))  # ... and evicts it from the device


def load_for_ini(eng, salt=None, digest=0, between=None):
    eng.request_begin("r-ini", "initech", None, 12, 8, False, cache_salt=salt)
    eng.pages_allocated(slots(5, 6))
    eng.kv_loaded("r-ini", OBJ, [5, 6], "issued", cache_salt=salt)
    if between is not None:
        between(eng)
    eng.kv_loaded("r-ini", OBJ, [5, 6], "completed", digest=digest, cache_salt=salt)
    eng.pages_allocated(slots(7))
    eng.rows_assigned("r-ini", 0, 12, 8, slots(5, 6, 7))  # positions < 8: the loaded prefix
    eng.forward(["r-ini"], [12], [slots(7)])
    eng.request_end("r-ini", "stop", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")


def run(tmp_path, body):
    path = tmp_path / "o.kvgrec"
    with RecordingWriter(path, overwrite=True) as rec:
        body(rec)
    findings, r = replay([path])
    return findings, r


def test_a_loaded_prefix_counts_as_written_and_a_clean_round_trip_is_quiet(tmp_path):
    findings, r = run(tmp_path, lambda rec: (lambda e: (store_from_acme(e), load_for_ini(e)))(engine(rec)))
    assert findings == [], [f.to_dict() for f in findings]
    assert r.pipeline.loads_unverified == 0 and r.summary()["apply_errors"] == 0


def test_without_the_load_record_the_same_read_is_unwritten(tmp_path):
    """What the records are for: a loaded prefix the sidecar did not see loaded reads as
    pages nothing wrote (HiCache without offload records)."""

    def body(rec):
        eng = engine(rec)
        store_from_acme(eng)
        eng.request_begin("r-ini", "initech", None, 12, 8, False)
        eng.pages_allocated(slots(5, 6, 7))
        eng.rows_assigned("r-ini", 0, 12, 8, slots(5, 6, 7))
        eng.forward(["r-ini"], [12], [slots(7)])

    findings, _ = run(tmp_path, body)
    assert [f.kind for f in findings] == ["unwritten_read"]


def test_storing_pages_nothing_wrote_ships_stale_kv_to_the_tier(tmp_path):
    def body(rec):
        eng = engine(rec)
        eng.request_begin("r-old", "globex", None, 8, 0, False)  # pages 1, 2 last held globex's KV
        eng.pages_allocated(slots(1, 2))
        eng.rows_assigned("r-old", 0, 8, 0, slots(1, 2))
        eng.forward(["r-old"], [8], [slots(1, 2)])
        eng.request_end("r-old", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
        eng.pages_freed(slots(1, 2))
        store_from_acme(eng, write=False)  # acme's forward never ran: the pages hold globex's KV

    findings, _ = run(tmp_path, body)
    (f,) = [f for f in findings if f.kind == "unwritten_send"]
    assert (f.severity, f.reader, f.pages) == ("critical", None, [1, 2])
    assert f.evidence["via"] == "offload" and f.evidence["object_key"] == f"{OBJ:016x}"
    assert [(p.rid, p.tenant) for p in f.exposed] == [("r-old", "globex")]


def test_a_load_landing_after_its_pages_went_to_another_request_is_a_late_write(tmp_path):
    """SGLang #31427 / #30321: the load-back races an eviction; by completion the destination
    pages were freed and handed to r-other, whose KV the load overwrites."""

    def steal(eng):
        eng.pages_freed(slots(5, 6))  # the bug: freed while the load is in flight
        eng.request_begin("r-other", "globex", None, 8, 0, False)
        eng.pages_allocated(slots(5, 6))
        eng.rows_assigned("r-other", 0, 8, 0, slots(5, 6))
        eng.forward(["r-other"], [8], [slots(5, 6)])

    def body(rec):
        eng = engine(rec)
        store_from_acme(eng)
        eng.request_begin("r-ini", "initech", None, 12, 8, False)
        eng.pages_allocated(slots(5, 6))
        eng.kv_loaded("r-ini", OBJ, [5, 6], "issued")
        steal(eng)
        eng.kv_loaded("r-ini", OBJ, [5, 6], "completed")

    findings, _ = run(tmp_path, body)
    (f,) = findings
    assert (f.kind, f.severity, f.reader.rid) == ("late_write", "critical", "r-ini")
    assert f.evidence["via"] == "load" and sorted(f.pages) == [5, 6]
    assert [p.rid for p in f.exposed] == ["r-other"]


def test_an_object_stored_under_another_salt_is_not_this_lookups(tmp_path):
    findings, _ = run(
        tmp_path,
        lambda rec: (lambda e: (store_from_acme(e, salt="acme-1"), load_for_ini(e, salt="ini-1")))(engine(rec)),
    )
    (f,) = findings
    assert (f.kind, f.severity, f.reader.rid) == ("cross_salt_prefix_share", "critical", "r-ini")
    assert f.evidence["via"] == "load" and sorted(f.pages) == [5, 6]


def test_another_models_kv_and_other_bytes_are_checksum_mismatches(tmp_path):
    def body(rec):
        store_from_acme(engine(rec, 1, model="llama-a"), digest=11)
        load_for_ini(engine(rec, 2, model="llama-b"), digest=12)

    findings, _ = run(tmp_path, body)
    (f,) = findings
    assert (f.kind, f.reader.rid, f.evidence["via"]) == ("checksum_mismatch", "r-ini", "load")
    assert (f.evidence["stored_model"], f.evidence["loaded_model"]) == ("llama-a", "llama-b")
    assert (f.evidence["stored_digest"], f.evidence["loaded_digest"]) == (f"{11:016x}", f"{12:016x}")


def test_a_load_of_an_object_never_seen_stored_is_counted_not_guessed(tmp_path):
    findings, r = run(tmp_path, lambda rec: load_for_ini(engine(rec)))
    assert findings == [] and r.pipeline.loads_unverified == 1


def test_digests_from_the_process_holding_the_kv_join_their_objects_by_key(tmp_path):
    """KV_DIGEST (vLLM's Worker hashes the KV; the EngineCore says KV_STORE / KV_LOAD): the
    stored digest may come before its KV_STORE, the loaded one after its KV_LOAD. The same
    bytes: compared, quiet. Other bytes (an object changed at rest): checksum_mismatch via
    the load, naming the request it was loaded for and whose KV was stored."""

    def scenario(loaded_digest):
        def body(rec):
            eng = engine(rec)
            eng.kv_digest(None, OBJ, 0x1111, "stored")  # (hashed as the forward saved it)
            store_from_acme(eng)
            eng.kv_digest(None, OBJ, 0x2222, "stored")  # an unrelated later digest: the object keeps its own
            eng.request_begin("r-ini", "initech", None, 12, 8, False)
            eng.pages_allocated(slots(5, 6))
            eng.kv_loaded("r-ini", OBJ, [5, 6], "issued")
            eng.kv_loaded("r-ini", OBJ, [5, 6], "completed")
            eng.kv_digest(None, OBJ, loaded_digest, "loaded")

        return body

    findings, r = run(tmp_path, scenario(0x1111))
    assert findings == [] and r.pipeline.load_digests_compared == 1, [f.to_dict() for f in findings]
    findings, r = run(tmp_path, scenario(0x9999))
    assert [f.kind for f in findings] == ["checksum_mismatch"], [f.to_dict() for f in findings]
    f = findings[0]
    assert f.reader.rid == "r-ini" and f.evidence["via"] == "load", f.to_dict()
    assert (f.evidence["stored_digest"], f.evidence["loaded_digest"]) == (f"{0x1111:016x}", f"{0x9999:016x}")
    assert sorted(f.pages) == [5, 6]


OTHER = 0xB


def test_a_tier_serving_another_objects_bytes_names_whose_they_are(tmp_path):
    """LMCache #4385's shape: the tier answers OBJ's key with OTHER's bytes (the loaded digest
    is OTHER's stored one). The finding names OTHER and the request whose KV it holds (globex)
    as exposed, not OBJ's owner; a digest no remembered object has names nobody new."""

    def scenario(loaded_digest):
        def body(rec):
            eng = engine(rec)
            store_from_acme(eng, digest=0x1111)
            eng.request_begin("r-glx", "globex", None, 8, 0, False)
            eng.pages_allocated(slots(3, 4))
            eng.rows_assigned("r-glx", 0, 8, 0, slots(3, 4))
            eng.forward(["r-glx"], [8], [slots(3, 4)])
            eng.request_end("r-glx", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
            eng.kv_stored("r-glx", OTHER, [3, 4], digest=0x2222)
            eng.pages_freed(slots(3, 4))
            load_for_ini(eng, digest=loaded_digest)

        return body

    findings, _ = run(tmp_path, scenario(0x2222))
    (f,) = findings
    assert (f.kind, f.reader.rid, f.evidence["via"]) == ("checksum_mismatch", "r-ini", "load"), f.to_dict()
    assert f.evidence["loaded_object_key"] == f"{OTHER:016x}" and f.evidence["object_key"] == f"{OBJ:016x}"
    assert [(p.rid, p.tenant) for p in f.exposed] == [("r-glx", "globex")]
    assert f"object {OTHER:016x}'s" in f.summary
    findings, _ = run(tmp_path, scenario(0x3333))  # bytes of no object it knows: OBJ's owner, as before
    (f,) = findings
    assert "loaded_object_key" not in f.evidence and f.exposed == []  # OBJ was the cache's own backup


def test_a_load_into_more_pages_than_its_object_was_stored_from_is_a_size_mismatch(tmp_path):
    """The object was stored from 2 pages; a load fills 3: the third gets bytes never stored
    under this key (a truncated store). The clean twin loads 2 (the round trip above)."""

    def body(rec):
        eng = engine(rec)
        store_from_acme(eng)
        eng.request_begin("r-ini", "initech", None, 12, 12, False)
        eng.pages_allocated(slots(5, 6, 7))
        eng.kv_loaded("r-ini", OBJ, [5, 6, 7], "issued")
        eng.kv_loaded("r-ini", OBJ, [5, 6, 7], "completed")

    findings, _ = run(tmp_path, body)
    assert [f.kind for f in findings] == ["transfer_size_mismatch"], [f.to_dict() for f in findings]
    f = findings[0]
    assert f.reader.rid == "r-ini" and f.evidence["via"] == "load"
    assert (f.evidence["direction"], f.evidence["stored_pages"], f.evidence["loaded_pages"]) == (
        "load_past_object",
        2,
        3,
    )


def load_before_begin(eng, rid, salt, pages=(5, 6), obj=OBJ):
    """SGLang HiCache's order: the load-back is issued and submitted during admission, before
    the request's first row and so before its REQ_BEGIN (engine_hooks/sglang/hooks_hicache.py);
    the KV_LOAD records name no scope (a radix node is found under the request's own)."""
    eng.pages_allocated(slots(*pages))
    eng.kv_loaded(rid, obj, list(pages), "issued")
    eng.kv_loaded(rid, obj, list(pages), "completed")
    eng.request_begin(rid, "initech", None, 12, 8, False, cache_salt=salt)
    eng.pages_allocated(slots(7))
    eng.rows_assigned(rid, 0, 12, 8, slots(*pages, 7))  # the loaded prefix: shared positions < 8
    eng.forward([rid], [12], [slots(7)])


def share_loaded(eng, rid, tenant, salt):
    """A later request handed r-ini's loaded pages 5, 6 by the cache (and page 8 of its own)."""
    eng.request_begin(rid, tenant, None, 12, 8, False, cache_salt=salt)
    eng.pages_allocated(slots(8))
    eng.rows_assigned(rid, 0, 12, 8, slots(5, 6, 8))
    eng.forward([rid], [12], [slots(8)])


def test_a_load_for_a_request_not_begun_yet_takes_its_scope_when_it_begins(tmp_path):
    """Salts in use: pages loaded for r-ini before its REQ_BEGIN are its scope's, so handing
    them to r-ini is no share across scopes, and a later request of r-ini's salt shares them
    quietly too."""

    def body(rec):
        eng = engine(rec)
        store_from_acme(eng)
        load_before_begin(eng, "r-ini", "ini-1")
        share_loaded(eng, "r-ini-2", "initech", "ini-1")

    findings, r = run(tmp_path, body)
    assert findings == [], [f.to_dict() for f in findings]
    assert r.pipeline.loads_unverified == 0


def test_pages_loaded_before_begin_still_may_not_cross_to_another_salt(tmp_path):
    """The clean twin's bug: the loaded pages (scope ini-1, taken at r-ini's REQ_BEGIN) handed
    by the cache to a request of another salt."""

    def body(rec):
        eng = engine(rec)
        store_from_acme(eng)
        load_before_begin(eng, "r-ini", "ini-1")
        share_loaded(eng, "r-glx", "globex", "glx-1")

    findings, _ = run(tmp_path, body)
    (f,) = findings
    assert (f.kind, f.reader.rid, sorted(f.pages)) == ("cross_salt_prefix_share", "r-glx", [5, 6])

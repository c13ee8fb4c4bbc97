"""``cross_salt_prefix_share``: prefix-cache pages handed across cache scopes (salt / extra key).

Recordings made through the public recording API, then ``kvguard replay``. A unified
engine, page_size 4: a first request writes pages 1, 2 (8 tokens) and finishes, the
prefix cache keeps them; a second request is handed page 1 (its first 4 tokens) from the
cache and writes its own page 3.
"""

from __future__ import annotations

import numpy as np

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.probes import Probes
from kvguard.sidecar.recorder import RecordingWriter
from kvguard.sidecar.replay import replay

PS = 4
MS = 1_000_000


def slots(*pages):
    return np.concatenate([np.arange(p * PS, (p + 1) * PS) for p in pages])


def record(path, first: dict, second: dict, second_warmup=False):
    """``first`` / ``second``: request_begin's scope keywords (extra_key, cache_salt)."""
    with RecordingWriter(path, overwrite=True) as rec:
        eng = Probes(rec.engine(engine_id=1))
        eng.hello("unified", 0, PS, 64, 64 * PS, 256, 256, "sglang", "0.5.23", "tiny", pid=1001)
        eng.request_begin("r-acme", "acme", None, 8, 0, False, **first)
        eng.pages_allocated(slots(1, 2))
        eng.rows_assigned("r-acme", 0, 8, 0, slots(1, 2))
        eng.forward(["r-acme"], [8], [slots(1, 2)])
        eng.request_end("r-acme", "length", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
        eng.pages_freed(slots(2))  # the cache keeps page 1
        eng.request_begin("r-ini", "initech", None, 8, 4, second_warmup, **second)
        eng.pages_allocated(slots(3))
        eng.rows_assigned("r-ini", 0, 8, 4, np.concatenate((slots(1), slots(3))))  # positions < 4: shared
        eng.forward(["r-ini"], [8], [slots(3)])
        eng.request_end("r-ini", "stop", ttft_ns=MS, e2e_ns=MS, output_tokens=1, reason="")
    findings, run = replay([path])
    return findings, run


def test_the_same_salt_shares_its_prefix_quietly(tmp_path):
    findings, run = record(tmp_path / "r.kvgrec", {"cache_salt": "team-a"}, {"cache_salt": "team-a"})
    assert findings == [], [f.to_dict() for f in findings]
    assert run.summary()["apply_errors"] == 0


def test_a_prefix_page_handed_across_salts_is_critical_and_names_whose_kv_it_was(tmp_path):
    findings, _ = record(tmp_path / "r.kvgrec", {"cache_salt": "team-a"}, {"cache_salt": "team-b"})
    (f,) = findings
    assert (f.kind, f.severity, f.reader.rid, f.pages) == ("cross_salt_prefix_share", "critical", "r-ini", [1])
    assert [(p.rid, p.tenant, p.pages) for p in f.exposed] == [("r-acme", "acme", [1])]
    assert f.evidence == {
        "reader_scope": f"{wire.request_scope(None, 'team-b'):016x}",
        "writer_scopes": [f"{wire.request_scope(None, 'team-a'):016x}"],
    }
    assert "team-" not in str(f.to_dict())  # the salts themselves never leave the engine


def test_the_default_scope_is_a_scope_a_salted_request_must_not_share(tmp_path):
    findings, _ = record(tmp_path / "r.kvgrec", {}, {"cache_salt": "team-b"})
    (f,) = findings
    assert f.kind == "cross_salt_prefix_share" and f.evidence["writer_scopes"] == ["0000000000000000"]


def test_extra_keys_separate_scopes_too(tmp_path):
    """SGLang appends the LoRA id to extra_key: two adapters' KV is not the same model's."""
    findings, _ = record(tmp_path / "r.kvgrec", {"extra_key": "lora-1"}, {"extra_key": "lora-2"})
    assert [f.kind for f in findings] == ["cross_salt_prefix_share"]
    findings, _ = record(tmp_path / "s.kvgrec", {"extra_key": "lora-1"}, {"extra_key": "lora-1"})
    assert findings == []


def test_an_engine_without_scopes_keeps_no_scope_column_and_judges_nothing(tmp_path):
    findings, run = record(tmp_path / "r.kvgrec", {}, {})
    assert findings == []
    (tracker,) = run.pipeline.engines.values()
    assert tracker.pool.scope is None


def test_a_warmup_reader_is_never_alarmed(tmp_path):
    findings, _ = record(tmp_path / "r.kvgrec", {"cache_salt": "a"}, {"cache_salt": "b"}, second_warmup=True)
    assert findings == []


def test_the_scope_column_counts_in_the_pools_memory(tmp_path):
    _, run = record(tmp_path / "r.kvgrec", {"cache_salt": "a"}, {"cache_salt": "a"})
    (tracker,) = run.pipeline.engines.values()
    pool = tracker.pool
    assert pool.scope is not None and pool.nbytes >= pool.scope.nbytes + pool.state.nbytes
    pool.ensure(np.array([pool.num_pages + 10]))  # grows with the other columns
    assert len(pool.scope) == pool.num_pages

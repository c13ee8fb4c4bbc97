"""``Pipeline.stats()`` (sidecar/stats.py): what the pipeline publishes for /metrics and /v1.

The collector renders these values after the lock is released (and serves them again
as a snapshot), so they must be copies the ingest thread cannot change underneath,
frozen, and complete: every outcome and page state at 0 where nothing was counted.
"""

import dataclasses

import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.sidecar import metrics
from kvguard.sidecar.stats import PipelineStats
from tests.sidecar.test_ledger import begin, engines, finish, receive, run, send


def test_a_transfer_is_published_per_receiving_engine_with_zero_series_for_the_sender(tmp_path):
    prefill, decode = engines(tmp_path)
    begin(prefill, decode, "r-1", 101, 8, [1, 2])
    send(prefill, "r-1", 101, 8)
    receive(decode, "r-1", 101, 8)
    finish(decode, "r-1", [1, 2], 8)
    sidecar, _sink = run(tmp_path)
    with sidecar.lock:
        stats = sidecar.pipeline_stats()
    by_role = {e.role: e for e in stats.engines}
    assert set(by_role) == {"prefill", "decode"} and all(e.announced for e in stats.engines)
    decode_id, prefill_id = by_role["decode"].engine_id, by_role["prefill"].engine_id
    assert stats.ledger.transfers_by_engine[decode_id] == {"paired": 1, "unverified": 0, "unpaired": 0, "warmup": 0}
    assert set(stats.ledger.transfers_by_engine[prefill_id].values()) == {0}
    assert stats.ledger.digests_compared == 1
    assert by_role["decode"].pages_read > 0 and by_role["decode"].pages_by_state["free"] == 2
    assert stats.records_by_kind["XFER_SEND"] == 1 and stats.apply_errors == 0
    assert stats.possible_findings == tuple(sorted(stats.possible_findings))
    assert stats.memory.bytes_by_part["transfer_rooms"] > 0
    sidecar.stop()


def test_stats_are_frozen_copies_the_ingest_thread_does_not_change(tmp_path):
    _prefill, decode = engines(tmp_path)
    sidecar, _sink = run(tmp_path)
    stats = sidecar.pipeline_stats()
    hellos = stats.records_by_kind["HELLO"]
    (decode_stats,) = [e for e in stats.engines if e.role == "decode"]
    decode.pages_allocated(np.arange(4, 12))
    sidecar.run_once(flush=True)
    assert stats.records_by_kind["HELLO"] == hellos and "ALLOC" not in stats.records_by_kind
    assert decode_stats.pages_by_state["allocated"] == 0  # taken before the ALLOC
    later = sidecar.pipeline_stats()
    assert later.records_by_kind["ALLOC"] == 1
    assert [e.pages_by_state["allocated"] for e in later.engines if e.role == "decode"] == [2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.apply_errors = 1  # type: ignore[misc]
    sidecar.stop()


def test_an_engine_seen_before_its_hello_is_published_as_unknown(tmp_path):
    sidecar, _sink = run(tmp_path)
    sidecar.pipeline.tracker(7)
    stats: PipelineStats = sidecar.pipeline_stats()
    (engine,) = stats.engines
    assert (engine.role, engine.pid, engine.pool_tokens, engine.announced) == ("unknown", None, None, False)
    assert metrics.engine_labels(engine) == ["unknown", "0"]
    assert sum(engine.pages_by_state.values()) == 1  # the one-page pool before any HELLO
    sidecar.stop()


def test_the_collector_reads_no_pipeline_internals():
    """/metrics renders PipelineStats only: the module names no model of the pipeline."""
    source = metrics.__file__
    text = open(source).read()
    for reach in ("pipeline.", ".pool.", "ttft_detector", ".ledger.", "ROLE_NAMES"):
        assert reach not in text, f"{source} reads {reach!r}"
    assert wire.Kind.PAD.name not in metrics.APPLIED_RECORD_KINDS

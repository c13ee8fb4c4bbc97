"""The tests' and demos' wait for an in-process sidecar: it returns only once every record
published so far is applied, not merely after a quiet spell (an ingest thread starved of
CPU applies nothing for a while, which looks quiet)."""

import threading
import time

import numpy as np

from kvguard.demo.settle import drained, wait_until_applied
from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar


def _engine(tmp_path) -> Probes:
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 2048, 250, "sglang", "0.5.23", "tiny")
    return p


def test_a_record_left_in_the_ring_is_not_drained_until_a_cycle_applies_it(tmp_path):
    p = _engine(tmp_path)
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    try:
        sidecar.run_once(flush=True)
        assert drained(sidecar)
        p.pages_allocated(np.arange(8))
        assert not drained(sidecar)  # published, not read
        sidecar.run_once(flush=True)
        assert drained(sidecar) and sidecar.pipeline.records_by_kind["ALLOC"] == 1
    finally:
        sidecar.stop()


def test_the_wait_outlasts_a_quiet_spell_while_a_record_is_unread(tmp_path):
    """The ingest is held (as a starved thread would be) for longer than the quiet spell with
    a record in the ring: the wait returns only after the record is applied."""
    p = _engine(tmp_path)
    sidecar = Sidecar(str(tmp_path), slack_ns=0, poll_interval_s=0.01)
    sidecar.run_once(flush=True)
    p.pages_allocated(np.arange(8))
    applied_after_hold = threading.Event()

    def starve_then_apply() -> None:
        time.sleep(0.6)  # three quiet spells of the wait below
        sidecar.run_once(flush=True)
        applied_after_hold.set()

    starver = threading.Thread(target=starve_then_apply)
    starver.start()
    try:
        wait_until_applied(sidecar, quiet_s=0.2, max_s=5.0)
        assert applied_after_hold.is_set()
        assert sidecar.pipeline.records_by_kind["ALLOC"] == 1
    finally:
        starver.join()
        sidecar.stop()

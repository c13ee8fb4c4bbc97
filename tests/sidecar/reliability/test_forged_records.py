"""Issue 14, item 5: a record cannot change another engine's state or raise a finding about it.

Records are bound to the ring they come from: the engine identity is the ring header's
``engine_id``, and a record stamped with another id is skipped and counted
(``kvguard_records_invalid_total{reason="foreign_engine"}``). A second ring whose header
claims an attached engine's id is refused (a ring error naming both rings).

Before the fix, a second ring writing FREE records stamped with a healthy engine's id made
the real ``kvguard sidecar`` raise ``double_free`` and ``use_after_free`` *critical*
findings naming that engine's requests, and 20 forged ids made 20 engines' series in
``/metrics``.
"""

from __future__ import annotations

import re
import struct
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvguard.engine_hooks import wire
from kvguard.engine_hooks.ring import RingWriter
from tests.sidecar.reliability.sidecar_under_test import counter, healthy_setup, stop_all

POOL_PAGES = 256  # the synthetic engine's pool (synthetic_engine.POOL_PAGES)
TOKEN = "forged-records-test"  # the sidecar's /v1 bearer token


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    stop_all(started)


def header_engine_id(ring: Path) -> int:
    _magic, _version, _hsize, _cap, _pid, engine_id, _start, _ticks = struct.unpack(
        "<8sIIQIIQQ", ring.read_bytes()[:48]
    )
    return engine_id


def findings_naming_engines(metrics: str) -> float:
    return sum(float(v) for v in re.findall(r"^kvguard_findings_total\{[^}]*\} (\S+)$", metrics, re.M))


def engines_listed(port: int) -> list[int]:
    reply = httpx.get(f"http://127.0.0.1:{port}/v1/engines", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    reply.raise_for_status()
    return sorted(int(e["engine"]) for e in reply.json()["engines"])


def forge_frees(writer: RingWriter, victim: int, rounds: int, spread_ids: int = 0) -> None:
    """FREE records of every page of the victim's pool, stamped with ``victim``'s id (and with
    ``spread_ids`` made-up ids), from ``writer``'s ring, whose header keeps its own id."""
    pages = wire.pages_payload(np.arange(POOL_PAGES, dtype=np.int64), wire.FreeKind.PAGE_IDS)
    own = writer.engine_id
    for _ in range(rounds):
        for stamp in [victim] + [0x7000 + k for k in range(spread_ids)]:
            writer.engine_id = stamp  # the header was written with ``own``: only the records lie
            writer.write(wire.Kind.FREE, pages)
            writer.engine_id = own
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_records_stamped_with_another_engines_id_change_nothing(tmp_path, procs, monkeypatch):
    monkeypatch.setenv("KVGUARD_API_TOKEN", TOKEN)  # /v1/engines, for the list of engines it keeps state for
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    (healthy_ring,) = ring_dir.glob("*.ring")
    victim = header_engine_id(healthy_ring)
    hostile = RingWriter(str(ring_dir), 1 << 20, engine_id=0xF0E)
    try:
        forge_frees(hostile, victim, rounds=40, spread_ids=20)
        sidecar.wait_for(
            "the forged records counted",
            lambda: counter(sidecar.metrics(), 'kvguard_records_invalid_total{reason="foreign_engine"}') >= 40 * 21,
            20,
        )
        sidecar.reads_keep_being_checked(engine.pid)
        final = sidecar.metrics()
        assert findings_naming_engines(final) == 0, [ln for ln in final.splitlines() if "findings_total" in ln]
        assert counter(final, "kvguard_rings_attached") == 2
        listed = engines_listed(sidecar.port)
        assert not any(0x7000 <= e < 0x7000 + 20 for e in listed), listed  # no series, no state for made-up ids
        assert len(re.findall(r"^kvguard_page_reads_checked_total\{", final, re.M)) <= 2
    finally:
        hostile.close(unlink=True)


@pytest.mark.timeout(90)
def test_a_ring_whose_header_claims_an_attached_engines_id_is_refused(tmp_path, procs):
    ring_dir, engine, sidecar = healthy_setup(tmp_path, procs)
    (healthy_ring,) = ring_dir.glob("*.ring")
    victim = header_engine_id(healthy_ring)
    errors_before = counter(sidecar.metrics(), "kvguard_ring_errors_total")
    copycat = RingWriter(str(ring_dir), 1 << 20, engine_id=victim)  # header and records both claim it
    try:
        forge_frees(copycat, victim, rounds=20)
        sidecar.wait_for(
            "the copycat ring refused",
            lambda: counter(sidecar.metrics(), "kvguard_ring_errors_total") > errors_before,
            20,
        )
        forge_frees(copycat, victim, rounds=20)  # it keeps writing: still refused, said once
        sidecar.reads_keep_being_checked(engine.pid)
        final = sidecar.metrics()
        assert findings_naming_engines(final) == 0
        assert counter(final, "kvguard_rings_attached") == 1
        assert counter(final, "kvguard_ring_errors_total") == errors_before + 1
        refusals = [ln for ln in sidecar.log_text().splitlines() if "refusing ring" in ln]
        assert len(refusals) == 1 and f"engine_id {victim}" in refusals[0] and str(healthy_ring) in refusals[0]
    finally:
        copycat.close(unlink=True)

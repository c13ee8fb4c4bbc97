"""cross_tenant_prefix_share: off by default; when tenants are declared isolated, a
prefix-cache page written by one tenant and read by another is reported (only then)."""

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink


def shared_prefix_stream(tmp_path, second_tenant):
    #   acme writes pages 1,2 (8 tokens) and ends: the radix cache keeps them
    #   the next request matches those 8 tokens and gets pages 1,2 as its prefix, plus page 3
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    p.request_begin("r-a", "acme", None, 8, 0, False)
    p.pages_allocated(np.arange(4, 12))
    p.rows_assigned("r-a", 0, 8, 0, np.arange(4, 12))
    p.forward(["r-a"], [8], [np.arange(4, 12)], [np.arange(4, 12)])
    p.request_end("r-a", "stop", 1, 2, 1, "")
    p.request_begin("r-b", second_tenant, None, 12, 8, False)
    p.pages_allocated(np.arange(12, 16))
    p.rows_assigned("r-b", 0, 12, 8, np.arange(4, 16))
    p.forward(["r-b"], [12], [np.arange(12, 16)], [np.arange(4, 16)])


def findings(tmp_path, isolate):
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0, isolate_tenants=isolate)
    sidecar.run_once(flush=True)
    sidecar.stop()
    return sink.findings


def test_cross_tenant_sharing_is_reported_when_tenants_are_isolated(tmp_path):
    shared_prefix_stream(tmp_path, "globex")
    (f,) = findings(tmp_path, isolate=True)
    assert (f.kind, f.severity, f.reader.tenant, f.pages) == ("cross_tenant_prefix_share", "warning", "globex", [1, 2])
    assert [(e.rid, e.tenant) for e in f.exposed] == [("r-a", "acme")]


def test_off_by_default_and_silent_within_one_tenant(tmp_path):
    shared_prefix_stream(tmp_path, "globex")
    assert findings(tmp_path, isolate=False) == []


def test_same_tenant_sharing_is_fine(tmp_path):
    shared_prefix_stream(tmp_path, "acme")
    assert findings(tmp_path, isolate=True) == []

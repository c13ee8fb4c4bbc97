"""double_free, use_after_free (write) and late_write, each both ways (page_size 4)."""

import numpy as np

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink


def engine(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 1 << 16))
    p.hello("decode", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    return p


def slots(*pages):
    return np.concatenate([np.arange(4 * q, 4 * q + 4) for q in pages])


def start(p, rid, tenant, *pages):
    p.request_begin(rid, tenant, None, 4 * len(pages), 0, False)
    p.pages_allocated(slots(*pages))
    p.rows_assigned(rid, 0, 4 * len(pages), 0, slots(*pages))
    p.forward([rid], [4 * len(pages)], [slots(*pages)], [slots(*pages)])


def late_write_into_b(tmp_path):
    """page 2: a owns it -> freed (a aborted) -> b gets it -> a's late write lands there."""
    p = engine(tmp_path)
    start(p, "a", "acme", 1, 2)
    p.pages_freed(slots(2))
    start(p, "b", "globex", 2)
    p.forward(["a"], [9], [[8]], None)
    return p


def findings(tmp_path):
    sink = MemorySink()
    sidecar = Sidecar(str(tmp_path), sinks=[sink], slack_ns=0)
    sidecar.run_once(flush=True)
    sidecar.stop()
    return sink.findings


def test_double_free_names_the_pages_and_their_last_writer(tmp_path):
    p = engine(tmp_path)
    start(p, "a", "acme", 1, 2)
    p.request_end("a", "stop", 1, 1, 1, "")
    p.pages_freed(slots(1, 2), "group")
    p.pages_freed(slots(2), "free")
    (f,) = findings(tmp_path)
    assert (f.kind, f.pages, f.evidence["free_kind"]) == ("double_free", [2], "free")
    assert [(e.rid, e.tenant) for e in f.exposed] == [("a", "acme")]


def test_free_then_reallocate_then_free_is_not_a_double_free(tmp_path):
    p = engine(tmp_path)
    start(p, "a", "acme", 1)
    p.request_end("a", "stop", 1, 1, 1, "")
    p.pages_freed(slots(1))
    start(p, "b", "acme", 1)
    p.request_end("b", "stop", 1, 1, 1, "")
    p.pages_freed(slots(1), "deferred")
    assert findings(tmp_path) == []


def test_a_write_into_a_freed_page_is_use_after_free(tmp_path):
    p = engine(tmp_path)
    start(p, "a", "acme", 1, 2)
    p.pages_freed(slots(2))  # freed early while "a" still runs
    p.forward(["a"], [9], [[8]], None)  # ...and "a" writes its next token into it
    kinds = [(f.kind, f.evidence.get("access")) for f in findings(tmp_path)]
    assert kinds == [("use_after_free", "write")]


def test_a_write_into_a_page_reassigned_to_another_request_is_a_late_write(tmp_path):
    late_write_into_b(tmp_path)
    late, read = findings(tmp_path)
    assert (late.kind, late.reader.rid, late.pages) == ("late_write", "a", [2])
    assert [(e.rid, e.tenant) for e in late.exposed] == [("b", "globex")]
    # the same forward's attention then reads b's page: that is a foreign read as well
    assert (read.kind, read.reader.rid, read.pages) == ("foreign_read", "a", [2])


def test_writes_into_own_pages_and_decode_appends_are_fine(tmp_path):
    p = engine(tmp_path)
    start(p, "a", "acme", 1)
    p.pages_allocated(slots(2))
    p.rows_assigned("a", 4, 5, 4, [8])
    p.forward(["a"], [5], [[8]], [slots(1, 2)[:5]])
    p.rows_assigned("a", 5, 6, 5, [9])
    p.forward(["a"], [6], [[9]], [slots(1, 2)[:6]])
    assert findings(tmp_path) == []


def test_the_owner_of_a_page_a_forward_wrote_late_into_is_not_judged_on_its_next_read(tmp_path):
    """A forward writes token slots: the owner may write that slot itself before it reads it,
    and the record names pages, not slots. So the late write is reported (late_write, naming
    the owner) and the owner's read of the page is not judged unwritten (a late transfer chunk,
    which fills whole pages, is: tests/tools/test_spec.py)."""
    p = late_write_into_b(tmp_path)
    p.forward(["b"], [4], [[]], [slots(2)])
    found = findings(tmp_path)
    assert [(f.kind, f.reader.rid) for f in found] == [("late_write", "a"), ("foreign_read", "a")]
    assert [(e.rid, e.tenant) for e in found[0].exposed] == [("b", "globex")]


def test_a_write_into_a_free_page_names_no_exposed_party_and_a_later_read_names_the_writer(tmp_path):
    p = engine(tmp_path)
    start(p, "a", "acme", 1, 2)
    p.pages_freed(slots(2))
    p.forward(["a"], [9], [[8]], None)  # a's KV lands in free page 2
    p.request_end("a", "stop", 1, 1, 1, "")
    p.pages_freed(slots(1))
    p.request_begin("b", "globex", None, 4, 0, False)
    p.pages_allocated(slots(2))
    p.rows_assigned("b", 0, 4, 0, slots(2))
    p.forward(["b"], [4], [[]], [slots(2)])  # nothing wrote it for b: a's KV is what it holds
    uaf, read = findings(tmp_path)
    assert (uaf.kind, uaf.evidence.get("access"), uaf.exposed) == ("use_after_free", "write", [])
    assert (read.kind, read.reader.rid) == ("unwritten_read", "b")
    assert [(e.rid, e.tenant) for e in read.exposed] == [("a", "acme")]

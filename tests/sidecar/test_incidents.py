"""Incidents: grouping, dedup, stable ids, resolution; and the bounded event history."""

import numpy as np

from kvguard.sidecar.findings import EngineRef, Finding, Party
from kvguard.sidecar.history import Event, History
from kvguard.sidecar.incidents import FIRING, RESOLVED, IncidentStore, incident_id, incident_key

ENGINE = EngineRef("decode", 0, 42)


def read(rid="r1", pages=(2, 3), exposed=(("a", "acme", (2,)),), ts=1):
    return Finding(
        "unwritten_read",
        "critical",
        ENGINE,
        Party(rid, "initech", 7),
        list(pages),
        [Party(r, t, None, list(p)) for r, t, p in exposed],
        ts,
        "s",
    )


def test_repeats_update_one_incident_and_are_not_new():
    store = IncidentStore()
    inc, new = store.observe(read(ts=1))
    assert new and inc.state == FIRING and inc.count == 1
    inc2, new2 = store.observe(read(pages=(3, 4), exposed=(("b", "globex", (4,)),), ts=5))
    assert inc2 is inc and not new2
    d = inc.to_dict()
    assert d["count"] == 2 and d["pages"] == [2, 3, 4] and d["tenants_exposed"] == ["acme", "globex"]
    assert (d["first_seen_ns"], d["last_seen_ns"]) == (1, 5)


def test_ids_are_stable_across_stores_and_distinct_per_reader():
    a, b = IncidentStore(), IncidentStore()
    assert a.observe(read())[0].id == b.observe(read())[0].id == incident_id(incident_key(read()))
    assert a.observe(read(rid="r2"))[0].id != a.observe(read())[0].id


def test_a_read_incident_resolves_when_its_reader_ends_and_fires_again_if_it_recurs():
    store = IncidentStore()
    inc, _ = store.observe(read())
    assert [i.id for i in store.on_request_end(42, "r1", 9)] == [inc.id]
    assert inc.state == RESOLVED and inc.resolution == "the reading request ended"
    _, new = store.observe(read(ts=10))
    assert new and inc.state == FIRING


def test_quiet_kinds_resolve_after_the_quiet_period():
    store = IncidentStore(quiet_resolve_ns=100)
    lost = Finding("events_lost", "warning", ENGINE, None, [], [], 10, "lost")
    inc, _ = store.observe(lost)
    assert store.tick(50) == [] and [i.id for i in store.tick(200)] == [inc.id]


def test_store_is_bounded_and_evicts_resolved_first():
    store = IncidentStore(max_incidents=2)
    first, _ = store.observe(read(rid="r1"))
    store.on_request_end(42, "r1", 2)
    store.observe(read(rid="r2"))
    store.observe(read(rid="r3"))
    assert first.id not in store.incidents and len(store.incidents) == 2


def test_history_keeps_the_newest_events_in_time_order():
    h = History(capacity=8)
    for i in range(6):
        h.append(i, 1, Event.ALLOC, 0, np.array([i % 3]), np.array([i]))
    h.append(6, 1, Event.WRITE, np.array([5, 5], np.uint64), np.array([0, 1]))
    h.append(7, 1, Event.READ, np.array([5], np.uint64), aux=np.array([9]))
    assert h.total == 9 and h.size == 8
    ev = h.page_events(1, 0)
    assert ev["ts_ns"].tolist() == [3, 6] and ev["event"].tolist() == [Event.ALLOC, Event.WRITE]
    req = h.request_events(5)
    assert [(int(e["event"]), int(e["page"]), int(e["aux"])) for e in req] == [
        (Event.WRITE, 0, 0),
        (Event.WRITE, 1, 0),
        (Event.READ, -1, 9),
    ]


def test_history_appends_every_shape_of_event_alike_across_the_ring_end():
    """One event (scalar fields), several pages, per-request arrays, scalar or per-page
    generations: each event's fields as given, wherever the write cursor is (slices before the
    ring's end, wrapped indices across it)."""
    rng = np.random.default_rng(7)
    h = History(capacity=10)
    expected = []
    for i in range(60):
        shape = i % 4
        if shape == 0:  # one event, no page
            h.append(i, 2, Event.REQ_BEGIN, 40 + i, aux=i)
            expected.append((i, 40 + i, -1, 0, i))
        elif shape == 1:  # one page, a scalar generation
            h.append(i, 2, Event.ALLOC, 0, np.array([i]), 3)
            expected.append((i, 0, i, 3, 0))
        elif shape == 2:  # several pages, per-page generations, one request
            pages, gens = rng.integers(0, 99, 3), rng.integers(0, 9, 3)
            h.append(i, 2, Event.WRITE, 7, pages, gens)
            expected += [(i, 7, int(p), int(g), 0) for p, g in zip(pages, gens)]
        else:  # per-request reads
            keys, lens = np.array([1, 2], np.uint64), np.array([5, 6])
            h.append(i, 2, Event.READ, keys, aux=lens)
            expected += [(i, 1, -1, 0, 5), (i, 2, -1, 0, 6)]
    assert h.total == len(expected)
    newest = expected[-h.capacity :]
    start = h.total % h.capacity  # the oldest kept event's slot
    order = [(start + j) % h.capacity for j in range(h.capacity)]
    got = [tuple(int(h.events[k][f]) for f in ("ts_ns", "req_key", "page", "gen", "aux")) for k in order]
    assert got == newest
    assert set(h.events["engine"].tolist()) == {2} and set(h.events["pool"].tolist()) == {0}


def storm_read(i: int, pages: int = 150, ts: int = 1) -> Finding:
    """A realistic critical read: a 32-hex rid, 150 pages read unwritten, three exposed parties
    (the incident's demo read is 149 pages), page ids past the small-int cache."""
    base = 10_000 + (i * 151) % 20_000
    ids = list(range(base, base + pages))
    exposed = [Party(f"{i:08x}{k:024x}", f"tenant-{k}", None, ids[k::3]) for k in range(3)]
    return Finding(
        "unwritten_read",
        "critical",
        ENGINE,
        Party(f"{i:032x}", "initech", 7),
        ids,
        exposed,
        ts,
        f"decode rank 0: request {i:032x} of tenant initech read {pages} pages nothing wrote for it",
        {"sender_rid": f"{i:032x}", "sender_tenant": "initech"},
    )


def test_the_store_estimate_is_not_below_what_incidents_cost():
    """INCIDENT_BYTES, STORED_FINDING_BYTES and PAGE_ID_BYTES are measured, rounded up: the
    estimate the byte bound applies is at least what the incidents take (and not 3x more)."""
    import tracemalloc

    store = IncidentStore(max_incidents=10**9, max_bytes=1 << 40)
    n = 400
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for i in range(n):
            for repeat in range(3):  # repeats store their findings, with their page lists
                store.observe(storm_read(i, ts=1 + repeat))
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"{(after - before) / n:.0f} B per incident measured, {store.nbytes / n:.0f} estimated")
    assert after - before <= store.nbytes < 3 * (after - before)


def test_a_storm_of_incidents_stays_within_the_byte_bound_and_keeps_the_newest():
    store = IncidentStore(max_bytes=2 << 20)
    ids = [store.observe(storm_read(i, ts=i))[0].id for i in range(2_000)]
    assert store.nbytes <= 2 << 20 and store.evicted > 0
    assert store.nbytes == sum(i.nbytes for i in store.incidents.values())  # the running total is exact
    assert ids[-1] in store.incidents and ids[0] not in store.incidents  # the oldest went first
    kept = len(store.incidents)
    # a resolved incident goes before any firing one, however old
    store.on_request_end(42, f"{1_999:032x}", 10**9)
    store.observe(storm_read(5_000, ts=10**9))
    assert ids[-1] not in store.incidents and ids[-2] in store.incidents and len(store.incidents) <= kept
    # an evicted reader's end finds nothing to resolve, and nothing is left behind for it
    assert store.on_request_end(42, f"{0:032x}", 10**9) == [] and len(store._by_reader) <= len(store.incidents)


def test_a_repeat_naming_a_new_exposed_party_says_so_and_one_naming_none_does_not():
    store = IncidentStore()
    inc, new = store.observe(read(exposed=(("a", "acme", (2,)),), ts=1))
    assert new and not inc.exposed_grew
    inc, new = store.observe(read(exposed=(("a", "acme", (2,)),), ts=2))
    assert not new and not inc.exposed_grew
    inc, new = store.observe(read(exposed=(("b", "globex", (3,)),), ts=3))
    assert not new and inc.exposed_grew and sorted(inc.exposed) == ["a", "b"]
    inc, new = store.observe(read(exposed=(), ts=4))
    assert not new and not inc.exposed_grew

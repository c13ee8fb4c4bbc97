"""SGLang's hierarchical cache (HiCache) on a real engine on CPU (0.5.23; `make test-versions`
runs it on 0.5.20-0.5.22 with KVGUARD_HICACHE_SGLANG), watched by kvguard.

HiCache backs radix-cache prefixes up from the device KV pool to a host pool and loads
them back when a request hits a prefix that was evicted from the device. A load-back
writes device pages outside any forward: without the adapter's HiCache hooks
(engine_hooks/sglang/hooks_hicache.py) every request reading a prefix loaded back from
the host was an ``unwritten_read`` (seen on this engine before the hooks existed).

The engine runs with HiCache's ``direct`` I/O backend and ``layer_first`` host layout,
which run on a CPU with the switches of ``kvguard.demo.cpu_compat`` (host buffer not
registered with CUDA, a torch index copy for sgl_kernel's ``transfer_kv_direct``). A
pool of 256 tokens (64 pages of 4) holds two 100-token prompts: four others evict the
first, whose next request loads its prefix back from the host.

The test-only fault plugin (tests/faults, faults ``hicache_host_flipped``,
``hicache_other_object`` and ``hicache_load_freed``) is armed in the same engine; each acts
only on a request named for it: the victim's backup is changed in host memory before its
load-back, or its load-back takes another backup's host slots (the content identity,
``KVGUARD_PAGE_IDENTITY``, on in this engine, catches it), or the victim's load-back is given
back to the allocator before its copy is submitted (last).
"""

from __future__ import annotations

import os
import random

import pytest

from kvguard.demo.engines import start_engine
from kvguard.engine_hooks import wire
from tests.support.engine_watch import Watch, describe, generate, prompt
from tests.support.fault_plugin import FAULTS_DIR, make_rid

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

VERSION = os.environ.get("KVGUARD_HICACHE_SGLANG", "0.5.23")  # make test-versions: each release
POOL = 256
PROMPT = 100
# the fault plugin arms on the victim's prefix lookup (mem_cache.common._req_radix_key, from 0.5.22)
FAULTS_RUN = VERSION in ("0.5.22", "0.5.23")
needs_faults = pytest.mark.skipif(not FAULTS_RUN, reason=f"the fault plugin cannot arm on SGLang {VERSION}")
HICACHE_ARGS = [
    "--enable-hierarchical-cache",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
    "--max-running-requests",
    "4",
]


@pytest.fixture(scope="module")
def hicache(tmp_path_factory, require_sglang):
    require_sglang(VERSION)
    work = tmp_path_factory.mktemp("hicache")
    ring_dir, events_dir = work / "rings", work / "events"
    ring_dir.mkdir()
    events_dir.mkdir()
    watch = Watch(ring_dir, events_dir)
    try:
        engine = start_engine(
            VERSION,
            work / "logs",
            max_total_tokens=POOL,
            context_length=512,
            ring_dir=ring_dir,
            extra_args=HICACHE_ARGS,
            extra_env={
                "KVGUARD_ROW_SAMPLE_EVERY": "1",  # the engine's own rows with every forward
                "KVGUARD_FAULT": "hicache_host_flipped,hicache_load_freed,hicache_other_object",
                "KVGUARD_FAULT_DIR": str(events_dir),
                # what prefix each page holds, carried through the host and back (sidecar/offload.py)
                "KVGUARD_PAGE_IDENTITY": "1",
                # the fault leaves the tree naming free pages, which SGLang's idle check raises on
                "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0",
            },
            extra_pythonpath=[FAULTS_DIR],
        )
    except BaseException:
        watch.stop()
        raise
    watch.settle()
    yield engine, watch
    try:
        assert engine.is_running(), engine.log_tail()
        watch.assert_plugin_ok()
        assert watch.sidecar.rings.stats.records_lost == 0
        assert watch.sidecar.pipeline.apply_errors == 0
    finally:
        engine.stop()
        watch.stop()


def records(watch: Watch, kind: wire.Kind) -> int:
    return watch.sidecar.pipeline.records_by_kind.get(kind.name, 0)


def evict_and_reload(engine, rng, first_rid: str, again_rid: str, tenant: str) -> tuple[list[int], dict]:
    """A prompt, four others that evict it to the host, then the prompt continued (its
    answer and more: the whole backup is a prefix of it, so the load-back takes all of it
    and its digest compares with the backup's; the engine's answer says it came from the
    host). Returns the prompt and that answer."""
    a = prompt(rng, PROMPT)
    first = generate(engine.url, first_rid, a, 4, tenant, extra_key=tenant)
    for i in range(4):
        filler = ("globex", "initech")[i % 2]
        generate(engine.url, f"{first_rid}-fill-{i}", prompt(rng, PROMPT), 4, filler, extra_key=filler)
    continued = a + first["output_ids"] + prompt(rng, 5)
    again = generate(engine.url, again_rid, continued, 4, tenant, extra_key=tenant)
    details = again["meta_info"].get("cached_tokens_details") or {}
    assert details.get("host", 0) >= 64, again["meta_info"]  # loaded back from the host pool
    return a, again


def test_prefixes_loaded_back_from_the_host_are_written_and_quiet(hicache):
    """A prompt, evicted to the host by four others, then asked for twice: its prefix is
    loaded back (the engine says so: cached tokens from the host), every copy is seen as
    a store or a load, and nothing is reported. The requests carry their tenant as
    ``extra_key``, SGLang's radix-cache scope: the loaded pages take the scope of the
    request they were loaded for, so handing them to it is no share across scopes."""
    engine, watch = hicache
    rng = random.Random(7)
    mark = watch.mark()
    a, again = evict_and_reload(engine, rng, "hic-a-1", "hic-a-2", "acme")
    third = generate(engine.url, "hic-a-3", a, 4, "acme", extra_key="acme")
    assert third["meta_info"]["cached_tokens"] >= 64, third["meta_info"]
    assert watch.since(mark) == [], describe(watch.since(mark))
    pipeline = watch.sidecar.pipeline
    assert records(watch, wire.Kind.KV_STORE) >= 1 and records(watch, wire.Kind.KV_LOAD) >= 2
    assert pipeline.loads_unverified == 0  # every load named a backup the sidecar saw stored
    assert pipeline.load_digests_compared >= 1  # a whole backup loaded back: the same bytes
    assert records(watch, wire.Kind.PROBE_ERROR) == 0
    assert records(watch, wire.Kind.REQ_SCOPE) >= 7
    # the request a load-back was for began before the load (with the prefix it was admitted
    # with), so findings name it and the TTFT rule counts its loaded prefix as cached
    (tracker,) = pipeline.engines.values()
    info = tracker.requests.get(wire.request_key("hic-a-2"))
    assert info is not None and info.cached_tokens == again["meta_info"]["cached_tokens"], info
    # the loaded-back pages took the backup's content identity, and the hits on them matched
    identity = pipeline.stats().page_identity
    assert identity["loaded"] >= 16 and identity["matched"] >= 16 and identity["mismatched"] == 0, identity


def fault_on_reload(engine, watch, fault: str, seed: int) -> tuple[str, dict, list]:
    """A victim's prompt evicted and asked for again, with ``fault`` acting on its
    load-back: (the victim's rid, the plugin's event, the findings since)."""
    mark = watch.mark()
    victim = make_rid(fault, "v", "1")
    evict_and_reload(engine, random.Random(seed), f"hic-{fault}", victim, "acme")
    ev = watch.wait_event(fault, "injected")
    assert ev["victim"] == victim
    return victim, ev, watch.since(mark)


@needs_faults
def test_host_kv_changed_at_rest_is_caught_when_it_is_loaded_back(hicache):
    """The victim's backup changes in host memory (one K value per layer of one slot)
    before its load-back: the loaded bytes are not the backed-up ones."""
    victim, ev, found = fault_on_reload(*hicache, "hicache_host_flipped", 13)
    (f,) = found
    assert (f.kind, f.severity, f.evidence["via"]) == ("checksum_mismatch", "critical", "load"), f.to_dict()
    assert f.evidence["stored_digest"] != f.evidence["loaded_digest"]
    assert (f.reader.rid, f.reader.tenant) == (victim, "acme")
    assert ev["device_slot"] // 4 in f.pages  # the load's pages, the changed slot's among them


@needs_faults
def test_a_prefix_loaded_back_from_another_prefixs_backup_names_whose_kv_it_is(hicache):
    """The tree hands the victim's load-back another node's host slots (a tier serving
    another prefix's KV under this one; Dynamo #15079's class): the backup loaded is intact,
    so its digest matches; the content identity it carried back does not match the
    victim's prefix, and the finding names the filler request whose prompt it is."""
    engine, watch = hicache
    victim, ev, found = fault_on_reload(engine, watch, "hicache_other_object", 17)
    assert ev["tokens"] >= 64
    (f,) = found
    assert (f.kind, f.severity, f.evidence["via"]) == ("prefix_content_mismatch", "critical", "prefix_hit"), f.to_dict()
    assert (f.reader.rid, f.reader.tenant) == (victim, "acme")
    assert len(f.pages) >= 16
    (party,) = f.exposed
    assert party.tenant in ("globex", "initech") and party.rid.startswith("hic-hicache_other_object-fill-"), party


@needs_faults
def test_a_load_back_into_pages_given_back_meanwhile_is_caught(hicache):
    """The bug (SGLang #31427 / #30321, a load-back racing an eviction): the victim's
    load-back is queued, then its destination pages go back to the allocator before the
    copy is submitted. The copy lands in free pages, and the victim reads them as its
    prefix. Last in the module: the engine's tree names free pages from here on."""
    victim, ev, found = fault_on_reload(*hicache, "hicache_load_freed", 11)
    assert ev["pages"]
    load = [f for f in found if f.evidence.get("via") == "load"]
    assert len(load) == 1, describe(found)
    f = load[0]
    assert (f.kind, f.severity, f.evidence["access"]) == ("use_after_free", "critical", "write"), f.to_dict()
    assert (f.reader.rid, f.reader.tenant) == (victim, "acme")
    assert sorted(f.pages) == sorted(ev["pages"])  # the pages the load landed in, freed under it
    assert f.exposed == []  # free pages: nobody's KV was overwritten by it
    # whatever follows (the victim reading pages handed out again) names only the victim
    assert {g.reader.rid for g in found} == {victim}, describe(found)

"""Tier 1 on real SGLang 0.5.23 objects (run by tests/engine_side/test_tier1.py in a subprocess).

Uses the engine bench's set-up (bench/engine_bench.py: a real PagedTokenToKVPoolAllocator,
a real ReqToTokenPool whose rows share radix-style prefixes, the real alloc_for_decode
and a real ForwardBatch, with the adapter's hooks wrapped as HookRegistry wraps them),
at a small batch. Prints one JSON line: what a healthy run, a corrupt row entry and a
bad input did.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import warnings


def main() -> int:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    from bench.engine_bench import PAGE, Engine
    from kvguard.engine_hooks import wire

    torch.set_num_threads(1)
    out = {}
    tmp = tempfile.mkdtemp(prefix="kvg-t1-")
    eng = Engine(8, 200, tmp, tier1=True)
    try:
        t1 = eng.probes.tier1
        found = []
        to_ring = t1.on_violation  # the probes' TIER1_VIOLATION record
        t1.on_violation = lambda v, total: (found.append(v), to_ring(v, total))
        # healthy decode steps: shared prefixes, private pages, page-boundary crossings
        assigns = 0
        for _ in range(70):
            eng.step()
            assigns += sum(1 for r in eng.reader.poll().records if r.kind == wire.Kind.ASSIGN)
        out["clean"] = {
            "steps": 70,
            "checks": t1.checks,
            "violations": t1.violations,
            "assigns": assigns,
            "probe_errors": eng.probes.probe_errors,
        }
        # request 0's row page 430 (private, past the shared prefix) -> request 1's page at that index
        rt = eng.pool.req_to_token
        k = 430
        owner_slot = int(rt[2, k * PAGE])
        rt[1, k * PAGE : (k + 1) * PAGE] = rt[2, k * PAGE : (k + 1) * PAGE]
        before = t1.violations
        eng.step()
        (v,) = found
        recs = [r.body for r in eng.reader.poll().records if r.kind == wire.Kind.TIER1_VIOLATION]
        out["corrupt"] = {
            "count": t1.violations - before,
            "owner_page": owner_slot // PAGE,
            "violation": {"rid": v.rid, "pages": v.pages, "owners": v.owners, "tags": v.tags},
            "record": {
                "reader_key": int(recs[0].reader_key),
                "pages": recs[0].pages.tolist(),
                "owner_keys": [int(x) for x in recs[0].owner_keys],
            }
            if len(recs) == 1
            else recs,
        }
        # a req_to_token of an unexpected dtype: Tier 1 turns itself off, serving goes on
        eng.pool.req_to_token = rt.float()
        eng.rt.State.row_sampler = eng.rt.RowSampler(every=0)  # this step is about Tier 1 only
        fb = eng.forward_batch(torch.zeros(8, dtype=torch.int64))
        result = eng.hr.forward_hook("ModelRunner.forward")(lambda runner, fb: "ran", eng.runner, fb)
        out["bad_input"] = {
            "enabled": t1.enabled,
            "errors": t1.errors,
            "forward_result": result,
            "disabled_hooks": sorted(eng.rt.disabled_hooks()),
            "probe_errors": eng.probes.probe_errors,
        }
    finally:
        eng.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

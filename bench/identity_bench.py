"""What the per-page content identity (``KVGUARD_PAGE_IDENTITY``, engine_hooks/page_identity.py)
costs the engine, on the SGLang adapter's real hook functions (CPU, no SGLang import: the
hooks read a ScheduleBatch-shaped namespace, as tests/engine_side/test_sglang_adapter.py does).

* **A 2k-token prefill**: the adapter's ``alloc_for_extend`` AROUND hook for one request of
  2,048 new tokens (no prefix hit), identity off vs on: off, the row's ASSIGN; on, that plus
  the chain over its full pages and one PAGE_IDENTITY record. At page sizes 64 (the
  reference), 16 and 1 (SGLang's default: one hash per token).
* **A decode step**: no identity code runs per decode step (the adapter reports decode pages
  when a request finishes). What a step pays is the releases of the requests finishing in it:
  at batch B with mean output O tokens, B / O requests per step, each hashing O / P pages, so
  ``B / P`` pages per step whatever O; ``release_us`` is one release of a 512-token output at
  page 64, and ``decode_step_b256_us`` that amortised over 512 steps x 256 requests.

Probes write into a real ring, drained outside the timed region. Best of ``repeat`` runs
(``thread_time_ns``: this thread's CPU).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import types
from array import array

import numpy as np

PREFILL_TOKENS = 2048
OUTPUT_TOKENS = 512
BATCH = 256


@contextlib.contextmanager
def _identity_env():
    """``KVGUARD_PAGE_IDENTITY`` as it was, afterwards (the parts switch it per measurement)."""
    saved = os.environ.get("KVGUARD_PAGE_IDENTITY")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KVGUARD_PAGE_IDENTITY", None)
        else:
            os.environ["KVGUARD_PAGE_IDENTITY"] = saved


def _best(fn, repeat: int, drain) -> float:
    best = float("inf")
    for _ in range(repeat):
        drain()
        t0 = time.thread_time_ns()
        fn()
        best = min(best, time.thread_time_ns() - t0)
    return best / 1000.0


def bench(repeat: int = 200) -> dict:
    import torch

    from kvguard.engine_hooks import probes as probes_mod
    from kvguard.engine_hooks.ring import RingReader, RingWriter
    from kvguard.engine_hooks.sglang import _runtime as rt
    from kvguard.engine_hooks.sglang import hooks_rows as hr
    from kvguard.engine_hooks.sglang import identity_hooks

    torch.set_num_threads(1)
    out: dict = {}
    with _identity_env(), tempfile.TemporaryDirectory() as tmp:
        writer = RingWriter(tmp, 1 << 24)
        reader = RingReader(writer.path)
        probes = probes_mod.Probes(writer)

        def drain():
            while reader.poll().records:
                pass

        try:
            probes_mod.reset_probes_for_tests(probes)
            for ps in (64, 16, 1):
                prompt = array("q", np.random.default_rng(ps).integers(3, 150_000, PREFILL_TOKENS).tolist())
                req_to_token = torch.zeros((2, PREFILL_TOKENS + OUTPUT_TOKENS), dtype=torch.int32)
                req_to_token[1, :PREFILL_TOKENS] = torch.arange(ps, ps + PREFILL_TOKENS, dtype=torch.int32)
                pool = types.SimpleNamespace(req_to_token=req_to_token)
                req = types.SimpleNamespace(
                    rid="bench-prefill",
                    kv=types.SimpleNamespace(req_pool_idx=1, holds_kv=False, kv_committed_len=0),
                    origin_input_ids=prompt,
                    output_ids=array("q"),
                    bootstrap_room=None,
                    bootstrap_host=None,
                    routing_key=None,
                    finished_reason=None,
                )
                req.finished = lambda: True
                batch = types.SimpleNamespace(
                    reqs=[req], prefix_lens=[0], seq_lens_cpu=torch.tensor([PREFILL_TOKENS]), req_to_token_pool=pool
                )
                hook = hr.alloc_for_extend_hook("alloc_for_extend")
                per_mode = {}
                for mode in ("0", "1"):
                    os.environ["KVGUARD_PAGE_IDENTITY"] = mode
                    rt.State.reset()
                    rt.State.hello_done, rt.State.page_size, probes.page_size = True, ps, ps
                    per_mode[mode] = _best(lambda hook=hook, batch=batch: hook(lambda b: None, batch), repeat, drain)
                out[f"prefill_2k_off_us_p{ps}"] = per_mode["0"]
                out[f"prefill_2k_on_us_p{ps}"] = per_mode["1"]
                out[f"prefill_2k_ratio_p{ps}"] = per_mode["1"] / per_mode["0"]
                if ps == 64:  # one finished request's release: its decode pages
                    req.output_ids = array("q", range(OUTPUT_TOKENS))
                    req.kv.kv_committed_len = PREFILL_TOKENS + OUTPUT_TOKENS

                    def release(req=req, first=PREFILL_TOKENS // ps):
                        identity_hooks.Identity.tips[req.rid] = (first, 1)  # where its last extend ended
                        identity_hooks.released(req)

                    out["release_us_p64"] = _best(release, repeat, drain)
                    out["decode_step_b256_us"] = out["release_us_p64"] * BATCH / OUTPUT_TOKENS
            assert probes.disabled_probes == set(), probes.disabled_probes
        finally:
            probes_mod.reset_probes_for_tests(None)
            rt.State.reset()
            writer.close()
    return out


def bench_vllm(repeat: int = 200, block: int = 16) -> dict:
    """The same on the vLLM adapter's EngineCore hooks (engine_hooks/vllm/identity_hooks.py,
    no vLLM import: SchedulerOutput-shaped namespaces): ``Scheduler.schedule``'s hook for one
    new request of 2,048 tokens (no hit) identity off vs on; ``_free_request``'s for a
    finished request of 512 output tokens (its decode blocks); and the schedule hook of a
    decode step of batch 256 (nothing prefilling), identity off vs on: no identity code but
    one check runs there."""
    from kvguard.engine_hooks import probes as probes_mod
    from kvguard.engine_hooks.ring import RingReader, RingWriter
    from kvguard.engine_hooks.vllm import _runtime as rt
    from kvguard.engine_hooks.vllm import hooks_core as hc
    from kvguard.engine_hooks.vllm import identity_hooks

    out: dict = {}
    rng = np.random.default_rng(block)

    class Request:
        def __init__(self, rid: str, n: int):
            self.request_id = rid
            self.all_token_ids = rng.integers(3, 150_000, n).tolist()
            self.num_prompt_tokens = n
            self.num_computed_tokens = 0
            self.num_output_tokens = 0
            self.cache_salt = None
            self.sampling_params = None
            self.kv_transfer_params = None

        def is_finished(self) -> bool:
            return True

        def get_finished_reason(self):
            return 1

    def step(new=(), cached=()):
        return types.SimpleNamespace(
            scheduled_new_reqs=[
                types.SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=0) for r, ids, _ in new
            ],
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=[r for r, _ in cached],
                new_block_ids=[None for _ in cached],
                num_computed_tokens=[c for _, c in cached],
                resumed_req_ids=set(),
            ),
            num_scheduled_tokens={**{r: n for r, _, n in new}, **{r: 1 for r, _ in cached}},
        )

    with _identity_env(), tempfile.TemporaryDirectory() as tmp:
        writer = RingWriter(tmp, 1 << 24)
        reader = RingReader(writer.path)
        probes = probes_mod.Probes(writer, page_size=block)

        def fresh(mode: str):
            os.environ["KVGUARD_PAGE_IDENTITY"] = mode
            rt.State.reset()
            rt.State.hello_done, rt.State.page_size = True, block

        def drain():
            rt.State.begun.clear()
            rt.State.prefilling.clear()
            rt.State.rows.clear()
            while reader.poll().records:
                pass

        try:
            probes_mod.reset_probes_for_tests(probes)
            prefill = Request("bench-prefill", PREFILL_TOKENS)
            sched = types.SimpleNamespace(requests={"bench-prefill": prefill})
            first = step(new=[("bench-prefill", list(range(1, PREFILL_TOKENS // block + 1)), PREFILL_TOKENS)])
            decoding = [(f"d{i}", PREFILL_TOKENS + i) for i in range(BATCH)]
            decode_step = step(cached=decoding)
            per_mode = {}
            for mode in ("0", "1"):
                fresh(mode)
                per_mode["prefill", mode] = _best(lambda: hc.schedule_post(None, first, sched), repeat, drain)

                def decode_drain():
                    drain()
                    for rid, _ in decoding:
                        rt.State.rows[rid] = 1
                        rt.State.begun[rid] = True

                per_mode["decode", mode] = _best(
                    lambda: hc.schedule_post(None, decode_step, sched), repeat, decode_drain
                )
            out[f"vllm_prefill_2k_off_us_b{block}"] = per_mode["prefill", "0"]
            out[f"vllm_prefill_2k_on_us_b{block}"] = per_mode["prefill", "1"]
            out[f"vllm_prefill_2k_ratio_b{block}"] = per_mode["prefill", "1"] / per_mode["prefill", "0"]
            out["vllm_decode_step_b256_off_us"] = per_mode["decode", "0"]
            out["vllm_decode_step_b256_on_us"] = per_mode["decode", "1"]
            # one finished request's release of its 512 decode tokens' blocks (on)
            done = Request("bench-done", PREFILL_TOKENS + OUTPUT_TOKENS)
            done.num_computed_tokens = PREFILL_TOKENS + OUTPUT_TOKENS

            def finish():
                rt.State.begun[done.request_id] = True
                identity_hooks.Identity.tips[done.request_id] = (PREFILL_TOKENS // block, 1)
                hc.free_request_pre(sched, done)

            out[f"vllm_release_us_b{block}"] = _best(finish, repeat, drain)
            assert probes.disabled_probes == set(), probes.disabled_probes
        finally:
            probes_mod.reset_probes_for_tests(None)
            rt.State.reset()
            writer.close()
    return out


if __name__ == "__main__":
    for k, v in {**bench(), **bench_vllm()}.items():
        print(f"{k:32s} {v:10.2f}")

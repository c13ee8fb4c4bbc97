"""kvguard_vllm_faults: a TEST-ONLY vLLM general plugin that breaks vLLM's KV block
bookkeeping in a running engine, for kvguard's engine tests (tests/integration/test_vllm_engine.py,
docs/fault-injection.md). Never install it anywhere.

vLLM finds it through ``kvguard_vllm_faults-0.1.0.dist-info/entry_points.txt`` (group
``vllm.general_plugins``) once ``tests/faults_vllm`` is on the engine's PYTHONPATH; it
patches only when ``KVGUARD_FAULT`` names faults, and a fault only touches requests whose
``vllm_xargs`` carry ``{"kvgf": "<fault>:<role>"}`` (clients cannot choose vLLM's request ids).

Faults (the bug families of issue 17):
  ``free_live_block``      an ``intruder``'s first allocation frees the last block of a live
                           ``reader`` while it is still in the reader's table, so the intruder is
                           handed it (vLLM PR #32255 / #52234: blocks freed under a live request)
  ``double_free_preempt``  preempting a ``victim`` frees its blocks twice (the preemption paths
                           that free a request twice); vLLM's counts are put back at once, so
                           the engine runs on
  ``salt_ignored``         requests with this fault hash their prompt blocks as if they had no
                           ``cache_salt`` (#44701, #37160: a salt lost on the way to the cache)
  ``prefix_wrong_block``   a ``faulty`` request's prefix-cache hit has its last block swapped for
                           the first block of the last finished ``victim`` (a stale key after
                           eviction and reallocation, vLLM #49125 / #37076: a hit on a block
                           that holds another prefix)

Prefill/decode faults (vLLM's ``MooncakeConnector``, in decode's worker). The worker never sees
a request's ``vllm_xargs``; these touch the transfers whose ``transfer_id`` (chosen by the proxy,
here the test) contains the fault's name:
  ``pd_short_pull``        decode pulls one block fewer than it reserved, leaving its first one
                           unfilled (a reservation the sender does not fill: the incident's shape;
                           vLLM PR #50558 / #57661, reservation and send disagreeing in NIXL)
  ``pd_corrupt_recv``      one byte of the first block decode received is flipped before the
                           request reads it (a transfer that delivered other bytes than were sent)

``KVGUARD_FAULT_GROUP`` (default 0): the KV cache group whose blocks ``free_live_block`` and
``double_free_preempt`` take, in an engine of several (a sliding-window group: a block still
inside the window; a Mamba / gated-delta-net group: a state block; tests/integration/test_arch_engines.py);
an intruder's ``vllm_xargs`` may name another (``{"kvgf_group": 1}``).

``KVGUARD_FAULT_DIR``: ``events.jsonl`` gets one line per thing done (request ids, block ids).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time

log = logging.getLogger("kvguard.faults")

FAULT_ENV = "KVGUARD_FAULT"
GROUP_ENV = "KVGUARD_FAULT_GROUP"
DIR_ENV = "KVGUARD_FAULT_DIR"
FAULTS = ("free_live_block", "double_free_preempt", "salt_ignored", "prefix_wrong_block")
PD_FAULTS = ("pd_short_pull", "pd_corrupt_recv")
_lock = threading.Lock()
_roles: dict[str, tuple[str, str]] = {}  # request id -> (fault, role), for the requests we saw arrive
_stolen: dict[str, object] = {}  # reader request id -> the block freed under it
_done: set[str] = set()


def xargs(fault: str, role: str) -> dict:
    """The ``vllm_xargs`` a test sends so that ``fault`` treats the request as ``role``."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    return {"kvgf": f"{fault}:{role}"}


def _event(**fields) -> None:
    d = os.environ.get(DIR_ENV)
    if not d:
        return
    with _lock, open(os.path.join(d, "events.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")


def _role_of(request) -> tuple[str, str] | None:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    raw = extra.get("kvgf")
    if not raw or ":" not in str(raw):
        return None
    fault, role = str(raw).split(":", 1)
    return fault, role


def _group(request=None) -> int:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    if "kvgf_group" in extra:
        return int(extra["kvgf_group"])
    return int(os.environ.get(GROUP_ENV, "0") or 0)


def _wrap(cls, attr, make):
    original = cls.__dict__[attr]
    setattr(cls, attr, functools.wraps(original)(make(original)))


def _free_live_block(armed: set[str]) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def add_request(original):
        def f(self, request, *a, **k):
            role = _role_of(request)
            if role is not None:
                _roles[request.request_id] = role
            return original(self, request, *a, **k)

        return f

    _wrap(Scheduler, "add_request", add_request)

    def stealable(block) -> bool:
        # an unhashed block of one holder goes back to the front of vLLM's free queue (LIFO reuse
        # of non-cached blocks), so the very allocation that frees it hands it out again
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    def allocate_slots(original):
        def f(self, request, *a, **k):
            rid = request.request_id
            if _roles.get(rid) == ("free_live_block", "reader") and request.num_computed_tokens:
                if rid not in _done and (request.num_output_tokens > 64 or _room_to_steal(self, request)):
                    # decoding, its last block at most half full (unhashed, so stealable, for the
                    # next 8 steps or more) in every group: the test sends its intruder now. (Told
                    # at a nearly full last block, the intruder met it hashed and could not take
                    # it; it took a later one, after its own allocation: freed under the reader,
                    # handed to nobody, no tenant exposed.)
                    _done.add(rid)
                    _event(fault="observe", event="reader_decoding", reader=rid)
                if rid not in _stolen:
                    # a slow step, so that the intruder's request meets a live reader: 400 tokens
                    # last 8 s or more. (At 5 ms a step, a TP 2 engine's reader had decoded all its
                    # tokens before the intruder got through the API server, whose CPU the two
                    # busy workers share on a 2-core machine: the fault found no reader.)
                    time.sleep(0.02)

            if _roles.get(rid) == ("free_live_block", "intruder") and rid not in _done:
                # the intruder's first allocation only: it allocates its prompt's blocks, so the
                # block freed here is the one it is handed (a later call may allocate nothing)
                _done.add(rid)
                group = _group(request)
                table = self.coordinator.single_type_managers[group].req_to_blocks
                for reader, blocks in table.items():
                    if _roles.get(reader) == ("free_live_block", "reader") and blocks and reader not in _stolen:
                        block = blocks[-1]
                        if not stealable(block):
                            _event(fault="observe", event="nothing_to_steal", reader=reader, intruder=rid)
                            continue
                        _stolen[reader] = (block, group)
                        # the bug: freed while still in the reader's table; the front of the
                        # free queue, so this very allocation hands it to the intruder
                        self.block_pool.free_blocks([block])
                        _event(
                            fault="free_live_block",
                            reader=reader,
                            intruder=rid,
                            block=block.block_id,
                            index=len(blocks) - 1,
                            group=group,
                        )
                        break
            return original(self, request, *a, **k)

        return f

    def _room_to_steal(manager, request) -> bool:
        for m in manager.coordinator.single_type_managers:
            blocks = m.req_to_blocks.get(request.request_id)
            if not blocks or not stealable(blocks[-1]):
                return False
            fills_by_token = not type(m).__name__.startswith("Mamba")  # (a state block does not)
            if fills_by_token and len(blocks) * m.block_size - request.num_computed_tokens < m.block_size // 2:
                return False
        return True

    _wrap(KVCacheManager, "allocate_slots", allocate_slots)

    def release(original):
        def f(self, request, *a, **k):
            stolen = _stolen.pop(request.request_id, None)
            if stolen is not None:  # keep vLLM's counts sane afterwards: the reader no longer frees it
                block, group = stolen
                blocks = self.coordinator.single_type_managers[group].req_to_blocks.get(request.request_id, [])
                if block in blocks:
                    blocks.remove(block)
            return original(self, request, *a, **k)

        return f

    _wrap(KVCacheManager, "free", release)
    _wrap(KVCacheManager, "pop_blocks_for_free", release)


def _double_free_preempt(armed: set[str]) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def preempt(original):
        def f(self, request, *a, **k):
            role = _role_of(request)
            _event(fault="observe", event="preempted", request=request.request_id)
            if role != ("double_free_preempt", "victim") or "double_free_preempt" in _done:
                return original(self, request, *a, **k)
            manager = self.kv_cache_manager
            blocks = list(manager.coordinator.single_type_managers[_group()].req_to_blocks.get(request.request_id, []))
            # only blocks this request alone held: a shared one freed twice would go to 0 under its other holder
            own = [b for b in blocks if not b.is_null and b.ref_cnt == 1]
            result = original(self, request, *a, **k)
            if own:
                _done.add("double_free_preempt")
                manager.block_pool.free_blocks(list(reversed(own)))  # the second free
                for b in own:
                    if b.ref_cnt < 0:
                        b.ref_cnt = 0  # as if nothing happened (vLLM asserts 0 when it hands them out again)
                _event(
                    fault="double_free_preempt",
                    victim=request.request_id,
                    blocks=[b.block_id for b in own],
                    hashed=[b.block_id for b in own if b.block_hash is not None],
                )
            return result

        return f

    _wrap(Scheduler, "_preempt_request", preempt)


def _salt_ignored(armed: set[str]) -> None:
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys

    @functools.wraps(original)
    def f(request, *a, **k):
        if _role_of(request) is None or _role_of(request)[0] != "salt_ignored" or not request.cache_salt:
            return original(request, *a, **k)
        salt, request.cache_salt = request.cache_salt, None
        try:
            return original(request, *a, **k)
        finally:
            request.cache_salt = salt

    kv_cache_utils.generate_block_hash_extra_keys = f


def _prefix_wrong_block(armed: set[str]) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    victim_blocks: list = []  # the last finished victim's blocks (group 0), kept by the block pool's cache

    def free(original):
        def f(self, request, *a, **k):
            role = _role_of(request)
            if role == ("prefix_wrong_block", "victim"):
                victim_blocks[:] = list(
                    self.coordinator.single_type_managers[0].req_to_blocks.get(request.request_id, ())
                )
                if victim_blocks:
                    _event(
                        fault="prefix_wrong_block",
                        event="victim",
                        victim=request.request_id,
                        block=victim_blocks[0].block_id,
                    )
            return original(self, request, *a, **k)

        return f

    def get_computed_blocks(original):
        def f(self, request, *a, **k):
            out = original(self, request, *a, **k)
            blocks, computed = out[0], out[1]
            hit = list(blocks.blocks[0]) if blocks.blocks else []
            if (
                _role_of(request) == ("prefix_wrong_block", "faulty")
                and request.request_id not in _done
                and len(hit) >= 2
                and victim_blocks
                and victim_blocks[0] not in hit
            ):
                _done.add(request.request_id)
                swapped = hit[-1]
                hit[-1] = victim_blocks[0]
                blocks.blocks = (hit, *blocks.blocks[1:])
                _event(
                    fault="prefix_wrong_block",
                    event="swapped",
                    faulty=request.request_id,
                    row_block=len(hit) - 1,
                    block=victim_blocks[0].block_id,
                    replaced=swapped.block_id,
                    computed=computed,
                )
            return out

        return f

    _wrap(KVCacheManager, "free", free)
    _wrap(KVCacheManager, "get_computed_blocks", get_computed_blocks)


def _pace() -> None:
    """Not a fault: a request whose ``vllm_xargs`` carry ``{"kvgf_pace": SECONDS}`` sleeps that
    long in each of its scheduling steps, so that it is still running when a test's client
    hangs up (a tiny model on an idle CPU decodes 400 tokens before uvicorn notices a closed
    connection under load). Armed with any fault."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    def allocate_slots(original):
        def f(self, request, *a, **k):
            extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
            pace = extra.get("kvgf_pace")
            if pace:
                time.sleep(min(float(pace), 0.1))
            return original(self, request, *a, **k)

        return f

    _wrap(KVCacheManager, "allocate_slots", allocate_slots)


def _mooncake_worker():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import MooncakeConnectorWorker

    return MooncakeConnectorWorker


def _pd_short_pull(armed: set[str]) -> None:
    cls = _mooncake_worker()

    def start_load_kv(original):
        def f(self, metadata, *a, **k):
            for pulls in (getattr(metadata, "reqs_to_recv", None) or {}).values():
                for rid, pull in pulls.items():
                    blocks = pull.local_block_ids[0] if pull.local_block_ids else []
                    if "pd_short_pull" in str(pull.transfer_id) and len(blocks) > 1:
                        # the bug: decode asks for fewer blocks than it reserved; the sender fills
                        # the last ones, the first stays as the pool left it
                        pull.local_block_ids[0] = blocks[1:]
                        _event(fault="pd_short_pull", request=rid, unfilled=blocks[0], asked=blocks[1:])
            return original(self, metadata, *a, **k)

        return f

    _wrap(cls, "start_load_kv", start_load_kv)


_kv_caches: dict = {}


def _pd_corrupt_recv(armed: set[str]) -> None:
    cls = _mooncake_worker()

    def register_kv_caches(original):
        def f(self, kv_caches, *a, **k):
            _kv_caches.update(kv_caches)
            return original(self, kv_caches, *a, **k)

        return f

    def process_pulling_result(original):
        def f(self, response, pull_metas, *a, **k):
            import torch

            for rid in response.ok_reqs or []:
                pull = pull_metas.get(rid)
                if pull is None or "pd_corrupt_recv" not in str(pull.transfer_id) or not pull.local_block_ids[0]:
                    continue
                block = pull.local_block_ids[0][0]
                layer = sorted(_kv_caches)[0]
                row = _kv_caches[layer][block].view(-1).view(torch.uint8)
                row[0] ^= 0x40  # the bug: the bytes that landed are not the bytes that were sent
                _event(fault="pd_corrupt_recv", request=rid, block=block, layer=layer)
            return original(self, response, pull_metas, *a, **k)

        return f

    _wrap(cls, "register_kv_caches", register_kv_caches)
    _wrap(cls, "process_pulling_result", process_pulling_result)


_INSTALL = {
    "pd_short_pull": _pd_short_pull,
    "pd_corrupt_recv": _pd_corrupt_recv,
    "free_live_block": _free_live_block,
    "double_free_preempt": _double_free_preempt,
    "salt_ignored": _salt_ignored,
    "prefix_wrong_block": _prefix_wrong_block,
}
_loaded = False


def load() -> None:
    """Entry point (``vllm.general_plugins``): patch the armed faults."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    raw = os.environ.get(FAULT_ENV, "")
    armed = {x.strip() for x in raw.split(",") if x.strip()}
    if "all" in armed:
        armed = set(FAULTS)
    if "all_pd" in armed:
        armed = set(PD_FAULTS)
    if armed & set(FAULTS):
        try:
            _pace()
        except Exception as exc:  # noqa: BLE001
            log.warning("kvguard_vllm_faults: cannot install the pace: %s: %s", type(exc).__name__, exc)
    for name in sorted(armed & set(_INSTALL)):
        try:
            _INSTALL[name](armed)
        except Exception as exc:  # noqa: BLE001
            log.warning("kvguard_vllm_faults: cannot arm %s: %s: %s", name, type(exc).__name__, exc)
            continue
        log.warning("kvguard_vllm_faults: TEST-ONLY fault %s armed", name)

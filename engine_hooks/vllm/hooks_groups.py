"""Engines with more than one KV cache group (hybrid models): the EngineCore's side.

vLLM gives each attention type of a hybrid model a KV cache group (a sliding-window group and
a full-attention one for Gemma 3 / GPT-OSS, a Mamba / gated-delta-net state group beside a
full-attention one for Qwen3-Next / Nemotron-H), served by one ``BlockPool``: one block-id
space, and one memory (a block id is the same bytes in every group; a block moves between
groups as it is freed and handed out again). So kvguard keeps one page model (pool 0: the
block pool's ALLOC / FREE, as for one group) and a row per request per group: group ``g``'s
rows and forwards are pool ``g`` (declared with ``shares_pages``), and a read through one
group of a block another request took in another group is as foreign as any.

What differs from one group, and how the hooks follow it:

* the rows: ``Scheduler.schedule`` returns each request's block ids per group (a new
  request's whole row, a running one's appended ids): one ASSIGN per group;
* blocks released while the request lives: a sliding-window group frees the blocks that
  fell behind the window, a state group the state blocks it no longer needs, both through
  ``KVCacheCoordinator.remove_skipped_blocks``, which replaces them in the request's row by
  the null block (block 0). The hook holds the frees made inside it, points those row
  positions at page 0 (never read: the engine's null block), then lets the frees go, so the
  sidecar never sees a block freed under a row that still names it;
* the worker reads each group over its own rule (hooks_worker.py): a window, the state
  entries.
"""

from __future__ import annotations

from . import _runtime as rt
from ._runtime import State

HOOK_NAME = "KVCacheCoordinator.remove_skipped_blocks"  # (plugin.py installs it under this name)


def new_rows(p, rid: str, block_ids, shared_until: int) -> None:
    """A request scheduled for the first time, or resumed: its whole row in every group."""
    for g, ids in zip(State.groups, block_ids):
        row = State.group_rows[g.index]
        ids = list(ids)
        if ids:
            p.row_pages_assigned(rid, 0, len(ids) * g.block_size, shared_until, ids, pool=g.index)
        row[rid] = ids


def appended(p, rid: str, gained, crossing: list[list]) -> None:
    """The blocks a running request gained this step, per group (None: no group gained any).
    One block (a decode step crossing into a new block, the usual case) is left in
    ``crossing[g]`` as (rid, position, block) for one batched write per group (``flush``)."""
    for g, ids in zip(State.groups, gained):
        if not ids:
            continue
        row = State.group_rows[g.index].get(rid)
        if row is None:
            continue  # a row we never saw begin (attached mid-run): nothing to place it against
        start = len(row) * g.block_size
        if len(ids) == 1:
            crossing[g.index].append((rid, start, ids[0]))
        else:
            p.row_pages_assigned(rid, start, start + len(ids) * g.block_size, start, list(ids), pool=g.index)
        row.extend(ids)


def flush(p, crossing: list[list]) -> None:
    """The step's one-block gains, one ASSIGN each, written group by group under one ring lock
    (as the single-group path does: one call each was most of a crossing step's cost)."""
    for g, gains in zip(State.groups, crossing):
        if gains:
            rids, positions, blocks = zip(*gains)
            p.decode_rows_assigned(rids, positions, [b * g.block_size for b in blocks], pool=g.index)


def forget(rid: str) -> None:
    for rows in State.group_rows:
        rows.pop(rid, None)


# --------------------------------------------------------------------------- window / state release
def remove_skipped_blocks(original, name: str):
    """``KVCacheCoordinator.remove_skipped_blocks(request_id, ...)``: frees inside it are held
    (``State.skipping``), the positions they leave in the request's rows are pointed at page 0,
    then the frees go out. A wrapper of its own (not ``rt.guarded``): the held frees must go
    out whatever the engine's call does."""

    def wrapper(self, request_id, *args, **kwargs):
        if not State.group_rows or name in rt._disabled or State.skipping is not None:
            return original(self, request_id, *args, **kwargs)
        held: list = []
        State.skipping = held
        try:
            return original(self, request_id, *args, **kwargs)
        finally:
            State.skipping = None
            if held:
                try:
                    released(request_id, held)
                except Exception as exc:  # noqa: BLE001
                    rt.hook_failed(name, exc)

    return wrapper


def released(rid: str, held: list) -> None:
    """``held``: (every block passed to ``free_blocks`` inside the call, the ids that reached
    FREE). Each block passed leaves ``rid``'s row in the group that held it."""
    p = rt.probes()
    blocks = {b for batch, _ in held for b in batch}
    for g in State.groups:
        row = State.group_rows[g.index].get(rid)
        if not row or not blocks:
            continue
        nulled = [i for i, b in enumerate(row) if b in blocks]
        for i in nulled:
            blocks.discard(row[i])
            row[i] = 0
        for start, end in _runs(nulled):
            ps = g.block_size
            p.row_pages_assigned(rid, start * ps, end * ps, start * ps, [0] * (end - start), pool=g.index)
    freed = [b for _, ids in held for b in ids]
    if freed:
        p.pages_freed(freed, kind="page_ids")


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted indices as [start, end) runs of consecutive ones."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out

"""Engines whose records come from more than one process: which ring belongs to which engine.

vLLM keeps its KV bookkeeping in two processes: the EngineCore allocates, assigns and frees
blocks and sees requests begin and end (its ring carries the HELLO); the Worker runs the
forwards over its block tables (its ring opens with ENGINE_PART naming the EngineCore's pid
instead of a HELLO). Both rings are merged in monotonic-time order by ingest like any others;
here a part's records are routed to its engine's tracker, so one page model sees the blocks
handed out and the forwards that read them. A part whose engine has not said HELLO yet has
nothing to be applied to: its records are counted (``records_without_engine``) and skipped.
"""

from __future__ import annotations

from kvguard.engine_hooks import wire

UNRESOLVED = -1


class EngineParts:
    def __init__(self):
        self.primary_of: dict[int, int] = {}  # part's engine id -> its engine's id (UNRESOLVED: not seen yet)
        self.part_pid: dict[int, int] = {}  # part's engine id -> the pid its ENGINE_PART names
        self.engine_by_pid: dict[int, int] = {}  # pid of a HELLO -> that engine's id
        self.records_without_engine = 0

    def on_part(self, engine_id: int, body: wire.EnginePart) -> None:
        self.part_pid[engine_id] = body.primary_pid
        self.primary_of[engine_id] = self.engine_by_pid.get(body.primary_pid, UNRESOLVED)

    def on_hello(self, engine_id: int, pid: int) -> None:
        self.engine_by_pid[pid] = engine_id
        for part, part_pid in self.part_pid.items():
            if part_pid == pid:
                self.primary_of[part] = engine_id

    def route(self, engine_id: int) -> int | None:
        """The engine id whose tracker this ring's records go to (None: a part whose engine is unknown)."""
        primary = self.primary_of.get(engine_id, engine_id)
        if primary == UNRESOLVED:
            self.records_without_engine += 1
            return None
        return primary

    def is_part(self, engine_id: int) -> bool:
        return engine_id in self.primary_of

    def on_gone(self, engine_id: int) -> None:
        """A ring retired: a part is forgotten; an engine's parts wait for a new HELLO from its pid."""
        if self.primary_of.pop(engine_id, None) is not None:
            self.part_pid.pop(engine_id, None)
            return
        for pid, eid in list(self.engine_by_pid.items()):
            if eid == engine_id:
                del self.engine_by_pid[pid]
        for part, primary in self.primary_of.items():
            if primary == engine_id:
                self.primary_of[part] = UNRESOLVED

    @property
    def parts(self) -> int:
        return len(self.primary_of)

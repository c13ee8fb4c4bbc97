"""The detector contract, and the events the models hand to detectors.

A detector is one class that declares the finding kinds it may raise (``kinds``, each an
entry of sidecar/catalogue.py) and the event types it observes (``events``), and
implements one method, ``observe(event, at) -> list[Finding]``. The pipeline dispatches
each event to the detectors that declared its type (a table built once, no if/elif
chain), files what they return into incidents, and delivers it.

The events themselves are typed facts in sidecar/events.py, a module below both the models
and the detectors. Detectors do no I/O and never call back into the pipeline: what they
need to judge comes in the event or in ``at.tracker``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from ..findings import EngineRef, Finding
    from ..tracker import EngineTracker


@dataclass(frozen=True, slots=True)
class At:
    """Where and when an event happened: the engine's model, its identity, the record's time."""

    tracker: EngineTracker | None
    engine: EngineRef
    engine_id: int
    ts_ns: int


class Detector(Protocol):
    """What every detector has. The optional hooks below are found once, when the detector set
    is built (sidecar/detectors/registry.py), and called through it: the pipeline never names a
    detector."""

    kinds: ClassVar[tuple[str, ...]]  # the catalogue kinds it may raise
    events: ClassVar[tuple[type, ...]]  # the event types it observes

    def observe(self, event: Any, at: At, /) -> list[Finding]: ...


# ---------------------------------------------------------------- optional hooks


class Ticking(Protocol):
    """Judges on the sidecar's clock too (findings that wait for later requests)."""

    def tick(self, now_ns: int, /) -> list[Finding]: ...


class EngineWatching(Protocol):
    """Holds per-engine state: judged and dropped when an engine's ring is retired (called
    while the engine's model is still there)."""

    def on_engine_gone(self, engine_id: int, ts_ns: int, /) -> list[Finding]: ...


class Publishing(Protocol):
    """Publishes figures of its own: ``stats()`` becomes ``PipelineStats.<stats_field>``."""

    stats_field: ClassVar[str]

    def stats(self) -> Any: ...


class Switchable(Protocol):
    """Runs only when its switch is on (``switch``: a catalogue switch, which is also the
    sidecar option and the recorded verdict option of that name)."""

    switch: ClassVar[str]
    enabled: bool


class WantsSharedReads(Protocol):
    """Its read verdicts must carry the legitimately shared prefix-cache pages read
    (``ReadVerdict.shared``), which cost the page model extra work to gather."""

    wants_shared_reads: ClassVar[bool]
    enabled: bool

"""One SGLang 0.5.23 prefill/decode pair for the engine tests that only need a healthy one.

Booting a pair costs ~90 s of two cores (six Python processes importing torch and SGLang,
docs/testing.md), and five tests need the same fixed pair: the router pairing test, the
canary's clean verdict, preflight through the router and against one server, and the
fixed incident. They share
one pair for the session, watched by one sidecar from before the engines start, the way
a sidecar runs beside a pod in production. tests/conftest.py runs the tests that use it
one after the other and stops the pair after the last of them.

The pair is the demo's (demo/run.py capture_incident): prefill pool 256 tokens, decode
pool 1024, context 2048, SGLang's router in front with ``--disable-retries``, served by
the echo model (docs/echo-model.md), with a waiting timeout of 10 s (the over-length
requests of the incident and of the canary wait that long at decode).

Each test judges only what it did: :meth:`SharedPD.window` marks where its part of the
sidecar's findings and record counts starts, and :meth:`Window.findings` keeps the
findings about its own requests (reader or sender rid, or bootstrap room) plus any that
name no request (lost records, probe errors: a failure whoever ran). The findings the
configuration raises once at start-up (``pool_smaller_than_context``, one per engine)
are :attr:`SharedPD.startup_findings`.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.demo.echo_model import echo_model_dir
from kvguard.demo.engines import PDPair
from kvguard.demo.run import DEMO_ROUTER_ARGS
from kvguard.demo.scenario import WORDS_DEMO
from kvguard.sidecar.findings import Finding
from kvguard.sidecar.service import Sidecar
from kvguard.sidecar.sinks.basic import MemorySink
from tests.support.sidecar_settle import wait_until_applied

VERSION = "0.5.23"
PREFILL_POOL_TOKENS = 256
DECODE_POOL_TOKENS = 1024
# decode's wait for a transfer: long enough that a prefill queued behind another on a loaded
# 2-core runner (its pool holds 256 tokens) still lands (at 5 s a routed request timed out
# once in CI while another worker booted engines), short for the over-length requests that wait it out
WAITING_TIMEOUT_S = 10


@dataclass
class Window:
    """One test's part of the shared sidecar's output."""

    shared: SharedPD
    first_finding: int
    records_at_start: Counter = field(default_factory=Counter)

    def settle(self) -> None:
        """Until the sidecar has applied what the engines wrote for this test."""
        wait_until_applied(self.shared.sidecar)

    def findings(self, rids: Collection[str] = (), rooms: Collection[int] = ()) -> list[Finding]:
        """Findings raised since the window opened about these requests, and those about no request."""
        out = []
        for f in self.shared.memory.findings[self.first_finding :]:
            reader = f.reader
            if reader is None:
                out.append(f)
            elif (
                reader.rid in rids
                or (reader.bootstrap_room is not None and reader.bootstrap_room in rooms)
                or f.evidence.get("sender_rid") in rids
            ):
                out.append(f)
        return out

    def records_by_kind(self) -> Counter:
        """Records the sidecar applied since the window opened, by kind."""
        now = Counter(self.shared.sidecar.pipeline.records_by_kind)
        now.subtract(self.records_at_start)
        return +now


class SharedPD:
    """The pair, its router and the sidecar watching it (see the module docstring)."""

    def __init__(self, work: Path) -> None:
        ring_dir = work / "rings"
        ring_dir.mkdir(parents=True, exist_ok=True)
        self.memory = MemorySink()
        self.sidecar = Sidecar(str(ring_dir), sinks=[self.memory], remove_dead_rings=False).start()
        self.stopped = False
        try:
            self.pair = PDPair(
                VERSION,
                ring_dir,
                work / "logs",
                prefill_pool_tokens=PREFILL_POOL_TOKENS,
                decode_pool_tokens=DECODE_POOL_TOKENS,
                model_dir=echo_model_dir(WORDS_DEMO["lag"]),
                load_format="auto",
                waiting_timeout_s=WAITING_TIMEOUT_S,
                router_args=DEMO_ROUTER_ARGS,
            ).start()
            wait_until_applied(self.sidecar)
        except BaseException:
            self.sidecar.stop()
            raise
        self.startup_findings = list(self.memory.findings)

    def window(self) -> Window:
        if self.stopped:
            raise RuntimeError("the shared 0.5.23 pair was stopped: tests/conftest.py runs its users together")
        wait_until_applied(self.sidecar)
        return Window(self, len(self.memory.findings), Counter(self.sidecar.pipeline.records_by_kind))

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        t0 = time.monotonic()
        try:
            self.pair.stop()
        finally:
            self.sidecar.stop()
        print(f"\nshared SGLang {VERSION} pair stopped in {time.monotonic() - t0:.1f} s", file=sys.stderr)

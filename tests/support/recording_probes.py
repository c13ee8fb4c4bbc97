"""A stand-in for engine_hooks.probes.Probes that records every call, for hook tests."""

from __future__ import annotations


class RecordingProbes:
    """Records (method, args, kwargs) of each probe call instead of writing records."""

    tier1 = None  # Tier 1 off (tests/engine_side/test_tier1.py covers it with the real Probes)

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))

        return record

    def named(self, name):
        return [c for c in self.calls if c[0] == name]


class CaptureWriter:
    """A ring writer for the real Probes that keeps each record as (kind, payload bytes, pool);
    ``take()`` decodes and clears them (engine id 1)."""

    def __init__(self, engine_id: int = 1):
        self.engine_id, self.records, self.records_written, self.dropped_records = engine_id, [], 0, 0

    def write(self, kind, payload, pool=0, flags=0):
        from kvguard.engine_hooks import wire

        self.records.append((wire.Kind(kind), bytes(payload), pool))
        self.records_written += 1
        return True

    def write_sticky(self, kind, payload, pool=0, append=False):  # RingWriter's: a copy kept (not here)
        return self.write(kind, payload, pool)

    def write_batch(self, kind, payloads, pool=0):
        return sum(self.write(kind, p, pool) for p in payloads)

    def take(self) -> list:
        from kvguard.engine_hooks import wire

        out = []
        for kind, payload, pool in self.records:
            out += wire.decode_stream(wire.encode(kind, 0, 1, self.engine_id, payload, pool), wire.DecodeStats())
        self.records.clear()
        return out


def judged(pipeline, cap: CaptureWriter) -> list:
    """What the sidecar's ``pipeline`` finds in every record ``cap`` captured since the last call."""
    found: list = []
    for rec in cap.take():
        found += pipeline.apply(rec)
    return found

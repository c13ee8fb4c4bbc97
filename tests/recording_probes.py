"""A stand-in for engine_hooks.probes.Probes that records every call, for hook tests."""

from __future__ import annotations


class RecordingProbes:
    """Records (method, args, kwargs) of each probe call instead of writing records."""

    tier1 = None  # Tier 1 off (tests/test_tier1.py covers it with the real Probes)

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))

        return record

    def named(self, name):
        return [c for c in self.calls if c[0] == name]

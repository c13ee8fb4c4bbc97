"""The settle helper lives in the demo package (kvguard.demo.settle), which the demos use too."""

from kvguard.demo.settle import wait_until_applied

__all__ = ["wait_until_applied"]

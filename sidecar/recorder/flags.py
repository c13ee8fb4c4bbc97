"""Parsers for the recording flags' values (``--record-max-bytes 4G``, ``--record-max-age 24h``)."""

from __future__ import annotations

import argparse
import re


class BadValue(ValueError, argparse.ArgumentTypeError):
    """A flag value that does not parse (argparse prints the message as is)."""


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "ki": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mi": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gi": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "ti": 1 << 40,
    "tib": 1 << 40,
}
_TIME_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_bytes(value: str) -> int:
    """``1073741824``, ``512M``, ``1G`` (binary units) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise BadValue(f"not a size: {value!r} (examples: 1073741824, 512M, 4G)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_seconds(value: str) -> float:
    """``3600``, ``90s``, ``30m``, ``24h``, ``7d`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _TIME_UNITS:
        raise BadValue(f"not a duration: {value!r} (examples: 3600, 90s, 30m, 24h, 7d)")
    seconds = float(m.group(1)) * _TIME_UNITS[m.group(2).lower()]
    if seconds <= 0:
        raise BadValue(f"duration must be > 0, got {value!r}")
    return seconds

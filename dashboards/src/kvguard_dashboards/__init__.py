"""kvguard's Grafana dashboards as code (grafana-foundation-sdk).

``DASHBOARDS`` maps each file of ``dashboards/generated/`` to the function that builds
it. ``render_all()`` is the whole generator: the JSON is deterministic (sorted keys,
panel ids in layout order), so the committed files can be compared byte for byte
(``kvguard dashboards generate --check``, tests/tools/test_dashboards.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from . import fleet, integrity, pages
from .common import number_panels

DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "kvguard-integrity.json": integrity.dashboard,
    "kvguard-fleet.json": fleet.dashboard,
    "kvguard-pages.json": pages.dashboard,
}


def render(build: Callable[[], Dashboard]) -> str:
    model = build().build()
    number_panels(model)
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def render_all() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {name: render(build) for name, build in DASHBOARDS.items()}


def stale(out_dir: Path) -> list[str]:
    """Files of ``out_dir`` that differ from what the code generates, are missing, or are extra."""
    want = render_all()
    have = {p.name for p in out_dir.glob("*.json")} if out_dir.is_dir() else set()
    differ = [n for n, text in want.items() if n not in have or (out_dir / n).read_text() != text]
    return sorted(differ + sorted(have - set(want)))


def write_all(out_dir: Path) -> list[str]:
    """Write every dashboard into ``out_dir``, remove JSON files no dashboard makes; returns the names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    want = render_all()
    for extra in sorted({p.name for p in out_dir.glob("*.json")} - set(want)):
        (out_dir / extra).unlink()
    for name, text in want.items():
        (out_dir / name).write_text(text)
    return sorted(want)

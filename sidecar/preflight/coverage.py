"""``kvguard preflight --sidecar URL``: what kvguard watches of each engine a sidecar sees.

The pool/context check reads the engine's own endpoints; what kvguard can and cannot follow
in that engine (its pools, KV cache groups, state, draft model: the adapter's COVERAGE,
docs/detectors.md ``coverage_gap``) is only known to the adapter inside the engine, which
tells the sidecar beside it. So the gate asks the sidecar (``GET /v1/engines``, its API
token) and prints each engine's account. With ``--require-coverage`` an engine with a part
kvguard does not watch, one whose adapter said nothing of its coverage, or a sidecar that
cannot be read, makes the gate exit 3.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import httpx

EXIT_COVERAGE_GAP = 3
API_TOKEN_ENV = "KVGUARD_API_TOKEN"  # the sidecar's own (kvguard sidecar --api-token-file / $KVGUARD_API_TOKEN)


@dataclass
class EngineCoverage:
    sidecar: str
    role: str = ""
    pid: int | None = None
    rank: int | None = None
    gaps: int | None = None  # None: the engine sent no COVERAGE (or the sidecar could not be read)
    items: list[dict] = field(default_factory=list)
    reason: str = ""  # why nothing could be read

    def to_json(self) -> dict:
        return {
            "sidecar": self.sidecar,
            "role": self.role,
            "pid": self.pid,
            "rank": self.rank,
            "coverage_gaps": self.gaps,
            "coverage": self.items,
            "reason": self.reason,
        }

    @property
    def complete(self) -> bool:
        return self.gaps == 0


def read_api_token(path: str | None) -> str | None:
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    return os.environ.get(API_TOKEN_ENV) or None


def fetch(sidecar: str, token: str | None, timeout_s: float, transport=None) -> list[EngineCoverage]:
    """Each engine the sidecar at ``sidecar`` watches, with its coverage (never raises)."""
    url = sidecar.rstrip("/") + "/v1/engines"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with httpx.Client(timeout=timeout_s, transport=transport) as client:
            r = client.get(url, headers=headers)
        if r.status_code in (401, 403):
            return [EngineCoverage(sidecar, reason=f"HTTP {r.status_code} from {url}: give the sidecar's API token")]
        r.raise_for_status()
        engines = r.json()["engines"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return [EngineCoverage(sidecar, reason=f"cannot read {url}: {type(exc).__name__}: {exc}")]
    if not engines:
        return [EngineCoverage(sidecar, reason="the sidecar watches no engine yet")]
    return [
        EngineCoverage(
            sidecar,
            str(e.get("role", "")),
            e.get("pid"),
            e.get("rank"),
            e.get("coverage_gaps"),
            list(e.get("coverage") or []),
        )
        for e in engines
    ]


def render(found: list[EngineCoverage]) -> str:
    lines = []
    for c in found:
        if c.reason:
            lines.append(f"kvguard coverage ({c.sidecar}): UNKNOWN: {c.reason}")
            continue
        head = f"kvguard coverage of {c.role} rank {c.rank} pid {c.pid} ({c.sidecar}): "
        if c.gaps is None:
            lines.append(head + "UNKNOWN: its adapter sent no coverage (kvguard older than wire contract 1.5)")
            continue
        lines.append(head + ("every part watched" if c.gaps == 0 else f"{c.gaps} part(s) NOT fully watched"))
        for item in c.items:
            mark = {"watched": "  ok ", "partial": "  PART", "unwatched": "  NO  "}.get(item.get("status", ""), "  ?  ")
            missing = item.get("missing") or []
            extra = f" (no {', '.join(missing)})" if missing and item.get("status") != "unwatched" else ""
            lines.append(f"{mark} {item.get('component')}{extra}: {item.get('detail')}")
    return "\n".join(lines)

"""Findings: what a detector concluded, with the evidence and the exposed parties."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

CRITICAL = "critical"
WARNING = "warning"
INFO = "info"


@dataclass(slots=True)
class Party:
    """A request (and its tenant) named by a finding."""

    rid: str
    tenant: str
    bootstrap_room: int | None = None
    pages: list[int] = field(default_factory=list)


@dataclass(slots=True)
class EngineRef:
    role: str
    rank: int
    pid: int


@dataclass(slots=True)
class Finding:
    kind: str
    severity: str
    engine: EngineRef
    reader: Party | None
    pages: list[int]
    exposed: list[Party]
    first_seen_ns: int
    summary: str
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        reader = None
        if self.reader is not None:
            reader = {
                "rid": self.reader.rid,
                "tenant": self.reader.tenant,
                "bootstrap_room": self.reader.bootstrap_room,
            }
        return {
            "kind": self.kind,
            "severity": self.severity,
            "engine": asdict(self.engine),
            "reader": reader,
            "pages": list(self.pages),
            "exposed": [{"rid": p.rid, "tenant": p.tenant, "pages": list(p.pages)} for p in self.exposed],
            "first_seen_ns": self.first_seen_ns,
            "summary": self.summary,
            "evidence": self.evidence,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

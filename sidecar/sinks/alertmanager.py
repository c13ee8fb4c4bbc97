"""Alertmanager v2 API: one alert per incident (POST /api/v2/alerts).

Labels identify the alert (``alertname`` = KVGuard + CamelCase kind, ``severity``,
``kind``, ``engine_role``, ``incident_id``); annotations carry the summary, the
reader and the exposed tenants. A resolved incident is posted again with ``endsAt``.
"""

from __future__ import annotations

import datetime as dt

import httpx

from ..findings import Finding
from ..incidents import incident_id, incident_key
from .delivery import PermanentError, QueuedSink, RetryableError


def alert_name(kind: str) -> str:
    return "KVGuard" + "".join(part.capitalize() for part in kind.split("_"))


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def finding_alert(f: Finding) -> dict:
    tenants = sorted({p.tenant or "?" for p in f.exposed})
    annotations = {"summary": f.summary[:1024], "pages": str(len(f.pages))}
    if f.reader is not None:
        annotations["reader"] = f"{f.reader.rid} (tenant {f.reader.tenant or '?'})"
    if tenants:
        annotations["exposed_tenants"] = ", ".join(tenants)
    return {
        "labels": {
            "alertname": alert_name(f.kind),
            "severity": f.severity,
            "kind": f.kind,
            "engine_role": f.engine.role,
            "incident_id": incident_id(incident_key(f)),
            "source": "kvguard",
        },
        "annotations": annotations,
        "startsAt": _now(),
    }


def resolved_alert(incident) -> dict:
    return {
        "labels": {
            "alertname": alert_name(incident.kind),
            "severity": incident.severity,
            "kind": incident.kind,
            "engine_role": incident.engine["role"],
            "incident_id": incident.id,
            "source": "kvguard",
        },
        "annotations": {"summary": incident.summary[:1024], "resolution": incident.resolution},
        "endsAt": _now(),
    }


class AlertmanagerTransport:
    def __init__(self, url: str, timeout_s: float = 10.0, client: httpx.Client | None = None):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--alertmanager-url: expected http(s)://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self._client = client or httpx.Client(timeout=timeout_s)

    def deliver(self, action: str, item) -> None:
        alert = finding_alert(item) if action == "trigger" else resolved_alert(item)
        try:
            resp = self._client.post(self.url, json=[alert])
        except httpx.HTTPError as exc:
            raise RetryableError(type(exc).__name__) from None
        if resp.status_code == 429 or resp.status_code >= 500:
            raise RetryableError(f"HTTP {resp.status_code}")
        if resp.status_code >= 400:
            raise PermanentError(f"HTTP {resp.status_code}: {resp.text[:200]}")


def alertmanager_sink(url: str, timeout_s: float = 10.0, **kwargs) -> QueuedSink:
    return QueuedSink(AlertmanagerTransport(url, timeout_s=timeout_s), "alertmanager", **kwargs)

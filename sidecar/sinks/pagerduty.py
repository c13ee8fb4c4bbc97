"""PagerDuty Events API v2: trigger on a new incident, resolve when it clears.

- ``dedup_key`` is the stable incident id, so repeats and restarts fold into one alert.
- severity: critical -> critical, warning -> warning, info -> info.
- ``summary`` is cut to 1,024 characters; ``custom_details`` carry the evidence (page
  ids, counts, request ids, tenants; never token ids, text or KV bytes); the event is
  kept under PagerDuty's 512 KB limit by trimming page lists.
- 429 and 5xx, timeouts and refused connections are retried with backoff; 400 is not.
- The routing key comes from a file or the environment and is never logged.
"""

from __future__ import annotations

import json
import re

import httpx

from ..findings import Finding
from ..incidents import incident_id, incident_key
from ..secrets import read_secret
from .delivery import PermanentError, QueuedSink, RetryableError

DEFAULT_URL = "https://events.pagerduty.com/v2/enqueue"
MAX_SUMMARY = 1024
MAX_EVENT_BYTES = 512 * 1024
_ROUTING_KEY = re.compile(r"^[A-Za-z0-9]{32}$")
SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}


def load_routing_key(path: str | None = None, env: str = "KVGUARD_PAGERDUTY_ROUTING_KEY") -> str:
    """From ``path`` or ``$env``; a ValueError names the setting, never the value."""
    key, source = read_secret(path, "--pagerduty-routing-key-file", env)
    if not key:
        raise ValueError(f"{source}: no PagerDuty routing key")
    if not _ROUTING_KEY.match(key):
        raise ValueError(
            f"{source}: not a PagerDuty integration key (expected 32 letters or digits, got {len(key)} characters)"
        )
    return key


def _trim_pages(details: dict, budget: int) -> dict:
    """Cut page lists until the JSON fits ``budget`` bytes; say how many were cut."""
    while len(json.dumps(details)) > budget:
        pages = details.get("pages", [])
        if len(pages) <= 16 and not any(len(e.get("pages", [])) > 16 for e in details.get("exposed", [])):
            details["exposed"] = details.get("exposed", [])[:50]
            break
        details["pages"] = pages[: len(pages) // 2]
        for party in details.get("exposed", []):
            party["pages"] = party.get("pages", [])[: max(1, len(party.get("pages", [])) // 2)]
        details["pages_truncated"] = True
    return details


def trigger_event(routing_key: str, f: Finding, source: str) -> dict:
    details = f.to_dict()
    details.pop("summary", None)
    event: dict = {
        "routing_key": routing_key,
        "event_action": "trigger",
        "dedup_key": incident_id(incident_key(f)),
        "payload": {
            "summary": f.summary[:MAX_SUMMARY],
            "source": source,
            "severity": SEVERITY.get(f.severity, "error"),
            "component": f"{f.engine.role}-rank-{f.engine.rank}",
            "group": "kvguard",
            "class": f.kind,
            "custom_details": details,
        },
    }
    overhead = len(json.dumps(event)) - len(json.dumps(details))
    event["payload"]["custom_details"] = _trim_pages(details, MAX_EVENT_BYTES - overhead - 1024)
    return event


def resolve_event(routing_key: str, incident) -> dict:
    return {"routing_key": routing_key, "event_action": "resolve", "dedup_key": incident.id}


class PagerDutyTransport:
    def __init__(
        self,
        routing_key: str,
        url: str = DEFAULT_URL,
        source: str = "kvguard",
        timeout_s: float = 10.0,
        client: httpx.Client | None = None,
    ):
        self._routing_key = routing_key
        self.url, self.source = url, source
        self._client = client or httpx.Client(timeout=timeout_s)

    def __repr__(self) -> str:  # never show the routing key
        return f"PagerDutyTransport(url={self.url!r})"

    def deliver(self, action: str, item) -> None:
        event = (
            trigger_event(self._routing_key, item, self.source)
            if action == "trigger"
            else resolve_event(self._routing_key, item)
        )
        try:
            resp = self._client.post(self.url, json=event)
        except httpx.HTTPError as exc:  # timeouts, refused connections
            raise RetryableError(f"{type(exc).__name__}") from None
        if resp.status_code == 429 or resp.status_code >= 500:
            raise RetryableError(f"HTTP {resp.status_code}")
        if resp.status_code >= 400:
            raise PermanentError(f"HTTP {resp.status_code}: {resp.text[:200]}")


def pagerduty_sink(routing_key: str, url: str = DEFAULT_URL, timeout_s: float = 10.0, **kwargs) -> QueuedSink:
    return QueuedSink(PagerDutyTransport(routing_key, url, timeout_s=timeout_s), "pagerduty", **kwargs)

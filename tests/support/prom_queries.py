"""Prometheus HTTP API helpers for tests that run a real Prometheus (dashboards, alert chain)."""

from __future__ import annotations

import time

import httpx


class PrometheusQueries:
    """Mixin: query the test's Prometheus at ``self.prom_url``; a non-200 or a failed
    query fails the test with Prometheus' own answer (503 while it starts)."""

    prom_url: str

    def api(self, path: str, **params) -> dict:
        resp = httpx.get(f"{self.prom_url}/api/v1/{path}", params=params, timeout=10)
        assert resp.status_code == 200, f"{resp.status_code} {resp.text}"
        body = resp.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [{"value": data["result"]}]

    def query_range(self, expr: str, seconds: int = 30) -> list[dict]:
        end = time.time()
        return self.api("query_range", query=expr, start=end - seconds, end=end, step="2s")["result"]

"""``kvguard isolation-report``: which tenants' prefix-cache hits crossed into which, from a
running sidecar's ``/v1/isolation`` (sidecar/detectors/probing.py keeps the counts).

The evidence an auditor asks for under OWASP AISVS 5.5.5 (tenant KV partitioning): per
(reader tenant, writer tenant), how many prefix-cache hits handed one tenant's requests
pages another tenant's requests wrote, over the last hour or less. Exit codes: 0 no hit
crossed tenants, 1 some did, 2 the sidecar could not be asked (or answered nonsense).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

from .secrets import read_secret

DEFAULT_URL = "http://127.0.0.1:9464"  # `kvguard sidecar --listen`'s default
TIMEOUT_S = 10.0


def fetch(url: str, token: str, window_s: int, timeout_s: float = TIMEOUT_S) -> dict:
    """The sidecar's ``/v1/isolation`` (ValueError says what went wrong)."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/isolation?window_s={int(window_s)}",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = json.loads(response.read(4 << 20))
    except urllib.error.HTTPError as exc:
        hint = (
            " (give the sidecar's /v1 token: --api-token-file or $KVGUARD_API_TOKEN)" if exc.code in (401, 403) else ""
        )
        raise ValueError(f"{url}: HTTP {exc.code} {exc.reason}{hint}") from exc
    except (OSError, ValueError) as exc:
        raise ValueError(f"{url}: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("pairs"), list):
        raise ValueError(f"{url}: not a /v1/isolation answer")
    return body


def render(body: dict) -> str:
    """The report as a table a person reads."""
    pairs = body["pairs"]
    lines = [
        f"prefix-cache hits across tenants, last {body.get('window_s', '?')} s "
        f"(probing detector {'on' if body.get('probing_detector') else 'off: kvguard sidecar --isolate-tenants'})",
    ]
    if not pairs:
        lines.append("no hit crossed tenants")
        return "\n".join(lines)
    header = ("reader tenant", "writer tenant", "prefix hits", "pages", "reader requests")
    rows = [
        (
            str(p["reader_tenant"]),
            str(p["writer_tenant"]),
            str(p["prefix_hits"]),
            str(p["pages"]),
            str(p["reader_requests"]),
        )
        for p in pairs
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if body.get("pairs_dropped"):
        lines.append(f"({body['pairs_dropped']} tenant pairs were dropped at the sidecar's bound)")
    return "\n".join(lines)


def cmd_isolation_report(args) -> int:
    try:
        token, _source = read_secret(args.api_token_file, "--api-token-file", "KVGUARD_API_TOKEN")
        body = fetch(args.url, token, args.window_s)
    except ValueError as exc:
        print(f"kvguard isolation-report: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(body, indent=2) if args.json else render(body))
    return 1 if body["pairs"] else 0


def _window(text: str) -> int:
    value = int(text)
    if not 60 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{value}: the sidecar keeps per-minute counts for an hour (60 .. 3600)")
    return value


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "isolation-report",
        help="which tenants' prefix-cache hits crossed into which (a running sidecar's /v1/isolation)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default=DEFAULT_URL, help=f"the sidecar's API (default {DEFAULT_URL})")
    p.add_argument("--api-token-file", default=None, help="file holding the /v1 token (default: $KVGUARD_API_TOKEN)")
    p.add_argument("--window-s", type=_window, default=3600, help="seconds back, 60 .. 3600 (default 3600)")
    p.add_argument("--json", action="store_true", help="the sidecar's answer as JSON")
    p.set_defaults(func=cmd_isolation_report)
    return p

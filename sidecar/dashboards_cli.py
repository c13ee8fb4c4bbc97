"""``kvguard dashboards``: regenerate the Grafana dashboards, or upload them.

``generate`` runs the dashboards-as-code sources (``dashboards/src``, grafana-foundation-sdk)
into ``dashboards/generated``; ``--check`` only says whether the committed JSON is current.
``push`` uploads the generated JSON through Grafana's HTTP API (``POST /api/dashboards/db``,
grafana-client). Exit codes of ``push``:

    0  every dashboard uploaded
    1  Grafana refused a dashboard (412 changed in Grafana / same name, 400, 404, other 4xx)
    2  bad arguments: URL, token file, no dashboards; nothing was sent
    3  Grafana not reachable or failing (refused connection, timeout, 5xx, not Grafana's API)
    4  Grafana rejected the credentials (401, 403)

The token (a Grafana service account token) comes from ``--token-file`` or
``$KVGUARD_GRAFANA_TOKEN`` and is never printed; neither is a password in the URL.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

DASHBOARDS_DIR = Path(__file__).resolve().parents[1] / "dashboards"
TOKEN_ENV = "KVGUARD_GRAFANA_TOKEN"
_ERRNO = re.compile(r"\[Errno -?\d+\] [^'\")]+")

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_AUTH = 0, 1, 2, 3, 4


# ---------------------------------------------------------------------- generate
def load_generator(src: Path):
    """Import ``kvguard_dashboards`` from ``src`` (a source tree, not an installed package)."""
    if not (src / "kvguard_dashboards" / "__init__.py").is_file():
        raise ValueError(
            f"--src {str(src)!r}: no kvguard_dashboards package there (dashboards/src of the kvguard source tree)"
        )
    sys.path.insert(0, str(src))
    try:
        return importlib.import_module("kvguard_dashboards")
    finally:
        sys.path.remove(str(src))


def cmd_generate(args) -> int:
    try:
        generator = load_generator(Path(args.src))
    except ValueError as exc:
        print(f"kvguard dashboards generate: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out)
    if args.check:
        stale = generator.stale(out)
        for name in stale:
            print(f"{out / name}: not what dashboards/src generates", file=sys.stderr)
        if stale:
            print(
                "kvguard dashboards generate: run `kvguard dashboards generate` and commit the result", file=sys.stderr
            )
        return EXIT_REFUSED if stale else EXIT_OK
    for name in generator.write_all(out):
        print(out / name)
    return EXIT_OK


# ---------------------------------------------------------------------- push
@dataclass
class PushError(Exception):
    code: int
    message: str


def redact(url: str) -> str:
    """``url`` without a password (``http://admin:secret@host`` -> ``http://admin:***@host``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def grafana_url(url: str) -> str:
    """Grafana's root URL, checked; a sub-path keeps a trailing slash (grafana-client appends ``api``)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PushError(
            EXIT_USAGE, f"--url: expected http(s)://HOST[:PORT][/PATH] (Grafana's root URL), got {redact(url)!r}"
        )
    path = parts.path.rstrip("/")
    return urlunsplit(parts._replace(path=path + "/" if path else ""))


def load_token(path: str | None) -> str | None:
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise PushError(EXIT_USAGE, f"--token-file {path!r}: {exc.strerror}") from None
        if not token:
            raise PushError(EXIT_USAGE, f"--token-file {path!r} is empty")
        return token
    return os.environ.get(TOKEN_ENV, "").strip() or None


def load_dashboards(directory: Path) -> list[tuple[str, dict]]:
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not files:
        raise PushError(
            EXIT_USAGE,
            f"--dir {str(directory)!r}: no dashboard JSON files (run `kvguard dashboards "
            f"generate`, or pass dashboards/generated of the kvguard source tree)",
        )
    out = []
    for f in files:
        try:
            out.append((f.name, json.loads(f.read_text(encoding="utf-8"))))
        except ValueError as exc:
            raise PushError(EXIT_USAGE, f"{f}: not JSON: {exc}") from None
    return out


def explain(exc: Exception, where: str) -> PushError:
    """One precise message and exit code for a failed upload."""
    import requests
    from grafana_client.client import GrafanaClientError, GrafanaException, GrafanaServerError

    if isinstance(exc, requests.exceptions.Timeout):
        return PushError(EXIT_UNREACHABLE, f"Grafana at {where} did not answer in time (--timeout)")
    if isinstance(exc, requests.exceptions.ConnectionError):
        return PushError(EXIT_UNREACHABLE, f"cannot connect to Grafana at {where}: {_reason(exc)}")
    if isinstance(exc, GrafanaServerError):
        return PushError(
            EXIT_UNREACHABLE,
            f"Grafana at {where} failed (HTTP {exc.status_code}: {_message(exc.response)}); try again later",
        )
    if isinstance(exc, GrafanaClientError):
        return _client_error(exc.status_code, exc.response, where)
    if isinstance(exc, GrafanaException):
        return PushError(EXIT_REFUSED, f"Grafana at {where}: {exc.message}")
    if isinstance(exc, ValueError):  # a 2xx that is not JSON: a login page, a proxy
        return PushError(
            EXIT_UNREACHABLE,
            f"{where} answered, but not like Grafana's HTTP API (no JSON): is --url Grafana's root URL?",
        )
    return PushError(EXIT_UNREACHABLE, f"upload to {where} failed: {type(exc).__name__}: {exc}")


def _client_error(status: int, response, where: str) -> PushError:
    message = _message(response)
    if status == 401:
        return PushError(
            EXIT_AUTH,
            f"Grafana at {where} rejected the credentials (HTTP 401: {message}): check --token-file or ${TOKEN_ENV}",
        )
    if status == 403:
        return PushError(
            EXIT_AUTH,
            f"Grafana at {where} denied the upload (HTTP 403: {message}): the token needs "
            f"the Editor role (or dashboards:write) on the folder",
        )
    if status == 412:
        reason = response.get("status", "") if isinstance(response, dict) else ""
        hint = {
            "version-mismatch": "the dashboard was changed in Grafana since (or pushed before); the "
            "repository is the source of truth: re-run with --overwrite to replace it",
            "name-exists": "another dashboard in that folder has the same title; re-run with --overwrite "
            "to replace it, or pick another --folder-uid",
            "plugin-dashboard": "a plugin owns it; re-run with --overwrite to replace it",
        }.get(reason, "")
        return PushError(
            EXIT_REFUSED,
            f"Grafana refused it (HTTP 412 {reason or 'precondition failed'}: "
            f"{message})" + (f": {hint}" if hint else ""),
        )
    if status == 404:
        return PushError(EXIT_REFUSED, f"Grafana answered 404 ({message}): does --folder-uid exist?")
    return PushError(EXIT_REFUSED, f"Grafana refused it (HTTP {status}: {message})")


def _message(response) -> str:
    if isinstance(response, dict):
        return str(response.get("message") or response)[:200]
    return str(response).strip()[:200] or "no details"


def _reason(exc: BaseException) -> str:
    """``[Errno 111] Connection refused`` out of requests' nested connection errors."""
    m = _ERRNO.search(str(exc))
    return m.group(0).strip() if m else type(exc).__name__


def push(
    url: str,
    token: str | None,
    dashboards: list[tuple[str, dict]],
    folder_uid: str | None = None,
    overwrite: bool = False,
    timeout_s: float = 10.0,
    out=None,
    err=None,
) -> int:
    """Upload each dashboard; stop at the first failure that would fail the rest the same way."""
    out, err = out or sys.stdout, err or sys.stderr
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    where, worst = redact(url), EXIT_OK
    for name, dashboard in dashboards:
        body = {"dashboard": {**dashboard, "id": None}, "overwrite": overwrite, "message": "kvguard dashboards push"}
        if folder_uid:
            body["folderUid"] = folder_uid
        try:
            answer = api.dashboard.update_dashboard(body)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a message and an exit code
            failure = explain(exc, where)
            print(f"kvguard dashboards push: {name}: {failure.message}", file=err)
            worst = max(worst, failure.code)
            if failure.code in (EXIT_UNREACHABLE, EXIT_AUTH):
                return failure.code
            continue
        print(
            f"{name}: {where.rstrip('/')}{answer.get('url', '')} (uid {answer.get('uid')}, "
            f"version {answer.get('version')})",
            file=out,
        )
    return worst


def installed_dashboards() -> Path:
    """Where the generated dashboards are: this checkout's ``dashboards/generated`` when there is
    one, else the copy installed with kvguard (package data of ``kvguard.dashboards``)."""
    checkout = DASHBOARDS_DIR / "generated"
    if checkout.is_dir() and any(checkout.glob("*.json")):
        return checkout
    from importlib import resources

    return Path(str(resources.files("kvguard.dashboards")))


def cmd_push(args) -> int:
    try:
        if args.url is None and not args.dry_run:
            raise PushError(EXIT_USAGE, "--url is required (or --dry-run)")
        url = grafana_url(args.url) if args.url is not None else None
        token = load_token(args.token_file)
        directory = Path(args.dir) if args.dir is not None else installed_dashboards()
        dashboards = load_dashboards(directory)
    except PushError as exc:
        print(f"kvguard dashboards push: {exc.message}", file=sys.stderr)
        return exc.code
    if args.dry_run:  # what would go where, without a request
        where = redact(url) if url is not None else "Grafana"
        print(f"would upload {len(dashboards)} dashboard(s) from {directory} to {where}:")
        for name, dash in dashboards:
            print(f"  {name}: {dash.get('title', '?')!r} (uid {dash.get('uid', '?')})")
        return 0
    assert url is not None
    return push(url, token, dashboards, args.folder_uid, args.overwrite, args.timeout)


def _positive_float(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        f = 0.0
    if not f > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {value!r}")
    return f


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "dashboards",
        help="regenerate the Grafana dashboards, or upload them to Grafana",
        description="Grafana dashboards as code (docs/dashboards.md).",
    )
    sub = p.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")
    g = sub.add_parser(
        "generate",
        help="write dashboards/generated/*.json from dashboards/src",
        description="Run the dashboards-as-code sources and write the JSON Grafana loads.",
    )
    g.add_argument("--src", default=str(DASHBOARDS_DIR / "src"), help="the sources (default: %(default)s)")
    g.add_argument(
        "--out", default=str(DASHBOARDS_DIR / "generated"), help="where the JSON goes (default: %(default)s)"
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the JSON in --out is not what the sources generate",
    )
    g.set_defaults(func=cmd_generate)
    u = sub.add_parser(
        "push",
        help="upload the generated dashboards through Grafana's HTTP API",
        description="Upload dashboards/generated/*.json with POST /api/dashboards/db. Exit codes: "
        "0 uploaded, 1 refused by Grafana, 2 bad arguments, 3 Grafana unreachable or "
        "failing, 4 credentials rejected.",
    )
    u.add_argument(
        "--url", default=None, help="Grafana's root URL, e.g. http://grafana:3000 (required unless --dry-run)"
    )
    u.add_argument(
        "--dry-run",
        action="store_true",
        help="load and list the dashboards that would be uploaded, and where, without contacting Grafana",
    )
    u.add_argument(
        "--token-file",
        default=None,
        help=f"file holding a Grafana service account token (default: "
        f"${TOKEN_ENV}; without either, user:password in --url or anonymous)",
    )
    u.add_argument(
        "--dir",
        default=None,
        help="the dashboard JSON files (default: dashboards/generated of this checkout, else the ones "
        "installed with kvguard)",
    )
    u.add_argument("--folder-uid", default=None, help="Grafana folder to put them in (default: General)")
    u.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the dashboards in Grafana even if they were "
        "changed there since (the repository is the source of truth)",
    )
    u.add_argument("--timeout", type=_positive_float, default=10.0, help="seconds per request (default 10)")
    u.set_defaults(func=cmd_push)
    return p

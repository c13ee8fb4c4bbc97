"""``kvguard preflight``: check every URL in parallel, print one report each."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import httpx

from . import coverage as cov
from . import router
from .checks import (
    _MAX_WORKERS,
    DEFAULT_TIMEOUT_S,
    EXIT_UNKNOWN,
    POOL_SMALLER,
    SAFE,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    UNKNOWN,
    Report,
    _one_line,
    _timeout_arg,
    check,
    read_token,
)
from .render import worst_exit


def run(
    urls: Sequence[str],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    token_file: str | None = None,
    as_json: bool = False,
    out: IO[str] | None = None,
    environ: dict[str, str] | None = None,
    transport: httpx.BaseTransport | None = None,
    sidecars: Sequence[str] = (),
    api_token_file: str | None = None,
    require_coverage: bool = False,
) -> int:
    """Check every URL (in parallel), print one report each (text, or one JSON object per line);
    then, for each ``sidecars`` URL, what kvguard watches of the engines it sees (coverage.py)."""
    out = out or sys.stdout
    try:
        token = read_token(token_file, environ)
    except ValueError as exc:
        groups = [[Report(u, reason=_one_line(exc))] for u in urls]
    else:
        with ThreadPoolExecutor(max_workers=max(1, min(_MAX_WORKERS, len(urls)))) as pool:
            groups = list(pool.map(lambda u: check(u, timeout_s=timeout_s, token=token, transport=transport), urls))
    reports = [r for g in groups for r in g]
    if as_json:
        for r in reports:
            out.write(json.dumps(r.to_json(), sort_keys=False) + "\n")
    else:
        out.write("\n\n".join(router.render_group(g) for g in groups) + "\n")
        if len(reports) > 1:
            counts = {v: sum(r.verdict == v for r in reports) for v in (SAFE, POOL_SMALLER, UNKNOWN)}
            out.write(
                f"\n{len(reports)} servers: {counts[SAFE]} safe, {counts[POOL_SMALLER]} pool smaller than "
                f"context, {counts[UNKNOWN]} cannot tell; exit {worst_exit(reports)}\n"
            )
    code = worst_exit(reports)
    if sidecars:
        try:
            api_token = cov.read_api_token(api_token_file)
        except OSError as exc:
            found = [cov.EngineCoverage(s, reason=f"cannot read the API token file: {exc}") for s in sidecars]
        else:
            found = [c for s in sidecars for c in cov.fetch(s, api_token, timeout_s, transport)]
        if as_json:
            for c in found:
                out.write(json.dumps(c.to_json()) + "\n")
        else:
            out.write("\n" + cov.render(found) + "\n")
        if require_coverage and code == 0 and not all(c.complete for c in found):
            code = cov.EXIT_COVERAGE_GAP
    out.flush()
    return code


# ---------------------------------------------------------------- command line


def cmd_preflight(args: argparse.Namespace) -> int:
    import logging

    if not getattr(args, "verbose", False):
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    return run(
        args.url,
        timeout_s=args.timeout,
        token_file=args.bearer_token_file,
        as_json=args.json,
        sidecars=args.sidecar or (),
        api_token_file=args.api_token_file,
        require_coverage=args.require_coverage,
    )


def _exit_1_on_usage_errors(p: argparse.ArgumentParser) -> None:
    """argparse exits 2 on usage errors; here 2 means "pool smaller than context"."""

    def error(message: str):
        p.print_usage(sys.stderr)
        p.exit(EXIT_UNKNOWN, f"{p.prog}: error: {message}\n")

    parse_known_args = p.parse_known_args

    def strict_parse_known_args(args=None, namespace=None):
        ns, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    p.error = error  # type: ignore[method-assign]
    p.parse_known_args = strict_parse_known_args  # type: ignore[method-assign]


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "preflight",
        help="deploy gate: compare a live SGLang or vLLM server's KV pool with its context length",
        description="Read each SGLang server's GET /server_info and GET /v1/models (a vLLM server: GET /v1/models "
        "and GET /metrics) and compare the KV pool with the context length the "
        "server enforces. "
        "A --url of SGLang's router (sglang-router) checks every worker it lists (GET /workers), "
        "each directly. Exit 0: pool >= context on every server; 2: some pool is smaller than its "
        "context; 1: cannot tell (the reason is printed). With several servers the worst wins "
        "(2 > 1 > 0). With --sidecar, also what kvguard watches of each engine (its pools, KV cache groups, "
        "state, draft model); --require-coverage exits 3 when some part is not watched (or cannot be read) "
        "and nothing worse was found.",
    )
    p.add_argument(
        "--url",
        action="append",
        required=True,
        metavar="URL",
        help="server base URL, http://HOST:PORT (repeat for each prefill and decode server), or the URL "
        "of SGLang's router: every worker it lists is checked",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per server on stdout (url, role, pool_tokens, context_len, "
        "max_req_input_len, page_size, verdict, reason, ..., router)",
    )
    p.add_argument(
        "--timeout",
        type=_timeout_arg,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"give each server at most this long (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--bearer-token-file",
        default=None,
        metavar="PATH",
        help=f"send 'Authorization: Bearer <token>' with the token in PATH (default ${TOKEN_FILE_ENV}, "
        f"else the token in ${TOKEN_ENV})",
    )
    p.add_argument(
        "--sidecar",
        action="append",
        metavar="URL",
        help="a kvguard sidecar's base URL (repeatable): print what kvguard watches of each engine it sees "
        "(GET /v1/engines' coverage)",
    )
    p.add_argument(
        "--api-token-file",
        default=None,
        metavar="PATH",
        help=f"the sidecar's API token for --sidecar (default ${cov.API_TOKEN_ENV})",
    )
    p.add_argument(
        "--require-coverage",
        action="store_true",
        help=f"exit {cov.EXIT_COVERAGE_GAP} when a --sidecar engine has a part kvguard does not watch, sent no "
        "coverage, or the sidecar cannot be read (and every pool check passed)",
    )
    p.set_defaults(func=cmd_preflight)
    _exit_1_on_usage_errors(p)
    return p

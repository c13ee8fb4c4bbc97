"""``kvguard canary --url URL``: the black-box cross-tenant canary (docs/canary.md)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .budget import DEFAULT_BUDGET
from .markers import DEFAULT_MIN_OVERLAP
from .plan import DEFAULT_MAX_PROMPT_TOKENS
from .report import EXIT_COULD_NOT_RUN, render_text
from .runner import DEFAULT_TIME_LIMIT_S, DEFAULT_TIMEOUT_S, Options, run_canary


def _positive(kind):
    def parse(value: str):
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
        return v

    return parse


def cmd_canary(args: argparse.Namespace) -> int:
    if not args.verbose:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    opts = Options(
        url=args.url,
        prefill_url=args.prefill_url,
        api=args.api,
        model=args.model,
        context_length=args.context_length,
        pool_tokens=args.pool_tokens,
        budget=args.budget,
        timeout_s=args.timeout,
        time_limit_s=args.time_limit,
        max_prompt_tokens=args.max_prompt_tokens,
        min_overlap=args.min_overlap,
        seed=args.seed,
    )
    from ..progress import progress_bar

    with progress_bar(total=args.budget, unit="req", desc="requests (of the budget)", quiet=args.json) as bar:
        opts.on_request = bar.update
        rep = run_canary(opts)
    if args.json:
        print(json.dumps(rep.to_json()), flush=True)
    else:
        print(render_text(rep), flush=True)
    return rep.exit_code


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "canary",
        help="black-box probe: plant markers as one tenant, look for them in another's answers",
        description="Plant unique markers in requests of a synthetic tenant A, drive tenant B down the risky "
        "paths (prompts around the pool and context limits, shared prefixes, cancelled streams, "
        "concurrency) and look for A's markers in B's output. Exit 0 clean, 3 a finding (leak, or a "
        "status that should have been an error), 1 could not run. See docs/canary.md.",
    )
    p.add_argument(
        "--url",
        required=True,
        help="what clients use: the router, a unified SGLang server, or any "
        "OpenAI-compatible endpoint; with --prefill-url, the decode server",
    )
    p.add_argument(
        "--prefill-url",
        default=None,
        help="a prefill/decode pair without a router: the prefill server "
        "(each request then goes to both, like SGLang's router; costs 2 requests of the budget)",
    )
    p.add_argument(
        "--api",
        choices=("auto", "native", "openai"),
        default="auto",
        help="native: SGLang /generate; "
        "openai: /v1/completions; auto (default): native when the server answers /server_info",
    )
    p.add_argument("--model", default=None, help="model name for /v1/completions (default: from /v1/models)")
    p.add_argument(
        "--context-length",
        type=_positive(int),
        default=None,
        help="use this context length (tokens) instead of what the server reports (for endpoints that report none)",
    )
    p.add_argument(
        "--pool-tokens",
        type=_positive(int),
        default=None,
        help="the KV pool (tokens) a prompt must fit, for endpoints that do not report it",
    )
    p.add_argument(
        "--budget",
        type=_positive(int),
        default=DEFAULT_BUDGET,
        help=f"never send more than this many HTTP requests, discovery included (default {DEFAULT_BUDGET})",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=DEFAULT_TIMEOUT_S,
        help=f"seconds per request (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--time-limit",
        type=_positive(float),
        default=DEFAULT_TIME_LIMIT_S,
        help=f"no new request after this many seconds (default {DEFAULT_TIME_LIMIT_S:g})",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=_positive(int),
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help=f"longest prompt to send (default {DEFAULT_MAX_PROMPT_TOKENS})",
    )
    p.add_argument(
        "--min-overlap",
        type=_positive(int),
        default=DEFAULT_MIN_OVERLAP,
        help=f"characters of marker text that make a leak (default {DEFAULT_MIN_OVERLAP})",
    )
    p.add_argument("--seed", type=int, default=None, help="marker seed (default: random per run)")
    p.add_argument("--json", action="store_true", help="one JSON object: verdict, limits, findings, every request")
    p.set_defaults(func=cmd_canary)

    def error(message: str):  # usage errors exit 1 ("could not run"); 3 is reserved for findings
        p.print_usage(sys.stderr)
        p.exit(EXIT_COULD_NOT_RUN, f"{p.prog}: error: {message}\n")

    p.error = error
    return p

"""``kvguard model``: write test models for the engine demos and tests.

``kvguard model echo --lag L OUT_DIR`` writes the hand-built GPT-2 "echo" model of
:mod:`kvguard.demo.echo_model` (real weights, no training): its greedy output copies
the prompt token ``L`` positions back, so a KV leak shows up as other requests'
tokens in the completion (docs/echo-model.md). Serve it with real weights (no
``--load-format dummy``).

Exit codes: 0 written; 1 any error (bad flag value, unwritable OUT_DIR), with a
one-line reason naming the flag and the value.
"""

from __future__ import annotations

import argparse
import sys

EXIT_OK = 0
EXIT_ERROR = 1


def _exit_1_on_usage_errors(p: argparse.ArgumentParser) -> None:
    """argparse exits 2 on usage errors; this command's contract is 0 or 1."""

    def error(message: str):
        p.print_usage(sys.stderr)
        p.exit(EXIT_ERROR, f"{p.prog}: error: {message}\n")

    p.error = error  # type: ignore[method-assign]


def cmd_model_echo(args: argparse.Namespace) -> int:
    from . import echo_model

    try:
        echo_model.validate(args.lag, args.n_positions, args.dtype, args.seed_search)
        echo_model.check_writable(args.out_dir)
        spec = echo_model.write_echo_gpt2(
            args.out_dir, args.lag, n_positions=args.n_positions, dtype=args.dtype,
            seed_search=args.seed_search, reuse=False,
        )  # fmt: skip
    except ValueError as exc:
        print(f"kvguard model echo: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(
        f"wrote the echo GPT-2 to {args.out_dir}: lag {spec.lag}, n_positions {spec.n_positions}, {spec.dtype}, "
        f"frequency seed {spec.seed} of {spec.seed_search} (worst sidelobe {spec.worst_sidelobe:.3f}, "
        f"margin {spec.margin_nats:.1f} nats). Greedy output copies the prompt token {spec.lag} positions back; "
        f"prompts need >= {spec.lag} tokens. Serve it with real weights (no --load-format dummy)."
    )
    return EXIT_OK


def register(subparsers) -> argparse.ArgumentParser:
    from .echo_model import DEFAULT_DTYPE, DEFAULT_N_POSITIONS, DEFAULT_SEED_SEARCH, DTYPES

    p = subparsers.add_parser(
        "model",
        help="write test models (hand-built weights) for engine demos and tests",
        description="Write small models with hand-set weights that make engine behaviour visible in the output.",
    )
    kinds = p.add_subparsers(dest="model_kind", required=True, metavar="KIND")
    e = kinds.add_parser(
        "echo",
        help="a GPT-2 whose greedy output copies the prompt token LAG positions back",
        description="Write a 1-layer GPT-2 (vocab 256, one character per token, n_embd 1024) with hand-set "
        "weights: safetensors, config.json and tokenizer into OUT_DIR (created if needed; files of "
        "the same name are replaced). Its greedy completion of a prompt x is x[-LAG], x[-LAG+1], ...: "
        "a request that reads another request's KV answers with that request's tokens. Prompts must "
        "be at least LAG tokens; more than LAG new tokens cycle. Serve it with real weights.",
    )
    e.add_argument("out_dir", metavar="OUT_DIR", help="directory to write the model into")
    e.add_argument(
        "--lag", type=int, required=True, metavar="L", help="copy the token L positions back (1 <= L < --n-positions)"
    )
    e.add_argument(
        "--n-positions",
        type=int,
        default=DEFAULT_N_POSITIONS,
        metavar="N",
        help=f"context length: learned positions 0..N-1 (default {DEFAULT_N_POSITIONS})",
    )
    e.add_argument(
        "--dtype",
        choices=DTYPES,
        default=DEFAULT_DTYPE,
        help=f"weights dtype in the safetensors file and config (default {DEFAULT_DTYPE})",
    )
    e.add_argument(
        "--seed-search",
        type=int,
        default=DEFAULT_SEED_SEARCH,
        metavar="N",
        help="try position-code seeds 0..N-1 and keep the one with the smallest worst sidelobe "
        f"(default {DEFAULT_SEED_SEARCH})",
    )
    e.set_defaults(func=cmd_model_echo)
    _exit_1_on_usage_errors(p)
    _exit_1_on_usage_errors(e)
    return p

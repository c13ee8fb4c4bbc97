"""``kvguard demo`` and ``kvguard model``: the incident on a real SGLang pair on CPU, and
the test models it serves. Registered into ``kvguard``'s parser when the kvguard-demo
distribution (this folder) is installed; engine and sidecar images leave it out."""

from __future__ import annotations

import sys

from . import model_cli


def cmd_demo(args) -> int:
    if args.engine == "vllm":
        if args.guard_mode != "off" or args.sglang != "0.5.19" or args.dummy_weights or args.model != "gpt2":
            print(
                "kvguard demo --engine vllm: --guard, --sglang, --model and --dummy-weights are SGLang's",
                file=sys.stderr,
            )
            return 1
        from .vllm_demo import run_vllm_demo

        return run_vllm_demo(as_json=args.json, workdir=args.workdir, keep=args.keep)
    from .run import run_demo

    return run_demo(
        sglang_version=args.sglang,
        as_json=args.json,
        workdir=args.workdir,
        keep=args.keep,
        words=not args.dummy_weights,
        guard=args.guard_mode,
        model=None if args.model == "gpt2" else args.model,
    )


def register(sub) -> None:
    model_cli.register(sub)

    p = sub.add_parser("demo", help="catch the 2026 KV exposure on a real SGLang prefill/decode pair on CPU")
    p.add_argument(
        "--engine",
        default="sglang",
        choices=["sglang", "vllm"],
        help="sglang: the 2026 incident on SGLang's prefill/decode pair (default); vllm: a block freed under a "
        "live request in a real vLLM engine (an injected fault), and the tenants it exposed",
    )
    p.add_argument(
        "--sglang",
        default="0.5.19",
        choices=["0.5.19", "0.5.23"],
        help="0.5.19 still leaks (default); 0.5.23 has the fix",
    )
    p.add_argument(
        "--model",
        default="gpt2",
        choices=["gpt2", "glm5", "deepseek_v2", "llama_tp2", "llama_pp2"],
        help="gpt2: the echo GPT-2 (default; the leak in words); glm5: a tiny GLM-5, the incident's model class "
        "(MLA latent KV + the DSA indexer cache); deepseek_v2: a tiny DeepSeek-V2 (MLA); llama_tp2: a tiny Llama "
        "with tensor parallelism 2 on both engines (two ranks each, one core per rank); llama_pp2: the same with "
        "pipeline parallelism 2 (two stages each, one layer per stage). The last four run with dummy weights: the "
        "leak shows as pages",
    )
    p.add_argument("--json", action="store_true", help="print the findings as JSON lines instead of the story")
    p.add_argument("--workdir", default=None, help="where logs and rings go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument(
        "--dummy-weights",
        action="store_true",
        help="serve a dummy-weight model (the leak shows as "
        "pages only) instead of the echo model (the leak shows as another tenant's words)",
    )
    p.add_argument(
        "--guard",
        dest="guard_mode",
        nargs="?",
        const="transfer",
        default="off",
        choices=["off", "transfer", "full"],
        help="run the engines with kvguard's guard (KVGUARD_GUARD; bare --guard: transfer): the request that "
        "would read other tenants' KV is failed in the engine instead of served (docs/guard.md)",
    )
    p.set_defaults(func=cmd_demo)

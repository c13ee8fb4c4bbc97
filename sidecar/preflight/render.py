"""The plain-words story of a preflight report, and the exit code of several."""

from __future__ import annotations

from collections.abc import Sequence

from . import router
from .checks import EXIT_UNKNOWN, MODELS_PATH, SAFE, UNKNOWN, Report

_MEANING = {
    "prefill": (
        "This is the 2026 incident's configuration: a prefill node whose pool is smaller than the context. "
        "Such prompts are rejected on prefill; SGLang up to 0.5.19 still handed them to decode, which read "
        "pages other requests had written and answered HTTP 200 with their data. On fixed versions the "
        "clients get errors for prompts the context length promises."
    ),
    "decode": (
        "Decode rejects prompts longer than its pool after prefill may already have done the work; clients "
        "get errors for prompts the context length promises. Check the prefill servers too."
    ),
    "unified": (
        "The server rejects prompts longer than its pool although the context length promises them; "
        "clients see errors, and any disaggregated deployment of this configuration is exposed."
    ),
}
_FIX = (
    "Fix: give the KV cache at least the context length (drop or raise a --max-total-tokens cap, raise "
    "--mem-fraction-static, spread the weights over more GPUs) or advertise less (--context-length at most "
    "the pool)."
)


def render_text(rep: Report) -> str:
    """The plain-words story of one report."""
    behind = None
    if rep.router is not None and rep.role != router.ROUTER_ROLE:
        behind = f"{rep.router} (listed as {rep.router_worker_type or 'a worker of no type'})"
    if rep.verdict == UNKNOWN:
        if behind is None:
            return f"{rep.url}: cannot tell: {rep.reason}"
        return "\n".join(
            [f"{rep.url}: cannot tell: {rep.reason}", f"  behind router:      {behind}"]
            + [f"  note: {n}" for n in rep.notes]
        )
    word = "SAFE" if rep.verdict == SAFE else f"POOL SMALLER THAN CONTEXT ({rep.severity})"
    role = rep.role or "not reported"
    if rep.role in ("prefill", "decode"):
        role += " (prefill/decode disaggregation)"
    elif rep.role == "unified":
        role += " (not disaggregated)"
    lines = [
        f"{rep.url}: {word}",
        f"  SGLang version:     {rep.version or 'not reported'}",
        f"  role:               {role}",
        f"  KV pool:            {rep.pool_tokens} tokens"
        + (f" (page size {rep.page_size})" if rep.page_size is not None else ""),
        f"  context length:     {rep.context_len} tokens (from {rep.context_source}"
        + (" max_model_len)" if rep.context_source == MODELS_PATH else " context_length)"),
        f"  pool / context:     {rep.ratio:.2f}x",
        "  max request input:  "
        + (f"{rep.max_req_input_len} tokens" if rep.max_req_input_len is not None else "not reported"),
    ]
    if behind is not None:
        lines.append(f"  behind router:      {behind}")
    if rep.verdict == SAFE:
        lines.append(
            "  means: every prompt the context length allows fits in the KV pool. The pool is shared by all "
            "running requests: a pool equal to the context holds one full-length request at a time "
            "(the incident's fix sized it at ~2x)."
        )
    else:
        lines.append(f"  means: {rep.reason}. " + _MEANING.get(rep.role or "", _MEANING["unified"]))
        lines.append(f"  {_FIX}")
    lines += [f"  note: {n}" for n in rep.notes]
    return "\n".join(lines)


def worst_exit(reports: Sequence[Report]) -> int:
    """0 safe < 1 unknown < 2 pool smaller: a known-unsafe server outranks an unreadable one."""
    return max((r.exit_code for r in reports), default=EXIT_UNKNOWN)

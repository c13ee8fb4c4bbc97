"""The canary's report: every request, what leaked where, and the verdict.

Exit codes: 0 clean; 3 a finding (tenant A's marker text in a tenant-B answer, or a
status that should have been an error); 1 could not run (the reason is one line).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .clients import Reply
from .limits import ServerLimits
from .markers import Leak
from .plan import Probe, Sizing

EXIT_CLEAN, EXIT_COULD_NOT_RUN, EXIT_FINDING = 0, 1, 3
_EXCERPT = 80


@dataclass
class Finding:
    kind: str  # "marker_leak" | "should_have_been_error"
    request: int
    message: str


@dataclass
class RequestRecord:
    index: int
    probe: Probe
    tenant: str
    prompt_chars: int
    reply: Reply
    leak: Leak | None = None
    note: str | None = None

    def to_json(self) -> dict[str, Any]:
        r, p = self.reply, self.probe
        return {
            "index": self.index,
            "rid": r.rid,
            "phase": p.phase,
            "tenant": self.tenant,
            "role": "victim" if p.tenant == "A" else "prober",
            "purpose": p.why,
            "expect": p.expect,
            "prompt_tokens_planned": p.prompt_tokens,
            "prompt_chars": self.prompt_chars,
            "max_new_tokens": p.max_new_tokens,
            "status": r.status,
            "ok": r.ok,
            "error": r.error,
            "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "completion_tokens": r.completion_tokens,
            "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 4),
            "latency_s": round(r.latency_s, 4),
            "aborted_by_client": r.aborted_by_client,
            "output_excerpt": r.text[:_EXCERPT],
            "leak": None
            if self.leak is None
            else {"fragment": self.leak.fragment, "blocks": self.leak.blocks, "victim_numbers": self.leak.victims},
            "note": self.note,
        }


def model_note(model: str | None) -> str:
    """What the model means for the verdict (the CLI always says which model it saw)."""
    name = os.path.basename((model or "").rstrip("/"))
    if not model:
        return "model: not reported. Leak detection needs a model that reproduces what it attended to."
    if "echo" in name.lower():
        return (
            f"model: {model} (looks like kvguard's echo model: its output copies the prompt, so KV it read "
            f"from another tenant comes back as text and a clean result means something)"
        )
    return (
        f"model: {model}. The markers come back only if this model reproduces text it attended to; a "
        f"fluent model may ignore or paraphrase another tenant's KV, so a clean result is weak evidence "
        f"(docs/canary.md). Serve kvguard's echo model (`kvguard model echo`) on a staging copy for a "
        f"strong test."
    )


@dataclass
class Report:
    url: str
    budget: int
    api: str | None = None
    model: str | None = None
    servers: list[ServerLimits] = field(default_factory=list)
    sizing: Sizing | None = None
    marker_run: str | None = None
    chars_per_token: dict[str, float] = field(default_factory=dict)  # per tenant, measured
    requests: list[RequestRecord] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # how the endpoint was read
    skipped: list[str] = field(default_factory=list)
    could_not_run: str | None = None
    budget_obj: Any = None

    def fail(self, reason: str) -> Report:
        self.could_not_run = " ".join(reason.split())
        return self

    @property
    def requests_sent(self) -> int:
        return self.budget_obj.used if self.budget_obj is not None else 0

    @property
    def verdict(self) -> str:
        if any(f.kind == "marker_leak" for f in self.findings):
            return "leak"
        if self.findings:
            return "should_have_been_error"
        return "could_not_run" if self.could_not_run else "clean"

    @property
    def exit_code(self) -> int:
        if self.findings:  # a finding stands even if the run was cut short afterwards
            return EXIT_FINDING
        return EXIT_COULD_NOT_RUN if self.could_not_run else EXIT_CLEAN

    def unread(self) -> list[str]:
        return [f"{s.url}: {u}" for s in self.servers for u in s.unread]

    def to_json(self) -> dict[str, Any]:
        s = self.sizing
        return {
            "url": self.url,
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "reason": self.could_not_run,
            "api": self.api,
            "model": self.model,
            "model_note": model_note(self.model),
            "budget": self.budget,
            "requests_sent": self.requests_sent,
            "limits": None
            if s is None
            else {
                "pool_tokens": s.pool_in,
                "decode_pool_tokens": s.pool_decode,
                "context_len": s.context_len,
                "max_req_input_len": s.max_input,
            },
            "servers": [x.to_json() for x in self.servers],
            "unread": self.unread(),
            "marker_run": self.marker_run,
            "chars_per_token": self.chars_per_token,
            "findings": [{"kind": f.kind, "request": f.request, "message": f.message} for f in self.findings],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "skipped": list(self.skipped),
            "requests": [r.to_json() for r in self.requests],
        }


def render_text(rep: Report) -> str:
    lines = [f"kvguard canary: {rep.url}"]
    for srv in rep.servers:
        lines.append(
            f"  server {srv.url}: SGLang {srv.version or '?'}, role {srv.role or 'not reported'}, KV pool "
            f"{srv.pool_tokens or '?'} tokens, context {srv.context_len or '?'}, page size "
            f"{srv.page_size or '?'}, chunked prefill {srv.chunked_prefill_size or '?'}"
        )
    for u in rep.unread():
        lines.append(f"  could not read: {u}")
    lines += [f"  note: {n}" for n in rep.notes]
    if rep.api:
        lines.append(f"  API: {rep.api}")
    lines.append("  " + model_note(rep.model))
    lines.append(
        f"  requests sent: {rep.requests_sent} of a budget of {rep.budget}"
        + (f"; markers of run {rep.marker_run}" if rep.marker_run else "")
    )
    if rep.requests:
        lines.append("")
        lines.append("  #  tenant              phase          prompt  status  result")
    for r in rep.requests:
        x = r.reply
        result = ("ok" if x.ok else (x.error or "error"))[:90]
        if x.aborted_by_client:
            result = "cancelled by the canary after the first chunk"
        if r.leak:
            result += f"  LEAK: {r.leak.fragment!r}"
        tokens = x.prompt_tokens if x.prompt_tokens is not None else f"~{r.probe.prompt_tokens}"
        lines.append(
            f"  {r.index:<2d} {r.tenant:19s} {r.probe.phase:14s} {tokens!s:>6}  {x.status or '-'!s:>6}  {result}"
        )
    lines.append("")
    for f in rep.findings:
        lines.append(f"FINDING [{f.kind}] {f.message}")
    for w in rep.warnings:
        lines.append(f"warning: {w}")
    for s in rep.skipped:
        lines.append(f"not probed: {s}")
    if rep.could_not_run:
        lines.append(f"could not run: {rep.could_not_run}")
    word = {
        "leak": "LEAK SEEN",
        "should_have_been_error": "A STATUS THAT SHOULD HAVE BEEN AN ERROR",
        "clean": "CLEAN (no marker of tenant A in tenant B's answers)",
        "could_not_run": "COULD NOT RUN",
    }
    lines.append(f"verdict: {word[rep.verdict]}; exit {rep.exit_code}")
    return "\n".join(lines)

"""Configuration detectors: ``pool_smaller_than_context``.

The KV pool is sized at start-up from memory left after the weights; the advertised
context length is a separate setting and nothing forces the two to agree. A prompt
that fits the context but not the pool takes the engine's reject path, which is the
path the 2026 incident leaked through. Critical on a disaggregated prefill node
(the incident's configuration), warning elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvguard.engine_hooks import wire

from ..catalogue import KIND
from ..findings import CRITICAL, WARNING, EngineRef, Finding
from .base import At


@dataclass(frozen=True, slots=True)
class PoolVsContext:
    pool_tokens: int
    context_len: int
    max_req_input_len: int

    @property
    def pool_smaller(self) -> bool:
        return 0 < self.pool_tokens < self.context_len

    @property
    def ratio(self) -> float:
        return self.pool_tokens / self.context_len if self.context_len else float("inf")


def severity_for(role: str) -> str:
    return CRITICAL if role == "prefill" else WARNING


def describe(engine: EngineRef, c: PoolVsContext) -> str:
    return (
        f"{engine.role} rank {engine.rank}: KV pool holds {c.pool_tokens} tokens but the context length is "
        f"{c.context_len} ({c.ratio:.2f}x): prompts between the two take the reject path"
    )


class PoolContextDetector:
    """Called on each HELLO record (engine start-up)."""

    kinds: ClassVar[tuple[str, ...]] = (KIND.pool_smaller_than_context,)
    events: ClassVar[tuple[type, ...]] = (wire.Hello,)

    def observe(self, hello: wire.Hello, at: At) -> list[Finding]:
        engine, ts_ns = at.engine, at.ts_ns
        c = PoolVsContext(hello.pool_tokens, hello.context_len, hello.max_req_input_len)
        if not c.pool_smaller:
            return []
        evidence = {
            "pool_tokens": c.pool_tokens,
            "context_len": c.context_len,
            "max_req_input_len": c.max_req_input_len,
            "page_size": hello.page_size,
            "engine_version": hello.engine_version,
            "model": hello.model,
        }
        return [
            Finding(
                KIND.pool_smaller_than_context,
                severity_for(engine.role),
                engine,
                None,
                [],
                [],
                ts_ns,
                describe(engine, c),
                evidence,
            )
        ]

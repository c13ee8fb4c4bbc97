"""Who a request key is (``RequestInfo``): a plain record, below the request directory that keeps
them and the events that carry them (sidecar/events.py), so that neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestInfo:
    key: int
    rid: str = ""
    tenant: str = ""
    room: int | None = None
    warmup: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    begin_ns: int = 0
    end_ns: int = 0
    finish: str = ""
    ttft_ns: int = 0
    rejected: str = ""
    reprefilled: bool = False  # KV released and prefilled again (REQ_END flag): TTFT not comparable
    known: bool = True  # False: a stub for a request whose REQ_BEGIN we never saw (not judged)
    guard_action: str = ""  # what the engine's guard did about its reads (GUARD read rules): aborted / observed
    scope: int = 0  # its prefix-cache scope (REQ_SCOPE: cache salt / extra key, hashed); 0 = the default

"""``kvguard preflight``: a deploy gate comparing a live SGLang or vLLM server's KV pool with its
context length (the incident's precondition), directly or through SGLang's router.

- :mod:`.checks`: reading ``/server_info`` and ``/v1/models``, the verdict per server.
- :mod:`.router`: a router URL, one report per worker it lists.
- :mod:`.render`: the plain-words story; :mod:`.cli`: the command.
"""

from .checks import (
    EXIT_CODES,
    EXIT_POOL_SMALLER,
    EXIT_SAFE,
    EXIT_UNKNOWN,
    POOL_SMALLER,
    SAFE,
    UNKNOWN,
    PreflightError,
    Report,
    check,
    evaluate,
    normalize_url,
    read_token,
)
from .cli import register, run
from .render import render_text, worst_exit

__all__ = [
    "EXIT_CODES",
    "EXIT_POOL_SMALLER",
    "EXIT_SAFE",
    "EXIT_UNKNOWN",
    "POOL_SMALLER",
    "SAFE",
    "UNKNOWN",
    "PreflightError",
    "Report",
    "check",
    "evaluate",
    "normalize_url",
    "read_token",
    "register",
    "run",
    "render_text",
    "worst_exit",
]

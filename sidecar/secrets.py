"""Secrets (API token, PagerDuty routing key) from a file or the environment.

One policy: the file wins over the variable; a missing or unreadable file is a
start-up error that names the flag and the path; the value itself is never put in a
message or a log line.
"""

from __future__ import annotations

import os


def read_secret(path: str | None, flag: str, env: str) -> tuple[str, str]:
    """(value, where it came from); value is "" when neither is set. ValueError names the flag."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip(), f"{flag} {path!r}"
        except OSError as exc:
            raise ValueError(f"{flag} {path!r}: {exc.strerror}") from exc
    return os.environ.get(env, "").strip(), f"${env}"

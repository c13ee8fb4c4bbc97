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


# ---------------------------------------------------------------------- settings shown elsewhere
# What a bundle (sidecar/bundle.py) may show of the sidecar's settings: every value, except
# the secrets' (said to be set or not) and a URL's password. The names that hold secrets:
SECRET_ENV = frozenset(("KVGUARD_API_TOKEN", "KVGUARD_PAGERDUTY_ROUTING_KEY", "KVGUARD_LEDGER_PASSWORD"))
# OTEL_EXPORTER_OTLP_HEADERS and its per-signal forms carry collectors' credentials
SECRET_ENV_PARTS = ("HEADERS", "TOKEN", "PASSWORD", "SECRET", "KEY")
SHOWN_ENV_PREFIXES = ("KVGUARD_", "OTEL_")
SET, UNSET = "(set, not shown)", "(not set)"


def redact_url(value: str) -> str:
    """``scheme://user:password@host/...`` without the password (and the user kept)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(value)
    except ValueError:
        return SET
    if parts.password is None and "@" not in parts.netloc:
        return value
    host = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}" if user else f"***@{host}"))


def _secret_name(name: str) -> bool:
    upper = name.upper()
    if upper.endswith("_FILE"):  # a path to a secret, not the secret
        return False
    return upper in SECRET_ENV or any(part in upper for part in SECRET_ENV_PARTS)


def redact_value(name: str, value):
    if _secret_name(name):
        return SET if value else UNSET
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def redact_settings(settings: dict) -> dict:
    """A settings mapping (the command line's) safe to hand on: secrets' values replaced by
    whether they are set, URLs without passwords."""
    out = {}
    for name, value in settings.items():
        if isinstance(value, (list, tuple)) and not _secret_name(name):
            out[name] = [redact_value(name, v) for v in value]
        else:
            out[name] = redact_value(name, value)
    return out


def environment_settings(environ) -> dict:
    """The KVGUARD_* and OTEL_* variables of the sidecar's environment, redacted."""
    return {name: redact_value(name, environ[name]) for name in sorted(environ) if name.startswith(SHOWN_ENV_PREFIXES)}

"""Progress of long commands (``kvguard replay``, ``kvguard canary``) on a terminal: a tqdm bar
on stderr, shown only when stderr is a terminal and the output is not ``--json``, so that
pipes, logs and machine-read output stay exactly as they were."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int, unit: str, desc: str, quiet: bool = False, unit_scale: bool = False) -> tqdm:
    """A context-managed bar (``update(n)``); a disabled one (every call a no-op) when ``quiet``
    or stderr is not a terminal."""
    shown = not quiet and sys.stderr.isatty()
    return tqdm(
        total=total, unit=unit, desc=desc, unit_scale=unit_scale, file=sys.stderr, disable=not shown, leave=False
    )

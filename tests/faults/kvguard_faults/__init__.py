"""kvguard_faults: a TEST-ONLY SGLang general plugin that injects KV-cache memory-safety
faults into a running SGLang 0.5.23 engine, for kvguard's engine tests
(tests/integration/test_faults_engine.py, docs/fault-injection.md). Never install it anywhere.

How SGLang finds it: ``tests/faults`` holds this package and a
``kvguard_faults-0.1.0.dist-info`` folder whose ``entry_points.txt`` names
``load`` in group ``sglang.srt.plugins``. Putting ``tests/faults`` on an engine
subprocess's ``PYTHONPATH`` (``sidecar.demo.engines.start_engine(...,
extra_pythonpath=[...])``) makes ``sglang.srt.plugins.load_plugins()`` call
:func:`load` in every engine process; it registers hooks only when
``KVGUARD_FAULT`` names faults, so it is inert otherwise.

Environment:
  ``KVGUARD_FAULT``      comma list of faults to arm, or ``all`` (see :data:`FAULTS`)
  ``KVGUARD_FAULT_DIR``  folder for ``events.jsonl``: one JSON line per thing the plugin
                         did (which pages it freed, which row it corrupted, ...), read
                         by the tests to know the exact pages and to pace the requests

A fault only touches requests whose rid is ``kvgf-<fault>-<role>-<anything>``, so one
engine can host every fault, one scenario after the other.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvguard.faults")

FAULT_ENV = "KVGUARD_FAULT"
DIR_ENV = "KVGUARD_FAULT_DIR"

# unified engine (one process): faults 1-4 of the issue; PD prefill: fault 5; PD decode: flip_received_page
FAULTS = (
    "use_after_free",
    "double_free",
    "row_corruption",
    "late_write_forward",
    "late_write_pool",
    "salt_dropped",
    "prefix_wrong_page",
    "spec_draft_foreign",
    "send_truncated",
    "sender_truncated",
    "send_foreign_page",
    "send_source_released",
    "completion_after_release",
    "flip_received_page",
    "hicache_load_freed",
    "hicache_host_flipped",
    "hicache_other_object",
    "state_slot_freed",
    "swa_freed_under_reader",
)


def rid_prefix(fault: str) -> str:
    return f"kvgf-{fault}-"


def make_rid(fault: str, role: str, tag: str) -> str:
    """The rid a test gives a request so that ``fault`` treats it as ``role``."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    return f"{rid_prefix(fault)}{role}-{tag}"


def enabled_faults(value: str | None = None) -> set[str]:
    raw = os.environ.get(FAULT_ENV, "") if value is None else value
    names = {x.strip() for x in raw.split(",") if x.strip()}
    if "all" in names:
        return set(FAULTS)
    unknown = names - set(FAULTS)
    if unknown:
        log.warning("kvguard_faults: unknown faults %s ignored (known: %s)", sorted(unknown), ", ".join(FAULTS))
    return names & set(FAULTS)


_loaded = False


def load() -> None:
    """Entry point (``sglang.srt.plugins``): register the hooks of the armed faults."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    faults = enabled_faults()
    if not faults:
        return
    from . import inject

    inject.register(faults, os.environ.get(DIR_ENV) or None)

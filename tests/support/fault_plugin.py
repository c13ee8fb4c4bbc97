"""The test-only fault plugin (tests/faults/kvguard_faults) as the engine tests use it.

``FAULTS_DIR`` goes on an engine subprocess's PYTHONPATH (``start_engine(...,
extra_pythonpath=[FAULTS_DIR])``) so that SGLang loads the plugin through its entry
point; ``make_rid`` names a request so that a fault treats it as a given role. The
plugin package is imported here without leaving tests/faults on this process's path,
so nothing else in the test session can pick the plugin up by accident.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAULTS_DIR = Path(__file__).resolve().parents[1] / "faults"

sys.path.insert(0, str(FAULTS_DIR))
try:
    from kvguard_faults import make_rid
finally:
    sys.path.remove(str(FAULTS_DIR))

__all__ = ["FAULTS_DIR", "make_rid"]

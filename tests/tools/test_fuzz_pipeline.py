"""Coverage-guided fuzzing of the record path (issue 14): ``tests/tools/fuzz/pipeline_target.py``
under libFuzzer (atheris), from the committed seeds, for a bounded, repeatable number of
inputs. Whatever the records, nothing raises in the decoder or inside ``Pipeline.apply``,
page models stay within their limits, rows within the row limit, rooms within their caps.
`make fuzz` runs it longer and keeps its corpus."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent / "fuzz" / "run.py"

pytest.importorskip("atheris", reason="atheris is in requirements/engine.lock: run `make venv`")


@pytest.mark.timeout(300)
def test_the_record_path_survives_coverage_guided_fuzzing(tmp_path):
    out = subprocess.run(
        [sys.executable, str(RUN), "--runs", "12000", "--seed", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    full = out.stdout + out.stderr
    tail = full[-6000:]
    assert out.returncode == 0, tail
    assert "Done 12000 runs" in tail, tail  # it ran to its bound, not stopped early
    # coverage-guided, not blind: the record path is instrumented (a package rename once left
    # it uninstrumented, and libFuzzer ran on with one input and this warning)
    assert "Is the code instrumented for coverage?" not in full and re.search(r"INITED cov: [1-9]\d*", full), full[
        :3000
    ]
    assert not list(tmp_path.glob("crash-*")), tail

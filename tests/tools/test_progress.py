"""Progress of long commands: a bar on a terminal's stderr, nothing when stderr is not a
terminal or the output is --json (what pipes, logs and machine readers get is unchanged)."""

from __future__ import annotations

import io

from kvguard.sidecar import progress
from kvguard.sidecar.canary.budget import Budget


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_bar_is_drawn_only_on_a_terminal_and_never_with_json(monkeypatch):
    for stream, quiet, drawn in ((_Terminal(), False, True), (_Terminal(), True, False), (io.StringIO(), False, False)):
        monkeypatch.setattr(progress.sys, "stderr", stream)
        with progress.progress_bar(total=10, unit="B", desc="segments", quiet=quiet) as bar:
            bar.update(4)
            bar.update(6)
        assert ("segments" in stream.getvalue()) is drawn, (quiet, stream.getvalue())


def test_the_canarys_budget_reports_each_reservation():
    taken: list[int] = []
    budget = Budget(8, on_take=taken.append)
    budget.take()
    budget.take(2, "a prefill/decode pair")
    assert taken == [1, 2] and budget.used == 3

"""The model checker for spec/model.py: exhaustive breadth-first search of every state the
protocol can reach from the initial pool, checking each transition's invariants.

Why an explicit-state checker in Python rather than spin alone: conformance
(spec/conformance.py) needs every *trace* of the model, with the model's verdicts, as
Python data it can turn into a recording; a second model in another language would have
to be kept equal to this one by hand. The search is the textbook one (a visited set of
hashable states, a FIFO frontier, parents kept for the shortest counterexample), the
state is plain tuples, and the invariants are checked on every enabled transition of
every reachable state. spec/transfer.pml states the same protocol for spin as an
independent check; tests/tools/test_spec.py asks both for the same answers.

``python spec/check.py`` prints, for BUGGY and FIXED at the configurations below, the
states explored and, per finding kind, the shortest counterexample or "none".
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec.model import BUGGY, FIXED, Config, Protocol, Req, State, Step, initial, successors

# Every request kind at least once: a normal one, a second tenant to reuse its pages, the
# over-long one prefill rejects. Three requests over four pages: a reservation always has
# to reuse pages someone else held, which is what every bug of the family needs.
CHECK_CONFIGS = {
    "two": Config(3, (Req("a", "acme", 1), Req("c", "initech", 2, too_long=True))),
    "three": Config(4, (Req("a", "acme", 2), Req("b", "globex", 1), Req("c", "initech", 2, too_long=True))),
    # sends in flight (the option: a send, then its completion; the sender's pages modelled):
    # every request kind again, two normal tenants to take each other's pages on either engine
    # (each pool holds two prompts: a reuse needs a release) and the over-long one
    "inflight": Config(
        3,
        (Req("a", "acme", 1), Req("b", "globex", 1), Req("c", "initech", 2, too_long=True)),
        prefill_pages=2,
    ),
}


@dataclass
class CheckResult:
    protocol: str
    config: str
    states: int = 0
    transitions: int = 0
    terminal: int = 0
    counterexamples: dict = field(default_factory=dict)  # kind -> [actions] (shortest)

    def kinds(self) -> set[str]:
        return set(self.counterexamples)


def check(cfg: Config, proto: Protocol, config_name: str = "") -> CheckResult:
    """Every reachable state once; the first (hence shortest) path to each violated kind."""
    res = CheckResult(proto.name, config_name)
    start = initial(cfg)
    parent: dict[State, tuple[State, str] | None] = {start: None}
    frontier = deque([start])
    while frontier:
        state = frontier.popleft()
        res.states += 1
        any_step = False
        for step in successors(cfg, proto, state):
            any_step = True
            res.transitions += 1
            for v in step.verdicts:
                if verdict_kind(v) not in res.counterexamples:
                    res.counterexamples[verdict_kind(v)] = _path(parent, state) + [step.action]
            if step.state not in parent:
                parent[step.state] = (state, step.action)
                frontier.append(step.state)
        if not any_step:
            res.terminal += 1
    return res


def verdict_kind(v) -> str:
    """The kind, with the access of a send in flight's invariants (``late_write/completion``,
    ``use_after_free/send``): they are properties of their own."""
    return f"{v.kind}/{v.access}" if v.access else v.kind


def _path(parent, state) -> list[str]:
    out = []
    while parent[state] is not None:
        state, action = parent[state]
        out.append(action)
    return out[::-1]


def traces(cfg: Config, proto: Protocol) -> Iterator[list[Step]]:
    """Every maximal action sequence (a run that ends where no action is enabled), depth
    first. Distinct sequences are distinct traces even where they reach the same state:
    kvguard sees the order."""
    path: list[Step] = []

    def walk(state: State) -> Iterator[list[Step]]:
        leaf = True
        for step in successors(cfg, proto, state):
            leaf = False
            path.append(step)
            yield from walk(step.state)
            path.pop()
        if leaf:
            yield list(path)

    yield from walk(initial(cfg))


def count_traces(cfg: Config, proto: Protocol) -> tuple[int, int]:
    """(traces, of which with a verdict), without building them: paths counted per state."""
    memo: dict[State, tuple[int, int]] = {}

    def walk(state: State) -> tuple[int, int]:
        if state in memo:
            return memo[state]
        total = bad = 0
        leaf = True
        for step in successors(cfg, proto, state):
            leaf = False
            t, b = walk(step.state)
            total += t
            bad += t if step.verdicts else b
        out = (1, 0) if leaf else (total, bad)
        memo[state] = out
        return out

    return walk(initial(cfg))


# what the buggy protocol must show (the three: the 0.5.19 admission path, the
# late-write race after a timeout release, a double free; with sends in flight, a completion
# into pages decode gave away and a send from pages prefill gave away) and what the fixed one must not
REQUIRED_ON_BUGGY = ("transfer_size_mismatch", "unwritten_read", "late_write", "double_free")
REQUIRED_IN_FLIGHT = ("late_write/completion", "use_after_free/send", "unwritten_read", "double_free")
IN_FLIGHT_SAFETY = ("late_write/completion", "use_after_free/send")
SAFETY = (
    "unwritten_read",
    "foreign_read",
    "use_after_free",
    "late_write",
    "double_free",
    "transfer_size_mismatch",
    *IN_FLIGHT_SAFETY,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CHECK_CONFIGS), action="append")
    args = ap.parse_args(argv)
    failed = []
    for name in args.config or sorted(CHECK_CONFIGS):
        cfg = CHECK_CONFIGS[name]
        for proto in (BUGGY, FIXED):
            res = check(cfg, proto, name)
            print(
                f"{proto.name:5} {name:5}: {res.states} states, {res.transitions} transitions, "
                f"{res.terminal} end states"
            )
            for kind, path in sorted(res.counterexamples.items()):
                print(f"    {kind}: {' '.join(path)}")
            if not res.counterexamples:
                print("    no invariant broken")
            if proto is BUGGY:
                required = REQUIRED_IN_FLIGHT if cfg.in_flight else REQUIRED_ON_BUGGY
                failed += [f"{name}/buggy: no {k} found" for k in required if k not in res.counterexamples]
            else:
                failed += [f"{name}/fixed: {k} reachable" for k in SAFETY if k in res.counterexamples]
    for line in failed:
        print(f"FAILED {line}")
    print("model check: " + ("FAILED" if failed else "the buggy protocol's bugs found, the fixed protocol verified"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs ``pipeline_target.py`` under libFuzzer from the committed seeds (``seeds.b64``).

    python tests/tools/fuzz/run.py [--seconds S | --runs N] [--corpus DIR] [--update-seeds]

``--corpus DIR`` keeps what the run finds (``make fuzz``: ``.kvguard-cache/fuzz-corpus``);
``--update-seeds`` merges that corpus down to the inputs that add coverage and rewrites
``seeds.b64`` (``make fuzz-seeds``). A crash leaves ``crash-*`` in the work directory and
exits non-zero: reproduce it with ``python tests/tools/fuzz/pipeline_target.py crash-...``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE / "pipeline_target.py"
SEEDS = HERE / "seeds.b64"
MAX_LEN = 2048


def read_seeds() -> list[bytes]:
    return [base64.b64decode(line) for line in SEEDS.read_text().splitlines() if line and not line.startswith("#")]


def write_seeds(corpus: Path) -> int:
    inputs = sorted(p.read_bytes() for p in corpus.iterdir() if p.is_file())
    header = SEEDS.read_text().splitlines()[0]
    SEEDS.write_text("\n".join([header, *sorted(base64.b64encode(b).decode() for b in inputs)]) + "\n")
    return len(inputs)


def unpack(seeds: list[bytes], into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for data in seeds:
        (into / hashlib.sha1(data).hexdigest()).write_bytes(data)


def fuzz(corpus: Path, work: Path, seconds: float | None, runs: int | None, seed: int) -> int:
    flags = [f"-max_len={MAX_LEN}", f"-seed={seed}", f"-artifact_prefix={work}/", "-print_final_stats=1"]
    flags += [f"-max_total_time={int(seconds)}"] if seconds else []
    flags += [f"-runs={runs}"] if runs else []
    return subprocess.run([sys.executable, str(TARGET), *flags, str(corpus)], cwd=work).returncode


def merge(into: Path, source: Path, work: Path) -> None:
    # libFuzzer re-runs the target by its path for a merge: the script is executable and its
    # shebang finds this interpreter first on PATH
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    subprocess.run(
        [str(TARGET), "-merge=1", f"-max_len={MAX_LEN}", str(into), str(source)], cwd=work, env=env, check=True
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, help="stop after this long")
    p.add_argument("--runs", type=int, help="stop after this many inputs")
    p.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed (default 1: repeatable)")
    p.add_argument("--corpus", type=Path, help="keep the corpus here (default: a temporary directory)")
    p.add_argument("--update-seeds", action="store_true", help="merge the corpus into seeds.b64 afterwards")
    args = p.parse_args(argv)
    if not (args.seconds or args.runs):
        p.error("give --seconds or --runs: a fuzz run is bounded")
    with tempfile.TemporaryDirectory(prefix="kvguard-fuzz-") as tmp:
        work = Path(tmp)
        # absolute: libFuzzer runs in the work directory (`make fuzz` passes a path relative to the repository)
        corpus = args.corpus.resolve() if args.corpus else work / "corpus"
        unpack(read_seeds(), corpus)
        rc = fuzz(corpus, work, args.seconds, args.runs, args.seed)
        crashes = sorted(work.glob("crash-*")) + sorted(work.glob("timeout-*")) + sorted(work.glob("oom-*"))
        for c in crashes:  # the temporary directory goes away: keep them where the run was started
            (Path.cwd() / c.name).write_bytes(c.read_bytes())
            print(
                f"fuzz: kept {c.name} (reproduce: python {TARGET.relative_to(Path.cwd()) if TARGET.is_relative_to(Path.cwd()) else TARGET} {c.name})"
            )
        if rc == 0 and args.update_seeds:
            merged = work / "merged"
            merged.mkdir()
            merge(merged, corpus, work)
            print(f"fuzz: seeds.b64 now holds {write_seeds(merged)} inputs")
        return rc


if __name__ == "__main__":
    sys.exit(main())

"""`dflashpipe bisect` on a planted slowdown among ten commits, in a throwaway DVC project.

    python benchmarks/bisect_slowdown.py [--commits 10] [--slow-from 6] [--runs 1] [--busy 0]

The project has one timed stage: `work.py` times 5 rounds of a fixed number of float32 matmuls and records
`rate_per_s` (matmuls per second) with its spread and the control beside it (dflashpipe.core.spread.Measuring),
as the pipeline's timed stages do. GOOD is measured and committed; then `--commits` commits each edit
work.py, and from `--slow-from` on it does twice the work per round (the planted slowdown). Only the last
commit is run and recorded again, so bisect has to reproduce the probes between. `--busy N` starts N
spinning processes beside it for the whole search (a neighbour the control should see). Prints the bisect
report, the commit it found against the planted one, probes run and seconds, as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

WORK_PY = """
import json, pathlib, sys, time
sys.path.insert(0, {src!r})
import torch
from dflashpipe.core.spread import Measuring, Spread
torch.manual_seed(0)
a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
PER_ROUND = {per_round}
rates = []
with Measuring() as window:
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(PER_ROUND):
            torch.mm(a, b)
        rates.append(64 / (time.perf_counter() - began))  # matmuls of the unslowed round per second
pathlib.Path("metrics").mkdir(exist_ok=True)
record = Spread.of(rates).record("rate_per_s", busy=window.busy)
pathlib.Path("metrics/work.json").write_text(json.dumps(record))
# revision {revision}
"""
DVC_YAML = """stages:
  work:
    cmd: python work.py
    deps: [work.py]
    metrics:
      - metrics/work.json: {cache: false}
"""


def sh(cwd: Path, *cmd: str) -> str:
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def spin() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", type=int, default=10)
    parser.add_argument("--slow-from", type=int, default=6)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--busy", type=int, default=0)
    args = parser.parse_args()

    from dflashpipe.commands.rerun.bisect import bisect, bisect_lines

    with tempfile.TemporaryDirectory(prefix="bisect-bench-") as tmp:
        project = Path(tmp)
        dvc = (sys.executable, "-m", "dvc")
        sh(project, "git", "init", "-q")
        sh(project, "git", "config", "user.email", "bench@example.com")
        sh(project, "git", "config", "user.name", "bench")
        sh(project, *dvc, "init", "-q")
        sh(project, *dvc, "config", "core.analytics", "false")
        (project / "dvc.yaml").write_text(DVC_YAML)
        shas = []
        for revision in range(args.commits + 1):
            per_round = 128 if revision >= args.slow_from else 64
            (project / "work.py").write_text(
                WORK_PY.format(src=str(ROOT / "src"), per_round=per_round, revision=revision)
            )
            if revision in (0, args.commits):
                sh(project, *dvc, "repro", "-q")
            sh(project, "git", "add", "-A")
            sh(project, "git", "commit", "-qm", f"revision {revision}")
            shas.append(sh(project, "git", "rev-parse", "HEAD"))
        neighbours = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
        for n in neighbours:
            n.start()
        began = time.perf_counter()
        try:
            found = bisect("rate_per_s", shas[0], shas[-1], runs=args.runs, root=project)
        finally:
            for n in neighbours:
                n.terminate()
        print("\n".join(bisect_lines(found)))
        print(
            json.dumps(
                {
                    "commits": args.commits,
                    "planted": f"revision {args.slow_from}",
                    "found": found.first.subject if found.first else f"one of {found.ambiguous}",
                    "right": found.first is not None and found.first.sha == shas[args.slow_from],
                    "probes": len(found.probes),
                    "stages_run": sum(p.stages_run for p in found.probes),
                    "seconds": round(time.perf_counter() - began, 1),
                    "busy_neighbours": args.busy,
                    "runs": args.runs,
                }
            )
        )


if __name__ == "__main__":
    main()

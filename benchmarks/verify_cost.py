"""What `explain --verify` costs on docs/incident.md's replay, with this checkout's runner and another's, side by side.

    python benchmarks/verify_cost.py OTHER_CHECKOUT [--rounds 2] [--runs 2]

Each round builds the replay (`tests/test_verify.py`'s `tiny_incident`: four standard-library stages that run in
milliseconds, so what is timed is the runner: its trees, its `dvc` calls, DVC's own work) once per checkout, in a
process of its own with that checkout's `src/` and `tests/`, and times `verify("rows_per_s", "healthy")` there;
the checkouts alternate within each round, so load on the machine falls on both alike. Prints each run's seconds
and what it called each cause, then the ratio of the medians (this checkout over the other).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import json, os, sys, tempfile, time
from pathlib import Path
tree = Path(sys.argv[1])
sys.path[:0] = [str(tree / "src"), str(tree)]
from tests.test_verify import tiny_incident
try:
    from dflashpipe.commands.rerun.verify import verify
except ImportError:  # a checkout from before the runners moved beside explain/
    from dflashpipe.commands.explain.verify import verify
project = tiny_incident(Path(tempfile.mkdtemp(prefix="verify-cost-")) / "project")
began = time.perf_counter()
found = verify("rows_per_s", "healthy", "workspace", project, runs=int(sys.argv[2]), progress=False)
took = time.perf_counter() - began
calls = {i.cause.what: i.call for i in found.interventions if i.call}
print(json.dumps({"seconds": took, "calls": calls, "together": found.together and found.together.call}))
"""


def once(checkout: Path, runs: int) -> dict:
    import json

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-c", ONE, str(checkout), str(runs)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("other", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="--runs of each verify")
    args = parser.parse_args()
    checkouts = {"this": ROOT, "other": args.other.resolve()}
    seconds: dict[str, list[float]] = {name: [] for name in checkouts}
    for round_ in range(args.rounds):
        for name, checkout in checkouts.items():
            found = once(checkout, args.runs)
            seconds[name].append(found["seconds"])
            print(f"round {round_ + 1} {name} ({checkout}): {found['seconds']:.1f} s, {found['calls']}")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = medians["this"] / medians["other"]
    print(f"this / other: {ratio:.2f} (medians {medians['this']:.1f} s and {medians['other']:.1f} s)")


if __name__ == "__main__":
    main()

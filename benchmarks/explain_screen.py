"""How long `dflashpipe explain`'s answer is, scenario by scenario, on a recorded project; and how long it takes.

    python benchmarks/explain_screen.py PROJECT [--src SRC] [--show] [--timing 5] [--fresh-clone REV]

PROJECT is a DVC project whose workspace matches its HEAD but for what the first scenario is about ("as it
is": a fresh clone after `dvc repro`, or bench rerun beside a busy neighbour); the others are made on top of
it and undone after: `seed` (data.num_samples +20% and data/compile moved aside), `patched torch` (the live
check's hash state says torch/fx/_symbolic_trace.py has another digest than its wheel's RECORD, as
tests/test_explain_machine.py makes it; no installed file is touched), `OMP_NUM_THREADS=1` and `OPENBLAS_*
set` (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE; both in explain's environment only), and the incident: the seed, the
patched torch and OMP_NUM_THREADS=1 at once. Each runs the `dflashpipe explain` command of SRC (default: this
checkout's src, or another revision's, to compare) with COLUMNS=100, as a terminal of 100 columns shows it, and
counts its lines.

`--fresh-clone REV` first counts `explain REV`'s lines: the newcomer's screen, with PROJECT's HEAD the commit of
a `dvc repro` made in a clone of REV (so the other scenarios start from a workspace that matches its HEAD).

`--timing N` also times `explain()` in-process N times on the project as it is (after one warm-up call, which
takes the imports), with SRC's code: the median and range, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HASH_STATE = ".dvc/tmp/dflashpipe-installed-files.json"
PATCHED = "torch/fx/_symbolic_trace.py"


@contextmanager
def as_it_is(project: Path):
    yield {}


@contextmanager
def seed(project: Path):
    params = project / "params.yaml"
    text = params.read_text()
    grown = re.sub(r"^(  num_samples: )(\d+)", lambda m: f"{m[1]}{int(m[2]) * 6 // 5}", text, count=1, flags=re.M)
    aside = Path(tempfile.mkdtemp(prefix="explain-screen-")) / "compile"
    params.write_text(grown)
    shutil.move(project / "data/compile", aside)
    try:
        yield {}
    finally:
        params.write_text(text)
        shutil.move(aside, project / "data/compile")


@contextmanager
def patched_torch(project: Path):
    import importlib.metadata as metadata

    state = project / HASH_STATE
    saved = state.read_text()
    hashes = json.loads(saved)
    hashes[str(metadata.distribution("torch").locate_file(PATCHED))][2] = "sha256=" + "A" * 43
    state.write_text(json.dumps(hashes))
    try:
        yield {}
    finally:
        state.write_text(saved)


@contextmanager
def one_thread(project: Path):
    yield {"OMP_NUM_THREADS": "1"}


@contextmanager
def openblas(project: Path):
    """The issue's record made where OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE were set, read the other way round:
    explain run where they are set and the record made without them."""
    yield {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"}


@contextmanager
def incident(project: Path):
    """The seed's whole story: the data grown, the compile cache deleted, a torch file patched, a thread variable
    changed (the four causes tests/test_explain_machine.py holds the first screen to)."""
    with seed(project), patched_torch(project), one_thread(project) as env:
        yield env


SCENARIOS = {
    "as it is": as_it_is,
    "seed": seed,
    "patched torch": patched_torch,
    "OMP_NUM_THREADS=1": one_thread,
    "OPENBLAS_* set": openblas,
    "incident (all four)": incident,
}


def screen(project: Path, src: Path, env: dict[str, str], since: str = "HEAD") -> str:
    full = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", **env}
    code = f"from dflashpipe.cli import app; app(['explain', {since!r}])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=project, env=full, capture_output=True, text=True)
    return proc.stdout + proc.stderr


def timing(project: Path, src: Path, n: int) -> str:
    code = f"""
import statistics, sys, time
sys.path.insert(0, {str(src)!r})
from dflashpipe.commands.explain import explain
explain("HEAD", "workspace", {str(project)!r})
took = []
for _ in range({n}):
    began = time.perf_counter()
    explain("HEAD", "workspace", {str(project)!r})
    took.append(time.perf_counter() - began)
print(f"{{statistics.median(took):.2f}} s (range {{min(took):.2f}}..{{max(took):.2f}}, {n} calls)")
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("project", type=Path)
    parser.add_argument("--src", type=Path, default=ROOT / "src")
    parser.add_argument("--show", action="store_true", help="print each first screen too")
    parser.add_argument("--timing", type=int, default=0)
    parser.add_argument(
        "--fresh-clone",
        metavar="REV",
        help="first, `explain REV`: the commit a clone was made at, where HEAD is that run committed",
    )
    args = parser.parse_args()
    project, src = args.project.resolve(), args.src.resolve()
    print(f"explain of {src} on {project}, 100 columns")
    if args.fresh_clone:
        text = screen(project, src, {}, args.fresh_clone)
        print(f"fresh clone ({args.fresh_clone} -> workspace): {len(text.splitlines())} lines")
        if args.show:
            print(text)
    for name, scenario in SCENARIOS.items():
        with scenario(project) as env:
            text = screen(project, src, env)
        print(f"{name}: {len(text.splitlines())} lines")
        if args.show:
            print(text)
    if args.timing:
        print(f"explain() in-process, the project as it is: {timing(project, src, args.timing)}")


if __name__ == "__main__":
    main()

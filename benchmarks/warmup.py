"""What the warmup artifact buys: the first training step cold vs with data/compile/ loaded,
and a drafter step compiled vs eager. Side by side in one run, as ratios.

    python benchmarks/warmup.py [--steps 5]

Needs `dvc repro warmup` first. Each measurement runs in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def measure(mode: str, steps: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from dflashpipe.compile.artifact import load_artifact, point_inductor_at
    from dflashpipe.compile.warmup import compiled_step, run_step_once
    from dflashpipe.core.params import load_params
    from dflashpipe.core.pipeline import COMPILE, TARGET, reuse_key
    from dflashpipe.model import DFlashDrafter
    from dflashpipe.target.adapter import load_materialised_target
    from dflashpipe.target.dtype import compute_dtype

    p = load_params(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        if mode == "warm":
            # as train does: only an artifact built for warmup's key now (else this raises, naming what changed)
            load_artifact(ROOT / COMPILE, Path(tmp) / "cache", reuse_key("warmup", ROOT))
        else:
            point_inductor_at(tmp)
        target = load_materialised_target(ROOT / TARGET, "cpu", compute_dtype("cpu", "auto"))
        drafter = DFlashDrafter.for_target(
            target, AutoTokenizer.from_pretrained(ROOT / TARGET), p["model"], generator=torch.Generator().manual_seed(0)
        )
        fn = drafter if mode == "eager" else compiled_step(drafter)
        began = time.perf_counter()
        run_step_once(fn, drafter, p["model"], p["compile"].micro_batch, torch.device("cpu"))
        first = time.perf_counter() - began
        began = time.perf_counter()
        for _ in range(steps):
            run_step_once(fn, drafter, p["model"], p["compile"].micro_batch, torch.device("cpu"))
        steady = (time.perf_counter() - began) / steps
    return {"first_step_s": first, "steady_step_s": steady}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(measure(args.mode, args.steps)))
        return
    r = {}
    for mode in ("cold", "warm", "eager"):
        proc = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        r[mode] = json.loads(line[0].removeprefix("RESULT "))
        print(f"{mode:5s} first step {r[mode]['first_step_s']:7.2f} s   steady step {r[mode]['steady_step_s']:.3f} s")
    print(f"first step, cold / with the artifact: {r['cold']['first_step_s'] / r['warm']['first_step_s']:.1f}x")
    print(f"steady step, eager / compiled: {r['eager']['steady_step_s'] / r['warm']['steady_step_s']:.2f}x")


if __name__ == "__main__":
    main()

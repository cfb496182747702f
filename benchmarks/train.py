"""Training throughput, side by side in one run, as ratios.

    python benchmarks/train.py [--steps 8]

Needs the embedded pipeline's inputs (`dvc repro warmup tokenize` first). Runs the train
stage's own function on them, each variant in a fresh process (dynamo state is per process):
  - compiled step (artifact loaded), 2 drafter replicas   <- the default
  - compiled step, 1 drafter replica                     (drafter-worker scaling)
  - eager step, sdpa, guard off, 2 replicas              (what compile buys)
and prints supervised drafter tokens/s for each and the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def variant(name: str, steps: int, out: Path) -> dict:
    from dflashpipe.params import load_params
    from dflashpipe.pipeline import reuse_key
    from dflashpipe.train.loop import TrainInputs
    from dflashpipe.train.stage import TrainPaths, train_drafter

    p = load_params(ROOT)
    compile_on = name != "eager-2"
    drafters = ("cpu",) if name == "compiled-1" else ("cpu", "cpu")
    inputs = TrainInputs(
        model=p["model"],
        compile=dataclasses.replace(p["compile"], enabled=compile_on, guard="error" if compile_on else "warn"),
        topology=dataclasses.replace(p["topology"], drafter_devices=drafters),
        train=dataclasses.replace(p["train"], max_steps=steps, checkpoint_every=0),
    )
    # The project's inputs, fresh outputs; no resume key (a variant always trains every step), and
    # warmup's key as it is now, so the artifact is loaded exactly when the train stage would load it.
    paths = dataclasses.replace(
        TrainPaths.pipeline(ROOT), drafter=out / "drafter", state=out / "state", metrics=out / "metrics"
    )
    return train_drafter(inputs, paths, key=None, compile_key=reuse_key("warmup", ROOT) if compile_on else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        with tempfile.TemporaryDirectory() as tmp:
            print("RESULT " + json.dumps(variant(args.variant, args.steps, Path(tmp))))
        return
    results = {}
    for name in ("compiled-2", "compiled-1", "eager-2"):
        proc = subprocess.run(
            [sys.executable, __file__, "--steps", str(args.steps), "--variant", name],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(line[0].removeprefix("RESULT "))
        m = results[name]
        print(
            f"{name:11s} {m['tokens_per_s']:8.1f} tokens/s  busy target {m['busy_s']['target']:.1f}s "
            f"drafter {m['busy_s']['drafter']:.1f}s  compiles in workers {m['compile']['compiles_in_worker_threads']}"
        )
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    print(f"2 vs 1 drafter replicas: {tps['compiled-2'] / tps['compiled-1']:.2f}x")
    print(f"compiled vs eager (2 replicas): {tps['compiled-2'] / tps['eager-2']:.2f}x")


if __name__ == "__main__":
    main()

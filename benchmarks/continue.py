"""A run continued: what raising train.max_steps retrains, what it saves, and that it ends where a straight run does.

    python benchmarks/continue.py [--short 120] [--long 160] [--tau-seeds 0]

On the default small target (data/target) and params.yaml's data, tokenize, model and train sections (features
online: no features stage to run first), each run the train stage's own function in a fresh process under a key
that leaves out the run's length, as reuse_key("train") does:

1. short: --short steps into a fresh state directory;
2. continued: --long steps on that state directory: it resumes where train/checkpoint.py lets it (wsd: the old
   decay start) and trains the rest;
3. straight: --long steps from step 0.

It prints the steps each trained, the seconds they took (and with loading), and whether the continued drafter's
weights are byte-identical to the straight one's. `--tau-seeds 0 1` also trains --short steps under the cosine
schedule per seed, beside the wsd runs, and prints the held-out simulated tau of each (metrics.json
heldout_acceptance, last): does wsd change it?
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def prepare(work: Path) -> None:
    """The manifest of params.yaml's data, tokenized for the default target, under `work`."""
    from dflashpipe.core.params import load_params
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.tokens.run import tokenize_manifest

    p = load_params(ROOT)
    build_manifest(p["data"], work / "manifest", root=ROOT)
    tokenize_manifest(p["tokenize"], work / "manifest", ROOT / "data" / "target", work / "tokens")


def train_once(work: Path, name: str, steps: int, schedule: str, seed: int) -> None:
    """One train stage run into work/name (its state kept there between calls); prints its metrics."""
    from dflashpipe.core.params import FeaturesParams, load_params
    from dflashpipe.core.pipeline import StageKey
    from dflashpipe.train.stage import TrainPaths, train_drafter
    from dflashpipe.train.state import TrainInputs

    p = load_params(ROOT)
    train = dataclasses.replace(p["train"], max_steps=steps, epochs=0, schedule=schedule, seed=seed)
    inputs = TrainInputs(
        model=p["model"],
        compile=p["compile"],
        topology=p["topology"],
        train=train,
        features=FeaturesParams(mode="online"),
        compute=p["compute"],
    )
    out = work / name
    paths = dataclasses.replace(
        TrainPaths.pipeline(ROOT),
        tokens=work / "tokens",
        drafter=out / "drafter",
        state=out / "state",
        metrics=out / "metrics",
        features=None,
    )
    key = StageKey("train", {"benchmark": json.dumps([schedule, seed, str(work)])})
    metrics = train_drafter(inputs, paths, key, None)
    # the seconds this process's steps took (load and set-up excluded: they do not grow with the steps)
    print("RESULT " + json.dumps({"heldout": metrics["heldout_acceptance"], "steps_s": metrics["balance"]["wall_s"]}))


def run(work: Path, name: str, steps: int, schedule: str = "wsd", seed: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", str(work), name, str(steps), schedule, str(seed)]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - began
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    trained = [ln for ln in proc.stdout.splitlines() if ln.startswith("train: step ")]
    resumed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("train: resumed", "train: not resuming"))]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")).removeprefix("RESULT "))
    return {"steps_trained": len(trained), "seconds": round(seconds, 1), "resume": resumed, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=120)
    parser.add_argument("--long", type=int, default=160)
    parser.add_argument("--tau-seeds", type=int, nargs="*", default=[])
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        work, name, steps, schedule, seed = args.child
        train_once(Path(work), name, int(steps), schedule, int(seed))
        return
    with tempfile.TemporaryDirectory(prefix="continue-") as tmp:
        work = Path(tmp)
        prepare(work)
        short = run(work, "grown", args.short)
        continued = run(work, "grown", args.long)
        straight = run(work, "straight", args.long)
        same = all(
            (work / "grown" / "drafter" / f).read_bytes() == (work / "straight" / "drafter" / f).read_bytes()
            for f in ("model.safetensors",)
        )
        for name, r in (("short", short), ("continued", continued), ("straight", straight)):
            print(
                f"{name:>9}: {r['steps_trained']} steps trained in {r['steps_s']} s ({r['seconds']} s with loading)  "
                + " | ".join(r["resume"])
            )
        print(f"continued == straight, weights byte for byte: {same}")
        saved = straight["steps_s"] - continued["steps_s"]
        print(f"saved: {saved:.1f} s of the straight run's {straight['steps_s']} s")
        for seed in args.tau_seeds:
            taus = {}
            for schedule in ("wsd", "cosine"):
                reused = (schedule, seed) == ("wsd", 0)  # the short run above
                r = short if reused else run(work, f"{schedule}-{seed}", args.short, schedule, seed)
                taus[schedule] = r["heldout"]["last"]["tau"]
            print(f"seed {seed}: held-out tau after {args.short} steps: {json.dumps(taus)}")


if __name__ == "__main__":
    main()

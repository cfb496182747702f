"""Training throughput of this tree against a baseline revision, side by side, as ratios.

    python benchmarks/train.py [--steps 8] [--repeats 3] [--baseline 047eb6f] [--data data]
    python benchmarks/train.py --baseline none     # this tree's variants instead (see below)

Needs the embedded pipeline's inputs in --data: manifest/, target/ and tokens/, and compile/ if it
is to be loaded (`dvc repro tokenize warmup` writes them to data/). Every run is the train stage's own
function, in a fresh process (dynamo state is per process), on the same data for the same steps,
interleaved: before, after, before, after, ...

- after: this working tree, on --data, as its train stage runs by default: on the stored features
  (--data's features/, which the features stage computed once, before: not in these figures) when
  params.yaml says `features.mode: offline`; the compile artifact is loaded when --data is the
  project's data/ and warmup's key still matches it, as the train stage would.
- before: REV's own code (`git archive REV` into a temporary directory, removed after) on the same
  manifest and target; its tokens are made by its own tokenize stage (the command in its dvc.yaml),
  for the shard format may differ between revisions. It compiles cold, in the main thread, before
  the timed steps (the artifact is this tree's).

Each side reports supervised tokens/s (median and min..max over the repeats), target-forward
seconds per supervised token (busy_s.target / supervised tokens), the padding fraction where the
revision records it, and the child's peak RSS; then after / before. Only fields every revision
writes are required.

`--baseline none` runs this tree's variants: compiled step with 2 drafter replicas (the default),
1 replica (drafter-worker scaling), eager sdpa with the guard off (what compile buys).

`--budget` compares the thread budget (dflashpipe.core.threads: each worker thread sets cores / CPU workers
intra-op threads) against none (every thread keeps torch's whole pool), this tree's default training,
interleaved budget, none, budget, none...; each arm loads a compile artifact its own warmup function built
first (at its own thread count), so no timed run compiles. It prints each arm's tokens/s and the
budget / none ratio of each adjacent pair, median (min..max). `--neighbour` runs a busy process beside
every timed run (a matmul loop, torch's default threads); `--omp-passive` sets OMP_WAIT_POLICY=passive
in the children (idle OpenMP threads sleep instead of spinning).

`--features` compares where the target's features come from, this tree only: it computes --data's
features once with the features stage's own function (timed: the first epoch's extra cost, in target
tokens/s), then runs online (the target's forward every step) and offline (the stored features)
interleaved, --repeats times each, on the same data for the same steps: offline / online is what every
epoch after the first gains.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = "047eb6f"
"""The landed main before the throughput work of this round (chunked loss, packing, flat gradients)."""
SHARED_INPUTS = ("manifest", "target", "regenerated")
"""What a revision's tokenize reads, shared with --data where it has it (regenerated/: since the regenerate stage)."""


def no_budget() -> None:
    """The `none` arm: ThreadBudget.apply sets nothing, so every thread keeps torch's default pool."""
    from dflashpipe.core import threads

    threads.ThreadBudget.apply = lambda self, role, device="cpu": 0


def build_artifact(data: Path, variant: str, out: Path) -> None:
    """The `budget`/`none` arm's compile artifact, by this tree's warmup function, at that arm's count."""
    sys.path.insert(0, str(ROOT / "src"))
    from dflashpipe.compile.warmup import build_warmup_artifact
    from dflashpipe.core.params import load_params
    from dflashpipe.core.pipeline import reuse_key
    from dflashpipe.core.threads import training_budget

    if variant == "none":
        no_budget()
    p = load_params(ROOT)
    budget = training_budget(p["topology"].target_devices, p["topology"].drafter_devices)
    build_warmup_artifact(
        p["model"],
        p["compile"],
        data / "target",
        out,
        reuse_key("warmup", ROOT),
        p["compute"].target_dtype,
        devices=p["topology"].drafter_devices,
        threads=budget,
    )


def features_params(variant: str):
    """The features mode of `variant` (imported only here: revisions before the features stage lack it)."""
    from dflashpipe.core.params import FeaturesParams

    return FeaturesParams(mode="offline" if variant == "offline-2" else "online")


def train_once(
    code: Path,
    data: Path,
    steps: int,
    variant: str,
    out: Path,
    compile_dir: Path | None = None,
    features: Path | None = None,
) -> dict:
    """One run of `code`'s train stage function on `data`'s inputs; what every revision reports. `features`:
    the stored features directory, read by the `offline-2` variant (and only then is features.mode set)."""
    sys.path.insert(0, str(code / "src"))
    from dflashpipe.core.params import load_params
    from dflashpipe.core.pipeline import reuse_key
    from dflashpipe.train.stage import TrainPaths, train_drafter
    from dflashpipe.train.state import TrainInputs

    if variant == "none":
        no_budget()
    p = load_params(code)
    compile_on = variant != "eager-2"
    drafters = ("cpu",) if variant == "compiled-1" else ("cpu", "cpu")
    inputs = TrainInputs(
        model=p["model"],
        compile=dataclasses.replace(p["compile"], enabled=compile_on, guard="error" if compile_on else "warn"),
        topology=dataclasses.replace(p["topology"], drafter_devices=drafters),
        train=dataclasses.replace(p["train"], max_steps=steps, checkpoint_every=0),
        **({"features": features_params(variant)} if features else {}),
    )
    paths = dataclasses.replace(
        TrainPaths.pipeline(code),
        tokens=data / "tokens",
        target=data / "target",
        compile=compile_dir or data / "compile",
        drafter=out / "drafter",
        state=out / "state",
        metrics=out / "metrics",
        **({"features": features} if features else {}),
    )
    # No resume key: every run trains every step. Warmup's key as it is now, so the artifact is loaded
    # exactly when the train stage would load it; only for the project's own data/.
    own = (code == ROOT and data == ROOT / "data" and (data / "compile").exists()) or compile_dir is not None
    m = train_drafter(inputs, paths, key=None, compile_key=reuse_key("warmup", ROOT) if compile_on and own else None)
    tokens = m["supervised_tokens"]
    return {
        "tokens_per_s": m["tokens_per_s"],
        "target_s_per_token": m["busy_s"]["target"] / tokens if tokens else None,
        "padding_fraction": m.get("padding_fraction"),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "busy_s": m["busy_s"],
        "compiles_in_worker_threads": m["compile"]["compiles_in_worker_threads"],
        "mfu": (m.get("throughput") or {}).get("mfu"),
        "threads": m.get("threads"),
        "compile_source": m["compile"]["source"],
    }


def child(
    code: Path, data: Path, steps: int, variant: str, extra: tuple[str, ...] = (), env: dict | None = None
) -> dict:
    cmd = [sys.executable, __file__, "--child", str(code), "--data", str(data), "--steps", str(steps), *extra]
    proc = subprocess.run(
        cmd + ["--variant", variant], capture_output=True, text=True, cwd=code, env={**os.environ, **(env or {})}
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not line:
        sys.exit(f"{code} ({variant}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[0].removeprefix("RESULT "))


def export_revision(rev: str, dest: Path, data: Path) -> Path:
    """REV's files in dest, its data/ sharing `data`'s manifest and target, and its own tokens."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True)
    if archive.returncode:
        sys.exit(f"--baseline {rev}: git archive failed: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    (dest / "data").mkdir(exist_ok=True)
    for name in SHARED_INPUTS:
        if (data / name).exists():
            (dest / "data" / name).symlink_to(data / name)
    env = ROOT / "data" / "env"
    if env.exists() and not (dest / "data" / "env").exists():
        (dest / "data" / "env").symlink_to(env)  # the fingerprint the revision's stages read params from
    stage = yaml.safe_load((dest / "dvc.yaml").read_text())["stages"]["tokenize"]
    cmd = shlex.split(stage["cmd"])
    cmd = [sys.executable if cmd[0] == "python" else cmd[0], *cmd[1:]]
    print(f"baseline {rev}: tokenizing with its own code ({' '.join(cmd[1:])})", flush=True)
    proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        sys.exit(f"baseline {rev}: its tokenize stage failed:\n{proc.stderr[-3000:]}")
    return dest / "data"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):10.4g} ({min(values):.4g}..{max(values):.4g})"


def default_variant(data: Path) -> tuple[str, tuple[str, ...]]:
    """How this tree's train stage runs by default: on --data's stored features when params.yaml says offline
    (the features stage paid the target's forward once, before; not in these figures), else online."""
    sys.path.insert(0, str(ROOT / "src"))
    from dflashpipe.core.params import load_params

    if load_params(ROOT)["features"].mode == "offline":
        if not (data / "features").is_dir():
            sys.exit(f"{data}: no features/ for this tree's offline default: run `dvc repro features` first")
        return "offline-2", ("--features-dir", str(data / "features"))
    return "compiled-2", ()


def compare(rev: str, steps: int, repeats: int, data: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        before_root = Path(tmp) / "rev"
        before_data = export_revision(rev, before_root, data)
        sides = {"before": (before_root, before_data, "compiled-2", ()), "after": (ROOT, data, *default_variant(data))}
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for i in range(repeats):
            for name, (code, side_data, variant, extra) in sides.items():
                runs[name].append(child(code, side_data, steps, variant, extra))
                r = runs[name][-1]
                print(
                    f"  repeat {i + 1} {name:6s} {r['tokens_per_s']:8.1f} tok/s  rss {r['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
    after = sides["after"][2]
    print(f"\n{steps} steps x {repeats} repeats each, before = {rev} (online), after = this tree ({after})")
    print("median (min..max)")
    rows = [
        ("supervised tok/s", "tokens_per_s"),
        ("target s / sup. token", "target_s_per_token"),
        ("padding fraction", "padding_fraction"),
        ("peak RSS MB", "peak_rss_mb"),
    ]
    print(f"{'':24s}{'before':>28s}{'after':>28s}  after/before")
    for label, key in rows:
        got = {s: [r[key] for r in runs[s] if r.get(key) is not None] for s in runs}
        cells = [spread(got[s]) if got[s] else f"{'not recorded':>10s}" for s in ("before", "after")]
        ratio = (
            f"{statistics.median(got['after']) / statistics.median(got['before']):.3f}x"
            if got["before"] and got["after"] and statistics.median(got["before"])
            else "-"
        )
        print(f"{label:24s}{cells[0]:>28s}{cells[1]:>28s}  {ratio}")
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["after"], runs["before"], strict=True)]
    print(f"supervised tok/s, after / before in each repeat's pair: {spread(pairs)}")


def variants(steps: int, data: Path) -> None:
    results = {}
    for name in ("compiled-2", "compiled-1", "eager-2"):
        m = results[name] = child(ROOT, data, steps, name)
        print(
            f"{name:11s} {m['tokens_per_s']:8.1f} tokens/s  busy target {m['busy_s']['target']:.1f}s "
            f"drafter {m['busy_s']['drafter']:.1f}s  compiles in workers {m['compiles_in_worker_threads']}"
        )
    tps = {k: v["tokens_per_s"] for k, v in results.items()}
    print(f"2 vs 1 drafter replicas: {tps['compiled-2'] / tps['compiled-1']:.2f}x")
    print(f"compiled vs eager (2 replicas): {tps['compiled-2'] / tps['eager-2']:.2f}x")


ARTIFACTS = ROOT / "benchmarks" / "results" / "budget-artifacts"
"""--budget's compile artifacts are kept here when the directory exists (git-ignored): later runs reuse them."""
NEIGHBOUR = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"
"""A busy neighbour: a matmul loop with torch's default threads."""


def budget_vs_none(steps: int, repeats: int, data: Path, neighbour: bool, omp_passive: bool) -> None:
    env = {"OMP_WAIT_POLICY": "passive"} if omp_passive else {}
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp:
        arms = ("budget", "none")
        if ARTIFACTS.is_dir():  # built by an earlier run of this tree (same code: same key, else it compiles cold)
            tmp = str(ARTIFACTS)
        for arm in arms:  # each arm's kernels, compiled at its own count, before anything is timed
            if (Path(tmp) / arm).is_dir():
                continue
            cmd = [sys.executable, __file__, "--build-artifact", str(Path(tmp) / arm), "--data", str(data)]
            proc = subprocess.run(cmd + ["--variant", arm], capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                sys.exit(f"building the {arm} arm's artifact failed:\n{proc.stderr[-3000:]}")
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for i in range(repeats):
            for arm in arms if i % 2 == 0 else reversed(arms):  # ABBA: a drift in load favours neither
                busy = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if neighbour else None
                try:
                    r = child(ROOT, data, steps, arm, ("--compile-dir", str(Path(tmp) / arm)), env)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
                runs[arm].append(r)
                print(
                    f"  repeat {i + 1} {arm:6s} {r['tokens_per_s']:8.1f} tok/s  "
                    f"busy target {r['busy_s']['target']:.1f}s drafter {r['busy_s']['drafter']:.1f}s  "
                    f"kernels: {r['compile_source'][:40]}",
                    flush=True,
                )
    conditions = ("a busy neighbour (matmul loop)" if neighbour else "no neighbour of ours") + (
        ", OMP_WAIT_POLICY=passive" if omp_passive else ""
    )
    print(f"\n{steps} steps x {repeats} repeats per arm, {conditions}; budget: {runs['budget'][0]['threads']}")
    for arm in arms:
        print(f"{arm:7s} tokens/s {spread([r['tokens_per_s'] for r in runs[arm]])}")
    ratios = [b["tokens_per_s"] / n["tokens_per_s"] for b, n in zip(runs["budget"], runs["none"], strict=True)]
    print(f"budget / none (each repeat's pair): {spread(ratios)}")


def features_side_by_side(steps: int, repeats: int, data: Path) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from dflashpipe.core.params import load_params
    from dflashpipe.features.run import compute_features

    p = load_params(ROOT)
    with tempfile.TemporaryDirectory(prefix="bench-features-", dir=data) as tmp:
        out = Path(tmp) / "features"
        run = compute_features("offline", p["model"], "cpu", data / "tokens", data / "target", out)
        first = run.summary["tokens"] / run.seconds
        print(
            f"features: {run.summary['tokens']} tokens, {run.summary['bytes'] / 1e6:.0f} MB, {run.seconds:.0f} s "
            f"({first:.0f} target tokens/s): the first epoch's extra cost",
            flush=True,
        )
        runs: dict[str, list[dict]] = {"online-2": [], "offline-2": []}
        for i in range(repeats):
            for name in runs:
                runs[name].append(child(ROOT, data, steps, name, ("--features-dir", str(out))))
                r = runs[name][-1]
                print(f"  repeat {i + 1} {name:9s} {r['tokens_per_s']:8.1f} sup. tok/s  busy {r['busy_s']}", flush=True)
    tps = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
    ratios = [off / on for off, on in zip(tps["offline-2"], tps["online-2"], strict=True)]
    print(f"\n{steps} steps x {repeats} repeats, interleaved; median (min..max)")
    for name, values in tps.items():
        print(f"{name:10s} supervised tok/s {spread(values)}")
    print(f"offline / online: {spread(ratios)} (per repeat, side by side)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="git revision, or none (variants only)")
    parser.add_argument("--data", type=Path, default=ROOT / "data", help="holds manifest/, target/, tokens/")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="compiled-2", help=argparse.SUPPRESS)
    parser.add_argument("--compile-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--build-artifact", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--features", action="store_true", help="online vs offline features, this tree")
    parser.add_argument("--features-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget", action="store_true", help="thread budget vs none, side by side")
    parser.add_argument("--neighbour", action="store_true", help="with --budget: a busy process beside each run")
    parser.add_argument("--omp-passive", action="store_true", help="with --budget: OMP_WAIT_POLICY=passive")
    args = parser.parse_args()
    data = args.data.resolve()
    if args.build_artifact:
        build_artifact(data, args.variant, args.build_artifact)
        return
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            result = train_once(
                args.child, data, args.steps, args.variant, Path(tmp), args.compile_dir, args.features_dir
            )
            print("RESULT " + json.dumps(result))
        return
    missing = [name for name in ("manifest", "target", "tokens") if not (data / name).is_dir()]
    if missing:
        sys.exit(f"{data}: no {', '.join(missing)}: run `dvc repro tokenize warmup` first (or pass --data)")
    if args.features:
        features_side_by_side(args.steps, args.repeats, data)
    elif args.budget:
        budget_vs_none(args.steps, args.repeats, data, args.neighbour, args.omp_passive)
    elif args.baseline == "none":
        variants(args.steps, data)
    else:
        compare(args.baseline, args.steps, args.repeats, data)


if __name__ == "__main__":
    main()

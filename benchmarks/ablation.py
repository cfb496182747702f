"""What each lever of the drafter's recipe is worth: one lever at a time, through the pipeline itself.

    python benchmarks/ablation.py --project /path/to/a/clone [--profile profiles/cpu-quality.yaml]
        [--arm NAME:key=value,key=value ...] [--out ablation.json]

Each arm is one `dvc exp run` in --project with its params set (`-S`) on top of params.yaml and the
profile, so every arm runs the same stages for the same budget and an arm's shared stages (manifest,
target, warmup ...) come from DVC's run cache instead of running again. The project's params.yaml and
dvc.lock are put back (git) before each arm: an arm's settings never leak into the next. Run it in a
clone: the workspace's outputs end as the last arm's.

Per arm it reports the quality figures, which do not depend on the machine's load: tau (mean accepted
length per verify step) with its spread over prompts where evaluate records it, slot-1 acceptance,
the final training loss and slot-1 training accuracy, and the wall seconds of the arm (load-dependent:
read it only against the other arms of the same run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

DEFAULT_ARMS = (
    "recipe:",  # the params as they are: every lever at its default
)


def profile_overrides(path: Path) -> list[str]:
    """A profile YAML (sections of params.yaml) as `-S key=value` overrides, lists in flow style."""
    doc = yaml.safe_load(path.read_text()) or {}
    out = []
    for section, values in doc.items():
        for key, value in (values or {}).items():
            text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
            out.append(f"{section}.{key}={text.removesuffix('...').strip()}")
    return out


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"--arm {text!r}: write NAME:key=value,key=value (NAME of letters, digits, - and _)")
    return name, [s for s in sets.split(",") if s]


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def run_arm(project: Path, name: str, overrides: list[str], log: Path) -> dict:
    subprocess.run(["git", "checkout", "HEAD", "--", "params.yaml", "dvc.lock"], cwd=project, check=True)
    cmd = ["dvc", "exp", "run", "-n", f"ablation-{name}-{int(time.time())}"]  # no -f: shared stages come from the cache
    for item in overrides:
        cmd += ["-S", item]
    start = time.perf_counter()
    with log.open("a") as out:
        out.write(f"\n### {name}: {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, cwd=project, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if done.returncode:
        return {"arm": name, "overrides": overrides, "error": f"dvc exp run exited {done.returncode}; see {log}"}
    ev = read_json(project / "metrics" / "detail" / "eval.json") or read_json(project / "metrics" / "eval.json")
    tr = read_json(project / "metrics" / "train" / "metrics.json")
    slots = tr.get("slot_accuracy") or {}
    return {
        "arm": name,
        "overrides": overrides,
        "tau": ev.get("tau"),
        "tau_over_prompts": ev.get("tau_over_prompts"),
        "slot1_acceptance": (ev.get("slot_acceptance") or {}).get("1"),
        "speedup": ev.get("speedup"),
        "train_vs_held_out": ev.get("train_vs_held_out"),
        "final_loss": tr.get("final_loss"),
        "train_slot_accuracy": slots,
        "wall_s": round(wall, 1),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| arm | tau | slot-1 acceptance | speedup | final loss | train acc slot 1 / last | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['arm']} | {r['error']} ||||||")
            continue
        acc = r["train_slot_accuracy"]
        first_last = f"{acc[min(acc)]:.3f} / {acc[max(acc)]:.3f}" if isinstance(acc, dict) and acc else "-"
        lines.append(
            f"| {r['arm']} | {r['tau']} | {r['slot1_acceptance']} | {r['speedup']} | {r['final_loss']} "
            f"| {first_last} | {r['wall_s']} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, required=True, help="a clone of the project with bin/setup run")
    ap.add_argument("--profile", type=Path, help="a profiles/*.yaml applied to every arm")
    ap.add_argument("--arm", action="append", help="NAME:key=value,... (repeatable); default: the params as is")
    ap.add_argument("--out", type=Path, default=Path("ablation.json"))
    args = ap.parse_args()
    base = profile_overrides(args.profile) if args.profile else []
    arms = [parse_arm(a) for a in (args.arm or DEFAULT_ARMS)]
    log = args.out.with_suffix(".log")
    rows = []
    for i, (name, sets) in enumerate(arms, 1):
        print(f"[{i}/{len(arms)}] {name}: {' '.join(sets) or '(as is)'}", file=sys.stderr, flush=True)
        rows.append(run_arm(args.project.resolve(), name, base + sets, log.resolve()))
        args.out.write_text(json.dumps(rows, indent=1) + "\n")  # after every arm: a long run keeps what it has
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()

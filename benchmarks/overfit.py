"""The overfit proof (dflashpipe.proof) with its misaligned arms, at several lengths, as a table.

    python benchmarks/overfit.py [--target data/target] [--samples 4] [--steps 20 40 60]
        [--anchors 256] [--lr 2e-3] [--max-new-tokens 64] [--seq-len 512] [--arms aligned NAME ...] [--work DIR]

(after `dvc repro target`; the data it memorises is made under --work, default benchmarks/results/overfit, keyed by
what it depends on: proof.run.prepared_data). The `proof` stage runs the aligned arm alone and records its tau in
metrics/proof.json; this benchmark adds the arms that break the trainer on purpose (proof.misalign), whose tau must
collapse, and the curve: each `--steps` value resumes the last one's checkpoint and is decoded.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dflashpipe.core.params import load_params  # noqa: E402
from dflashpipe.proof.misalign import MISALIGNMENTS  # noqa: E402
from dflashpipe.proof.run import ALIGNED, ProofRun, memorise  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    params = load_params(ROOT)
    proof = params["proof"]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "data" / "target")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "results" / "overfit")
    parser.add_argument("--samples", type=int, default=proof.samples)
    parser.add_argument("--max-new-tokens", type=int, default=proof.max_new_tokens)
    parser.add_argument("--seq-len", type=int, default=proof.seq_len)
    parser.add_argument("--anchors", type=int, default=proof.num_anchors)
    parser.add_argument("--lr", type=float, default=proof.lr)
    parser.add_argument("--steps", type=int, nargs="+", default=[20, proof.steps, 60])
    parser.add_argument(
        "--arms", nargs="+", default=[ALIGNED, *MISALIGNMENTS], choices=[ALIGNED, *MISALIGNMENTS], help="default: all"
    )
    args = parser.parse_args()
    chosen = {"samples": args.samples, "max_new_tokens": args.max_new_tokens, "seq_len": args.seq_len}
    proof = replace(proof, **chosen, num_anchors=args.anchors, lr=args.lr)
    run = ProofRun.of(proof, params["model"], params["compute"])
    table = {arm: memorise(run, args.target, args.work, args.steps, ROOT, arm) for arm in args.arms}
    out = args.work / "overfit.json"
    out.write_text(json.dumps({"run": asdict(run), "arms": {k: [asdict(c) for c in v] for k, v in table.items()}}))
    block_size = run.model.block_size
    print(
        f"{'arm':<14}{'steps':>6}{'tokens':>9}{'loss':>8}{'train tau':>10}{'tau':>7}{'median':>8}{'acc@1':>7}  verdict"
    )
    for arm, checkpoints in table.items():
        for c in checkpoints:
            print(
                f"{arm:<14}{c.steps:>6}{c.supervised_tokens:>9}{c.final_loss:>8.3f}"
                f"{c.train_acceptance:>10.3f}{c.tau:>7.3f}{c.tau_over_prompts['median']:>8.3f}"
                f"{c.slot_acceptance.get('1', 0):>7.3f}  {c.verdict(block_size)}"
            )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

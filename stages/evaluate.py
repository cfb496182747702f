"""Stage `evaluate`: speculative decoding with data/drafter on the eval split, into metrics/eval.json.

    python stages/evaluate.py      (what dvc.yaml runs; `dvc metrics diff` / `dvc plots diff` compare runs)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.evaluate.evaluation import EvaluateInputs, evaluate_drafter  # noqa: E402
from dflashpipe.stage import run_stage  # noqa: E402


def evaluate(p) -> None:
    inputs = EvaluateInputs(evaluate=p.evaluate, model=p.model, compile=p.compile)
    evaluate_drafter(inputs, "data/drafter", "data/target", "data/manifest", "metrics/train/metrics.json",
                     "data/compile", "metrics")


if __name__ == "__main__":
    run_stage("evaluate", evaluate)

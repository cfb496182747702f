"""Stage `evaluate`: speculative decoding with data/drafter on the eval split, into metrics/eval.json.

python stages/evaluate.py      (what dvc.yaml runs; `dvc metrics diff` / `dvc plots diff` compare runs)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.evaluate.evaluation import EvaluateInputs, evaluate_drafter  # noqa: E402
from dflashpipe.pipeline import COMPILE, DRAFTER, MANIFEST, METRICS, TARGET, TRAIN_METRICS, reuse_key  # noqa: E402
from dflashpipe.stage import run_stage  # noqa: E402


def evaluate(p) -> None:
    inputs = EvaluateInputs(evaluate=p.evaluate, model=p.model, compile=p.compile)
    # warmup's key, as dvc.yaml defines it (and as warmup and train take it): the timed train step loads
    # data/compile only if it was built for this key. Eager needs none (and the key hashes all of data/target).
    compile_key = reuse_key("warmup") if p.compile.enabled else None
    evaluate_drafter(inputs, DRAFTER, TARGET, MANIFEST, TRAIN_METRICS, COMPILE, METRICS, compile_key=compile_key)


if __name__ == "__main__":
    run_stage("evaluate", evaluate)

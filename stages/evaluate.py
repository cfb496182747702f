"""Stage `evaluate`: speculative decoding with data/drafter on the eval split, into metrics/eval.json.

python stages/evaluate.py      (what dvc.yaml runs; `dvc metrics diff` / `dvc plots diff` compare runs)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.pipeline import (  # noqa: E402
    BENCH_METRICS,
    DRAFTER,
    EVAL_PROMPTS,
    MANIFEST,
    METRICS,
    TARGET,
    TOKENS,
    TRAIN_METRICS,
)
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.evaluate.evaluation import EvaluateInputs, evaluate_drafter  # noqa: E402


def evaluate(p) -> None:
    evaluate_drafter(
        EvaluateInputs(evaluate=p.evaluate, compute=p.compute, template_kwargs=p.target.chat_template_kwargs),
        DRAFTER,
        TARGET,
        MANIFEST,
        TRAIN_METRICS,
        BENCH_METRICS,
        METRICS,
        tokens_dir=TOKENS,
        prompts_out=EVAL_PROMPTS,
    )


if __name__ == "__main__":
    run_stage("evaluate", evaluate)

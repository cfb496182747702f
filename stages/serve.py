"""Stage `serve`: vLLM serves data/drafter on evaluate's prompts; what it does beside ours, into metrics/serve.json
(what a sweep compares) and metrics/detail/serve.json.

python stages/serve.py      (what dvc.yaml runs; without the serving environment it records `served: not_run`)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.errors import SourceError  # noqa: E402
from dflashpipe.core.pipeline import (  # noqa: E402
    DRAFTER,
    EVAL_METRICS,
    EVAL_PROMPTS,
    SERVE_DETAIL,
    SERVE_METRICS,
    TARGET,
)
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.serve.served_check import ServeInputs, served_check  # noqa: E402


def serve(p) -> None:
    try:
        evaluation = json.loads(EVAL_METRICS.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{EVAL_METRICS}: not readable ({exc}): run `dvc repro evaluate`") from None
    served_check(
        ServeInputs(serve=p.serve, evaluate=p.evaluate, compute=p.compute),
        DRAFTER,
        TARGET,
        EVAL_PROMPTS,
        evaluation,
        SERVE_METRICS,
        SERVE_DETAIL,
    )


if __name__ == "__main__":
    run_stage("serve", serve)

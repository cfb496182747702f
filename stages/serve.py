"""Stage `serve`: vLLM serves data/drafter on evaluate's prompts; what it does beside ours, into metrics/serve.json.

python stages/serve.py      (what dvc.yaml runs; without the serving environment it records `served: not_run`)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.errors import SourceError  # noqa: E402
from dflashpipe.core.pipeline import DRAFTER, EVAL_DETAIL, MANIFEST, SERVE_METRICS, TARGET  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.serve.served_check import ServeInputs, served_check  # noqa: E402


def serve(p) -> None:
    try:
        evaluation = json.loads(EVAL_DETAIL.read_text(encoding="utf-8"))  # tau and the per-position acceptance
    except (OSError, ValueError) as exc:
        raise SourceError(f"{EVAL_DETAIL}: not readable ({exc}): run `dvc repro evaluate`") from None
    served_check(
        ServeInputs(
            serve=p.serve, evaluate=p.evaluate, compute=p.compute, template_kwargs=p.target.chat_template_kwargs
        ),
        DRAFTER,
        TARGET,
        MANIFEST,
        evaluation,
        SERVE_METRICS,
    )


if __name__ == "__main__":
    run_stage("serve", serve)

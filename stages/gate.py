"""Stage `gate`: the drafter's figures from evaluate and serve against params.yaml's bars, into metrics/gate.json.

python stages/gate.py      (what dvc.yaml runs; with gate.fail false a failed gate is recorded, not raised)
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.artifacts import write_bytes_atomic  # noqa: E402
from dflashpipe.core.errors import SourceError  # noqa: E402
from dflashpipe.core.pipeline import EVAL_METRICS, GATE_METRICS, SERVE_METRICS  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.gate import enforce, quality_gate  # noqa: E402


def read_metrics(path: Path, stage: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SourceError(f"{path}: not readable ({exc}): run `dvc repro {stage}`") from None


def gate(p) -> None:
    serve = read_metrics(SERVE_METRICS, "serve") if p.gate.served_acceptance else None
    metrics, checks = quality_gate(p.gate, read_metrics(EVAL_METRICS, "evaluate"), serve)
    # in the checks' order, the verdict first: what `dvc metrics show` and `dvc exp show` put in front
    write_bytes_atomic(GATE_METRICS, (json.dumps(metrics, indent=2, allow_nan=False) + "\n").encode())
    for check in checks:
        print(check.line(), flush=True)
    print(f"gate: {metrics['gate']}", flush=True)
    enforce(metrics, checks, p.gate.fail)


if __name__ == "__main__":
    run_stage("gate", gate)

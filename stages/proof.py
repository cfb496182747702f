"""Stage `proof`: the overfit proof on data/target, into metrics/proof.json.

python stages/proof.py      (what dvc.yaml runs; `dvc metrics diff` and `dflashpipe history` read its tau)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.pipeline import PROOF_METRICS, TARGET  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.proof.stage import run_proof  # noqa: E402


def proof(p) -> None:
    run_proof(p.proof, p.model, p.compute, TARGET, PROOF_METRICS, template_kwargs=p.target.chat_template_kwargs)


if __name__ == "__main__":
    run_stage("proof", proof)

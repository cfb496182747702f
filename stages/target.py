"""Stage `target`: materialise the frozen target model into data/target/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.target.materialise import materialise_target  # noqa: E402

if __name__ == "__main__":
    run_stage("target", lambda params: materialise_target(params.target, "data/target"))

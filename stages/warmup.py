"""Stage `warmup`: compile the training step once, in one thread, into data/compile/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.compile.warmup import build_warmup_artifact  # noqa: E402
from dflashpipe.stage import run_stage  # noqa: E402

if __name__ == "__main__":
    run_stage("warmup", lambda p: build_warmup_artifact(p.model, p.compile, "data/target", "data/compile"))

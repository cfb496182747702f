"""Stage `tokenize`: render and tokenize the manifest shards into data/tokens/ (reusing unchanged shards).

Named tokens.py, not tokenize.py: Python puts a script's own directory first on sys.path, so a
stages/tokenize.py would shadow the standard library's `tokenize` for every stage script.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.artifacts import write_json_atomic  # noqa: E402
from dflashpipe.stage import run_stage  # noqa: E402
from dflashpipe.tokens import tokenize_manifest, tokenize_metrics  # noqa: E402


def tokenize(params) -> None:
    run = tokenize_manifest(params.tokenize, "data/manifest", "data/target", "data/tokens")
    write_json_atomic("metrics/tokenize.json", tokenize_metrics(run))


if __name__ == "__main__":
    run_stage("tokenize", tokenize)

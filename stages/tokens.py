"""Stage `tokenize`: render and tokenize the manifest shards into data/tokens/ (reusing unchanged shards).

Named tokens.py, not tokenize.py: Python puts a script's own directory first on sys.path, so a
stages/tokenize.py would shadow the standard library's `tokenize` for every stage script.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.metrics import write_metrics  # noqa: E402
from dflashpipe.core.pipeline import REGENERATED, TARGET, TOKENIZE_METRICS, TOKENS, reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.tokens.run import tokenize_manifest, tokenize_metrics  # noqa: E402


def tokenize(params) -> None:
    # The key is what dvc.yaml lists for the stage, less two things (pipeline.REUSE, with the reasons):
    # data/regenerated, because each shard is also keyed by its own input shard's sha256, so growing the
    # data reuses the old shards; and tokenize.num_proc, which never changes a byte of a shard.
    run = tokenize_manifest(
        params.tokenize,
        REGENERATED,
        TARGET,
        TOKENS,
        key=reuse_key("tokenize"),
        template_kwargs=params.target.chat_template_kwargs,
    )
    write_metrics(TOKENIZE_METRICS, tokenize_metrics(run))


if __name__ == "__main__":
    run_stage("tokenize", tokenize)

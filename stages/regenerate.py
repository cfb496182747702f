"""Stage `regenerate`: the target answers every training prompt again, into data/regenerated/ (reusing
unchanged shards); disabled, data/regenerated/ is the manifest's training shards, hard-linked."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.metrics import write_metrics  # noqa: E402
from dflashpipe.core.pipeline import MANIFEST, REGENERATE_METRICS, REGENERATED, TARGET, reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.regenerate.run import regenerate_manifest, regenerate_metrics  # noqa: E402


def regenerate(params) -> None:
    # The key is what dvc.yaml lists for the stage less data/manifest (pipeline.REUSE): each shard is also
    # keyed by its own input shard's sha256, so growing the data answers only the new shards. Disabled,
    # nothing is generated and nothing needs a key.
    p = params.regenerate
    key = reuse_key("regenerate") if p.enabled else None
    run = regenerate_manifest(
        p,
        MANIFEST,
        TARGET,
        REGENERATED,
        key=key,
        target_dtype=params.compute.target_dtype,
        template_kwargs=params.target.chat_template_kwargs,
    )
    write_metrics(REGENERATE_METRICS, regenerate_metrics(run))


if __name__ == "__main__":
    run_stage("regenerate", regenerate)

"""Stage `manifest`: build the training shards and the eval split into data/manifest/, keeping what an
earlier build under the same key (pipeline.REUSE) already holds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.metrics import write_metrics  # noqa: E402
from dflashpipe.core.pipeline import MANIFEST, MANIFEST_METRICS, reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.data.manifest import build_manifest  # noqa: E402
from dflashpipe.data.shards import manifest_metrics  # noqa: E402


def manifest(params) -> None:
    # The key is what dvc.yaml lists for the stage less the sources and data.num_samples (pipeline.REUSE); each
    # source adds its own spec: its shards of an earlier build are kept, so growing the data writes only what was added.
    summary = build_manifest(params.data, MANIFEST, key=reuse_key("manifest"))
    write_metrics(MANIFEST_METRICS, manifest_metrics(summary))


if __name__ == "__main__":
    run_stage("manifest", manifest)

"""Stage `manifest`: build the training shards and the eval split into data/manifest/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.artifacts import write_json_atomic  # noqa: E402
from dflashpipe.data.manifest import build_manifest  # noqa: E402
from dflashpipe.data.shards import manifest_metrics  # noqa: E402
from dflashpipe.stage import run_stage  # noqa: E402


def manifest(params) -> None:
    summary = build_manifest(params.data, "data/manifest")
    write_json_atomic("metrics/manifest.json", manifest_metrics(summary))


if __name__ == "__main__":
    run_stage("manifest", manifest)

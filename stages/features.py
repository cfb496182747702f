"""Stage `features`: the target's hidden states at the drafter's layers, once per token shard (offline mode)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.metrics import write_metrics  # noqa: E402
from dflashpipe.core.pipeline import FEATURES, FEATURES_METRICS, TARGET, TOKENS, reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.features.run import compute_features, features_metrics  # noqa: E402


def features(params) -> None:
    # The key is what dvc.yaml lists for the stage, less data/tokens (each shard is keyed by its own token
    # shard) and the model keys that never reach a hidden state (pipeline.REUSE, with the reasons).
    device = params.topology.target_devices[0]  # the first target device computes them all
    key = reuse_key("features")
    run = compute_features(
        params.features.mode, params.model, device, TOKENS, TARGET, FEATURES, key, params.compute.target_dtype
    )
    write_metrics(FEATURES_METRICS, features_metrics(run))


if __name__ == "__main__":
    run_stage("features", features)

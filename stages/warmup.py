"""Stage `warmup`: compile the training step once, in one thread, into data/compile/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.compile.warmup import build_warmup_artifact  # noqa: E402
from dflashpipe.core.pipeline import COMPILE, TARGET, reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.core.threads import training_budget  # noqa: E402
from dflashpipe.train.topology import check_topology  # noqa: E402


def warmup(p) -> None:
    # The key is taken before the build, over the inputs DVC saw when it decided to run this stage;
    # train and evaluate take the same reuse_key("warmup") and load the artifact only if they are equal.
    # compiled at the intra-op count train's drafter threads will run it at (dflashpipe.core.threads)
    threads = training_budget(p.topology.target_devices, p.topology.drafter_devices)
    check_topology(p.topology)  # compiled where train's drafter replicas run, so those devices must be here
    build_warmup_artifact(
        p.model,
        p.compile,
        TARGET,
        COMPILE,
        reuse_key("warmup"),
        p.compute.target_dtype,
        devices=p.topology.drafter_devices,
        threads=threads,
    )


if __name__ == "__main__":
    run_stage("warmup", warmup)

"""Stage `train`: train the drafter replicas on the target's features into data/drafter/.

One machine:     dvc repro train      (what dvc.yaml runs: python stages/train.py)
Several:         topology.nodes: N, then `dvc repro train` on the head node, which prints the torchrun
                 command each other node runs and trains as rank 0 (train/nodes.py); each process runs
                 params.yaml's topology on its machine, gradients are all-reduced, rank 0 writes the outputs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.core.pipeline import reuse_key  # noqa: E402
from dflashpipe.core.stage import run_stage  # noqa: E402
from dflashpipe.train.nodes import is_worker, launch  # noqa: E402
from dflashpipe.train.stage import TrainPaths, train_drafter  # noqa: E402
from dflashpipe.train.state import TrainInputs  # noqa: E402


def train(p) -> None:
    if p.topology.nodes > 1 and not is_worker():  # DVC started this on the head: run its agent, whose worker trains
        launch(p.topology.nodes, "stages/train.py")
        return
    inputs = TrainInputs(
        model=p.model,
        compile=p.compile,
        topology=p.topology,
        train=p.train,
        features=p.features,
        compute=p.compute,
    )
    # Resume a checkpoint only if everything dvc.yaml lists for train is as it was when it was saved;
    # use the compile artifact only if it was built for warmup's inputs as they are now (each key hashes
    # every file of its deps, data/target included: the warmup one only when it is used).
    compile_key = reuse_key("warmup") if p.compile.enabled else None
    train_drafter(inputs, TrainPaths.pipeline(), key=reuse_key("train"), compile_key=compile_key)


if __name__ == "__main__":
    run_stage("train", train)

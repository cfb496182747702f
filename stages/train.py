"""Stage `train`: train the drafter replicas on the target's features into data/drafter/.

Single process:      python stages/train.py            (what dvc.yaml runs)
Several machines:    torchrun --nnodes N --nproc-per-node 1 --rdzv-endpoint HOST:29500 stages/train.py
                     (each process runs params.yaml's topology on its own machine; gradients are
                     all-reduced across processes; rank 0 writes the outputs)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run the code DVC hashed

from dflashpipe.stage import run_stage  # noqa: E402
from dflashpipe.train.loop import TrainInputs, train_drafter  # noqa: E402


def train(p) -> None:
    inputs = TrainInputs(model=p.model, compile=p.compile, topology=p.topology, train=p.train)
    train_drafter(inputs, "data/tokens", "data/target", "data/compile", "data/drafter", "data/train-state",
                  "metrics/train")


if __name__ == "__main__":
    run_stage("train", train)

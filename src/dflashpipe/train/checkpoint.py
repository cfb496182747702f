"""The resumable checkpoint in data/train-state/checkpoint/, saved under the run's key.

DVC reruns `train` when anything dvc.yaml lists for it changed. A rerun must then train from
step 0, or it would "resume" the finished run of the old inputs at max_steps, train nothing
and hand back the old drafter as the new one. So a checkpoint records the key it was saved
under (`dflashpipe.pipeline.reuse_key("train")` plus the process count, which also decides the
trajectory but is no dvc.yaml input) and is resumed only under an identical key. A run with
no key (None) never resumes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflashpipe.artifacts import atomic_directory, verify_file_listing, write_file_listing, write_json_atomic
from dflashpipe.errors import DflashpipeError
from dflashpipe.pipeline import StageKey
from dflashpipe.train.metrics import StepRecord

if TYPE_CHECKING:
    from dflashpipe.train.loop import Trainer

CHECKPOINT = "checkpoint"
WORLD_SIZE = "run:world_size"


class TrainCheckpointError(DflashpipeError):
    """The resumable checkpoint in data/train-state/ is damaged."""


def checkpoint_key(key: StageKey | None, world_size: int) -> StageKey | None:
    """The stage's key plus the process count (torchrun's WORLD_SIZE): params.yaml sets the replicas of
    one process, so the process count multiplies the global batch and decides the trajectory too."""
    if key is None:
        return None
    return StageKey(key.stage, {**key.inputs, WORLD_SIZE: str(world_size)})


def save_checkpoint(trainer: Trainer, state_dir: Path, key: StageKey | None) -> None:
    """Replica 0's weights and optimizer (every replica is identical), the step, the history and the key."""
    with atomic_directory(state_dir / CHECKPOINT) as tmp:
        trainer.replicas[0].drafter.save_pretrained(tmp / "drafter")
        torch.save(trainer.replicas[0].optimizer.state_dict(), tmp / "optimizer.pt")
        write_json_atomic(
            tmp / "state.json",
            {
                "key": key.to_json() if key is not None else None,
                "step": trainer.step,
                "truncated": trainer.truncated,
                "history": [record.__dict__ for record in trainer.history],
            },
        )
        write_file_listing(tmp)


def verify_checkpoint(path: Path) -> None:
    """Check every file of the checkpoint at `path` against its files.json; raise TrainCheckpointError otherwise."""
    # Written whole or not at all (atomic_directory), so damage here came from outside: say so, never
    # resume from wrong numbers and never silently throw away hours of training either.
    verify_file_listing(
        path,
        f"delete it to start this run from step 0 (`rm -r {path}`); a checkpoint "
        f"is not cached by DVC, so it cannot be restored",
        TrainCheckpointError,
    )


def resume(trainer: Trainer, state_dir: Path, key: StageKey | None) -> bool:
    """Load the checkpoint into every replica if it was saved under `key`; else say why not and return False."""
    from safetensors.torch import load_file

    path = state_dir / CHECKPOINT
    if not path.exists():
        return False
    if key is None:
        print(f"train: not resuming {path}: this run has no key to check it against; training from step 0")
        return False
    verify_checkpoint(path)
    state = json.loads((path / "state.json").read_text())
    why_not = mismatch(StageKey.from_json(state.get("key")), key)
    if why_not:
        print(f"train: not resuming {path}: {why_not}; training from step 0")
        return False
    weights = load_file(path / "drafter" / "model.safetensors")
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    for rep in trainer.replicas:
        rep.drafter.load_state_dict({k: v.to(rep.device) for k, v in weights.items()}, strict=False)
        # A private copy each: load_state_dict keeps same-device tensors as they are, and two
        # optimizers stepping one shared exp_avg would pull the replicas apart.
        rep.optimizer.load_state_dict(copy.deepcopy(optimizer))
    trainer.step, trainer.truncated = state["step"], state["truncated"]
    trainer.history = [StepRecord(**h) for h in state["history"]]
    print(f"train: resumed from {path} at step {trainer.step}")
    return True


def mismatch(recorded: StageKey | None, key: StageKey, shown: int = 3) -> str:
    """Why a checkpoint saved under `recorded` is not this run's ("" when it is), naming what changed."""
    if recorded is None:
        return "it records no key (saved by an older version)"
    changes = key.changes_since(recorded, shown)
    return f"its inputs differ ({changes})" if changes else ""

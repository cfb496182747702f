"""The resumable checkpoint in data/train-state/checkpoint/, saved under the run's key.

DVC reruns `train` when anything dvc.yaml lists for it changed. A rerun must then train from
step 0, or it would "resume" the finished run of the old inputs at max_steps, train nothing
and hand back the old drafter as the new one. So a checkpoint records the key it was saved
under (`dflashpipe.core.pipeline.reuse_key("train")` plus the process count, which also decides the
trajectory but is no dvc.yaml input) and is resumed only under an identical key. A run with
no key (None) never resumes.

This module reads and writes files: `load_checkpoint` hands back what was saved, and the Trainer
loads it into its replicas (`Trainer.restore`); `CheckpointPolicy` says when a run writes one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashpipe.core.artifacts import atomic_directory, verify_file_listing, write_file_listing, write_json_atomic
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.pipeline import StageKey
from dflashpipe.model import DFlashDrafter
from dflashpipe.train.state import StepRecord, TrainState

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


@dataclass
class Checkpoint:
    """What a checkpoint holds: one replica's weights and optimizer state (every replica is identical), and
    the run's state."""

    weights: dict[str, torch.Tensor]
    optimizer: dict
    state: TrainState


def save_checkpoint(
    state: TrainState, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, state_dir: Path, key: StageKey | None
) -> None:
    """One replica's weights and optimizer (every replica is identical), the step, the history and the key."""
    with atomic_directory(state_dir / CHECKPOINT) as tmp:
        drafter.save_pretrained(tmp / "drafter")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        write_json_atomic(
            tmp / "state.json",
            {
                "key": key.to_json() if key is not None else None,
                "step": state.step,
                "truncated": state.truncated,
                "history": [record.__dict__ for record in state.history],
            },
        )
        write_file_listing(tmp)


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a run writes its checkpoint, and of what (torchtitan's CheckpointManager, at a fraction of the size):
    after every `every` steps (train.checkpoint_every; 0: never) and after the last step, which the stage saves
    once its outputs are written (`Trainer.run` says why). Only rank 0 writes: every process holds the same
    weights."""

    state_dir: Path
    key: StageKey | None
    every: int
    writes: bool
    """False on every process but rank 0."""
    state: TrainState
    """The run's state, which the loop advances in place: the one the Trainer holds once it has restored."""
    drafter: DFlashDrafter
    optimizer: torch.optim.Optimizer
    """One replica's (every replica is identical)."""

    def save(self, step: int, last_step: bool) -> None:
        """The checkpoint after `step` steps, when due: every `every` steps, and after the last one."""
        if self.every and self.writes and (last_step or step % self.every == 0):
            save_checkpoint(self.state, self.drafter, self.optimizer, self.state_dir, self.key)


def verify_checkpoint(path: Path) -> None:
    """Check every file of the checkpoint at `path` against its files.json; raise TrainCheckpointError otherwise."""
    # Written whole or not at all (atomic_directory), so damage here came from outside: say so, never
    # resume from wrong numbers and never silently throw away hours of training either. dvc.yaml caches
    # data/train-state, so the copy DVC recorded can be restored.
    verify_file_listing(
        path,
        f"restore the recorded one (`dvc checkout {path.parent}`), or delete it to start this run from "
        f"step 0 (`rm -r {path}`)",
        TrainCheckpointError,
    )


def load_checkpoint(state_dir: Path, key: StageKey | None) -> Checkpoint | None:
    """The checkpoint in `state_dir` if it was saved under `key`; else say why not and return None."""
    from safetensors.torch import load_file

    path = state_dir / CHECKPOINT
    if not path.exists():
        return None
    if key is None:
        print(f"train: not resuming {path}: this run has no key to check it against; training from step 0")
        return None
    verify_checkpoint(path)
    saved = json.loads((path / "state.json").read_text())
    why_not = mismatch(StageKey.from_json(saved.get("key")), key)
    if why_not:
        print(f"train: not resuming {path}: {why_not}; training from step 0")
        return None
    checkpoint = Checkpoint(
        weights=load_file(path / "drafter" / "model.safetensors"),
        optimizer=torch.load(path / "optimizer.pt", weights_only=True),
        state=TrainState(saved["step"], saved["truncated"], [StepRecord(**h) for h in saved["history"]]),
    )
    print(f"train: resumed from {path} at step {checkpoint.state.step}")
    return checkpoint


def mismatch(recorded: StageKey | None, key: StageKey, shown: int = 3) -> str:
    """Why a checkpoint saved under `recorded` is not this run's ("" when it is), naming what changed."""
    if recorded is None:
        return "it records no key (saved by an older version)"
    changes = key.changes_since(recorded, shown)
    return f"its inputs differ ({changes})" if changes else ""

"""The resumable checkpoints in data/train-state/, saved under the run's key.

DVC reruns `train` when anything dvc.yaml lists for it changed. A rerun must then train from
step 0, or it would "resume" the finished run of the old inputs at max_steps, train nothing
and hand back the old drafter as the new one. So a checkpoint records the key it was saved
under and is resumed only under an identical key. The key (`checkpoint_key`) is
`reuse_key("train")`, which leaves out what never moves the weights (pipeline.REUSE says what and why:
the run's length among them), plus the process count, which decides the trajectory but is no dvc.yaml
input, less the CPU thread facts when every device is a GPU. A run with no key (None) never resumes.

The run's length is checked apart: a checkpoint resumes only if every step it trained had the learning
rate this run's schedule gives that step (`lr_mismatch`). Two are kept: `checkpoint/`, the latest, and
`decay-start/`, taken where a wsd schedule starts to decay: every step before it trains at the same lr
whatever max_steps is, so raising max_steps (or epochs) retrains only from the old decay start on, and
lowering it, or another schedule, trains from step 0.

This module reads and writes files: `load_checkpoint` hands back what was saved, and the Trainer
loads it into its replicas (`Trainer.restore`); `CheckpointPolicy` says when a run writes one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflashpipe.core.artifacts import atomic_directory, verify_file_listing, write_file_listing, write_json_atomic
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.pipeline import StageKey
from dflashpipe.model import DFlashDrafter
from dflashpipe.train.state import StepRecord, TrainState

CHECKPOINT = "checkpoint"
DECAY_START = "decay-start"
WORLD_SIZE = "run:world_size"
THREAD_FACTS = "param:data/env/fingerprint.json:threads."


class TrainCheckpointError(DflashpipeError):
    """The resumable checkpoint in data/train-state/ is damaged."""


def checkpoint_key(key: StageKey | None, world_size: int, devices: Sequence[torch.device] = ()) -> StageKey | None:
    """The stage's key plus the process count (torchrun's WORLD_SIZE): params.yaml sets the replicas of
    one process, so the process count multiplies the global batch and decides the trajectory too. When every
    device of the run (`devices`: targets and drafters) is a GPU, the CPU's thread facts (fingerprint
    threads.*) decide no number of it and leave the key."""
    if key is None:
        return None
    inputs = dict(key.inputs)
    if devices and all(d.type == "cuda" for d in devices):
        inputs = {name: value for name, value in inputs.items() if not name.startswith(THREAD_FACTS)}
    return StageKey(key.stage, {**inputs, WORLD_SIZE: str(world_size)})


@dataclass
class Checkpoint:
    """What a checkpoint holds: one replica's weights and optimizer state (every replica is identical), and
    the run's state."""

    weights: dict[str, torch.Tensor]
    optimizer: dict
    state: TrainState


def save_checkpoint(
    state: TrainState,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    state_dir: Path,
    key: StageKey | None,
    name: str = CHECKPOINT,
) -> None:
    """One replica's weights and optimizer (every replica is identical), the step, the history and the key."""
    with atomic_directory(state_dir / name) as tmp:
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


@dataclass
class CheckpointPolicy:
    """When a run writes its checkpoint, and of what (torchtitan's CheckpointManager, at a fraction of the size):
    after every `every` steps (train.checkpoint_every), once `minutes` have passed since the last one
    (train.checkpoint_minutes), and after the last step, which the stage saves once its outputs are written
    (`Trainer.run` says why); with both cadences 0, never. At step `keep_at` (wsd's decay start) it also keeps
    a copy in decay-start/. Only rank 0 writes: every process holds the same weights."""

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
    minutes: float = 0.0
    keep_at: int | None = None
    last_saved: float = field(default_factory=lambda: time.monotonic())

    def save(self, step: int, last_step: bool) -> None:
        """The checkpoint after `step` steps, when due."""
        if not self.writes or not (self.every or self.minutes):
            return
        by_time = self.minutes and time.monotonic() - self.last_saved >= self.minutes * 60
        if last_step or by_time or (self.every and step % self.every == 0):
            save_checkpoint(self.state, self.drafter, self.optimizer, self.state_dir, self.key)
            self.last_saved = time.monotonic()
        if step == self.keep_at:
            save_checkpoint(self.state, self.drafter, self.optimizer, self.state_dir, self.key, DECAY_START)


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


def load_checkpoint(
    state_dir: Path, key: StageKey | None, max_steps: int, lr_at: Callable[[int], float]
) -> Checkpoint | None:
    """The furthest checkpoint in `state_dir` this run may continue: saved under `key`, at most `max_steps` steps
    in, and every step it trained at the lr `lr_at` gives it. Says why of each it passes over; None: none."""
    from safetensors.torch import load_file

    paths = [state_dir / name for name in (CHECKPOINT, DECAY_START) if (state_dir / name).exists()]
    if not paths:
        return None
    if key is None:
        print(f"train: not resuming {paths[0]}: this run has no key to check it against; training from step 0")
        return None
    usable, refused = [], []
    for path in paths:
        verify_checkpoint(path)
        saved = json.loads((path / "state.json").read_text())
        why_not = mismatch(StageKey.from_json(saved.get("key")), key) or lr_mismatch(saved, max_steps, lr_at)
        (refused if why_not else usable).append((path, saved, why_not))
    if not usable:
        for path, _, why_not in refused:
            print(f"train: not resuming {path}: {why_not}; training from step 0")
        return None
    path, saved, _ = max(usable, key=lambda u: u[1]["step"])
    for other, _, why_not in refused:
        print(f"train: not resuming {other}: {why_not}")
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


def lr_mismatch(saved: dict, max_steps: int, lr_at: Callable[[int], float]) -> str:
    """Why the run recorded in `saved` (state.json) is no prefix of a `max_steps` run on the schedule `lr_at`
    ("" when it is): a longer checkpoint, or a step trained at another lr than this run gives it."""
    if saved["step"] > max_steps:
        return f"it trained {saved['step']} steps, this run trains {max_steps}"
    for record in saved["history"]:
        expected = lr_at(record["step"])
        if record["lr"] != expected:
            return (
                f"its step {record['step'] + 1} trained at lr {record['lr']:.6g}, this run's schedule gives "
                f"{expected:.6g} (train.max_steps, epochs or the schedule's params differ)"
            )
    return ""

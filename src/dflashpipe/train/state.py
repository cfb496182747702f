"""What a training run is given (`TrainInputs`) and where it stands (`TrainState`: its step, its records).

The Trainer owns one `TrainState` and advances it once per step; the checkpoint saves and restores exactly
it (beside replica 0's weights and optimizer), and the metrics are read from it, so a resumed run reports
the whole run, not only the steps it trained itself. This module imports nothing else of train/: the loop,
the checkpoint and the metrics all import it, and none of them imports another back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflashpipe.core.params import (
    CompileParams,
    ComputeParams,
    FeaturesParams,
    ModelParams,
    TopologyParams,
    TrainParams,
)
from dflashpipe.model import DraftLoss


@dataclass(frozen=True)
class TrainInputs:
    model: ModelParams
    compile: CompileParams
    topology: TopologyParams
    train: TrainParams
    features: FeaturesParams = FeaturesParams(mode="online")
    compute: ComputeParams = ComputeParams(target_dtype="auto")


@dataclass
class StepRecord:
    step: int
    loss: float
    """Mean over this process's replicas."""
    lr: float
    tokens: int
    """Supervised tokens of the step, over every process."""
    seconds: float
    slot_correct: list[float]
    slot_count: list[float]
    target_busy_s: float
    """Cumulative, over the target workers of this run."""
    drafter_busy_s: float
    """Cumulative, over the drafter replicas of this run."""
    padding_fraction: float = 0.0
    """Pad tokens / all tokens of this process's packed rows this step (every step's rows are the same size)."""
    accepted: float = 0.0
    """Leading right slots summed over this process's blocks (DraftLoss.accepted): simulated verification."""
    blocks: float = 0.0
    """Blocks whose slot 1 is supervised, over this process's replicas (DraftLoss.blocks)."""
    heldout_acceptance: float | None = None
    """Simulated tau on the held-out sequences after this step's update (train.heldout_every); None: not measured."""

    @property
    def acceptance_length(self) -> float:
        """Simulated tau on this step's training blocks (before its update)."""
        return acceptance_length([self])

    @classmethod
    def of(
        cls,
        step: int,
        lr: float,
        losses: Sequence[DraftLoss],
        seconds: float,
        target_busy_s: float,
        drafter_busy_s: float,
        padding_fraction: float = 0.0,
    ) -> StepRecord:
        """One step's record from every replica's loss terms (every process's: train/nodes.every_replica)."""
        correct = torch.stack([o.slot_correct.detach().float().cpu() for o in losses]).sum(0)
        count = torch.stack([o.slot_count.detach().float().cpu() for o in losses]).sum(0)
        loss = float(sum(o.loss.detach().float().cpu() for o in losses) / len(losses))
        accepted, blocks = (
            float(sum(getattr(o, name).detach().float().cpu() for o in losses)) for name in ("accepted", "blocks")
        )
        return cls(
            step=step,
            loss=loss,
            lr=lr,
            tokens=int(count.sum()),
            seconds=seconds,
            slot_correct=correct.tolist(),
            slot_count=count.tolist(),
            target_busy_s=target_busy_s,
            drafter_busy_s=drafter_busy_s,
            padding_fraction=padding_fraction,
            accepted=accepted,
            blocks=blocks,
        )


def simulated_tau(accepted: float, blocks: float) -> float:
    """Accepted slots per block, + 1 for the target's bonus token: what greedy verification would give."""
    return 1 + accepted / max(blocks, 1)


def acceptance_length(records: Sequence[StepRecord]) -> float:
    """Simulated tau over the blocks of `records`."""
    return simulated_tau(sum(h.accepted for h in records), sum(h.blocks for h in records))


@dataclass
class TrainState:
    """The run so far: the next step to train, the sequences cut to seq_len so far, one record per step."""

    step: int = 0
    truncated: int = 0
    history: list[StepRecord] = field(default_factory=list)

"""Which packed rows each step of training takes, in an order that depends only on the seed.

Each epoch's permutation of the sequences (`epoch_order`) is packed into rows of `seq_len` tokens
(dflashpipe.features.packing: whole documents, each seeing only itself; an epoch's last rows may be part-filled).
Step s of the run takes global rows [s*G, (s+1)*G) of the endless stream of packed epochs (G = processes x
drafter replicas x micro_batch); process p's replica r takes its own slice of them. So the data a replica
sees at a step never depends on threads, timing or where a run was resumed: only on the seed, the step and
the sequences' lengths. A run stated in epochs (`run_length`) is as many steps as take those epochs' rows.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params import TrainParams
from dflashpipe.features.packing import pack_rows


@functools.lru_cache(maxsize=4)
def epoch_order(num_sequences: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of one epoch, from the seed and the epoch number alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_sequences, generator=g).numpy()


def held_out(shard_starts: np.ndarray, count: int) -> list[int]:
    """The sequences kept out of training (train.heldout_sequences): the last `count` of the first token shard.
    Growing the data appends shards and never changes the first, and the evaluate stage's training-split
    prompts are the first of its manifest shard, so these are neither."""
    if count == 0:
        return []
    first = int(shard_starts[1]) if len(shard_starts) > 1 else 0
    if count * 2 > first:
        raise ParamsError(
            f"params.yaml: train.heldout_sequences = {count}: the first token shard holds {first} sequences; "
            f"hold out at most half of them"
        )
    return list(range(first - count, first))


def without(lengths: np.ndarray, held: Sequence[int]) -> np.ndarray:
    """`lengths` with the held-out sequences' set to 0: packing skips them, every other index stays put."""
    if not len(held):
        return lengths
    kept = lengths.copy()
    kept[list(held)] = 0
    return kept


@dataclass(frozen=True, eq=False)
class BatchPlan:
    """Which sequences make up each row of each (step, process, replica). Shared by the target threads."""

    lengths: np.ndarray
    """Tokens per sequence (TokenData.lengths)."""
    seq_len: int
    world_size: int
    replicas: int
    micro_batch: int
    seed: int
    _rows_per_epoch: list[int] = field(default_factory=list, init=False, repr=False)
    _packed: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, init=False, repr=False)
    """The last two epochs packed, as (sequences in row order, row bounds): a run's steps only move forward."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def global_batch(self) -> int:
        """Rows per step over every process and replica."""
        return self.world_size * self.replicas * self.micro_batch

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._packed:
            rows = pack_rows(epoch_order(len(self.lengths), self.seed, epoch), self.lengths, self.seq_len)
            bounds = np.cumsum([0] + [len(row) for row in rows])
            self._packed[epoch] = (np.fromiter((i for row in rows for i in row), np.int64), bounds)
            while len(self._packed) > 2:
                del self._packed[next(iter(self._packed))]  # the least recently packed
        return self._packed[epoch]

    def rows_in(self, epochs: int) -> int:
        """Packed rows in the stream's first `epochs` epochs (each epoch's packing differs, so each is counted)."""
        with self._lock:
            while len(self._rows_per_epoch) < epochs:
                self._rows_per_epoch.append(len(self._epoch(len(self._rows_per_epoch))[1]) - 1)
            return sum(self._rows_per_epoch[:epochs])

    def row(self, index: int) -> list[int]:
        """Global row `index` of the endless stream of packed epochs."""
        if not len(self.lengths):
            raise ValueError("no sequences to pack: the token data is empty")
        with self._lock:
            epoch = 0
            while True:
                if epoch == len(self._rows_per_epoch):
                    self._rows_per_epoch.append(len(self._epoch(epoch)[1]) - 1)
                if index < self._rows_per_epoch[epoch]:
                    order, bounds = self._epoch(epoch)
                    return order[bounds[index] : bounds[index + 1]].tolist()
                index -= self._rows_per_epoch[epoch]
                epoch += 1

    def rows(self, step: int, rank: int, replica: int) -> list[list[int]]:
        start = step * self.global_batch + (rank * self.replicas + replica) * self.micro_batch
        return [self.row(k) for k in range(start, start + self.micro_batch)]


@dataclass(frozen=True)
class RunLength:
    """How many steps the run trains and where the count comes from (metrics.json `run_length`)."""

    steps: int
    warmup_steps: int
    epochs: int
    """0: train.max_steps stated the steps."""
    rows: int | None
    """Packed rows in those epochs (None when max_steps stated the steps)."""
    rows_per_step: int
    """compile.micro_batch x drafter replicas x processes."""

    def to_json(self) -> dict:
        source = "train.max_steps" if not self.epochs else "train.epochs: ceil(rows / rows_per_step)"
        return {**dataclasses.asdict(self), "from": source}


def run_length(train: TrainParams, plan: BatchPlan) -> RunLength:
    """The run's steps: train.max_steps, or enough steps to take every row of train.epochs epochs (rounded up: the
    last step's rows may begin the next epoch, so no row of the stated epochs goes untrained)."""
    if not train.epochs:
        return RunLength(train.max_steps, train.for_steps(train.max_steps).warmup_steps, 0, None, plan.global_batch)
    if not int(np.count_nonzero(plan.lengths)):
        raise ParamsError("params.yaml: train.epochs is set, but the token data holds no sequence to train on")
    rows = plan.rows_in(train.epochs)
    steps = -(-rows // plan.global_batch)
    return RunLength(steps, train.for_steps(steps).warmup_steps, train.epochs, rows, plan.global_batch)

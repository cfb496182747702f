"""Token shards in, fixed-shape batches out, in an order that depends only on the seed.

Step s of the run takes global sequence slots [s*G, (s+1)*G) of an endless stream of
epoch permutations (G = processes x drafter replicas x micro_batch); process p's
replica r takes its own slice of them. So the data a replica sees at a step never
depends on threads, timing or where a run was resumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from dflashpipe.tokens.shards import TokenData


@functools.lru_cache(maxsize=4)
def epoch_order(num_sequences: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of one epoch, from the seed and the epoch number alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_sequences, generator=g).numpy()


@dataclass(frozen=True)
class BatchPlan:
    """Which sequences each (step, process, replica) trains on."""

    num_sequences: int
    world_size: int
    replicas: int
    micro_batch: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.replicas * self.micro_batch

    def indices(self, step: int, rank: int, replica: int) -> list[int]:
        start = step * self.global_batch + (rank * self.replicas + replica) * self.micro_batch
        out = []
        for slot in range(start, start + self.micro_batch):
            epoch, i = divmod(slot, self.num_sequences)
            out.append(int(epoch_order(self.num_sequences, self.seed, epoch)[i]))
        return out


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[B, S] long, right-padded with pad_id."""
    loss_mask: torch.Tensor
    """[B, S] long: 1 on supervised (assistant) tokens."""
    attention_mask: torch.Tensor
    """[B, S] long: 1 on real tokens."""
    truncated: int
    """Sequences cut to seq_len."""


def collate(data: TokenData, indices: list[int], seq_len: int, pad_id: int) -> Batch:
    ids = torch.full((len(indices), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((len(indices), seq_len), dtype=torch.long)
    attention = torch.zeros((len(indices), seq_len), dtype=torch.long)
    truncated = 0
    for row, i in enumerate(indices):
        seq_ids, seq_mask = data.sequence(i)
        n = min(len(seq_ids), seq_len)
        truncated += len(seq_ids) > seq_len
        ids[row, :n] = torch.from_numpy(seq_ids[:n])
        mask[row, :n] = torch.from_numpy(seq_mask[:n])
        attention[row, :n] = 1
    return Batch(ids, mask, attention, truncated)

"""Token shards in, packed fixed-shape rows out, in an order that depends only on the seed.

Packing: each epoch's permutation of the sequences is packed into rows of `seq_len` tokens,
first fit over the last OPEN_ROWS rows opened: a sequence goes into the first of those rows
with room for it whole, else it opens a new row (the oldest open row is then closed). A
sequence longer than `seq_len` is cut to it (counted as truncated); no other sequence is ever
split, so every document in a row is whole and sees only itself (the target's block-diagonal
causal mask, the drafter's DFlash mask, both from the rows' `document_ids`). The rest of a row
is padding. Rows keep the order they were opened in; an epoch's last rows may be part-filled.

Step s of the run takes global rows [s*G, (s+1)*G) of the endless stream of packed epochs
(G = processes x drafter replicas x micro_batch); process p's replica r takes its own slice of
them. So the data a replica sees at a step never depends on threads, timing or where a run was
resumed: only on the seed, the step and the sequences' lengths.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflashpipe.errors import ParamsError

if TYPE_CHECKING:  # only an annotation: training imports no pyarrow (the GPU check's machine has none)
    from dflashpipe.tokens.shards import TokenData


OPEN_ROWS = 16
"""Rows a sequence may still be packed into. On the embedded default's chats (mean 1032 tokens) in rows of
2048 (the 8-GPU profile) padding is 50% one sequence a row, 23% next fit (1 open row), 8% at 8, 6% at 16,
4% at 64: 16 is where more open rows stop paying (it costs OPEN_ROWS checks per sequence, once an epoch)."""


@functools.lru_cache(maxsize=4)
def epoch_order(num_sequences: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of one epoch, from the seed and the epoch number alone."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_sequences, generator=g).numpy()


def pack_rows(order: Sequence[int], lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sequence indices per row: `order` packed first fit over the last OPEN_ROWS rows (module docstring)."""
    rows: list[list[int]] = []
    room: list[int] = []  # free tokens of rows[-len(room):], the open ones
    for i in order:
        n = min(int(lengths[i]), seq_len)
        if n == 0:  # held out of training (BatchPlan.held_out), or nothing to train on
            continue
        open_from = len(rows) - len(room)
        for k, free in enumerate(room):
            if n <= free:
                rows[open_from + k].append(int(i))
                room[k] -= n
                break
        else:
            rows.append([int(i)])
            room.append(seq_len - n)
            if len(room) > OPEN_ROWS:
                room.pop(0)
    return rows


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


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[B, S] long: each row's documents one after another, then pad_id."""
    loss_mask: torch.Tensor
    """[B, S] long: 1 on supervised (assistant) tokens."""
    attention_mask: torch.Tensor
    """[B, S] long: 1 on real tokens, 0 on padding."""
    document_ids: torch.Tensor
    """[B, S] long: which document of its row a token belongs to (0, 1, ..); -1 on padding."""
    position_ids: torch.Tensor
    """[B, S] long: a token's position in its own document (0 on padding)."""
    truncated: int
    """Sequences cut to seq_len."""

    @property
    def padding_fraction(self) -> float:
        """Pad tokens / all tokens of the rows."""
        return float((self.attention_mask == 0).sum()) / self.attention_mask.numel()


def collate(data: TokenData, rows: Sequence[Sequence[int]], seq_len: int, pad_id: int) -> Batch:
    """Lay out the sequences of each row (BatchPlan.rows) one after another, cut to seq_len, and pad."""
    shape = (len(rows), seq_len)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    mask = torch.zeros(shape, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    documents = torch.full(shape, -1, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    truncated = 0
    for r, row in enumerate(rows):
        start = 0
        for d, i in enumerate(row):
            seq_ids, seq_mask = data.sequence(i)
            n = min(len(seq_ids), seq_len)
            if start + n > seq_len:
                raise ValueError(f"row {r} of {list(row)}: its sequences hold more than seq_len {seq_len} tokens")
            truncated += len(seq_ids) > seq_len
            end = start + n
            # Widened copies: the stored arrays are narrow, read-only views that torch must not share.
            ids[r, start:end] = torch.from_numpy(seq_ids[:n].astype(np.int64))
            mask[r, start:end] = torch.from_numpy(seq_mask[:n].astype(np.int64))
            attention[r, start:end] = 1
            documents[r, start:end] = d
            positions[r, start:end] = torch.arange(n)
            start = end
    return Batch(ids, mask, attention, documents, positions, truncated)

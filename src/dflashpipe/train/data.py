"""Token shards in, fixed-shape batches out, in an order that depends only on the seed.

Step s of the run takes global sequence slots [s*G, (s+1)*G) of an endless stream of
epoch permutations (G = processes x drafter replicas x micro_batch); process p's
replica r takes its own slice of them. So the data a replica sees at a step never
depends on threads, timing or where a run was resumed.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dflashpipe.artifacts import file_sha256
from dflashpipe.errors import SourceError


@dataclass(frozen=True)
class TokenData:
    """Every training sequence, flat: sequence i is ids[offsets[i]:offsets[i+1]]."""

    ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def supervised_tokens(self) -> int:
        return int(self.loss_mask.sum())


def load_tokens(tokens_dir: Path | str) -> TokenData:
    """Read data/tokens/ (checked against its summary.json) into one flat array."""
    tokens_dir = Path(tokens_dir)
    fix = f"run `dvc checkout {tokens_dir}` or `dvc repro -f tokenize`"
    try:
        summary = json.loads((tokens_dir / "summary.json").read_text())
        entries = [(str(e["file"]), str(e["sha256"])) for e in summary["shards"]]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SourceError(f"{tokens_dir}/summary.json: unreadable or not a tokens summary ({exc!r}): {fix}") from None
    ids, masks, lengths = [], [], []
    for name, sha256 in entries:
        path = tokens_dir / name
        if Path(name).name != name or not path.is_file() or file_sha256(path) != sha256:
            raise SourceError(f"{path}: missing or not the shard summary.json records (sha256): {fix}")
        try:
            table = pq.read_table(path, columns=["input_ids", "loss_mask"])
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise SourceError(f"{path}: not a readable tokens shard ({exc}): {fix}") from None
        for column, out in (("input_ids", ids), ("loss_mask", masks)):
            out.append(table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False))
        lengths.append(table.column("input_ids").combine_chunks().value_lengths().to_numpy(zero_copy_only=False))
    if not lengths or sum(len(x) for x in lengths) == 0:
        raise SourceError(f"{tokens_dir}: no training sequences (see its summary.json skip counts)")
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    return TokenData(np.concatenate(ids).astype(np.int64), np.concatenate(masks).astype(np.int64), offsets)


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
        start, end = int(data.offsets[i]), int(data.offsets[i + 1])
        n = min(end - start, seq_len)
        truncated += (end - start) > seq_len
        ids[row, :n] = torch.from_numpy(data.ids[start:start + n])
        mask[row, :n] = torch.from_numpy(data.loss_mask[start:start + n])
        attention[row, :n] = 1
    return Batch(ids, mask, attention, truncated)

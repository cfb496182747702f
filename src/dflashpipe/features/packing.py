"""Token sequences packed into fixed-shape rows: whole documents, each seeing only itself.

Packing: a sequence of sequences (an epoch's order, or a token shard's) is packed into rows of `seq_len`
tokens, first fit over the last OPEN_ROWS rows opened: a sequence goes into the first of those rows with
room for it whole, else it opens a new row (the oldest open row is then closed). A sequence longer than
`seq_len` is cut to it (counted as truncated); no other sequence is ever split, so every document in a row
is whole and sees only itself (the target's block-diagonal causal mask, the drafter's DFlash mask, both
from the rows' `document_ids`). The rest of a row is padding. Rows keep the order they were opened in.

Train packs its epochs this way (dflashpipe.train.data) and the features stage its token shards, and both
lay the rows out with `collate`: a document's stored features are what the online trainer computes for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:  # only an annotation: training imports no pyarrow (the GPU check's machine has none)
    from dflashpipe.tokens.shards import TokenData


OPEN_ROWS = 16
"""Rows a sequence may still be packed into. On the embedded default's chats (mean 1032 tokens) in rows of
2048 (the 8-GPU profile) padding is 50% one sequence a row, 23% next fit (1 open row), 8% at 8, 6% at 16,
4% at 64: 16 is where more open rows stop paying (it costs OPEN_ROWS checks per sequence, once an epoch)."""


def pack_rows(order: Sequence[int], lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sequence indices per row: `order` packed first fit over the last OPEN_ROWS rows (module docstring)."""
    rows: list[list[int]] = []
    room: list[int] = []  # free tokens of rows[-len(room):], the open ones
    for i in order:
        n = min(int(lengths[i]), seq_len)
        if n == 0:  # held out of training (train.data.without), or nothing to train on
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

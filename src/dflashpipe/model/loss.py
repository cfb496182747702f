"""Same-position labels and the decay-weighted cross-entropy of DFlash blocks."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class DraftLoss(NamedTuple):
    """What one training forward returns (a NamedTuple, so DDP and torch.compile pass it through)."""

    loss: torch.Tensor
    """Scalar: weighted CE summed over supervised slots, divided by the sum of the weights."""
    slot_correct: torch.Tensor
    """[block_size - 1]: supervised slots k = 1.. whose argmax is the label (count, float)."""
    slot_count: torch.Tensor
    """[block_size - 1]: supervised slots k = 1.. (count, float); sum both over steps before dividing."""

    @property
    def slot_accuracy(self) -> torch.Tensor:
        return self.slot_correct / self.slot_count.clamp_min(1)


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights [B, A, block_size - 1] for slots k = 1..block_size-1 (slot 0 is the given anchor).

    Slot k predicts the token at anchor + k. Its weight is validity (a real anchor, a position
    inside the sequence) x loss_mask there x exp(-(k-1)/gamma): early slots decide how many
    drafted tokens are accepted, so they count most.
    """
    seq_len = input_ids.shape[1]
    k = torch.arange(1, block_size, device=input_ids.device)
    positions = anchors[:, :, None] + k  # [B, A, bs-1]
    inside = positions < seq_len
    positions = positions.clamp_max(seq_len - 1)
    flat = positions.flatten(1)
    labels = input_ids.gather(1, flat).view_as(positions)
    supervised = loss_mask.gather(1, flat).view_as(positions).bool()
    decay = torch.exp(-(k - 1).to(torch.float32) / gamma)
    weights = (anchor_valid[:, :, None] & inside & supervised).to(torch.float32) * decay
    return labels, weights


def decay_weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> DraftLoss:
    """CE of logits [B, A, bs-1, V] against labels, weighted and normalised by the weight sum."""
    # At least float32: a bf16 log-softmax over a large vocabulary is too coarse to train on.
    work = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits.flatten(0, -2).to(work), labels.flatten(), reduction="none").view_as(weights)
    weights = weights.to(work)
    # A batch without one supervised slot gives loss 0 (not NaN): nothing to learn, nothing to break.
    loss = (ce * weights).sum() / weights.sum().clamp_min(torch.finfo(work).tiny)
    with torch.no_grad():
        counted = weights > 0
        correct = (logits.argmax(-1) == labels) & counted
        slot_correct = correct.flatten(0, 1).sum(0).to(torch.float32)
        slot_count = counted.flatten(0, 1).sum(0).to(torch.float32)
    return DraftLoss(loss, slot_correct, slot_count)

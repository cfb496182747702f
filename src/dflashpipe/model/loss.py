"""Same-position labels and the decay-weighted cross-entropy of DFlash blocks.

`decay_weighted_loss` is the definition, over a full logits tensor [B, A, bs-1, V].
`chunked_decay_weighted_loss` is what training runs: the same loss, gradients and slot counts
from the hidden states, never holding more than one chunk of rows' logits. At 8 GPUs (1 x 512
anchors x 15 slots, 152K vocabulary) the full fp32 logits alone are 4.7 GB per micro-batch.

Distillation (model.distill) mixes in the target's own prediction for each slot: per row,
(1 - w) x CE(data token) + w x CE(the target's argmax) or w x KL(target || drafter). The
target's logits come from its final hidden states at the slots' positions, through the same
LM head, one chunk at a time like the drafter's.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

LOGITS_CHUNK_BYTES = 128 * 2**20
"""One chunk's fp32 logits (turned into its softmax in place): rows = budget / (4 x vocab). The loss's peak,
measured on the CPU, is 1-2x this budget eager and about 4x it compiled (inductor overlaps two chunks' logits
and softmax), however many rows: at 8 GPUs 35 chunks of 220 rows, ~0.5 GB compiled instead of 4.7 GB."""


class DraftLoss(NamedTuple):
    """What one training forward returns (a NamedTuple, so DDP and torch.compile pass it through)."""

    loss: torch.Tensor
    """Scalar: weighted CE summed over supervised slots, divided by the sum of the weights."""
    slot_correct: torch.Tensor
    """[block_size - 1]: supervised slots k = 1.. whose argmax is the label (count, float)."""
    slot_count: torch.Tensor
    """[block_size - 1]: supervised slots k = 1.. (count, float); sum both over steps before dividing."""
    accepted: torch.Tensor
    """Scalar: over the blocks whose slot 1 is supervised, the leading slots whose argmax is the label (a
    run stops at the first wrong or unsupervised slot), summed: what greedy verification would accept."""
    blocks: torch.Tensor
    """Scalar: the blocks whose slot 1 is supervised (count, float)."""

    @property
    def slot_accuracy(self) -> torch.Tensor:
        return self.slot_correct / self.slot_count.clamp_min(1)

    @property
    def acceptance_length(self) -> torch.Tensor:
        """Simulated tau on the training blocks: accepted slots per block, + 1 for the target's bonus token."""
        return 1 + self.accepted / self.blocks.clamp_min(1)


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    gamma: float,
    document_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights [B, A, block_size - 1] for slots k = 1..block_size-1 (slot 0 is the given anchor).

    Slot k predicts the token at anchor + k. Its weight is validity (a real anchor, a position
    inside the sequence and, in a packed row, inside the anchor's document: `document_ids` [B, S])
    x loss_mask there x exp(-(k-1)/gamma): early slots decide how many drafted tokens are
    accepted, so they count most.
    """
    seq_len = input_ids.shape[1]
    k = torch.arange(1, block_size, device=input_ids.device)
    positions = anchors[:, :, None] + k  # [B, A, bs-1]
    inside = positions < seq_len
    positions = positions.clamp_max(seq_len - 1)
    flat = positions.flatten(1)
    labels = input_ids.gather(1, flat).view_as(positions)
    supervised = loss_mask.gather(1, flat).view_as(positions).bool()
    if document_ids is not None:
        inside = inside & (
            document_ids.gather(1, flat).view_as(positions) == document_ids.gather(1, anchors)[:, :, None]
        )
    decay = torch.exp(-(k - 1).to(torch.float32) / gamma)
    weights = (anchor_valid[:, :, None] & inside & supervised).to(torch.float32) * decay
    return labels, weights


Distill = Literal["none", "argmax", "kl"]


def prediction_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """[B, A, block_size - 1]: where the target predicts slot k's token (anchor + k - 1, the position before
    it), clamped into the row (slots past its end carry no weight)."""
    return (anchors[:, :, None] + torch.arange(block_size - 1, device=anchors.device)).clamp_max(seq_len - 1)


def decay_weighted_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    target_logits: torch.Tensor | None = None,
    distill: Distill = "none",
    distill_weight: float = 0.0,
) -> DraftLoss:
    """CE of logits [B, A, bs-1, V] against labels, weighted and normalised by the weight sum; with
    `distill`, mixed with the target's `target_logits` [B, A, bs-1, V] (module docstring)."""
    # At least float32: a bf16 log-softmax over a large vocabulary is too coarse to train on.
    work = torch.promote_types(logits.dtype, torch.float32)
    flat = logits.flatten(0, -2).to(work)
    ce = F.cross_entropy(flat, labels.flatten(), reduction="none").view_as(weights)
    if distill != "none":
        teacher = target_logits.flatten(0, -2).to(work)
        if distill == "argmax":
            term = F.cross_entropy(flat, teacher.argmax(-1), reduction="none")
        else:
            log_p = teacher.log_softmax(-1)
            term = (log_p.exp() * (log_p - flat.log_softmax(-1))).sum(-1)
        ce = (1 - distill_weight) * ce + distill_weight * term.view_as(weights)
    return _draft_loss((ce * weights.to(work)).sum(), logits.argmax(-1), labels, weights)


def _draft_loss(
    weighted_ce: torch.Tensor, argmax: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> DraftLoss:
    """The loss and slot counts from the weighted CE sum and the argmax [B, A, bs-1]."""
    # A batch without one supervised slot gives loss 0 (not NaN): nothing to learn, nothing to break.
    loss = weighted_ce / weights.sum().to(weighted_ce.dtype).clamp_min(torch.finfo(weighted_ce.dtype).tiny)
    with torch.no_grad():
        counted = weights > 0
        correct = (argmax == labels) & counted
        slot_correct = correct.flatten(0, 1).sum(0).to(torch.float32)
        slot_count = counted.flatten(0, 1).sum(0).to(torch.float32)
        accepted = correct.to(torch.int32).cumprod(-1).sum().to(torch.float32)
        blocks = counted[..., 0].sum().to(torch.float32)
    return DraftLoss(loss, slot_correct, slot_count, accepted, blocks)


def chunk_rows(vocab_size: int) -> int:
    return max(1, LOGITS_CHUNK_BYTES // (4 * vocab_size))


class _ChunkedWeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ weight.T, label_i) and each row's argmax, one chunk of rows at a time.

    The loss is final, so its gradient w.r.t. hidden is known up to the incoming scalar: forward
    computes it, (softmax - onehot) * w @ weight, while each chunk's logits are at hand, and backward
    only scales it. No logits are kept or recomputed: the two matmuls of the unchunked form, one
    chunk of logits in memory. `weight` is the target's frozen LM head: it gets no gradient.

    With `teacher` (the target's final hidden states, one row per row of hidden) each chunk also
    computes the target's logits; the row's soft label becomes (1 - a) x onehot(label) + a x the
    target's onehot(argmax) or softmax, so the gradient stays softmax - soft label."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, rows, teacher=None, distill="none", alpha=0.0):
        work = torch.promote_types(hidden.dtype, torch.float32)
        total = hidden.new_zeros((), dtype=work)
        argmax, grads = [], []
        keep = 1.0 if teacher is None else 1.0 - alpha
        for start in range(0, hidden.shape[0], rows):
            label, w = labels[start : start + rows, None], weights[start : start + rows, None].to(work)
            logits = hidden[start : start + rows] @ weight.t()
            argmax.append(logits.argmax(-1))
            wide = logits.to(work)  # the same tensor when it is float32 already: changed in place below
            del logits
            target = wide.gather(1, label)
            if teacher is not None:
                t_logits = (teacher[start : start + rows] @ weight.t()).to(work)
                if distill == "argmax":
                    t_label = t_logits.argmax(-1, keepdim=True)
                    del t_logits
                    t_target = wide.gather(1, t_label)
                else:
                    log_p = t_logits.log_softmax(-1)
                    del t_logits
                    p = log_p.exp()
                    # sum p log p - sum p z: the KL's terms that do not need the normaliser of z
                    t_target = (p * wide).sum(-1, keepdim=True) - (p * log_p).sum(-1, keepdim=True)
                    del log_p
            top = wide.amax(-1, keepdim=True)
            probs = wide.sub_(top).exp_()
            norm = probs.sum(-1, keepdim=True)
            lse = top + norm.log()
            row = (lse - target) * keep
            probs.div_(norm).scatter_add_(1, label, torch.full_like(target, -keep))
            if teacher is not None:
                row = row + (lse - t_target) * alpha
                if distill == "argmax":
                    probs.scatter_add_(1, t_label, torch.full_like(target, -alpha))
                else:
                    probs.sub_(p.mul_(alpha))
                    del p
            total = total + (row * w).sum()
            grads.append(probs.mul_(w).to(hidden.dtype) @ weight)
            del wide, probs  # before the next chunk's logits exist
        ctx.save_for_backward(torch.cat(grads))
        argmax = torch.cat(argmax)
        ctx.mark_non_differentiable(argmax)
        return total, argmax

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_argmax: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        grad = (grad_hidden.to(grad_total.dtype) * grad_total).to(grad_hidden.dtype)
        return grad, None, None, None, None, None, None, None


def chunked_decay_weighted_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    rows: int | None = None,
    target_hidden: torch.Tensor | None = None,
    distill: Distill = "none",
    distill_weight: float = 0.0,
) -> DraftLoss:
    """`decay_weighted_loss(lm_head(hidden), labels, weights, lm_head(target_hidden), distill, distill_weight)`
    for hidden and target_hidden [B, A, bs-1, H], chunked over rows.

    The logits are computed in the dtype the LM head would run in (autocast's, else its weight's)
    and widened to at least float32 for the CE, as in the unchunked form; the inputs are cast
    before the Function, so its forward and backward (which runs outside autocast) agree. `rows`:
    rows per chunk (default: LOGITS_CHUNK_BYTES' worth; half of it with KL, which holds the target's
    distribution beside the drafter's)."""
    weight = lm_head.weight
    if weight.requires_grad or getattr(lm_head, "bias", None) is not None:
        raise ValueError("the chunked loss takes a frozen LM head without bias (the target's): no grad, no bias")
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    flat = hidden.flatten(0, -2).to(dtype)
    rows = rows or chunk_rows(weight.shape[0])
    if distill == "none":
        total, argmax = _ChunkedWeightedCE.apply(flat, weight.to(dtype), labels.flatten(), weights.flatten(), rows)
    else:
        if target_hidden is None or target_hidden.shape != hidden.shape:
            raise ValueError(f"distill {distill!r} needs the target's hidden states, shaped like hidden {hidden.shape}")
        teacher = target_hidden.flatten(0, -2).to(dtype)
        rows = max(1, rows // 2) if distill == "kl" else rows
        total, argmax = _ChunkedWeightedCE.apply(
            flat, weight.to(dtype), labels.flatten(), weights.flatten(), rows, teacher, distill, distill_weight
        )
    return _draft_loss(total, argmax.view_as(labels), labels, weights)

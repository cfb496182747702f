"""Anchor sampling: where each training block starts, resampled every step."""

from __future__ import annotations

import torch


def anchor_candidates(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[B, S] bool: positions whose token and next token are both supervised (and, in a packed row,
    of the same document).

    The anchor token is given to the drafter and slot 1 predicts the next token, so a
    block is worth training only if at least its first prediction is supervised.
    """
    supervised = loss_mask.bool()
    candidates = torch.zeros_like(supervised)
    candidates[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    if document_ids is not None:
        candidates[:, :-1] &= document_ids[:, :-1] == document_ids[:, 1:]
    return candidates


def sample_anchor_positions(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator, document_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` distinct candidate positions per sequence, uniformly at random, sorted.

    Returns (anchors [B, A] long, valid [B, A] bool). A sequence with fewer candidates
    gets its real anchors first and padding anchors (position 0, valid False) after them,
    so shapes stay static; padding blocks carry no loss. The same generator state gives
    the same anchors on any device: the random numbers are drawn on the generator's device.
    """
    candidates = anchor_candidates(loss_mask, document_ids).to(generator.device)
    batch, seq_len = candidates.shape
    scores = torch.rand(batch, seq_len, generator=generator, device=generator.device)
    # Scores lie in [0, 1), so every candidate outranks every non-candidate.
    scores = torch.where(candidates, scores, torch.full_like(scores, -1.0))
    k = min(num_anchors, seq_len)
    top = scores.topk(k, dim=1).indices
    valid = candidates.gather(1, top)
    # Sort real anchors ascending and push padding behind them (seq_len sorts last).
    positions, order = torch.where(valid, top, torch.full_like(top, seq_len)).sort(dim=1)
    valid = valid.gather(1, order)
    positions = torch.where(valid, positions, torch.zeros_like(positions))
    if k < num_anchors:
        pad = num_anchors - k
        positions = torch.cat([positions, positions.new_zeros(batch, pad)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(batch, pad)], dim=1)
    return positions.to(loss_mask.device), valid.to(loss_mask.device)

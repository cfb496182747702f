"""Parity: before its first step, train checks that what the drafter learns from is what decoding will feed it.

For the first PARITY_SEQUENCES training sequences it rebuilds decoding's side, as evaluate and the served check run
it (target.prefill over the sequence's own ids, the drafter's context encoded from the features strictly before an
anchor, one block drafted after it), and compares it with what training hands the drafter for the same tokens:
1. features: training's (data/features offline, the trainer's target pass online) against the prefill's, in the
   one compute dtype, within FEATURE_TOLERANCE of their largest magnitude;
2. labels: each supervised slot's label (block_labels) is the token decoding verifies in that slot;
3. the block: the training forward's logits (the training mask over the packed row) against decoding's, for the
   drafter as built, within LOGIT_TOLERANCE of their largest magnitude.
A mismatch fails the stage before any step, naming the sequence, the position and both tokens; the figures are
train's record's `parity`. The published misalignments (a layer tapped one off, labels shifted by one, a block that
sees its own anchor) each fail it (tests/test_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflashpipe.core.errors import DflashpipeError

if TYPE_CHECKING:
    from dflashpipe.train.loop import Trainer

PARITY_SEQUENCES = 2
ANCHORS = 8
"""Anchors per sequence, spread over its supervised positions."""
FEATURE_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
"""Of the features' largest magnitude: a packed row and a lone prompt run other kernels (one rounding's worth in
bfloat16, a few float32 ulps per layer); a layer one off differs by tens of percent."""
LOGIT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}


class ParityError(DflashpipeError):
    """What training hands the drafter differs from what decoding will: no step is trained on it."""


@dataclass
class Parity:
    sequences: int = 0
    anchors: int = 0
    tokens: int = 0
    labels_checked: int = 0
    feature_gap: float = 0.0
    """The largest features difference, over their largest magnitude."""
    logit_gap: float = 0.0
    """The largest block-logits difference, over their largest magnitude."""
    dtype: str = "float32"
    checked: bool = True
    """False only where the proof trains a misaligned arm on purpose."""

    def to_json(self) -> dict:
        if not self.checked:
            return {"passed": None}
        dtype = self.dtype
        return {
            "sequences": self.sequences,
            "anchors": self.anchors,
            "tokens": self.tokens,
            "labels_checked": self.labels_checked,
            "feature_gap": round(self.feature_gap, 6),
            "logit_gap": round(self.logit_gap, 6),
            "tolerance": {
                "features": FEATURE_TOLERANCE[dtype],
                "logits": LOGIT_TOLERANCE[dtype],
            },
            "dtype": self.dtype,
            "passed": True,
        }


def parity_anchors(loss_mask: torch.Tensor, count: int = ANCHORS) -> torch.Tensor:
    """[count] positions spread over those whose token and next token are supervised (where training anchors)."""
    candidates = torch.nonzero(loss_mask[:-1].bool() & loss_mask[1:].bool()).flatten()
    if not len(candidates):
        return candidates
    picks = torch.linspace(0, len(candidates) - 1, min(count, len(candidates))).round().long()
    return candidates[picks].unique()


def check_parity(trainer: Trainer) -> Parity:
    """Parity on the trainer's first PARITY_SEQUENCES sequences, its drafter as built and its first target."""
    from dflashpipe.features.packing import collate
    from dflashpipe.model import drafter as drafter_module  # by module: what a misalignment patches is checked
    from dflashpipe.target.prefill import prefill

    drafter, target, data, model = trainer.replicas[0].drafter, trainer.targets[0], trainer.data, trainer.inputs.model
    dtype = drafter.feature_dtype
    parity = Parity(dtype=str(dtype).removeprefix("torch."))
    layer_ids = list(drafter.config.target_layer_ids)
    bs = drafter.config.block_size
    for i in range(min(PARITY_SEQUENCES, len(data))):
        batch = collate(data, [[i]], model.seq_len, trainer.pad_id)
        length = int(batch.document_ids[0].ge(0).sum())
        ids, mask = batch.input_ids[0, :length], batch.loss_mask[0, :length]
        anchors = parity_anchors(mask)
        if not len(anchors):
            continue
        with torch.no_grad():
            trained = trainer.target_side([[i]], batch, anchors[None])[0].to("cpu", dtype)[0, :length]
            decoded = prefill(target, ids.tolist(), layer_ids).features[0].to("cpu", dtype)
            parity.feature_gap = max(parity.feature_gap, _features(i, ids, trained, decoded))
            valid = torch.ones(1, len(anchors), dtype=torch.bool)
            labels, weights = drafter_module.block_labels(
                batch.input_ids, batch.loss_mask, anchors[None], valid, bs, 1.0, batch.document_ids
            )
            parity.labels_checked += _labels(i, ids, anchors, labels[0], weights[0])
            device = drafter.fc.weight.device
            hidden = drafter.block_hidden(trained[None].to(device), ids[None].to(device), anchors[None].to(device))
            for j, anchor in enumerate(anchors.tolist()):
                context = drafter.encode_context(trained[None, :anchor].to(device))
                drafted = drafter.draft_logits(context, ids[anchor].view(1).to(device))[0]
                training = drafter.logits(hidden[0, j, 1:])
                parity.logit_gap = max(parity.logit_gap, _block(i, anchor, training, drafted))
        parity.sequences += 1
        parity.anchors += len(anchors)
        parity.tokens += length
    return parity


def _relative_gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """The largest |a - b| over b's largest magnitude, and the row (first index) where it is."""
    diff = (a.float() - b.float()).abs()
    scale = max(float(b.float().abs().max()), 1e-12)
    per_row = diff.flatten(1).max(dim=1).values if diff.dim() > 1 else diff
    row = int(per_row.argmax())
    return float(per_row[row]) / scale, row


def _features(seq: int, ids: torch.Tensor, trained: torch.Tensor, decoded: torch.Tensor) -> float:
    gap, position = _relative_gap(trained, decoded)
    tolerance = FEATURE_TOLERANCE[str(trained.dtype).removeprefix("torch.")]
    if gap > tolerance:
        raise ParityError(
            f"parity: training sequence {seq}, position {position} (token {int(ids[position])}): the features "
            f"training reads differ from decoding's by {gap:.3g} of their magnitude (tolerance {tolerance}): the "
            f"trainer taps other target layers or another pass than decoding; no step was trained"
        )
    return gap


def _labels(seq: int, ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> int:
    checked = 0
    for j, anchor in enumerate(anchors.tolist()):
        for k in range(labels.shape[-1]):
            position = anchor + 1 + k
            if weights[j, k] <= 0 or position >= len(ids):
                continue
            checked += 1
            if int(labels[j, k]) != int(ids[position]):
                raise ParityError(
                    f"parity: training sequence {seq}, position {position}: slot {k + 1} after anchor {anchor} learns "
                    f"token {int(labels[j, k])} but decoding verifies token {int(ids[position])} there; no step was "
                    f"trained"
                )
    return checked


def _block(seq: int, anchor: int, training: torch.Tensor, drafted: torch.Tensor) -> float:
    gap, slot = _relative_gap(training, drafted)
    tolerance = LOGIT_TOLERANCE[str(drafted.dtype).removeprefix("torch.")]
    if gap > tolerance:
        raise ParityError(
            f"parity: training sequence {seq}, position {anchor + 1 + slot}: the block after anchor {anchor} drafts "
            f"token {int(training[slot].argmax())} in training and {int(drafted[slot].argmax())} in decoding (logits "
            f"{gap:.3g} of their magnitude apart, tolerance {tolerance}): the training mask shows the block another "
            f"context than decoding does; no step was trained"
        )
    return gap

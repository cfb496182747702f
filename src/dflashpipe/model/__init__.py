"""The DFlash drafter: architecture, mask, attention backends, loss, anchors, checkpoint format."""

from dflashpipe.model.anchors import sample_anchor_positions
from dflashpipe.model.config import DFlashConfig
from dflashpipe.model.drafter import DFlashDrafter, DraftContext, StepInputs, TargetHead
from dflashpipe.model.loss import DraftLoss
from dflashpipe.model.mask import dflash_mask_mod
from dflashpipe.model.target_layers import spaced_target_layer_ids, target_features

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DraftContext",
    "DraftLoss",
    "StepInputs",
    "TargetHead",
    "dflash_mask_mod",
    "sample_anchor_positions",
    "spaced_target_layer_ids",
    "target_features",
]

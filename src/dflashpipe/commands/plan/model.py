"""The run's models as the stages build them, on the meta device: the target from its config, and the drafter
sized for it by the class train trains. An 8B target costs no memory here, and the FLOPs of a training row are
counted by train/flops.py, so a plan and a train run's metrics count alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dflashpipe.core.params import ComputeParams, ModelParams
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.model.attention import resolve_backend
from dflashpipe.model.config import DFlashConfig, text_config
from dflashpipe.target.dtype import compute_dtype
from dflashpipe.train.flops import side_flops, target_forward_flops

BYTES = {"bfloat16": 2, "float32": 4}


class ShapesOnlyDrafter(DFlashDrafter):
    """The drafter's modules with no values: nothing to initialise, and no final norm to check against the
    target's (that check computes on real weights)."""

    def _init_weights(self, generator: torch.Generator | None) -> None:
        pass

    def _copy_final_norm(self, final_norm: torch.nn.Module) -> None:
        pass


@dataclass(frozen=True)
class Models:
    """The target and one drafter replica, shapes only."""

    target: torch.nn.Module
    drafter: DFlashDrafter

    @classmethod
    def build(cls, config: Any, model: ModelParams) -> Models:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            target = AutoModelForCausalLM.from_config(config)
            drafter = ShapesOnlyDrafter(
                DFlashConfig.for_target(config, model, mask_token_id=0),  # its value changes no shape
                TargetHead.of(target),
                attention="sdpa",  # a module choice made per call; the weights are the same
                final_norm=model.final_norm,  # trained or not: one of the drafter's parameters
                distill=model.distill,
            )
        return cls(target, drafter)


@dataclass(frozen=True)
class Shapes:
    """What memory and time are computed from: parameter counts, widths and one training row's FLOPs."""

    target_params: int
    """Every weight of the target: a target worker loads it whole."""
    head_params: int
    """The embedding, final norm and LM head that every drafter device borrows from the target."""
    drafter_params: int
    """The drafter's trained weights (fp32, each with a gradient and two AdamW moments)."""
    target_flops: int
    """One row of `model.seq_len` tokens through the target (train's FLOP convention)."""
    drafter_flops: int
    """One row's drafter forward and backward."""
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tapped: int
    """Target layers whose hidden states feed the drafter."""
    drafter_layers: int
    target_dtype: str
    """What the target computes in on its devices (compute.target_dtype): the features' dtype too."""
    drafter_dtype: str
    """What the drafter's matmuls run in: bf16 autocast on CUDA, float32 on a CPU."""
    attention: str
    """The drafter's attention backend on its devices (model.attention)."""

    @classmethod
    def of(
        cls, models: Models, model: ModelParams, compute: ComputeParams, target_device: str, drafter_device: str
    ) -> Shapes:
        text = text_config(models.target.config)
        config = models.drafter.config
        head = TargetHead.of(models.target)
        borrowed = {id(p): p for m in (head.embed_tokens, head.final_norm, head.lm_head) for p in m.parameters()}
        target_flops, drafter_flops = side_flops(model, models.drafter, models.target)
        drafter_type = torch.device(drafter_device).type
        return cls(
            target_params=sum(p.numel() for p in models.target.parameters()),
            head_params=sum(p.numel() for p in borrowed.values()),  # a tied head is the embedding: once
            drafter_params=sum(p.numel() for p in models.drafter.parameters() if p.requires_grad),
            target_flops=target_flops,
            drafter_flops=drafter_flops,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab=text.vocab_size,
            tapped=len(config.target_layer_ids),
            drafter_layers=config.num_layers,
            target_dtype=planned_target_dtype(target_device, compute.target_dtype),
            drafter_dtype="bfloat16" if drafter_type == "cuda" else "float32",
            attention=resolve_backend(model.attention, torch.device(drafter_device)),
        )


def planned_target_dtype(device: str, choice: str) -> str:
    """The dtype the target will compute its batched work in on a planned device. A plan is made on any machine
    for devices it may not have, so a GPU's is not probed here: every GPU in devices.PUBLISHED computes bfloat16
    (Ampere or later), which is what `auto` resolves to there; a CPU is this machine, resolved as a stage would."""
    if torch.device(device).type == "cuda":
        return "float32" if choice == "float32" else "bfloat16"
    return str(compute_dtype(device, choice)).removeprefix("torch.")


def whole_forward_flops(models: Models, seq_len: int) -> int:
    """One row through every decoder layer of the target (a serving engine's prefill runs them all)."""
    return target_forward_flops(models.target, (text_config(models.target.config).num_hidden_layers - 1,), seq_len)


def feature_bytes_per_token(sh: Shapes, model: ModelParams) -> float:
    """What a target hands a drafter per token of a row (and what the features stage stores): the tapped layers'
    hidden states, and when distilling the target's final hidden state at each drafted slot."""
    per_token = sh.tapped * sh.hidden * BYTES[sh.target_dtype]
    if model.distill != "none":
        per_token += model.num_anchors * (model.block_size - 1) * sh.hidden * BYTES[sh.target_dtype] / model.seq_len
    return per_token

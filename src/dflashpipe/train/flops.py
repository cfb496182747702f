"""Training throughput: model FLOPs per sequence on each side and per step, achieved FLOP/s and MFU.

The convention (what is counted, and why causal attention counts half) is docs/throughput.md; the formulas
are checked against torch's own FLOP counter in tests/test_train.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflashpipe.core.devices import peak_bf16_flops
from dflashpipe.core.params import ModelParams
from dflashpipe.train.state import StepRecord, TrainInputs
from dflashpipe.train.topology import Topology


def device_peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s; None for a CPU or a GPU not in dflashpipe.core.devices."""
    return peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def linear_params(module: torch.nn.Module) -> int:
    """Weights that multiply activations: every nn.Linear's (2 FLOPs per weight per token)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def target_forward_flops(target: torch.nn.Module, target_layer_ids: Sequence[int], seq_len: int) -> int:
    """One sequence through decoder layers 0..max(ids): 2 x matmul weights x S, plus causal attention
    2 x S^2 x width per layer (QK^T and AV, 2 x 2 x S^2 x width, halved by the causal mask)."""
    layers = target.model.layers[: max(target_layer_ids) + 1]
    return sum(
        2 * linear_params(layer) * seq_len + 2 * seq_len**2 * layer.self_attn.q_proj.out_features for layer in layers
    )


def drafter_forward_flops(drafter: torch.nn.Module, seq_len: int, num_anchors: int) -> int:
    """One sequence's training forward: fc over S context tokens; per layer its matmuls over the A x bs
    block tokens, K and V of the S context tokens, and attention of A x bs queries over S + A x bs keys
    (dense, as sdpa computes it); the LM head over the A x (bs - 1) drafted slots."""
    bs = drafter.config.block_size
    queries = num_anchors * bs
    fc = 2 * drafter.fc.weight.numel() * seq_len
    layers = sum(
        2 * linear_params(layer) * queries
        + 2 * (layer.self_attn.k_proj.weight.numel() + layer.self_attn.v_proj.weight.numel()) * seq_len
        + 4 * queries * (seq_len + queries) * layer.self_attn.q_proj.out_features
        for layer in drafter.layers
    )
    head = 2 * drafter.target.lm_head.weight.numel() * num_anchors * (bs - 1)
    return fc + layers + head


def side_flops(model: ModelParams, drafter: torch.nn.Module, target: torch.nn.Module) -> tuple[int, int]:
    """One sequence's model FLOPs on each side of training: the target's forward, and the drafter's forward and
    backward. Distilling runs the target through its last layer, and its LM head (forward only) on the drafted
    slots, inside the drafter's loss. `drafter`: one replica; `target`: one target copy (dflashpipe plan passes
    shapes-only copies of both)."""
    distilling = model.distill != "none"
    through = (drafter.config.num_target_layers - 1,) if distilling else drafter.config.target_layer_ids
    target_side = target_forward_flops(target, through, model.seq_len)
    drafter_side = 3 * drafter_forward_flops(drafter, model.seq_len, model.num_anchors)
    if distilling:
        drafter_side += 2 * drafter.target.lm_head.weight.numel() * model.num_anchors * (model.block_size - 1)
    return target_side, drafter_side


def throughput(
    inputs: TrainInputs,
    topology: Topology,
    drafter: torch.nn.Module,
    target: torch.nn.Module,
    steady: Sequence[StepRecord],
) -> dict:
    """Model FLOPs per step (every process), achieved FLOP/s over the steady steps, and MFU where every device's
    peak is known. `drafter`: one replica; `target`: one target copy; `steady`: the run's records less its first
    step when it has more than one."""
    p = inputs
    sequences = p.compile.micro_batch * topology.replicas * topology.world_size
    per_step = sequences * sum(side_flops(p.model, drafter, target))
    seconds = sum(h.seconds for h in steady)
    achieved = per_step * len(steady) / seconds if seconds > 0 else 0.0
    peaks = [device_peak_flops(d) for d in {*topology.targets, *topology.drafters}]
    peak = sum(peaks) * topology.world_size if peaks and None not in peaks else None
    return {
        "flops_per_step": per_step,
        "flops_per_s": float(f"{achieved:.4g}"),
        "peak_flops_per_s": peak,
        "mfu": round(achieved / peak, 4) if peak else None,
    }

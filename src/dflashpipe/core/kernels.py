"""Products whose best form on the CPU is not the one torch picks: chosen by measurement, applied in one place.

`RowsFirstLinear`: a linear layer over the few rows that decoding feeds it (a decode step's batch of replies,
a verify step's block, a drafter's slots). torch's linear takes x @ W.T, and on this project's 2-core CPU
(torch 2.13, float32) that kernel is slow at 2 to 64 rows: a 49152 x 576 LM head took 12-23 ms on 2-8 rows
where weight @ x.T took 2.5-5.8 ms. One row goes to a matrix-vector kernel slower still: the same product
over the row twice takes less. SmolLM2-135M's decode step went from 39 to 22 ms, its decoder over 2 or 4
positions from 46-49 ms to 29-30 ms (benchmarks/evaluate.py --parts). From a few hundred rows on the two
forms are equal, and gradients keep torch's own path, so training and features compute as before.
"""

from __future__ import annotations

import torch

FEW_ROWS = 64
"""Up to this many rows, the rows-first form (measured faster at 2-64 rows, equal from 128 on)."""


class RowsFirstLinear(torch.nn.Linear):
    """nn.Linear computing weight @ x.T for few rows on the CPU without gradients; torch's linear otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if (
            rows > FEW_ROWS
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])
        # one row would go to a matrix-vector kernel, slower than this one on that row twice
        out = (self.weight @ (torch.cat([flat, flat]) if rows == 1 else flat).t())[:, :rows].t()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def rows_first(module: torch.nn.Module) -> torch.nn.Module:
    """Every plain nn.Linear of `module` computes as RowsFirstLinear from now on (the same parameters, so the
    same state dict and the same borrowers: a drafter holding the target's LM head gets it too)."""
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = RowsFirstLinear
    return module


def bfloat16_native(device_type: str) -> bool:
    """Whether a device of this type computes bfloat16 in hardware: a CUDA GPU that supports it, or a CPU with
    AMX or AVX512-BF16 instructions. Elsewhere torch emulates it (on an AVX2-only CPU, 3-7x float32's time)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type == "cpu":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def native_dtype(device_type: str) -> str:
    """What `compute.target_dtype: auto` computes in on a device of this type, one dtype for every kind of work
    (regenerating, features, the trainer's borrowed modules, decoding), so the drafter learns from the numerics it is
    judged and served on: bfloat16 on a GPU that computes it, float32 on every CPU. Every CPU computes float32 the
    same, so a CPU run's verdicts (the proof, lossless, the gate) do not depend on which CPU ran it; bfloat16 makes
    other replies, so other data (docs/measurements.md), and stays a choice (`bfloat16`) where AMX makes it faster.
    Recorded by the fingerprint (`target_dtype`), so a stage's lock names the dtype it ran in."""
    return "bfloat16" if device_type == "cuda" and bfloat16_native(device_type) else "float32"

"""Attention kernels: compiled FlexAttention or SDPA, chosen once per run, fed one mask definition."""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashpipe.core.errors import ParamsError
from dflashpipe.model.mask import MaskMod, dense_mask, flex_block_mask

Backend = Literal["flex", "sdpa"]


def resolve_backend(name: str, device: torch.device) -> Backend:
    """`auto` means flex where it can train (CUDA) and sdpa on the CPU, where flex has no backward."""
    if name == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if name not in ("flex", "sdpa"):
        raise ParamsError(f"params.yaml: model.attention = {name!r}: allowed values are ['auto', 'flex', 'sdpa']")
    return name  # type: ignore[return-value]


@functools.cache
def compiled_flex_attention():
    """One compiled flex_attention per process: every caller shares its graph and its cache entry.

    Static shapes (dynamic=False) because training pads to fixed shapes; a second shape
    recompiles, which the warmup stage is there to do before training starts.
    """
    return torch.compile(flex_attention, dynamic=False)


def build_mask(
    mask_mod: MaskMod, backend: Backend, batch: int, q_len: int, kv_len: int, device: torch.device
) -> BlockMask | torch.Tensor:
    if backend == "flex":
        return flex_block_mask(mask_mod, batch, q_len, kv_len, device)
    return dense_mask(mask_mod, batch, q_len, kv_len, device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: BlockMask | torch.Tensor | None,
    backend: Backend,
    compiled: bool = True,
) -> torch.Tensor:
    """Scaled dot-product attention of q [B, Hq, Q, D] over k, v [B, Hkv, KV, D]; mask None = see all."""
    if backend == "sdpa":
        if isinstance(mask, BlockMask):
            raise TypeError("the sdpa backend needs the dense mask, not a BlockMask")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    if torch.is_grad_enabled() and q.requires_grad and q.device.type == "cpu":
        raise ParamsError(
            "params.yaml: model.attention = 'flex': FlexAttention has no backward on the CPU; "
            "use 'sdpa' or 'auto' to train here (flex still serves CPU inference under torch.no_grad())"
        )
    if mask is not None and not isinstance(mask, BlockMask):
        raise TypeError("the flex backend needs a BlockMask, not a dense mask")
    kernel = compiled_flex_attention() if compiled else flex_attention
    return kernel(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])

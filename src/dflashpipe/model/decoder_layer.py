"""The drafter's decoder layer: Qwen3-style (RMSNorm, RoPE, q/k RMSNorm, gated SiLU MLP), non-causal.

Parameter names follow the published DFlash drafter (`self_attn.q_proj`, `mlp.gate_proj`,
`input_layernorm`, ...) so that our state dict is its checkpoint format unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from dflashpipe.model.attention import Backend, attend
from dflashpipe.model.config import DFlashConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 (bf16 squares lose too much), scale in the input dtype, as Qwen3 does.
        dtype = x.dtype
        x32 = x.to(torch.promote_types(dtype, torch.float32))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Rotary:
    """Rotary position embedding (the non-interleaved "rotate half" form). No state, so no checkpoint keys."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim, self.theta = head_dim, theta

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for integer positions [B, N]: each [B, 1, N, head_dim], ready to broadcast over heads."""
        # Angles in float32 (float64 for float64 models): bf16 positions past 256 are not even integers.
        work = torch.float64 if dtype == torch.float64 else torch.float32
        exponent = (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device).to(work) / self.head_dim
        )
        inv_freq = 1.0 / (self.theta**exponent)
        angles = positions.to(work)[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block tokens; keys and values from the context features and the block tokens alike."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V [B, Hkv, N, D] of x [B, N, H]: the same projections for context and block."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: BlockMask | torch.Tensor | None,
        backend: Backend,
        compiled: bool,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        # Context keys first, then block keys: the layout that the mask_mod indexes.
        k, v = torch.cat([context_k, k], dim=2), torch.cat([context_v, v], dim=2)
        y = attend(q, k, v, mask, backend, compiled)
        return self.o_proj(y.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(
        self,
        x: torch.Tensor,
        context_k: torch.Tensor,
        context_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: BlockMask | torch.Tensor | None,
        backend: Backend,
        compiled: bool,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context_k, context_v, cos, sin, mask, backend, compiled)
        return x + self.mlp(self.post_attention_layernorm(x))

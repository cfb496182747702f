"""The DFlash attention mask, defined once as a FlexAttention `mask_mod`.

Key/value layout of one training sequence: the S context positions (fused target
features) first, then the A draft blocks of `block_size` tokens each; queries are the
block tokens only, in the same block order. A query in block a sees
  - context positions strictly before its anchor (what the target had verified), and
  - every token of its own block, in both directions;
never another block. In a packed row (several documents, dflashpipe.features.packing) a block sees only the
context of its anchor's own document. Both attention backends derive their mask from this one function:
flex compiles it into a BlockMask, sdpa evaluates it on broadcast index tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dflash_mask_mod(
    anchor_positions: torch.Tensor, context_len: int, block_size: int, document_ids: torch.Tensor | None = None
) -> MaskMod:
    """The mask for anchors [B, A] over `context_len` context keys followed by A * block_size block keys.

    `document_ids` [B, context_len]: the document of each context position (None: one document a row)."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_block = q_idx // block_size
        anchor = anchor_positions[b, q_block]
        sees_context = (kv_idx < context_len) & (kv_idx < anchor)
        if document_ids is not None:
            # Block keys lie past the context: clamped, they index a real position and are masked above.
            key_document = document_ids[b, kv_idx.clamp_max(context_len - 1)]
            sees_context = sees_context & (key_document == document_ids[b, anchor])
        # For context keys (kv_idx < context_len) the floor division is negative, never a block index.
        sees_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == q_block)
        return sees_context | sees_own_block

    return mask_mod


def dense_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate `mask_mod` on every (b, q, kv) at once: a boolean [B, 1, Q, KV] mask for sdpa."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return mask_mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


def flex_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The same mask as a FlexAttention BlockMask, shared by all heads (H=None)."""
    return create_block_mask(mask_mod, batch, None, q_len, kv_len, device=device)

"""Deliberate misalignments: each breaks the trainer alone (decoding stays correct) in one of the ways published
DFlash trainers were found broken, and a proof trained under it must fail.

  labels        slot k learns the token at anchor + k + 1 (labels shifted by one: SpecForge #455)
  context_mask  a block also sees the context at its own anchor (`<=` for `<` in the mask)
  block_index   block i sees the context before i * block_size, not before its anchor: where anchors lie closer than
                a block apart a block sees past its anchor, the tokens it must draft (SpecForge #470)
  layer         the trainer taps the output of layer id - 1 (hidden_states[id], not [id + 1])
  mask_token    the trainer fills the block with another token than the one the drafter drafts with
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch


@contextlib.contextmanager
def _patched(owner, name: str, value) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _shifted_labels():
    from dflashpipe.model import drafter

    original = drafter.block_labels

    def block_labels(input_ids, loss_mask, anchors, *rest):
        return original(input_ids.roll(-1, 1), loss_mask.roll(-1, 1), anchors, *rest)

    return _patched(drafter, "block_labels", block_labels)


def _context_mask_sees_anchor():
    from dflashpipe.model import drafter

    original = drafter.dflash_mask_mod

    def dflash_mask_mod(anchor_positions, context_len, block_size, document_ids=None):
        mod = original(anchor_positions, context_len, block_size, document_ids)

        def mask_mod(b, h, q_idx, kv_idx):  # context keys up to and including the anchor: `<=` for `<`
            return mod(b, h, q_idx, kv_idx) | (kv_idx == anchor_positions[b, q_idx // block_size])

        return mask_mod

    return _patched(drafter, "dflash_mask_mod", dflash_mask_mod)


def _context_follows_block_index():
    from dflashpipe.model import drafter

    original = drafter.dflash_mask_mod

    def dflash_mask_mod(anchor_positions, context_len, block_size, document_ids=None):
        mod = original(anchor_positions, context_len, block_size, document_ids)

        def mask_mod(b, h, q_idx, kv_idx):  # the context a block sees by its index in the row, as if blocks tiled it
            by_index = (kv_idx < context_len) & (kv_idx < (q_idx // block_size) * block_size)
            return by_index | ((kv_idx >= context_len) & mod(b, h, q_idx, kv_idx))

        return mask_mod

    return _patched(drafter, "dflash_mask_mod", dflash_mask_mod)


def _layer_one_early():
    from dflashpipe.train import loop

    original = loop.target_layer_features

    def target_layer_features(model, input_ids, attention_mask, layer_ids, *rest):
        if min(layer_ids) < 1:
            raise ValueError(f"layer ids {list(layer_ids)}: the misalignment needs every id >= 1")
        return original(model, input_ids, attention_mask, [i - 1 for i in layer_ids], *rest)

    return _patched(loop, "target_layer_features", target_layer_features)  # the trainer's pass, not decoding's


def _other_mask_token():
    from dflashpipe.model.drafter import DFlashDrafter

    original = DFlashDrafter._block_ids

    def _block_ids(self, anchor_ids):
        block = original(self, anchor_ids)
        if torch.is_grad_enabled():  # training only: decoding drafts under no_grad with the configured token
            block[..., 1:] = (self.config.mask_token_id + 1) % self.config.vocab_size
        return block

    return _patched(DFlashDrafter, "_block_ids", _block_ids)


@contextlib.contextmanager
def trained_misaligned(name: str) -> Iterator[None]:
    """Train under misalignment `name` with train's parity check off: the proof judges a broken trainer by what its
    drafter decodes, a guard of its own beside parity, which would stop most of them before their first step."""
    from dflashpipe.train import parity, stage

    with MISALIGNMENTS[name](), _patched(stage, "check_parity", lambda trainer: parity.Parity(checked=False)):
        yield


MISALIGNMENTS: dict[str, Callable[[], AbstractContextManager[None]]] = {
    "labels": _shifted_labels,
    "context_mask": _context_mask_sees_anchor,
    "block_index": _context_follows_block_index,
    "layer": _layer_one_early,
    "mask_token": _other_mask_token,
}

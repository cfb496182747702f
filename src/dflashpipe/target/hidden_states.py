"""The target's decoder run by hand up to the drafter's deepest layer: its layers' hidden states, exactly.

What `target_features` (dflashpipe.model) takes from a full Hugging Face forward with output_hidden_states,
computed with only decoder layers 0..max(ids): no later layer, no LM head, no logits (features' and train's
target pass). Packed rows attend within their own documents (`document_causal_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflashpipe.target.adapter import cache_keyword


def document_causal_mask(document_ids: torch.Tensor, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask [B, 1, S, S] of packed rows: a token sees the tokens of its own document
    up to itself (within `sliding_window` tokens when given), as if each document were alone.

    Additive (0 / dtype's min), so that eager attention (which adds it) and SDPA (which takes any float
    mask) read the same mask. Padding (document -1) sees padding, so no query row is empty."""
    seq_len = document_ids.shape[1]
    q = torch.arange(seq_len, device=document_ids.device).view(seq_len, 1)
    kv = q.view(1, seq_len)
    allowed = (kv <= q) & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    if sliding_window is not None:
        allowed = allowed & (kv > q - sliding_window)  # transformers' sliding_window_overlay
    zero = torch.zeros((), dtype=dtype, device=document_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def target_layer_features(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: Sequence[int],
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """What `target_features(target(..., output_hidden_states=True).hidden_states, ids)` returns, computed
    with only decoder layers 0..max(ids): no later layer, no LM head, no logits.

    `target` is a Hugging Face causal LM of the Llama/Qwen3 shape (transformers 5.x): `target.model` holds
    embed_tokens, rotary_emb, layers and norm. This builds the attention masks and position embeddings with
    the helpers its decoder's forward calls (no cache, as in a single uncached forward). Hugging Face
    returns the final-normed output as the last hidden state, so when the last decoder layer is chosen it
    is normed here too.

    Packed rows (dflashpipe.features.packing) pass `document_ids` and in-document `position_ids` [B, S]: each document
    then attends only within itself (document_causal_mask, an explicit 4D mask that the decoder layers of
    every transformers 5.x read alike), so its features are those of the document alone. The padding
    is then document -1 and `attention_mask` goes unused.
    """
    ids = _check_ids(target, target_layer_ids)
    chosen, _ = _decoder_pass(target, input_ids, attention_mask, ids, ids[-1], document_ids, position_ids)
    return torch.cat(chosen, dim=-1)


def target_features_and_predictions(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: Sequence[int],
    predict_at: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_layer_features`, plus the target's final (normed) hidden states at `predict_at` [B, ...]
    (row positions): what its LM head turns into its logits, its prediction of the next token, there.

    The layers after max(ids) run over the whole row (their attention reads every earlier position), but
    the final norm only on the gathered rows and no LM head at all: the loss applies it chunk by chunk."""
    ids = _check_ids(target, target_layer_ids)
    last = target.model.config.num_hidden_layers - 1
    chosen, hidden = _decoder_pass(target, input_ids, attention_mask, ids, last, document_ids, position_ids)
    batch, size = hidden.shape[0], hidden.shape[-1]
    rows = hidden.gather(1, predict_at.reshape(batch, -1, 1).expand(-1, -1, size))
    return torch.cat(chosen, dim=-1), target.model.norm(rows).view(*predict_at.shape, size)


def _check_ids(target, target_layer_ids: Sequence[int]) -> list[int]:
    ids, num_layers = list(target_layer_ids), target.model.config.num_hidden_layers
    if not ids or ids[0] < 0 or ids[-1] >= num_layers or ids != sorted(set(ids)):
        raise ValueError(f"target layer ids {ids}: give distinct increasing ids from 0 to {num_layers - 1}")
    return ids


def _decoder_pass(
    target,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    ids: list[int],
    through: int,
    document_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Decoder layers 0..`through`: the outputs of layers `ids` (the last decoder layer's normed, as Hugging
    Face returns it) and layer `through`'s output, not normed."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    decoder = target.model
    config = decoder.config
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers

    attn = getattr(config, "_attn_implementation", None)
    if (document_ids is None) != (position_ids is None):
        raise ValueError("packed rows need both document_ids and position_ids, or neither")
    if document_ids is not None and attn not in ("sdpa", "eager"):
        raise ValueError(f"target attention {attn!r}: packed rows need 'sdpa' or 'eager' (an explicit 4D mask)")
    hidden = decoder.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    # Positional up to the (absent) cache: transformers 5.17 names it past_key_values, 5.24 cache.
    mask_args = (config, hidden, attention_mask, None)
    masks: dict[str, object] = {}
    for kind in sorted(set(layer_types[: through + 1])):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"target layer type {kind!r}: only full and sliding attention layers are supported")
        window = config.sliding_window if kind == "sliding_attention" else None
        if document_ids is not None:
            masks[kind] = document_causal_mask(document_ids, window, hidden.dtype)
        elif window is None:
            masks[kind] = create_causal_mask(*mask_args, position_ids=position_ids)
        else:
            masks[kind] = create_sliding_window_causal_mask(*mask_args, position_ids=position_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)

    chosen, out, layer_cache = set(ids), [], cache_keyword(decoder.layers[0])
    for i, layer in enumerate(decoder.layers[: through + 1]):
        hidden = layer(
            hidden,
            attention_mask=masks[layer_types[i]],
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            **{layer_cache: None},
            use_cache=False,
        )
        if isinstance(hidden, tuple):
            hidden = hidden[0]
        if i in chosen:
            out.append(hidden)
    if ids[-1] == num_layers - 1 and getattr(config, "tie_last_hidden_states", None) is not False:
        out[-1] = decoder.norm(out[-1])
    return out, hidden

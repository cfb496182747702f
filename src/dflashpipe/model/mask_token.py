"""The MASK token: which id fills a block's slots 1.. before the drafter predicts them."""

from __future__ import annotations

from typing import Any

from dflashpipe.core.errors import ParamsError


def resolve_mask_token_id(tokenizer: Any, num_embeddings: int, mask_token: str) -> int:
    """The tokenizer's own mask token if it has one; else `mask_token`, added to the vocabulary if new.

    The drafter embeds MASK with the target's frozen embedding table, and so does every
    DFlash server, so the id must be a row of that table: adding a token works only where
    the table has spare (padding) rows, as Qwen3's has.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None:
        token_id, how = tokenizer.mask_token_id, f"the tokenizer's mask token {tokenizer.mask_token!r}"
    elif mask_token in tokenizer.get_vocab():
        token_id, how = tokenizer.convert_tokens_to_ids(mask_token), f"model.mask_token = {mask_token!r}"
    else:
        # A new token gets the next id; check that it fits before changing the tokenizer.
        token_id, how = len(tokenizer), f"model.mask_token = {mask_token!r} (not in the vocabulary)"
        if token_id < num_embeddings:
            tokenizer.add_special_tokens({"mask_token": mask_token})
            token_id = tokenizer.mask_token_id
    if not 0 <= token_id < num_embeddings:
        raise ParamsError(
            f"params.yaml: {how} has id {token_id}, but the target's embedding has only {num_embeddings} rows: "
            f"set model.mask_token to a token of the target's vocabulary that the training data never uses"
        )
    return int(token_id)

"""Greedy replies from the target in this process: batched, with a KV cache, one token per forward.

Prompts of a batch are left-padded to one width (positions count real tokens only, the padding is
masked out), so every row's next token is its last column's argmax. A row leaves the batch as soon
as it ends (its cache rows are dropped with it): the batch shrinks to the replies still running
instead of paying for finished ones until the longest reply ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Reply:
    """The target's tokens after a prompt, its stop token excluded; `stopped`: it ended with a stop token
    (else it ran into max_new_tokens)."""

    tokens: tuple[int, ...]
    stopped: bool


def stop_token_ids(target, tokenizer) -> list[int]:
    """End of turn: the generation config's eos ids and the tokenizer's eos token."""
    ids = target.generation_config.eos_token_id if target.generation_config is not None else None
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


@torch.no_grad()
def greedy_replies(
    target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    on_token: Callable[[int], None] = lambda n: None,
) -> list[Reply]:
    """One greedy reply per prompt (all in one batch); `on_token(n)` after each step that made n tokens."""
    from transformers import DynamicCache

    device, stop = target.device, torch.tensor(sorted(stop_ids), dtype=torch.long, device=target.device)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
            mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=target.config)
    logits = target(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1).logits
    rows = torch.arange(len(prompts), device=device)  # the prompts still in the batch
    tokens: list[list[int]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)
    for step in range(max_new_tokens):
        chosen = logits[:, -1].argmax(-1)
        ended = torch.isin(chosen, stop)
        for row, token, end in zip(rows.tolist(), chosen.tolist(), ended.tolist(), strict=True):
            if end:
                stopped[row] = True
            else:
                tokens[row].append(token)
        on_token(len(rows))
        keep = (~ended).nonzero().flatten()
        if len(keep) == 0 or step == max_new_tokens - 1:
            break
        if len(keep) < len(rows):
            rows, chosen, mask, positions = rows[keep], chosen[keep], mask[keep], positions[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        logits = target(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions, cache=cache).logits
    return [Reply(tuple(t), s) for t, s in zip(tokens, stopped, strict=True)]

"""Continuous batching of greedy replies (regenerate's decoding): the same prompts give the same replies.

A reply's row leaves the batch as soon as it ends and the next prompt takes its place (`greedy_replies`);
rows leave and join through the KV cache's layers (`_Rows`), the one place the project reaches inside
transformers' cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflashpipe.target.adapter import Target


@dataclass(frozen=True)
class Reply:
    """The target's tokens after a prompt, its stop token excluded; `stopped`: it ended with a stop token
    (else it ran into max_new_tokens)."""

    tokens: tuple[int, ...]
    stopped: bool


@torch.no_grad()
def greedy_replies(
    target: Target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    on_token: Callable[[int], None] = lambda n: None,
    batch_size: int | None = None,
) -> list[Reply]:
    """One greedy reply per prompt, at most `batch_size` rows at once (None: all); `on_token(n)` after each
    forward that made n tokens.

    Continuous batching: a row leaves as soon as its reply ends (its cache rows go with it) and the next
    prompt, in the given order, is read in and takes its place, so the batch stays full until the prompts run
    out. Rows are left-padded to one width (positions count real tokens only, the padding is masked out), so
    every row's next token is its last column's argmax. Which rows share a forward depends only on the
    prompts, `max_new_tokens` and the replies so far: the same inputs give the same replies."""
    stop = frozenset(stop_ids)
    batch_size = batch_size or max(len(prompts), 1)
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: the given order
    tokens: list[list[int]] = [[] for _ in prompts]
    stopped = [False] * len(prompts)

    def take(rows: _Rows, logits: torch.Tensor) -> None:
        """Each row's next token from its last column; then the rows whose reply ended leave."""
        rows.chosen = logits[:, -1].argmax(-1)
        ended = []
        for k, (row, token) in enumerate(zip(rows.rows, rows.chosen.tolist(), strict=True)):
            if token in stop:
                stopped[row] = True
            else:
                tokens[row].append(token)
            if stopped[row] or len(tokens[row]) >= max_new_tokens:
                ended.append(k)
        on_token(len(rows.rows))
        if ended:
            rows.drop(ended)

    running: _Rows | None = None
    while waiting or running is not None:
        free = batch_size - (len(running.rows) if running is not None else 0)
        if free and waiting:
            admitted = [waiting.pop() for _ in range(min(free, len(waiting)))]
            new, logits = _read_prompts(target, admitted, [prompts[i] for i in admitted])
            take(new, logits)
            if new.rows:
                running = new if running is None else running.merged(new)
            continue
        assert running is not None
        grown = running.grown()
        take(running, target.decode_step(running.chosen[:, None], running.cache, **grown))
        if not running.rows:
            running = None
    return [Reply(tuple(t), s) for t, s in zip(tokens, stopped, strict=True)]


def _read_prompts(target: Target, rows: list[int], prompts: list[Sequence[int]]) -> tuple[_Rows, torch.Tensor]:
    """The prompts read into a fresh cache, left-padded to the longest: their rows, and the last column's logits."""
    device = target.device
    width = max(max(len(p) for p in prompts), 1)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for k, prompt in enumerate(prompts):
        if prompt:
            ids[k, width - len(prompt) :] = torch.tensor(list(prompt), device=device)
            mask[k, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = target.new_cache()
    logits = target.decode_step(ids, cache, attention_mask=mask, position_ids=positions, logits_to_keep=1)
    return _Rows(rows, cache, mask, positions[:, -1:], ids[:, -1]), logits


@dataclass
class _Rows:
    """Replies decoded together: the prompt each row answers, their KV cache (left-padded to one width), the
    attention mask [B, T], each row's last position [B, 1] and the token each row feeds next [B].

    Rows leave and join through the cache's layers' `keys` and `values` ([B, heads, T, head_dim]: transformers
    5's DynamicLayer)."""

    rows: list[int]
    cache: Any
    mask: torch.Tensor
    positions: torch.Tensor
    chosen: torch.Tensor

    def grown(self) -> dict[str, torch.Tensor]:
        """The mask and positions of the next decode step, which appends the chosen tokens to the cache."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self.positions = self.positions + 1
        return {"attention_mask": self.mask, "position_ids": self.positions}

    def drop(self, ended: list[int]) -> None:
        """Remove the ended rows, then the columns of left padding that no remaining row needs."""
        gone = set(ended)
        keep = [k for k in range(len(self.rows)) if k not in gone]
        self.rows = [self.rows[k] for k in keep]
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        self.mask, self.positions, self.chosen = self.mask[index], self.positions[index], self.chosen[index]
        self.cache.batch_select_indices(index)
        unused = int(self.mask.argmax(-1).min())  # the first real column of the least padded row
        layers = _full_layers(self.cache)
        if unused and layers is not None:
            self.mask = self.mask[:, unused:]
            for layer in layers:
                layer.keys, layer.values = layer.keys[:, :, unused:], layer.values[:, :, unused:]

    def merged(self, new: _Rows) -> _Rows:
        """These rows and the `new` ones in one cache, left-padded to one width."""
        width = max(self.mask.shape[1], new.mask.shape[1])
        layers, joining = _full_layers(self.cache), _full_layers(new.cache)
        if layers is None or joining is None:
            raise NotImplementedError(
                f"continuous batching joins full-attention DynamicLayers; this cache ({type(self.cache).__name__}) "
                "has others: set regenerate.batch_size to at least the prompts of a shard, or use an endpoint"
            )
        for mine, theirs in zip(layers, joining, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2), _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2), _left_pad(theirs.values, width, 2)])
        return _Rows(
            self.rows + new.rows,
            self.cache,
            torch.cat([_left_pad(self.mask, width, 1), _left_pad(new.mask, width, 1)]),
            torch.cat([self.positions, new.positions]),
            torch.cat([self.chosen, new.chosen]),
        )


def _full_layers(cache: Any) -> list[Any] | None:
    """The cache's layers when each is a full-attention layer of keys and values [B, heads, T, head_dim]; else None."""
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
        return None
    return layers


def _left_pad(t: torch.Tensor, width: int, axis: int) -> torch.Tensor:
    """`t` with zeros prepended along `axis` up to `width`."""
    missing = width - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t.new_zeros(shape), t], dim=axis)

"""DFlash speculative decoding, greedy: the decoding loop and the one interface it drafts through.

    prefill:  target(prompt) -> first token + the chosen layers' hidden states of the prompt
              drafter.begin(those features)
    each verify step, with `anchor` the last committed token (at position = context length):
      1. drafter.draft(anchor)          one forward: a whole block of proposals
      2. target(anchor + proposals)     one forward over its own KV cache
      3. accept the longest prefix of proposals that equals the target's argmax, then the
         target's next argmax (the bonus token); crop the target cache to what was verified
      4. drafter.extend(features of the anchor + accepted tokens)

Greedy acceptance commits only the target's own argmax tokens, so the output is the
target's greedy decoding, token for token (the tests check it on every eval prompt).
The stopping rule is the reference `dflash_generate`'s: at most `max_new_tokens` new
tokens (the prefill's first one included), ending at the first stop token, kept.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflashpipe.model import DFlashDrafter, DraftContext, target_features


class Drafter(Protocol):
    """What the loop needs from a drafter. `draft` must return exactly block_size - 1 token ids."""

    block_size: int
    target_layer_ids: Sequence[int]
    """Which target layers' hidden states `begin` and `extend` receive (concatenated, as in training)."""

    def begin(self, features: torch.Tensor) -> None:
        """Start a sequence from the prompt's target features [1, P, n*H] (positions 0..P-1)."""

    def draft(self, anchor: torch.Tensor) -> torch.Tensor:
        """Token ids [block_size - 1] proposed after `anchor` (0-d), which sits at position = the context length."""

    def extend(self, features: torch.Tensor) -> None:
        """Append the features [1, N, n*H] of newly verified tokens to the context."""


class DFlashProposer:
    """A trained DFlashDrafter behind `Drafter`. Its context holds only verified tokens' keys and values
    (a block's own keys are never cached), so after every `extend` it is exactly the committed length."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.block_size = drafter.config.block_size
        self.target_layer_ids = drafter.config.target_layer_ids
        self.context: DraftContext | None = None

    def begin(self, features: torch.Tensor) -> None:
        self.context = self.drafter.encode_context(features)

    def draft(self, anchor: torch.Tensor) -> torch.Tensor:
        return self.drafter.draft_logits(self.context, anchor.view(1))[0].argmax(-1)

    def extend(self, features: torch.Tensor) -> None:
        self.context = self.drafter.encode_context(features, self.context)


def clock(device: torch.device) -> float:
    """Wall time after the device has finished what was queued (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Prefill:
    """The target after reading the prompt: its cache, its first token, the prompt's hidden states."""

    prompt_len: int
    cache: object
    first_token: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...]
    seconds: float

    def fork(self) -> Prefill:
        """An independent copy, so two decoders can start from one prefill."""
        return Prefill(self.prompt_len, copy.deepcopy(self.cache), self.first_token, self.hidden_states, self.seconds)


@dataclass
class Decoded:
    """One decoding run: the new tokens (prompt excluded) and, for speculative runs, each verify step."""

    tokens: list[int]
    decode_s: float
    """From after the prefill to the last token: the time that speedup compares."""
    prefill_s: float
    accepted: list[int] = field(default_factory=list)
    """Per verify step: how many proposals the target accepted (0 .. size - 1)."""
    produced: list[int] = field(default_factory=list)
    """Per verify step: tokens committed (accepted + bonus, cut at max_new_tokens or a stop token)."""
    sizes: list[int] = field(default_factory=list)
    """Per verify step: the verified block's length (the block size, or fewer near max_new_tokens)."""
    profile: dict[str, float] = field(default_factory=dict)
    """With profile=True: seconds in the drafter's draft and extend, the target's verify forward, and whole
    steps; what a step spends outside those three is the loop's own overhead."""

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the prefill (the prefill's own token is not decode work)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (accepted + 1 bonus, bounded by the tokens left)."""
        return sum(self.produced) / len(self.produced) if self.produced else 0.0


def prefill(target, prompt_ids: Sequence[int]) -> Prefill:
    from transformers import DynamicCache

    device = target.device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    began = clock(device)
    cache = DynamicCache(config=target.config)
    out = target(ids, past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    first = out.logits[0, -1].argmax(-1)
    return Prefill(ids.shape[1], cache, first, out.hidden_states, clock(device) - began)


def _first_stop(tokens: list[int], stop: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop), None)


@torch.no_grad()
def target_generate(target, start: Prefill, max_new_tokens: int, stop_token_ids: Sequence[int]) -> Decoded:
    """Target-only greedy decoding, one token per forward: the reference output and the speedup's baseline."""
    stop, device = frozenset(stop_token_ids), target.device
    token = start.first_token.view(1, 1)
    tokens = [int(token)]
    began = clock(device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop:
        out = target(token, past_key_values=start.cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
    return Decoded(tokens, clock(device) - began, start.seconds)


@torch.no_grad()
def speculative_generate(
    target, drafter: Drafter, start: Prefill, max_new_tokens: int, stop_token_ids: Sequence[int], profile: bool = False
) -> Decoded:
    """Greedy DFlash decoding from a prefill; `profile` times each part (with a device sync around each)."""
    stop, device, bs = frozenset(stop_token_ids), target.device, drafter.block_size
    layer_ids = list(drafter.target_layer_ids)
    cache = start.cache
    drafter.begin(target_features(start.hidden_states, layer_ids))
    anchor = start.first_token
    result = Decoded([int(anchor)], 0.0, start.seconds)
    timing = {"draft_s": 0.0, "verify_s": 0.0, "extend_s": 0.0, "step_s": 0.0}
    began = clock(device)
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop:
        t0 = clock(device) if profile else 0.0
        size = min(bs, max_new_tokens - len(result.tokens) + 1)
        proposals = drafter.draft(anchor)[: size - 1]
        t1 = clock(device) if profile else 0.0
        out = target(
            torch.cat([anchor.view(1), proposals]).view(1, size),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=True,
        )
        t2 = clock(device) if profile else 0.0
        posterior = out.logits[0].argmax(-1)  # [size]: the target's token after each block position
        matches = (proposals == posterior[:-1]).cumprod(0).sum()
        # One transfer to the host per step: the accepted count and the target's tokens together.
        host = torch.cat([matches.view(1), posterior]).tolist()
        accepted = host[0]
        new = host[1 : accepted + 2]  # the accepted proposals equal the target's tokens; then the bonus
        new = new[: max_new_tokens - len(result.tokens)]
        cut = _first_stop(new, stop)
        if cut is not None:
            new = new[: cut + 1]
        result.accepted.append(accepted)
        result.produced.append(len(new))
        result.sizes.append(size)
        result.tokens.extend(new)
        finished = len(result.tokens) >= max_new_tokens or cut is not None
        if not finished:
            # The anchor and the accepted proposals are verified: keep their target keys and drafter context.
            rejected = size - accepted - 1
            if rejected:
                cache.crop(-rejected)  # transformers 5: a negative count of positions to drop from the end
            features = target_features(out.hidden_states, layer_ids)[:, : accepted + 1]
            t3 = clock(device) if profile else 0.0
            drafter.extend(features)
            timing["extend_s"] += (clock(device) - t3) if profile else 0.0
            anchor = posterior[accepted]
        if profile:
            timing["draft_s"] += t1 - t0
            timing["verify_s"] += t2 - t1
            timing["step_s"] += clock(device) - t0
    result.decode_s = clock(device) - began
    if profile:
        result.profile = timing
    return result

"""DFlash speculative decoding, greedy: the decoding loop and the one interface it drafts through.

    prefill:  target(prompt) -> first token + the chosen layers' hidden states of the prompt
              drafter.begin(those features)
    each verify step, with `anchor` the last committed token (at position = context length):
      1. drafter.draft(anchor, count)   one forward: a whole block, proposals for the slots to verify
      2. target(anchor + proposals)     one forward of the decoder over its own KV cache
      3. the target's LM head at the anchor's position, and only if the first proposal holds at the
         others: the accepted proposals, then the target's token (the bonus); crop the target
         cache to what was verified
      4. drafter.extend(features of the anchor + accepted tokens)

Greedy acceptance commits only the target's own argmax tokens. Each run records, beside every token it
emits, the argmax of the forward that verified it and that forward's logits row, so evaluate can hold the
run to the lossless contract (dflashpipe.evaluate.lossless): exact against its own verify forwards in any
dtype, and equal to plain greedy decoding or diverging only where both paths see a near-tie.
The stopping rule is the reference `dflash_generate`'s: at most `max_new_tokens` new
tokens (the prefill's first one included), ending at the first stop token, kept.

What a step does not compute, because nothing reads it: the block's logits when the first proposal is
rejected (the common case of a weak drafter; one row of the LM head costs about half of seven on one
CPU thread), and hidden states of layers the drafter does not read (forward hooks keep only its layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dflashpipe.core.spread import clock
from dflashpipe.model import DFlashDrafter, DraftContext
from dflashpipe.target.adapter import Target
from dflashpipe.target.prefill import Prefill, captured_features, layer_capture


class Drafter(Protocol):
    """What the loop needs from a drafter. `draft` must return exactly block_size - 1 token ids."""

    block_size: int
    target_layer_ids: Sequence[int]
    """Which target layers' hidden states `begin` and `extend` receive (concatenated, as in training)."""

    def begin(self, features: torch.Tensor) -> None:
        """Start a sequence from the prompt's target features [1, P, n*H] (positions 0..P-1)."""

    def draft(self, anchor: torch.Tensor, count: int) -> torch.Tensor:
        """Token ids [count] (count <= block_size - 1) proposed after `anchor` (0-d), which sits at position = the
        context length: the first `count` of the block's proposals, the only ones the step verifies."""

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

    def draft(self, anchor: torch.Tensor, count: int) -> torch.Tensor:
        return self.drafter.draft_logits(self.context, anchor.view(1), count)[0].argmax(-1)

    def extend(self, features: torch.Tensor) -> None:
        self.context = self.drafter.encode_context(features, self.context)


STEP_PARTS = ("draft", "verify_forward", "verify_head", "accept", "crop", "capture", "extend")
"""What one verify step spends its time on, in order (speculative_generate's profile):
draft: the drafter's forward and LM head, proposals out; verify_forward: the target's decoder over the
block; verify_head: the target's LM head and argmax (position 0, then the rest if its proposal held); accept: the
bookkeeping of committed tokens; crop: dropping the rejected positions from the target's KV cache;
capture: the accepted positions' features from the hooked layers; extend: the drafter's context update."""


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
    """With profile=True: seconds in each of STEP_PARTS, and in whole steps (`step`), summed over steps."""
    verified: list[int] = field(default_factory=list)
    """Per token: the argmax of the forward that verified it (the prefill's, a decode step's or a verify
    forward's row), recorded apart from the rule that chose the token."""
    logits: list[torch.Tensor] = field(default_factory=list)
    """Per token: that forward's logits row [vocab] (what the lossless contract weighs a divergence with)."""

    @property
    def decode_tokens(self) -> int:
        """Tokens produced after the prefill (the prefill's own token is not decode work)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (accepted + 1 bonus, bounded by the tokens left)."""
        return sum(self.produced) / len(self.produced) if self.produced else 0.0


def _started(start: Prefill) -> Decoded:
    """A decoding run's record holding the prefill's token, verified by the prefill itself."""
    first = int(start.first_token)
    return Decoded([first], 0.0, start.seconds, verified=[first], logits=[start.first_logits])


def _first_stop(tokens: list[int], stop: frozenset[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in stop), None)


@torch.no_grad()
def target_generate(
    target: Target | torch.nn.Module, start: Prefill, max_new_tokens: int, stop_token_ids: Sequence[int]
) -> Decoded:
    """Target-only greedy decoding, one token per forward: the reference output and the speedup's baseline."""
    target = Target.of(target)
    stop, device = frozenset(stop_token_ids), target.device
    token = start.first_token.view(1, 1)
    result = _started(start)
    began = clock(device)
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop:
        row = target.decode_step(token, start.cache)[0, -1]
        token = row.argmax(-1).view(1, 1)
        result.tokens.append(int(token))
        result.verified.append(result.tokens[-1])
        result.logits.append(row)
    result.decode_s = clock(device) - began
    return result


def accepted_proposals(proposals: Sequence[int], verified: Sequence[int]) -> int:
    """Greedy acceptance: how many proposals, from the first, equal the target's argmax at their position
    (`verified[i]` is the target's token after block position i, so it checks proposal i)."""
    accepted = 0
    while accepted < len(proposals) and accepted < len(verified) and proposals[accepted] == verified[accepted]:
        accepted += 1
    return accepted


@torch.no_grad()
def speculative_generate(
    target: Target | torch.nn.Module,
    drafter: Drafter,
    start: Prefill,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    profile: bool = False,
    draft_tokens: int = 0,
) -> Decoded:
    """Greedy DFlash decoding from a prefill (of the drafter's layers); `profile` times each of STEP_PARTS
    (with a device sync around each, so on CUDA it slows the run it measures). `draft_tokens`: proposals
    verified per step (0: all block_size - 1)."""
    target = Target.of(target)
    stop, device = frozenset(stop_token_ids), target.device
    bs = min(drafter.block_size, draft_tokens + 1) if draft_tokens else drafter.block_size
    head, layer_ids, cache = target.head, list(drafter.target_layer_ids), start.cache
    if start.features.shape[1] != start.prompt_len:
        raise ValueError("speculative_generate needs a prefill of the drafter's layers: prefill(..., layer_ids)")
    drafter.begin(start.features)
    anchor = start.first_token
    result = _started(start)
    seconds = dict.fromkeys((*STEP_PARTS, "step"), 0.0)
    marks: list[float] = []

    def mark() -> None:
        if profile:
            marks.append(clock(device))

    began = clock(device)
    with layer_capture(target.model, layer_ids) as captured:
        while len(result.tokens) < max_new_tokens and result.tokens[-1] not in stop:
            marks.clear()
            mark()
            size = min(bs, max_new_tokens - len(result.tokens) + 1)
            proposals = drafter.draft(anchor, size - 1)
            block = torch.cat([anchor.view(1), proposals]).view(1, size)
            mark()
            normed = target.decoder_forward(block, cache)
            mark()
            # The target's token after each block position, only as far as the proposals hold (the first position
            # whose argmax differs from the proposal after it ends the step: that argmax is the bonus). Position 0
            # alone first (one row is the cheap product); once its proposal holds, the rest at once.
            wanted, rows = proposals.tolist(), [head(normed[:, 0])[0]]
            if int(rows[0].argmax()) == wanted[0]:
                rows.extend(head(normed[0, 1:]))
            verified = [int(row.argmax()) for row in rows]
            accepted = accepted_proposals(wanted, verified)
            if accepted >= len(rows):  # more accepted than verified: only a broken rule gets here; record it
                rows.extend(head(normed[0, len(rows) : accepted + 1]))
                verified = [int(row.argmax()) for row in rows]
            new = [*wanted[:accepted], verified[accepted]]  # the accepted proposals, then the target's bonus
            mark()
            new = new[: max_new_tokens - len(result.tokens)]
            cut = _first_stop(new, stop)
            if cut is not None:
                new = new[: cut + 1]
            result.verified.extend(verified[: len(new)])
            result.logits.extend(rows[: len(new)])
            result.accepted.append(accepted)
            result.produced.append(len(new))
            result.sizes.append(size)
            result.tokens.extend(new)
            finished = len(result.tokens) >= max_new_tokens or cut is not None
            mark()
            if not finished:
                # The anchor and the accepted proposals are verified: keep their target keys and drafter context.
                rejected = size - accepted - 1
                if rejected:
                    cache.crop(-rejected)  # transformers 5: a negative count of positions to drop from the end
                mark()
                features = captured_features(captured, layer_ids, normed, accepted + 1)
                mark()
                drafter.extend(features)
                mark()
                anchor = torch.tensor(result.tokens[-1], device=device)
            if profile:
                for part, (a, b) in zip(STEP_PARTS, zip(marks, marks[1:], strict=False), strict=False):
                    seconds[part] += b - a
                seconds["step"] += marks[-1] - marks[0]
    result.decode_s = clock(device) - began
    if profile:
        result.profile = seconds
    return result

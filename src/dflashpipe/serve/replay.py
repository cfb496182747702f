"""Our decoder's proposals at every step the engine drafted: the step-by-step comparison of the served check.

The engine's run is replayed, not run again: the target reads the prompt, then at each of the engine's steps our
drafter proposes after the engine's anchor, the target reads the anchor and the proposals the engine's tokens show
accepted (exactly what a verify step keeps in its cache), and the drafter's context is extended with those
positions' features, as `evaluate.speculative` does after a verify. So both drafters propose from the same context
at every step, whatever either would have accepted, and a disagreement is the drafter read differently (a layer,
a mask token, a config field), not a path that drifted apart.

A step's accepted count is read off the engine's tokens: greedy acceptance keeps the proposals that equal the
tokens after the anchor, up to the first that does not (the bonus token differs from the proposal it replaced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflashpipe.evaluate.speculative import DFlashProposer, accepted_proposals
from dflashpipe.target.adapter import Target
from dflashpipe.target.prefill import captured_features, layer_capture, prefill


@dataclass(frozen=True)
class EngineStep:
    """One draft of the engine: the anchor it drafted after, and its proposals."""

    anchor: int
    proposals: tuple[int, ...]


TIE = 0.05
"""A proposal of the engine's whose logit under our drafter is within this of our top one is a tie, not a
different reading. The engine's drafter reads the engine's target hidden states, which float32 kernels of another
summation order compute slightly otherwise; a barely trained drafter proposes among near-equal frequent tokens, and
that noise reorders them (gaps measured in docs/measurements.md, a few hundredths at most). A misread config moves
the logits by far more (tests/test_serve.py's target layer one off)."""


@dataclass
class Replay:
    """One prompt's comparison: per engine step that was verified, whether our proposals equal the engine's, up to
    a tie (TIE)."""

    equal: list[bool] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    """The steps whose proposals differ: step index, the anchor's position among the new tokens, both proposals, the
    largest logit gap (ours) and whether it is a tie."""


@torch.no_grad()
def replay(
    target: Target, proposer: DFlashProposer, prompt_ids: Sequence[int], tokens: Sequence[int], steps: list[EngineStep]
) -> Replay:
    """Our proposals beside the engine's at each of its steps over `tokens` (its new tokens for the prompt; the first
    is the prefill's). A step drafted after the last token (the engine drafts once more before it notices the end)
    is not compared: nothing verified it. Raises ValueError when an anchor is not the token the steps lead to."""
    layers = list(proposer.target_layer_ids)
    start = prefill(target, prompt_ids, layers)
    proposer.begin(start.features)
    cache, device, result, at = start.cache, target.device, Replay(), 0
    with layer_capture(target.model, layers) as captured:
        for index, step in enumerate(steps):
            if at >= len(tokens) - 1:  # no token after this anchor: a draft nothing verified
                break
            if step.anchor != tokens[at]:
                raise ValueError(
                    f"engine step {index} drafted after token {step.anchor}, but its output has {tokens[at]} at "
                    f"position {at}: the recorded steps are not this prompt's"
                )
            anchor, engine = torch.tensor(tokens[at], device=device), list(step.proposals)
            logits = proposer.drafter.draft_logits(proposer.context, anchor.view(1), len(engine))[0].float()
            ours = logits.argmax(-1).tolist()
            # how far below our top logit each of the engine's proposals lies (0 where they are equal)
            gaps = [round(float(logits[j, ours[j]] - logits[j, engine[j]]), 6) for j in range(len(engine))]
            same = ours == engine or max(gaps) <= TIE
            result.equal.append(same)
            if ours != engine:
                result.mismatches.append(
                    {"step": index, "position": at, "engine": engine, "ours": ours, "gap": max(gaps), "tie": same}
                )
            # the tokens after the anchor are what the target verified: greedy acceptance's rule, evaluate's own
            kept = tokens[at : at + accepted_proposals(step.proposals, tokens[at + 1 :]) + 1]  # anchor + accepted
            normed = target.decoder_forward(torch.tensor([kept], device=device), cache)
            proposer.extend(captured_features(captured, layers, normed, len(kept)))
            at += len(kept)
    return result

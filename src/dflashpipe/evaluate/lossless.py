"""What "lossless" means here, checked on every prompt, in two parts.

1. **Exact, in any dtype.** Every token speculative decoding emits is the target's argmax in the very forward
   that verified it: the accepted proposals, then the bonus token. The decoding loop records that argmax beside
   each emitted token (`Decoded.verified`), apart from the acceptance rule that chose the token, so a broken rule
   (a proposal accepted too many, an off-by-one bonus) is caught whatever the numerics.
2. **Agreement with plain greedy decoding, explained or failed.** Per prompt: the same tokens, or the first
   position where they differ. Up to there both paths read the same context, so at that position their logits
   for the two tokens (the plain path's choice `a`, the speculative path's `b`) are comparable. A verify forward
   over a block and a decode step over one row do not round alike in bfloat16, and where the plain path's margin
   a - b is inside that rounding the two argmaxes may differ honestly. So a divergence is **numerics** when both
   paths see a near-tie between a and b: the plain margin and the speculative path's reverse margin b - a each lie
   within the paths' measured disagreement (`tolerance`). Anything else is a **bug**. In float32 the expectation
   is exact equality: every divergence is a bug.

`tolerance` is measured, not assumed: the largest disagreement of the two paths' top-2 logit gaps at the
positions before the divergence (same context, both computed), and at least one rounding step of the compute
dtype at the logits' size (an exact tie, or a gap of one bfloat16 step, is always numerics). A KV cache cropped
wrongly or a wrong feature row gives logits far outside it, and so a bug.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from dflashpipe.core.errors import DflashpipeError

NUMERICS, BUG = "numerics", "bug"
Verdict = Literal["numerics", "bug"]


class ContractError(DflashpipeError):
    """A decoding run broke the lossless contract (a bug, not numerics)."""


def rounding_step(dtype: torch.dtype, value: float) -> float:
    """The spacing of `dtype`'s values at `value`'s size: one rounding step there (bfloat16 at 20.0: 0.125)."""
    info = torch.finfo(dtype)  # eps: the step just above 1.0 (bfloat16 2^-7, float32 2^-23)
    return math.ldexp(info.eps, math.frexp(abs(value))[1] - 1) if value else info.tiny


def exact_violations(tokens: list[int], verified: list[int]) -> list[int]:
    """Positions whose emitted token is not the verifying forward's argmax (part 1 of the contract)."""
    if len(tokens) != len(verified):
        raise ValueError(f"{len(tokens)} tokens but {len(verified)} verified argmaxes: the loop lost track")
    return [i for i, (t, v) in enumerate(zip(tokens, verified, strict=True)) if t != v]


def first_divergence(plain: list[int], speculative: list[int]) -> int | None:
    """The first position where the two outputs differ (one ending before the other counts), or None."""
    index = next((i for i, (x, y) in enumerate(zip(plain, speculative, strict=False)) if x != y), None)
    return index if index is not None or len(plain) == len(speculative) else min(len(plain), len(speculative))


def _gap(row: torch.Tensor, a: int, b: int) -> float:
    return float(row[a].float() - row[b].float())


@dataclass(frozen=True)
class Divergence:
    """The first position where speculative decoding left plain greedy decoding, and why."""

    position: int
    """Index into the new tokens (0 = the prefill's token)."""
    plain_token: int
    speculative_token: int
    margin: float
    """The plain path's logit of its own token minus that of the speculative path's token (>= 0)."""
    reverse_margin: float
    """The speculative path's logit of its token minus that of the plain path's token (>= 0 when exact)."""
    difference: float
    """How far the two paths' gaps between those two tokens differ there: margin + reverse_margin."""
    tolerance: float
    """The paths' measured disagreement before this position, at least one rounding step of the dtype."""
    verdict: Verdict

    def to_json(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def judge(
    plain_tokens: list[int],
    plain_logits: list[torch.Tensor],
    speculative_tokens: list[int],
    speculative_logits: list[torch.Tensor],
    dtype: torch.dtype,
) -> Divergence | None:
    """Part 2 of the contract for one prompt: None when the outputs agree, else the first divergence judged.

    `*_logits[i]` is the row [vocab] of logits the path chose token i from (both paths share the prefill's row
    at 0). `dtype`: what the target computed in; float32 expects exact equality."""
    p = first_divergence(plain_tokens, speculative_tokens)
    if p is None:
        return None
    if p >= min(len(plain_tokens), len(speculative_tokens)):
        # one path stopped where the other went on: no token pair to weigh, so no numerics to blame
        a = plain_tokens[p] if p < len(plain_tokens) else -1
        b = speculative_tokens[p] if p < len(speculative_tokens) else -1
        return Divergence(p, a, b, math.inf, math.inf, math.inf, 0.0, BUG)
    a, b = plain_tokens[p], speculative_tokens[p]
    plain, spec = plain_logits[p], speculative_logits[p]
    margin, reverse = _gap(plain, a, b), _gap(spec, b, a)
    size = max(abs(float(plain[a])), abs(float(plain[b])), abs(float(spec[a])), abs(float(spec[b])))
    noise = 0.0
    for j in range(1, p):  # position 0 is the shared prefill's row: no disagreement to measure
        top2 = torch.topk(plain_logits[j].float(), 2).indices.tolist()
        noise = max(noise, abs(_gap(plain_logits[j], *top2) - _gap(speculative_logits[j], *top2)))
    tolerance = max(noise, rounding_step(dtype, size))
    near_tie = dtype != torch.float32 and margin <= tolerance and reverse <= tolerance
    return Divergence(p, a, b, margin, reverse, margin + reverse, tolerance, NUMERICS if near_tie else BUG)

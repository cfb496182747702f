"""The lossless contract's judge (dflashpipe.evaluate.lossless) on logits rows shaped like the divergences
bfloat16 decoding really shows on a CPU: an exact tie, a margin of one bfloat16 step, and a margin no rounding
explains. The decoding loop and the stage are held to it in tests/test_evaluate.py."""

from __future__ import annotations

import pytest
import torch

from dflashpipe.evaluate.lossless import BUG, NUMERICS, exact_violations, first_divergence, judge, rounding_step

VOCAB = 6


def row(**logits: float) -> torch.Tensor:
    """A logits row over VOCAB tokens, -10 except the ones named t0..t5, in bfloat16 as the head gives them."""
    values = torch.full((VOCAB,), -10.0)
    for name, value in logits.items():
        values[int(name[1:])] = value
    return values.to(torch.bfloat16)


def test_rounding_step_is_the_dtypes_spacing_at_that_size():
    assert rounding_step(torch.bfloat16, 20.0) == 0.125  # 16 <= x < 32: 2^4 x 2^-7
    assert rounding_step(torch.bfloat16, 10.0) == 0.0625
    assert rounding_step(torch.float32, 20.0) == 2.0**-19


def test_outputs_that_agree_have_no_divergence_and_a_shorter_one_diverges_where_it_ends():
    rows = [row(t1=5.0)] * 3
    assert judge([1, 1, 1], rows, [1, 1, 1], rows, torch.bfloat16) is None
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1, 2], [1, 3]) == 1
    assert judge([1, 2], rows, [1, 2, 3], rows, torch.bfloat16).verdict == BUG  # nothing to weigh: not numerics


@pytest.mark.parametrize(
    ("plain", "speculative", "verdict"),
    [
        (row(t2=28.0, t3=28.0), row(t2=28.0, t3=28.125), NUMERICS),  # an exact tie on the plain side
        (row(t2=20.125, t3=20.0), row(t2=20.0, t3=20.125), NUMERICS),  # one bfloat16 step each way
        (row(t2=23.0, t3=20.0), row(t2=20.0, t3=23.0), BUG),  # 3.0 apart: no rounding explains it
        (row(t2=20.125, t3=20.0), row(t2=10.0, t3=20.0), BUG),  # a near-tie for plain, not for speculative
    ],
)
def test_a_divergence_is_numerics_only_where_both_paths_see_a_near_tie(plain, speculative, verdict):
    shared = row(t1=9.0)
    found = judge([1, 2], [shared, plain], [1, 3], [shared, speculative], torch.bfloat16)
    assert (found.position, found.plain_token, found.speculative_token, found.verdict) == (1, 2, 3, verdict)
    assert found.margin >= 0 and found.difference == pytest.approx(found.margin + found.reverse_margin)


def test_float32_expects_exact_equality():
    shared, tie = row(t1=9.0), row(t2=28.0, t3=28.0)
    assert judge([1, 2], [shared, tie], [1, 3], [shared, tie], torch.float32).verdict == BUG


def test_the_tolerance_is_the_paths_measured_disagreement_before_the_divergence():
    """Before it, both paths computed the same positions; their top-2 gaps differed by 0.5 there, so a margin of
    0.375 at the divergence is inside what the numerics already did on this prompt (one step alone is 0.125)."""
    shared = row(t1=9.0)
    plain = [shared, row(t4=20.5, t5=20.0), row(t2=20.375, t3=20.0)]
    spec = [shared, row(t4=20.0, t5=20.0), row(t2=20.0, t3=20.125)]
    found = judge([1, 4, 2], plain, [1, 4, 3], spec, torch.bfloat16)
    assert found.tolerance == 0.5 and found.verdict == NUMERICS
    alone = judge([1, 2], [shared, plain[2]], [1, 3], [shared, spec[2]], torch.bfloat16)
    assert alone.tolerance == 0.125 and alone.verdict == BUG


def test_exactness_names_the_tokens_the_verify_forward_did_not_choose():
    assert exact_violations([5, 6, 7], [5, 6, 7]) == []
    assert exact_violations([5, 9, 7], [5, 6, 7]) == [1]
    with pytest.raises(ValueError, match="lost track"):
        exact_violations([5, 6], [5])

"""The chunked loss is the unchunked definition: same loss, slot counts and gradients, chunk by chunk.

`decay_weighted_loss` over full logits is the reference; the chunked form computes the same from the
hidden states and the frozen LM head, holding one chunk's logits at a time (model/loss.py). With
distillation the reference is autograd through the textbook CE / KL over the target's full logits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflashpipe.model.loss import chunked_decay_weighted_loss, decay_weighted_loss

B, A, SLOTS, H, V = 2, 3, 5, 16, 97


def case(dtype: torch.dtype, seed: int = 0, weights: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, A, SLOTS, H, generator=g, dtype=dtype)
    head = nn.Linear(H, V, bias=False).to(dtype).requires_grad_(False)
    head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype))
    labels = torch.randint(0, V, (B, A, SLOTS), generator=g)
    if weights is None:
        weights = torch.rand(B, A, SLOTS, generator=g)
        weights[0, 1] = 0.0  # a padding anchor: rows of zero weight
        weights[1, :, 3] = 0.0
    # Make some argmaxes right, so slot_correct is not all zeros.
    labels[0, 0] = (hidden[0, 0] @ head.weight.t()).argmax(-1)
    return hidden, head, labels, weights


def both(hidden, head, labels, weights, rows, autocast_dtype=None, teacher=None, distill="none", alpha=0.0):
    """(loss, slot_correct, slot_count, grad wrt hidden) for the reference and the chunked form."""
    out = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            if chunked:
                terms = chunked_decay_weighted_loss(h, head, labels, weights, rows, teacher, distill, alpha)
            else:
                t_logits = None if teacher is None else head(teacher)
                terms = decay_weighted_loss(head(h.to(head.weight.dtype)), labels, weights, t_logits, distill, alpha)
        terms.loss.backward()
        out.append((terms.loss.detach(), terms.slot_correct, terms.slot_count, h.grad))
    return out


def test_float64_chunked_equals_unchunked_for_every_chunk_size():
    hidden, head, labels, weights = case(torch.float64)
    for rows in (1, 7, 30, B * A * SLOTS, 1000):  # one row, uneven chunks, exact fit, one chunk
        (ref, ref_correct, ref_count, ref_grad), (got, correct, count, grad) = both(hidden, head, labels, weights, rows)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        assert torch.equal(correct, ref_correct) and torch.equal(count, ref_count)
        assert ref_correct.sum() > 0 and grad[0, 1].abs().sum() == 0  # zero-weight rows get zero gradient


def test_float32_chunked_matches_unchunked_within_float32_rounding():
    hidden, head, labels, weights = case(torch.float32, seed=1)
    (ref, ref_correct, ref_count, ref_grad), (got, correct, count, grad) = both(hidden, head, labels, weights, rows=4)
    # Stated tolerance: fp32 rounding of a 97-way logsumexp summed over 30 rows (relative ~1e-6).
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(correct, ref_correct) and torch.equal(count, ref_count)


def test_bf16_autocast_on_cpu_matches_unchunked():
    hidden, head, labels, weights = case(torch.float32, seed=2)
    (ref, _, ref_count, ref_grad), (got, _, count, grad) = both(hidden, head, labels, weights, 4, torch.bfloat16)
    assert grad.dtype == torch.float32 and torch.equal(count, ref_count)
    # Both compute the logits in bf16 and the CE in fp32; only the order of the bf16 matmul's sums may differ.
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad, ref_grad, rtol=2e-2, atol=2e-3)


def test_a_batch_without_a_supervised_slot_gives_loss_zero_and_zero_gradient():
    hidden, head, labels, weights = case(torch.float32, weights=torch.zeros(B, A, SLOTS))
    (ref, _, _, ref_grad), (got, correct, count, grad) = both(hidden, head, labels, weights, rows=4)
    assert got.item() == 0.0 == ref.item()
    assert torch.isfinite(grad).all() and grad.abs().sum() == 0
    assert count.sum() == 0 and correct.sum() == 0


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_compiled_fullgraph_gives_the_eager_loss_and_gradient(autocast):
    hidden, head, labels, weights = case(torch.float32, seed=3)

    def step(h):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return tuple(chunked_decay_weighted_loss(h, head, labels, weights, rows=8))

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, dynamic=False)):
        h = hidden.clone().requires_grad_(True)
        loss, correct, count, accepted, blocks = fn(h)
        loss.backward()
        results.append((loss.detach(), correct, count, h.grad))
        assert blocks.item() == (weights[..., 0] > 0).sum().item()
    # Compiled kernels may sum in another order: fp32 rounding, or bf16's when the logits are bf16.
    tol = {"rtol": 1e-2, "atol": 1e-3} if autocast else {"rtol": 1e-5, "atol": 1e-6}
    for got, ref in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, ref, **tol)


def test_a_trainable_lm_head_or_one_with_bias_is_refused():
    hidden, head, labels, weights = case(torch.float32)
    for bad in (head.requires_grad_(True), nn.Linear(H, V, bias=True).requires_grad_(False)):
        try:
            chunked_decay_weighted_loss(hidden, bad, labels, weights)
        except ValueError as exc:
            assert "frozen LM head" in str(exc)
        else:
            raise AssertionError("accepted an LM head it cannot differentiate correctly")


@pytest.mark.parametrize("distill", ["argmax", "kl"])
def test_distilled_chunked_equals_the_unchunked_definition(distill):
    hidden, head, labels, weights = case(torch.float64, seed=4)
    teacher = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for rows in (1, 7, 1000):
        (ref, ref_correct, ref_count, ref_grad), (got, correct, count, grad) = both(
            hidden, head, labels, weights, rows, teacher=teacher, distill=distill, alpha=0.3
        )
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
        assert torch.equal(correct, ref_correct) and torch.equal(count, ref_count)
    plain = both(hidden, head, labels, weights, 7)[0][0]
    assert not torch.allclose(got, plain)  # the target's term is really in it


def test_distill_weight_mixes_data_and_target_terms():
    hidden, head, labels, weights = case(torch.float64, seed=6)
    plain = chunked_decay_weighted_loss(hidden, head, labels, weights, 7).loss
    # weight 0: exactly the data loss; KL to itself is 0, so weight w leaves (1 - w) x the data loss
    for distill in ("argmax", "kl"):
        none_share = chunked_decay_weighted_loss(hidden, head, labels, weights, 7, hidden, distill, 0.0).loss
        torch.testing.assert_close(none_share, plain, rtol=1e-12, atol=1e-12)
    to_itself = chunked_decay_weighted_loss(hidden, head, labels, weights, 7, hidden, "kl", 0.25).loss
    torch.testing.assert_close(to_itself, 0.75 * plain, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="needs the target's hidden states"):
        chunked_decay_weighted_loss(hidden, head, labels, weights, 7, None, "kl", 0.5)


def test_acceptance_counts_the_leading_run_of_right_supervised_slots_per_block():
    """Simulated greedy verification on training blocks: a run stops at the first wrong or unsupervised slot,
    and a block whose slot 1 is unsupervised is no block (decoding never verifies one there)."""
    labels = torch.tensor([[[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]]])
    predicted = torch.tensor([[[1, 2, 0], [0, 2, 3], [1, 2, 3], [1, 2, 3]]])
    weights = torch.tensor([[[1.0, 1, 1], [1, 1, 1], [1, 0, 1], [0, 1, 1]]])
    logits = torch.nn.functional.one_hot(predicted, 5).float() * 10
    out = decay_weighted_loss(logits, labels, weights)
    # blocks 0, 1, 2 count; they accept 2, 0 and 1 (block 2's run stops at its unsupervised slot 2)
    assert out.blocks.item() == 3 and out.accepted.item() == 3
    assert out.acceptance_length.item() == pytest.approx(2.0)

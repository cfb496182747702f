"""Packed rows: whole documents packed into fixed-shape rows, each document seeing only itself.

The oracle for every packed computation is the same computation on each document alone: the
target's features (block-diagonal causal mask), the drafter's block hidden states (DFlash mask
with documents, both backends) and the labels and weights of its blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflashpipe.features.packing import OPEN_ROWS, collate, pack_rows
from dflashpipe.model.anchors import anchor_candidates
from dflashpipe.model.loss import block_labels
from dflashpipe.target.hidden_states import target_features_and_predictions, target_layer_features
from dflashpipe.tokens.shards import load_tokens
from dflashpipe.train.data import BatchPlan, epoch_order
from tests.test_model import eager_flex
from tests.test_target_side import tiny_target as hf_target
from tests.tiny import VOCAB, random_target, target_config, tiny_drafter

# -- packing -------------------------------------------------------------------------------------


def test_an_epoch_packs_every_sequence_once_whole_and_wastes_less_than_one_a_row():
    rng = np.random.default_rng(0)
    seq_len = 256
    lengths = np.concatenate([rng.integers(8, 200, size=300), [256, 300, 1000]])  # 2 longer than a row
    order = epoch_order(len(lengths), 5, 0)
    rows = pack_rows(order, lengths, seq_len)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert [i for row in rows for i in row] != list(order)  # first fit reorders within an epoch
    cut = np.minimum(lengths, seq_len)
    assert all(sum(cut[i] for i in row) <= seq_len for row in rows)
    assert any(len(row) > 1 for row in rows)
    assert pack_rows(order, lengths, seq_len) == rows  # the same order packs the same rows
    padding = 1 - cut.sum() / (len(rows) * seq_len)
    one_a_row = 1 - cut.sum() / (len(lengths) * seq_len)
    print(f"padding: packed {padding:.3f}, one sequence a row {one_a_row:.3f}, {OPEN_ROWS} open rows")
    assert padding < 0.1 < 0.4 < one_a_row


def test_a_resumed_plan_gives_each_step_the_rows_an_uninterrupted_one_does():
    lengths = np.random.default_rng(1).integers(4, 60, size=50)
    plan = BatchPlan(lengths, 64, world_size=2, replicas=2, micro_batch=2, seed=1)
    steps = [[plan.rows(s, rank, r) for rank in range(2) for r in range(2)] for s in range(12)]  # > 2 epochs
    resumed = BatchPlan(lengths, 64, world_size=2, replicas=2, micro_batch=2, seed=1)
    assert [resumed.rows(s, rank, r) for s in (9, 3) for rank in range(2) for r in range(2)] == steps[9] + steps[3]
    first, second = (pack_rows(epoch_order(50, 1, epoch), lengths, 64) for epoch in (0, 1))
    stream = [row for step in steps for rows in step for row in rows]
    assert stream[: len(first) + len(second)] == first + second


@pytest.fixture(scope="module")
def data(train_inputs):
    return load_tokens(train_inputs / "tokens")


def test_collate_lays_out_whole_documents_with_their_ids_and_positions(data):
    seq_len = int(np.percentile(data.lengths, 90))  # a few sequences are cut
    epoch = pack_rows(epoch_order(len(data), 0, 0), data.lengths, seq_len)
    truncated = pad_tokens = 0
    for first in range(0, len(epoch), 4):
        rows = epoch[first : first + 4]
        batch = collate(data, rows, seq_len, pad_id=7)
        for r, row in enumerate(rows):
            start = 0
            for d, i in enumerate(row):
                ids, mask = data.sequence(i)
                n = min(len(ids), seq_len)
                assert torch.equal(batch.input_ids[r, start : start + n], torch.from_numpy(ids[:n].astype(np.int64)))
                assert torch.equal(batch.loss_mask[r, start : start + n], torch.from_numpy(mask[:n].astype(np.int64)))
                assert (batch.document_ids[r, start : start + n] == d).all()
                assert torch.equal(batch.position_ids[r, start : start + n], torch.arange(n))
                start += n
            assert (batch.input_ids[r, start:] == 7).all() and (batch.document_ids[r, start:] == -1).all()
            assert batch.attention_mask[r, :start].all() and not batch.attention_mask[r, start:].any()
            assert not batch.loss_mask[r, start:].any()
        truncated += batch.truncated
        pad_tokens += batch.padding_fraction * len(rows) * seq_len
    assert truncated == (data.lengths > seq_len).sum() > 0
    cut = np.minimum(data.lengths, seq_len).sum()
    assert pad_tokens == pytest.approx(len(epoch) * seq_len - cut) and pad_tokens > 0
    with pytest.raises(ValueError, match="more than seq_len"):
        collate(data, [list(range(len(data)))], seq_len, pad_id=7)


# -- the target: a packed row's features are each document's features alone ------------------------


def packed_row(lengths: list[int], seq_len: int, vocab: int, seed: int = 0):
    """Random ids of documents of `lengths` laid out one after another, padded: ids, documents, positions."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab - 1, (1, seq_len), generator=g)
    documents = torch.full((1, seq_len), -1)
    positions = torch.zeros((1, seq_len), dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths):
        documents[0, start : start + n] = d
        positions[0, start : start + n] = torch.arange(n)
        start += n
    ids[0, start:] = 0
    return ids, documents, positions


def targets():
    yield "llama-sdpa", random_target(target_config(VOCAB, attn_implementation="sdpa")), [1, 3, 5]
    yield "llama-eager", random_target(target_config(VOCAB, attn_implementation="eager")), [0, 2, 5]
    # Sliding layers (3..) over a 4-token window: the window applies within a document too.
    yield "qwen3-sliding", hf_target("qwen3", "sdpa"), [1, 4]


def test_a_packed_rows_target_features_are_each_documents_features_alone():
    lengths, seq_len = [7, 12, 1, 5], 32
    ids, documents, positions = packed_row(lengths, seq_len, VOCAB)
    attention = (documents >= 0).long()
    worst = {}
    for name, target, layer_ids in targets():
        with torch.no_grad():
            packed = target_layer_features(target, ids, attention, layer_ids, documents, positions)
            # Distillation's path: the same features, and the target's logits at every position of the row.
            every = torch.arange(seq_len)[None]
            same, predicted = target_features_and_predictions(
                target, ids, attention, layer_ids, every, documents, positions
            )
            assert torch.equal(same, packed)
            start = 0
            for n in lengths:
                alone = target_layer_features(target, ids[:, start : start + n], None, layer_ids)
                err = (packed[:, start : start + n] - alone).abs().max().item()
                logits = target(input_ids=ids[:, start : start + n]).logits
                err_logits = (target.lm_head(predicted[:, start : start + n]) - logits).abs().max().item()
                worst[name] = max(worst.get(name, 0.0), err / alone.abs().max().item())
                worst[name] = max(worst[name], err_logits / logits.abs().max().item())
                start += n
            # Against the full model's own forward too, for the last document.
            full = target(input_ids=ids[:, start - n : start], output_hidden_states=True).hidden_states
            assert torch.allclose(packed[:, start - n : start, : full[1].shape[-1]], full[layer_ids[0] + 1], atol=1e-5)
    print("packed vs alone, max relative error:", {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) < 1e-5


def test_packed_target_features_need_both_documents_and_positions():
    _, target, layer_ids = next(targets())
    ids, documents, positions = packed_row([4, 4], 8, VOCAB)
    with pytest.raises(ValueError, match="both document_ids and position_ids"):
        target_layer_features(target, ids, None, layer_ids, documents, None)


# -- the drafter: a block sees its own document only ------------------------------------------------


def packed_drafter_case(drafter, lengths=(9, 14, 6), seq_len=32):
    """Features and ids of a packed row, and anchors in each document (one whose block runs past its end)."""
    ids, documents, positions = packed_row(list(lengths), seq_len, drafter.config.vocab_size - 1, seed=3)
    features = torch.randn(1, seq_len, drafter.config.feature_size, generator=torch.Generator().manual_seed(4))
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    local = [[1, 5], [0, 6, 12], [2]]  # 12 + block size 4 runs past document 1's end (14)
    anchors = torch.tensor([[starts[d] + a for d in range(3) for a in local[d]]])
    return features, ids, documents, positions, starts, local, anchors


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_a_packed_rows_blocks_are_each_documents_blocks_alone(backend):
    drafter = tiny_drafter(attention="sdpa")
    features, ids, documents, positions, starts, local, anchors = packed_drafter_case(drafter)
    lengths = (9, 14, 6)
    with torch.no_grad():
        if backend == "flex":
            drafter.attention, drafter.compile_flex = "flex", False
        with eager_flex():
            packed = drafter.block_hidden(features, ids, anchors, documents, positions)
            k, worst = 0, 0.0
            for d, n in enumerate(lengths):
                part = slice(starts[d], starts[d] + n)
                alone = drafter.block_hidden(features[:, part], ids[:, part], torch.tensor([local[d]]))
                got = packed[:, k : k + len(local[d])]
                worst = max(worst, ((got - alone).abs().max() / alone.abs().max()).item())
                k += len(local[d])
    print(f"{backend}: packed vs alone block hidden states, max relative error {worst:.1e}")
    assert worst < 1e-5
    # Without the documents the row is one long document, and the later blocks read the earlier documents.
    with torch.no_grad(), eager_flex():
        unpacked = drafter.block_hidden(features, ids, anchors)
    assert not torch.allclose(unpacked[:, 2:], packed[:, 2:], atol=1e-3)


def test_block_labels_stop_at_the_end_of_the_anchors_document():
    drafter = tiny_drafter()
    _, ids, documents, _, starts, local, anchors = packed_drafter_case(drafter)
    loss_mask = (documents >= 0).long()
    valid = torch.ones_like(anchors, dtype=torch.bool)
    labels, weights = block_labels(ids, loss_mask, anchors, valid, 4, 4.0, documents)
    k = 0
    for d, n in enumerate((9, 14, 6)):
        part = slice(starts[d], starts[d] + n)
        want_labels, want_weights = block_labels(
            ids[:, part], loss_mask[:, part], torch.tensor([local[d]]), valid[:, : len(local[d])], 4, 4.0
        )
        got = slice(k, k + len(local[d]))
        assert torch.equal(weights[:, got], want_weights)
        assert torch.equal(labels[:, got][want_weights > 0], want_labels[want_weights > 0])
        k += len(local[d])
    assert weights[0, 4].tolist()[1:] == [0.0, 0.0]  # anchor 12 of 14 tokens: slot 1 only


def test_no_anchor_on_a_documents_last_token_even_before_a_supervised_document():
    loss_mask = torch.ones(1, 10, dtype=torch.long)
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    assert anchor_candidates(loss_mask)[0].tolist() == [True] * 9 + [False]
    assert anchor_candidates(loss_mask, documents)[0].tolist() == [1, 1, 1, 0, 1, 1, 0, 1, 1, 0]

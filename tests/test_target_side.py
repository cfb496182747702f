"""The target side of training: the truncated target forward and the token data's memory footprint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflashpipe.model.features import target_features, target_layer_features
from dflashpipe.tokens.shards import TokenData, load_tokens
from dflashpipe.train.data import collate

NUM_LAYERS = 6


def tiny_target(kind: str, attn: str):
    """A random-init 6-layer Llama (or Qwen3 with sliding-window layers), float32, eval."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:  # layers 3.. slide over a 4-token window: the sliding mask is built too
        config = Qwen3Config(**shape, head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=3)
        assert "sliding_attention" in config.layer_types
        model = Qwen3ForCausalLM(config)
    return model.float().eval().requires_grad_(False)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """3 right-padded rows of 16 tokens (lengths 16, 11 and 5; pad id 0)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (3, 16), generator=g)
    attention = torch.zeros(3, 16, dtype=torch.long)
    for row, n in enumerate((16, 11, 5)):
        attention[row, :n] = 1
        ids[row, n:] = 0
    return ids, attention


@pytest.mark.parametrize(("kind", "attn"), [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa")])
def test_truncated_target_forward_gives_exactly_the_full_models_features(kind, attn):
    target = tiny_target(kind, attn)
    ids, attention = padded_batch()
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        for layer_ids in ([1], [1, 3], [0, 2, 4], [0], [2, NUM_LAYERS - 1]):
            want = target_features(out.hidden_states, layer_ids)
            got = target_layer_features(target, ids, attention, layer_ids)
            assert got.dtype == want.dtype and got.shape == want.shape == (3, 16, 64 * len(layer_ids))
            assert torch.equal(got, want), (layer_ids, (got - want).abs().max())


def test_truncated_target_forward_never_runs_later_layers_or_the_lm_head():
    target = tiny_target("llama", "sdpa")
    ids, attention = padded_batch()
    calls = {k: 0 for k in range(NUM_LAYERS)} | {"norm": 0, "lm_head": 0}

    def count(key):
        def hook(*_):
            calls[key] += 1

        return hook

    handles = [layer.register_forward_hook(count(k)) for k, layer in enumerate(target.model.layers)]
    handles += [target.model.norm.register_forward_hook(count("norm"))]
    handles += [target.lm_head.register_forward_hook(count("lm_head"))]
    try:
        with torch.no_grad():
            target_layer_features(target, ids, attention, [0, 2])
    finally:
        for h in handles:
            h.remove()
    assert calls == {0: 1, 1: 1, 2: 1, 3: 0, 4: 0, 5: 0, "norm": 0, "lm_head": 0}


def test_truncated_target_forward_refuses_layer_ids_the_target_lacks():
    target = tiny_target("llama", "sdpa")
    ids, attention = padded_batch()
    for bad in ([], [NUM_LAYERS], [3, 1], [-1]):
        with pytest.raises(ValueError, match="target layer ids"):
            target_layer_features(target, ids, attention, bad)


@pytest.fixture(scope="module")
def tokens_dir(train_inputs):
    """A real tokens directory: real chat data tokenized with the real SmolLM2 tokenizer."""
    return train_inputs / "tokens"


def test_load_tokens_keeps_the_stored_dtypes(tokens_dir):
    data = load_tokens(tokens_dir)
    n = len(data.ids)
    assert n > 0 and len(data) > 1
    assert data.ids.dtype == np.int32 and data.ids.nbytes == 4 * n
    assert data.loss_mask.dtype == np.uint8 and data.loss_mask.nbytes == n and len(data.loss_mask) == n
    assert data.offsets.dtype == np.int64 and data.offsets.nbytes == 8 * (len(data) + 1)
    assert data.offsets[0] == 0 and data.offsets[-1] == n
    assert set(np.unique(data.loss_mask)) <= {0, 1}
    assert data.supervised_tokens == int(data.loss_mask.astype(np.int64).sum()) > 0


def test_collate_of_the_stored_dtypes_equals_collate_of_int64(tokens_dir):
    data = load_tokens(tokens_dir)
    wide = TokenData(data.ids.astype(np.int64), data.loss_mask.astype(np.int64), data.offsets)
    lengths = np.diff(data.offsets)
    indices = list(range(len(data)))
    # seq_len below the longest sequence (truncation) and above it (padding)
    for seq_len in (int(np.median(lengths)), int(lengths.max()) + 7):
        for start in range(0, len(indices), 4):
            batch_indices = indices[start : start + 4]
            got = collate(data, batch_indices, seq_len, pad_id=5)
            want = collate(wide, batch_indices, seq_len, pad_id=5)
            for name in ("input_ids", "loss_mask", "attention_mask"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype == torch.long and torch.equal(a, b), name
            assert got.truncated == want.truncated
    assert any(collate(data, [i], int(np.median(lengths)), 5).truncated for i in indices)

"""The target side of training: the truncated target forward and the token data's memory footprint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflashpipe.features.packing import collate
from dflashpipe.model.target_layers import target_features
from dflashpipe.target.hidden_states import target_features_and_predictions, target_layer_features
from dflashpipe.tokens.shards import TokenData, TokenShard, load_tokens

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


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_target_predictions_at_block_positions_are_the_full_models_logits_there(kind):
    target = tiny_target(kind, "sdpa")
    ids, attention = padded_batch()
    at = torch.tensor([[[0, 1, 2], [7, 8, 9]], [[3, 4, 5], [8, 9, 10]], [[0, 1, 2], [2, 3, 4]]])  # [B, A, slots]
    with torch.no_grad():
        full = target(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        features, hidden = target_features_and_predictions(target, ids, attention, [1, 3], at)
        logits = target.lm_head(hidden)
    assert torch.equal(features, target_features(full.hidden_states, [1, 3]))
    want = full.logits.gather(1, at.flatten(1)[..., None].expand(-1, -1, 128)).view(3, 2, 3, 128)
    assert hidden.shape == (3, 2, 3, 64)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


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
    assert len(data) > 1 and len(data.shards) > 1
    assert data.lengths.dtype == np.int64 and len(data.lengths) == len(data)
    assert data.lengths.tolist() == np.concatenate([np.diff(s.offsets) for s in data.shards]).tolist()
    for shard in data.shards:
        assert shard.ids.dtype == np.int32 and shard.loss_mask.dtype == np.uint8 and shard.offsets.dtype == np.int64
        assert len(shard.ids) == len(shard.loss_mask) == shard.offsets[-1] and shard.offsets[0] == 0
        assert set(np.unique(shard.loss_mask)) <= {0, 1}
    supervised = 0
    for i in range(len(data)):
        ids, mask = data.sequence(i)
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and len(ids) == len(mask) == data.lengths[i]
        supervised += int(mask.sum(dtype=np.int64))
    assert data.supervised_tokens == supervised > 0
    with pytest.raises(IndexError):
        data.sequence(len(data))


def mapped_files(array: np.ndarray) -> set[str]:
    """The files whose mapping (in /proc/self/maps) holds `array`'s memory: none for a copy in the heap."""
    address = array.__array_interface__["data"][0]
    found = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high and len(fields) > 5:
            found.add(fields[5])
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's /proc/self/maps")
def test_load_tokens_maps_the_shards_instead_of_copying_them(tokens_dir):
    data = load_tokens(tokens_dir)
    files = [entry["file"] for entry in json.loads((tokens_dir / "summary.json").read_text())["shards"]]
    for index, shard in enumerate(data.shards):
        path = str((tokens_dir / files[index]).resolve())
        for array in (shard.ids, shard.loss_mask):
            assert mapped_files(array) == {path}
        ids, mask = data.sequence(int(data.starts[index]))
        assert np.shares_memory(ids, shard.ids) and np.shares_memory(mask, shard.loss_mask)
    # the index alone is this process's own memory (a copy: a file-backed mapping is a file's path)
    for index in (data.lengths, data.starts, *(s.offsets for s in data.shards)):
        assert not any(name.startswith("/") for name in mapped_files(index))


def test_collate_of_the_stored_dtypes_equals_collate_of_int64(tokens_dir):
    data = load_tokens(tokens_dir)
    wide = TokenData(
        tuple(TokenShard.of(s.ids.astype(np.int64), s.loss_mask.astype(np.int64), s.offsets) for s in data.shards)
    )
    lengths = data.lengths
    indices = list(range(len(data)))
    # seq_len below the longest sequence (truncation) and above it (padding)
    for seq_len in (int(np.median(lengths)), int(lengths.max()) + 7):
        for start in range(0, len(indices), 4):
            rows = [[i] for i in indices[start : start + 4]]  # one sequence a row
            got = collate(data, rows, seq_len, pad_id=5)
            want = collate(wide, rows, seq_len, pad_id=5)
            for name in ("input_ids", "loss_mask", "attention_mask"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype == torch.long and torch.equal(a, b), name
            assert got.truncated == want.truncated
    assert any(collate(data, [[i]], int(np.median(lengths)), 5).truncated for i in indices)

"""The DFlash drafter: one mask for two backends, the loss, anchors, and the published checkpoint format.

Tiny random configs throughout; the published reference (`dflash`, inference only) is the oracle
for the architecture and the checkpoint format, a plain Python loop the oracle for the mask.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import warnings

import pytest
import torch
import yaml
from torch.nn.attention.flex_attention import create_block_mask

from dflashpipe.core.errors import ParamsError, SourceError
from dflashpipe.core.params import load_params
from dflashpipe.model import DFlashConfig, DFlashDrafter, TargetHead, sample_anchor_positions
from dflashpipe.model.anchors import anchor_candidates
from dflashpipe.model.config import ARCHITECTURE
from dflashpipe.model.loss import block_labels, decay_weighted_loss
from dflashpipe.model.mask import dense_mask, dflash_mask_mod
from dflashpipe.model.mask_token import resolve_mask_token_id
from dflashpipe.model.target_layers import spaced_target_layer_ids, target_features
from tests.conftest import ROOT
from tests.tiny import (
    MASK_ID,
    VOCAB,
    random_batch,
    tiny_config,  # noqa: F401 - tests/reliability/test_corrupted.py imports it from here
    tiny_drafter,
    tiny_target,
)

CPU = torch.device("cpu")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@contextlib.contextmanager
def eager_flex():
    """Eager flex warns that it is unfused; on the CPU in tests that is the point, not a problem."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


# -- the mask -----------------------------------------------------------------------------------


def mask_by_loops(
    anchors: torch.Tensor, context_len: int, block_size: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """The DFlash rule written out position by position: the oracle for the mask_mod. With `documents`
    (a packed row), a block sees only context of its anchor's document."""
    batch, num_anchors = anchors.shape
    q_len = num_anchors * block_size
    out = torch.zeros(batch, 1, q_len, context_len + q_len, dtype=torch.bool)
    for b in range(batch):
        for q in range(q_len):
            block = q // block_size
            anchor = anchors[b, block]
            for kv in range(context_len):
                same = documents is None or documents[b, kv] == documents[b, anchor]
                out[b, 0, q, kv] = kv < anchor and same
            for slot in range(block_size):
                out[b, 0, q, context_len + block * block_size + slot] = True
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    ("batch", "context_len", "num_anchors", "block_size"),
    [(1, 8, 2, 3), (2, 40, 5, 4), (3, 130, 9, 16), (2, 300, 17, 8)],
)
def test_dense_mask_and_block_mask_both_follow_the_dflash_rule(batch, context_len, num_anchors, block_size, packed):
    g = torch.Generator().manual_seed(context_len)
    anchors = torch.sort(torch.randint(0, context_len, (batch, num_anchors), generator=g), dim=1).values
    documents = None
    if packed:  # documents start at random positions (a new one at 0 and wherever the draw is 1)
        documents = torch.randint(0, 4, (batch, context_len), generator=g).eq(1).long().cumsum(dim=1)
    mask_mod = dflash_mask_mod(anchors, context_len, block_size, documents)
    q_len, kv_len = num_anchors * block_size, context_len + num_anchors * block_size
    dense = dense_mask(mask_mod, batch, q_len, kv_len, CPU)
    assert torch.equal(dense, mask_by_loops(anchors, context_len, block_size, documents))

    # The BlockMask, tile by tile: a tile is computed iff some entry is visible, "full" iff all are.
    tile = 16
    block_mask = create_block_mask(mask_mod, batch, None, q_len, kv_len, device="cpu", BLOCK_SIZE=tile)
    pad_q, pad_kv = -q_len % tile, -kv_len % tile
    padded = torch.nn.functional.pad(dense, (0, pad_kv, 0, pad_q))
    tiles = padded.view(batch, 1, (q_len + pad_q) // tile, tile, (kv_len + pad_kv) // tile, tile)
    any_visible = tiles.any(dim=(3, 5))
    assert torch.equal(block_mask.to_dense().bool(), any_visible)
    full = torch.zeros_like(any_visible)
    for b in range(batch):
        for row in range(full.shape[2]):
            n = block_mask.full_kv_num_blocks[b, 0, row]
            full[b, 0, row, block_mask.full_kv_indices[b, 0, row, :n]] = True
    # Only tiles entirely inside the real (unpadded) mask can be full.
    real = torch.zeros_like(padded)
    real[..., :q_len, :kv_len] = True
    all_visible = (tiles & real.view_as(tiles)).all(dim=(3, 5)) & real.view_as(tiles).all(dim=(3, 5))
    assert torch.equal(full, all_visible)


# -- flex == sdpa -------------------------------------------------------------------------------


def test_flex_and_sdpa_give_the_same_drafter_outputs():
    drafter = tiny_drafter(attention="sdpa")
    batch = random_batch(drafter, num_anchors=4)
    with torch.no_grad():
        hidden_sdpa = drafter.block_hidden(batch[0], batch[1], batch[3])
        loss_sdpa = drafter(*batch)
        drafter.attention, drafter.compile_flex = "flex", False
        with eager_flex():
            hidden_flex = drafter.block_hidden(batch[0], batch[1], batch[3])
            loss_flex = drafter(*batch)
    err = rel_err(hidden_flex, hidden_sdpa)
    print(f"flex (eager) vs sdpa, block hidden states: max relative error {err:.2e}")
    assert err < 1e-5
    assert abs(loss_flex.loss.item() - loss_sdpa.loss.item()) < 1e-5 * loss_sdpa.loss.item()
    assert torch.equal(loss_flex.slot_count, loss_sdpa.slot_count)


def test_compiled_flex_matches_sdpa_and_compiles_once_for_a_run():
    from torch._dynamo.utils import counters

    drafter = tiny_drafter(attention="sdpa")
    flex = tiny_drafter(attention="flex")
    flex.load_state_dict(drafter.state_dict())
    errors = []
    graphs_before = counters["stats"]["unique_graphs"]
    for step in range(3):  # new anchors each step, as in training: the same compiled graph
        batch = random_batch(drafter, seed=step)
        with torch.no_grad():
            errors.append(
                rel_err(
                    flex.block_hidden(batch[0], batch[1], batch[3]), drafter.block_hidden(batch[0], batch[1], batch[3])
                )
            )
    print(f"compiled flex vs sdpa, block hidden states: max relative error {max(errors):.2e}")
    assert max(errors) < 1e-5
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_flex_refuses_to_train_on_the_cpu():
    drafter = tiny_drafter(attention="flex")
    drafter.compile_flex = False
    with eager_flex(), pytest.raises(ParamsError, match="no backward on the CPU.*'sdpa' or 'auto'"):
        drafter(*random_batch(drafter))


# -- gradients and learning ------------------------------------------------------------------------


def test_gradients_match_finite_differences_in_float64():
    target = tiny_target(hidden=8, heads=2, kv_heads=1, vocab=13).double()
    drafter = tiny_drafter(target, layers=1, block_size=3, n_target=2).double()
    features, input_ids, loss_mask, anchors, valid = random_batch(
        drafter, batch=1, seq_len=8, num_anchors=2, dtype=torch.float64
    )
    names = [n for n, p in drafter.named_parameters() if p.requires_grad]
    params = tuple(p.detach().clone().requires_grad_(True) for n, p in drafter.named_parameters() if p.requires_grad)
    features.requires_grad_(True)

    def loss(features, *params):
        state = dict(zip(names, params, strict=True))
        return torch.func.functional_call(drafter, state, (features, input_ids, loss_mask, anchors, valid)).loss

    assert torch.autograd.gradcheck(loss, (features, *params), eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_loss_goes_down_on_a_tiny_batch():
    drafter = tiny_drafter()
    batch = random_batch(drafter, seq_len=24, num_anchors=4)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    first = drafter(*batch)
    for _ in range(60):
        out = drafter(*batch)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    last = drafter(*batch)
    print(
        f"overfit: loss {first.loss.item():.3f} -> {last.loss.item():.3f}, "
        f"accuracy {first.slot_accuracy.mean().item():.2f} -> {last.slot_accuracy.mean().item():.2f}"
    )
    assert last.loss.item() < 0.3 * first.loss.item()
    assert last.slot_accuracy.mean() > 0.8


def test_the_target_modules_stay_frozen_and_out_of_the_state_dict():
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter(*random_batch(drafter)).loss.backward()
    assert target.get_input_embeddings().weight.grad is None
    borrowed = (target.get_input_embeddings(), target.model.norm, target.lm_head)
    assert not any(p.requires_grad for module in borrowed for p in module.parameters())
    assert not drafter.norm.weight.requires_grad
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    assert not any(k.startswith(("embed", "lm_head", "target")) for k in drafter.state_dict())


# -- labels and loss ---------------------------------------------------------------------------


def test_labels_are_same_position_and_weights_decay_with_the_slot():
    input_ids = torch.arange(100, 110)[None]  # token at position p is 100 + p
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 7, 0]]), torch.tensor([[True, True, False]])
    labels, weights = block_labels(input_ids, loss_mask, anchors, valid, block_size=4, gamma=2.0)
    assert labels[0, 0].tolist() == [103, 104, 105]
    assert labels[0, 1].tolist() == [108, 109, 109]  # past the end: clamped, and weight 0 below
    decay = [1.0, math.exp(-0.5), math.exp(-1.0)]
    assert weights[0, 0].tolist() == pytest.approx([decay[0], 0.0, decay[2]])  # position 4 is unsupervised
    assert weights[0, 1].tolist() == pytest.approx([decay[0], decay[1], 0.0])
    assert weights[0, 2].tolist() == [0.0, 0.0, 0.0]  # a padding anchor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 3, 3, 120, generator=g)
    out = decay_weighted_loss(logits, labels, weights)
    by_hand = (
        sum(
            weights[0, a, k] * -torch.log_softmax(logits[0, a, k], -1)[labels[0, a, k]]
            for a in range(3)
            for k in range(3)
        )
        / weights.sum()
    )
    assert out.loss.item() == pytest.approx(by_hand.item(), rel=1e-6)
    assert out.slot_count.tolist() == [2.0, 1.0, 1.0]


# -- anchors ------------------------------------------------------------------------------------


def test_anchors_are_supervised_sorted_distinct_and_deterministic():
    g = torch.Generator().manual_seed(0)
    loss_mask = (torch.rand(6, 50, generator=g) < 0.6).float()
    loss_mask[4] = 0  # no supervised token at all
    loss_mask[5] = 0
    loss_mask[5, 10:13] = 1  # two candidates only: 10 and 11
    candidates = anchor_candidates(loss_mask)
    anchors, valid = sample_anchor_positions(loss_mask, 8, torch.Generator().manual_seed(7))
    again, valid_again = sample_anchor_positions(loss_mask, 8, torch.Generator().manual_seed(7))
    other, _ = sample_anchor_positions(loss_mask, 8, torch.Generator().manual_seed(8))
    assert torch.equal(anchors, again) and torch.equal(valid, valid_again)
    assert not torch.equal(anchors, other)
    for b in range(6):
        real = anchors[b][valid[b]].tolist()
        assert len(real) == min(8, int(candidates[b].sum()))
        assert real == sorted(set(real))
        assert all(loss_mask[b, p] == 1 and loss_mask[b, p + 1] == 1 for p in real)
        assert valid[b].tolist() == sorted(valid[b].tolist(), reverse=True)  # real first, padding after
        assert anchors[b][~valid[b]].eq(0).all()
    assert anchors[5][valid[5]].tolist() == [10, 11]
    assert not valid[4].any()

    # Every candidate is drawn some time: sampling covers them all, not just the first ones.
    seen = set()
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        a, v = sample_anchor_positions(loss_mask[:1], 8, gen)
        seen |= set(a[0][v[0]].tolist())
    assert seen == set(candidates[0].nonzero().flatten().tolist())


# -- checkpoint format ----------------------------------------------------------------------------


def test_save_and_load_round_trip_gives_identical_logits(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    batch = random_batch(drafter)
    drafter.save_pretrained(tmp_path / "a")
    drafter.save_pretrained(tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    loaded = DFlashDrafter.from_pretrained(tmp_path / "a", TargetHead.of(target), attention="sdpa", gamma=4.0)
    with torch.no_grad():
        assert torch.equal(
            loaded.block_hidden(batch[0], batch[1], batch[3]), drafter.block_hidden(batch[0], batch[1], batch[3])
        )
        assert torch.equal(loaded(*batch).loss, drafter(*batch).loss)

    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == [ARCHITECTURE]
    assert config["num_target_layers"] == 8
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 5], "block_size": 4}


def test_the_reference_dflash_loads_our_checkpoint_and_drafts_the_same(tmp_path):
    from dflash.model import DFlashDraftModel

    target = tiny_target()
    # Through the published bf16 checkpoint: both sides load its bf16 weights and compute in float32.
    tiny_drafter(target).save_pretrained(tmp_path, dtype=torch.bfloat16)
    drafter = DFlashDrafter.from_pretrained(tmp_path, TargetHead.of(target), dtype=torch.float32, attention="sdpa")
    reference, info = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    assert reference.target_layer_ids == [1, 3, 5] and reference.block_size == 4
    assert reference.mask_token_id == VOCAB - 1
    reference.eval()

    features, input_ids, _, anchors, _ = random_batch(drafter, num_anchors=4)
    bs, errors, logit_errors = 4, [], []
    embed = target.get_input_embeddings().weight
    with torch.no_grad():
        ours = drafter.block_hidden(features, input_ids, anchors)
        for b in range(anchors.shape[0]):
            for i, anchor in enumerate(anchors[b].tolist()):
                block = torch.tensor([[input_ids[b, anchor].item()] + [reference.mask_token_id] * (bs - 1)])
                # The reference drafts one block from the features of every position before the anchor.
                theirs = reference(
                    target_hidden=features[b : b + 1, :anchor],
                    noise_embedding=embed[block],
                    position_ids=torch.arange(anchor + bs)[None],
                )
                errors.append((ours[b, i] - theirs[0]).abs().max().item())
                logit_errors.append(
                    (drafter.logits(ours[b, i, 1:]) - reference.compute_logits(theirs[0, 1:], target.lm_head))
                    .abs()
                    .max()
                    .item()
                )
                # Our speculative-decoding path, with the context encoded in two pieces, agrees too.
                context = drafter.encode_context(features[b : b + 1, : anchor // 2])
                context = drafter.encode_context(features[b : b + 1, anchor // 2 : anchor], context)
                drafted = drafter.draft_logits(context, input_ids[b : b + 1, anchor])
                logit_errors.append(
                    (drafted[0] - reference.compute_logits(theirs[0, 1:], target.lm_head)).abs().max().item()
                )
    print(f"ours vs dflash reference: hidden max abs error {max(errors):.2e}, logits {max(logit_errors):.2e}")
    assert max(errors) < 1e-5 and max(logit_errors) < 1e-5


def test_our_loader_reads_what_the_reference_saves(tmp_path):
    from dflash.model import DFlashDraftModel

    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "ours")
    DFlashDraftModel.from_pretrained(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    loaded = DFlashDrafter.from_pretrained(tmp_path / "theirs", TargetHead.of(target), attention="sdpa")
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


# -- building for a real target from params.yaml ---------------------------------------------------------


def test_target_layer_spacing_agrees_with_the_reference():
    from dflash.model import build_target_layer_ids

    for layers in (6, 8, 12, 30, 36):
        for count in range(1, min(layers - 3, 6) + 1):
            assert spaced_target_layer_ids(layers, count) == build_target_layer_ids(layers, count)
    with pytest.raises(ParamsError, match="model.target_layers = 4: the target has 6 layers"):
        spaced_target_layer_ids(6, 4)


def test_features_are_the_chosen_layers_outputs():
    target = tiny_target()
    out = target(torch.randint(0, VOCAB, (1, 5)), output_hidden_states=True)
    features = target_features(out.hidden_states, [1, 3])
    assert torch.equal(features[..., 32:], out.hidden_states[4])


def test_a_drafter_for_a_real_target_and_tokenizer_from_params_yaml(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = load_params(ROOT)["model"]
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    drafter = DFlashDrafter.for_target(target, tokenizer, params, torch.Generator().manual_seed(0))
    assert drafter.config.mask_token_id == tokenizer.convert_tokens_to_ids(params.mask_token) < len(tokenizer)
    assert drafter.config.target_layer_ids == tuple(spaced_target_layer_ids(6, params.target_layer_count))
    assert drafter.config.hidden_size == target.config.hidden_size

    rows = target.get_input_embeddings().num_embeddings
    with pytest.raises(ParamsError, match=r"'<\|MASK\|>' \(not in the vocabulary\) has id .* only \d+ rows"):
        resolve_mask_token_id(tokenizer, rows, "<|MASK|>")
    assert "<|MASK|>" not in tokenizer.get_vocab()  # the refusal left the tokenizer as it was
    assert resolve_mask_token_id(tokenizer, len(tokenizer) + 1, "<|MASK|>") == len(tokenizer) - 1
    assert tokenizer.mask_token == "<|MASK|>"
    assert resolve_mask_token_id(tokenizer, len(tokenizer), "ignored") == tokenizer.mask_token_id


def test_a_mask_token_added_in_a_spare_row_is_recorded_and_served_by_name(tiny_target_dir, tmp_path):
    """Qwen3's case (SpecForge adds <|MASK|> in a spare row): the target's saved tokenizer never names the id, so
    the drafter's config records the string, and the served config spells it from there."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from dflashpipe.serve.served_files import mask_token

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    target = tiny_target(vocab=len(tokenizer) + 8)
    params = replace(load_params(ROOT)["model"], mask_token="<|MASK|>")
    drafter = DFlashDrafter.for_target(target, tokenizer, params, torch.Generator().manual_seed(0))
    assert drafter.config.mask_token_id == len(tokenizer) - 1 and drafter.config.mask_token == "<|MASK|>"
    saved = drafter.config.to_checkpoint_dict("float32")
    assert DFlashConfig.from_checkpoint_dict(saved) == drafter.config
    assert mask_token(tiny_target_dir, drafter.config.mask_token_id, saved["dflash_config"]["mask_token"]) == "<|MASK|>"
    with pytest.raises(SourceError, match="no token with id .* another target"):
        mask_token(tiny_target_dir, drafter.config.mask_token_id)


def test_a_target_whose_final_norm_is_not_rmsnorm_is_refused():
    target = tiny_target()
    target.model.norm = torch.nn.LayerNorm(32)
    with pytest.raises(SourceError, match="is not weight \\* x / rms"):
        tiny_drafter(target)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": 0}, r"model.layers = 0: must be between 1 and 64"),
        ({"block_size": 1}, r"model.block_size = 1: must be between 2"),
        ({"seq_len": 8, "block_size": 8}, r"model.seq_len = 8: must be longer than model.block_size = 8"),
        (
            {"target_layers": 3, "target_layer_ids": [5, 2, 9]},
            r"model.target_layer_ids = \[5, 2, 9\]: list model.target_layers = 3",
        ),
        (
            {"target_layers": 0, "layers": 2, "target_layer_ids": [1, 2, 3]},
            r"list model.layers = 2 \(model.target_layers is 0\)",
        ),
        ({"target_layers": -1}, r"model.target_layers = -1: must be between 0 and 64"),
        ({"final_norm": "learned"}, r"model.final_norm = 'learned': allowed values are \['trained', 'frozen'\]"),
        ({"distill": "soft"}, r"model.distill = 'soft': allowed values are \['none', 'argmax', 'kl'\]"),
        ({"distill_weight": 1.5}, r"model.distill_weight = 1.5: must be between 0 and 1"),
        (
            {"final_norm": "frozen", "final_norm_scale": 0.1},
            r"model.final_norm_scale = 0.1: must be in \(0, 10\], and 1 when model.final_norm is frozen",
        ),
        ({"target_layer_ids": [2, 1]}, r"model.target_layer_ids = \[2, 1\]"),
        ({"gamma": 0}, r"model.gamma = 0.0: must be a positive number"),
        ({"attention": "cuda"}, r"model.attention = 'cuda': allowed values are \['auto', 'flex', 'sdpa'\]"),
        ({"mask_token": " "}, r"model.mask_token is empty"),
    ],
)
def test_bad_model_params_name_the_key(tmp_path, change, message):
    shutil.copy(ROOT / "params.yaml", tmp_path)
    doc = yaml.safe_load((tmp_path / "params.yaml").read_text())
    doc["model"].update(change)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(ParamsError, match=message):
        load_params(tmp_path)


def test_explicit_target_layer_ids_must_fit_the_target():
    params = load_params(ROOT)["model"]
    from dataclasses import replace

    explicit = replace(params, target_layers=2, target_layer_ids=(2, 8))
    with pytest.raises(ParamsError, match=r"model.target_layer_ids = \[2, 8\]: the target has 8 layers"):
        DFlashConfig.for_target(tiny_target().config, explicit, MASK_ID)
    ok = DFlashConfig.for_target(tiny_target().config, replace(explicit, target_layer_ids=(2, 7)), MASK_ID)
    assert ok.target_layer_ids == (2, 7) and ok.feature_size == 64


def test_target_layers_follow_the_drafter_layers_unless_set():
    from dataclasses import replace

    params = replace(load_params(ROOT)["model"], target_layer_ids=())
    qwen3_8b = tiny_target().config
    qwen3_8b.num_hidden_layers = 36
    # The published Qwen3-8B drafter: 5 layers reading 5 target layers.
    follows = DFlashConfig.for_target(qwen3_8b, replace(params, layers=5, target_layers=0), MASK_ID)
    assert follows.target_layer_ids == (1, 9, 17, 25, 33)
    assert DFlashConfig.for_target(qwen3_8b, replace(params, layers=5, target_layers=3), MASK_ID).target_layer_ids == (
        1,
        17,
        33,
    )


@pytest.mark.parametrize(("final_norm", "scale"), [("trained", 0.1), ("frozen", 1.0)])
def test_the_final_norm_starts_as_the_targets_scaled_and_trains_only_when_asked(final_norm, scale):
    target = tiny_target()
    drafter = DFlashDrafter(
        tiny_config(target),
        TargetHead.of(target),
        attention="sdpa",
        gamma=4.0,
        final_norm=final_norm,
        final_norm_scale=scale,
    )
    assert torch.equal(drafter.norm.weight, target.model.norm.weight * scale)
    drafter(*random_batch(drafter)).loss.backward()
    assert (drafter.norm.weight.grad is not None) == (final_norm == "trained")
    assert "norm.weight" in drafter.state_dict()  # the checkpoint format carries it either way


def test_init_target_copies_the_targets_top_layers(tiny_target_dir):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = replace(load_params(ROOT)["model"], layers=2, init="target")
    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    drafter = DFlashDrafter.for_target(target, tokenizer, params, torch.Generator().manual_seed(0))
    for ours, theirs in zip(drafter.layers, target.model.layers[-2:], strict=True):
        their_state = theirs.state_dict()
        for name, tensor in ours.state_dict().items():
            if name in their_state:
                assert torch.equal(tensor, their_state[name].to(tensor)), name
            else:  # a Llama target has no q/k norms: they stay the identity scale
                assert name.endswith(("q_norm.weight", "k_norm.weight")) and torch.all(tensor == 1), name
    random = DFlashDrafter.for_target(target, tokenizer, replace(params, init="random"), torch.Generator())
    assert not torch.equal(random.layers[0].mlp.up_proj.weight, drafter.layers[0].mlp.up_proj.weight)

    with pytest.raises(ParamsError, match="model.layers = 7 but the target has only 6 layers"):
        DFlashDrafter.for_target(target, tokenizer, replace(params, layers=7, target_layers=2), torch.Generator())
    target.model.layers[5].mlp.up_proj = torch.nn.Linear(target.config.hidden_size, 8, bias=False)
    with pytest.raises(
        SourceError, match=r"target decoder layer 5: mlp.up_proj.weight is \[8, 64\], drafter layer 1 needs"
    ):
        DFlashDrafter.for_target(target, tokenizer, params, torch.Generator())

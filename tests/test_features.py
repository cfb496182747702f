"""Offline target features: what the features stage stores is what the online trainer computes, shard by
shard under the incremental protocol, and train refuses features that do not fit its drafter."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch

from dflashpipe.core.errors import DflashpipeError, SourceError
from dflashpipe.core.params import ModelParams, build
from dflashpipe.core.pipeline import StageKey
from dflashpipe.features.packing import collate
from dflashpipe.features.run import check_disk, compute_features
from dflashpipe.features.shards import FeatureLayout, FeatureStore
from dflashpipe.target.dtype import compute_dtype
from dflashpipe.tokens.shards import load_tokens
from dflashpipe.train.data import BatchPlan
from tests.tiny import model_params

MODEL = build(ModelParams, model_params(), "model")
KEY = StageKey("features", {"test": "one"})


@pytest.fixture(scope="module")
def offline(train_inputs, tmp_path_factory):
    """data/features for the shared tiny inputs (2 token shards), as the stage computes it."""
    out = tmp_path_factory.mktemp("features") / "features"
    run = compute_features("offline", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", out, KEY)
    return out, run


def layout_for(train_inputs, model=MODEL) -> FeatureLayout:
    from transformers import AutoConfig

    return FeatureLayout.of(AutoConfig.from_pretrained(train_inputs / "target"), model, compute_dtype("cpu", "auto"))


def test_stored_features_are_what_the_online_trainer_computes_for_the_same_rows(train_inputs, offline):
    from dflashpipe.target.adapter import Target
    from dflashpipe.train.loop import target_inputs

    out, run = offline
    assert (
        run.computed_shards == ["train-chitchat-00000.safetensors", "train-chitchat-00001.safetensors"]
        and not run.reused_shards
    )
    data = load_tokens(train_inputs / "tokens")
    layout = layout_for(train_inputs)
    store = FeatureStore.load(out, train_inputs / "tokens", data, layout)
    target = Target.load(train_inputs / "target", "cpu", "auto")
    # training's own packing (another one than the stage's): each document attends only within itself
    plan = BatchPlan(data.lengths, MODEL.seq_len, 1, 2, 2, seed=5)
    for step in range(3):
        rows = plan.rows(step, 0, 1)
        batch = collate(data, rows, MODEL.seq_len, 0)
        online, _ = target_inputs(target, batch, torch.zeros(2, 1, dtype=torch.long), layout.layer_ids, MODEL)
        stored = store.rows(rows, torch.float32)
        real = batch.attention_mask.bool()
        assert stored.shape == online.shape
        assert not stored[~real].any(), "padding carries features"
        error = (stored[real] - online[real]).abs().max() / online[real].abs().max()
        assert error < 1e-2, f"step {step}: stored features differ from online ones by {error:.3g} (bf16: ~4e-3)"


def test_a_rerun_reuses_every_shard_and_a_missing_or_rekeyed_one_is_computed_again(train_inputs, offline, tmp_path):
    out, first = offline
    copy = tmp_path / "features"
    shutil.copytree(out, copy)
    inode = (copy / "train-chitchat-00000.safetensors").stat().st_ino
    again = compute_features("offline", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", copy, KEY)
    assert again.computed_shards == [] and again.reused_shards == [
        "train-chitchat-00000.safetensors",
        "train-chitchat-00001.safetensors",
    ]
    assert (copy / "train-chitchat-00000.safetensors").stat().st_ino == inode
    assert again.summary == first.summary
    assert (copy / "files.json").read_bytes() == (out / "files.json").read_bytes()

    (copy / "train-chitchat-00001.safetensors").unlink()
    (copy / ".train-chitchat-00001.safetensors.partial-x").write_bytes(b"left by a kill")
    one = compute_features("offline", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", copy, KEY)
    assert one.computed_shards == ["train-chitchat-00001.safetensors"] and one.reused_shards == [
        "train-chitchat-00000.safetensors"
    ]
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in out.iterdir())
    for name in ("train-chitchat-00001.safetensors", "summary.json", "files.json"):
        assert (copy / name).read_bytes() == (out / name).read_bytes(), f"{name}: not the bytes of a full run"

    edited = StageKey("features", {"test": "an edited dep"})
    rekeyed = compute_features("offline", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", copy, edited)
    assert rekeyed.reused_shards == [] and len(rekeyed.computed_shards) == 2
    nothing = compute_features("offline", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", copy, None)
    assert nothing.reused_shards == [], "without a key nothing says what made a shard"


def test_online_mode_stores_nothing_and_removes_what_an_offline_run_left(train_inputs, offline, tmp_path):
    copy = tmp_path / "features"
    shutil.copytree(offline[0], copy)
    run = compute_features("online", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", copy, KEY)
    assert sorted(p.name for p in copy.iterdir()) == ["files.json", "summary.json"]
    assert run.summary == {"mode": "online", "shards": []}


def test_features_of_other_layers_are_refused_naming_the_shard_shapes_and_fix(train_inputs, offline):
    out, _ = offline
    data = load_tokens(train_inputs / "tokens")
    other = build(ModelParams, {**model_params(), "target_layer_ids": [1, 4]}, "model")
    want = layout_for(train_inputs, other)
    assert want.layer_ids != layout_for(train_inputs).layer_ids
    with pytest.raises(SourceError) as caught:
        FeatureStore.load(out, train_inputs / "tokens", data, want)
    message = str(caught.value)
    assert str(out / "train-chitchat-00000.safetensors") in message and "run `dvc repro features`" in message
    assert f"for layers {list(want.layer_ids)}" in message and "features of shape [" in message
    longer = dataclasses.replace(layout_for(train_inputs), seq_len=MODEL.seq_len * 2)
    cut = rf"cut at {MODEL.seq_len} tokens, but the drafter reads .* cut at {MODEL.seq_len * 2}:"
    with pytest.raises(SourceError, match=cut):
        FeatureStore.load(out, train_inputs / "tokens", data, longer)


def test_a_damaged_shard_is_refused_by_train_and_recomputed_by_the_stage(train_inputs, offline, tmp_path):
    out, _ = offline
    copy = tmp_path / "features"
    shutil.copytree(out, copy)
    victim = copy / "train-chitchat-00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x40  # inside the features
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(raw))
    data = load_tokens(train_inputs / "tokens")
    with pytest.raises(SourceError, match=r"train-chitchat-00001.safetensors.*run `dvc repro features`"):
        FeatureStore.load(copy, train_inputs / "tokens", data, layout_for(train_inputs))
    run = compute_features("offline", MODEL, "cpu", train_inputs / "tokens", train_inputs / "target", copy, KEY)
    assert run.computed_shards == ["train-chitchat-00001.safetensors"]
    assert victim.read_bytes() == (out / "train-chitchat-00001.safetensors").read_bytes()


def test_a_disk_too_small_is_refused_before_writing_with_the_estimate(train_inputs, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(DflashpipeError, match=r"need about [\d.]+ GB and the disk has [\d.]+ GB free"):
        check_disk(tmp_path, free * 2)
    check_disk(tmp_path, 1 << 20)  # a megabyte fits


def test_distilling_offline_is_refused_before_anything_is_computed(train_inputs, tmp_path):
    model = build(ModelParams, {**model_params(), "distill": "kl"}, "model")
    with pytest.raises(DflashpipeError, match=r"model.distill = 'kl' also needs the target's final states"):
        compute_features("offline", model, "cpu", train_inputs / "tokens", train_inputs / "target", tmp_path, KEY)
    assert not any(tmp_path.iterdir())


def test_the_summary_states_the_layout_and_the_bytes_a_token(train_inputs, offline):
    out, _ = offline
    summary = json.loads((out / "summary.json").read_text())
    layout = layout_for(train_inputs)
    data = load_tokens(train_inputs / "tokens")
    assert summary["layout"] == layout.to_json()
    assert summary["tokens"] == int(np.minimum(data.lengths, MODEL.seq_len).sum())
    assert (
        summary["bytes"] == summary["tokens"] * len(layout.layer_ids) * layout.hidden_size * layout.torch_dtype.itemsize
    )


def test_offline_training_trains_like_online_on_the_same_rows(train_inputs, offline):
    from tests.test_train import config, train

    out, _ = offline
    runs = {}
    for mode in ("online", "offline"):
        cfg = {**config(f"features-{mode}", drafters=2, max_steps=4, checkpoint_every=0), "features": {"mode": mode}}
        runs[mode] = train(train_inputs, {**cfg, "features_dir": str(out)})
    assert runs["offline"]["features"] == "offline" and runs["online"]["features"] == "online"
    assert runs["offline"]["replicas_identical"] is True
    assert runs["offline"]["supervised_tokens"] == runs["online"]["supervised_tokens"]
    # the same rows, anchors and initialisation: only the features' bf16 rounding differs
    assert runs["offline"]["final_loss"] == pytest.approx(runs["online"]["final_loss"], rel=1e-2)

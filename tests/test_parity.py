"""Train's parity check (dflashpipe.train.parity) on real tiny inputs, in this process: it passes for the trainer as
it is, online and offline, and each published misalignment fails the stage before any step, naming the training
sequence, the position and both tokens."""

from __future__ import annotations

import pytest

from dflashpipe.core.params import (
    CompileParams,
    ComputeParams,
    FeaturesParams,
    ModelParams,
    TopologyParams,
    TrainParams,
    build,
)
from dflashpipe.proof.misalign import MISALIGNMENTS
from dflashpipe.train.loop import TrainInputs
from dflashpipe.train.parity import ParityError
from dflashpipe.train.stage import TrainPaths, train_drafter
from tests.test_train import MODEL, TRAIN


def run(train_inputs, out, mode: str = "online", features=None, dtype: str = "auto") -> dict:
    inputs = TrainInputs(
        model=build(ModelParams, MODEL, "model"),
        compile=CompileParams(enabled=False, micro_batch=2, guard="error"),
        topology=TopologyParams(target_devices=("cpu",), drafter_devices=("cpu",), allow_shared_devices=True),
        train=build(TrainParams, {**TRAIN, "max_steps": 1, "checkpoint_every": 1}, "train"),
        features=FeaturesParams(mode=mode),
        compute=ComputeParams(target_dtype=dtype),
    )
    paths = TrainPaths(
        train_inputs / "tokens",
        train_inputs / "target",
        out / "compile",
        out / "drafter",
        out / "state",
        out / "metrics",
        features,
    )
    return train_drafter(inputs, paths, None, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # every CPU's auto, and a GPU's (what AMX computes fast)
@pytest.mark.parametrize("mode", ["online", "offline"])
def test_the_trainers_inputs_are_decodings_and_the_record_says_how_close(train_inputs, tmp_path, mode, dtype):
    features = None
    if mode == "offline":
        from dflashpipe.features.run import compute_features

        features = tmp_path / "features"
        compute_features("offline", build(ModelParams, MODEL, "model"), "cpu", train_inputs / "tokens",
                         train_inputs / "target", features, target_dtype=dtype)  # fmt: skip
    parity = run(train_inputs, tmp_path / "run", mode, features, dtype)["parity"]
    assert parity["passed"] and parity["sequences"] == 2 and parity["anchors"] >= 8 and parity["labels_checked"] > 0
    assert parity["dtype"] == dtype
    assert parity["feature_gap"] < parity["tolerance"]["features"] / 10
    assert parity["logit_gap"] < parity["tolerance"]["logits"] / 10


@pytest.mark.parametrize(
    ("misalignment", "names"),
    [
        ("layer", "the features training reads differ from decoding's"),
        ("labels", "learns token"),
        ("context_mask", "the training mask shows the block another context"),
    ],
)
def test_each_published_misalignment_fails_train_before_any_step(train_inputs, tmp_path, misalignment, names):
    with MISALIGNMENTS[misalignment](), pytest.raises(ParityError, match=names) as caught:
        run(train_inputs, tmp_path / misalignment)
    assert "training sequence 0, position " in str(caught.value) and "token" in str(caught.value)
    assert not (tmp_path / misalignment / "drafter").exists() and not any((tmp_path / misalignment / "state").iterdir())

"""The overfit proof (benchmarks/overfit.py) on a tiny target, through the real stage functions: a correct
trainer memorises the target's own replies and then drafts them; a trainer broken on purpose in one of the
ways published DFlash trainers were broken fails the same check.

The tiny target's hidden states carry little of its next token, so a block that also sees the context at
its own anchor (`context_mask`) gains too little to show here (tau 3.29 against 3.83 aligned, measured):
that arm runs in the benchmark on the real target, and the mask itself is checked against the published
reference in tests/test_model.py."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT
from tests.tiny import write_talking_target

spec = importlib.util.spec_from_file_location("overfit", ROOT / "benchmarks" / "overfit.py")
overfit = importlib.util.module_from_spec(spec)
sys.modules["overfit"] = overfit  # its dataclasses look their module up by name
spec.loader.exec_module(overfit)

BLOCK = 4
RUN = overfit.OverfitRun(
    samples=8,
    max_new_tokens=24,
    seq_len=256,
    num_anchors=128,
    lr=3e-3,
    # The last layer among the features: its hidden state is the target's next token, as in a trained model.
    model=(("layers", 1), ("block_size", BLOCK), ("target_layers", 2), ("target_layer_ids", [1, 5])),
)
STEPS = 120


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, smollm2_tokenizer_dir):
    """The talking target and, once, the memorised data: its greedy replies to 8 chitchat conversations."""
    target = write_talking_target(tmp_path_factory.mktemp("overfit-target"), smollm2_tokenizer_dir)
    work = tmp_path_factory.mktemp("overfit")
    overfit.prepare(RUN, target, work)
    return target, work


def test_a_correct_trainer_drafts_what_it_memorised(prepared):
    target, work = prepared
    [checkpoint] = overfit.overfit(RUN, target, work, [STEPS])
    assert checkpoint.lossless
    assert checkpoint.exact_prompts >= 2, "too few prompts whose greedy reply is the trained one to judge"
    assert checkpoint.verdict(BLOCK) == "aligned", checkpoint
    # It learned on the way: the trainer's own simulated acceptance rose from its first steps.
    window = json.loads((work / "aligned" / "metrics" / "metrics.json").read_text())["acceptance_length"]
    assert window["first"] < 1.5 < 2.5 < window["last"] == checkpoint.train_acceptance


@pytest.mark.parametrize("misalignment", ["labels", "layer", "mask_token"])
def test_a_trainer_misaligned_with_decoding_fails_the_proof(prepared, misalignment):
    target, work = prepared
    [checkpoint] = overfit.overfit(RUN, target, work, [STEPS], misalignment)
    assert checkpoint.lossless  # decoding stays the target's own: only the drafts get worse
    assert checkpoint.verdict(BLOCK) != "aligned", checkpoint
    assert checkpoint.tau < 2.0, checkpoint

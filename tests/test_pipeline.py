"""The pipeline under real DVC: what reruns, what does not, and how it fails."""

from __future__ import annotations

import json

import yaml

from tests.conftest import RUN_PROFILE, copy_project, run, set_params


def status(project) -> dict:
    return json.loads(run(["dvc", "status", "--json"], project).stdout or "{}")


def test_repro_runs_the_stages_then_reruns_only_what_changed(pipeline_run, tmp_path):
    first = (pipeline_run.parent / "repro.log").read_text()  # the shared run's `dvc repro`, from nothing
    for stage in ("fingerprint", "target", "manifest", "tokenize", "warmup", "train", "evaluate"):
        assert f"Running stage '{stage}'" in first
    project = copy_project(pipeline_run, tmp_path / "project")  # its run is committed as HEAD
    assert (project / "data/target/model.safetensors").is_file()
    samples = RUN_PROFILE["data__num_samples"]
    assert json.loads((project / "data/manifest/summary.json").read_text())["num_samples"] == samples

    again = run(["dvc", "repro"], project).stdout
    for stage in ("target", "manifest", "tokenize", "warmup", "train", "evaluate"):
        assert f"Stage '{stage}' didn't change, skipping" in again
    assert status(project) == {"fingerprint": ["always changed"]}

    set_params(project, data__num_samples=samples + 20)
    changed = status(project)
    assert set(changed) == {"fingerprint", "manifest"}
    assert {"changed deps": {"params.yaml": {"data.num_samples": "modified"}}} in changed["manifest"]
    diff = json.loads(run(["dvc", "params", "diff", "--json"], project).stdout)
    assert diff["params.yaml"]["data.num_samples"] == {"old": samples, "new": samples + 20, "diff": 20}

    shards = {p.name: p.read_bytes() for p in (project / "data/manifest").glob("train-*.parquet")}
    grown = run(["dvc", "repro", "train"], project).stdout  # evaluate is not what this test is about
    assert "Stage 'target' didn't change, skipping" in grown and "Running stage 'manifest'" in grown
    # growing the data must not touch the compile cache
    assert "Stage 'warmup' didn't change, skipping" in grown and "Running stage 'train'" in grown
    for name, data in shards.items():
        assert (project / "data/manifest" / name).read_bytes() == data, f"{name} changed when the data grew"
    assert len(list((project / "data/manifest").glob("train-*.parquet"))) == len(shards) + 1


def test_the_dag_hangs_target_and_manifest_off_the_fingerprint(dvc_project):
    dot = run(["dvc", "dag", "--dot"], dvc_project).stdout
    assert '"fingerprint" -> "target"' in dot and '"fingerprint" -> "manifest"' in dot
    lock_params = yaml.safe_load((dvc_project / "dvc.yaml").read_text())["stages"]["manifest"]["params"]
    assert {"data/env/fingerprint.json": ["python.version"]} in lock_params


def test_bad_params_stop_the_first_stage_with_one_message_and_nothing_recorded(dvc_project):
    # The whole of params.yaml is validated by every stage, so the first one to run refuses it.
    set_params(dvc_project, data__num_samples=0)
    proc = run(["dvc", "repro", "manifest"], dvc_project, check=False)
    assert proc.returncode != 0
    assert "dflashpipe fingerprint: error: params.yaml: data.num_samples = 0: must be between 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (dvc_project / "data/manifest").exists()
    assert not (dvc_project / "dvc.lock").exists()

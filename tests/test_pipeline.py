"""The pipeline under real DVC: what reruns, what does not, and how it fails."""

from __future__ import annotations

import json

import yaml

from tests.conftest import run, set_params


def status(project) -> dict:
    return json.loads(run(["dvc", "status", "--json"], project).stdout or "{}")


def test_repro_runs_the_stages_then_reruns_only_what_changed(dvc_project):
    first = run(["dvc", "repro"], dvc_project).stdout
    for stage in ("fingerprint", "target", "manifest", "tokenize", "warmup", "train", "evaluate"):
        assert f"Running stage '{stage}'" in first
    assert (dvc_project / "data/target/model.safetensors").is_file()
    assert json.loads((dvc_project / "data/manifest/summary.json").read_text())["num_samples"] == 60

    again = run(["dvc", "repro"], dvc_project).stdout
    assert "Stage 'target' didn't change, skipping" in again
    for stage in ("target", "manifest", "tokenize", "warmup", "train", "evaluate"):
        assert f"Stage '{stage}' didn't change, skipping" in again
    assert status(dvc_project) == {"fingerprint": ["always changed"]}

    run(["git", "add", "-A"], dvc_project)
    run(["git", "commit", "-qm", "ran"], dvc_project)
    set_params(dvc_project, data__num_samples=80)
    changed = status(dvc_project)
    assert set(changed) == {"fingerprint", "manifest"}
    assert {"changed deps": {"params.yaml": {"data.num_samples": "modified"}}} in changed["manifest"]
    diff = json.loads(run(["dvc", "params", "diff", "--json"], dvc_project).stdout)
    assert diff["params.yaml"]["data.num_samples"] == {"old": 60, "new": 80, "diff": 20}

    shards = {p.name: p.read_bytes() for p in (dvc_project / "data/manifest").glob("train-*.parquet")}
    grown = run(["dvc", "repro"], dvc_project).stdout
    assert "Stage 'target' didn't change, skipping" in grown and "Running stage 'manifest'" in grown
    # growing the data must not touch the compile cache
    assert "Stage 'warmup' didn't change, skipping" in grown and "Running stage 'train'" in grown
    for name, data in shards.items():
        assert (dvc_project / "data/manifest" / name).read_bytes() == data, f"{name} changed when the data grew"
    assert len(list((dvc_project / "data/manifest").glob("train-*.parquet"))) == 4


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

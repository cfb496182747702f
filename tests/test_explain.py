"""`dflashpipe explain` on the real pipeline under real DVC: exact verdicts and root causes."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from dflashpipe.explain import ALWAYS, DIRECT, DOWNSTREAM, OUTPUTS, UNCHANGED, explain, to_markdown
from tests.conftest import RUN_PROFILE, copy_project, run, set_params


def verdicts(report) -> dict[str, str]:
    return {v.stage: v.verdict for v in report.stages}


def roots(report) -> list[tuple]:
    return [(c.kind, c.what, c.old, c.new, tuple(c.stages)) for c in report.root_causes]


N = RUN_PROFILE["data__num_samples"]
SHARDS = N // RUN_PROFILE["data__shard_size"]


@pytest.fixture
def committed(pipeline_run, tmp_path):
    """A private copy of the tiny pipeline, reproduced and committed once for the session."""
    return copy_project(pipeline_run, tmp_path / "project")


def test_nothing_changed_says_so(committed):
    report = explain("HEAD", "workspace", committed)
    assert set(verdicts(report).values()) == {ALWAYS, UNCHANGED} and verdicts(report)["fingerprint"] == ALWAYS
    assert report.root_causes == [] and report.metrics == []


def test_growing_the_data_hits_manifest_only_and_costs_are_attributed(committed):
    set_params(committed, data__num_samples=N + 20)
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report) == {"fingerprint": ALWAYS, "target": UNCHANGED, "manifest": DIRECT, "tokenize": DOWNSTREAM,
                                "warmup": UNCHANGED, "train": DOWNSTREAM, "evaluate": DOWNSTREAM}
    assert roots(report) == [("param", "params.yaml:data.num_samples", N, N + 20, ("manifest",))]
    assert report.root_causes[0].evidence == (
        "dvc.lock@HEAD stages.manifest.params['params.yaml']['data.num_samples'] vs params.yaml (workspace) data.num_samples")

    run(["dvc", "repro", "manifest"], committed)  # its metrics are what this test reads
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report)["manifest"] == DIRECT and verdicts(report)["target"] == UNCHANGED
    deltas = {m.key: (m.old, m.new, m.causes) for m in report.metrics}
    assert deltas["train_samples"] == (N, N + 20, ["params.yaml:data.num_samples"])
    assert deltas["shards"] == (SHARDS, SHARDS + 1, ["params.yaml:data.num_samples"])
    assert next(m for m in report.metrics if m.key == "train_samples").change == pytest.approx(20 / N)
    md = to_markdown(report)
    assert f"`param params.yaml:data.num_samples: {N} -> {N + 20}` — hits manifest" in md
    assert "| target | unchanged |" in md and f"`train_samples` {N} -> {N + 20} (+{round(100 * 20 / N)}%)" in md


def test_a_deleted_output_is_missing_and_restorable(committed):
    shutil.rmtree(committed / "data/manifest")
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report)["manifest"] == OUTPUTS
    (cause,) = report.stages[[v.stage for v in report.stages].index("manifest")].causes
    assert (cause.kind, cause.what, cause.new) == ("out", "data/manifest", "missing")
    assert "restorable: `dvc checkout`" in cause.evidence
    run(["dvc", "checkout", "data/manifest"], committed)
    assert verdicts(explain("HEAD", "workspace", committed))["manifest"] == UNCHANGED


def test_a_deleted_compile_cache_is_restored_by_checkout_without_recompiling(committed):
    shutil.rmtree(committed / "data/compile")
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report)["warmup"] == OUTPUTS
    assert "restorable" in report.stages[[v.stage for v in report.stages].index("warmup")].causes[0].evidence
    run(["dvc", "checkout", "data/compile"], committed)
    assert "warmup" not in json.loads(run(["dvc", "status", "--json"], committed).stdout or "{}")
    set_params(committed, model__block_size=8)
    changed = json.loads(run(["dvc", "status", "--json"], committed).stdout)
    assert {"changed deps": {"params.yaml": {"model.block_size": "modified"}}} in changed["warmup"]


def test_an_edited_source_file_hits_the_stages_that_list_it(committed):
    with open(committed / "src/dflashpipe/target.py", "a") as fh:
        fh.write("\n# an edit\n")
    report = explain("HEAD", "workspace", committed)
    # target.py materialises the target (target) and loads it (warmup, train, evaluate list it too);
    # tokenize only reads the target's output, so it is downstream.
    assert verdicts(report) == {"fingerprint": ALWAYS, "target": DIRECT, "manifest": UNCHANGED,
                                "tokenize": DOWNSTREAM, "warmup": DIRECT, "train": DIRECT, "evaluate": DIRECT}
    ((kind, what, old, new, stages),) = roots(report)
    assert (kind, what, stages) == ("dep", "src/dflashpipe/target.py", ("target", "warmup", "train", "evaluate"))
    assert old != new
    assert "dvc.lock@HEAD stages.target.deps[" in report.root_causes[0].evidence


def test_a_compile_env_var_names_the_fingerprint_key_and_hits_warmup_not_data(committed):
    run(["dvc", "repro", "fingerprint"], committed, env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report) == {"fingerprint": ALWAYS, "target": UNCHANGED, "manifest": UNCHANGED,
                                "tokenize": UNCHANGED, "warmup": DIRECT, "train": DIRECT,
                                "evaluate": DIRECT}
    (cause,) = report.root_causes
    assert (cause.kind, cause.what, cause.new) == ("param", "data/env/fingerprint.json:env", {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    # evaluate times a compiled train step on warmup's kernels, so it lists what decides them too
    assert cause.stages == ["warmup", "train", "evaluate"]


def test_an_edited_model_file_hits_warmup_and_train(committed):
    with open(committed / "src/dflashpipe/model/layers.py", "a") as fh:
        fh.write("\n# an edit\n")
    report = explain("HEAD", "workspace", committed)
    assert {s: v for s, v in verdicts(report).items() if v != UNCHANGED} == {
        "fingerprint": ALWAYS, "warmup": DIRECT, "train": DIRECT, "evaluate": DIRECT}
    assert [(c.what, c.stages) for c in report.root_causes] == [
        ("src/dflashpipe/model", ["warmup", "train", "evaluate"])]


def test_two_experiments_compare_by_name_and_json_is_complete(committed):
    # a learning-rate experiment (reruns train and evaluate), then on top of it an evaluation-only one
    lr = yaml.safe_load((committed / "params.yaml").read_text())["train"]["lr"]
    run(["dvc", "exp", "run", "-n", "fast", "-S", "train.lr=0.01"], committed)
    report = explain("HEAD", "fast", committed)
    assert {s: v for s, v in verdicts(report).items() if v != UNCHANGED} == {
        "fingerprint": ALWAYS, "train": DIRECT, "evaluate": DOWNSTREAM}
    assert roots(report) == [("param", "params.yaml:train.lr", lr, 0.01, ("train",))]

    run(["dvc", "exp", "run", "-n", "short", "-S", "evaluate.max_new_tokens=8"], committed)
    report = explain("fast", "short", committed)
    assert {s: v for s, v in verdicts(report).items() if v != UNCHANGED} == {"fingerprint": ALWAYS, "evaluate": DIRECT}
    assert roots(report) == [("param", "params.yaml:evaluate.max_new_tokens", RUN_PROFILE["evaluate__max_new_tokens"],
                              8, ("evaluate",))]

    proc = run(["dflashpipe", "explain", "HEAD", "fast", "--json"], committed)
    data = json.loads(proc.stdout)
    assert (data["a"], data["b"]) == ("HEAD", "fast")
    final_loss = next(m for m in data["metrics"] if m["key"] == "final_loss")
    assert final_loss["old"] != final_loss["new"] and final_loss["causes"] == ["params.yaml:train.lr"]


def test_an_unknown_revision_is_a_clear_error(committed):
    proc = run(["dflashpipe", "explain", "no-such-rev"], committed, check=False)
    assert proc.returncode == 2
    assert "'no-such-rev' is neither a git revision nor a DVC experiment" in proc.stderr

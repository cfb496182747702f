"""`dflashpipe explain` on the real pipeline under real DVC: exact verdicts and root causes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflashpipe.explain import ALWAYS, DIRECT, DOWNSTREAM, OUTPUTS, UNCHANGED, explain, to_markdown
from tests.conftest import make_project, run, set_params


def verdicts(report) -> dict[str, str]:
    return {v.stage: v.verdict for v in report.stages}


def roots(report) -> list[tuple]:
    return [(c.kind, c.what, c.old, c.new, tuple(c.stages)) for c in report.root_causes]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, tiny_target_dir):
    """The tiny pipeline, reproduced and committed once for the module."""
    project = make_project(tmp_path_factory.mktemp("explain") / "project", tiny_target_dir)
    run(["dvc", "repro"], project)
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "baseline"], project)
    return project


@pytest.fixture
def committed(baseline, tmp_path):
    """A private copy of the baseline (git, DVC cache and workspace move with it)."""
    return Path(shutil.copytree(baseline, tmp_path / "project", symlinks=True))


def test_nothing_changed_says_so(committed):
    report = explain("HEAD", "workspace", committed)
    assert set(verdicts(report).values()) == {ALWAYS, UNCHANGED} and verdicts(report)["fingerprint"] == ALWAYS
    assert report.root_causes == [] and report.metrics == []


def test_growing_the_data_hits_manifest_only_and_costs_are_attributed(committed):
    set_params(committed, data__num_samples=80)
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report) == {"fingerprint": ALWAYS, "target": UNCHANGED, "manifest": DIRECT, "tokenize": DOWNSTREAM,
                                "warmup": UNCHANGED, "train": DOWNSTREAM, "evaluate": DOWNSTREAM}
    assert roots(report) == [("param", "params.yaml:data.num_samples", 60, 80, ("manifest",))]
    assert report.root_causes[0].evidence == (
        "dvc.lock@HEAD stages.manifest.params['params.yaml']['data.num_samples'] vs params.yaml (workspace) data.num_samples")

    run(["dvc", "repro"], committed)
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report)["manifest"] == DIRECT and verdicts(report)["target"] == UNCHANGED
    deltas = {m.key: (m.old, m.new, m.causes) for m in report.metrics}
    assert deltas["train_samples"] == (60, 80, ["params.yaml:data.num_samples"])
    assert deltas["shards"] == (3, 4, ["params.yaml:data.num_samples"])
    assert next(m for m in report.metrics if m.key == "train_samples").change == pytest.approx(1 / 3)
    md = to_markdown(report)
    assert "`param params.yaml:data.num_samples: 60 -> 80` — hits manifest" in md
    assert "| target | unchanged |" in md and "`train_samples` 60 -> 80 (+33%)" in md


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
                                "evaluate": DOWNSTREAM}
    (cause,) = report.root_causes
    assert (cause.kind, cause.what, cause.new) == ("param", "data/env/fingerprint.json:env", {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert cause.stages == ["warmup", "train"]


def test_an_edited_model_file_hits_warmup_and_train(committed):
    with open(committed / "src/dflashpipe/model/layers.py", "a") as fh:
        fh.write("\n# an edit\n")
    report = explain("HEAD", "workspace", committed)
    assert {s: v for s, v in verdicts(report).items() if v != UNCHANGED} == {
        "fingerprint": ALWAYS, "warmup": DIRECT, "train": DIRECT, "evaluate": DIRECT}
    assert [(c.what, c.stages) for c in report.root_causes] == [
        ("src/dflashpipe/model", ["warmup", "train", "evaluate"])]


def test_two_experiments_compare_by_name_and_json_is_complete(committed):
    run(["dvc", "exp", "run", "-n", "small", "-S", "data.num_samples=70"], committed)
    run(["dvc", "exp", "run", "-n", "big", "-S", "data.num_samples=90"], committed)
    report = explain("small", "big", committed)
    assert verdicts(report)["manifest"] == DIRECT and verdicts(report)["target"] == UNCHANGED
    assert roots(report) == [("param", "params.yaml:data.num_samples", 70, 90, ("manifest",))]
    proc = run(["dflashpipe", "explain", "small", "big", "--json"], committed)
    data = json.loads(proc.stdout)
    assert (data["a"], data["b"]) == ("small", "big")
    assert {m["key"]: (m["old"], m["new"]) for m in data["metrics"]}["train_samples"] == (70, 90)


def test_an_unknown_revision_is_a_clear_error(committed):
    proc = run(["dflashpipe", "explain", "no-such-rev"], committed, check=False)
    assert proc.returncode == 2
    assert "'no-such-rev' is neither a git revision nor a DVC experiment" in proc.stderr

"""The pipeline under real DVC: what reruns, what does not, and how it fails; and dvc.yaml held to the
code it runs (every output path the code names, every module a stage imports, every fingerprint key)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from dflashpipe.core.pipeline import PipelineError, lies_under
from dflashpipe.core.stage_code import (
    INFRASTRUCTURE,
    code_deps,
    drift,
    pipeline_code_deps,
    runs,
    stage_script,
    with_code_deps,
)
from tests.conftest import RUN_PROFILE, copy_from_root, copy_project, run, set_params, write_stand_ins


def status(project) -> dict:
    return json.loads(run(["dvc", "status", "--json"], project).stdout or "{}")


def test_repro_runs_the_stages_then_reruns_only_what_changed(pipeline_run, tmp_path):
    first = (pipeline_run.parent / "repro.log").read_text()  # the shared run's `dvc repro`, from nothing
    for stage in (
        "fingerprint",
        "target",
        "manifest",
        "regenerate",
        "tokenize",
        "warmup",
        "train",
        "bench",
        "proof",
        "evaluate",
    ):
        assert f"Running stage '{stage}'" in first
    project = copy_project(pipeline_run, tmp_path / "project")  # its run is committed as HEAD
    # the tiny target's float32 safetensors are read where they lie (models/tiny), not copied into data/target
    assert "weights" in json.loads((project / "data/target/source.json").read_text())
    assert not list((project / "data/target").glob("*.safetensors"))
    samples = RUN_PROFILE["data__num_samples"]
    assert json.loads((project / "data/manifest/summary.json").read_text())["num_samples"] == samples

    again = run(["dvc", "repro"], project).stdout
    for stage in ("target", "manifest", "regenerate", "tokenize", "warmup", "train", "bench", "proof", "evaluate"):
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


def test_dvc_draws_the_dag_our_deps_and_fingerprint_params_imply(dvc_project):
    # Two independent readings of dvc.yaml: DVC's own DAG, and the edges its entries imply (a dep
    # inside another stage's output; a params entry naming a key of the fingerprint file, which DVC
    # turns into an edge from the stage that writes that file).
    dot = run(["dvc", "dag", "--dot"], dvc_project).stdout
    drawn = set(re.findall(r'"([\w-]+)" -> "([\w-]+)"', dot))
    stages = yaml.safe_load((dvc_project / "dvc.yaml").read_text())["stages"]
    writers = {out: name for name, entry in stages.items() for out in outputs(entry)}
    implied = set()
    for name, entry in stages.items():
        for dep in (_path(d) for d in entry.get("deps", []) or []):
            implied |= {(writer, name) for out, writer in writers.items() if writer != name and covered(dep, [out])}
        if fingerprint_keys(entry):
            implied.add((writers[FINGERPRINT_FILE], name))
    assert drawn == implied
    # the fingerprint reaches target and manifest only as params: no file of theirs depends on it
    assert {("fingerprint", "target"), ("fingerprint", "manifest")} <= drawn


def test_bad_params_stop_the_first_stage_with_one_message_and_nothing_recorded(dvc_project):
    # The whole of params.yaml is validated by every stage, so the first one to run refuses it.
    set_params(dvc_project, data__num_samples=0)
    proc = run(["dvc", "repro", "manifest"], dvc_project, check=False)
    assert proc.returncode != 0
    assert "dflashpipe fingerprint: error: params.yaml: data.num_samples = 0: must be between 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (dvc_project / "data/manifest").exists()
    assert not (dvc_project / "dvc.lock").exists()


def test_an_edit_of_a_module_reruns_exactly_the_stages_that_run_it(dvc_project):
    # DVC's own verdict, on a lock recorded without running anything: every output a stand-in file, then
    # `dvc commit` hashes deps and outs as they are. tokens/shards.py is tokenize's (under its package dep)
    # and read by features, train, proof and evaluate (a dep by itself): those five rerun, and no other stage.
    write_stand_ins(copy_from_root(dvc_project, [FINGERPRINT_FILE]))
    run(["dvc", "commit", "--force"], dvc_project)
    assert status(dvc_project) == {"fingerprint": ["always changed"]}

    module = "src/dflashpipe/tokens/shards.py"
    with open(dvc_project / module, "a") as file:
        file.write("\n# an edit\n")
    running = {
        name for name, script in scripts(dvc_project).items() if module in runs(dvc_project / script, dvc_project)
    }
    assert running == {"tokenize", "features", "train", "proof", "evaluate"}
    assert set(status(dvc_project)) == running | {"fingerprint"}


# --- dvc.yaml against the code: fast, no DVC run --------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
FINGERPRINT_FILE = "data/env/fingerprint.json"
KERNEL_STAGES = ("warmup", "train", "bench", "evaluate")


def stages_of(root: Path) -> dict:
    return yaml.safe_load((root / "dvc.yaml").read_text())["stages"]


@pytest.fixture(scope="module")
def stages() -> dict:
    return stages_of(ROOT)


def scripts(root: Path) -> dict[str, str]:
    """Each stage's stages/ script, by stage."""
    return {name: script for name, entry in stages_of(root).items() if (script := stage_script(entry["cmd"]))}


def _path(entry) -> str:
    return next(iter(entry)) if isinstance(entry, dict) else entry


def outputs(stage: dict) -> list[str]:
    return [_path(o) for kind in ("outs", "metrics", "plots") for o in stage.get(kind, []) or []]


def fingerprint_keys(stage: dict) -> list[str] | None:
    named = [
        item[FINGERPRINT_FILE]
        for item in stage.get("params", []) or []
        if isinstance(item, dict) and FINGERPRINT_FILE in item
    ]
    return named[0] if named else None


def covered(path: str, deps: list[str]) -> bool:
    return any(lies_under(path, dep) for dep in deps)


def test_every_output_path_the_code_names_is_written_by_exactly_one_stage(stages):
    from dflashpipe.core import pipeline

    names = (
        "FINGERPRINT",
        "TARGET",
        "MANIFEST",
        "REGENERATED",
        "TOKENS",
        "FEATURES",
        "COMPILE",
        "DRAFTER",
        "TRAIN_STATE",
        "MANIFEST_METRICS",
        "REGENERATE_METRICS",
        "TOKENIZE_METRICS",
        "FEATURES_METRICS",
        "TRAIN_METRICS",
    )
    for name in names:
        path = getattr(pipeline, name).as_posix()
        writers = [stage for stage, entry in stages.items() if path in outputs(entry)]
        assert len(writers) == 1, f"pipeline.{name} = {path}: an output of {writers or 'no stage'} in dvc.yaml"
    every = [out for entry in stages.values() for out in outputs(entry)]
    assert len(every) == len(set(every)), "a path is an output of two stages"


def test_dvc_yaml_lists_the_code_each_stage_runs_as_bin_deps_writes_it():
    # A module a stage runs but does not list is code whose edits DVC never sees; one it lists but does not run
    # reruns it for nothing. Each line names the stage, the path and the command that mends dvc.yaml.
    lines = drift(ROOT)
    assert not lines, "\n".join(lines)


def test_a_drifted_dvc_yaml_is_named_stage_by_stage_and_written_back_stably(tmp_path):
    project = copy_from_root(tmp_path, ["dvc.yaml", ".dvcignore", "stages", "src/dflashpipe"])
    path = project / "dvc.yaml"
    written = path.read_text()
    drifted = written.replace("      - src/dflashpipe/tokens\n", "").replace(
        "      - stages/target.py\n", "      - stages/target.py\n      - src/dflashpipe/target/adapter.py\n"
    )
    path.write_text(drifted)
    assert drift(project) == [
        "dvc.yaml stage target: extra src/dflashpipe/target/adapter.py (run bin/deps --write)",
        "dvc.yaml stage tokenize: missing src/dflashpipe/tokens (run bin/deps --write)",
        "dvc.yaml stage proof: missing src/dflashpipe/tokens (run bin/deps --write)",
    ]
    deps = pipeline_code_deps(project)
    assert with_code_deps(drifted, deps) == written
    assert with_code_deps(written, deps) == written  # a second --write changes nothing
    path.write_text(written.replace("      - stages/serve.py\n", ""))
    with pytest.raises(PipelineError, match=r"\['serve'\] do not list their script under deps"):
        with_code_deps(path.read_text(), pipeline_code_deps(project))


def test_the_import_walk_finds_what_a_stage_runs():
    # the walk itself must be able to see a gap: train runs its package's modules and the model
    code = set(runs(ROOT / "stages/train.py", ROOT))
    # through the model package's __init__ (it re-exports), and lazily imported modules too
    assert {"src/dflashpipe/model/__init__.py", "src/dflashpipe/model/mask.py"} <= code
    assert "src/dflashpipe/target/adapter.py" in code
    assert not any(f"src/{m.replace('.', '/')}.py" in code for m in INFRASTRUCTURE)
    # the target package's modules, each by itself: train runs the adapter, never the target stage's code
    assert "src/dflashpipe/target/materialise.py" not in code and "src/dflashpipe/target/batching.py" not in code
    deps = code_deps(ROOT / "stages/train.py", ROOT)
    assert "src/dflashpipe/train" in deps and "src/dflashpipe/target/adapter.py" in deps
    assert not any(covered("src/dflashpipe/target/materialise.py", [dep]) for dep in deps)
    # a script that serve's engine starts in the serving environment's interpreter: no import shows it
    assert "src/dflashpipe/serve/vllm_run.py" in code_deps(ROOT / "stages/serve.py", ROOT)


def test_every_module_lies_under_the_deps_of_exactly_the_stages_that_run_it(stages):
    # Every module, not only the one DVC was shown above: DVC hashes every file under a dep (.dvcignore aside),
    # so a module lying under a stage's deps is a module whose edit reruns it. Infrastructure lies under none;
    # an inert file lies under at most the stages that run it (where its package is one dep).
    ran = {name: runs(ROOT / script, ROOT) for name, script in scripts(ROOT).items()}
    under = {name: [_path(d) for d in stages[name].get("deps", [])] for name in ran}
    for module in sorted(SRC.rglob("*.py")):
        rel = module.relative_to(ROOT).as_posix()
        rerun = {name for name in ran if covered(rel, under[name])}
        running = {name for name in ran if rel in ran[name]}
        said = f"{rel}: under the deps of {sorted(rerun)}, run by {sorted(running)}"
        if any(ran[name][rel] for name in running):  # inert
            assert rerun <= running, said
        else:
            assert rerun == running, said


TIMED_STAGES = ("train", "bench", "evaluate")
"""The kernel stages that record timed metrics: they name the machine's thread facts too (docs/design.md)."""


def test_the_stages_that_run_compiled_kernels_name_the_same_environment_keys(stages):
    keys = {name: fingerprint_keys(stages[name]) for name in KERNEL_STAGES}
    assert keys["warmup"], "warmup names no fingerprint keys"
    # inductor generates (and caches) CPU kernels for torch's intra-op thread count: it is a kernel key
    assert "threads.torch_intra_op" in keys["warmup"]
    timing = [k for k in keys["train"] if k not in keys["warmup"]]
    assert timing == ["threads.torch_inter_op", "threads.env", "threads.affinity", "threads.cpu_quota"]
    assert all(keys[name] == keys["warmup"] + timing for name in TIMED_STAGES), keys
    # no stage that only makes data reruns for a thread count: its bytes do not follow it
    for name, entry in stages.items():
        if name not in KERNEL_STAGES:
            assert not any(k.startswith("threads") for k in fingerprint_keys(entry) or []), name


def test_every_fingerprint_key_a_stage_names_is_in_the_fingerprint(stages):
    from dflashpipe.core.env import observe

    facts = observe(project=ROOT).facts
    for name, entry in stages.items():
        for key in fingerprint_keys(entry) or []:
            node = facts
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"{name}: {FINGERPRINT_FILE} has no {key}"
                node = node[part]

"""The pipeline under real DVC: what reruns, what does not, and how it fails; and dvc.yaml held to the
code it runs (every output path the code names, every module a stage imports, every fingerprint key)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import RUN_PROFILE, copy_project, run, set_params


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
        "evaluate",
    ):
        assert f"Running stage '{stage}'" in first
    project = copy_project(pipeline_run, tmp_path / "project")  # its run is committed as HEAD
    assert (project / "data/target/model.safetensors").is_file()
    samples = RUN_PROFILE["data__num_samples"]
    assert json.loads((project / "data/manifest/summary.json").read_text())["num_samples"] == samples

    again = run(["dvc", "repro"], project).stdout
    for stage in ("target", "manifest", "regenerate", "tokenize", "warmup", "train", "bench", "evaluate"):
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


# --- dvc.yaml against the code: fast, no DVC run --------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
FINGERPRINT_FILE = "data/env/fingerprint.json"
# Imported by every stage and validated on their own (tests/test_params.py, the stage runner): a
# stage does not list them, and an edit to them is not meant to rerun the pipeline.
INFRASTRUCTURE = {f"dflashpipe.core.{m}" for m in ("params", "errors", "stage", "artifacts", "pipeline")} | {
    "dflashpipe.cli"
}
KERNEL_STAGES = ("warmup", "train", "bench", "evaluate")


@pytest.fixture(scope="module")
def stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


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
    return any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps)


def module_file(module: str) -> Path | None:
    """The source file of a dflashpipe module (a package's __init__.py), or None if there is none."""
    base = SRC.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(tree: ast.Module, file: Path) -> set[str]:
    """Every module an import statement anywhere in `tree` (functions included) may load, but not
    those only under `if TYPE_CHECKING:`; `from pkg import name` yields pkg and pkg.name."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name | ast.Attribute)
        and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    package = file.parent.relative_to(SRC).as_posix().replace("/", ".") if file.is_relative_to(SRC) else ""
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def inert(tree: ast.Module) -> bool:
    """Nothing but a docstring (a package's __init__.py, often): editing it cannot change an output,
    and once it holds code it is no longer inert and must be listed."""
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in tree.body)


def stage_code(script: Path) -> set[str]:
    """The dflashpipe source files a stage script runs: its imports, transitively, with the packages
    that hold them (importing a.b.c runs a/__init__.py and a/b/__init__.py), infrastructure and
    inert files aside."""
    files: set[str] = set()
    todo, seen = [script], set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        tree = ast.parse(file.read_text(), str(file))
        if file != script and not inert(tree):
            files.add(file.relative_to(ROOT).as_posix())
        for module in _imported(tree, file):
            parts = module.split(".")
            if parts[0] != "dflashpipe" or any(".".join(parts[:i]) in INFRASTRUCTURE for i in range(2, len(parts) + 1)):
                continue
            for i in range(2, len(parts) + 1):  # the enclosing packages, then the module itself
                found = module_file(".".join(parts[:i]))
                if found is not None:
                    todo.append(found)
    return files


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


def test_every_stage_lists_its_script_and_every_module_it_imports_as_deps(stages):
    missing = {}
    for name, entry in stages.items():
        (script,) = re.findall(r"stages/\w+\.py", entry["cmd"])
        deps = [_path(d) for d in entry.get("deps", []) or []]
        needed = {script} | stage_code(ROOT / script)
        gaps = sorted(path for path in needed if not covered(path, deps))
        if gaps:
            missing[name] = gaps
    # A module a stage runs but does not list: editing it changes the stage's output and DVC never reruns it.
    assert missing == {}, f"dvc.yaml deps miss code the stage runs: {missing}"


def test_the_import_walk_finds_what_a_stage_runs():
    # the walk itself must be able to see a gap: train runs its package's modules and the model
    code = stage_code(ROOT / "stages/train.py")
    # through the model package's __init__ (it re-exports), and lazily imported modules too
    assert {"src/dflashpipe/model/__init__.py", "src/dflashpipe/model/mask.py"} <= code
    assert "src/dflashpipe/target/adapter.py" in code
    assert not any(f"src/{m.replace('.', '/')}.py" in code for m in INFRASTRUCTURE)
    # the target package's modules, each by itself: train runs the adapter, never the target stage's code
    assert "src/dflashpipe/target/materialise.py" not in code and "src/dflashpipe/target/batching.py" not in code
    assert not covered("src/dflashpipe/target/adapter.py", ["src/dflashpipe/train"])
    assert covered("src/dflashpipe/train/loop.py", ["src/dflashpipe/train"])


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

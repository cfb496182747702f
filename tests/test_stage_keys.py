"""Every reuse key moves exactly when DVC would rerun the stage, and never otherwise.

For each stage that reuses work (pipeline.REUSE: the manifest's shards, tokenize's shards, warmup's
compile artifact, train's checkpoint) each file under each of its dvc.yaml deps is edited in turn, and each of its
params changed: the key must change (else stale work would be reused), except for the deps and
params the rule leaves out by name, which must not (else work would be redone for nothing). An
edit to a project file that is not a dep of the stage must not change it either.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashpipe.core.pipeline import DVC_FILE, PARAMS_FILE, REUSE, Pipeline, reuse_key, stage_key, stage_spec
from tests.conftest import copy_from_root, write_stand_ins

CODE = ["dvc.yaml", "params.yaml", ".dvcignore", "stages", "src/dflashpipe", "data/env/fingerprint.json"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The project's code and params, with a small stand-in file for every output and data dep of every stage."""
    return write_stand_ins(copy_from_root(tmp_path_factory.mktemp("keys"), CODE))


def files_under(project: Path, dep: str) -> list[Path]:
    path = project / dep
    return (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    )


def changed_value(value):
    """A different value of the same kind, as a user's edit would make."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-edited"
    if isinstance(value, list):
        return [*value, value[0] if value else 1]
    if isinstance(value, dict):
        return {**value, "EDITED": "1"}
    return "edited"


def edit_param(project: Path, file: str, key: str) -> None:
    path = project / file
    data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = changed_value(node.get(leaf))
    path.write_text(json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False))


@pytest.mark.parametrize("stage", sorted(REUSE))
def test_each_dep_file_moves_the_key_unless_left_out_by_name(project, stage):
    rule, base = REUSE[stage], reuse_key(stage, project).digest
    spec = stage_spec(stage, project)
    assert set(rule.without_deps) <= set(spec.deps)
    tried = 0
    for dep in spec.deps:
        for file in files_under(project, dep):
            original = file.read_bytes()
            file.write_bytes(original + b"\n# edited\n")
            try:
                moved = reuse_key(stage, project).digest != base
            finally:
                file.write_bytes(original)
            tried += 1
            rel = file.relative_to(project)
            if dep in rule.without_deps:
                assert not moved, f"{stage}: editing {rel} (left out: {rule.why}) changed the key"
            else:
                assert moved, f"{stage}: editing {rel}, under its dep {dep}, left the key unchanged: stale reuse"
    assert tried >= len(spec.deps)
    assert reuse_key(stage, project).digest == base


@pytest.mark.parametrize("stage", sorted(REUSE))
def test_each_param_moves_the_key_unless_left_out_by_name(project, stage):
    rule, base = REUSE[stage], reuse_key(stage, project).digest
    spec = stage_spec(stage, project)
    assert set(rule.without_params) <= {key for _, key in spec.params}
    for file, key in spec.params:
        original = (project / file).read_bytes()
        edit_param(project, file, key)
        try:
            moved = reuse_key(stage, project).digest != base
        finally:
            (project / file).write_bytes(original)
        if key in rule.without_params:
            assert not moved, f"{stage}: changing {file}:{key} (left out: {rule.why}) changed the key"
        else:
            assert moved, f"{stage}: changing {file}:{key} left the key unchanged: stale reuse"


@pytest.mark.parametrize("stage", sorted(REUSE))
def test_files_that_are_not_deps_cost_no_recompute(project, stage):
    spec = stage_spec(stage, project)
    deps = {p for dep in spec.deps for p in files_under(project, dep)}
    others = [p for p in files_under(project, "src/dflashpipe") + files_under(project, "stages") if p not in deps]
    # bytecode beside the stage's code (inside a dep directory, or beside a dep file, as manifest lists its
    # modules one by one): .dvcignore'd, so DVC does not hash it and neither does the key
    code = next(project / dep for dep in spec.deps if dep.startswith("src/"))
    code_dir = code if code.is_dir() else code.parent
    (code_dir / "__pycache__").mkdir(exist_ok=True)
    others += [code_dir / "__pycache__" / "module.cpython-311.pyc"]
    assert len(others) > 5
    base = reuse_key(stage, project).digest
    for file in others:
        original = file.read_bytes() if file.exists() else None
        file.write_bytes((original or b"") + b"\n# edited\n")
        try:
            assert reuse_key(stage, project).digest == base, f"{stage}: {file.relative_to(project)} is no dep of it"
        finally:
            if original is None:
                file.unlink()
            else:
                file.write_bytes(original)
    # params of other stages neither
    own = {key for _, key in spec.params}
    params = yaml.safe_load((project / PARAMS_FILE).read_text())
    foreign = [f"{section}.{key}" for section, keys in params.items() for key in keys if f"{section}.{key}" not in own]
    assert foreign
    original = (project / PARAMS_FILE).read_bytes()
    for key in foreign:
        edit_param(project, PARAMS_FILE, key)
    try:
        assert reuse_key(stage, project).digest == base
    finally:
        (project / PARAMS_FILE).write_bytes(original)


def test_a_key_names_what_changed(project):
    before = reuse_key("train", project)
    file = project / "src/dflashpipe/train/data.py"
    original = file.read_bytes()
    file.write_bytes(original + b"\n")
    try:
        after = reuse_key("train", project)
    finally:
        file.write_bytes(original)
    assert after.changed_since(before.inputs) == ["src/dflashpipe/train/data.py"]
    assert (project / DVC_FILE).is_file()


@pytest.mark.slow
def test_an_edit_of_training_code_retrains_instead_of_resuming(pipeline_run, tmp_path):
    """The stale resume that once recorded an old drafter as new code's output, under real DVC."""
    from dflashpipe.core.artifacts import file_sha256
    from tests.conftest import copy_project, run

    project = copy_project(pipeline_run, tmp_path / "project")
    weights = project / "data/drafter/model.safetensors"
    before = file_sha256(weights)
    assert (project / "data/train-state/checkpoint").is_dir()  # the finished run's checkpoint is there
    data_py = project / "src/dflashpipe/train/data.py"
    text = data_py.read_text()
    assert "seed * 1_000_003 + epoch" in text
    data_py.write_text(text.replace("seed * 1_000_003 + epoch", "seed * 1_000_003 + epoch + 7"))  # another data order
    out = run(["dvc", "repro", "train"], project).stdout
    assert "resumed" not in out
    assert "not resuming" in out and "src/dflashpipe/train/data.py" in out
    assert file_sha256(weights) != before
    assert run(["dvc", "status", "train"], project).stdout.strip().endswith("up to date.")


def test_the_chat_template_kwargs_move_exactly_the_stages_that_render_chats(project):
    """target.chat_template_kwargs reaches every rendering, so it moves the keys of the stages that render (and their
    reuse keys) and no other: not the target stage, whose weights the template's arguments never reach, nor serve,
    which replays the token ids evaluate rendered (data/eval/prompts.json, an output DVC reruns it on)."""
    names = Pipeline.read(project).names

    def keys() -> tuple[dict, dict]:
        return {n: stage_key(n, project).digest for n in names}, {n: reuse_key(n, project).digest for n in REUSE}

    original = (project / PARAMS_FILE).read_bytes()
    stages, reuses = keys()
    edit_param(project, PARAMS_FILE, "target.chat_template_kwargs")
    try:
        edited, edited_reuses = keys()
    finally:
        (project / PARAMS_FILE).write_bytes(original)
    rendering = ["evaluate", "proof", "regenerate", "tokenize"]
    assert sorted(n for n in names if stages[n] != edited[n]) == rendering
    assert sorted(n for n in REUSE if reuses[n] != edited_reuses[n]) == ["regenerate", "tokenize"]

"""Untrusted files: weights load from safetensors only, a crafted pickle never runs, a data path cannot
point a stage outside the project unless the person running it opts in, and no code path unpickles,
evals or execs what it reads."""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import DataParams, TargetParams
from dflashpipe.core.pipeline import ALLOW_OUTSIDE_PROJECT, MANIFEST
from dflashpipe.data.manifest import build_manifest
from dflashpipe.target.materialise import materialise_target
from tests.conftest import ROOT, run, set_params
from tests.tiny import TARGET_SHAPE, manifest_params, source


class Payload:
    """Unpickling this runs a shell command that leaves a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted_model_dir(tiny_target_dir: Path, project: Path, weights_name: str) -> Path:
    """The tiny model's config and tokenizer, with its weights replaced by a malicious pickle."""
    model = project / "models/evil"
    shutil.copytree(tiny_target_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    (model / weights_name).write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload(project / "PWNED")}))
    return model


def test_a_pickle_checkpoint_as_the_target_is_refused_and_never_unpickled(tmp_path, tiny_target_dir):
    crafted_model_dir(tiny_target_dir, tmp_path, "pytorch_model.bin")
    with pytest.raises(
        SourceError,
        match=r"models/evil ships no safetensors weights "
        r"\(pytorch_model.bin\); pickle checkpoints are refused "
        r".*convert it .*safe_serialization=True",
    ):
        materialise_target(TargetParams(source="models/evil", dtype="float32"), tmp_path / "out", root=tmp_path)
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()


def test_a_pickle_named_as_safetensors_is_a_clear_error_and_never_unpickled(tmp_path, tiny_target_dir):
    crafted_model_dir(tiny_target_dir, tmp_path, "model.safetensors")
    with pytest.raises(SourceError, match=r"cannot load the target from 'models/evil': .*header"):
        materialise_target(TargetParams(source="models/evil", dtype="float32"), tmp_path / "out", root=tmp_path)
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "out").exists()


@pytest.fixture
def outside(tmp_path) -> tuple[Path, Path]:
    """A project, and a file beside it (outside it) that params try to reach."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data/sources").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "secret.jsonl").write_text('{"messages": [{"role": "user", "content": "not yours"}]}\n')
    return project, elsewhere


def manifest_from(path: str) -> DataParams:
    return manifest_params(1, 1, source("jsonl", name="mine", path=path))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_a_source_path_outside_the_project_is_refused_unless_allowed(outside, how, monkeypatch):
    project, elsewhere = outside
    monkeypatch.delenv(ALLOW_OUTSIDE_PROJECT, raising=False)
    secret = elsewhere / "secret.jsonl"
    if how == "symlink":
        (project / "data/sources/link.jsonl").symlink_to(secret)
    path = {"dotdot": "../elsewhere/secret.jsonl", "absolute": str(secret), "symlink": "data/sources/link.jsonl"}[how]
    with pytest.raises(
        SourceError,
        match=rf"params.yaml: data.sources\[mine\].path = '{path}' resolves to {secret}, "
        rf"outside the project {project}: .*{ALLOW_OUTSIDE_PROJECT}=1",
    ):
        build_manifest(manifest_from(path), project / "m", root=project)
    assert not (project / "m").exists()

    monkeypatch.setenv(ALLOW_OUTSIDE_PROJECT, "1")
    assert build_manifest(manifest_from(path), project / "m", root=project)["sources"]["mine"]["train"] == 1


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_target_outside_the_project_needs_no_escape_hatch(outside, tiny_target_dir, how, monkeypatch):
    """A model directory is only read, never copied, and its files are fingerprinted wherever it lies
    (docs/usage.md): unlike a data path, it needs no DFLASHPIPE_ALLOW_OUTSIDE_PROJECT."""
    project, elsewhere = outside
    monkeypatch.delenv(ALLOW_OUTSIDE_PROJECT, raising=False)
    model = elsewhere / "model"
    shutil.copytree(tiny_target_dir, model)
    source = {"dotdot": "../elsewhere/model", "absolute": str(model)}[how]
    summary = materialise_target(TargetParams(source=source, dtype="float32"), project / "t", root=project)
    assert summary["num_hidden_layers"] == TARGET_SHAPE["num_hidden_layers"] == 6
    assert json.loads((project / "t-weights.json").read_text())["directory"] == str(model)


def test_the_stage_refuses_an_escaping_path_with_one_line(dvc_project, tmp_path, monkeypatch):
    (tmp_path / "secret.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    set_params(
        dvc_project,
        data__sources=[{"name": "mine", "kind": "jsonl", "weight": 1.0, "eval": 0, "path": "../secret.jsonl"}],
    )
    monkeypatch.delenv(ALLOW_OUTSIDE_PROJECT, raising=False)
    proc = run(["python", "stages/manifest.py"], dvc_project, check=False)
    assert proc.returncode == 2, proc.stderr
    assert (
        "dflashpipe manifest: error: params.yaml: data.sources[mine].path = '../secret.jsonl' resolves to"
        in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (dvc_project / MANIFEST).exists()


UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}


def unsafe_calls(path: Path, base: Path = ROOT) -> list[str]:
    """Every call in `path` that could run code it reads: eval/exec, pickle-likes, torch.load without
    weights_only=True, yaml.load without a safe loader."""
    found = []
    for node in sorted(ast.walk(ast.parse(path.read_text(), str(path))), key=lambda n: getattr(n, "lineno", 0)):
        where = f"{path.relative_to(base)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}: imports {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if name in ("eval", "exec", "compile", "__import__"):
            found.append(f"{where}: {name}()")
        torch_load = name.endswith("torch.load") or name == "load" and "weights_only" in keywords
        if torch_load and keywords.get("weights_only") != "True":
            found.append(f"{where}: {name}() without weights_only=True")
        yaml_load = name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load")
        if yaml_load and "SafeLoader" not in keywords.get("Loader", ""):
            found.append(f"{where}: {name}() without yaml.SafeLoader")
    return found


def test_no_code_path_unpickles_evals_or_execs_what_it_reads():
    files = sorted((ROOT / "src/dflashpipe").rglob("*.py")) + sorted((ROOT / "stages").glob("*.py"))
    assert len(files) > 10
    assert [f for path in files for f in unsafe_calls(path)] == []


def test_the_scan_finds_each_unsafe_call(tmp_path):
    bad = tmp_path / "probe.py"
    bad.write_text(
        "import pickle\nimport torch, yaml\ntorch.load('x')\ntorch.load('x', weights_only=False)\n"
        "eval('1')\nexec('x=1')\nyaml.load('a')\ntorch.load('x', weights_only=True)\n"
        "yaml.load('a', Loader=yaml.SafeLoader)\n"
    )
    assert unsafe_calls(bad, tmp_path) == [
        "probe.py:1: imports pickle",
        "probe.py:3: torch.load() without weights_only=True",
        "probe.py:4: torch.load() without weights_only=True",
        "probe.py:5: eval()",
        "probe.py:6: exec()",
        "probe.py:7: yaml.load() without yaml.SafeLoader",
    ]

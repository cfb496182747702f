"""params.yaml is validated once, with errors that name the key; dvc.yaml declares exactly what each stage reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params import load_params, load_stage_params
from tests.conftest import ROOT


def stages() -> list[str]:
    return list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])


@pytest.mark.parametrize("stage", stages())
def test_dvc_yaml_declares_exactly_the_keys_each_stage_reads(stage):
    # Raises if dvc.yaml declares a key the stage's config does not have, or misses one it has.
    load_stage_params(stage, ROOT)


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copy(ROOT / "params.yaml", tmp_path)
    shutil.copy(ROOT / "dvc.yaml", tmp_path)
    return tmp_path


def edit(path: Path, fn) -> None:
    doc = yaml.safe_load(path.read_text())
    fn(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_a_declared_key_the_stage_does_not_read_is_refused(project):
    edit(project / "dvc.yaml", lambda d: d["stages"]["manifest"]["params"].insert(0, "data.not_a_key"))
    with pytest.raises(ParamsError, match=r"declares \['data.not_a_key'\].*does not read"):
        load_stage_params("manifest", project)


def test_a_read_key_that_dvc_yaml_does_not_declare_is_refused(project):
    edit(project / "dvc.yaml", lambda d: d["stages"]["manifest"]["params"].remove("data.shard_size"))
    params = load_stage_params("manifest", project)
    assert params.data.num_samples > 0
    with pytest.raises(ParamsError, match=r"misses data.shard_size.*goes unseen"):
        _ = params.data.shard_size


def test_a_stage_cannot_read_a_section_it_does_not_declare(project):
    params = load_stage_params("target", project)
    assert params.target.dtype in ("bfloat16", "float16", "float32")
    with pytest.raises(ParamsError, match="reads params section 'data'.*does not declare"):
        _ = params.data


@pytest.mark.parametrize("stage", ["regenerate", "tokenize", "evaluate", "proof"])
def test_the_stages_that_render_read_the_template_kwargs_and_no_other_target_key(project, stage):
    edit(project / "params.yaml", lambda d: d["target"].update(chat_template_kwargs={"enable_thinking": False}))
    params = load_stage_params(stage, project)
    assert params.target.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ParamsError, match=rf"stages.{stage}.params misses target.source"):
        _ = params.target.source


def test_the_target_stage_does_not_read_the_template_kwargs(project):
    params = load_stage_params("target", project)
    with pytest.raises(ParamsError, match=r"stages.target.params misses target.chat_template_kwargs"):
        _ = params.target.chat_template_kwargs


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["data"].update(num_sample=5), r"data: unknown key\(s\) \['num_sample'\]"),
        (lambda d: d["data"].pop("shard_size"), r"data.shard_size is missing"),
        (lambda d: d["data"].update(num_samples="many"), r"data.num_samples = 'many': expected an integer"),
        (lambda d: d["data"].update(num_samples=True), r"data.num_samples = True: expected an integer"),
        (lambda d: d["data"].update(num_samples=-3), r"data.num_samples = -3: must be between 1"),
        (
            lambda d: d["data"].update(on_bad_record="ignore"),
            r"data.on_bad_record = 'ignore': allowed values are \['error', 'skip'\]",
        ),
        (lambda d: d["data"].update(sources=[]), r"data.sources is empty"),
        (
            lambda d: d["target"].update(chat_template_kwargs=[1]),
            r"target.chat_template_kwargs = \[1\]: expected a mapping with string keys",
        ),
        (lambda d: d["data"]["sources"][0].update(weight=-1), r"data.sources\[sharegpt\].weight = -1.0"),
        (
            lambda d: d["data"]["sources"][0].update(kind="csv"),
            r"data.sources\[sharegpt\].kind = 'csv': allowed values",
        ),
        (lambda d: d["data"]["sources"][0].update(path="x.jsonl"), r"data.sources\[sharegpt\].path is set"),
        (
            lambda d: d["data"]["sources"].append({"name": "mine", "kind": "jsonl", "weight": 1, "eval": 0}),
            r"data.sources\[mine\].path is required",
        ),
        (
            lambda d: d["data"]["sources"].append(dict(d["data"]["sources"][0])),
            r"duplicate source names \['sharegpt'\]",
        ),
        (
            lambda d: d["train"].update(max_steps=10, epochs=2),
            r"train.max_steps = 10 and train.epochs = 2: exactly one of them states the run's length",
        ),
        (
            lambda d: d["train"].update(max_steps=0, epochs=0),
            r"train.max_steps = 0 and train.epochs = 0: exactly one of them",
        ),
        (
            lambda d: d["train"].update(warmup_steps=4, warmup_ratio=0.04),
            r"train.warmup_steps = 4 and train.warmup_ratio = 0.04: at most one of them",
        ),
        (lambda d: d["train"].update(warmup_ratio=1.5), r"train.warmup_ratio = 1.5: must be between 0.0 and 1.0"),
        (lambda d: d["target"].update(dtype="int8"), r"target.dtype = 'int8': allowed values"),
        (lambda d: d["compile"].update(enabled="yes"), r"compile.enabled = 'yes': allowed values are \['auto'\]"),
        (lambda d: d["regenerate"].update(concurrency=0), r"regenerate.concurrency = 0: must be between 1"),
        (lambda d: d["regenerate"].update(devices="gpu"), r"regenerate.devices = 'gpu': expected a list"),
        (
            lambda d: d["regenerate"].update(devices=["cuda:0", "cpu"]),
            r"regenerate.devices = \['cuda:0', 'cpu'\]: use auto, or a non-empty list of devices of one type",
        ),
        (lambda d: d["regenerate"].update(endpoints=["localhost:8000"]), r"regenerate.endpoints has 'localhost:8000'"),
        (lambda d: d.update(extra={"a": 1}), r"unknown section\(s\) \['extra'\]"),
        (lambda d: d.pop("target"), r"missing section\(s\) \['target'\]"),
    ],
)
def test_bad_params_name_the_key_the_value_and_what_is_allowed(project, change, message):
    edit(project / "params.yaml", change)
    with pytest.raises(ParamsError, match=message):
        load_params(project)


@pytest.mark.parametrize(
    ("enabled", "drafters", "compiles"),
    [
        ("auto", ["cpu", "cpu"], False),
        ("auto", ["cuda:5", "cuda:6"], True),
        (True, ["cpu"], True),
        (False, ["cuda"], False),
    ],
)
def test_compile_auto_compiles_where_the_drafter_runs_on_cuda(project, enabled, drafters, compiles):
    def change(d):
        d["compile"]["enabled"] = enabled
        d["topology"].update(drafter_devices=drafters, target_devices=["cpu"])

    edit(project / "params.yaml", change)
    for stage in ("warmup", "train", "bench"):  # every stage that reads compile.* sees the decision, never `auto`
        assert load_stage_params(stage, project).compile.enabled is compiles


def test_unparsable_yaml_is_a_clear_error(project):
    (project / "params.yaml").write_text("data: [unclosed\n")
    with pytest.raises(ParamsError, match="params.yaml: not valid YAML"):
        load_params(project)

"""Profiles: every shipped profile is valid over params.yaml, and its `dvc exp run` line means the profile.

The line is parsed back by DVC's own override parser (the one `dvc exp run -S` uses) on a copy of
params.yaml; the result must be params.yaml with exactly the profile's keys replaced. A GPU profile is a recipe:
it states every key params.yaml sizes for the CPU, or it is refused naming them.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
import yaml
from dvc.utils.hydra import apply_overrides
from typer.testing import CliRunner

from dflashpipe.cli import app
from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params import load_params
from dflashpipe.core.params.profile import cpu_sized_keys, experiment_command, profile_overrides

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "profiles").glob("*.yaml"))


def test_the_shipped_profiles_are_the_ones_the_docs_name():
    assert {p.stem for p in PROFILES} == {"gpu8", "gpu8-story", "specforge-qwen3-8b", "cpu-quality"}


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.stem)
def test_a_profile_line_sets_exactly_its_keys(profile, tmp_path):
    line = experiment_command(profile, root=ROOT)
    words = shlex.split(line)
    assert words[:5] == ["dvc", "exp", "run", "-n", profile.stem]
    sets = [words[i + 1] for i, w in enumerate(words) if w == "-S"]
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    apply_overrides(str(tmp_path / "params.yaml"), sets)

    before = yaml.safe_load((ROOT / "params.yaml").read_text())
    after = yaml.safe_load((tmp_path / "params.yaml").read_text())
    wanted = yaml.safe_load(profile.read_text())
    for section, keys in before.items():
        assert after[section] == {**keys, **wanted.get(section, {})}, section
    load_params(tmp_path)  # and the result is a valid params.yaml


def test_a_profile_with_a_value_out_of_range_names_the_profile_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: -1.0\n")
    with pytest.raises(ParamsError, match=r"bad\.yaml \(over params\.yaml\): .*train\.lr"):
        profile_overrides(bad, ROOT)


def test_a_profile_with_an_unknown_key_or_section_is_refused(tmp_path):
    for text, needle in (("train:\n  steps: 3\n", r"unknown key\(s\) \['steps'\]"), ("trian:\n  lr: 1\n", "trian")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        result = CliRunner().invoke(app, ["profile", str(bad)])
        assert result.exit_code == 2
        assert "bad.yaml" in result.output
        with pytest.raises(ParamsError, match=needle):
            profile_overrides(bad, ROOT)


GPU_PROFILES = [p for p in PROFILES if "cuda" in str(yaml.safe_load(p.read_text()).get("topology"))]


def test_every_gpu_profile_states_each_cpu_sized_key():
    assert {p.stem for p in GPU_PROFILES} == {"gpu8", "gpu8-story", "specforge-qwen3-8b"}
    for profile in GPU_PROFILES:
        assert set(cpu_sized_keys()) <= set(profile_overrides(profile, ROOT)), profile.name


def test_a_gpu_profile_that_inherits_cpu_sized_keys_is_refused_naming_every_one(tmp_path):
    recipe = yaml.safe_load((ROOT / "profiles" / "gpu8.yaml").read_text())
    del recipe["train"]["lr"], recipe["evaluate"]["num_prompts"]
    bad = tmp_path / "gpu.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["profile", str(bad)])
    assert result.exit_code == 2
    message = " ".join(result.output.split())  # the CLI's line, as the terminal wraps it
    assert "gpu.yaml: a GPU profile" in message and "params.yaml: train.lr, evaluate.num_prompts; state each" in message
    # the same keys left to params.yaml are a CPU profile's right
    cpu = {section: keys for section, keys in recipe.items() if section != "topology"}
    bad.write_text(yaml.safe_dump(cpu))
    profile_overrides(bad, ROOT)


def test_the_story_runs_the_shipped_recipe_on_its_own_split():
    # so that `dflashpipe plan` compares the two splits alone (tests/test_plan.py)
    story, shipped = (yaml.safe_load((ROOT / "profiles" / f"{n}.yaml").read_text()) for n in ("gpu8-story", "gpu8"))
    assert story.pop("topology") != shipped.pop("topology")
    assert story == shipped

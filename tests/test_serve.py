"""The served check: a real vLLM (the serving environment, `bin/setup --serve`) serves a drafter, and what it does is
held against our decoder: it passes on a drafter served as trained, fails on one planted config fault, says in one
line what vLLM could not load, and is recorded as not run, never as passed, without the serving environment.

The target is tests/tiny.py's talking target (its replies vary with the prompt); the drafter is fitted to its greedy
continuations (tests/test_evaluate.py's `fit_to_target`), so that it accepts some proposals and its proposals depend
on the target's features: a wrong layer shows.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflashpipe.core.artifacts import write_file_listing
from dflashpipe.core.params import ComputeParams, EvaluateParams, ServeParams, build
from dflashpipe.core.pipeline import SERVE_METRICS
from dflashpipe.core.serving_env import PYTHON_ENV, ServingEnvironmentError, serving_python
from dflashpipe.evaluate.evaluation import decode_prompts
from dflashpipe.evaluate.metrics import eval_metrics
from dflashpipe.evaluate.prompts import HELD_OUT, TRAIN, eval_prompts
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.serve.engine import EngineWorker
from dflashpipe.serve.served_check import ServedCheckError, ServeInputs, served_check
from dflashpipe.serve.served_files import write_served_files
from tests.conftest import ROOT, copy_project, run
from tests.test_evaluate import MAX_NEW, MODEL, fit_to_target
from tests.tiny import manifest_params, project_params, source, write_talking_target

INPUTS = ServeInputs(
    serve=ServeParams(min_proposal_agreement=0.95),
    evaluate=build(EvaluateParams, {**project_params("evaluate"), "num_prompts": 2, "max_new_tokens": MAX_NEW}, "e"),
    compute=ComputeParams(target_dtype="float32"),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_tokenizer_dir) -> dict:
    """A talking target materialised, a manifest with an eval split, a drafter fitted to the target as train
    publishes it, and evaluate's metrics of it."""
    from dflashpipe.core.params import TargetParams
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.target.materialise import materialise_target

    work = tmp_path_factory.mktemp("serve")
    write_talking_target(work / "models" / "talking", smollm2_tokenizer_dir)
    materialise_target(TargetParams(source="models/talking", dtype="float32"), work / "target", root=work)
    build_manifest(
        manifest_params(8, 8, source("chitchat", eval=6), source("humaneval", weight=0.0, eval=3)), work / "manifest"
    )
    chat = load_chat_tokenizer(work / "target")
    target = Target.load(work / "target", "cpu", "float32", decoding=True, kind="decode")
    p = INPUTS.evaluate
    prompts = [
        prompt
        for split in (HELD_OUT, TRAIN)
        for prompt in eval_prompts(work / "manifest", chat, p.num_prompts, p.max_prompt_tokens, split)[0]
    ]
    stop = target.stop_token_ids(chat.tokenizer)
    from dflashpipe.evaluate.speculative import prefill, target_generate

    greedy = [target_generate(target, prefill(target, q.prompt_ids), MAX_NEW, ()).tokens for q in prompts]
    drafter = DFlashDrafter.for_target(target.model, chat.tokenizer, MODEL, torch.Generator().manual_seed(0))
    # fitted harder than evaluate's tests fit theirs: proposals that follow the target's features, so that a
    # drafter fed other layers proposes otherwise (at 60 steps it proposed the same tokens whatever the layers)
    fit_to_target(
        drafter,
        target.model,
        [q.prompt_ids + g for q, g in zip(prompts, greedy, strict=True)],
        [len(q.prompt_ids) for q in prompts],
        steps=120,
        lr=1e-2,
    )
    drafter.save_pretrained(work / "drafter", dtype=torch.bfloat16)
    write_file_listing(work / "drafter")
    ours = DFlashDrafter.from_pretrained(work / "drafter", TargetHead.of(target.model), dtype=torch.float32).eval()
    results = decode_prompts(target, ours, prompts, MAX_NEW, stop)
    evaluation, _ = eval_metrics(results, ours.config.block_size)
    return {"work": work, "evaluation": evaluation}


@pytest.fixture(scope="module")
def engine(vllm_python, tmp_path_factory):
    """One vLLM process for this file's checks: vLLM imported once, the target's plain run made once (each check
    still starts its own speculative engine on the drafter it is handed)."""
    worker = EngineWorker(vllm_python, tmp_path_factory.mktemp("engine") / "vllm.log")
    yield worker
    worker.close()


def check(served: dict, engine: EngineWorker, out, served_dir=None) -> dict:
    work = served["work"]
    return served_check(
        INPUTS,
        work / "drafter",
        work / "target",
        work / "manifest",
        served["evaluation"],
        out,
        ROOT,
        served_dir,
        engine,
    )


def planted(served: dict, to, edit) -> object:
    """The drafter's served files with config.json edited by `edit`: what a faulty exporter would hand a server."""
    to.mkdir()
    write_served_files(served["work"] / "drafter", served["work"] / "target", to)
    config = json.loads((to / "config.json").read_text())
    edit(config)
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_vllm_serves_the_drafter_as_our_decoder_runs_it(engine, served, tmp_path, capsys):
    record = check(served, engine, tmp_path / "serve.json")
    assert json.loads((tmp_path / "serve.json").read_text()) == record
    assert record["served"] == "passed" and record["reason"] is None
    assert set(record["engine"]) == {"python", "vllm", "torch", "transformers"} and record["engine"]["vllm"]
    # float32: vLLM's speculative output is its plain greedy output on every prompt
    contract = record["contract"]
    assert contract["prompts"] == contract["equal_to_plain"] >= 4 and record["lossless"]
    # and every step vLLM drafted, ours drafted the same from the same context
    proposals = record["proposals"]
    assert proposals["steps"] > 10 and proposals["agreement"] == 1.0 and proposals["mismatches"] == []
    # the fitted drafter accepts some: vLLM's own counters, beside evaluate's figures on the same prompts
    assert record["tau"] > 1.0 and record["drafts"] > 0
    assert abs(record["tau_gap"]) < 0.25 and record["evaluate"]["tau"] == served["evaluation"]["tau"]
    assert list(record["slot_acceptance"]) == [str(k) for k in range(1, MODEL.block_size)]
    out = capsys.readouterr().out
    print(out)
    assert "served tau" in out and ": passed" in out


def test_a_shifted_target_layer_fails_the_served_check(engine, served, tmp_path):
    """The exporter writes the layer ids one off (as if it counted from the embeddings): vLLM reads other hidden
    states than the drafter was trained on, and its proposals leave ours."""

    def shift(config: dict) -> None:
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]

    faulty = planted(served, tmp_path / "faulty", shift)
    with pytest.raises(ServedCheckError, match=r"vLLM's proposals equal ours \(up to a tie\) on") as failed:
        check(served, engine, tmp_path / "serve.json", faulty)
    print(failed.value)
    record = json.loads((tmp_path / "serve.json").read_text())
    assert record["served"] == "failed" and "target_layer_ids" in record["reason"]
    assert record["proposals"]["agreement"] < INPUTS.serve.min_proposal_agreement
    assert record["proposals"]["mismatches"]


def test_a_drafter_vllm_cannot_load_is_one_line_naming_the_field(engine, served, tmp_path):
    """A drafter whose layer claims sliding-window attention with no window: vLLM refuses it; the stage says so in
    one line with vLLM's reason and the config field."""

    def sliding(config: dict) -> None:
        config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]

    faulty = planted(served, tmp_path / "faulty", sliding)
    with pytest.raises(ServedCheckError) as failed:
        check(served, engine, tmp_path / "serve.json", faulty)
    message = str(failed.value)
    print(message)
    assert "\n" not in message and message.startswith("vLLM failed loading the speculative engine")
    assert "window size" in message and "config.json field `sliding_window` = null" in message
    record = json.loads((tmp_path / "serve.json").read_text())
    assert record["served"] == "failed" and record["reason"] == message


def test_without_a_serving_environment_the_check_is_recorded_not_run(served, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    root = tmp_path / "project"  # a project with no .venv-serve
    root.mkdir()
    work = served["work"]
    record = served_check(
        INPUTS, work / "drafter", work / "target", work / "manifest", served["evaluation"], tmp_path / "s.json", root
    )
    assert record["served"] == "not_run" and "bin/setup --serve" in record["reason"]
    assert json.loads((tmp_path / "s.json").read_text()) == record and "tau" not in record
    assert capsys.readouterr().out.count("\n") == 1
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ServingEnvironmentError, match=f"^{PYTHON_ENV}=.*: no such interpreter"):
        serving_python(root)


def test_dvc_repro_records_not_run_then_serves_once_the_environment_is_set_up(vllm_python, pipeline_run, tmp_path):
    """The shared tiny pipeline ran with no serving environment: `served: not_run`. Setting one up moves the
    fingerprint's serving keys, which rerun the serve stage alone; explain names that cause, and history follows
    the served tau like any metric."""
    project = copy_project(pipeline_run, tmp_path / "project")
    record = json.loads((project / SERVE_METRICS).read_text())
    assert record == {"served": "not_run", "reason": record["reason"], "engine": None}
    assert "bin/setup --serve" in record["reason"]
    with_vllm = {PYTHON_ENV: str(vllm_python)}
    out = run(["dvc", "repro"], project, env=with_vllm).stdout
    assert re.findall(r"Running stage '(\w+)'", out) == ["fingerprint", "serve"], out
    record = json.loads((project / SERVE_METRICS).read_text())
    assert record["served"] == "passed" and record["engine"]["vllm"], record
    assert record["proposals"]["agreement"] == 1.0 and record["contract"]["bugs"] == 0
    explained = run(["dflashpipe", "explain", "HEAD"], project, env=with_vllm).stdout
    print(explained)
    cause = next(line for line in explained.splitlines() if "param serving:" in line)
    assert "vllm" in cause and "served tau" in explained, explained
    assert "metrics/serve.json" in run(["dflashpipe", "explain", "HEAD", "--all"], project, env=with_vllm).stdout
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "served"], project)
    followed = run(["dflashpipe", "history", "--metric", "metrics/serve.json:tau"], project, env=with_vllm).stdout
    print(followed)
    assert str(record["tau"]) in followed

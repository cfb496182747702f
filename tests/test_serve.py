"""The served check: a real vLLM (the serving environment, `bin/setup --serve`) serves a drafter, and what it does is
held against our decoder: it passes on a drafter served as trained, fails on one planted config fault, says in one
line what vLLM could not load, and is recorded as not run, never as passed, without the serving environment.

The target is tests/tiny.py's talking target (its replies vary with the prompt); the drafter is fitted to its greedy
continuations (tests/test_evaluate.py's `fit_to_target`), so that it accepts some proposals and its proposals depend
on the target's features: a wrong layer shows. The prompts file holds the manifest's real eval prompts as evaluate
writes them, the held-out ones in two benchmarks (one per source), so that vLLM's counters are read per benchmark.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch
import yaml

from dflashpipe.core.artifacts import write_file_listing
from dflashpipe.core.params import ComputeParams, EvaluateParams, ServeParams, build
from dflashpipe.core.pipeline import SERVE_DETAIL, SERVE_METRICS
from dflashpipe.core.serving_env import PYTHON_ENV, ServingEnvironmentError, serving_python
from dflashpipe.evaluate.evaluation import decode_prompts
from dflashpipe.evaluate.prompts import HELD_OUT, TRAIN, eval_prompts
from dflashpipe.evaluate.prompts_file import DecodedPrompt, write_prompts_file
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.serve.engine import EngineWorker
from dflashpipe.serve.served_check import ServedCheckError, ServeInputs, acceptance, by_benchmark, served_check
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
    target = Target.load(work / "target", "cpu", "float32", decoding=True)
    p = INPUTS.evaluate
    prompts = [
        prompt
        for split in (HELD_OUT, TRAIN)
        for prompt in eval_prompts(work / "manifest", chat, p.num_prompts, p.max_prompt_tokens, split)[0]
    ]
    stop = target.stop_token_ids(chat.tokenizer)
    from dflashpipe.evaluate.speculative import target_generate
    from dflashpipe.target.prefill import prefill

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
    # evaluate's rows: the held-out prompts by source (two benchmarks), the training ones in none
    decoded = [
        DecodedPrompt(q.source if q.split == HELD_OUT else TRAIN, q.sample_id, 1, q.split, tuple(q.prompt_ids))
        for q in prompts
    ]
    write_prompts_file(work / "prompts.json", decoded)
    # evaluate's tau per benchmark, counted as contract 3 counts it: each request's own, then the mean
    taus: dict[str, list[float]] = {}
    for r, d in zip(results, decoded, strict=True):
        if r.speculative.produced:
            taus.setdefault(d.benchmark, []).append(r.speculative.tau)
    evaluation = {"benchmarks": {name: {"tau": round(sum(t) / len(t), 4)} for name, t in taus.items()}}
    return {"work": work, "evaluation": evaluation, "benchmarks": [d.benchmark for d in decoded]}


@pytest.fixture(scope="module")
def engine(vllm_python, tmp_path_factory):
    """One vLLM process for this file's checks: vLLM imported once, the target's plain run made once (each check
    still starts its own speculative engine on the drafter it is handed)."""
    worker = EngineWorker(vllm_python, tmp_path_factory.mktemp("engine") / "vllm.log")
    yield worker
    worker.close()


def check(served: dict, engine: EngineWorker, out, served_dir=None):
    work = served["work"]
    return served_check(
        INPUTS,
        work / "drafter",
        work / "target",
        work / "prompts.json",
        served["evaluation"],
        out / "serve.json",
        out / "detail" / "serve.json",
        ROOT,
        served_dir,
        engine,
    )


def written(out) -> tuple[dict, dict]:
    return json.loads((out / "serve.json").read_text()), json.loads((out / "detail" / "serve.json").read_text())


@pytest.fixture(scope="module")
def passed(engine, served, tmp_path_factory) -> dict:
    """The check on the drafter served as trained (two of this file's tests read it: one vLLM run), and what it
    printed."""
    out = tmp_path_factory.mktemp("passed")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        record = check(served, engine, out)
    print(printed.getvalue())
    return {"record": record, "files": written(out), "printed": printed.getvalue()}


def planted(served: dict, to, edit) -> object:
    """The drafter's served files with config.json edited by `edit`: what a faulty exporter would hand a server."""
    to.mkdir()
    write_served_files(served["work"] / "drafter", served["work"] / "target", to)
    config = json.loads((to / "config.json").read_text())
    edit(config)
    (to / "config.json").write_text(json.dumps(config))
    return to


def test_vllm_serves_the_drafter_as_our_decoder_runs_it(passed, served):
    metrics, detail = passed["files"]
    assert (metrics, detail) == (passed["record"].metrics, passed["record"].detail)
    # what a sweep compares, and nothing else (the quality gate reads these keys)
    assert set(metrics) == {"served", "tau", "acceptance_per_position", "agreement", "benchmarks"}
    assert metrics["served"] == "passed" and detail["reason"] is None
    assert set(detail["engine"]) == {"python", "vllm", "torch", "transformers"} and detail["engine"]["vllm"]
    assert set(detail["definitions"]) >= {"tau", "tau_pooled", "acceptance_per_position", "ours", "agreement"}
    # float32: vLLM's speculative output is its plain greedy output on every prompt
    contract = detail["contract"]
    assert contract["prompts"] == contract["equal_to_plain"] >= 4 and detail["lossless"]
    # and every step vLLM drafted, ours drafted the same from the same context
    proposals = detail["proposals"]
    assert proposals["steps"] > 10 and metrics["agreement"] == proposals["agreement"] == 1.0
    assert proposals["mismatches"] == []
    # the fitted drafter accepts some: vLLM's own counters, beside evaluate's tau on the same prompts, per benchmark
    assert metrics["tau"] > 1.0 and detail["held_out"]["drafts"] > 0
    assert list(metrics["acceptance_per_position"]) == [str(k) for k in range(1, MODEL.block_size)]
    # vLLM counts the proposals a draft accepted past a stop token, which evaluate does not commit: a row of a few
    # short requests (humaneval's here: two drafts) reads higher served; a row of many drafts reads alike
    for name, row in metrics["benchmarks"].items():
        assert row["ours"] == served["evaluation"]["benchmarks"][name]["tau"]
        assert row["tau"] >= row["ours"], (name, row)
        if detail["benchmarks"][name]["drafts"] >= 10:
            assert abs(row["tau"] - row["ours"]) < 0.25, (name, row)
    assert detail["benchmarks"]["chitchat"]["drafts"] >= 10
    lines = passed["printed"].splitlines()
    assert "served tau" in lines[0] and lines[0].endswith(": passed")
    assert [line.split(":")[1].strip() for line in lines[1:]] == list(metrics["benchmarks"])  # a line per benchmark


def test_vllm_counters_are_read_per_benchmark(passed, served):
    """One row per benchmark of the prompts file (the training split's requests in none); each row's counters
    are its own requests', and the rows' counters add up to the whole."""
    metrics, detail = passed["files"]
    held_out = [b for b in dict.fromkeys(served["benchmarks"]) if b != TRAIN]
    assert list(metrics["benchmarks"]) == list(detail["benchmarks"]) == held_out == ["chitchat", "humaneval"]
    rows = detail["benchmarks"]
    assert [rows[b]["requests"] for b in held_out] == [served["benchmarks"].count(b) for b in held_out]
    for key in ("requests", "drafts", "accepted"):
        assert sum(row[key] for row in rows.values()) == detail["held_out"][key]  # every row here is held-out
    assert all(row["drafts"] > 0 for row in rows.values())


def test_per_benchmark_acceptance_splits_the_counters_it_is_given():
    """Hand-made counters (no engine): a request that never drafted counts in no tau, tau is the mean of the
    requests' own, tau_pooled all accepted over all drafts; the rows add up to the whole."""

    def counter(drafts: int, accepted: list[int]) -> dict:
        return {"drafts": drafts, "accepted": sum(accepted), "accepted_per_position": accepted}

    prompts = [DecodedPrompt(b, str(i), 1, "benchmark", (1,)) for i, b in enumerate(["a", "b", "a", "b"])]
    counters = [counter(4, [2, 2]), counter(2, [2, 0]), counter(1, [0, 0]), counter(0, [0, 0])]
    rows = by_benchmark(prompts, counters, 2)
    whole = acceptance(counters, 2)
    assert list(rows) == ["a", "b"]
    assert rows["a"]["tau"] == round((2 + 1) / 2, 4) and rows["a"]["tau_pooled"] == round(1 + 4 / 5, 4)
    assert rows["b"]["tau"] == 2.0 and rows["b"]["requests"] == 2  # the request that never drafted: no tau
    assert whole["tau"] == round((2 + 2 + 1) / 3, 4) and whole["tau_pooled"] == round(1 + 6 / 7, 4)
    assert whole["acceptance_per_position"] == {"1": round(4 / 7, 4), "2": round(2 / 7, 4)}
    for key in ("requests", "drafts", "accepted"):
        assert rows["a"][key] + rows["b"][key] == whole[key]


def test_a_shifted_target_layer_fails_the_served_check(engine, served, tmp_path):
    """The exporter writes the layer ids one off (as if it counted from the embeddings): vLLM reads other hidden
    states than the drafter was trained on, and its proposals leave ours."""

    def shift(config: dict) -> None:
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]

    faulty = planted(served, tmp_path / "faulty", shift)
    with pytest.raises(ServedCheckError, match=r"vLLM's proposals equal ours \(up to a tie\) on") as failed:
        check(served, engine, tmp_path, faulty)
    print(failed.value)
    metrics, detail = written(tmp_path)
    assert metrics["served"] == detail["served"] == "failed" and "target_layer_ids" in detail["reason"]
    assert metrics["agreement"] < INPUTS.serve.min_proposal_agreement
    assert detail["proposals"]["mismatches"]


def test_a_drafter_vllm_cannot_load_is_one_line_naming_the_field(engine, served, tmp_path):
    """A drafter whose layer claims sliding-window attention with no window: vLLM refuses it; the stage says so in
    one line with vLLM's reason and the config field."""

    def sliding(config: dict) -> None:
        config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]

    faulty = planted(served, tmp_path / "faulty", sliding)
    with pytest.raises(ServedCheckError) as failed:
        check(served, engine, tmp_path, faulty)
    message = str(failed.value)
    print(message)
    assert "\n" not in message and message.startswith("vLLM failed loading the speculative engine")
    assert "window size" in message and "config.json field `sliding_window` = null" in message
    metrics, detail = written(tmp_path)
    assert metrics == {"served": "failed"} and detail["reason"] == message


def test_without_a_serving_environment_the_check_is_recorded_not_run(served, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    root = tmp_path / "project"  # a project with no .venv-serve
    root.mkdir()
    work = served["work"]
    record = served_check(
        INPUTS,
        work / "drafter",
        work / "target",
        work / "prompts.json",
        served["evaluation"],
        tmp_path / "serve.json",
        tmp_path / "detail" / "serve.json",
        root,
    )
    assert written(tmp_path) == (record.metrics, record.detail)
    assert record.metrics == {"served": "not_run"}  # no figure, so nothing reads as a pass
    assert "bin/setup --serve" in record.detail["reason"]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "bin/setup --serve" in out
    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(ServingEnvironmentError, match=f"^{PYTHON_ENV}=.*: no such interpreter"):
        serving_python(root)


def test_dvc_repro_records_not_run_then_serves_once_the_environment_is_set_up(vllm_python, pipeline_run, tmp_path):
    """The shared tiny pipeline ran with no serving environment: `served: not_run`. Setting one up moves the
    fingerprint's serving keys, which rerun the serve stage alone; explain names that cause, and history follows
    the served tau like any metric."""
    project = copy_project(pipeline_run, tmp_path / "project")
    assert json.loads((project / SERVE_METRICS).read_text()) == {"served": "not_run"}
    assert "bin/setup --serve" in json.loads((project / SERVE_DETAIL).read_text())["reason"]
    with_vllm = {PYTHON_ENV: str(vllm_python)}
    out = run(["dvc", "repro"], project, env=with_vllm).stdout
    assert re.findall(r"Running stage '(\w+)'", out) == ["fingerprint", "serve", "gate"], out  # gate reads serve
    record, detail = json.loads((project / SERVE_METRICS).read_text()), json.loads((project / SERVE_DETAIL).read_text())
    assert record["served"] == "passed" and detail["engine"]["vllm"], detail
    assert record["agreement"] == 1.0 and detail["contract"]["bugs"] == 0
    benchmarks = [b["name"] for b in yaml.safe_load((project / "params.yaml").read_text())["evaluate"]["benchmarks"]]
    assert sorted(record["benchmarks"]) == sorted(["held_out", *benchmarks]), record
    assert record["benchmarks"]["held_out"]["tau"] == record["tau"]
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


def test_a_prompts_file_of_another_shape_is_refused_naming_the_entry(tmp_path):
    from dflashpipe.core.errors import SourceError
    from dflashpipe.evaluate.prompts_file import read_prompts_file

    path = tmp_path / "prompts.json"
    write_prompts_file(path, [DecodedPrompt("mt_bench", "81", 2, "benchmark", (1, 2, 3))])
    assert read_prompts_file(path) == [DecodedPrompt("mt_bench", "81", 2, "benchmark", (1, 2, 3))]
    path.write_text(json.dumps({"prompts": [{"benchmark": "mt_bench", "id": "81", "turn": 2, "split": "benchmark"}]}))
    with pytest.raises(SourceError, match=r"prompts\.json: prompts\[0\]: KeyError\('prompt_ids'\).*dvc repro evaluate"):
        read_prompts_file(path)
    path.write_text("{}")
    with pytest.raises(SourceError, match=r"not readable as evaluate's prompts"):
        read_prompts_file(path)

"""The bench stage: the drafter step's speed with its spread, and no path from the data to it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from dflashpipe.bench.stage import NOTE, REPEATS, run_bench
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params import CompileParams
from dflashpipe.core.pipeline import BENCH_METRICS
from dflashpipe.core.spread import Spread
from dflashpipe.core.threads import CORES_ENV
from tests.conftest import ROOT, copy_project, run, set_params
from tests.tiny import tiny_model_params


def upstream(stage: str, stages: dict) -> set[str]:
    """Every stage whose output reaches `stage` through deps, transitively (as DVC draws the DAG)."""
    writers = {
        (next(iter(o)) if isinstance(o, dict) else o): name
        for name, entry in stages.items()
        for kind in ("outs", "metrics", "plots")
        for o in entry.get(kind, []) or []
    }
    found, todo = set(), [stage]
    while todo:
        for dep in stages[todo.pop()].get("deps", []) or []:
            for out, writer in writers.items():
                if (dep == out or dep.startswith(out + "/") or out.startswith(dep + "/")) and writer not in found:
                    found.add(writer)
                    todo.append(writer)
    return found


def test_no_data_tokens_or_train_input_reaches_bench_in_dvc_yaml():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    bench = stages["bench"]
    assert {d for d in bench["deps"] if d.startswith("data/")} == {"data/compile", "data/target"}
    assert upstream("bench", stages) == {"target", "warmup"}  # never manifest, tokenize, train
    keys = [k for k in bench["params"] if isinstance(k, str)]
    # topology: with the cores, the drafter threads' intra-op count the step is compiled and timed at;
    # compute: the dtype of the borrowed embedding, norm and head; no data
    assert keys and all(k.split(".")[0] in ("model", "compile", "topology", "compute") for k in keys), keys
    # the same shapes and kernel environment as the compile it times
    assert keys == [k for k in stages["warmup"]["params"] if isinstance(k, str)]
    fingerprint = "data/env/fingerprint.json"
    kernels, timed = stages["warmup"]["params"][-1][fingerprint], bench["params"][-1][fingerprint]
    # the kernel environment, and the thread facts that decide how fast they run (never a data key)
    assert timed[: len(kernels)] == kernels and all(k.startswith("threads.") for k in timed[len(kernels) :])
    # evaluate decodes eagerly: no compile artifact or compile params any more, only bench's figure
    evaluate = stages["evaluate"]
    assert "data/compile" not in evaluate["deps"] and "metrics/bench.json" in evaluate["deps"]
    # and the chat template's arguments its prompts are rendered with
    assert not [
        k
        for k in evaluate["params"]
        if isinstance(k, str) and k.split(".")[0] not in ("evaluate", "compute") and k != "target.chat_template_kwargs"
    ]


def check_figure(record: dict, key: str) -> Spread:
    figure = Spread.read(record, key)
    assert figure is not None, f"{key} has no {key}_spread: {record}"
    assert figure.repeats == REPEATS >= 2 and 0 < figure.low <= figure.median <= figure.high
    return figure


def test_the_eager_step_is_timed_in_rounds_with_its_spread(tiny_target_dir, tmp_path):
    out = tmp_path / "metrics/bench.json"
    compile = CompileParams(enabled=False, micro_batch=1, guard="error")
    metrics = run_bench(tiny_model_params(), compile, tiny_target_dir, tmp_path / "no-compile", out, None)
    assert read_record_at(out) == metrics and json.loads(out.read_text()) == {"tokens_per_s": metrics["tokens_per_s"]}
    assert metrics["note"] == NOTE and metrics["note"].startswith("data changes cannot reach bench")
    assert metrics["runs"] == "eager" and metrics["compile_source"] == "eager: compile.enabled is false"
    assert set(metrics["paths"]) == {"eager"} and "compiled_over_eager" not in metrics
    headline = check_figure(metrics, "tokens_per_s")
    assert check_figure(metrics["paths"]["eager"], "tokens_per_s") == headline
    assert metrics["shapes"]["input_ids"] == [1, tiny_model_params().seq_len]
    assert not list(tmp_path.glob("metrics/.bench.json*"))  # the inductor scratch is gone
    # what the machine gave the rounds rides with each figure: CPU time over wall time, CPUs, load
    machine = metrics["tokens_per_s_spread"]["machine"]
    assert set(machine) == {"cpu_s", "wall_s", "cpu_over_wall", "cpus", "load_1m", "control_ms"}
    assert machine["cpu_s"] > 0 and machine["wall_s"] > 0 and machine["cpus"] == len(os.sched_getaffinity(0))
    assert machine["cpu_over_wall"] == pytest.approx(machine["cpu_s"] / machine["wall_s"], abs=0.01)
    assert metrics["paths"]["eager"]["tokens_per_s_spread"]["machine"] == machine


def test_the_bench_step_records_its_thread_budget_and_shows_progress(tiny_target_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CORES_ENV, "1")  # one core for this process, whatever the machine has
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        compile = CompileParams(enabled=False, micro_batch=1, guard="error")
        metrics = run_bench(tiny_model_params(), compile, tiny_target_dir, tmp_path / "none", tmp_path / "b.json", None)
        assert metrics["threads"] == {
            "cores": 1,
            "limited_by": CORES_ENV,
            "workers": {"drafter": 1},
            "threads": {"drafter": 1},
        }
        assert torch.get_num_threads() == 1  # what the timed rounds ran with
        err = capsys.readouterr().err  # progress on stderr: a tick per timed round
        assert "bench: 100%" in err and f"{REPEATS}/{REPEATS}" in err and "eager" in err and "tok/s" in err, err
    finally:
        torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def bench_run(pipeline_run) -> dict:
    return read_record_at(pipeline_run / BENCH_METRICS)


def test_the_pipelines_bench_times_warmups_kernels_against_eager(pipeline_run, bench_run):
    assert "Running stage 'bench'" in (pipeline_run.parent / "repro.log").read_text()
    m = bench_run
    assert m["runs"] == "compiled" and m["compile_source"] == "artifact" and m["graphs_compiled_while_timed"] == 0
    assert check_figure(m, "tokens_per_s") == check_figure(m["paths"]["compiled"], "tokens_per_s")
    check_figure(m["paths"]["eager"], "tokens_per_s")
    check_figure(m, "compiled_over_eager")  # a ratio per round, where both paths saw the same machine
    shown = json.loads(run(["dvc", "metrics", "show", "--json"], pipeline_run).stdout)
    assert BENCH_METRICS.as_posix() in json.dumps(shown)  # the step's tokens/s; the ratio is detail, in git
    assert "compiled_over_eager" not in json.dumps(shown) and "compiled_over_eager" in json.dumps(m)


def test_a_data_change_leaves_bench_up_to_date(pipeline_run, tmp_path):
    project = copy_project(pipeline_run, tmp_path / "project")
    params = yaml.safe_load((project / "params.yaml").read_text())
    set_params(project, data__num_samples=params["data"]["num_samples"] + 20, train__max_steps=7)
    changed = json.loads(run(["dvc", "status", "--json"], project).stdout)
    assert {"manifest", "train"} <= set(changed) and "bench" not in changed
    # reproducing bench with the data changed runs nothing of it; a kernel-side change reaches it
    out = run(["dvc", "repro", "bench"], project).stdout
    assert "Stage 'bench' didn't change, skipping" in out
    set_params(project, compile__micro_batch=params["compile"]["micro_batch"] + 1)
    assert "bench" in json.loads(run(["dvc", "status", "--json"], project).stdout)


def test_the_compiled_step_loads_warmups_artifact_only_under_warmups_key(tiny_target_dir, tmp_path, monkeypatch):
    import dflashpipe.bench.stage
    from dflashpipe.bench.stage import bench_step
    from dflashpipe.compile.artifact import BUILT_FOR, built_for
    from dflashpipe.core.pipeline import StageKey
    from tests.test_compile import stand_in_artifact

    # What is under test is which kernels the step is pointed at, not compiling them (minutes on a CPU).
    monkeypatch.setattr(dflashpipe.bench.stage, "compiled_step", lambda drafter: drafter)
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the step points inductor at its scratch
        monkeypatch.setenv(name, "")
    built = StageKey(
        "warmup", {"dep:src/dflashpipe/model/decoder_layer.py": "1", "param:params.yaml:model.seq_len": "64"}
    )
    artifact = stand_in_artifact(tmp_path / "compile", {BUILT_FOR: built_for(built)})
    compile = CompileParams(enabled=True, micro_batch=1, guard="error")

    def source(key):
        metrics = bench_step(tiny_model_params(), compile, tiny_target_dir, artifact, tmp_path / "scratch", key)
        assert set(metrics["paths"]) == {"eager", "compiled"} and metrics["runs"] == "compiled"
        check_figure(metrics, "compiled_over_eager")
        return metrics["compile_source"]

    assert source(built) == "artifact"
    edited = StageKey("warmup", {**built.inputs, "dep:src/dflashpipe/model/decoder_layer.py": "2"})
    assert source(edited) == (
        f"cold compile: {artifact} was built for other inputs "
        f"(src/dflashpipe/model/decoder_layer.py changed): `dvc repro warmup` rebuilds it"
    )
    assert source(None).startswith(f"cold compile: {artifact}: no warmup stage key to check it against")

"""`dflashpipe explain` against the live machine, under real DVC on the shared pipeline run: when one side is the
workspace, the machine now is the workspace's fingerprint for every verdict, so the header, the verdicts, the
root causes and every rendering of them (--json, --md, text, `report`, `history --workspace`) say the same.

The machine is made to differ cheaply, without touching the shared venv: an environment variable of this
process, or the hash state the live check trusts for torch files whose size and mtime did not move."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import shutil
from pathlib import Path

import pytest

from dflashpipe.commands.explain import NoiseCall, StageVerdict, explain, print_text, to_json, to_markdown
from dflashpipe.core import env
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.pipeline import Pipeline
from tests.conftest import copy_project, run, set_params
from tests.test_explain import N, invalidated, naming, quiet, verdicts

EDITED = "torch/fx/_symbolic_trace.py"


@pytest.fixture
def committed(pipeline_run, tmp_path):
    return copy_project(pipeline_run, tmp_path / "project")


def edit_torch_file_as_the_check_sees_it(project: Path, rel: str = EDITED) -> None:
    """The live check re-hashes only torch files whose size or mtime moved, and takes the hash state's digest for
    the rest: a digest other than the wheel's RECORD there is, to it, an edited file."""
    state = project / env.HASH_STATE
    hashes = json.loads(state.read_text())
    path = str(metadata.distribution("torch").locate_file(rel))
    assert path in hashes, "the pipeline run's fingerprint stage hashed torch's files into its hash state"
    hashes[path][2] = "sha256=" + "A" * 43
    state.write_text(json.dumps(hashes))


def machine_stages(report) -> list[str]:
    """The stages a `machine` cause hits directly, then what the verdicts put downstream of them (DAG order)."""
    hit: list[str] = []
    for v in report.stages:
        if (v.verdict == StageVerdict.DIRECT and any(c.kind == "machine" for c in v.causes)) or (
            v.verdict == StageVerdict.DOWNSTREAM and set(v.upstream) & set(hit)
        ):
            hit.append(v.stage)
    return hit


def assert_one_story(report, project: Path, capsys, extra_env: dict | None = None) -> None:
    """The header's stages are the verdicts' machine stages; JSON, Markdown, text, `report` and
    `history --workspace` carry the same verdicts and root causes."""
    found, causes = verdicts(report), [(c.kind, c.what) for c in report.root_causes]
    assert report.machine.stale and report.machine.invalid == machine_stages(report) != []
    assert ("machine", report.root_causes[0].what) in causes
    data = json.loads(to_json(report))
    assert {s["stage"]: s["verdict"] for s in data["stages"]} == found
    assert [(c["kind"], c["what"]) for c in data["root_causes"]] == causes
    assert data["machine"]["invalid"] == report.machine.invalid
    md = to_markdown(report, full=True)
    assert "every stage's recorded inputs are the same" not in md
    for stage, verdict in found.items():
        assert f"| {stage} | {verdict} |" in md
    print_text(report)
    text = capsys.readouterr().out
    assert "Causes\n  nothing" not in text and "Causes\n  (1) machine " in text
    rerun = text.split("\nStages\n", 1)[1].split("\nHeadlines\n", 1)[0].split("  unchanged: ", 1)[0]
    assert rerun.startswith("  invalidated: ") and all(stage in rerun for stage in report.machine.invalid)
    print_text(report, full=True)
    text = capsys.readouterr().out
    for stage in report.machine.invalid:
        assert f"{stage}: {StageVerdict.DIRECT}" in text or f"{stage}: {StageVerdict.DOWNSTREAM}" in text
    from dflashpipe.commands.report.build import build

    assert {name: verdict for name, verdict, _, _ in build(project).stages} == found
    history = json.loads(run(["dflashpipe", "history", "--workspace", "--json"], project, env=extra_env).stdout)
    assert {s["stage"]: s["verdict"] for s in history["workspace"]["stages"]} == found
    assert [(c["kind"], c["what"]) for c in history["workspace"]["root_causes"]] == causes


def test_an_edited_torch_file_not_yet_fingerprinted_is_the_machine_cause_of_every_stage_reading_it(committed, capsys):
    edit_torch_file_as_the_check_sees_it(committed)
    report = explain("HEAD", "workspace", committed)
    readers = naming("torch.files_edited")
    assert {"warmup", "train", "bench", "evaluate"} <= set(readers) and "tokenize" not in readers
    assert verdicts(report) == invalidated(readers)
    (cause,) = report.root_causes
    assert (cause.kind, cause.what, cause.old, cause.new, cause.stages) == (
        "machine",
        "torch.files_edited",
        [],
        [EDITED],
        readers,
    )
    assert "this machine now (observed live; data/env/fingerprint.json still says []: stale)" in cause.evidence
    assert f"edited {EDITED} (" in cause.evidence
    assert report.machine.invalid == [*readers, "serve", "gate"]  # serve reads evaluate's metrics, the gate both
    assert [(c.what, c.new) for c in report.machine.changes] == [
        ("torch.files_edited", [EDITED]),
        ("torch.files_ok", False),
    ]
    assert_one_story(report, committed, capsys)


def test_a_variable_set_here_but_not_fingerprinted_is_the_machine_cause(committed, capsys, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    report = explain("HEAD", "workspace", committed)
    readers = naming("env")
    assert verdicts(report) == invalidated(readers)
    (cause,) = report.root_causes
    assert (cause.kind, cause.what, cause.old, cause.new, cause.stages) == (
        "machine",
        "env",
        {},
        {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"},
        readers,
    )
    assert_one_story(report, committed, capsys, {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    # once the fingerprint stage has run here, the file says it too: the same change, now a param of the file
    run(["dvc", "repro", "fingerprint"], committed, env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    report = explain("HEAD", "workspace", committed)
    assert not report.machine.stale and report.machine.invalid == []
    assert verdicts(report) == invalidated(readers)
    assert [(c.kind, c.what) for c in report.root_causes] == [("param", "data/env/fingerprint.json:env")]


def test_a_thread_count_set_here_is_the_machine_cause_of_warmup_and_the_timed_stages(committed, capsys, monkeypatch):
    recorded = json.loads((committed / "data/env/fingerprint.json").read_text())["threads"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = explain("HEAD", "workspace", committed)
    kernels, timed = naming("threads.torch_intra_op"), naming("threads.env")
    assert timed == ["train", "bench", "evaluate"] and kernels == ["warmup", *timed]
    causes = {c.what: c for c in report.root_causes}
    assert causes["threads.env"].kind == "machine" and causes["threads.env"].new["OMP_NUM_THREADS"] == "1"
    assert causes["threads.env"].stages == timed
    if recorded["torch_intra_op"] > 1:  # torch now starts with one thread: other CPU kernels, so warmup too
        intra = causes["threads.torch_intra_op"]
        assert (intra.kind, intra.old, intra.new, intra.stages) == ("machine", recorded["torch_intra_op"], 1, kernels)
        assert verdicts(report) == invalidated(kernels)
    else:
        assert verdicts(report) == invalidated(timed)
    assert_one_story(report, committed, capsys, {"OMP_NUM_THREADS": "1"})


def metric(report, file: str, key: str):
    return next(m for m in report.metrics if (m.file, m.key) == (file, key))


def test_bench_re_measured_with_one_thread_names_the_thread_change(committed, monkeypatch):
    # every timed figure carries what the machine gave the process while it measured
    for file in ("metrics/bench.json", "metrics/train/metrics.json"):
        facts = read_record_at(committed / file)["tokens_per_s_spread"]["machine"]
        assert set(facts) == {"cpu_s", "wall_s", "cpu_over_wall", "cpus", "load_1m", "control_ms"}, file
    run(["dvc", "repro", "bench"], committed, env={"OMP_NUM_THREADS": "1"})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # explained in the shell that re-measured: the file is current
    report = explain("HEAD", "workspace", committed)
    assert not report.machine.stale
    threads = next(c for c in report.root_causes if c.what == "data/env/fingerprint.json:threads.env")
    assert threads.kind == "param" and threads.new["OMP_NUM_THREADS"] == "1" and "bench" in threads.stages
    moved = metric(report, "metrics/bench.json", "tokens_per_s")
    assert moved.call == NoiseCall.NOISE or "data/env/fingerprint.json:threads.env" in moved.causes, moved
    # back in a shell without it: the machine is HEAD's again, so no input of bench differs from HEAD's record;
    # the figure still moved, and explain says what the records of the two measurements say
    monkeypatch.delenv("OMP_NUM_THREADS")
    report = explain("HEAD", "workspace", committed)
    assert report.machine.stale and "threads.env" in [c.what for c in report.machine.changes]
    moved = metric(report, "metrics/bench.json", "tokens_per_s")
    assert moved.causes == []
    assert "threads.env {" in moved.machine and '"OMP_NUM_THREADS": "1"' in moved.machine
    assert moved.machine.startswith("the runs were recorded (dvc.lock) with ")
    assert "; while measuring: before CPU time/wall " in moved.machine


def first_screen(report) -> list[tuple[int, str]]:
    from dflashpipe.commands.explain import answer, answer_lines

    return answer_lines(answer(report))


def test_the_seed_incident_replayed_names_exactly_its_four_causes_on_the_first_screen(committed, monkeypatch):
    """The story this project exists for, on the tiny pipeline: the data grown, the compile cache deleted, a torch
    file patched, a thread variable changed. The first screen names exactly those four causes, each with the stages
    it invalidates, in at most 25 lines of 100 columns, and nothing else as a cause."""
    from dflashpipe.commands.explain.render import DETAIL, INDENT, ITEM, SECTION, WIDTH

    recorded = json.loads((committed / "data/env/fingerprint.json").read_text())["threads"]
    set_params(committed, data__num_samples=N + 20)
    shutil.rmtree(committed / "data/compile")
    edit_torch_file_as_the_check_sees_it(committed)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lines = first_screen(explain("HEAD", "workspace", committed))
    assert len(lines) <= 25 and all(INDENT[level] + len(text) <= WIDTH for level, text in lines)
    causes = lines[lines.index((SECTION, "Causes")) + 1 : lines.index((SECTION, "Stages"))]
    named = {text.split(":", 1)[0].split(") ", 1)[1]: i for i, (level, text) in enumerate(causes) if level == ITEM}
    assert set(named) == {
        "param data.num_samples",
        "output data/compile of warmup",
        "machine torch.files_edited",
        "machine threads",
    }, causes

    def hits(name: str) -> str:  # the line after the cause, less the evidence's name when it went there
        return causes[named[name] + 1][1].split("  [", 1)[0]

    def invalidates(direct: list[str]) -> str:
        """What dvc.yaml's DAG puts downstream of `direct`: the stages reading their outputs, transitively."""
        ups, found = Pipeline.read(committed).upstream(), list(direct)
        for name in ups:  # dvc.yaml lists stages upstream first
            if name not in found and set(ups[name]) & set(found):
                found.append(name)
        later = [name for name in ups if name in found and name not in direct]
        return f"invalidates {', '.join(direct)}" + (f"; downstream {', '.join(later)}" if later else "")

    assert hits("param data.num_samples") == invalidates(["manifest"])
    assert causes[named["output data/compile of warmup"]][1].endswith("missing; restorable: `dvc checkout`")
    assert hits("machine torch.files_edited") == invalidates(naming("torch.files_edited"))
    assert f'machine torch.files_edited: [] -> ["{EDITED}"]' in causes[named["machine torch.files_edited"]][1]
    threads = naming("threads.torch_intra_op") if recorded["torch_intra_op"] > 1 else naming("threads.env")
    assert hits("machine threads") == invalidates(threads)
    assert ") machine threads: env: OMP_NUM_THREADS unset -> 1" in causes[named["machine threads"]][1]
    assert all(level in (ITEM, DETAIL) for level, _ in causes)


def test_a_variable_no_runtime_of_torch_reads_reruns_nothing_and_one_it_reads_reruns_its_readers(committed):
    """OPENBLAS_* beside a torch that computes on MKL reaches only numpy's OpenBLAS, which no stage's output goes
    through: recorded, invalidating nothing. OMP_NUM_THREADS is read by torch's OpenMP: the stages naming the
    thread facts rerun, the rest stays."""
    fingerprint = committed / "data/env/fingerprint.json"
    runtimes = json.loads(fingerprint.read_text())["threads"]["runtimes"]["torch"]
    if "openblas" in runtimes:
        pytest.skip("this torch computes on OpenBLAS: its variables are read here")
    openblas = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
    run(["dvc", "repro", "fingerprint"], committed, env=openblas)
    threads = json.loads(fingerprint.read_text())["threads"]
    assert threads["other_env"] == openblas and not set(openblas) & set(threads["env"])
    assert set(json.loads(run(["dvc", "status", "--json"], committed).stdout)) == {"fingerprint"}
    assert verdicts(explain("HEAD", "workspace", committed, machine=False)) == quiet()

    intra = threads["torch_intra_op"]
    run(["dvc", "repro", "fingerprint"], committed, env={"OMP_NUM_THREADS": "1"})
    readers = naming("threads.torch_intra_op") if intra > 1 else naming("threads.env")
    assert set(json.loads(run(["dvc", "status", "--json"], committed).stdout)) == {"fingerprint", *readers}
    assert verdicts(explain("HEAD", "workspace", committed, machine=False)) == invalidated(readers)


def test_a_stage_run_alone_under_other_threads_than_the_fingerprint_file_refuses_before_any_work(committed):
    """`dvc repro -s bench` skips the fingerprint stage: bench would run at one thread while dvc.lock recorded the
    file's thread facts. It refuses in one line, naming the key, both values and the fix, and nothing is locked."""
    lock = (committed / "dvc.lock").read_bytes()
    proc = run(["dvc", "repro", "-f", "-s", "bench"], committed, check=False, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    (line,) = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("dflashpipe bench:")]
    assert line.startswith("dflashpipe bench: error: data/env/fingerprint.json is stale: threads.")
    assert "OMP_NUM_THREADS unset -> 1" in line
    assert line.endswith("run `dvc repro` without -s/--single-item, or `dvc repro fingerprint` first")
    assert (committed / "dvc.lock").read_bytes() == lock

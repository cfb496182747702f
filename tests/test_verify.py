"""`dflashpipe explain --verify`: causes proven by intervention, on a tiny pipeline of its own (stdlib stages
that run in milliseconds) whose effects are known by construction:

- `kernel.py` sleeps per row: A's 0.25 ms, B's 4 ms (the slow kernels): restoring it is a change;
- without `cache/kernels.json` (the compile cache, deleted in the workspace) every row pays 4 ms more:
  restoring it from the DVC cache is a change;
- `data.rows` grows 40 -> 60, but throughput is timed on fixed batches: reverting it is within noise;
- `machine.json` is written by a stage from the machine (cu128 -> cu130): it cannot be reverted here;
- `probe` times the same kernel on fixed rows and reads no data: `measure`'s probe, as bench is train's.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from dflashpipe.commands.rerun.verify import (
    FIXED,
    MEASURED,
    OUTSIDE,
    OVER_BUDGET,
    ranked,
    verification_lines,
    verify,
)
from tests.conftest import run

FAST, SLOW = 0.00025, 0.004

STAGES = {
    "machine": {
        "cmd": "python machine.py",
        "deps": ["machine.py"],
        "outs": [{"machine.json": {"cache": False}}],
        "always_changed": True,
    },
    "prepare": {"cmd": "python prepare.py", "deps": ["prepare.py"], "params": ["data.rows"], "outs": ["data"]},
    "warm": {"cmd": "python warm.py", "deps": ["warm.py"], "params": ["kernel.block"], "outs": ["cache"]},
    "measure": {
        "cmd": "python measure.py",
        "deps": ["measure.py", "kernel.py", "data", "cache"],
        "params": [{"machine.json": ["lib"]}],
        "metrics": [{"metrics.json": {"cache": False}}],
    },
    "probe": {
        "cmd": "python measure.py probe",
        "deps": ["measure.py", "kernel.py", "cache"],
        "params": [{"machine.json": ["lib"]}],
        "metrics": [{"probe.json": {"cache": False}}],
    },
}

SCRIPTS = {
    "machine.py": """
        import json, os
        json.dump({"lib": os.environ.get("TINY_LIB", "cu128")}, open("machine.json", "w"))
    """,
    "prepare.py": """
        import json, os, yaml
        rows = yaml.safe_load(open("params.yaml"))["data"]["rows"]
        os.makedirs("data", exist_ok=True)
        json.dump(list(range(rows)), open("data/rows.json", "w"))
    """,
    "warm.py": """
        import json, os, yaml
        os.makedirs("cache", exist_ok=True)
        json.dump({"block": yaml.safe_load(open("params.yaml"))["kernel"]["block"]}, open("cache/kernels.json", "w"))
    """,
    "measure.py": """
        # rows/s on 4 fixed batches of 8 rows: the data's size cannot reach it, the kernel and its cache can;
        # `probe`: the same on rows of its own, reading no data
        import json, os, statistics, sys, time
        import kernel
        probe = sys.argv[1:] == ["probe"]
        rows = list(range(32)) if probe else json.load(open("data/rows.json"))
        compiled = os.path.exists("cache/kernels.json")
        rates = []
        for b in range(4):
            start = time.perf_counter()
            for i in range(8):
                kernel.step(rows[(b * 8 + i) % len(rows)])
                if not compiled:
                    time.sleep(0.004)  # no compile cache: kernels built on the fly
            rates.append(8 / (time.perf_counter() - start))
        wall = sum(8 / r for r in rates)
        key = "probe_rows_per_s" if probe else "rows_per_s"
        json.dump({key: statistics.median(rates),
                   key + "_spread": {"low": min(rates), "high": max(rates), "repeats": len(rates),
                                     "machine": {"wall_s": wall}}},
                  open("probe.json" if probe else "metrics.json", "w"))
    """,
}


def kernel(cost: float) -> str:
    return f"import time\n\n\ndef step(row):\n    time.sleep({cost})\n"


def dvc_repro(project: Path, **env) -> None:
    """`dvc repro` in-process (the CLI would cost seconds of imports per call)."""
    from dvc.repo import Repo

    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.chdir(project)
        with Repo(str(project)) as repo:
            repo.reproduce()


def commit(project: Path, message: str) -> None:
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", message], project)


def tiny_incident(project: Path) -> Path:
    """A healthy run (tag `healthy`); a commit that grew the data; one that slowed the kernel and swapped the
    kernel library; then, uncommitted, the compile cache deleted. docs/incident.md replays the same."""
    from dvc.repo import Repo

    project.mkdir(parents=True)
    for name, text in SCRIPTS.items():
        (project / name).write_text(textwrap.dedent(text).lstrip())
    (project / "kernel.py").write_text(kernel(FAST))
    (project / "params.yaml").write_text(yaml.safe_dump({"data": {"rows": 40}, "kernel": {"block": 8}}))
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": STAGES}, sort_keys=False))
    run(["git", "init", "-q"], project)
    run(["git", "config", "user.email", "test@example.com"], project)
    run(["git", "config", "user.name", "test"], project)
    Repo.init(str(project)).close()
    dvc_repro(project)
    commit(project, "healthy run")
    run(["git", "tag", "healthy"], project)
    (project / "params.yaml").write_text(yaml.safe_dump({"data": {"rows": 60}, "kernel": {"block": 8}}))
    dvc_repro(project)
    commit(project, "grow the data 40 -> 60 rows")
    (project / "kernel.py").write_text(kernel(SLOW))
    dvc_repro(project, TINY_LIB="cu130")
    commit(project, "new kernel build, on cu130")
    (project / "cache" / "kernels.json").unlink()
    return project


def tree_digest(project: Path) -> dict[str, str]:
    """Every workspace file's sha256, DVC's cache and scratch (which arms may add to) left out."""
    found = {}
    for path in sorted(project.rglob("*")):
        rel = path.relative_to(project).as_posix()
        if path.is_file() and not rel.startswith((".dvc/cache/", ".dvc/tmp/")):
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def incident(tmp_path_factory):
    """Shared: verify never changes the workspace (the first test checks it), and --budget 0 runs nothing."""
    with pytest.MonkeyPatch.context() as mp:
        # the stages run under DVC in this process: `python` must be this interpreter (it has yaml)
        mp.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        yield tiny_incident(tmp_path_factory.mktemp("verify") / "project")


def test_each_cause_reverted_alone_gives_its_known_effect_and_the_workspace_is_untouched(incident):
    before, status = tree_digest(incident), run(["git", "status", "--porcelain"], incident).stdout
    found = verify("rows_per_s", "healthy", "workspace", incident, runs=2, progress=False)
    assert tree_digest(incident) == before and run(["git", "status", "--porcelain"], incident).stdout == status
    assert (found.file, found.stage, found.runs) == ("metrics.json", "measure", 2)
    by_cause = {(i.cause.kind, i.cause.what): i for i in found.interventions}
    assert set(by_cause) == {
        ("dep", "kernel.py"),
        ("param", "params.yaml:data.rows"),
        ("param", "machine.json:lib"),
        ("out", "cache"),
    }
    assert found.baseline is not None and found.baseline["repeats"] == 2 * 4, verification_lines(found)
    kernel_fix, cache_fix = by_cause[("dep", "kernel.py")], by_cause[("out", "cache")]
    data, lib = by_cause[("param", "params.yaml:data.rows")], by_cause[("param", "machine.json:lib")]
    assert (kernel_fix.status, kernel_fix.call) == (MEASURED, "change") and kernel_fix.change > 0.5
    assert (cache_fix.status, cache_fix.call) == (MEASURED, "change") and cache_fix.change > 0.5
    assert (data.status, data.call) == (MEASURED, "noise"), verification_lines(found)
    assert lib.status == FIXED and "written by stage machine" in lib.action and "cu128" in lib.action
    assert all(i.figure["repeats"] == 8 and i.seconds > 0 for i in (kernel_fix, cache_fix, data))
    # all three together take it most of the way back to A: what is left is the machine's
    assert found.together.call == "change" and found.together.share > 0.5 > max(kernel_fix.share, cache_fix.share)
    lines = verification_lines(found)
    assert any(
        line.startswith("revert param data.rows in params.yaml to 40 [") and "within noise" in line for line in lines
    )
    assert any(line.startswith("restore kernel.py from A (") and ", change" in line for line in lines)
    assert any(line.startswith("no probe for rows_per_s: each arm runs stage measure (timed run as") for line in lines)
    assert any(line.startswith("cannot revert here [param machine.json:lib: cu128 -> cu130]") for line in lines)


def test_budget_caps_the_runs_and_bad_input_is_one_line(incident):
    from typer.testing import CliRunner

    from dflashpipe.cli import app

    cwd = os.getcwd()
    os.chdir(incident)
    try:
        result = CliRunner().invoke(app, ["explain", "healthy", "--verify", "rows_per_sec", "--budget", "0"])
        assert result.exit_code == 2
        assert result.output.strip().splitlines() == [
            "error: no metrics file of workspace or healthy records 'rows_per_sec'; "
            "nearby keys: rows_per_s (metrics.json), probe_rows_per_s (probe.json)"
        ]
        text = CliRunner().invoke(app, ["explain", "healthy", "--verify", "rows_per_s", "--budget", "0"])
        result = CliRunner().invoke(app, ["explain", "healthy", "--verify", "rows_per_s", "--budget", "0", "--json"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 0 and text.exit_code == 0, result.output + text.output
    # the first screen (the causes, the stages, the headlines) first, then the arms
    screen, arms = text.output.split("\nverify rows_per_s (metrics.json, stage measure): ")
    assert screen.startswith("What changed: healthy -> workspace\nCauses\n") and "Headlines" in screen
    assert "not run (over --budget)" in arms
    data = json.loads(result.output)
    assert data["baseline"] is None  # nothing ran
    assert sorted(i["status"] for i in data["interventions"]) == [FIXED, OVER_BUDGET, OVER_BUDGET, OVER_BUDGET]


PROBE = {"metrics.json:rows_per_s": "probe.json:probe_rows_per_s"}


def test_a_probe_measured_in_place_of_the_metric_sees_the_kernel_and_rules_the_data_out(incident):
    found = verify("rows_per_s", "healthy", "workspace", incident, runs=2, progress=False, probes=PROBE)
    assert (found.stage, found.measured.stage, found.measured.file) == ("measure", "probe", "probe.json")
    by_cause = {(i.cause.kind, i.cause.what): i for i in found.interventions}
    data = by_cause[("param", "params.yaml:data.rows")]
    assert data.status == OUTSIDE and data.figure is None and "stage probe does not read it" in data.action
    kernel_fix, cache_fix = by_cause[("dep", "kernel.py")], by_cause[("out", "cache")]
    assert (kernel_fix.call, cache_fix.call) == ("change", "change"), verification_lines(found)
    assert "moved together" in found.probe_agreement, found.probe_agreement
    # said before the first arm: 4 arms (baseline, two causes, together) x 2 runs x the probe's recorded run
    recorded = json.loads((incident / "probe.json").read_text())["probe_rows_per_s_spread"]["machine"]["wall_s"]
    assert found.estimate_s == round(4 * 2 * recorded, 1)
    lines = verification_lines(found)
    assert lines[1].startswith("answer: ") and ("dep kernel.py" in lines[1] or "output cache" in lines[1])
    print("\n".join(lines))
    causes = [line.split(" [", 1)[0] for line in lines if " [" in line and not line.startswith("revert all")]
    assert causes[-2:] == ["outside the probe", "cannot revert here"], causes  # after the measured ones
    shares = [i.share for i in ranked(found) if i.status == MEASURED]
    assert shares == sorted(shares, key=abs, reverse=True), shares  # ranked by measured effect


def test_a_verification_over_its_time_budget_is_refused_before_any_run(incident):
    from typer.testing import CliRunner

    from dflashpipe.cli import app

    before = tree_digest(incident)
    cwd = os.getcwd()
    os.chdir(incident)
    try:
        result = CliRunner().invoke(app, ["explain", "healthy", "--verify", "rows_per_s", "--time-budget", "0.001"])
    finally:
        os.chdir(cwd)
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: --verify rows_per_s: estimated ") and "over --time-budget 0 s" in line, line
    assert "has no probe: each arm runs stage measure" in line and "pass --time-budget " in line
    assert tree_digest(incident) == before
    assert len(run(["git", "worktree", "list"], incident).stdout.splitlines()) == 1  # no arm was opened


def causes_of(group: str, changes: dict) -> list:
    from dflashpipe.commands.explain import Cause

    return [Cause("machine", f"{group}.{k}" if k else group, old, new, "test") for k, (old, new) in changes.items()]


@pytest.mark.parametrize(
    ("group", "changes", "status", "variables", "pristine", "says"),
    [
        ("threads", {"env": ({}, {"OMP_NUM_THREADS": "1"}), "torch_intra_op": (2, 1)}, MEASURED,
         {"OMP_NUM_THREADS": None}, False, "run with OMP_NUM_THREADS unset"),
        ("env", {"": ({"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, {})}, MEASURED,
         {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, False, "run with TORCHINDUCTOR_MAX_AUTOTUNE=1"),
        ("torch", {"files_edited": ([], ["torch/autograd/__init__.py"]), "files_ok": (True, False)}, MEASURED,
         {}, True, "run in a pristine environment from A's requirements/cpu.lock"),
        ("torch", {"cpu_capability": ("AVX512", "AVX2")}, FIXED, {}, False, "only a machine with torch.cpu_capability"),
        ("gpu", {"names": (["NVIDIA H100"], ["NVIDIA H200"])}, FIXED, {}, False, "only a machine with gpu.names"),
    ],
)  # fmt: skip
def test_a_machine_cause_is_reverted_by_a_variable_or_a_pristine_environment_or_named_as_the_machine(
    group, changes, status, variables, pristine, says
):
    from dflashpipe.commands.rerun.verify import _plan_machine
    from tests.conftest import ROOT

    planned = _plan_machine(causes_of(group, changes), "HEAD", ROOT)
    assert (planned.status, planned.variables, planned.pristine) == (status, variables, pristine)
    assert planned.action.startswith(says), planned.action
    assert len(planned.causes) == len(changes)  # one arm for the group's keys


def test_a_figure_that_is_not_timed_costs_its_runs_longest_timed_part_not_a_copied_stages():
    from dflashpipe.commands.rerun.verify import _timed_parts

    record = {
        "tau": 2.1,
        "decode_tokens_per_s": {"target_spread": {"machine": {"wall_s": 30.0}}, "x_spread": {"machine": {}}},
        "train": {"tokens_per_s_spread": {"machine": {"wall_s": 900.0}}},  # train's run, copied: not evaluate's
    }
    assert _timed_parts(record, {"train"}) == [30.0]
    assert sorted(_timed_parts(record, set())) == [30.0, 900.0]

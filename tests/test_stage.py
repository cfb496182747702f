"""The stage runner (`dflashpipe.core.stage.run_stage`): a dep or param edited while a stage runs fails the stage
with one line naming it, so DVC (which hashes deps only after the command, DVC issue #11058) records nothing.

Real DVC in a temporary git repo: a stage of its own that goes through `run_stage` like every stage of the
project, and waits mid-run until the test has edited one of its inputs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflashpipe.core import pipeline
from tests.conftest import copy_from_root, run

ROOT = Path(__file__).resolve().parents[1]

PROBE = f"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {str(ROOT / "src")!r})
from dflashpipe.core.stage import run_stage


def body(params):
    Path("out.txt").write_text(Path("inputs/a.txt").read_text())
    signal = os.environ.get("PROBE_SIGNAL")
    if signal:  # say the body runs (the start key is taken), then wait for the test's edit
        Path(signal + ".started").touch()
        deadline = time.time() + 120
        while not Path(signal + ".go").exists() and time.time() < deadline:
            time.sleep(0.02)


run_stage("probe", body)
"""

DVC_YAML = {
    "stages": {
        "probe": {
            "cmd": "python probe.py",
            "deps": ["probe.py", "inputs"],
            "params": [{"probe.yaml": ["x"]}],
            "outs": ["out.txt"],
        }
    }
}


@pytest.fixture
def project(tmp_path) -> Path:
    """A git + DVC repo with the project's params.yaml (every stage validates it) and one stage, run once."""
    project = copy_from_root(tmp_path / "project", ["params.yaml", ".dvcignore"])
    (project / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (project / "probe.py").write_text(PROBE)
    (project / "probe.yaml").write_text("x: 1\n")
    (project / "inputs").mkdir()
    (project / "inputs/a.txt").write_text("first\n")
    (project / "inputs/b.txt").write_text("second\n")
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"]):
        run(cmd, project)
    run(["dvc", "repro"], project)
    return project


def repro_editing(project: Path, edit) -> subprocess.CompletedProcess:
    """`dvc repro -f probe`, calling `edit()` while the stage's body runs (after its start key was taken)."""
    signal = project.parent / "signal"
    for done in (Path(f"{signal}.started"), Path(f"{signal}.go")):
        done.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PROBE_SIGNAL": str(signal),
    }
    proc = subprocess.Popen(
        ["dvc", "repro", "-f", "probe"], cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 120
    while not Path(f"{signal}.started").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    edit()
    Path(f"{signal}.go").touch()
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def our_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("dflashpipe probe:")]


def test_a_dep_edited_while_the_stage_runs_fails_it_with_one_line_and_nothing_is_locked(project):
    lock = (project / "dvc.lock").read_bytes()
    proc = repro_editing(project, lambda: (project / "inputs/a.txt").write_text("edited mid-run\n"))
    assert proc.returncode != 0
    assert our_lines(proc) == [
        "dflashpipe probe: error: inputs/a.txt changed while the stage ran, so its outputs were made from other "
        "inputs than DVC would record; nothing was recorded: rerun `dvc repro probe`"
    ]
    assert (project / "dvc.lock").read_bytes() == lock
    # rerun as told: now the lock records the edited input with the output made from it
    run(["dvc", "repro", "probe"], project)
    assert (project / "out.txt").read_text() == "edited mid-run\n"
    assert "dvc.lock" not in run(["dvc", "status"], project).stdout


def test_a_param_or_an_added_file_changed_while_the_stage_runs_is_named(project):
    lock = (project / "dvc.lock").read_bytes()
    proc = repro_editing(project, lambda: (project / "probe.yaml").write_text("x: 2\n"))
    assert proc.returncode != 0 and (project / "dvc.lock").read_bytes() == lock
    (line,) = our_lines(proc)
    assert line.startswith("dflashpipe probe: error: probe.yaml:x changed while the stage ran")

    def two_edits() -> None:
        (project / "inputs/c.txt").write_text("added\n")
        (project / "inputs/b.txt").unlink()

    proc = repro_editing(project, two_edits)
    assert proc.returncode != 0 and (project / "dvc.lock").read_bytes() == lock
    (line,) = our_lines(proc)
    assert line.startswith("dflashpipe probe: error: inputs/b.txt (and 1 more: inputs/c.txt) changed while")


def test_a_stage_whose_inputs_stayed_put_records_as_before(project):
    proc = repro_editing(project, lambda: None)
    assert proc.returncode == 0 and our_lines(proc) == [], proc.stderr
    assert "probe" in yaml.safe_load((project / "dvc.lock").read_text())["stages"]


def test_every_stage_script_goes_through_run_stage_under_its_dvc_yaml_name():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        script = ROOT / stage["cmd"].split()[-1]
        found = re.findall(r"run_stage\(\s*\"([a-z_]+)\"", script.read_text())
        assert found == [name], f"{script} must call run_stage({name!r}, ...) once"


def test_a_file_is_hashed_once_unless_its_stat_moved(tmp_path, monkeypatch):
    """The end-of-stage key re-reads only files whose stat moved, and never trusts a stat that could hide an
    edit: a file changed within RACY_NS of its hashing, or one whose ctime alone moved (mtime set back)."""
    reads: list[Path] = []
    real = pipeline.file_sha256
    monkeypatch.setattr(pipeline, "file_sha256", lambda path: reads.append(path) or real(path))
    old = time.time() - 60
    file = tmp_path / "dep.bin"
    file.write_bytes(b"aaaa")
    os.utime(file, (old, old))
    first = pipeline._file_digest(file)
    # ctime is now (utime moved it): within RACY_NS, so not trusted yet
    assert pipeline._file_digest(file) == first and len(reads) == 2
    monkeypatch.setattr(pipeline, "RACY_NS", 0)  # hashed after its last change: from now on its stat says enough
    assert pipeline._file_digest(file) == first and len(reads) == 2
    # same size, mtime set back: only the ctime moved, and that is enough to read it again
    time.sleep(0.05)
    file.write_bytes(b"bbbb")
    os.utime(file, (old, old))
    assert pipeline._file_digest(file) != first and len(reads) == 3


def test_a_measurement_window_records_cpu_time_against_wall_time():
    from dflashpipe.core.spread import Control, Measuring, Spread

    with Measuring() as idle:
        time.sleep(0.2)
    assert idle.busy.wall_s >= 0.2 and idle.busy.cpu_s / idle.busy.wall_s < 0.5  # asleep: no CPU wanted
    with Measuring() as spinning:
        began = time.process_time()
        while time.process_time() - began < 0.1:
            pass
    # one thread, and what the control's OpenMP threads spin on after it (a few ms, into the window)
    assert spinning.busy.cpu_s >= 0.1 and spinning.busy.cpu_s <= spinning.busy.wall_s * 1.05 + 0.03
    recorded = Spread.of([1.0, 2.0, 3.0]).record("tokens_per_s", busy=spinning.busy)
    assert recorded["tokens_per_s_spread"]["machine"] == spinning.busy.to_json()
    assert Spread.read(recorded, "tokens_per_s") == Spread(2.0, 1.0, 3.0, 3)  # readers see the figure as before
    # the control, timed before and after the window on the same device, rides with the machine facts
    before, after = spinning.busy.control_ms
    assert before > 0 and after > 0
    assert recorded["tokens_per_s_spread"]["machine"]["control_ms"] == {"before": before, "after": after}
    assert Control.read(recorded["tokens_per_s_spread"]["machine"]) == Control(before, after)


def test_a_control_that_cannot_run_is_recorded_as_absent_never_as_zero():
    from dflashpipe.core.spread import Busy, Control, control_ms, cuda_facts

    assert control_ms("cuda:99") is None  # no such device here: absent
    assert cuda_facts("cpu") is None and cuda_facts("cuda:99") is None  # NVML's facts only for a CUDA device
    assert "control_ms" not in Busy(1.0, 1.0, 2, 0.5, None).to_json()
    assert Control.read({"control_ms": {"before": 0.0, "after": 3.0}}) is None
    assert Control.read({"control_ms.before": 3.0, "control_ms.after": 6.0}) == Control(3.0, 6.0)  # flattened


def test_a_stage_refuses_a_machine_the_fingerprint_file_does_not_describe(tmp_path):
    """DVC records the fingerprint file's values of the keys a stage declares; a stage must not run where the
    machine differs (the fingerprint stage skipped), and says which key, both values and the fix. The machine is
    observed by the fingerprint stage's own code; a fact it no longer has (a library uninstalled) is removed."""
    import json
    import shutil

    from dflashpipe.core import env
    from dflashpipe.core.stage import StaleMachineError, check_machine_current

    project = tmp_path / "project"
    (project / ".dvc/tmp").mkdir(parents=True)
    if (ROOT / env.HASH_STATE).is_file():  # spares hashing torch's files again: the test is not about that
        shutil.copy(ROOT / env.HASH_STATE, project / env.HASH_STATE)
    keys = ["threads.torch_intra_op", "threads.env", "torch.version", "flash_attn.version"]
    stages = {"timed": {"cmd": "python timed.py", "params": [{"data/env/fingerprint.json": keys}], "outs": ["o"]}}
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    record = project / "data/env/fingerprint.json"
    check_machine_current("timed", project)  # no fingerprint file yet: DVC cannot run the stage, nothing to compare

    live = env.observe(project / env.HASH_STATE, project=project).facts
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps(live))
    check_machine_current("timed", project)  # the file describes this machine

    other = json.loads(json.dumps(live))
    other["threads"]["torch_intra_op"] = live["threads"]["torch_intra_op"] + 1
    other["threads"]["env"] = {**live["threads"]["env"], "OMP_NUM_THREADS": "7"}
    other["flash_attn"] = {"version": "2.7.4"}
    record.write_text(json.dumps(other))
    with pytest.raises(StaleMachineError) as err:
        check_machine_current("timed", project)
    intra = live["threads"]["torch_intra_op"]
    assert str(err.value) == (
        f"data/env/fingerprint.json is stale: threads.torch_intra_op is {intra + 1} there but {intra} on this "
        "machine; threads.env: OMP_NUM_THREADS 7 -> unset; flash_attn.version: 2.7.4 -> removed; dvc.lock would "
        "record a machine this stage did not run on: run `dvc repro` without -s/--single-item, or `dvc repro "
        "fingerprint` first"
    )


def test_every_stage_that_declares_target_dtype_refuses_a_file_whose_target_dtype_is_not_this_machines(tmp_path):
    """The refusal reads the keys each stage declares in dvc.yaml, so a fingerprint group added there
    (target_dtype: what compute.target_dtype: auto computes in) is checked without a list of its own: a file
    written on a CPU with bfloat16 kernels does not describe one without them."""
    import json
    import shutil

    from dflashpipe.core import env
    from dflashpipe.core.stage import StaleMachineError, check_machine_current

    project = tmp_path / "project"
    (project / ".dvc/tmp").mkdir(parents=True)
    if (ROOT / env.HASH_STATE).is_file():  # spares hashing torch's files again: the test is not about that
        shutil.copy(ROOT / env.HASH_STATE, project / env.HASH_STATE)
    shutil.copy(ROOT / "dvc.yaml", project / "dvc.yaml")
    declaring = [
        name
        for name in pipeline.Pipeline.read(ROOT).names
        if (str(pipeline.FINGERPRINT), "target_dtype") in pipeline.stage_spec(name, ROOT).params
    ]
    assert {"regenerate", "features", "warmup", "train", "bench", "evaluate"} <= set(declaring)

    live = env.observe(project / env.HASH_STATE, project=project).facts
    other = json.loads(json.dumps(live))
    other["target_dtype"]["cpu"] = "bfloat16" if live["target_dtype"]["cpu"] != "bfloat16" else "float32"
    record = project / pipeline.FINGERPRINT
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps(other))
    for name in declaring:
        with pytest.raises(StaleMachineError, match=r"stale: target_dtype is .* there but .* on this machine"):
            check_machine_current(name, project)

"""`dflashpipe history` on a small real DVC project in a temporary git repo: three stages (prepare -> train ->
evaluate) whose scripts are one-liners, run by real `dvc repro` and `dvc exp run`, so every commit, lock
entry, `.dir` listing and experiment ref is DVC's own. Then the bad inputs: each one line, exit 2, nothing
changed on disk."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from dflashpipe.commands.explain import NoiseCall, StageVerdict, explain, to_markdown
from dflashpipe.commands.explain.history import history, history_lines, history_markdown
from dflashpipe.core.errors import DflashpipeError
from tests.conftest import run

TRAIN = "metrics/train/metrics.json"  # the file names report's headlines read

# prepare writes one part file per 10 samples (growing n adds part files, the old ones keep their bytes) and
# an eval split that n does not touch; train reads a speed file no stage tracks (a timing is an observation,
# not an input) and records tokens_per_s with its spread; evaluate reads the model and the eval split only.
PREPARE_PY = """
import json, pathlib, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
out = pathlib.Path("data/prep"); out.mkdir(parents=True, exist_ok=True)
for i in range(n // 10):
    (out / f"part-{i}.txt").write_text(f"part {i}\\n")
(out / "eval.txt").write_text("held out\\n")
"""
TRAIN_PY = """
import json, pathlib
parts = sorted(pathlib.Path("data/prep").glob("part-*.txt"))
pathlib.Path("data/model").mkdir(parents=True, exist_ok=True)
pathlib.Path("data/model/weights.txt").write_text(f"{len(parts)} parts\\n")
speed = json.loads(pathlib.Path("speed.json").read_text())
record = {"final_loss": round(1 / (1 + len(parts)), 4), "tokens_per_s": speed["median"]}
if speed.get("repeats", 1) > 1:
    record["tokens_per_s_spread"] = {k: speed[k] for k in ("low", "high", "repeats")}
pathlib.Path("metrics/train").mkdir(parents=True, exist_ok=True)
pathlib.Path("metrics/train/metrics.json").write_text(json.dumps(record))
"""
EVALUATE_PY = """
import json, pathlib
w = pathlib.Path("data/model/weights.txt").read_text()
e = pathlib.Path("data/prep/eval.txt").read_text()
pathlib.Path("metrics/eval.json").write_text(json.dumps({"tau": len(w) + len(e)}))
"""
DVC_YAML = {
    "stages": {
        "prepare": {"cmd": "python prepare.py", "deps": ["prepare.py"], "params": ["n"], "outs": ["data/prep"]},
        "train": {
            "cmd": "python train.py",
            "deps": ["train.py", "data/prep"],
            "outs": ["data/model"],
            "metrics": [{"metrics/train/metrics.json": {"cache": False}}],
        },
        "evaluate": {
            "cmd": "python evaluate.py",
            "deps": ["evaluate.py", "data/model", "data/prep/eval.txt"],
            "metrics": [{"metrics/eval.json": {"cache": False}}],
        },
    }
}


def git(project: Path, *args: str) -> str:
    return run(["git", *args], project).stdout.strip()


def set_speed(project: Path, median: float, low: float, high: float, repeats: int) -> None:
    (project / "speed.json").write_text(json.dumps({"median": median, "low": low, "high": high, "repeats": repeats}))


def commit_run(project: Path, message: str, n: int | None = None) -> None:
    if n is not None:
        (project / "params.yaml").write_text(yaml.safe_dump({"n": n}))
    run(["dvc", "repro", "-q"], project)
    git(project, "add", "-A")
    git(project, "commit", "-qm", message)


@pytest.fixture(scope="module")
def toy_history(tmp_path_factory) -> Path:
    """Four commits: the project (no dvc.lock), a first run (n=20, speed without spread), grown data
    (n=30, speed within noise of the next), a train.py edit (speed beyond noise)."""
    project = tmp_path_factory.mktemp("toy") / "project"
    project.mkdir()
    for name, text in {"prepare.py": PREPARE_PY, "train.py": TRAIN_PY, "evaluate.py": EVALUATE_PY}.items():
        (project / name).write_text(text)
    (project / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 20}))
    (project / ".gitignore").write_text("speed.json\n")
    git(project, "init", "-q")
    git(project, "config", "user.email", "test@example.com")
    git(project, "config", "user.name", "test")
    run(["dvc", "init", "-q"], project)
    run(["dvc", "config", "core.analytics", "false"], project)
    git(project, "add", "-A")
    git(project, "commit", "-qm", "project")
    set_speed(project, 100.0, 100.0, 100.0, 1)  # an old record: one repeat, no spread
    commit_run(project, "first run")
    set_speed(project, 95.0, 90.0, 104.0, 5)
    commit_run(project, "grow the data", n=30)
    set_speed(project, 70.0, 66.0, 73.0, 5)
    with open(project / "train.py", "a") as fh:
        fh.write("# slower\n")
    commit_run(project, "edit train")
    return project


def test_every_commit_with_its_metrics_causes_and_noise_calls(toy_history):
    h = history(root=toy_history)
    assert [s.subject for s in h.steps] == ["first run", "grow the data", "edit train"]
    # report's headline figures, those these commits record
    assert h.metrics == ["metrics/eval.json:tau", f"{TRAIN}:tokens_per_s", f"{TRAIN}:final_loss"]
    first, grown, edited = h.steps
    assert first.parent is None and first.root_causes == [] and first.metrics[f"{TRAIN}:tokens_per_s"] == 100.0

    # growing n reaches train through the DAG, but a move within the repeats' range is noise: not blamed on n
    assert [(c.kind, c.what, c.old, c.new, c.stages) for c in grown.root_causes] == [
        ("param", "params.yaml:n", 20, 30, ["prepare"])
    ]
    deltas = {d.key: d for d in grown.deltas}
    assert deltas["tokens_per_s"].call == NoiseCall.UNMEASURED  # the first run recorded no spread
    assert deltas["tokens_per_s"].spread == "before no spread recorded; after 95 (range 90..104, 5 repeats)"
    assert deltas["final_loss"].causes == ["params.yaml:n"] and grown.moved == [f"{TRAIN}:final_loss"]

    deltas = {d.key: d for d in edited.deltas}
    assert (deltas["tokens_per_s"].call, deltas["tokens_per_s"].causes) == (NoiseCall.CHANGE, ["train.py"])
    assert deltas["tokens_per_s"].spread.endswith("after 70 (range 66..73, 5 repeats)")
    assert edited.moved == [f"{TRAIN}:tokens_per_s"]
    assert [(c.what, c.stages) for c in edited.root_causes] == [("train.py", ["train"])]

    text = "\n".join(history_lines(h))
    assert "tokens_per_s: 95.0 -> 70.0 [change: before 95 (range 90..104, 5 repeats); after 70" in text
    assert text.count("<< moved") == 2
    assert "**70.0 (change)**" in history_markdown(history(root=toy_history))


def test_a_move_within_noise_is_not_attributed_even_when_a_cause_reaches_the_stage(toy_history, tmp_path):
    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    set_speed(project, 72.0, 68.0, 75.0, 5)  # overlaps HEAD's 66..73
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 40}))
    # the clone has no DVC cache: pull the outputs from the original's
    run(["dvc", "cache", "dir", str(toy_history / ".dvc/cache")], project)
    run(["dvc", "checkout", "-q"], project, check=False)
    commit_run(project, "grow again")
    (step,) = history(since="HEAD~1", metrics=["tokens_per_s", "final_loss"], root=project).steps
    deltas = {d.key: d for d in step.deltas}
    assert (deltas["tokens_per_s"].call, deltas["tokens_per_s"].causes) == (NoiseCall.NOISE, [])
    assert deltas["final_loss"].causes == ["params.yaml:n"]
    assert step.moved == [f"{TRAIN}:final_loss"]  # a deterministic figure that changed did move


def test_file_level_paths_name_only_files_whose_hash_changed(toy_history):
    report = explain("HEAD~2", "HEAD~1", toy_history)  # n 20 -> 30: prepare adds part-2.txt
    by_stage = {v.stage: v for v in report.stages}
    assert by_stage["train"].paths == ["train <- data/prep/part-2.txt (prepare: params.yaml:n)"]
    # evaluate also lists data/prep/eval.txt, whose hash did not change: it is reached through train only
    assert by_stage["evaluate"].verdict == StageVerdict.DOWNSTREAM
    assert by_stage["evaluate"].paths == [
        "evaluate <- data/model (train) <- data/prep/part-2.txt (prepare: params.yaml:n)"
    ]


def test_a_commit_that_changes_code_or_params_without_re_running_is_marked_unrecorded(toy_history, tmp_path):
    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    with open(project / "train.py", "a") as fh:
        fh.write("# faster now?\n")
    git(project, "commit", "-qam", "edit train, no re-run")
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 60}))
    git(project, "commit", "-qam", "grow n, no re-run")
    h = history(since="HEAD~2", root=project)
    code, param = h.steps
    # the locks are identical, so comparing them finds nothing; git says what changed under the record
    assert code.root_causes == [] and param.root_causes == []
    assert [(u.stage, u.changed) for u in code.unrecorded] == [("train", ["train.py"])]
    assert [(u.stage, u.changed) for u in param.unrecorded] == [("prepare", ["params.yaml:n"])]
    assert "    unrecorded: train.py changed, dvc.lock not re-run for train (its committed" in history_lines(h)[2]
    assert "**unrecorded**: params.yaml:n changed, dvc.lock not re-run for prepare |" in history_markdown(h)
    assert dataclasses.asdict(h)["steps"][0]["unrecorded"] == [{"stage": "train", "changed": ["train.py"]}]
    # commits that re-ran what they changed (n grown, train.py edited, each with `dvc repro`) are not marked
    assert [s.unrecorded for s in history(root=toy_history).steps] == [[], [], []]


def test_explain_names_what_the_earlier_side_committed_without_re_running_as_one_cause(toy_history, tmp_path):
    """A fresh clone of a commit that changed code and params without `dvc repro` after: its dvc.lock predates
    them, which is not a change between HEAD and the workspace. The first screen says it once, with the stages
    it reaches; an input edited in the workspace is a cause of its own."""
    from dflashpipe.commands.explain import answer_lines
    from dflashpipe.commands.explain.answer import answer

    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    with open(project / "train.py", "a") as fh:
        fh.write("# faster now?\n")
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 60}))
    git(project, "commit", "-qam", "edit train and grow n, no re-run")
    with open(project / "evaluate.py", "a") as fh:
        fh.write("# edited here\n")
    report = explain("HEAD", "workspace", project, machine=False)
    assert sorted(report.as_committed) == ["params.yaml:n", "train.py"]
    causes = [text for _, text in answer_lines(answer(report))]
    assert "(1) HEAD's dvc.lock predates 2 inputs it commits  [dvc.lock@HEAD vs git@HEAD]" in causes, causes
    assert "not rerun since: n, train.py" in causes, causes
    assert any(") dep evaluate.py: edited  [dvc.lock@HEAD vs the workspace]" in t for t in causes), causes
    # against the commit before, the same files did change in git: causes of their own, as ever
    assert explain("HEAD~1", "workspace", project, machine=False).as_committed == []


def test_paths_say_so_when_the_cache_has_no_listing(toy_history, tmp_path):
    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    (v,) = [v for v in explain("HEAD~2", "HEAD~1", project).stages if v.stage == "train"]
    assert v.paths == ["train <- data/prep: directory changed (file listing not in the cache) (prepare: params.yaml:n)"]


def test_experiments_appear_after_their_baseline(toy_history, tmp_path):
    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    run(["dvc", "cache", "dir", str(toy_history / ".dvc/cache")], project)
    run(["dvc", "checkout", "-q"], project, check=False)
    set_speed(project, 71.0, 67.0, 74.0, 5)
    run(["dvc", "exp", "run", "-q", "-n", "bigger", "-S", "n=50"], project)
    steps = history(since="HEAD~1", metrics=["final_loss"], root=project).steps
    assert [(s.label, s.parent) for s in steps] == [(steps[0].label, steps[0].parent), ("exp bigger", steps[0].label)]
    assert [(c.what, c.old, c.new) for c in steps[1].root_causes] == [("params.yaml:n", 30, 50)]
    assert steps[1].moved == [f"{TRAIN}:final_loss"]
    # an experiment name works as --since too
    with pytest.raises(DflashpipeError, match="no commits in bigger..HEAD"):
        history(since="bigger", root=project)


BENCH_PY = """
import json, pathlib, yaml
speed = yaml.safe_load(open("params.yaml"))["bench_speed"]
pathlib.Path("metrics/bench.json").write_text(json.dumps({"tokens_per_s": speed}))
"""


def test_a_key_two_metrics_files_record_is_printed_with_its_file(toy_history, tmp_path):
    # bench records tokens_per_s as train does: a bare `tokens_per_s` would not say which of the two moved
    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    run(["dvc", "cache", "dir", str(toy_history / ".dvc/cache")], project)
    run(["dvc", "checkout", "-q"], project, check=False)
    (project / "bench.py").write_text(BENCH_PY)
    pipeline = yaml.safe_load((project / "dvc.yaml").read_text())
    pipeline["stages"]["bench"] = {
        "cmd": "python bench.py",
        "deps": ["bench.py"],
        "params": ["bench_speed"],
        "metrics": [{"metrics/bench.json": {"cache": False}}],
    }
    (project / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 30, "bench_speed": 50.0}))
    commit_run(project, "add bench at 50")
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 30, "bench_speed": 60.0}))
    commit_run(project, "bench 60")

    h = history(since="HEAD~1", root=project)
    assert h.names == {
        "metrics/eval.json:tau": "tau",
        f"{TRAIN}:tokens_per_s": f"{TRAIN}:tokens_per_s",
        "metrics/bench.json:tokens_per_s": "metrics/bench.json:tokens_per_s",
        f"{TRAIN}:final_loss": "final_loss",
    }
    text = "\n".join(history_lines(h))
    assert "metrics: tau=" in text and f"{TRAIN}:tokens_per_s=70.0" in text and "final_loss=" in text
    assert "    metrics/bench.json:tokens_per_s: 50.0 -> 60.0 [unmeasured" in text
    assert "| metrics/bench.json:tokens_per_s |" in history_markdown(h)

    # explain names the figure the same way, though train's tokens_per_s did not change
    report = explain("HEAD~1", "HEAD", project)
    assert [(m.file, m.name) for m in report.metrics] == [("metrics/bench.json", "metrics/bench.json:tokens_per_s")]
    assert "- `metrics/bench.json:tokens_per_s` 50.0 -> 60.0" in to_markdown(report, full=True)


def _disk(project: Path) -> tuple[str, bytes]:
    return git(project, "status", "--porcelain", "--ignored"), (project / "dvc.lock").read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["history", "--since", "firts-run"], "'firts-run' is neither a git revision nor a DVC experiment"),
        (["history", "--metric", "tokens_per_sec"], "no state in this range records metric 'tokens_per_sec'"),
        (["history", "--since", "HEAD"], "no commits in HEAD..HEAD"),
        (["explain", "HEAD", "no-such-exp"], "'no-such-exp' is neither a git revision nor a DVC experiment"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(toy_history, args, message):
    git(toy_history, "tag", "-f", "first-run", "HEAD~2")
    before = _disk(toy_history)
    proc = run(["dflashpipe", *args], toy_history, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert message in line
    if "firts-run" in args:
        assert line.endswith("nearby refs: first-run")
    if "tokens_per_sec" in args:
        assert "nearby keys: tokens_per_s" in line
    assert _disk(toy_history) == before


def test_a_dvc_lock_merge_conflict_is_named(toy_history, tmp_path):
    project = Path(run(["git", "clone", "-q", str(toy_history), str(tmp_path / "c")], tmp_path).args[-1])
    run(["dvc", "cache", "dir", str(toy_history / ".dvc/cache")], project)
    set_speed(project, 70.0, 66.0, 73.0, 5)
    git(project, "checkout", "-qb", "other")
    commit_run(project, "n=40 on other", n=40)
    git(project, "checkout", "-q", "-")
    commit_run(project, "n=50 here", n=50)
    assert subprocess.run(["git", "merge", "-q", "other"], cwd=project, capture_output=True).returncode != 0
    before = _disk(project)
    proc = run(["dflashpipe", "explain"], project, check=False)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "dvc.lock (workspace): unresolved merge conflict (line" in line
    assert _disk(project) == before
    # history reads commits, not the workspace: it still works mid-merge, until a conflicted lock is committed
    assert [s.subject for s in history(since="HEAD~1", root=project).steps] == ["n=50 here"]
    git(project, "add", "-A")
    git(project, "commit", "-qm", "merged without resolving")
    proc = run(["dflashpipe", "history", "--since", "HEAD~1"], project, check=False)
    assert proc.returncode == 2 and "dvc.lock@" in proc.stderr and "unresolved merge conflict" in proc.stderr


def test_no_dvc_lock_anywhere_is_an_error(tmp_path):
    git(tmp_path, "init", "-q")
    with pytest.raises(DflashpipeError, match="the repository has no commit yet"):
        history(root=tmp_path)
    (tmp_path / "a.txt").write_text("a\n")
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "add", "a.txt"], tmp_path)
    run(["git", "-c", "user.email=t@e", "-c", "user.name=t", "commit", "-qm", "a"], tmp_path)
    with pytest.raises(DflashpipeError, match="no commit on HEAD's first-parent line has a dvc.lock"):
        history(root=tmp_path)


def test_levels_mark_a_drift_no_step_shows_and_ignore_a_blip_and_the_machine():
    from dflashpipe.commands.explain.history import Measured, Step, change_points
    from dflashpipe.core.spread import Control, Spread

    metric = f"{TRAIN}:tokens_per_s"

    def step(label: str, median: float, control_ms: float = 3.0) -> Step:
        found = Step(label, label, f"commit {label}", None, {metric: median})
        figure = Spread(median, median - 2, median + 2, 5)
        found.measured[metric] = Measured(median, figure, Control(control_ms, control_ms))
        return found

    # each step within noise of its parent, but 44 is beyond the level 50 held, and 41 after it holds there
    drift = [step("a", 50), step("b", 47), step("c", 44), step("d", 41), step("e", 41)]
    change_points(drift, metric)
    (level,) = [lv for s in drift for lv in s.levels]
    assert (level.label, level.since, level.call, level.confirmed) == ("c", "a", NoiseCall.CHANGE, True)
    assert level.line("tokens_per_s") == (
        "level: tokens_per_s 50 (range 48..52, 5 repeats) (since a) -> 44 (range 42..46, 5 repeats) [change]"
    )
    # a commit the next one undoes is a blip, not a level; a drop the control measured too is the machine
    blip = [step("a", 50), step("b", 30), step("c", 50), step("d", 25, control_ms=6.0), step("e", 25, 6.0)]
    change_points(blip, metric)
    assert [lv for s in blip for lv in s.levels] == []
    # a move at the last commit is marked, and said to be unconfirmed
    last = [step("a", 50), step("b", 50), step("c", 30)]
    change_points(last, metric)
    assert [(lv.label, lv.confirmed) for s in last for lv in s.levels] == [("c", False)]

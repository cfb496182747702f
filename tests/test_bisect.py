"""`dflashpipe bisect` on a small real DVC project in a temporary git repo: ten commits after a measured one,
most of them never re-run (their records are stale), one of them changing the metric. Every probe is a real
`git worktree` and a real `dvc repro` sharing the project's cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dflashpipe.commands.rerun.bisect import bisect, bisect_lines
from dflashpipe.core.errors import DflashpipeError
from tests.conftest import run

PREPARE_PY = """
import pathlib, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
pathlib.Path("data").mkdir(exist_ok=True)
pathlib.Path("data/prep.txt").write_text(f"{n} samples\\n")
"""
# the metric comes from a constant of train.py: the commit that changes it is the one to find
TRAIN_PY = """
import json, pathlib
SCORE = {score}
prep = pathlib.Path("data/prep.txt").read_text()
pathlib.Path("metrics").mkdir(exist_ok=True)
pathlib.Path("metrics/train.json").write_text(json.dumps({{"score": SCORE, "prep": int(prep.split()[0])}}))
# revision {revision}
"""
DVC_YAML = {
    "stages": {
        "prepare": {"cmd": "python prepare.py", "deps": ["prepare.py"], "params": ["n"], "outs": ["data/prep.txt"]},
        "train": {
            "cmd": "python train.py",
            "deps": ["train.py", "data/prep.txt"],
            "metrics": [{"metrics/train.json": {"cache": False}}],
        },
    }
}


def git(project: Path, *args: str) -> str:
    return run(["git", *args], project).stdout.strip()


@pytest.fixture(scope="module")
def ten_commits(tmp_path_factory) -> tuple[Path, list[str]]:
    """GOOD (run: score 1, n 20), then ten commits each editing train.py: the third also sets n to 30 (the
    `prep` metric moves), the sixth breaks train.py, the seventh on set score 2. Only the last (BAD) is run and
    recorded again. Returns the project and the ten shas."""
    project = tmp_path_factory.mktemp("bisect") / "project"
    project.mkdir()
    (project / "prepare.py").write_text(PREPARE_PY)
    (project / "train.py").write_text(TRAIN_PY.format(score=1, revision=0))
    (project / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (project / "params.yaml").write_text(yaml.safe_dump({"n": 20}))
    git(project, "init", "-q")
    git(project, "config", "user.email", "test@example.com")
    git(project, "config", "user.name", "test")
    run(["dvc", "init", "-q"], project)
    run(["dvc", "config", "core.analytics", "false"], project)
    run(["dvc", "repro", "-q"], project)
    git(project, "add", "-A")
    git(project, "commit", "-qm", "good")
    git(project, "tag", "good")
    shas = []
    for revision in range(1, 11):
        text = TRAIN_PY.format(score=2 if revision >= 7 else 1, revision=revision)
        if revision == 6:
            text = text.replace("SCORE =", "SCORE = = ")  # this commit cannot run
        (project / "train.py").write_text(text)
        if revision == 3:
            (project / "params.yaml").write_text(yaml.safe_dump({"n": 30}))
        if revision == 10:
            run(["dvc", "repro", "-q"], project)
        git(project, "add", "-A")
        git(project, "commit", "-qm", f"revision {revision}")
        shas.append(git(project, "rev-parse", "HEAD"))
    return project, shas


def test_bisect_finds_the_commit_and_says_what_a_skipped_one_hides(ten_commits):
    project, shas = ten_commits
    found = bisect("score", "good", "HEAD", root=project)
    assert found.metric == "metrics/train.json:score" and found.candidates == 10
    probed = {p.sha: p for p in found.probes}
    # revision 6 cannot be reproduced: skipped and said so, so revisions 6 and 7 both stay candidates
    assert "failed" in probed[shas[5]].skipped and probed[shas[5]].measured is None
    assert found.first is None and found.ambiguous == [shas[5][:8], shas[6][:8]]
    assert (probed[shas[4]].moved, probed[shas[6]].moved, probed[shas[6]].call) == (False, True, "differs")
    # a stale commit is reproduced (train runs; prepare's output comes from the cache); BAD's record is current
    assert probed[shas[4]].stages_run == 1 and probed[shas[9]].stages_run == 0
    lines = bisect_lines(found)
    assert lines[-2] == f"first moved: one of {shas[5][:8]}, {shas[6][:8]} (skipped commits hide which)"
    assert git(project, "worktree", "list").count("\n") == 0  # every probe's worktree removed


def test_bisect_places_the_first_move_exactly_when_nothing_hides_it(ten_commits):
    project, shas = ten_commits
    found = bisect("metrics/train.json:prep", "good", "HEAD", root=project)
    assert found.first is not None and found.first.sha == shas[2]
    assert bisect_lines(found)[-2] == f"first moved: {shas[2][:8]} revision 3"
    assert len(found.probes) == 5  # GOOD, BAD and three of the ten between (log2 of 10, rounded up)
    assert all(not p.skipped for p in found.probes)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("score", "HEAD", "good"), "is not an ancestor of good"),
        (("score", "good", "nowhere"), "nowhere"),
        (("nothing", "good", "HEAD"), "no state in this range records metric 'nothing'"),
        (("score", "good", "HEAD~5"), "did not move between good and HEAD~5"),
        (("score", "good", "HEAD~4"), "cannot measure metrics/train.json:score at HEAD~4 .*failed"),
    ],
)
def test_bad_bisect_ranges_are_one_line_errors(ten_commits, args, message):
    project, _ = ten_commits
    with pytest.raises(DflashpipeError, match=message) as err:
        bisect(*args, root=project)
    assert "\n" not in str(err.value)


def test_the_command_prints_the_report_and_a_bad_range_is_exit_2(ten_commits):
    project, shas = ten_commits
    proc = run(["dflashpipe", "bisect", "prep", "good", "HEAD"], project)
    assert proc.stdout.splitlines()[-2] == f"first moved: {shas[2][:8]} revision 3"
    proc = run(["dflashpipe", "bisect", "score", "HEAD", "good"], project, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: HEAD is not an ancestor of good")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_repeated_runs_pool_by_one_rule_a_rate_brought_to_one_machine_speed_by_its_control():
    """bisect's probes and --verify's arms pool their runs by spread.pool and are judged by one rule, so the same
    runs are moved for both or for neither. Two runs of one rate, the second on a machine 2x slower (its control
    twice the time): each is first brought to the runs' mean machine speed, then pooled."""
    from dflashpipe.commands.explain.history import Measured, moved
    from dflashpipe.commands.rerun.tree import pooled
    from dflashpipe.core import spread

    quiet = Measured(100.0, spread.Spread(100.0, 95.0, 105.0, 4), spread.Control(3.0, 3.0))
    busy = Measured(50.0, spread.Spread(50.0, 47.0, 52.0, 4), spread.Control(6.0, 6.0))
    found = pooled("rows_per_s", [quiet, busy])
    assert found.control == spread.Control(4.5, 4.5)
    s = found.spread
    assert (s.median, s.low, s.high, s.repeats) == pytest.approx((200 / 3, 188 / 3, 70.0, 8))
    # against a run on the quiet machine: the rate's drop is the control's (1.5x), not a change
    assert moved("rows_per_s", quiet, found) == (False, "machine")
    # without controls the runs pool as they are: median of medians, widest range, every repeat
    bare = [Measured(r.value, r.spread) for r in (quiet, busy)]
    assert pooled("rows_per_s", bare).spread == spread.Spread(75.0, 47.0, 105.0, 8)
    # a timed figure without a spread: each run one repeat; any other figure is deterministic: the last run
    assert pooled("seconds", [Measured(2.0), Measured(3.0)]).spread == spread.Spread.of([2.0, 3.0])
    assert pooled("score", [Measured(1), Measured(1)]) == Measured(1)

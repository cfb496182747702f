"""Many machines, one record, under real DVC: a shared remote with the run cache, and a sweep through DVC's queue.

- Machine A (the shared pipeline run) pushes its outputs and run cache to a directory remote; a fresh clone B
  pulls them, and `dvc repro` runs nothing but the fingerprint, which observes the machine and always runs.
- B with one machine fact that differs (DFLASHPIPE_CORES, in the fingerprint's threads.env) reruns exactly the
  stages whose dvc.yaml params name that key, and `dflashpipe explain` says why in one line.
- `dflashpipe plan -S ... --queue` prints each sweep point's plan and queues it; `dvc queue start -j 2` runs them.
"""

from __future__ import annotations

import json
import re
import shutil
import time

from dflashpipe.core import env
from dflashpipe.core.pipeline import FINGERPRINT
from dflashpipe.core.threads import CORES_ENV
from tests.conftest import copy_project, run
from tests.test_explain import naming


def ran(stdout: str) -> list[str]:
    """The stages `dvc repro` ran, in order ("cached - skipping run" is a restore, not a run)."""
    return re.findall(r"Running stage '([\w-]+)'", stdout)


def test_a_clone_that_pulls_the_shared_record_reruns_only_what_its_machine_changes(pipeline_run, tmp_path):
    a = copy_project(pipeline_run, tmp_path / "a")
    run(["dvc", "remote", "add", "-d", "shared", str(tmp_path / "remote")], a)
    run(["git", "commit", "-qam", "the team's remote"], a)
    run(["dvc", "push", "--run-cache"], a)

    b = tmp_path / "b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    # The same machine: the torch files' hash state that A's fingerprint keeps comes along (a real second machine
    # hashes them once; the result is the same, only slower).
    (b / env.HASH_STATE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(a / env.HASH_STATE, b / env.HASH_STATE)
    run(["dvc", "pull", "--run-cache"], b)
    # B's checkout of the in-project tiny target is other files (their times): target hashes them again (seconds)
    # and finds the same weights, so nothing downstream of it reruns
    assert ran(run(["dvc", "repro"], b).stdout) == ["fingerprint", "target"]
    run(["git", "commit", "-qam", "B's record: its own target files' times"], b)

    recorded = json.loads((b / FINGERPRINT).read_text())["threads"]["env"].get(CORES_ENV)
    differing = {CORES_ENV: "2" if recorded == "1" else "1"}
    readers = naming("threads.env")
    assert readers == ["train", "bench", "evaluate"]  # dvc.yaml's timing keys: the stages that time kernels
    explained = run(["dflashpipe", "explain"], b, env=differing).stdout.splitlines()
    causes = explained[explained.index("Causes") + 1 : explained.index("Stages")]
    moved = f"{CORES_ENV} {recorded or 'unset'} -> {differing[CORES_ENV]}"
    assert causes[0].strip().startswith(f"(1) machine threads.env: {moved}"), explained
    assert causes[1].strip().startswith(f"invalidates {', '.join(readers)}") and len(causes) == 2, explained
    rerun = run(["dvc", "repro"], b, env=differing).stdout
    assert ran(rerun) == ["fingerprint", *readers, "serve", "gate"], rerun  # serve reads eval.json, the gate both


def test_a_sweep_is_queued_with_its_plan_and_run_two_at_a_time(pipeline_run, tmp_path):
    # A sweep of evaluate's budget: each experiment reruns evaluate alone (a train.lr sweep, as docs/usage.md shows
    # it, reruns train too: the same queue, three times the cost here).
    project = copy_project(pipeline_run, tmp_path / "project")
    points = (8, 10)
    for tokens in points:
        queued = run(["dflashpipe", "plan", "-S", f"evaluate.max_new_tokens={tokens}", "--queue"], project)
        assert queued.stdout.startswith(f"plan: params.yaml -S evaluate.max_new_tokens={tokens}\n"), queued.stdout
        assert "bound by the drafter side" in queued.stdout
        assert f"dvc exp run --queue -S evaluate.max_new_tokens={tokens}" in queued.stderr, queued.stderr
    run(["dvc", "queue", "start", "-j", "2"], project)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = run(["dvc", "queue", "status"], project).stdout
        if "Queued" not in status and "Running" not in status:
            break
        time.sleep(1)
    run(["dvc", "queue", "stop", "--kill"], project, check=False)
    assert status.count("Success") == 2, status
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project).stdout)
    done = sorted(
        exp["revs"][0]["data"]["params"]["params.yaml"]["data"]["evaluate"]["max_new_tokens"]
        for revision in shown
        for exp in revision.get("experiments") or []
    )
    assert done == list(points), shown

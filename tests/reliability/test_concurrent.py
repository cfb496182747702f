"""Concurrency: two `dvc repro` at once on one project, and two queued experiments run by two workers."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from dvc.lock import FAILED_TO_LOCK_MESSAGE

from dflashpipe.core.params import load_params
from dflashpipe.core.pipeline import MANIFEST, MANIFEST_METRICS, TARGET, reuse_key
from dflashpipe.data.manifest import build_manifest
from dflashpipe.data.shards import verify_manifest
from dflashpipe.target.materialise import materialise_target
from tests.conftest import run
from tests.reliability.harness import group_process, kill_group, start, status, tree_bytes

STAGES = ["target", "manifest"]


def test_a_second_repro_fails_fast_on_the_lock_and_the_first_completes_intact(dvc_project, tmp_path):
    project = dvc_project
    first = start(["dvc", "repro", *STAGES], project, tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 60
        while group_process(first.pid, "stages/") is None:  # DVC holds the repo lock while a stage runs
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.01)
        began = time.monotonic()
        second = run(["dvc", "repro", *STAGES], project, check=False)
        waited = time.monotonic() - began
        # DVC 3 holds the repo lock only while it reads or writes its own state; while a stage's command
        # runs, that stage's deps and outputs are held in .dvc/tmp/rwlock. Either refusal is DVC's lock.
        repo_lock = FAILED_TO_LOCK_MESSAGE.split(".")[0] in second.stderr
        rw_lock = "is busy, it is being blocked by" in second.stderr and f"(PID {first.pid})" in second.stderr
        assert second.returncode != 0 and (repo_lock or rw_lock), second.stderr
        assert waited < 20 and first.poll() is None, f"the second run took {waited:.1f}s, or outlived the first"
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
    finally:
        kill_group(first)

    assert not set(status(project, *STAGES)) - {"fingerprint"}, "the first run left a stage out of date"
    params = load_params(project)
    materialise_target(params["target"], tmp_path / "target", root=project)
    build_manifest(params["data"], tmp_path / "manifest", root=project, key=reuse_key("manifest", project))
    assert tree_bytes(project / TARGET) == tree_bytes(tmp_path / "target")
    assert tree_bytes(project / MANIFEST) == tree_bytes(tmp_path / "manifest")
    verify_manifest(project / MANIFEST)


def experiment_metrics(project) -> dict[str, dict]:
    """Experiment name -> its metrics/manifest.json, from `dvc exp show --json`."""
    found: dict[str, dict] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            data = node.get("data")
            if isinstance(node.get("name"), str) and isinstance(data, dict):
                metrics = (data.get("metrics") or {}).get(str(MANIFEST_METRICS), {}).get("data")
                if metrics:
                    found[node["name"]] = metrics
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(run(["dvc", "exp", "show", "--json"], project).stdout))
    for name, metrics in found.items():  # the rest of the manifest's record, at the experiment's own commit
        detail = run(["git", "show", f"refs/exps/{name}:metrics/detail/manifest.json"], project, check=False)
        if detail.returncode:  # experiments are kept under refs/exps/<baseline>/<name>
            ref = run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], project).stdout.split()
            ref = next(r for r in ref if r.endswith(f"/{name}"))
            detail = run(["git", "show", f"{ref}:metrics/detail/manifest.json"], project)
        metrics.update({**json.loads(detail.stdout), **metrics})
    return found


def stage_workspaces(project: Path) -> set[str]:
    """The experiment workspaces (DVC's temporary copies under .dvc/tmp/exps) in which a stage runs now."""
    exps, found = str(project / ".dvc" / "tmp" / "exps"), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            cwd = os.readlink(entry / "cwd")
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
        if cwd.startswith(exps) and any(arg.startswith("stages/") for arg in argv):
            found.add(cwd)
    return found


def test_two_queued_experiments_run_at_once_with_correct_distinct_metrics(dvc_project, tmp_path):
    project, sizes = dvc_project, {"n30": 30, "n45": 45}
    for name, n in sizes.items():
        run(["dvc", "exp", "run", "--queue", "manifest", "-n", name, "-S", f"data.num_samples={n}"], project)
    # Not `run`: the detached workers inherit its pipes, so it would wait for them to finish.
    start(["dvc", "queue", "start", "-j", "2"], project, tmp_path / "queue.log").wait(timeout=60)
    # Overlap is read from the stage processes themselves, sampled every 20 ms: `dvc queue status` takes about
    # a second a call, and on a quiet machine both tiny experiments can start and end between two calls.
    done, most_running = threading.Event(), [0]

    def sample() -> None:
        while not done.is_set():
            most_running[0] = max(most_running[0], len(stage_workspaces(project)))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    deadline, table = time.monotonic() + 240, ""
    try:
        while time.monotonic() < deadline:
            table = run(["dvc", "queue", "status"], project).stdout
            rows = {
                line.split()[1]: line.split()[-1]
                for line in table.splitlines()
                if len(line.split()) >= 4 and line.split()[1] in sizes
            }
            if len(rows) == 2 and all(state in ("Success", "Failed") for state in rows.values()):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the queued experiments did not finish:\n{table}")
    finally:
        done.set()
        sampler.join()
    assert set(rows.values()) == {"Success"}, table
    assert most_running[0] == 2, f"the two experiments' stages never ran at the same time:\n{table}"

    metrics = experiment_metrics(project)
    for name, n in sizes.items():
        assert metrics[name]["train_samples"] == n
        assert metrics[name]["shards"] == sum(-(-round(w * n) // 20) for w in (0.5, 0.3, 0.2))  # shards per source
        assert metrics[name]["records_read"] == n + metrics[name]["eval_samples"] + metrics[name]["records_skipped"]
    assert not (project / MANIFEST).exists(), "a queued experiment wrote into the workspace"

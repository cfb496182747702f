"""The thread budget: the cores this process may use (affinity, cgroup quota, DFLASHPIPE_CORES), split among a
stage's workers, each setting its own count in its own thread."""

from __future__ import annotations

import threading

import pytest
import torch

from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.threads import CORES_ENV, quota_cores, thread_budget
from dflashpipe.train.topology import Topology, train_threads


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "env", "cores", "limited_by"),
    [
        (range(2), "max 100000\n", {}, 2, "affinity"),  # no quota: the affinity
        (range(64), "200000 100000\n", {}, 2, "cgroup cpu.max"),  # a 2-core quota on a 64-core machine
        (range(64), "150000 100000\n", {}, 2, "cgroup cpu.max"),  # 1.5 cores: rounded up
        (range(64), "50000 100000\n", {}, 1, "cgroup cpu.max"),  # half a core: at least one
        ({0, 3}, "400000 100000\n", {}, 2, "affinity"),  # pinned to 2 of 4 quota cores
        (range(8), "", {}, 8, "affinity"),  # cgroup v1 or no file: the affinity
        (range(8), "max 100000", {CORES_ENV: "3"}, 3, CORES_ENV),  # a pytest-xdist worker's share
        (range(2), "max 100000", {CORES_ENV: "4"}, 2, "affinity"),  # never above what the OS gives
    ],
)
def test_the_cores_are_the_fewest_of_affinity_quota_and_the_override(affinity, cpu_max, env, cores, limited_by):
    budget = thread_budget({"decode": 1}, affinity=affinity, cpu_max=cpu_max, env=env)
    assert (budget.cores, budget.limited_by) == (cores, limited_by)
    assert budget.threads == {"decode": cores}


@pytest.mark.parametrize(
    ("cores", "workers", "threads"),
    [
        (2, {"target": 1, "drafter": 2}, {"target": 1, "drafter": 1}),  # the default train on 2 cores: 3 threads, not 6
        (8, {"target": 1, "drafter": 2}, {"target": 2, "drafter": 2}),  # rounded down: never more threads than cores
        (16, {"target": 5, "drafter": 3}, {"target": 2, "drafter": 2}),
        (4, {"target": 0, "drafter": 1}, {"target": 1, "drafter": 4}),  # targets on GPUs: the drafter gets the cores
        (2, {"process": 4}, {"process": 1}),  # more workers than cores: one each
        (6, {}, {}),
    ],
)
def test_the_cores_are_split_evenly_among_the_workers_on_the_cpu(cores, workers, threads):
    budget = thread_budget(workers, affinity=range(cores), cpu_max="max 100000", env={})
    assert budget.threads == threads
    assert budget.to_json() == {"cores": cores, "limited_by": "affinity", "workers": workers, "threads": threads}


def test_train_counts_only_the_workers_on_the_cpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert train_threads(Topology((cpu,), (cpu, cpu), 0, 1)).workers == {"target": 1, "drafter": 2}
    assert train_threads(Topology((gpu, gpu), (cpu,), 0, 1)).workers == {"target": 0, "drafter": 1}


@pytest.mark.parametrize(("line", "cores"), [("max 100000", None), ("garbage", None), ("0 100000", None), ("", None)])
def test_an_unlimited_or_unreadable_quota_is_no_limit(line, cores):
    assert quota_cores(line) == cores


def test_a_malformed_override_is_refused_naming_the_variable():
    with pytest.raises(DflashpipeError, match=CORES_ENV):
        thread_budget({}, affinity=range(2), cpu_max="", env={CORES_ENV: "two"})


def test_each_worker_thread_keeps_its_own_count_whatever_the_others_set():
    """torch initialises a thread's count lazily, at its first op, from the last count any thread set: a worker
    that set 1 and then met another's 3 at its first op would run with 3. apply() initialises first."""
    budgets = [thread_budget({"w": 1}, affinity=range(n), cpu_max="", env={}) for n in (1, 3)]
    all_set, seen = threading.Barrier(2), {}

    def worker(i: int) -> None:
        budgets[i].apply("w")
        all_set.wait()  # both have set their count before either runs an op
        torch.ones(1 << 16).sum()
        seen[i] = torch.get_num_threads()

    saved = torch.get_num_threads()
    try:
        for _ in range(3):
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert seen == {0: 1, 1: 3}
    finally:
        torch.set_num_threads(saved)


def test_a_worker_on_an_accelerator_takes_one_thread():
    budget = thread_budget({"target": 1}, affinity=range(4), cpu_max="", env={})
    got = {}

    def worker() -> None:
        got["n"] = budget.apply("target", torch.device("cuda:0"))
        got["torch"] = torch.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got == {"n": 1, "torch": 1}


def test_spinning_is_bounded_before_torch_loads_unless_the_user_chose_a_wait():
    import ast
    import os
    import subprocess
    import sys

    from dflashpipe.core.threads import SPIN_COUNT, bound_the_spinning
    from tests.tiny import ROOT

    env: dict[str, str] = {}
    bound_the_spinning(env)
    assert env == {"GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(chosen)
        bound_the_spinning(env)
        assert env == chosen
    # what libgomp reads when torch loads it, in a process that imports dflashpipe first, as every stage does
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import dflashpipe, torch, os; print(os.environ['GOMP_SPINCOUNT'])"
    assert subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True).stdout.strip() == (
        SPIN_COUNT
    )
    for script in sorted((ROOT / "stages").glob("*.py")):
        imports = [
            (n.module if isinstance(n, ast.ImportFrom) else n.names[0].name) or ""
            for n in ast.walk(ast.parse(script.read_text()))
            if isinstance(n, (ast.Import, ast.ImportFrom))
        ]
        ours = [m.split(".")[0] for m in imports if m.split(".")[0] in ("dflashpipe", "torch")]
        assert not ours or ours[0] == "dflashpipe", f"{script.name} imports torch before dflashpipe"

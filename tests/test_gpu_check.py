"""benchmarks/gpu_check.py: the lent GPU machine's one check, run here with --dry (tiny, on the CPU), in a
Python that cannot import what that machine lacks (dvc, gguf, datasets: a meta-path finder refuses them
in every process of the run, installed through sitecustomize)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"

BLOCKER = """
import sys

BLOCKED = {blocked!r}


class Absent:
    \"\"\"Wraps a meta-path finder: a blocked package is not found, as on a machine without it (an import raises
    ModuleNotFoundError, importlib.util.find_spec gives None, which is how optional imports probe).\"\"\"

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
"""


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = load_check()


@pytest.fixture(scope="module")
def absent_env(tmp_path_factory) -> dict:
    """The environment of a Python in which the packages the lent machine lacks cannot be imported."""
    site = tmp_path_factory.mktemp("absent")
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(gpu_check.BLOCKED_ELSEWHERE)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT / "src")])}


def run_check(env: dict, out, *args: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )
    assert out.is_file(), proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.fixture(scope="module")
def dry(absent_env, tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    return run_check(absent_env, tmp_path_factory.mktemp("dry") / "gpu_check.json", "--dry")


def test_the_blocker_hides_packages_that_are_installed_here(absent_env):
    for name in gpu_check.BLOCKED_ELSEWHERE:
        assert importlib.util.find_spec(name) is not None, f"{name} is not installed here: nothing to hide"
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=absent_env)
        assert proc.returncode != 0 and f"No module named '{name}'" in proc.stderr, name


def test_dry_run_runs_every_planned_section_and_each_passes(dry):
    proc, report = dry
    failed = {
        f"{s['section']} {s.get('target') or s.get('run')}": s for s in report["sections"] if s["status"] != "passed"
    }
    assert proc.returncode == 0 and report["passed"] and not failed, json.dumps(failed, indent=1)[:6000]
    planned = [(name, arg) for name, arg in gpu_check.plan(dry=True)]
    assert [(s["section"], s.get("target") or s.get("run")) for s in report["sections"]] == planned
    assert report["dry"] is True and report["wall_s"] > 0
    assert all(s["wall_s"] > 0 and s["result"]["seconds"] > 0 for s in report["sections"])


def test_dry_run_records_versions_and_the_device(dry):
    env = dry[1]["env"]
    import torch
    import transformers

    assert env["torch"] == torch.__version__ and env["transformers"] == transformers.__version__
    assert env["device"] == "cpu" and env["runs_on"] == "cpu" and env["capability"] is None


def sections(report: dict, name: str) -> list[dict]:
    return [s["result"] for s in report["sections"] if s["section"] == name]


def test_dry_run_figures(dry):
    report = dry[1]
    for flex in sections(report, "flex_vs_sdpa"):
        assert flex["outputs"]["loss"]["rel"] <= flex["tolerance_rel"] and flex["outputs"]["slot_count"]["max_abs"] == 0
        assert flex["outputs"]["block_hidden"]["rel"] <= flex["tolerance_rel"]  # the CPU's forward-only comparison
        assert flex["notes"], "the CPU's forward-only comparison must say so"
        assert flex["step_s"]["flex_compiled"]["median_s"] > 0 and flex["step_s"]["sdpa_eager"]["median_s"] > 0
    compile_runs = {r["run"]: r for r in sections(report, "compile")}
    warm, cold = compile_runs["warm"], compile_runs["cold-1"]
    assert warm["errors"] == [] and warm["compiles_in_worker_threads"] == 0 and warm["new_graphs_in_threads"] == 0
    assert warm["main_thread_compile_s"] > 0
    # the story's fault, reproduced: cold threads each compile (on this torch, one graph per thread)
    assert cold["compiles_in_worker_threads"] >= 1 and cold["new_graphs_in_threads"] >= 1
    (train,) = sections(report, "train")
    assert train["tokens_per_s"] > 0 and train["step"]["positions_per_s"] > 0
    assert train["metrics"]["replicas_identical"] and train["metrics"]["compile"]["compiles_in_worker_threads"] == 0
    replicas = train["metrics"]["compile"]["replicas"]
    assert sorted(replicas) == ["0", "1"] and all(r["device"] == "cpu" for r in replicas.values())
    assert all(r["compiles_in_thread"] == 0 and r["recompiles_in_thread"] == 0 for r in replicas.values())
    assert train["mfu"] is None  # no peak FLOP/s for a CPU
    (decode,) = sections(report, "decode")
    assert decode["target_float32"]["lossless"] and decode["target_float32"]["tau"] >= 1
    assert decode["drafter_dtype"] == "bfloat16"


def test_no_section_imports_what_the_lent_machine_lacks(dry):
    for s in dry[1]["sections"]:
        assert not set(s["result"]["imported"]) & set(gpu_check.BLOCKED_ELSEWHERE), s["section"]
        assert "torch" in s["result"]["imported"]


def test_an_exhausted_budget_skips_every_section_and_still_writes_the_json(absent_env, tmp_path):
    proc, report = run_check(absent_env, tmp_path / "gpu_check.json", "--dry", "--budget-s", "0", timeout=120)
    assert proc.returncode == 1 and report["passed"] is False and report["env"] is None
    assert [s["status"] for s in report["sections"]] == ["skipped"] * len(gpu_check.plan(dry=True))


def test_the_train_section_puts_the_replicas_away_from_the_default_device_when_it_can():
    assert gpu_check.train_devices(0) == ("cpu", "cpu")
    assert gpu_check.train_devices(1) == ("cuda:0", "cuda:0")
    assert gpu_check.train_devices(8) == ("cuda:0", "cuda:7")  # the replicas warm up where they run, not on cuda:0


def test_the_train_section_fails_when_a_replica_compiled_in_its_thread():
    clean = {"compiles_in_thread": 0, "recompiles_in_thread": 0}
    compile = {"compiles_in_worker_threads": 0, "new_graphs_in_workers": 0, "replicas": {"0": clean, "1": clean}}
    assert gpu_check.no_compiles_after_warmup(compile)
    assert not gpu_check.no_compiles_after_warmup(
        {**compile, "replicas": {"0": clean, "1": {**clean, "recompiles_in_thread": 1}}}
    )
    assert not gpu_check.no_compiles_after_warmup({**compile, "replicas": {}})  # no record is no proof

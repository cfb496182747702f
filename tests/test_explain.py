"""`dflashpipe explain`: its comparison on hand-built lock states (fast), then on the real pipeline under
real DVC (slow, the shared `pipeline_run`): exact verdicts and root causes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dflashpipe.commands.explain import (
    NoiseCall,
    StageVerdict,
    compare,
    explain,
    metric_line,
    read_revision_state,
    root_causes,
    to_markdown,
)
from dflashpipe.core.env import ABSENT, fact_at
from tests.conftest import RUN_PROFILE, copy_project, run, set_params


def verdicts(report) -> dict[str, str]:
    return {v.stage: v.verdict for v in report.stages}


def roots(report) -> list[tuple]:
    return [(c.kind, c.what, c.old, c.new, tuple(c.stages)) for c in report.root_causes]


N = RUN_PROFILE["data__num_samples"]
SHARDS = N // RUN_PROFILE["data__shard_size"]


@pytest.fixture
def committed(pipeline_run, tmp_path):
    """A private copy of the tiny pipeline, reproduced and committed once for the session."""
    return copy_project(pipeline_run, tmp_path / "project")


def test_nothing_changed_says_so(committed):
    report = explain("HEAD", "workspace", committed)
    assert (
        set(verdicts(report).values()) == {StageVerdict.ALWAYS, StageVerdict.UNCHANGED}
        and verdicts(report)["fingerprint"] == StageVerdict.ALWAYS
    )
    assert report.root_causes == [] and report.metrics == []


def test_growing_the_data_hits_manifest_only_and_costs_are_attributed(committed):
    set_params(committed, data__num_samples=N + 20)
    report = explain("HEAD", "workspace", committed)
    # warmup (and anything else that never reads data) stays unchanged
    assert verdicts(report) == {
        **quiet(),
        "manifest": StageVerdict.DIRECT,
        "regenerate": StageVerdict.DOWNSTREAM,
        "tokenize": StageVerdict.DOWNSTREAM,
        "features": StageVerdict.DOWNSTREAM,  # reads the token shards (online it writes an empty listing, but reruns)
        "train": StageVerdict.DOWNSTREAM,
        "evaluate": StageVerdict.DOWNSTREAM,
        "serve": StageVerdict.DOWNSTREAM,
        "gate": StageVerdict.DOWNSTREAM,
    }
    assert roots(report) == [("param", "params.yaml:data.num_samples", N, N + 20, ("manifest",))]
    assert report.root_causes[0].evidence == (
        "dvc.lock@HEAD stages.manifest.params['params.yaml']['data.num_samples'] vs "
        "params.yaml (workspace) data.num_samples"
    )
    # nothing has rerun, so no hash moved yet: the path goes through the stages that will rerun
    by_stage = {v.stage: v for v in report.stages}
    assert (
        "evaluate <- data/drafter (train, not rerun yet) <- data/tokens (tokenize, not rerun yet) <- "
        "data/regenerated (regenerate, not rerun yet) <- "
    ) in "\n".join(by_stage["evaluate"].paths)
    assert not report.machine.stale  # the fingerprint stage ran on this machine

    run(["dvc", "repro", "manifest"], committed)  # its metrics are what this test reads
    report = explain("HEAD", "workspace", committed)
    assert verdicts(report)["manifest"] == StageVerdict.DIRECT and verdicts(report)["target"] == StageVerdict.UNCHANGED
    deltas = {m.key: (m.old, m.new, m.causes) for m in report.metrics}
    assert deltas["train_samples"] == (N, N + 20, ["params.yaml:data.num_samples"])
    assert deltas["shards"] == (SHARDS, SHARDS + 3, ["params.yaml:data.num_samples"])  # one more per source
    assert next(m for m in report.metrics if m.key == "train_samples").change == pytest.approx(20 / N)
    md = to_markdown(report)
    assert f"- (1) param data.num_samples: {N} -> {N + 20}  [dvc.lock@HEAD vs params.yaml]" in md
    assert "  - invalidates manifest; downstream regenerate, tokenize, features, train, evaluate, serve" in md
    assert "train_samples" not in md  # no headline: behind --all, counted
    md = to_markdown(report, full=True)
    assert f"`param params.yaml:data.num_samples: {N} -> {N + 20}` — hits manifest" in md
    assert "| target | unchanged |" in md and f"`train_samples` {N} -> {N + 20} (+{round(100 * 20 / N)}%)" in md


def test_grown_data_rerun_and_committed_names_the_changed_files_on_each_path(committed):
    set_params(committed, data__num_samples=N + 20)
    run(["dvc", "repro"], committed)
    run(["git", "add", "-A"], committed)
    run(["git", "commit", "-qm", "grow the data"], committed)
    report = explain("HEAD~1", "HEAD", committed)
    assert report.machine is None  # two recorded states: the machine now is not part of the question
    paths = {v.stage: v.paths for v in report.stages}
    # each source's new shard, its hashes and the manifest's own listing and summary moved (eight files: five
    # named); the old shards kept their bytes
    grown = ", ".join(
        ["data/manifest/files.json"]
        + [f"data/manifest/hashes-{s}.bin" for s in ("chitchat", "python_code", "sharegpt")]
        + ["data/manifest/summary.json", "3 more (manifest: params.yaml:data.num_samples)"]
    )
    assert paths["tokenize"] == [f"tokenize <- data/regenerated (regenerate) <- {grown}"]
    # the eval split kept its sha256: evaluate is invalidated through the token shards (its bigram floor counts
    # them) and train's outputs, never through it
    assert paths["evaluate"] and not any("eval.parquet" in p for p in paths["evaluate"])
    assert all(
        p.startswith(
            (
                "evaluate <- data/tokens (tokenize) <- ",
                "evaluate <- data/drafter (train) <- data/tokens (tokenize) <- ",
                "evaluate <- metrics/train/metrics.json (train) <- data/tokens (tokenize) <- ",
                "evaluate <- metrics/detail/train.json (train) <- data/tokens (tokenize) <- ",
            )
        )
        for p in paths["evaluate"]
        if not p.startswith("evaluate <- data/manifest/summary.json")  # it names the first training shard
    )
    assert all(p.endswith(f"(regenerate) <- {grown}") for p in paths["evaluate"] if "summary.json (manifest" not in p)
    assert paths["warmup"] == [] and paths["target"] == []


def test_a_deleted_output_is_missing_and_restorable(committed):
    shutil.rmtree(committed / "data/manifest")
    report = explain("HEAD", "workspace", committed)
    # restorable: what was computed from it (tokenize, train, evaluate) stays valid
    assert verdicts(report) == {**quiet(), "manifest": StageVerdict.OUTPUTS}
    (cause,) = report.stages[[v.stage for v in report.stages].index("manifest")].causes
    assert (cause.kind, cause.what, cause.new) == ("out", "data/manifest", "missing")
    assert "restorable: `dvc checkout`" in cause.evidence
    run(["dvc", "checkout", "data/manifest"], committed)
    assert verdicts(explain("HEAD", "workspace", committed))["manifest"] == StageVerdict.UNCHANGED


def test_a_deleted_compile_cache_is_restored_by_checkout_without_recompiling(committed):
    shutil.rmtree(committed / "data/compile")
    report = explain("HEAD", "workspace", committed)
    assert {s: v for s, v in verdicts(report).items() if v != StageVerdict.UNCHANGED} == {
        "fingerprint": StageVerdict.ALWAYS,
        "warmup": StageVerdict.OUTPUTS,
    }
    assert "restorable" in report.stages[[v.stage for v in report.stages].index("warmup")].causes[0].evidence
    run(["dvc", "checkout", "data/compile"], committed)
    assert "warmup" not in json.loads(run(["dvc", "status", "--json"], committed).stdout or "{}")
    set_params(committed, model__block_size=8)
    changed = json.loads(run(["dvc", "status", "--json"], committed).stdout)
    assert {"changed deps": {"params.yaml": {"model.block_size": "modified"}}} in changed["warmup"]


def test_an_edited_source_file_hits_the_stages_that_list_it(committed):
    with open(committed / "src/dflashpipe/target/adapter.py", "a") as fh:
        fh.write("\n# an edit\n")
    report = explain("HEAD", "workspace", committed)
    # the adapter loads and runs the target (regenerate, warmup, train, evaluate list it, among others);
    # tokenize only reads regenerate's output, so it is downstream.
    listed = listing("src/dflashpipe/target/adapter.py")
    assert {"regenerate", "warmup", "train", "evaluate"} <= set(listed)
    assert verdicts(report) == {**invalidated(listed), "tokenize": StageVerdict.DOWNSTREAM}
    ((kind, what, old, new, stages),) = roots(report)
    assert (kind, what, stages) == ("dep", "src/dflashpipe/target/adapter.py", tuple(listed))
    assert old != new
    assert "dvc.lock@HEAD stages.regenerate.deps[" in report.root_causes[0].evidence


def test_a_compile_env_var_names_the_fingerprint_key_and_hits_warmup_not_data(committed):
    run(["dvc", "repro", "fingerprint"], committed, env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    kernel = naming("env")
    assert {"warmup", "train", "evaluate"} <= set(kernel) and not {"manifest", "tokenize"} & set(kernel)
    # the fingerprint file alone (no live machine): what `dvc status` compares against
    report = explain("HEAD", "workspace", committed, machine=False)
    assert report.machine is None
    assert verdicts(report) == invalidated(kernel)
    (cause,) = report.root_causes
    assert (cause.kind, cause.what, cause.new) == (
        "param",
        "data/env/fingerprint.json:env",
        {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"},
    )
    # evaluate times a compiled train step on warmup's kernels, so it lists what decides them too
    assert cause.stages == kernel
    # this process has no such variable: the file describes another machine, and explain says so first; the
    # machine is what `dvc repro` will run with here, and it is the one dvc.lock recorded: nothing is invalid
    report = explain("HEAD", "workspace", committed)
    machine = report.machine
    assert machine.stale and [(c.what, c.old, c.new) for c in machine.changes] == [
        ("env.TORCHINDUCTOR_MAX_AUTOTUNE", "1", None)
    ]
    assert machine.invalid == [] and machine.edited == []
    assert verdicts(report) == quiet() and report.root_causes == []
    first = to_markdown(report, full=True).split("### This machine\n")[1].splitlines()[0]
    assert first.startswith(
        "- the fingerprint file is stale: env.TORCHINDUCTOR_MAX_AUTOTUNE now null (recorded 1); "
        "these stages are invalid on this machine: none ("
    )


def test_an_edited_model_file_hits_warmup_and_train(committed):
    with open(committed / "src/dflashpipe/model/decoder_layer.py", "a") as fh:
        fh.write("\n# an edit\n")
    report = explain("HEAD", "workspace", committed)
    listed = listing("src/dflashpipe/model")
    assert {"warmup", "train", "evaluate"} <= set(listed) and "tokenize" not in listed
    assert verdicts(report) == invalidated(listed)
    assert [(c.what, c.stages) for c in report.root_causes] == [("src/dflashpipe/model", listed)]


def test_two_experiments_compare_by_name_and_json_is_complete(committed):
    # a learning-rate experiment (reruns train and evaluate), then on top of it an evaluation-only one
    lr = yaml.safe_load((committed / "params.yaml").read_text())["train"]["lr"]
    run(["dvc", "exp", "run", "-n", "fast", "-S", "train.lr=0.01"], committed)
    report = explain("HEAD", "fast", committed)
    assert {s: v for s, v in verdicts(report).items() if v != StageVerdict.UNCHANGED} == {
        "fingerprint": StageVerdict.ALWAYS,
        "train": StageVerdict.DIRECT,
        "evaluate": StageVerdict.DOWNSTREAM,
        "serve": StageVerdict.DOWNSTREAM,
        "gate": StageVerdict.DOWNSTREAM,
    }
    assert roots(report) == [("param", "params.yaml:train.lr", lr, 0.01, ("train",))]

    run(["dvc", "exp", "run", "-n", "short", "-S", "evaluate.max_new_tokens=8"], committed)
    report = explain("fast", "short", committed)
    # the served check decodes the same prompts to the same length: it names evaluate's keys
    expected = {
        "fingerprint": StageVerdict.ALWAYS,
        "evaluate": StageVerdict.DIRECT,
        "serve": StageVerdict.DIRECT,
        "gate": StageVerdict.DOWNSTREAM,
    }
    assert {s: v for s, v in verdicts(report).items() if v != StageVerdict.UNCHANGED} == expected
    old_length = RUN_PROFILE["evaluate__max_new_tokens"]
    assert roots(report) == [("param", "params.yaml:evaluate.max_new_tokens", old_length, 8, ("evaluate", "serve"))]

    proc = run(["dflashpipe", "explain", "HEAD", "fast", "--json"], committed)
    data = json.loads(proc.stdout)
    assert (data["a"], data["b"]) == ("HEAD", "fast")
    final_loss = next(m for m in data["metrics"] if m["key"] == "final_loss")
    assert final_loss["old"] != final_loss["new"] and final_loss["causes"] == ["params.yaml:train.lr"]


def test_a_revision_whose_metrics_are_missing_or_unreadable_still_gets_every_stage_verdict(committed):
    from dflashpipe.commands.explain import answer, answer_lines

    (committed / "metrics/bench.json").write_text("{ not json")
    (committed / "metrics/eval.json").unlink()
    (committed / "metrics/detail/eval.json").unlink()  # evaluate's whole record: its detail holds tau too
    run(["git", "add", "-A"], committed)
    run(["git", "commit", "-qm", "metrics lost"], committed)
    report = explain("HEAD~1", "HEAD", committed)
    assert verdicts(report) == quiet() and report.root_causes == []  # dvc.lock is what decides them
    (note,) = report.notes
    assert note.startswith("metrics/bench.json@HEAD: not valid JSON (")
    lines = [text for _, text in answer_lines(answer(report))]
    assert any(text.startswith("note: metrics/bench.json@HEAD: not valid JSON (") for text in lines)
    tau = next(text for text in lines if text.startswith("tau "))
    assert tau.endswith("differs: recorded on one side only")
    proc = run(["dflashpipe", "explain", "HEAD~1", "HEAD"], committed)
    assert "Stages\n  unchanged: " in proc.stdout and "note: metrics/bench.json@HEAD" in proc.stdout


def test_an_unknown_revision_is_a_clear_error(committed):
    proc = run(["dflashpipe", "explain", "no-such-rev"], committed, check=False)
    assert proc.returncode == 2
    assert "'no-such-rev' is neither a git revision nor a DVC experiment" in proc.stderr


# --- the comparison alone: hand-built lock states, no pipeline run, no DVC ------------------------
#
# `compare` takes two states (per stage: cmd, dep md5s, param values, out md5s, as a dvc.lock records
# them) and derives the DAG from the newer dvc.yaml. These tests build both states as plain dicts, in
# dvc.lock's own format, and read them with explain's own reader, so what is tested is exactly the
# comparison `dflashpipe explain` makes between two revisions.

ROOT = Path(__file__).resolve().parents[1]
KERNEL_KEY = "data/env/fingerprint.json:torch.version"
FINGERPRINT_PARAMS = "data/env/fingerprint.json"


def dvc_stages() -> dict:
    """This project's dvc.yaml stages (the pipeline fixtures copy this file): stage lists come from here."""
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def quiet() -> dict[str, str]:
    """Every stage unchanged, the always-changed fingerprint aside."""
    return {**dict.fromkeys(dvc_stages(), StageVerdict.UNCHANGED), "fingerprint": StageVerdict.ALWAYS}


def invalidated(direct: list[str]) -> dict[str, str]:
    """Every stage's verdict when exactly `direct` changed directly and nothing else did: the served check reads
    evaluate's metrics/eval.json, so it is invalidated downstream of evaluate (direct where it is listed itself), and
    the gate reads both."""
    after_evaluate = dict.fromkeys(("serve", "gate"), StageVerdict.DOWNSTREAM) if "evaluate" in direct else {}
    return {**quiet(), **after_evaluate, **dict.fromkeys(direct, StageVerdict.DIRECT)}


def listing(dep: str) -> list[str]:
    """The stages, in dvc.yaml order, whose deps list `dep`."""
    return [s for s, d in dvc_stages().items() if dep in _paths(d.get("deps"))]


def naming(key: str) -> list[str]:
    """The stages, in dvc.yaml order, whose params name fingerprint key `key`."""

    def named(d: dict) -> list[str]:
        return [k for e in d.get("params", []) if isinstance(e, dict) for k in e.get(FINGERPRINT_PARAMS, [])]

    return [s for s, d in dvc_stages().items() if key in named(d)]


class LockState:
    """A revision as plain dicts: what `read_revision_state` reads through git, without git."""

    def __init__(self, label: str, stages: dict, lock: dict) -> None:
        self.label, self._files = label, {"dvc.yaml": {"stages": stages}, "dvc.lock": lock}

    def read_yaml(self, path: str):
        return self._files.get(path)


def _paths(entries) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def lock_of(stages: dict, md5: dict[str, str] | None = None, values: dict[str, object] | None = None) -> dict:
    """The dvc.lock a run of `stages` would record: every dep and out hashed (`md5` overrides a path's
    hash; a dep inside another stage's out hashes like it), every param with a value (`values`
    overrides `file:key`; params.yaml keys are bare)."""
    md5, values = md5 or {}, values or {}

    def h(path: str) -> str:
        return md5.get(path, f"md5({path})")

    lock = {}
    for name, d in stages.items():
        params: dict[str, dict] = {}
        for item in d.get("params", []) or []:
            for file, keys in ({"params.yaml": [item]} if isinstance(item, str) else item).items():
                for key in keys:
                    label = key if file == "params.yaml" else f"{file}:{key}"
                    value = values.get(label, f"value of {label}")
                    if value is not ABSENT:  # a key the params file lacks is not in the lock either
                        params.setdefault(file, {})[key] = value
        lock[name] = {
            "cmd": d["cmd"],
            "deps": [{"path": p, "md5": h(p)} for p in _paths(d.get("deps"))],
            "params": params,
            "outs": [{"path": p, "md5": h(p)} for k in ("outs", "metrics", "plots") for p in _paths(d.get(k))],
        }
    return {"schema": "2.0", "stages": lock}


def compared(stages: dict, old_lock: dict, new_lock: dict, recorded: dict | None = None, cache=None):
    old = read_revision_state(LockState("HEAD", stages, old_lock))
    new = read_revision_state(LockState("new", stages, new_lock))
    return compare(old, new, recorded or {}, cache, "HEAD", "new")


def verdict_map(found) -> dict[str, str]:
    return {v.stage: v.verdict for v in found}


def cause_tuples(found) -> list[tuple]:
    return [(c.kind, c.what, c.old, c.new, tuple(c.stages)) for c in root_causes(found)]


@pytest.fixture(scope="module")
def dag() -> dict:
    """This project's dvc.yaml stages: the DAG the verdicts are about."""
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_compare_the_same_lock_is_unchanged_everywhere(dag):
    found = compared(dag, lock_of(dag), lock_of(dag))
    assert [v.stage for v in found] == list(dag)  # dvc.yaml lists stages upstream first
    assert verdict_map(found) == quiet()
    assert root_causes(found) == [] and all(v.causes == [] and v.upstream == [] for v in found)


def test_compare_growing_the_data_invalidates_its_chain_and_never_warmup(dag):
    found = compared(
        dag, lock_of(dag, values={"data.num_samples": 2000}), lock_of(dag, values={"data.num_samples": 2400})
    )
    assert verdict_map(found) == {
        **quiet(),
        "manifest": StageVerdict.DIRECT,
        "regenerate": StageVerdict.DOWNSTREAM,
        "tokenize": StageVerdict.DOWNSTREAM,
        "features": StageVerdict.DOWNSTREAM,  # reads the token shards (online it writes an empty listing, but reruns)
        "train": StageVerdict.DOWNSTREAM,
        "evaluate": StageVerdict.DOWNSTREAM,
        "serve": StageVerdict.DOWNSTREAM,
        "gate": StageVerdict.DOWNSTREAM,
    }
    assert cause_tuples(found) == [("param", "params.yaml:data.num_samples", 2000, 2400, ("manifest",))]
    by_stage = {v.stage: v for v in found}
    assert by_stage["regenerate"].upstream == ["manifest"] and by_stage["tokenize"].upstream == ["regenerate"]
    assert by_stage["train"].upstream == ["features", "tokenize"]
    # the eval split lives in data/manifest; the floor's bigram table is counted on data/tokens
    assert by_stage["evaluate"].upstream == ["manifest", "tokenize", "train"]
    assert root_causes(found)[0].evidence == (
        "dvc.lock@HEAD stages.manifest.params['params.yaml']['data.num_samples'] vs "
        "dvc.lock@new stages.manifest.params['params.yaml']['data.num_samples']"
    )


def test_compare_a_train_param_hits_train_and_evaluate_only(dag):
    found = compared(dag, lock_of(dag, values={"train.lr": 6e-4}), lock_of(dag, values={"train.lr": 1e-3}))
    assert verdict_map(found) == {
        **quiet(),
        "train": StageVerdict.DIRECT,
        "evaluate": StageVerdict.DOWNSTREAM,
        "serve": StageVerdict.DOWNSTREAM,
        "gate": StageVerdict.DOWNSTREAM,
    }
    assert cause_tuples(found) == [("param", "params.yaml:train.lr", 6e-4, 1e-3, ("train",))]


def test_compare_an_edited_source_file_hits_the_stages_listing_it_and_their_downstream(dag):
    found = compared(dag, lock_of(dag), lock_of(dag, md5={"src/dflashpipe/target/adapter.py": "edited"}))
    assert verdict_map(found) == {
        **quiet(),
        **dict.fromkeys(listing("src/dflashpipe/target/adapter.py"), StageVerdict.DIRECT),
        "tokenize": StageVerdict.DOWNSTREAM,
        "gate": StageVerdict.DOWNSTREAM,  # it reads evaluate's and serve's metrics
    }
    assert cause_tuples(found) == [
        (
            "dep",
            "src/dflashpipe/target/adapter.py",
            "md5(src/dflashpipe/target/adapter.py)",
            "edited",
            tuple(listing("src/dflashpipe/target/adapter.py")),
        )
    ]


def test_compare_a_dep_inside_an_upstream_output_is_that_upstream_not_a_root_cause(dag):
    # tokenize's recorded data/manifest hash differs because manifest's output differs: the root
    # cause is manifest's (its output), not a second one on tokenize.
    found = compared(dag, lock_of(dag), lock_of(dag, md5={"data/manifest": "regenerated"}))
    assert verdict_map(found) == {
        **quiet(),
        "regenerate": StageVerdict.DOWNSTREAM,
        "tokenize": StageVerdict.DOWNSTREAM,
        "features": StageVerdict.DOWNSTREAM,
        "evaluate": StageVerdict.DOWNSTREAM,
        "train": StageVerdict.DOWNSTREAM,
        "serve": StageVerdict.DOWNSTREAM,
        "gate": StageVerdict.DOWNSTREAM,
    }
    assert root_causes(found) == []
    assert {v.stage: v.upstream for v in found if v.upstream} == {
        "regenerate": ["manifest"],
        "tokenize": ["regenerate"],
        "features": ["tokenize"],
        "train": ["features", "tokenize"],
        "evaluate": ["manifest", "tokenize", "train"],
        "serve": ["evaluate", "train"],  # it replays evaluate's requests: no manifest file of its own
        "gate": ["evaluate", "serve"],
    }


def test_compare_a_kernel_environment_key_hits_only_the_stages_naming_it(dag):
    found = compared(dag, lock_of(dag, values={KERNEL_KEY: "2.13.0"}), lock_of(dag, values={KERNEL_KEY: "2.13.1"}))
    kernel = naming("torch.version")
    assert {"warmup", "train", "evaluate"} <= set(kernel) and not {"manifest", "tokenize", "target"} & set(kernel)
    # regenerate names it too (greedy replies are the kernels' numerics), so tokenize, reading them, is downstream
    assert verdict_map(found) == {**invalidated(kernel), "tokenize": StageVerdict.DOWNSTREAM}
    assert cause_tuples(found) == [("param", KERNEL_KEY, "2.13.0", "2.13.1", tuple(kernel))]


def test_compare_a_library_version_key_hits_the_stages_naming_it_and_their_downstream(dag):
    key = "data/env/fingerprint.json:transformers.version"
    found = compared(dag, lock_of(dag, values={key: "5.24.0"}), lock_of(dag, values={key: "5.25.0"}))
    # what reads the target's output without naming the key itself is downstream (warmup, train, ...)
    assert verdict_map(found) == {
        **quiet(),
        **dict.fromkeys(listing("data/target"), StageVerdict.DOWNSTREAM),
        "target": StageVerdict.DIRECT,
        "regenerate": StageVerdict.DIRECT,
        "tokenize": StageVerdict.DIRECT,
        "features": StageVerdict.DIRECT,  # the target's forward is transformers' code
        "proof": StageVerdict.DIRECT,  # it regenerates and tokenizes its own data
        "gate": StageVerdict.DOWNSTREAM,
    }
    causes = ("target", "regenerate", "tokenize", "features", "proof")
    assert cause_tuples(found) == [("param", key, "5.24.0", "5.25.0", causes)]


def test_compare_the_always_changed_fingerprint_invalidates_nothing_by_itself(dag):
    # The fingerprint file's bytes differ on every run (it is rewritten); stages depend on named keys only.
    found = compared(dag, lock_of(dag), lock_of(dag, md5={"data/env/fingerprint.json": "rewritten"}))
    assert verdict_map(found) == quiet()
    assert root_causes(found) == []


# A small DAG of its own, for the mechanics: a -> b -> c, and d beside them.
SMALL = {
    "a": {"cmd": "python a.py", "deps": ["a.py"], "params": ["a.n"], "outs": ["out/a"]},
    "b": {"cmd": "python b.py", "deps": ["b.py", "out/a"], "params": ["b.n"], "outs": ["out/b"]},
    "c": {"cmd": "python c.py", "deps": ["c.py", "out/b/part"], "metrics": ["out/c.json"]},
    "d": {"cmd": "python d.py", "deps": ["d.py"], "params": ["a.n"], "outs": ["out/d"]},
}


def test_compare_a_param_hits_every_stage_naming_it_and_downstream_only():
    found = compared(SMALL, lock_of(SMALL, values={"a.n": 1}), lock_of(SMALL, values={"a.n": 2}))
    assert verdict_map(found) == {
        "a": StageVerdict.DIRECT,
        "b": StageVerdict.DOWNSTREAM,
        "c": StageVerdict.DOWNSTREAM,
        "d": StageVerdict.DIRECT,
    }
    assert cause_tuples(found) == [("param", "params.yaml:a.n", 1, 2, ("a", "d"))]

    found = compared(SMALL, lock_of(SMALL, values={"b.n": 1}), lock_of(SMALL, values={"b.n": 2}))
    assert verdict_map(found) == {
        "a": StageVerdict.UNCHANGED,
        "b": StageVerdict.DIRECT,
        "c": StageVerdict.DOWNSTREAM,
        "d": StageVerdict.UNCHANGED,
    }


def test_compare_a_changed_cmd_added_param_and_removed_dep_are_each_a_cause():
    changed = {**SMALL, "b": {**SMALL["b"], "cmd": "python b.py --fast", "params": ["b.n", "b.m"], "deps": ["out/a"]}}
    old = read_revision_state(LockState("HEAD", SMALL, lock_of(SMALL)))
    new = read_revision_state(LockState("new", changed, lock_of(changed)))
    found = compare(old, new, {}, None, "HEAD", "new")
    assert verdict_map(found) == {
        "a": StageVerdict.UNCHANGED,
        "b": StageVerdict.DIRECT,
        "c": StageVerdict.DOWNSTREAM,
        "d": StageVerdict.UNCHANGED,
    }
    assert cause_tuples(found) == [
        ("cmd", "b", "python b.py", "python b.py --fast", ("b",)),
        ("dep", "b.py", "md5(b.py)", None, ("b",)),
        ("param", "params.yaml:b.m", None, "value of b.m", ("b",)),
    ]


def test_compare_frozen_stage_is_frozen_and_does_not_invalidate_downstream():
    frozen = {**SMALL, "a": {**SMALL["a"], "frozen": True}}
    found = compared(frozen, lock_of(frozen, values={"a.n": 1}), lock_of(frozen, values={"a.n": 2}))
    # `dvc repro` will not rerun a, so b's inputs stay what they were; d names a.n itself.
    assert verdict_map(found) == {
        "a": StageVerdict.FROZEN,
        "b": StageVerdict.UNCHANGED,
        "c": StageVerdict.UNCHANGED,
        "d": StageVerdict.DIRECT,
    }
    assert cause_tuples(found) == [("param", "params.yaml:a.n", 1, 2, ("d",))]


def test_compare_an_always_changed_stage_says_so_whatever_changed():
    always = {**SMALL, "a": {**SMALL["a"], "always_changed": True}}
    found = compared(always, lock_of(always), lock_of(always))
    assert verdict_map(found) == {
        "a": StageVerdict.ALWAYS,
        "b": StageVerdict.UNCHANGED,
        "c": StageVerdict.UNCHANGED,
        "d": StageVerdict.UNCHANGED,
    }
    found = compared(always, lock_of(always, md5={"a.py": "x"}), lock_of(always, md5={"a.py": "y"}))
    assert verdict_map(found)["a"] == StageVerdict.ALWAYS and root_causes(found) == []


def test_compare_a_stage_missing_from_the_old_state_is_unknown():
    grown = {**SMALL, "e": {"cmd": "python e.py", "deps": ["e.py", "out/c.json"], "outs": ["out/e"]}}
    old = read_revision_state(LockState("HEAD", SMALL, lock_of(SMALL)))
    new = read_revision_state(LockState("new", grown, lock_of(grown)))
    found = compare(old, new, {}, None, "HEAD", "new")
    assert verdict_map(found) == {
        "a": StageVerdict.UNCHANGED,
        "b": StageVerdict.UNCHANGED,
        "c": StageVerdict.UNCHANGED,
        "d": StageVerdict.UNCHANGED,
        "e": StageVerdict.UNKNOWN,
    }
    unlocked = lock_of(SMALL)
    del unlocked["stages"]["b"]
    found = compared(SMALL, unlocked, lock_of(SMALL))
    # b's old outputs are unknowable, so what reads them cannot be called unchanged
    assert verdict_map(found) == {
        "a": StageVerdict.UNCHANGED,
        "b": StageVerdict.UNKNOWN,
        "c": StageVerdict.DOWNSTREAM,
        "d": StageVerdict.UNCHANGED,
    }


class DirCache:
    """DVC's local cache layout, enough for `compare`: an object is a file named by its md5."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def oid_to_path(self, md5: str) -> str:
        return str(self.root / md5)

    def put(self, md5: str, content: bytes = b"x") -> None:
        (self.root / md5).write_bytes(content)


def test_compare_a_missing_output_is_restorable_only_when_the_cache_holds_every_file(tmp_path):
    cache = DirCache(tmp_path)
    lock = lock_of(SMALL, md5={"out/b": "bbb.dir"})
    recorded = {name: {o["path"]: o["md5"] for o in entry["outs"]} for name, entry in lock["stages"].items()}
    gone = lock_of(SMALL, md5={"out/b": None})  # the workspace has no out/b now

    found = compared(SMALL, lock, gone, recorded, cache)
    # not in the cache: b must be rebuilt, so c, which reads it, is invalidated with it
    assert verdict_map(found) == {
        "a": StageVerdict.UNCHANGED,
        "b": StageVerdict.OUTPUTS,
        "c": StageVerdict.DOWNSTREAM,
        "d": StageVerdict.UNCHANGED,
    }
    (cause,) = next(v for v in found if v.stage == "b").causes
    assert (cause.kind, cause.what, cause.old, cause.new) == ("out", "out/b", "bbb.dir", "missing")
    assert cause.evidence.endswith("not in the cache: `dvc repro -f b` rebuilds it")
    assert cause_tuples(found) == [("out", "out/b", "bbb.dir", "missing", ("b",))]

    cache.put("bbb.dir", json.dumps([{"md5": "f1", "relpath": "part"}]).encode())
    found = compared(SMALL, lock, gone, recorded, cache)
    (cause,) = next(v for v in found if v.stage == "b").causes  # the listing names a file the cache lacks
    assert cause.evidence.endswith("not in the cache: `dvc repro -f b` rebuilds it")
    cache.put("f1")
    found = compared(SMALL, lock, gone, recorded, cache)
    (cause,) = next(v for v in found if v.stage == "b").causes
    assert cause.evidence.endswith("restorable: `dvc checkout` brings the recorded bytes back from the cache")
    # restorable: `dvc checkout` brings back exactly what c was computed from, so c is still valid
    assert verdict_map(found) == {
        "a": StageVerdict.UNCHANGED,
        "b": StageVerdict.OUTPUTS,
        "c": StageVerdict.UNCHANGED,
        "d": StageVerdict.UNCHANGED,
    }


class MetricsState(LockState):
    """A revision with committed metrics files as well."""

    def __init__(self, label: str, stages: dict, lock: dict, metrics: dict[str, dict]) -> None:
        super().__init__(label, stages, lock)
        self._metrics = metrics

    def read_text(self, path: str):
        return json.dumps(self._metrics[path]) if path in self._metrics else None


def deltas_between(stages: dict, old: tuple, new: tuple) -> dict:
    """metric key -> MetricDelta between two (lock, metrics) revisions, as explain computes them."""
    from dflashpipe.commands.explain import metric_deltas

    sa, sb = MetricsState("HEAD", stages, *old), MetricsState("new", stages, *new)
    before, after = read_revision_state(sa), read_revision_state(sb)
    found = compare(before, after, {}, None, "HEAD", "new")
    return {m.key: m for m in metric_deltas(sa, sb, after, found)}


def train_metrics(tokens_per_s: float, spread: dict | None) -> dict:
    record = {"tokens_per_s": tokens_per_s, "final_loss": 9.7}
    return {"metrics/train/metrics.json": record | ({"tokens_per_s_spread": spread} if spread else {})}


def test_a_throughput_drop_within_noise_is_not_blamed_on_grown_data(dag):
    # growing the data, rerun: the manifest, the tokens and the drafter get new hashes
    rerun = {p: f"new md5({p})" for p in ("data/manifest", "data/regenerated", "data/tokens", "data/drafter")}
    grown = (lock_of(dag, values={"data.num_samples": 2000}), lock_of(dag, rerun, {"data.num_samples": 2400}))
    spread = {"low": 48.0, "high": 53.0, "repeats": 5}

    # data.num_samples reaches train through the DAG, yet the ranges overlap: noise, attributed to nothing
    found = deltas_between(
        dag,
        (grown[0], train_metrics(52.0, spread)),
        (grown[1], train_metrics(49.5, {"low": 47.0, "high": 51.0, "repeats": 3})),
    )
    (m,) = found.values()
    assert (m.key, m.call, m.causes) == ("tokens_per_s", NoiseCall.NOISE, [])
    assert m.spread == "before 52 (range 48..53, 5 repeats); after 49.5 (range 47..51, 3 repeats)"
    assert "within noise: not attributed" in metric_line(m)[1]

    found = deltas_between(
        dag,
        (grown[0], train_metrics(52.0, spread)),
        (grown[1], train_metrics(31.0, {"low": 30.0, "high": 33.0, "repeats": 3})),
    )
    assert (found["tokens_per_s"].call, found["tokens_per_s"].causes) == (
        NoiseCall.CHANGE,
        ["params.yaml:data.num_samples"],
    )

    found = deltas_between(dag, (grown[0], train_metrics(52.0, None)), (grown[1], train_metrics(51.0, spread)))
    assert found["tokens_per_s"].call == NoiseCall.UNMEASURED
    assert found["tokens_per_s"].spread == "before no spread recorded; after 51 (range 48..53, 5 repeats)"
    assert found["tokens_per_s"].causes == ["params.yaml:data.num_samples"]  # unmeasured: the causes stand


def test_a_metric_is_not_attributed_through_an_upstream_that_reran_to_the_same_bytes(dag):
    # an edit of the manifest's code reran manifest and tokenize, but the tokens came out byte-identical:
    # train's inputs did not change, so nothing of it may be blamed on that edit
    edit = {"src/dflashpipe/data": "md5(edited)", "data/manifest": "new md5(data/manifest)"}  # manifest's package
    found = deltas_between(
        dag,
        (lock_of(dag), train_metrics(52.0, {"low": 50.0, "high": 53.0, "repeats": 5})),
        (lock_of(dag, edit), train_metrics(31.0, {"low": 30.0, "high": 33.0, "repeats": 5})),
    )
    assert (found["tokens_per_s"].call, found["tokens_per_s"].causes) == (NoiseCall.CHANGE, [])
    # the same edit with the tokens changed: now it reaches train
    edit.update({p: f"new md5({p})" for p in ("data/regenerated", "data/tokens")})
    found = deltas_between(
        dag,
        (lock_of(dag), train_metrics(52.0, {"low": 50.0, "high": 53.0, "repeats": 5})),
        (lock_of(dag, edit), train_metrics(31.0, {"low": 30.0, "high": 33.0, "repeats": 5})),
    )
    assert found["tokens_per_s"].causes == ["src/dflashpipe/data"]


def test_a_metric_is_attributed_only_to_causes_that_reach_its_stage(dag):
    # a tokenizer change reaches train (through tokens) but an evaluate-only param does not reach train
    key = "evaluate.max_new_tokens"
    found = deltas_between(
        dag,
        (lock_of(dag, values={key: 8}), train_metrics(52.0, None)),
        (lock_of(dag, values={key: 16}), {"metrics/train/metrics.json": {"tokens_per_s": 52.0, "final_loss": 9.8}}),
    )
    assert found["final_loss"].causes == [] and found["final_loss"].call is None


def test_compare_paths_name_the_changed_files_of_a_directory_and_skip_unchanged_deps(tmp_path):
    cache = DirCache(tmp_path)
    cache.put("a1.dir", json.dumps([{"md5": "p", "relpath": "part"}, {"md5": "s1", "relpath": "shard-0"}]).encode())
    cache.put(
        "a2.dir",
        json.dumps(
            [{"md5": "p", "relpath": "part"}, {"md5": "s1", "relpath": "shard-0"}, {"md5": "s2", "relpath": "shard-1"}]
        ).encode(),
    )
    # a -> b (reads all of out/a) -> c (reads out/b/part); e reads out/a/part only, which kept its hash
    dag = {**SMALL, "e": {"cmd": "python e.py", "deps": ["e.py", "out/a/part"], "outs": ["out/e"]}}
    old = lock_of(dag, md5={"out/a": "a1.dir", "out/a/part": "p"}, values={"a.n": 1})
    new = lock_of(
        dag, md5={"out/a": "a2.dir", "out/a/part": "p", "out/b": "b2.dir", "out/b/part": "q"}, values={"a.n": 2}
    )
    found = {v.stage: v for v in compared(dag, old, new, cache=cache)}
    assert found["b"].paths == ["b <- out/a/shard-1 (a: params.yaml:a.n)"]
    assert found["c"].paths == ["c <- out/b/part (b) <- out/a/shard-1 (a: params.yaml:a.n)"]
    assert (
        found["e"].paths == [] and found["e"].verdict == StageVerdict.DOWNSTREAM
    )  # invalidated by a, via no changed file
    assert found["d"].paths == []
    # the new listing is not in the cache: say so instead of guessing files
    new = lock_of(dag, md5={"out/a": "a3.dir", "out/a/part": "p"}, values={"a.n": 2})
    found = {v.stage: v for v in compared(dag, old, new, cache=cache)}
    assert found["b"].paths == ["b <- out/a: directory changed (file listing not in the cache) (a: params.yaml:a.n)"]


def fingerprint_values(stages: dict, facts: dict) -> dict[str, object]:
    """lock_of's `values` for every fingerprint key the stages name, as `facts` (a fingerprint) holds them: ABSENT
    for a key it lacks (a group added to dvc.yaml since the committed file was written), left out of the lock."""
    named = {
        k
        for d in stages.values()
        for e in d.get("params", [])
        if isinstance(e, dict)
        for k in e.get(FINGERPRINT_PARAMS, [])
    }
    return {f"{FINGERPRINT_PARAMS}:{k}": fact_at(facts, k) for k in named}


def test_a_stale_fingerprint_names_the_edited_torch_file_and_the_stages_it_invalidates(dag):
    from dflashpipe.commands.explain import EditedFile, Machine, machine_lines
    from dflashpipe.commands.explain.machine import (
        Live,
        attribute_to_machine,
        fingerprint_changes,
        with_live_fingerprint,
    )

    recorded = json.loads((ROOT / "data/env/fingerprint.json").read_text())
    threads = {"torch_intra_op": 2, "torch_inter_op": 2, "env": {}, "affinity": "0-1", "cpu_quota": "none"}
    recorded["threads"] = recorded.get("threads") or threads  # a file recorded before the thread facts
    now = json.loads(json.dumps(recorded))
    now["torch"]["files_edited"] = ["torch/fx/_symbolic_trace.py"]
    now["torch"]["files_ok"] = False
    changes = fingerprint_changes(recorded, now)
    assert [(c.what, c.new) for c in changes] == [
        ("torch.files_edited", ["torch/fx/_symbolic_trace.py"]),
        ("torch.files_ok", False),
    ]
    edited = EditedFile("torch/fx/_symbolic_trace.py", "sha256=old", "sha256=new", ["Tracer.trace"])
    live = Live(Machine(True, changes, [], [edited], "full check: hashed all 3 torch files"), now)
    # the workspace's file and lock say nothing moved; its fingerprint keys are read off the machine instead
    lock = lock_of(dag, values=fingerprint_values(dag, recorded))
    workspace = with_live_fingerprint(read_revision_state(LockState("workspace", dag, lock)), live, {})
    found = compare(read_revision_state(LockState("HEAD", dag, lock)), workspace, {}, None, "HEAD", "workspace")
    attribute_to_machine(found, live)
    readers = naming("torch.files_edited")  # the kernel environment, and nothing that reads data
    assert {"warmup", "train", "evaluate"} <= set(readers) and "tokenize" not in readers
    assert verdict_map(found) == invalidated(readers)
    (cause,) = root_causes(found)
    assert (cause.kind, cause.what, cause.old, cause.new, cause.stages) == (
        "machine",
        "torch.files_edited",
        [],
        ["torch/fx/_symbolic_trace.py"],
        readers,
    )
    assert cause.evidence.endswith(
        "this machine now (observed live; data/env/fingerprint.json still says []: stale); "
        "edited torch/fx/_symbolic_trace.py (changed: Tracer.trace)"
    )
    # the header's list is read off the same verdicts, and each change names the stages it hits
    # invalid on this machine: the stages naming the key, and serve, which reads evaluate's metrics
    assert live.machine.invalid == [*readers, "serve", "gate"]
    assert changes[0].stages == readers and changes[1].stages == []
    first, second = machine_lines(live.machine)
    assert first.startswith(
        'the fingerprint file is stale: torch.files_edited now ["torch/fx/_symbolic_trace.py"] (recorded []); '
        "torch.files_ok now false (recorded true); "
        f"these stages are invalid on this machine: {', '.join([*readers, 'serve', 'gate'])} (full check"
    )
    assert second == (
        "edited installed file torch/fx/_symbolic_trace.py: sha256=new (the wheel's RECORD says sha256=old); "
        "changed definitions: Tracer.trace"
    )


def test_the_live_check_imports_torch_only_when_its_key_moved(tmp_path, monkeypatch):
    """explain observes the machine with the fingerprint stage's own code; the facts only an imported torch
    tells are reused when recorded under the same key (torch's files, the CPU, the GPUs, the loading variables)."""
    import sys

    from dflashpipe.core import env

    hashes, loaded = tmp_path / "hashes.json", tmp_path / "loaded.json"
    if (ROOT / env.HASH_STATE).is_file():  # spares hashing torch's 12K files again: the test is not about that
        shutil.copy(ROOT / env.HASH_STATE, hashes)
    stage = env.observe(hashes, loaded, project=tmp_path)  # as the fingerprint stage runs it: imports torch, records
    assert stage.probed and json.loads(loaded.read_text())["key"] == env.loaded_key(stage.integrity)
    reused = env.observe(hashes, loaded, reuse_loaded=True, project=tmp_path)
    assert (reused.probed, reused.facts, reused.integrity.rehashed) == (False, stage.facts, 0)
    code = (
        "import json, sys; from dflashpipe.core import env; "
        f"o = env.observe({str(hashes)!r}, {str(loaded)!r}, reuse_loaded=True, project={str(tmp_path)!r}); "
        "print(o.probed, 'torch' in sys.modules, json.dumps(o.facts, sort_keys=True))"
    )
    probed, imported, facts = run([sys.executable, "-c", code], tmp_path).stdout.split(" ", 2)
    assert (probed, imported, json.loads(facts)) == ("False", "False", stage.facts)
    # a variable that steers which libraries load moved: import torch again, and record under the new key
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    assert env.observe(hashes, loaded, reuse_loaded=True, project=tmp_path).probed
    assert not env.observe(hashes, loaded, reuse_loaded=True, project=tmp_path).probed
    # a record made under another key (another machine, other torch files) is never taken
    loaded.write_text(json.dumps({**json.loads(loaded.read_text()), "key": "another machine's"}))
    assert env.observe(hashes, loaded, reuse_loaded=True, project=tmp_path).probed


def test_a_figure_read_off_a_clock_is_never_called_a_deterministic_move():
    from dflashpipe.commands.explain.comparison import is_throughput

    timed = ["tokens_per_s", "encoded_tokens_per_second", "busy_s.target", "compile.warmup_s", "speedup", "seconds"]
    counted = ["per_source.chitchat.tau", "throughput.flops_per_step", "verify_steps", "final_loss", "shards"]
    assert [k for k in timed + counted if is_throughput(k, {}, {})] == timed
    assert is_throughput("tau", {"tau_spread.low": 1.0}, {})  # a recorded spread says so whatever the name


def busy(cpu_over_wall: float, load: float) -> dict:
    """A spread's `machine` facts (spread.Busy.to_json) for 2 CPUs."""
    return {"cpu_s": 2.0 * cpu_over_wall, "wall_s": 2.0, "cpu_over_wall": cpu_over_wall, "cpus": 2, "load_1m": load}


def test_a_timed_figure_that_moved_with_no_input_changed_says_what_the_machine_facts_say(dag):
    quiet_run = {"low": 50.0, "high": 53.0, "repeats": 5, "machine": busy(1.95, 0.4)}
    busy_run = {"low": 30.0, "high": 33.0, "repeats": 5, "machine": busy(0.9, 3.8)}
    found = deltas_between(
        dag, (lock_of(dag), train_metrics(52.0, quiet_run)), (lock_of(dag), train_metrics(31.0, busy_run))
    )
    assert set(found) == {"tokens_per_s"}  # the facts ride in the spread, never as metrics of their own
    m = found["tokens_per_s"]
    assert (m.call, m.causes) == (NoiseCall.CHANGE, [])
    assert m.machine == (
        "while measuring: before CPU time/wall 1.95 on 2 CPUs, load 0.4; after CPU time/wall 0.9 on 2 CPUs, load 3.8"
    )
    assert m.control == "no control recorded at HEAD and new"  # records older than the control
    line = f"changed inputs: none recorded; {m.spread}; {m.control}; recorded machine facts: {m.machine}"
    assert metric_line(m)[1].endswith(line)
    # an input that reaches the figure is its cause: no machine story then
    found = deltas_between(
        dag,
        (lock_of(dag, values={"train.lr": 1e-3}), train_metrics(52.0, quiet_run)),
        (lock_of(dag, values={"train.lr": 2e-3}), train_metrics(31.0, busy_run)),
    )
    assert (found["tokens_per_s"].causes, found["tokens_per_s"].machine) == (["params.yaml:train.lr"], "")


def controlled(cpu_over_wall: float, load: float, before_ms: float, after_ms: float) -> dict:
    """`busy` with the control timed before and after the measurement (spread.Measuring)."""
    return busy(cpu_over_wall, load) | {"control_ms": {"before": before_ms, "after": after_ms}}


def test_a_rate_that_moved_as_much_as_its_control_is_the_machine_not_an_input(dag):
    from dflashpipe.commands.explain import NoiseCall

    quiet = {"low": 50.0, "high": 53.0, "repeats": 5, "machine": controlled(1.95, 0.4, 3.0, 3.2)}
    loaded = {"low": 15.0, "high": 17.0, "repeats": 5, "machine": controlled(0.7, 3.9, 9.5, 10.1)}
    grew = lock_of(dag, values={"train.lr": 1e-3}), lock_of(dag, values={"train.lr": 2e-3})
    # an input reaches the figure, yet the control moved as much (about 3.1x): the machine, no input blamed
    found = deltas_between(dag, (grew[0], train_metrics(52.0, quiet)), (grew[1], train_metrics(16.0, loaded)))
    m = found["tokens_per_s"]
    assert (m.call, m.causes) == (NoiseCall.MACHINE, [])
    assert m.control == "the machine was 3.16x slower at new: control 9.8 ms at new vs 3.1 ms at HEAD"
    assert "the machine's move, as the control measured it: not attributed" in metric_line(m)[1]
    assert m.control in metric_line(m)[1]
    # the same drop with a control that did not move: a change, and the input on its path is blamed
    steady = {**loaded, "machine": controlled(0.7, 3.9, 3.0, 3.3)}
    found = deltas_between(dag, (grew[0], train_metrics(52.0, quiet)), (grew[1], train_metrics(16.0, steady)))
    assert (found["tokens_per_s"].call, found["tokens_per_s"].causes) == (NoiseCall.CHANGE, ["params.yaml:train.lr"])
    # a control that explains only part of the drop (1.5x of 3.2x): what is left is a change
    half = {**loaded, "machine": controlled(0.7, 3.9, 4.6, 4.8)}
    found = deltas_between(dag, (grew[0], train_metrics(52.0, quiet)), (grew[1], train_metrics(16.0, half)))
    assert found["tokens_per_s"].call == NoiseCall.CHANGE
    # a side without a control: compared as before, and said so
    bare = {**loaded, "machine": busy(0.7, 3.9)}
    found = deltas_between(dag, (grew[0], train_metrics(52.0, quiet)), (grew[1], train_metrics(16.0, bare)))
    assert (found["tokens_per_s"].call, found["tokens_per_s"].control) == (
        NoiseCall.CHANGE,
        "no control recorded at new",
    )
    # a ratio of two paths timed side by side is not scaled by the control: the machine cancels out in it
    assert (
        deltas_between(
            dag,
            (grew[0], {"metrics/train/metrics.json": {"speedup": 2.0, "speedup_spread": quiet}}),
            (
                grew[1],
                {
                    "metrics/train/metrics.json": {
                        "speedup": 1.0,
                        "speedup_spread": {**quiet, "low": 0.9, "high": 1.1, "machine": loaded["machine"]},
                    }
                },
            ),
        )["speedup"].call
        == NoiseCall.CHANGE
    )


def test_a_figure_measured_under_other_threads_than_the_machine_now_names_them(dag):
    """The workspace's verdicts read the machine now; a figure in it was measured under what its dvc.lock
    recorded. When the machine is back to what A recorded, no input differs, and the lock says why it moved."""
    from dflashpipe.commands.explain import metric_deltas

    key = "data/env/fingerprint.json:threads.env"
    sa = MetricsState("HEAD", dag, lock_of(dag, values={key: {}}), train_metrics(52.0, None))
    sb = MetricsState("workspace", dag, lock_of(dag, values={key: {"OMP_NUM_THREADS": "1"}}), train_metrics(31.0, None))
    now = read_revision_state(sa)  # the machine now, as HEAD recorded it
    verdicts = compare(read_revision_state(sa), now, {}, None, "HEAD", "workspace")
    assert set(verdict_map(verdicts).values()) == {StageVerdict.UNCHANGED, StageVerdict.ALWAYS}
    (m,) = (d for d in metric_deltas(sa, sb, now, verdicts) if d.key == "tokens_per_s")
    assert (m.call, m.causes) == (NoiseCall.UNMEASURED, [])
    assert m.machine == 'the runs were recorded (dvc.lock) with threads.env {} -> {"OMP_NUM_THREADS": "1"}'


def test_an_upstream_that_only_rewrote_its_metrics_invalidates_nothing_downstream(dag):
    """regenerate reran (`dvc repro -f`) and wrote new timings into metrics/regenerate.json, its shards byte for
    byte the same: tokenize reads the shards, never that file, so no alarm is raised without a changed path."""
    timings = {"metrics/regenerate.json": "md5(new timings)"}
    found = {v.stage: v for v in compared(dag, lock_of(dag), lock_of(dag, timings))}
    assert (found["regenerate"].verdict, found["tokenize"].verdict) == (StageVerdict.UNCHANGED, StageVerdict.UNCHANGED)
    assert found["tokenize"].upstream == [] and found["tokenize"].paths == []
    # the shards themselves changed: now tokenize is downstream, and says through which file
    shards = {**timings, "data/regenerated": "new md5(data/regenerated)"}
    found = {v.stage: v for v in compared(dag, lock_of(dag), lock_of(dag, shards))}
    assert found["tokenize"].verdict == StageVerdict.DOWNSTREAM and found["tokenize"].upstream == ["regenerate"]
    assert found["tokenize"].paths == ["tokenize <- data/regenerated (regenerate: unchanged)"]


def test_a_compile_cache_rebuilt_to_other_bytes_for_the_same_key_is_equivalent(dag, tmp_path):
    """data/compile's bytes differ from build to build (paths and timestamps inside the objects), but inductor
    names every file by its cache key and report.json records the warmup key: same names and key, same kernels."""
    cache = DirCache(tmp_path)

    def build(name: str, digest: str, files: tuple[str, ...] = ("inductor/ab/kernel.so",)) -> str:
        report = json.dumps({"built_for": {"stage": "warmup", "digest": digest}, "seconds": len(name)})
        cache.put(f"report-{name}", report.encode())
        listing = [{"relpath": f, "md5": f"{f}-{name}"} for f in files] + [
            {"relpath": "report.json", "md5": f"report-{name}"}
        ]
        cache.put(f"{name}.dir", json.dumps(listing).encode())
        return f"{name}.dir"

    # a kernel named by its source's hash, and an FX graph entry (its key a directory, the entry file named by a
    # hash of its bytes, which hold timings): the key is what must match, not the entry's name
    entries = ("inductor/ab/cabc.cpp", "inductor/ab/cabc.so", "inductor/fxgraph/f3/f3key/{}")
    here = build("here", "k" * 64, tuple(f.format("entry1") for f in entries))
    there = build("there", "k" * 64, tuple(f.format("entry2") for f in entries))
    found = {
        v.stage: v
        for v in compared(dag, lock_of(dag, {"data/compile": there}), lock_of(dag, {"data/compile": here}), cache=cache)
    }
    assert verdict_map(found.values()) == quiet()
    assert found["warmup"].note.startswith(
        "data/compile rebuilt here, equivalent: other bytes, the same 4 entries by inductor's cache keys, "
        "built for the same warmup key (kkkkkkkkkkkk)"
    )
    assert found["train"].paths == found["bench"].paths == []
    # built for another key, or other files (other cache keys): what reads it is invalidated, naming the path
    for other in (
        build("key", "x" * 64, tuple(f.format("entry1") for f in entries)),
        build("files", "k" * 64, ("inductor/cd/ccd.cpp", "inductor/cd/ccd.so", "inductor/fxgraph/f3/f3key/entry1")),
        build("graph", "k" * 64, ("inductor/ab/cabc.cpp", "inductor/ab/cabc.so", "inductor/fxgraph/g4/g4key/entry1")),
    ):
        found = {
            v.stage: v
            for v in compared(
                dag, lock_of(dag, {"data/compile": there}), lock_of(dag, {"data/compile": other}), cache=cache
            )
        }
        assert (found["train"].verdict, found["bench"].verdict) == (StageVerdict.DOWNSTREAM, StageVerdict.DOWNSTREAM)
        assert found["bench"].paths[0].startswith("bench <- data/compile/")


def test_a_forced_rebuild_of_the_compile_cache_is_equivalent_and_invalidates_nothing(committed):
    run(["dvc", "repro", "-f", "warmup"], committed)
    lock = yaml.safe_load((committed / "dvc.lock").read_text())["stages"]["warmup"]["outs"][0]["md5"]
    head = yaml.safe_load(run(["git", "show", "HEAD:dvc.lock"], committed).stdout)["stages"]["warmup"]["outs"][0]
    report = explain("HEAD", "workspace", committed)
    by_stage = {v.stage: v for v in report.stages}
    if lock == head["md5"]:  # the rebuild gave the very same bytes: nothing to tell apart
        assert verdicts(report) == quiet()
        return
    assert verdicts(report) == quiet() and report.root_causes == []
    assert by_stage["warmup"].note.startswith("data/compile rebuilt here, equivalent: other bytes, the same ")
    assert by_stage["train"].paths == [] and by_stage["bench"].paths == []
    assert "| warmup | unchanged | data/compile rebuilt here, equivalent" in to_markdown(report, full=True)


def test_a_fingerprint_key_the_file_does_not_hold_yet_is_read_off_the_machine(dag):
    """dvc.yaml names a key the fingerprint file (and dvc.lock) predate: `dvc repro` will run the stages with
    the machine's value, so the machine's value is what the verdicts compare, and the header agrees."""
    from dflashpipe.commands.explain import Machine
    from dflashpipe.commands.explain.machine import (
        Live,
        attribute_to_machine,
        fingerprint_changes,
        with_live_fingerprint,
    )

    recorded = json.loads((ROOT / "data/env/fingerprint.json").read_text())
    recorded.pop("threads", None)  # a file written before the thread facts
    now = {**recorded, "threads": {"torch_intra_op": 2, "torch_inter_op": 2, "env": {}, "affinity": "0-1"}}
    now["threads"]["cpu_quota"] = "none"
    lock = lock_of(dag, values=fingerprint_values(dag, recorded))
    for entry in lock["stages"].values():  # nor did dvc.lock record them
        named = entry["params"].get(FINGERPRINT_PARAMS, {})
        for key in [k for k in named if k.startswith("threads.")]:
            del named[key]
    live = Live(Machine(True, fingerprint_changes(recorded, now), [], [], "full check"), now)
    declared = {
        name: [k for e in d.get("params", []) if isinstance(e, dict) for k in e.get(FINGERPRINT_PARAMS, [])]
        for name, d in dag.items()
    }
    workspace = with_live_fingerprint(read_revision_state(LockState("workspace", dag, lock)), live, declared)
    found = compare(read_revision_state(LockState("HEAD", dag, lock)), workspace, {}, None, "HEAD", "workspace")
    attribute_to_machine(found, live)
    readers = naming("threads.torch_intra_op")
    assert verdict_map(found) == invalidated(readers)
    causes = {c.what: c for c in root_causes(found)}
    intra = causes["threads.torch_intra_op"]
    assert (intra.kind, intra.old, intra.new, intra.stages) == ("machine", None, 2, readers)
    assert intra.evidence.endswith("this machine now (observed live; data/env/fingerprint.json lacks it: stale)")
    assert causes["threads.env"].stages == naming("threads.env")
    assert live.machine.invalid == [*readers, "serve", "gate"]


def test_the_control_is_set_aside_only_by_a_fact_that_can_move_it(dag):
    """A compile variable changed what train ran with, yet the control (an eager matmul) cannot follow it: a rate
    that fell as far as the control rose is the machine's. The thread variables its matmul's runtimes read can
    move it: then it is no neutral reference, and the figure is compared as it is."""
    from dflashpipe.commands.explain import NoiseCall

    quiet = {"low": 50.0, "high": 53.0, "repeats": 5, "machine": controlled(1.95, 0.4, 3.0, 3.2)}
    loaded = {"low": 15.0, "high": 17.0, "repeats": 5, "machine": controlled(0.7, 3.9, 9.5, 10.1)}
    for key, before, after, call in (
        (f"{FINGERPRINT_PARAMS}:env", {}, {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, NoiseCall.MACHINE),
        (f"{FINGERPRINT_PARAMS}:threads.env", {}, {"OMP_NUM_THREADS": "1"}, NoiseCall.CHANGE),
        (f"{FINGERPRINT_PARAMS}:threads.torch_intra_op", 2, 1, NoiseCall.CHANGE),
    ):
        found = deltas_between(
            dag,
            (lock_of(dag, values={key: before}), train_metrics(52.0, quiet)),
            (lock_of(dag, values={key: after}), train_metrics(16.0, loaded)),
        )["tokens_per_s"]
        assert found.call == call, key
        if call == NoiseCall.MACHINE:
            assert found.causes == [] and found.slowdown == pytest.approx(9.8 / 3.1)
        else:
            name = key.split(":", 1)[1]
            assert found.control == f"control not applied: {name} changed what it runs on"
            assert found.causes == [key] and found.slowdown is None


def answer_of(dag, old: tuple, new: tuple, **report_fields):
    """explain's Report and first screen between two hand-built (lock, metrics) revisions."""
    from dflashpipe.commands.explain import Report, answer_lines, metric_deltas
    from dflashpipe.commands.explain.answer import answer
    from dflashpipe.commands.explain.comparison import headlines_same

    sa, sb = MetricsState("HEAD", dag, *old), MetricsState("new", dag, *new)
    after = read_revision_state(sb)
    found = compare(read_revision_state(sa), after, {}, None, "HEAD", "new")
    metrics = metric_deltas(sa, sb, after, found)
    report = Report("HEAD", "new", root_causes(found), found, metrics, **report_fields)
    report.headlines_same = headlines_same(sa, sb, metrics)
    return report, answer_lines(answer(report))


def headline_metrics(tokens_per_s: float, spread: dict, loss: float, extra: int = 0) -> dict:
    """The train and eval metrics files with the headline figures, and `extra` non-headline keys."""
    train = {"tokens_per_s": tokens_per_s, "tokens_per_s_spread": spread, "final_loss": loss}
    train |= {f"step_profile.share.part{i}": tokens_per_s + i for i in range(extra)}
    return {"metrics/train/metrics.json": train, "metrics/eval.json": {"tau": 1.067}}


def test_the_first_screen_is_the_causes_the_stages_and_the_headlines(dag):
    quiet = {"low": 50.0, "high": 53.0, "repeats": 5, "machine": controlled(1.95, 0.4, 3.0, 3.2)}
    loaded = {"low": 15.0, "high": 17.0, "repeats": 5, "machine": controlled(0.7, 3.9, 9.5, 10.1)}
    rerun = {p: f"new md5({p})" for p in ("data/manifest", "data/regenerated", "data/tokens", "data/drafter")}
    report, lines = answer_of(
        dag,
        (lock_of(dag, values={"data.num_samples": 2000}), headline_metrics(52.0, quiet, 9.70, extra=40)),
        (lock_of(dag, rerun, {"data.num_samples": 2400}), headline_metrics(16.0, loaded, 9.71, extra=40)),
    )
    from dflashpipe.commands.explain.render import DETAIL, FOOTER, INDENT, ITEM, SECTION, TITLE, WIDTH

    downstream = [s for s in dag if verdicts(report)[s] == StageVerdict.DOWNSTREAM]
    assert lines[:4] == [
        (TITLE, "What changed: HEAD -> new"),
        (SECTION, "Causes"),
        (ITEM, "(1) param data.num_samples: 2000 -> 2400  [dvc.lock@HEAD vs dvc.lock@new]"),
        (DETAIL, f"invalidates manifest; downstream {', '.join(downstream)}"),
    ]
    assert (SECTION, "Stages") in lines and (ITEM, f"invalidated: {', '.join(['manifest', *downstream])}") in lines
    heads = lines[lines.index((SECTION, "Headlines")) + 1 :]
    # the rate fell as far as the control rose: the machine, with the control's factor; the loss is deterministic
    assert heads[0][1].startswith("train tokens/s  52 -> 16 (-69%)") and heads[0][1].endswith(
        "machine: control 3.16x slower"
    )
    # the loss is deterministic: it differs, its one cause under it, and how to measure that cause's effect
    assert heads[1][1].startswith("final loss") and heads[1][1].endswith("differs")
    assert heads[2:5] == [
        (DETAIL, "on its path: (1) param data.num_samples"),
        (DETAIL, "not verified: dflashpipe explain HEAD new --verify metrics/train/metrics.json:final_loss"),
        (ITEM, "the same: tau"),
    ]
    # the 40 other figures that moved are behind --all, counted; nothing of them is on the first screen
    assert heads[-1][0] == FOOTER and "40 more metrics that differ" in heads[-1][1]
    assert not any("step_profile" in text for _, text in lines)
    assert all(INDENT[level] + len(text) <= WIDTH for level, text in lines) and len(lines) <= 25


def test_evaluate_and_train_records_reach_the_first_screen_only_through_the_headline_list(dag):
    """eval.json's contract, floor and baseline and train's balance are dozens of keys: the first screen shows
    the contract (`lossless`, a headline: false is a bug) and says on speedup's line that its baseline differs,
    since the two figures are then not like for like; the rest is counted behind --all."""
    from dflashpipe.commands.explain.render import FOOTER, INDENT, SECTION, WIDTH

    def evaluated(dtype: str, speedup: float, lossless: bool, bugs: int) -> dict:
        return {
            "tau": 1.067,
            "speedup": speedup,
            "lossless": lossless,
            "baseline": {"decoding": "plain greedy, one sequence", "dtype": dtype},
            "floor": {"bigram": {"tau": 1.01 + bugs / 100, "slot_1_acceptance": 0.02 + bugs / 100}},
            "contract": {"prompts": 8, "exact": 8 - bugs, "bugs": bugs, "departures": [{"id": "p"}] * bugs},
        }

    def trained(busy: float) -> dict:
        sides = {side: {"busy_s": busy + i, "tokens_per_s_busy": 10 * busy + i} for i, side in enumerate("ab")}
        return {"final_loss": 9.7, "balance": {**sides, "bound_by": "drafter", "waited": "target", "steps": 120}}

    old = {"metrics/eval.json": evaluated("float32", 0.48, True, 0), "metrics/train/metrics.json": trained(3.0)}
    new = {"metrics/eval.json": evaluated("bfloat16", 0.61, False, 1), "metrics/train/metrics.json": trained(4.0)}
    report, lines = answer_of(
        dag,
        (lock_of(dag, values={"compute.target_dtype": "float32"}), old),
        (lock_of(dag, values={"compute.target_dtype": "bfloat16"}), new),
    )
    heads = [text for _, text in lines[lines.index((SECTION, "Headlines")) + 1 :]]
    speedup = next(i for i, text in enumerate(heads) if text.startswith("speedup"))
    said = " ".join(heads[speedup : speedup + 2])
    assert "against baseline.dtype float32 -> bfloat16" in said and "baseline.decoding" not in said
    lossless = next(i for i, t in enumerate(heads) if t.startswith("lossless"))
    assert "true -> false" in heads[lossless] and heads[lossless + 1] == "on its path: (1) param compute.target_dtype"
    assert heads[-2] == "the same: tau, final loss"
    assert not any(word in text for _, text in lines for word in ("balance", "floor", "contract", "bound_by"))
    # floor (2), contract (3: exact, bugs, departures) and balance (4 busy figures) behind --all, counted
    assert lines[-1][0] == FOOTER and "9 more metrics that differ" in lines[-1][1]
    assert all(INDENT[level] + len(text) <= WIDTH for level, text in lines) and len(lines) <= 25


def test_one_thread_variable_is_one_cause_of_the_machine_and_a_removed_fact_is_named(dag):
    """OMP_NUM_THREADS moves two fingerprint keys (the variable, and torch's intra-op count that follows it): one
    cause on the first screen, with the stages of both. A fact the machine no longer has (a library uninstalled)
    is said to be removed, not crashed on."""
    from dflashpipe.commands.explain import Machine, Report, answer_lines
    from dflashpipe.commands.explain.answer import answer
    from dflashpipe.commands.explain.machine import (
        Live,
        attribute_to_machine,
        fingerprint_changes,
        with_live_fingerprint,
    )

    recorded = json.loads((ROOT / "data/env/fingerprint.json").read_text())
    recorded["threads"] = {"torch_intra_op": 2, "torch_inter_op": 2, "env": {}, "affinity": "0-1", "cpu_quota": "none"}
    now = json.loads(json.dumps(recorded))
    now["threads"]["env"], now["threads"]["torch_intra_op"] = {"OMP_NUM_THREADS": "1"}, 1
    del now["triton"]  # uninstalled: the fingerprint of this machine has no such group
    live = Live(Machine(True, fingerprint_changes(recorded, now), [], [], "full check"), now)
    lock = lock_of(dag, values=fingerprint_values(dag, recorded))
    workspace = with_live_fingerprint(read_revision_state(LockState("workspace", dag, lock)), live, {})
    found = compare(read_revision_state(LockState("HEAD", dag, lock)), workspace, {}, None, "HEAD", "workspace")
    attribute_to_machine(found, live)
    report = Report("HEAD", "workspace", root_causes(found), found, [], live.machine)
    causes = [text for level, text in answer_lines(answer(report)) if " machine " in text]
    assert causes == [
        "(1) machine threads: env: OMP_NUM_THREADS unset -> 1; torch_intra_op: 2 -> 1",
        f"(2) machine triton.version: {recorded['triton']['version']} -> removed  [dvc.lock@HEAD vs this machine]",
    ]
    assert set(verdicts(report)[s] for s in naming("threads.torch_intra_op") + naming("triton.version")) == {
        StageVerdict.DIRECT
    }


def test_a_stage_rerun_by_no_cause_says_why_on_the_first_screen(dag):
    """bench forced beside a busy neighbour: no input changed, but its metrics file has new timings, and
    evaluate reads it. The first screen names no cause, and says what makes evaluate rerun."""
    from dflashpipe.commands.explain import Report, answer, answer_lines
    from dflashpipe.commands.explain.render import DETAIL, ITEM

    found = compared(dag, lock_of(dag), lock_of(dag, {"metrics/bench.json": "md5(new timings)"}))
    report = Report("HEAD", "new", root_causes(found), found, [])
    lines = answer_lines(answer(report))
    assert (ITEM, "nothing: every stage's recorded inputs are the same") in lines
    downstream = [stage for stage, verdict in verdict_map(found).items() if verdict == StageVerdict.DOWNSTREAM]
    assert downstream[0] == "evaluate"  # and what reads its outputs (the served check)
    rerun = lines.index((ITEM, f"invalidated: {', '.join(downstream)}"))
    assert lines[rerun + 1] == (DETAIL, "evaluate <- metrics/bench.json (bench: unchanged)")


def test_a_live_machine_cause_is_blamed_for_no_recorded_figure(dag):
    """OMP_NUM_THREADS set in this shell is what the next `dvc repro` runs with; the figures both sides recorded
    were measured with what their dvc.lock entries say. So it invalidates stages but moves no recorded metric, and
    a rate that fell with the control is still the machine's."""
    from dflashpipe.commands.explain import Machine, NoiseCall, metric_deltas
    from dflashpipe.commands.explain.machine import (
        Live,
        attribute_to_machine,
        fingerprint_changes,
        with_live_fingerprint,
    )

    recorded = json.loads((ROOT / "data/env/fingerprint.json").read_text())
    recorded["threads"] = {"torch_intra_op": 2, "torch_inter_op": 2, "env": {}, "affinity": "0-1", "cpu_quota": "none"}
    now = json.loads(json.dumps(recorded))
    now["threads"]["env"] = {"OMP_NUM_THREADS": "1"}
    live = Live(Machine(True, fingerprint_changes(recorded, now), [], [], "full check"), now)
    quiet = {"low": 50.0, "high": 53.0, "repeats": 5, "machine": controlled(1.95, 0.4, 3.0, 3.2)}
    loaded = {"low": 15.0, "high": 17.0, "repeats": 5, "machine": controlled(0.7, 3.9, 9.5, 10.1)}
    lock = lock_of(dag, values=fingerprint_values(dag, recorded))
    sa, sb = MetricsState("HEAD", dag, lock, train_metrics(52.0, quiet)), MetricsState("ws", dag, lock, {})
    sb._metrics = train_metrics(16.0, loaded)
    workspace = with_live_fingerprint(read_revision_state(sb), live, {})
    found = compare(read_revision_state(sa), workspace, {}, None, "HEAD", "workspace")
    attribute_to_machine(found, live)
    assert {c.kind for c in root_causes(found)} == {"machine"}
    (m,) = (d for d in metric_deltas(sa, sb, workspace, found) if d.key == "tokens_per_s")
    assert (m.call, m.causes) == (NoiseCall.MACHINE, [])


def slowed_train(dag, **report_fields):
    """The data grown and the compile package edited, train's rate fallen beyond its control, the loss moved: two
    causes on the rate's path, (1) upstream of (2) in the DAG. train's record of its run is in its detail file."""
    quiet = {"low": 50.0, "high": 53.0, "repeats": 5, "machine": controlled(1.95, 0.4, 3.0, 3.2)}
    slow = {"low": 15.0, "high": 17.0, "repeats": 5, "machine": controlled(1.9, 0.5, 3.1, 3.2)}
    run = {
        "compile": {
            "source": "artifact",
            "warmup_s": 41.234,
            "new_graphs_in_workers": 1,
            "replicas": {"0": {"recompiles_in_thread": 0}, "1": {"recompiles_in_thread": 2}},
        },
        "busy_s": {"target": 1.04, "drafter": 498.539},
    }
    old, new = headline_metrics(52.0, quiet, 9.70), headline_metrics(16.0, slow, 9.71)
    new["metrics/detail/train.json"] = run
    edited = {"src/dflashpipe/compile": "md5(edited)"} | {
        p: f"new md5({p})" for p in ("data/manifest", "data/regenerated", "data/tokens", "data/drafter")
    }
    return answer_of(
        dag,
        (lock_of(dag, values={"data.num_samples": 2000}), old),
        (lock_of(dag, edited, {"data.num_samples": 2400}), new),
        **report_fields,
    )


def headline_block(lines, label: str) -> list[str]:
    """A headline's line and the detail lines under it, a wrapped detail joined back into one."""
    from dflashpipe.commands.explain.render import DETAIL

    start = next(i for i, (_, text) in enumerate(lines) if text.startswith(label))
    block = [lines[start][1]]
    for level, text in lines[start + 1 :]:
        if level != DETAIL:
            break
        if text.startswith(("on its path:", "by measured effect:", "not verified:", "new ran:", "workspace ran:")):
            block.append(text)
        else:
            block[-1] += f" {text}"
    return block


def test_a_moved_headline_lists_the_causes_on_its_path_in_dag_order_and_how_to_verify_them(dag):
    """Without --verify, no effect is measured: the causes on the rate's path go under it in the order of the
    Causes, and the line after gives the exact command that would measure them (B named only when it is not the
    workspace, --verify's default)."""
    from dflashpipe.commands.explain.answer import answer
    from dflashpipe.commands.explain.render import INDENT, WIDTH, answer_lines

    report, lines = slowed_train(dag)
    causes = [text for _, text in lines if text.startswith("(")]
    assert causes[0].startswith("(1) param data.num_samples") and causes[1].startswith("(2) dep src/dflashpipe/compile")
    block = headline_block(lines, "train tokens/s")
    assert block[0].startswith("train tokens/s  52 -> 16 (-69%)") and " change" in block[0]
    assert block[1:3] == [
        "on its path: (1) param data.num_samples, (2) dep src/dflashpipe/compile",
        "not verified: dflashpipe explain HEAD new --verify metrics/train/metrics.json:tokens_per_s",
    ]
    assert all(INDENT[level] + len(text) <= WIDTH for level, text in lines) and len(lines) <= 25
    report.b = "workspace"
    block = headline_block(answer_lines(answer(report)), "train tokens/s")
    assert block[2] == "not verified: dflashpipe explain HEAD --verify metrics/train/metrics.json:tokens_per_s"


def test_a_rate_headline_carries_the_later_runs_own_record_of_how_it_ran(dag):
    """Beside train's rate, one line of what train recorded of its run: where its kernels came from, the warm-up's
    seconds, what compiled while timed, the recompiles, each side's busy time. A record without those facts (the
    loss's line, or a run that recorded none) says nothing of them."""
    from dflashpipe.commands.explain import Report
    from dflashpipe.commands.explain.answer import answer
    from dflashpipe.commands.explain.render import answer_lines

    report, lines = slowed_train(dag)
    (rate,) = (m for m in report.metrics if m.key == "tokens_per_s")
    assert rate.ran["compile.source"] == "artifact" and rate.ran["busy_s.drafter"] == 498.539
    assert headline_block(lines, "train tokens/s")[3] == (
        "new ran: kernels from the compile cache; warm-up 41.2 s; 1 graph, 2 recompiles while timed; "
        "busy target 1.04 s, drafter 499 s"
    )
    assert not any(" ran:" in text for text in headline_block(lines, "final loss"))
    # bench's record: a cold compile, nothing compiled while timed, no sides to split
    rate.file, rate.ran = (
        "metrics/bench.json",
        {"compile_source": "cold compile: no report", "graphs_compiled_while_timed": 0},
    )
    bench = Report(report.a, report.b, report.root_causes, report.stages, [rate])
    block = headline_block(answer_lines(answer(bench)), "train-step tokens/s")
    assert block[-1] == "new ran: kernels compiled here; no compiles while timed"
    rate.ran = {}
    assert not any(" ran:" in text for _, text in answer_lines(answer(bench)))


def test_measured_effects_rank_a_headlines_causes_and_replace_the_call_to_verify(dag):
    """What --verify measured (the fraction of the way back to A that reverting each cause alone went) ranks the
    causes under the rate by its size, against their DAG order, each with its effect; the rate's `not verified`
    line goes. A cause is named as the first screen names it or by the root cause --verify reverted; a headline
    nothing was measured for keeps its call to verify."""
    from dflashpipe.commands.explain.answer import answer
    from dflashpipe.commands.explain.render import answer_lines

    report, _ = slowed_train(dag)
    measured = {"param data.num_samples": 0.04, "src/dflashpipe/compile": -0.91}
    lines = answer_lines(answer(report, {"metrics/train/metrics.json:tokens_per_s": measured}))
    block = headline_block(lines, "train tokens/s")
    assert block[1] == (
        "by measured effect: (2) dep src/dflashpipe/compile -91% measured, (1) param data.num_samples +4% measured"
    )
    assert not any(text.startswith("not verified") for text in block)
    assert any(text.startswith("not verified") for text in headline_block(lines, "final loss"))
    # a cause on the path with no measurement (over the budget, or not revertible here) is last, said to be so
    lines = answer_lines(answer(report, {"metrics/train/metrics.json:tokens_per_s": {"param data.num_samples": 0.04}}))
    assert headline_block(lines, "train tokens/s")[1] == (
        "by measured effect: (1) param data.num_samples +4% measured, (2) dep src/dflashpipe/compile not measured"
    )

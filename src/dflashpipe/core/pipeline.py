"""The pipeline as dvc.yaml declares it: where each stage's outputs live, and what decides them.

One definition of what decides an output. DVC reruns a stage when anything under its
`deps` or any of its `params` changed; a stage that reuses earlier work (tokenize's shards,
warmup's compile artifact, train's resume checkpoint) must reuse it on exactly the same
condition, or an edit that makes DVC rerun the stage would hand back the old output, and
`dvc.lock` would record it as the new one. So a reuse key is never a hand-kept list of files:
`stage_key(stage)` reads the stage's entry in dvc.yaml and hashes every file under each
dep (as DVC does, minus what .dvcignore ignores) and the value of each param, from
params.yaml or from the params file an earlier stage wrote (the fingerprint). A caller
may leave out a dep or a param only by naming it, with its reason (tokenize keys each
shard by its own input shard, not by the whole manifest).

The output paths are defined once here; `tests/test_pipeline.py` checks them against dvc.yaml.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.core.artifacts import canonical_json, file_sha256
from dflashpipe.core.errors import DflashpipeError, SourceError

DVC_FILE = "dvc.yaml"
PARAMS_FILE = "params.yaml"

# Every stage output, by the stage that writes it (tests/test_pipeline.py holds these to dvc.yaml).
FINGERPRINT = Path("data/env/fingerprint.json")
TARGET = Path("data/target")
MANIFEST = Path("data/manifest")
REGENERATED = Path("data/regenerated")
TOKENS = Path("data/tokens")
FEATURES = Path("data/features")
COMPILE = Path("data/compile")
DRAFTER = Path("data/drafter")
TRAIN_STATE = Path("data/train-state")
METRICS = Path("metrics")
DETAIL = METRICS / "detail"
MANIFEST_METRICS = METRICS / "manifest.json"
REGENERATE_METRICS = METRICS / "regenerate.json"
TOKENIZE_METRICS = METRICS / "tokenize.json"
FEATURES_METRICS = METRICS / "features.json"
TRAIN_METRICS_DIR = METRICS / "train"
TRAIN_METRICS = TRAIN_METRICS_DIR / "metrics.json"
EVAL_METRICS = METRICS / "eval.json"
EVAL_DETAIL = DETAIL / "eval.json"
EVAL_PROMPTS = Path("data/eval/prompts.json")
BENCH_METRICS = METRICS / "bench.json"
SERVE_METRICS = METRICS / "serve.json"
SERVE_DETAIL = DETAIL / "serve.json"
PROOF_METRICS = METRICS / "proof.json"
REGRESSION_METRICS = METRICS / "eval_regression.json"
GATE_METRICS = METRICS / "gate.json"

MISSING = "missing"
ALLOW_OUTSIDE_PROJECT = "DFLASHPIPE_ALLOW_OUTSIDE_PROJECT"


class PipelineError(DflashpipeError):
    """dvc.yaml does not declare what the code asks of it."""


@dataclass(frozen=True)
class StageSpec:
    """One stage of dvc.yaml: its deps, its params as (params file, key) pairs, and its outputs (`outs`: every
    kind; `metrics` and `plots` those declared as such, `plots` with their options)."""

    name: str
    deps: tuple[str, ...]
    params: tuple[tuple[str, str], ...]
    outs: tuple[str, ...]
    metrics: tuple[str, ...] = ()
    plots: tuple[tuple[str, dict], ...] = ()
    cmd: str | None = None
    frozen: bool = False
    always_changed: bool = False

    @property
    def plain_outs(self) -> tuple[str, ...]:
        """The outs declared under `outs:` (neither metrics nor plots)."""
        declared = {*self.metrics, *(path for path, _ in self.plots)}
        return tuple(o for o in self.outs if o not in declared)

    @property
    def params_by_file(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for file, key in self.params:
            found.setdefault(file, []).append(key)
        return found


class Pipeline:
    """The stages of one dvc.yaml (the workspace's, or any revision's), in its order, and the DAG they draw:
    a stage reads another's output when one of its deps is that output or lies under it."""

    def __init__(self, stages: Mapping[str, Any], where: str = DVC_FILE) -> None:
        self.where = where
        self.specs = {name: spec_of(name, entry or {}) for name, entry in (stages or {}).items()}

    @classmethod
    def of(cls, doc: Any, where: str = DVC_FILE) -> Pipeline:
        """The pipeline of a parsed dvc.yaml document (None: an empty one)."""
        return cls((doc or {}).get("stages", {}) or {}, where)

    @classmethod
    def read(cls, root: Path | str = ".") -> Pipeline:
        """The workspace's pipeline: dvc.yaml under `root`."""
        return cls.of(read_dvc_yaml(root), str(Path(root) / DVC_FILE))

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def spec(self, name: str) -> StageSpec:
        if name not in self.specs:
            raise PipelineError(f"{self.where}: no stage {name!r}; stages: {sorted(self.specs)}")
        return self.specs[name]

    def upstream(self) -> dict[str, list[str]]:
        """For each stage, the stages whose outputs it takes as file deps, sorted."""
        return upstream_of({n: s.deps for n, s in self.specs.items()}, {n: s.outs for n, s in self.specs.items()})


def lies_under(path: str, out: str) -> bool:
    """Whether `path` is the output `out` or a file inside it (a dep on one file of a directory output, a file
    git lists under a directory dep): DVC's own reading of a path against an output."""
    return path == out or path.startswith(out.rstrip("/") + "/")


def dag(deps: Mapping[str, Iterable[str]], outs: Mapping[str, Iterable[str]]):
    """The stage graph (networkx.DiGraph, an edge producer -> consumer) from each stage's dep and out paths."""
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(deps)
    producers = {out: name for name, paths in outs.items() for out in paths}
    for name, paths in deps.items():
        for dep in paths:
            for out, producer in producers.items():
                if producer != name and lies_under(dep, out):
                    graph.add_edge(producer, name)
    return graph


def upstream_of(deps: Mapping[str, Iterable[str]], outs: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
    """For each stage (named in `deps`), the stages whose outputs it takes as file deps, sorted."""
    graph = dag(deps, outs)
    return {name: sorted(graph.predecessors(name)) for name in deps}


def upstream_first(names: Iterable[str], ups: Mapping[str, list[str]]) -> list[str]:
    """`names` ordered so that each comes after its `ups` (depth first, in the given order otherwise)."""
    import networkx as nx

    names = list(names)
    graph = nx.DiGraph()
    for name in names:
        graph.add_node(name)
        graph.add_edges_from((name, u) for u in ups.get(name, []))
    order: dict[str, None] = {}
    for name in names:
        if name not in order:
            order.update((n, None) for n in nx.dfs_postorder_nodes(graph, name) if n not in order)
    return list(order)


def read_dvc_yaml(root: Path | str = ".") -> dict[str, Any]:
    path = Path(root) / DVC_FILE
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise PipelineError(f"{path} not found: run from the project root") from None
    except yaml.YAMLError as exc:
        raise PipelineError(f"{path}: not valid YAML: {exc}") from None


def stage_spec(name: str, root: Path | str = ".") -> StageSpec:
    return Pipeline.read(root).spec(name)


def spec_of(name: str, entry: dict[str, Any]) -> StageSpec:
    """A stage's spec from its dvc.yaml entry (any revision's: `dflashpipe history` reads old ones)."""
    params: list[tuple[str, str]] = []
    for item in entry.get("params", []) or []:
        if isinstance(item, str):
            params.append((PARAMS_FILE, item))
        else:
            params += [(file, key) for file, keys in item.items() for key in keys or []]
    kinds = ("outs", "metrics", "plots")
    declared = {kind: [_path_and_options(o) for o in entry.get(kind, []) or []] for kind in kinds}
    deps = [next(iter(d)) if isinstance(d, dict) else d for d in entry.get("deps", []) or []]
    return StageSpec(
        name,
        tuple(deps),
        tuple(params),
        tuple(path for kind in kinds for path, _ in declared[kind]),
        metrics=tuple(path for path, _ in declared["metrics"]),
        plots=tuple(declared["plots"]),
        cmd=entry.get("cmd"),
        frozen=bool(entry.get("frozen")),
        always_changed=bool(entry.get("always_changed")),
    )


def _path_and_options(item: str | dict) -> tuple[str, dict]:
    """An output as dvc.yaml writes it (`path` or `{path: {options}}`) as (path, options)."""
    if isinstance(item, dict):
        path = next(iter(item))
        return path, item[path] or {}
    return item, {}


@dataclass(frozen=True)
class StageKey:
    """What decides a stage's output, input by input: `dep:<file>` -> sha256, `param:<file>:<key>` -> value.

    Two keys are equal exactly when DVC would see the same deps and params."""

    stage: str
    inputs: Mapping[str, str]

    @property
    def digest(self) -> str:
        return hashlib.sha256(canonical_json({"stage": self.stage, "inputs": dict(self.inputs)})).hexdigest()

    def changed_since(self, recorded: Mapping[str, str]) -> list[str]:
        """The inputs that differ from `recorded` (an earlier key's inputs), named for a message."""
        names = sorted(set(self.inputs) | set(recorded))
        return [name.split(":", 1)[1] for name in names if self.inputs.get(name) != recorded.get(name)]

    def changes_since(self, recorded: StageKey, shown: int) -> str:
        """What differs from `recorded`, in one line: `a.py, params.yaml:x and 2 more changed` ("" if nothing)."""
        if recorded.digest == self.digest:
            return ""
        if recorded.stage != self.stage:
            return f"stage {recorded.stage!r}'s key, not {self.stage!r}'s"
        changed = self.changed_since(recorded.inputs)
        more = f" and {len(changed) - shown} more" if len(changed) > shown else ""
        return f"{', '.join(changed[:shown])}{more} changed"

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "digest": self.digest, "inputs": dict(self.inputs)}

    @classmethod
    def from_json(cls, raw: Any) -> StageKey | None:
        """A key recorded by `to_json`, or None if `raw` is not one (an older or damaged record)."""
        try:
            return cls(str(raw["stage"]), {str(k): str(v) for k, v in raw["inputs"].items()})
        except (KeyError, TypeError, AttributeError):
            return None


@dataclass(frozen=True)
class Reuse:
    """A stage that reuses earlier work, and what its key leaves out of dvc.yaml's list, with why."""

    without_deps: tuple[str, ...] = ()
    without_params: tuple[str, ...] = ()
    why: str = ""


REUSE = {
    "manifest": Reuse(
        ("data/sources",),
        ("data.num_samples", "data.sources"),
        "each source is its own stream, keyed by its own spec (summary.json) and checked against the bytes of "
        "its files it read; num_samples only says where each stream is cut, so growing keeps and resumes them",
    ),
    "regenerate": Reuse(
        ("data/manifest", "src/dflashpipe/core/spread.py", "src/dflashpipe/core/threads.py"),
        ("regenerate.endpoints", "regenerate.endpoint_model", "regenerate.concurrency", "regenerate.devices"),
        "each shard's key adds its own input shard's sha256, so growing the manifest reuses the replies "
        "already generated; spread and threads only time and place the work; which servers or devices answer, "
        "how many, and how many requests are in flight never decide a reply (an endpoint gets one prompt a "
        "request, a device whole shards): what does, the engine, its version, the model it serves and the "
        "device type and dtype, is in each shard's record and checked (regenerate.run.SameGenerator)",
    ),
    "tokenize": Reuse(
        ("data/regenerated",),
        ("tokenize.num_proc",),
        "each shard's key adds its own input shard's sha256, so growing the manifest reuses the "
        "shards it already had; num_proc never changes a byte",
    ),
    "features": Reuse(
        ("data/tokens",),
        (
            "model.block_size",
            "model.num_anchors",
            "model.gamma",
            "model.attention",
            "model.mask_token",
            "model.final_norm",
            "model.final_norm_scale",
            "model.init",
            "model.distill",
            "model.distill_weight",
            "topology.drafter_devices",
            "topology.allow_shared_devices",
        ),
        "each shard's key adds its own token shard's sha256, so growing the data computes only the new shards; "
        "the target's hidden states depend on the layers chosen (model.layers, target_layers, target_layer_ids) "
        "and the length cut (model.seq_len), never on the drafter's other settings, which come with the model "
        "section (a distilling drafter is refused offline before anything is computed)",
    ),
    "warmup": Reuse(why="train and bench use the compile artifact only if it was built for this key"),
    "train": Reuse(
        (),
        (
            "train.max_steps",
            "train.epochs",
            "train.checkpoint_every",
            "train.checkpoint_minutes",
            "train.prefetch",
            "train.heldout_every",
            "compile.guard",
            "topology.allow_shared_devices",
        ),
        "a checkpoint in data/train-state is resumed only if it was saved under this key: what moves the weights. "
        "The run's length is checked step by step against the schedule instead (train/checkpoint.py), so a longer "
        "run continues a shorter one; the checkpoint cadences, prefetch (how far the target threads run ahead), "
        "the held-out cadence (forward passes after the update, no gradient), the guard (raise or warn on a "
        "recompile) and allow_shared_devices (a check) never change a weight",
    ),
}
"""Every reuse in the pipeline. tests/test_stage_keys.py edits each dep and param of each of these
stages and checks the key moves exactly when it must."""


def reuse_key(name: str, root: Path | str = ".") -> StageKey:
    """The key under which stage `name` may reuse earlier work (see REUSE)."""
    rule = REUSE[name]
    return stage_key(name, root, without_deps=rule.without_deps, without_params=rule.without_params)


def stage_key(
    name: str, root: Path | str = ".", *, without_deps: Iterable[str] = (), without_params: Iterable[str] = ()
) -> StageKey:
    """Hash what dvc.yaml lists for stage `name`, paths relative to `root`.

    `without_deps` / `without_params` leave out deps (as written in dvc.yaml) and params keys;
    each must be declared, so a renamed dep cannot quietly fall out of the key."""
    root = Path(root)
    spec = stage_spec(name, root)
    without_deps, without_params = set(without_deps), set(without_params)
    unknown = sorted((without_deps - set(spec.deps)) | (without_params - {k for _, k in spec.params}))
    if unknown:
        raise PipelineError(f"{root / DVC_FILE}: stage {name!r} declares no dep or param {unknown}")
    ignore = dvcignore(root)
    inputs: dict[str, str] = {}
    for dep in spec.deps:
        if dep not in without_deps:
            inputs.update(_dep_digests(root, dep, ignore))
    files: dict[str, Any] = {}
    for file, key in spec.params:
        if key in without_params:
            continue
        if file not in files:
            files[file] = _read_params_file(root / file)
        inputs[f"param:{file}:{key}"] = _param_value(files[file], key)
    return StageKey(name, inputs)


RACY_NS = 2_000_000_000
"""A digest is reused only for a file whose last change (mtime, ctime) is this much older than when it was
hashed: a file written just before or while it was hashed could change again within one tick of the
filesystem's clock keeping its size (git's "racily clean" rule). 2 s covers the coarsest clocks (FAT, HFS+)."""

_DIGESTS: dict[str, tuple[tuple[int, ...], int, str]] = {}
"""absolute path -> (stat signature, when hashed (ns), sha256), for this process: a stage takes its key at its
start, again inside its body (reuse_key) and at its end (stage.run_stage), and hashes each file once."""


def _file_digest(path: Path) -> str:
    """file_sha256(path), re-read only when the file's inode, size, mtime or ctime moved since this process
    hashed it, or when it changed within RACY_NS of that hashing (then its stat could hide an edit)."""
    st = os.stat(path)
    signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    known = _DIGESTS.get(str(path))
    if known is not None and known[0] == signature and max(st.st_mtime_ns, st.st_ctime_ns) < known[1] - RACY_NS:
        return known[2]
    hashed_at = time.time_ns()
    digest = file_sha256(path)
    _DIGESTS[str(path)] = (signature, hashed_at, digest)
    return digest


def _dep_digests(root: Path, dep: str, ignore) -> dict[str, str]:
    path = root / dep
    if path.is_file():
        return {f"dep:{dep}": _file_digest(path.absolute())}
    if not path.is_dir():
        return {f"dep:{dep}": MISSING}
    digests = {}
    for file in sorted(path.rglob("*")):
        rel = file.relative_to(root).as_posix()
        if file.is_file() and not (ignore and ignore.match_file(rel)):
            digests[f"dep:{rel}"] = _file_digest(file.absolute())
    return digests or {f"dep:{dep}": "empty"}


def dvcignore(root: Path):
    """DVC leaves what .dvcignore matches out of a directory's hash (e.g. __pycache__); so does the key."""
    import pathspec

    path = root / ".dvcignore"
    lines = path.read_text().splitlines() if path.is_file() else []
    return pathspec.PathSpec.from_lines("gitignore", lines) if lines else None


def _read_params_file(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise PipelineError(f"{path}: unreadable ({exc}); run the stage that writes it") from None


def _param_value(params: Any, key: str) -> str:
    node = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return canonical_json(node).decode().strip()


def project_path(root: Path | str, relative: str, key: str) -> Path:
    """`relative` (a params value at `key`) resolved against the project root, symlinks followed.

    A path that lands outside the project (`../`, an absolute path, a link out) is refused unless
    DFLASHPIPE_ALLOW_OUTSIDE_PROJECT=1: DVC tracks only files inside the project, so an outside
    source could change unseen, and a shared params.yaml could point a stage at any file.
    """
    root = Path(root).resolve()
    path = (root / relative).resolve()
    if path.is_relative_to(root) or os.environ.get(ALLOW_OUTSIDE_PROJECT) == "1":
        return path
    raise SourceError(
        f"params.yaml: {key} = {relative!r} resolves to {path}, outside the project {root}: copy it into the "
        f"project (data/ for data, then `dvc add` it), or set {ALLOW_OUTSIDE_PROJECT}=1 to allow paths outside "
        f"(DVC then cannot see when that file changes)"
    )

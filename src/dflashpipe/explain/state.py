"""Reading one state of the pipeline: a git revision, a DVC experiment, or the workspace.

A revision's state is what its dvc.yaml and dvc.lock recorded, read through git with the workspace
untouched; the workspace's is what DVC computes from the files on disk now (DVC's own hashing, through its
Python API). Stages come from dvc.yaml, so a new stage needs no change here.

Invariant: this is the only module of the package that reads files, git, DVC or its cache. Every value it
returns carries its evidence (`StageState.where`), and what it cannot read is None, never a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.errors import DflashpipeError
from dflashpipe.evaluate.regression import resolve_revision
from dflashpipe.explain.report import StageState

WORKSPACE = "workspace"
PARAMS_FILE = "params.yaml"


class State:
    """Files of one state: a git revision (read through git, the workspace untouched) or the workspace."""

    def __init__(self, repo, name: str) -> None:
        self.repo, self.name = repo, name
        if name == WORKSPACE:
            self.rev, self.fs = None, None
        else:
            self.rev = resolve_revision(repo, name)
            self.fs = repo.scm.get_fs(self.rev)

    @property
    def label(self) -> str:
        return WORKSPACE if self.rev is None else self.name

    def read_text(self, path: str) -> str | None:
        try:
            if self.fs is None:
                return (Path(self.repo.root_dir) / path).read_text(encoding="utf-8")
            with self.fs.open(path, mode="r", encoding="utf-8") as fh:
                return fh.read()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def read_yaml(self, path: str) -> Any:
        text = self.read_text(path)
        return None if text is None else yaml.safe_load(text)


def _dvc_yaml_stages(state: State) -> dict[str, dict]:
    doc = state.read_yaml("dvc.yaml")
    if doc is None:
        raise DflashpipeError(f"no dvc.yaml at {state.label}")
    return doc.get("stages", {}) or {}


def _entry_path(entry: Any) -> str:
    return next(iter(entry)) if isinstance(entry, dict) else entry


def _declared(stage: dict) -> tuple[list[str], dict[str, list[str]], list[str], list[str]]:
    """deps, params by file, outs (all kinds), metrics of one dvc.yaml stage."""
    params: dict[str, list[str]] = {}
    for entry in stage.get("params", []) or []:
        if isinstance(entry, str):
            params.setdefault(PARAMS_FILE, []).append(entry)
        else:
            for file, keys in entry.items():
                params.setdefault(file, []).extend(keys or [])
    outs = [_entry_path(o) for kind in ("outs", "metrics", "plots") for o in stage.get(kind, []) or []]
    metrics = [_entry_path(o) for o in stage.get("metrics", []) or []]
    return [_entry_path(d) for d in stage.get("deps", []) or []], params, outs, metrics


def _lock_hash(entry: dict) -> str | None:
    return entry.get("md5")


def read_revision_state(state: State) -> dict[str, StageState]:
    stages = _dvc_yaml_stages(state)
    lock = (state.read_yaml("dvc.lock") or {}).get("stages", {})
    result = {}
    for name, definition in stages.items():
        deps, params, outs, metrics = _declared(definition)
        entry = lock.get(name)
        st = StageState(
            name,
            cmd=definition.get("cmd"),
            metrics=metrics,
            frozen=bool(definition.get("frozen")),
            always_changed=bool(definition.get("always_changed")),
            locked=entry is not None,
        )
        where = f"dvc.lock@{state.label}"
        if entry is not None:
            st.cmd = entry.get("cmd", st.cmd)
            for i, dep in enumerate(entry.get("deps", []) or []):
                st.deps[dep["path"]] = _lock_hash(dep)
                st.where[f"dep:{dep['path']}"] = f"{where} stages.{name}.deps[{i}].md5"
            for file, values in (entry.get("params", {}) or {}).items():
                st.params[file] = dict(values)
                for key in values:
                    st.where[f"param:{file}:{key}"] = f"{where} stages.{name}.params['{file}']['{key}']"
            for i, out in enumerate(entry.get("outs", []) or []):
                st.outs[out["path"]] = _lock_hash(out)
                st.where[f"out:{out['path']}"] = f"{where} stages.{name}.outs[{i}].md5"
        else:
            st.deps = {d: None for d in deps}
            st.params = {f: {k: None for k in keys} for f, keys in params.items()}
            st.outs = {o: None for o in outs}
        result[name] = st
    return result


def read_workspace_state(repo) -> tuple[dict[str, StageState], dict[str, dict[str, str | None]]]:
    """The workspace as DVC computes it now, and what the workspace's dvc.lock recorded for outs."""
    from dvc.dependency.param import ParamsDependency

    result, recorded_outs = {}, {}
    for stage in repo.index.stages:
        name = stage.name
        st = StageState(
            name,
            cmd=stage.cmd,
            frozen=stage.frozen,
            always_changed=stage.always_changed,
            metrics=[o.def_path for o in stage.outs if o.metric],
        )
        for dep in stage.deps:
            if isinstance(dep, ParamsDependency):
                values = dep.read_params()
                st.params[dep.def_path] = dict(values)
                for key in values:
                    st.where[f"param:{dep.def_path}:{key}"] = f"{dep.def_path} (workspace) {key}"
            else:
                st.deps[dep.def_path] = _hash_now(dep)
                st.where[f"dep:{dep.def_path}"] = f"md5 of {dep.def_path} in the workspace (computed by DVC)"
        recorded_outs[name] = {}
        for out in stage.outs:
            st.outs[out.def_path] = _hash_now(out)
            recorded_outs[name][out.def_path] = out.hash_info.value if out.hash_info else None
            st.where[f"out:{out.def_path}"] = f"md5 of {out.def_path} in the workspace (computed by DVC)"
        result[name] = st
    return result, recorded_outs


def _hash_now(item) -> str | None:
    try:
        if not item.exists:
            return None
        return item.get_hash().value
    except Exception:  # unreadable or vanished while hashing: report as missing, never guess
        return None


def in_cache(cache, md5: str) -> bool:
    """Whether the DVC cache holds object `md5` (for a directory, every file it lists)."""
    path = Path(cache.oid_to_path(md5))
    if not path.is_file():
        return False
    if md5.endswith(".dir"):
        entries = json.loads(path.read_text())
        return all(Path(cache.oid_to_path(e["md5"])).is_file() for e in entries)
    return True


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def read_metrics(state: State, path: str) -> dict[str, Any]:
    """A metrics file of `state`, flattened to dotted keys ({} when the state has no such file)."""
    text = state.read_text(path)
    if text is None:
        return {}
    return _flatten(json.loads(text) if path.endswith(".json") else yaml.safe_load(text))

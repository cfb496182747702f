"""Reading one state of the pipeline: a git revision, a DVC experiment, or the workspace.

A revision's state is what its dvc.yaml and dvc.lock recorded, read through the one revision reader
(dflashpipe.core.revision) with the workspace untouched; the workspace's is what DVC computes from the files on
disk now (DVC's own hashing, through its Python API). Stages come from dvc.yaml (dflashpipe.core.pipeline's
model of it), so a new stage needs no change here.

Invariant: with dflashpipe.core.revision, this is the only module of the package that reads files, git, DVC or
its cache. Every value it returns carries its evidence (`StageState.where`), and what it cannot read is
None, never a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashpipe.commands.explain.records import Cause, StageState
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.pipeline import DVC_FILE, FINGERPRINT, PARAMS_FILE, Pipeline, lies_under
from dflashpipe.core.revision import Revision, Workspace, changed_in_git

State = Revision | Workspace
"""The files of one state: a commit's (read through git) or the workspace's."""


class LocalCache:
    """DVC 3's local cache layout (`<cache>/files/md5/xx/yyyy`), enough to read `.dir` listings without
    constructing a dvc Repo (1.5 s of imports and setup: most of history's time budget)."""

    def __init__(self, root: str | Path) -> None:
        self.dir = Path(root) / ".dvc" / "cache"
        for config in (".dvc/config", ".dvc/config.local"):
            self.dir = _configured_cache_dir(Path(root), config) or self.dir

    def oid_to_path(self, md5: str) -> str:
        return str(self.dir / "files" / "md5" / md5[:2] / md5[2:])


def _configured_cache_dir(root: Path, config: str) -> Path | None:
    import configparser

    parser = configparser.ConfigParser()
    try:
        parser.read(root / config)
    except configparser.Error:
        return None
    value = parser.get("cache", "dir", fallback=None)
    return None if value is None else ((root / ".dvc") / value).resolve()


def _pipeline(state: State) -> Pipeline:
    doc = state.read_yaml("dvc.yaml")
    if doc is None:
        raise DflashpipeError(f"no dvc.yaml at {state.label}")
    return Pipeline.of(doc, f"dvc.yaml@{state.label}")


def read_revision_state(state: State) -> dict[str, StageState]:
    lock = (state.read_yaml("dvc.lock") or {}).get("stages", {})
    result = {}
    for name, spec in _pipeline(state).specs.items():
        entry = lock.get(name)
        st = StageState(
            name,
            cmd=spec.cmd,
            metrics=list(spec.metrics),
            frozen=spec.frozen,
            always_changed=spec.always_changed,
            locked=entry is not None,
        )
        if entry is not None:
            _read_lock_entry(st, entry, f"dvc.lock@{state.label}")
        else:
            st.deps = {d: None for d in spec.deps}
            st.params = {f: {k: None for k in keys} for f, keys in spec.params_by_file.items()}
            st.outs = {o: None for o in spec.outs}
        result[name] = st
    return result


def _read_lock_entry(st: StageState, entry: dict, where: str) -> None:
    """Fill `st` with what its dvc.lock entry recorded: cmd, each dep's and out's md5, each param's value."""
    name = st.name
    st.cmd = entry.get("cmd", st.cmd)
    for i, dep in enumerate(entry.get("deps", []) or []):
        st.deps[dep["path"]] = dep.get("md5")
        st.where[f"dep:{dep['path']}"] = f"{where} stages.{name}.deps[{i}].md5"
    for file, values in (entry.get("params", {}) or {}).items():
        st.params[file] = dict(values)
        for key in values:
            st.where[f"param:{file}:{key}"] = f"{where} stages.{name}.params['{file}']['{key}']"
    for i, out in enumerate(entry.get("outs", []) or []):
        st.outs[out["path"]] = out.get("md5")
        st.where[f"out:{out['path']}"] = f"{where} stages.{name}.outs[{i}].md5"


def read_workspace_state(repo) -> tuple[dict[str, StageState], dict[str, dict[str, str | None]]]:
    """The workspace as DVC computes it now, and what the workspace's dvc.lock recorded for outs."""
    from dvc.dependency.param import ParamsDependency

    result, recorded_outs, params_files = {}, {}, {}
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
                values = _read_params(dep, params_files)
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


def _read_params(dep, files: dict[str, Any]) -> dict[str, Any]:
    """What DVC's `dep.read_params()` returns, with each params file parsed once (by DVC's own loader) instead
    of once per stage: ruamel parsing params.yaml eight times was a third of explain's time."""
    import dpath
    from dvc.utils.serialize import ParseError, load_path

    if dep.fs_path not in files:
        try:
            files[dep.fs_path] = load_path(dep.fs_path, dep.repo.fs) if dep.exists and not dep.isdir() else None
        except ParseError as exc:
            raise DflashpipeError(f"{dep.def_path} (workspace): unreadable params file ({exc})") from None
    config = files[dep.fs_path]
    if config is None:
        return {}
    values = {}
    for key in dep.params or list(config):
        try:
            values[key] = dpath.get(config, key, separator=".")
        except KeyError:  # a missing key is absent, as DVC reports it
            continue
    return values


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


def dir_listing(cache, md5: str | None) -> dict[str, str] | None:
    """relpath -> md5 of a directory object `md5` (`...dir`) from the cache, None when the cache lacks it."""
    if cache is None or not md5 or not md5.endswith(".dir"):
        return None
    try:
        entries = json.loads(Path(cache.oid_to_path(md5)).read_text())
    except (OSError, ValueError):
        return None
    return {e["relpath"]: e.get("md5") for e in entries if isinstance(e, dict) and "relpath" in e}


def cached_json(cache, md5: str | None) -> Any:
    """A JSON file's content from the DVC cache by its md5 (a file inside a directory output), None if absent."""
    if cache is None or not md5:
        return None
    try:
        return json.loads(Path(cache.oid_to_path(md5)).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def as_committed(root: Path, sa: State, sb: State, causes: list[Cause]) -> list[str]:
    """The causes (their `what`) whose input git holds alike on both sides, though the earlier side's dvc.lock
    recorded another version: a code dep, params.yaml's keys or dvc.yaml's commands committed at `sa` without a
    `dvc repro` after. Not a change between the sides, but the earlier record's age. Inputs git does not hold
    (DVC's data) and the fingerprint's keys (the machine's) are never listed."""
    if not isinstance(sa, Revision):
        return []
    path = {c.what: c.what for c in causes if c.kind == "dep"}
    path |= {c.what: PARAMS_FILE for c in causes if c.kind == "param" and c.what.startswith(f"{PARAMS_FILE}:")}
    path |= {c.what: DVC_FILE for c in causes if c.kind == "cmd"}
    paths = sorted(set(path.values()))
    changed = changed_in_git(root, sa.rev, sb.rev, paths)
    if changed is None:
        return []
    alike = {p for p in paths if p != str(FINGERPRINT) and not any(lies_under(f, p) for f in changed)}
    return [what for what, p in path.items() if p in alike]

"""Reading one state of the pipeline: a git revision, a DVC experiment, or the workspace.

A revision's state is what its dvc.yaml and dvc.lock recorded, read through git with the workspace
untouched; the workspace's is what DVC computes from the files on disk now (DVC's own hashing, through its
Python API). Stages come from dvc.yaml, so a new stage needs no change here.

Invariant: this is the only module of the package that reads files, git, DVC or its cache. Every value it
returns carries its evidence (`StageState.where`), and what it cannot read is None, never a guess.
"""

from __future__ import annotations

import difflib
import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.errors import DflashpipeError
from dflashpipe.evaluate.regression import resolve_revision
from dflashpipe.explain.report import StageState
from dflashpipe.pipeline import spec_of

WORKSPACE = "workspace"
CONFLICT_MARKERS = ("<<<<<<< ", "=======", ">>>>>>> ")
EXPS_NAMESPACE = "refs/exps/"


def parse_yaml(text: str, where: str) -> Any:
    """YAML through libyaml when present (history parses a dvc.lock per distinct blob: 8x faster than pure Python).

    A file holding git's merge conflict markers is named as such: its YAML error would not say why."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(CONFLICT_MARKERS):
            raise DflashpipeError(
                f"{where}: unresolved merge conflict (line {number}: {line.strip()[:20]!r}); resolve it, "
                "e.g. `git checkout --theirs dvc.lock && dvc repro`, then run this again"
            )
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as exc:
        raise DflashpipeError(f"{where}: not valid YAML: {' '.join(str(exc).split())}") from None


def known_refs(root: str | Path) -> list[str]:
    """Branch, tag and DVC experiment names of the repository: what a revision argument can name."""
    proc = subprocess.run(
        ["git", "for-each-ref", "--format=%(refname)"], cwd=root, capture_output=True, text=True, check=False
    )
    names = []
    for ref in proc.stdout.split():
        for prefix in ("refs/heads/", "refs/tags/"):
            if ref.startswith(prefix):
                names.append(ref[len(prefix) :])
        if ref.startswith(EXPS_NAMESPACE) and ref.count("/") == 4:
            names.append(ref.rsplit("/", 1)[1])  # refs/exps/<sha[:2]>/<sha[2:]>/<name>: what `dvc exp list` shows
    return sorted(set(names))


def unknown_revision(name: str, root: str | Path) -> DflashpipeError:
    refs = known_refs(root)
    near = difflib.get_close_matches(name, refs, n=5, cutoff=0.5)
    known = f"nearby refs: {', '.join(near)}" if near else f"known refs: {', '.join(refs[:10]) or 'none'}"
    return DflashpipeError(f"{name!r} is neither a git revision nor a DVC experiment (see `dvc exp list`); {known}")


def resolve(root: str | Path, name: str) -> str:
    """A git revision, or a DVC experiment's name, to a commit sha, through git alone (no dvc Repo: its imports
    take most of a second). An experiment is found by its ref, `refs/exps/<sha[:2]>/<sha[2:]>/<name>`."""
    proc = subprocess.run(
        ["git", "rev-parse", "--verify", "-q", f"{name}^{{commit}}"], cwd=root, capture_output=True, text=True
    )
    if proc.returncode == 0:
        return proc.stdout.strip()
    refs = subprocess.run(
        ["git", "for-each-ref", "--format=%(objectname) %(refname)", EXPS_NAMESPACE],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.splitlines()
    found = sorted(
        {sha for sha, ref in (r.split(" ", 1) for r in refs) if ref.count("/") == 4 and ref.endswith("/" + name)}
    )
    if len(found) > 1:
        raise DflashpipeError(
            f"{name!r} names {len(found)} DVC experiments (commits {', '.join(found)}): give one's sha"
        )
    if not found:
        raise unknown_revision(name, root)
    return found[0]


class State:
    """Files of one state: a git revision (read through git, the workspace untouched) or the workspace."""

    def __init__(self, repo, name: str) -> None:
        self.repo, self.name = repo, name
        if name == WORKSPACE:
            self.rev, self.fs = None, None
        else:
            try:
                self.rev = resolve_revision(repo, name)
            except DflashpipeError:
                raise unknown_revision(name, repo.root_dir) from None
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
        return None if text is None else parse_yaml(text, f"{path}@{self.label}")


class GitObjects:
    """Files of many commits through one `git cat-file --batch` process: history reads ~3 files per commit,
    and a process (or a dulwich tree walk) per read would dominate its time. Parsed YAML is kept per blob."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._proc = subprocess.Popen(
            ["git", "cat-file", "--batch"], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._yaml: dict[bytes, Any] = {}
        self._read: dict[tuple[str, str], tuple[bytes, bytes] | None] = {}

    def read(self, rev: str, path: str) -> tuple[bytes, bytes] | None:
        """(blob id, content) of `path` at `rev`, or None when the commit has no such file. Each (rev, path) is
        asked of git once: a step reads the same metrics file for every key, and again as the next's parent."""
        if (rev, path) in self._read:
            return self._read[rev, path]
        self._proc.stdin.write(f"{rev}:{path}\n".encode())
        self._proc.stdin.flush()
        header = self._proc.stdout.readline().split()
        found = None
        if len(header) == 3:  # else "<object> missing"
            blob, kind, size = header
            data = self._proc.stdout.read(int(size) + 1)[:-1]
            found = (blob, data) if kind == b"blob" else None
        self._read[rev, path] = found
        return found

    def yaml(self, rev: str, path: str, where: str) -> Any:
        found = self.read(rev, path)
        if found is None:
            return None
        if found[0] not in self._yaml:
            self._yaml[found[0]] = parse_yaml(found[1].decode("utf-8"), where)
        return self._yaml[found[0]]

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait()

    def __enter__(self) -> GitObjects:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Commit:
    """One commit's files, as `State` reads a revision, through a shared GitObjects."""

    def __init__(self, objects: GitObjects, rev: str, label: str) -> None:
        self.objects, self.rev, self.name, self.label = objects, rev, label, label

    def read_text(self, path: str) -> str | None:
        found = self.objects.read(self.rev, path)
        return None if found is None else found[1].decode("utf-8")

    def read_yaml(self, path: str) -> Any:
        return self.objects.yaml(self.rev, path, f"{path}@{self.label}")


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


def _dvc_yaml_stages(state: State) -> dict[str, dict]:
    doc = state.read_yaml("dvc.yaml")
    if doc is None:
        raise DflashpipeError(f"no dvc.yaml at {state.label}")
    return doc.get("stages", {}) or {}


def _declared(name: str, stage: dict) -> tuple[list[str], dict[str, list[str]], list[str], list[str]]:
    """deps, params by file, outs (all kinds), metrics of one dvc.yaml stage (read as the stage keys read it)."""
    spec = spec_of(name, stage)
    params: dict[str, list[str]] = {}
    for file, key in spec.params:
        params.setdefault(file, []).append(key)
    metrics = [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("metrics", []) or []]
    return list(spec.deps), params, list(spec.outs), metrics


def _lock_hash(entry: dict) -> str | None:
    return entry.get("md5")


def read_revision_state(state: State) -> dict[str, StageState]:
    stages = _dvc_yaml_stages(state)
    lock = (state.read_yaml("dvc.lock") or {}).get("stages", {})
    result = {}
    for name, definition in stages.items():
        deps, params, outs, metrics = _declared(name, definition)
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
    if not path.endswith(".json"):
        return _flatten(parse_yaml(text, f"{path}@{state.label}"))
    try:
        return _flatten(json.loads(text))
    except ValueError as exc:
        raise DflashpipeError(f"{path}@{state.label}: not valid JSON ({exc})") from None

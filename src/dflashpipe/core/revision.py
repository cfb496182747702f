"""The one reader of git revisions: resolving a name to a commit, and reading a commit's files and metrics.

Every module that asks git something asks it here (explain, history, verify, report, the regression check),
so a revision means the same thing everywhere: a git revision, or a DVC experiment's name found by its ref
(`refs/exps/<sha[:2]>/<sha[2:]>/<name>`, what `dvc exp list` shows). No dvc Repo is built: its imports take
most of a second, and git alone answers all of this.

Files of many commits are read through one `git cat-file --batch` process (`Revisions`): history reads ~3
files per commit, and a process per read would dominate its time. A commit's files (`Revision`) and the
workspace's (`Workspace`) are read alike: `label`, `read_text`, `read_yaml`, and `read_metrics` over them.
"""

from __future__ import annotations

import difflib
import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.core.errors import DflashpipeError

WORKSPACE = "workspace"
EXPS_NAMESPACE = "refs/exps/"
CONFLICT_MARKERS = ("<<<<<<< ", "=======", ">>>>>>> ")


def run_git(root: str | Path, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    """git `args` in `root`, its output as bytes, whatever its exit status: for callers that test that status."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True, input=input, check=False)


def git(root: str | Path, *args: str) -> str:
    """git `args` in `root`, its stdout; a failure is one line naming the command and git's last word."""
    proc = run_git(root, *args)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise DflashpipeError(f"git {' '.join(args)}: {err[-1] if err else ''}")
    return proc.stdout.decode()


def commit_of(root: str | Path, rev: str) -> str | None:
    """The commit sha `rev` names, None when it names none (or `root` is no repository)."""
    proc = run_git(root, "rev-parse", "--verify", "-q", f"{rev}^{{commit}}")
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


def is_repository(root: str | Path) -> bool:
    return run_git(root, "rev-parse", "--git-dir").returncode == 0


def no_commit_reason(root: str | Path) -> str | None:
    """Why `root` has no HEAD commit to read ("not a git repository", ...), None when it has one."""
    if not is_repository(root):
        return "not a git repository"
    return None if commit_of(root, "HEAD") else "the repository has no commit yet"


def has_file(root: str | Path, rev: str, path: str) -> bool:
    """Whether commit `rev` holds `path`."""
    return run_git(root, "cat-file", "-e", f"{rev}:{path}").returncode == 0


def changed_in_git(root: str | Path, a: str, b: str | None, paths: list[str]) -> list[str] | None:
    """The files under `paths` that git holds otherwise at revision `a` than at `b` (None: the working tree, with
    its untracked files), and the `paths` it ignores (DVC's data, which git does not hold); None when git cannot
    say (`a` is no revision)."""
    if not paths:
        return []
    diff = run_git(root, "diff", "--name-only", "--no-renames", a, *([b] if b else []), "--", *paths)
    if diff.returncode != 0:
        return None
    found = diff.stdout.decode().splitlines()
    if b is None:
        found += git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).splitlines()
    # exit status 1: none ignored
    return found + run_git(root, "check-ignore", "--", *paths).stdout.decode().splitlines()


def experiment_refs(root: str | Path) -> list[tuple[str, str]]:
    """(commit sha, ref) of every ref under refs/exps/ (DVC's experiments, and its stashes and temp refs)."""
    lines = git(root, "for-each-ref", "--format=%(objectname) %(refname)", EXPS_NAMESPACE).splitlines()
    return [tuple(line.split(" ", 1)) for line in lines if line]


def known_refs(root: str | Path) -> list[str]:
    """Branch, tag and DVC experiment names of the repository: what a revision argument can name."""
    names = []
    for ref in run_git(root, "for-each-ref", "--format=%(refname)").stdout.decode().split():
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
    """A git revision, or a DVC experiment's name, to a commit sha; an unknown name is one line with nearby refs."""
    found = commit_of(root, name)
    if found is not None:
        return found
    if not is_repository(root):
        raise DflashpipeError(f"{Path(root).resolve()}: not a git repository, so {name!r} names no revision")
    shas = sorted({sha for sha, ref in experiment_refs(root) if ref.count("/") == 4 and ref.endswith("/" + name)})
    if len(shas) > 1:
        raise DflashpipeError(f"{name!r} names {len(shas)} DVC experiments (commits {', '.join(shas)}): give one's sha")
    if not shas:
        raise unknown_revision(name, root)
    return shas[0]


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


class Revisions:
    """Files of many commits of the repository at `root` through one `git cat-file --batch` process.
    Parsed YAML is kept per blob, and each (commit, path) is asked of git once."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._proc = subprocess.Popen(
            ["git", "cat-file", "--batch"], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._yaml: dict[bytes, Any] = {}
        self._read: dict[tuple[str, str], tuple[bytes, bytes] | None] = {}

    def at(self, name: str, label: str | None = None) -> Revision:
        """The files of the commit `name` resolves to (see `resolve`), labelled `label` (default: `name`)."""
        return Revision(self, resolve(self.root, name), label or name)

    def read(self, rev: str, path: str) -> tuple[bytes, bytes] | None:
        """(blob id, content) of `path` at commit `rev`, or None when the commit has no such file."""
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

    def __enter__(self) -> Revisions:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Revision:
    """One commit's files, read through a shared `Revisions`; `rev` is its sha, `label` how it is named."""

    def __init__(self, revisions: Revisions, rev: str, label: str) -> None:
        self.revisions, self.rev, self.name, self.label = revisions, rev, label, label

    def read_text(self, path: str) -> str | None:
        found = self.revisions.read(self.rev, path)
        return None if found is None else found[1].decode("utf-8")

    def read_yaml(self, path: str) -> Any:
        return self.revisions.yaml(self.rev, path, f"{path}@{self.label}")


class Workspace:
    """The files on disk under `root`, read as a `Revision`'s are."""

    rev = None

    def __init__(self, root: str | Path, label: str = WORKSPACE) -> None:
        self.root, self.name, self.label = Path(root), label, label

    def read_text(self, path: str) -> str | None:
        try:
            return (self.root / path).read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError):
            return None

    def read_yaml(self, path: str) -> Any:
        text = self.read_text(path)
        return None if text is None else parse_yaml(text, f"{path}@{self.label}")


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """A nested metrics document as dotted keys: {"a": {"b": 1}} -> {"a.b": 1}."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def read_json(files, path: str) -> Any:
    """A JSON file of `files` (a Revision or Workspace), None when it has no such file."""
    text = files.read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise DflashpipeError(f"{path}@{files.label}: not valid JSON ({exc})") from None


def read_metrics(files, path: str) -> dict[str, Any]:
    """A metrics file of `files` (anything with `label` and `read_text`), flattened to dotted keys ({} when
    there is no such file)."""
    if not path.endswith(".json"):
        text = files.read_text(path)
        return {} if text is None else flatten(parse_yaml(text, f"{path}@{files.label}"))
    found = read_json(files, path)
    return {} if found is None else flatten(found)

"""One scratch tree: a commit of the project checked out beside it, where DVC runs without touching the workspace.

A `git worktree` of the commit (no copy of the history), whose DVC cache is the project's own (`cache.dir` in its
`.dvc/config.local`) with outputs linked from it rather than copied: a probe of the real pipeline would otherwise
copy the target's weights and every shard (DVC removes a linked output before it reruns the stage, and copies a
`persist` one first). What a run computes goes into that shared cache, the run cache included, so a stage any tree
ever computed is restored, never recomputed. `dvc` runs as a subprocess of this interpreter, its stages' `python`
this interpreter too: the tree's code is what runs, and nothing of this process (its directory, its file
descriptors, its imported torch) leaks into a stage.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflashpipe.commands.explain.comparison import is_throughput
from dflashpipe.commands.explain.history import Measured
from dflashpipe.core import spread
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import read_metrics
from dflashpipe.core.revision import Workspace, git, run_git

LINKED = "reflink,hardlink,symlink,copy"
"""DVC's cache types, best first: an output is linked from the shared cache where the filesystem allows."""


class RunFailed(DflashpipeError):
    """A `dvc` command failed in a scratch tree; the message is its last line of output."""


def dvc(
    cwd: Path, *args: str, python: Path | None = None, variables: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """`dvc ARGS` in `cwd` with `python` (default: this interpreter), whose directory comes first on PATH (the
    stages' `python`), and this process's environment with `variables` set (None: unset)."""
    python = python or Path(sys.executable)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for name, value in (variables or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return subprocess.run([str(python), "-m", "dvc", *args], cwd=cwd, env=env, capture_output=True, text=True)


def shared_cache(root: Path) -> Path:
    """The project's DVC cache directory, as DVC resolves it (its config files, global and system ones too)."""
    asked = dvc(root, "cache", "dir")
    if asked.returncode != 0 or not asked.stdout.strip():
        raise DflashpipeError(f"{root}: `dvc cache dir` failed: {(asked.stderr or asked.stdout).strip()[-200:]}")
    return Path(asked.stdout.strip())


class ScratchTree:
    """`with ScratchTree(root, rev, path, cache) as tree:` the commit `rev` of project `root` at `path`, sharing
    the DVC cache `cache`; removed (and pruned from git's list) on leaving, whatever happened inside."""

    def __init__(self, root: Path, rev: str, path: Path, cache: Path) -> None:
        self.root, self.rev, self.path, self.cache = root, rev, path, cache
        self.stages_run = 0
        """Stages `dvc repro` ran here so far (0: every output came from the cache or the commit's record)."""
        self.python: Path | None = None
        """The interpreter `dvc` and the stages run with here (None: this one); a pristine environment's for an
        arm that reverts installed packages."""
        self.variables: dict[str, str | None] = {}
        """Environment variables set (None: unset) for every `dvc` run here: an arm that reverts a variable."""

    def __enter__(self) -> ScratchTree:
        git(self.root, "worktree", "add", "--detach", "--quiet", str(self.path), self.rev)
        # written, not `dvc config`d: the file is the tree's own (git ignores it), and a dvc process costs ~1 s
        config = self.path / ".dvc" / "config.local"
        config.write_text(f"[cache]\n    dir = {self.cache}\n    type = {LINKED}\n", encoding="utf-8")
        return self

    def __exit__(self, *exc) -> None:
        run_git(self.root, "worktree", "remove", "--force", str(self.path))
        run_git(self.root, "worktree", "prune")

    def dvc(self, *args: str) -> str:
        """Run `dvc ARGS` here; its standard output, or RunFailed naming the command and its last line."""
        proc = dvc(self.path, *args, python=self.python, variables=self.variables)
        if proc.returncode != 0:
            last = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
            last = [line for line in last if ": error: " in line] or last  # a stage's own one line says why
            raise RunFailed(f"dvc {' '.join(args)} failed: {last[-1][:300] if last else f'exit {proc.returncode}'}")
        return proc.stdout

    def repro(self, *args: str) -> None:
        """`dvc repro ARGS`, counting the stages it ran."""
        self.stages_run += self.dvc("repro", *args).count("Running stage '")

    def figure(self, file: str, key: str) -> Measured | None:
        """`key` of metrics file `file` as this tree holds it now, with its spread and control."""
        return Measured.of(read_metrics(Workspace(self.path, f"tree {self.path.name}"), file), key)


def pooled(key: str, runs: list[Measured]) -> Measured:
    """Repeated runs of `key` as one figure (`spread.pool`). A timed figure recorded without a spread counts as
    one repeat of its value; any other figure is deterministic, so its runs agree and the last one stands."""
    if len(runs) == 1:
        return runs[0]
    timed = is_throughput(key, {}, {})
    if all(r.spread is not None for r in runs) or (timed and all(json_number(r.value) is not None for r in runs)):
        spreads = [r.spread or spread.Spread.of([json_number(r.value)]) for r in runs]
        figure, control = spread.pool(spreads, [r.control for r in runs])
        return Measured(figure.median, figure, control)
    return runs[-1]

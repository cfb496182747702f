"""A pristine environment: the project's own lock installed afresh, so that an arm reverts the machine's packages.

An edited file of the installed torch, a swapped torch build or any other locked package moved on the machine is
reverted by running the arm's stages with another interpreter: a virtual environment holding exactly the lock
files bin/setup installs (`LOCKS`) as they are at a revision, installed by the uv bin/setup installed, offline
from uv's cache and hardlinked from it, not copied, so that it takes seconds (uv copies where the cache lies on
another filesystem), with the arm's own tree importable as `dflashpipe` (the `.pth` file an editable install
writes).

Invariant: nothing written through one environment reaches another. A hardlinked file *is* uv's cached copy, so:
- .venv is installed by copy (bin/setup): an edit there, in place or not, never reaches the cache;
- a file inside a hardlinked environment (tests edit one) is edited by replacement, a new file renamed over it,
  never written in place, which would edit the cache and every environment linked from it. Python writes its
  bytecode that way too;
- `build(check=...)` hashes the files the caller names (those the machine check found edited) against their
  wheel's RECORD, and refuses an environment whose cache holds an edited copy.

No `--compile-bytecode`: compiling every module of every package is most of a build's time, and a stage imports
a small part of them; `environ` lets each module a process imports be compiled once, by the first process to
import it, into the environment's own `__pycache__`.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.core.env import WHEELS, distribution_integrity
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.revision import Revisions, Workspace

LOCKS = ("requirements/cpu.lock", "requirements/nodeps.lock")
"""What bin/setup installs into .venv: every package hashed, every dependency listed (no resolution)."""


@dataclass
class Pristine:
    python: Path
    """dest/bin/python: the interpreter an arm's `dvc` and stages run with."""
    seconds: float
    """How long the build took."""
    locks: list[str]
    """The lock files installed, as the project names them (`LOCKS`)."""

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) for a process of this environment: its bin first on PATH
        (a stage's `python`), VIRTUAL_ENV naming it, no PYTHONPATH (which would import another tree's code or
        packages), and bytecode written, so that only the first process compiles what it imports
        (PYTHONDONTWRITEBYTECODE, set on some machines, would make every process compile it)."""
        base = os.environ if base is None else base
        env = {k: v for k, v in base.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
        bin_dir = self.python.parent
        env["PATH"] = os.pathsep.join(filter(None, [str(bin_dir), base.get("PATH")]))  # never an empty entry: "."
        env["VIRTUAL_ENV"] = str(bin_dir.parent)
        return env


def build(
    root: Path, rev: str | None, dest: Path, code: Path, check: Mapping[str, list[str]] | None = None
) -> Pristine:
    """A pristine environment at `dest` (a new directory) holding `LOCKS` as they are at revision `rev` of project
    `root` (None: its working tree), with `code/src` importable as `dflashpipe`. `check`: distribution -> files
    (RECORD's paths) that must match their RECORD there. Any failure is one line and leaves no `dest`."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        raise DflashpipeError(f"no uv beside {sys.executable}: bin/setup installs it (requirements/uv.lock)")
    if dest.exists():
        raise DflashpipeError(f"{dest} already exists: a pristine environment is built into a new directory")
    if not (code / "src" / "dflashpipe").is_dir():
        raise DflashpipeError(f"{code} holds no src/dflashpipe: not a tree of this project")
    locks, label = _read_locks(root, rev)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="pristine-locks-") as tmp:
            files = []
            for path, text in locks.items():
                files += ["-r", str(Path(tmp) / Path(path).name)]
                Path(files[-1]).write_text(text, encoding="utf-8")
            _uv(uv, "venv", "--quiet", "--python", sys.executable, str(dest))
            python = str(dest / "bin" / "python")
            install = ["--no-deps", "--require-hashes", "--link-mode", "hardlink", "--quiet", *files]
            _uv(uv, "pip", "install", "--python", python, *install, locks=locks, label=label)
        site = Path(sysconfig.get_path("purelib", "venv", vars={"base": str(dest), "platbase": str(dest)}))
        (site / "dflashpipe.pth").write_text(f"{code.resolve() / 'src'}\n", encoding="utf-8")
        for name, paths in (check or {}).items():
            _check_cached(uv, site, name, paths)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return Pristine(dest / "bin" / "python", time.perf_counter() - start, list(locks))


def pinned(root: Path, rev: str | None) -> set[str]:
    """The distributions `LOCKS` pin at `rev` (normalised names): what a pristine environment of it reverts; none
    where a lock is missing there (no pristine environment of that revision)."""
    try:
        locks, _ = _read_locks(root, rev)
    except DflashpipeError:
        return set()
    lines = (line.strip() for text in locks.values() for line in text.splitlines())
    return {line.split("==", 1)[0].lower().replace("_", "-") for line in lines if "==" in line and line[0] not in "#-"}


def _read_locks(root: Path, rev: str | None) -> tuple[dict[str, str], str]:
    """`LOCKS`' texts at `rev` (None: the working tree), and how that revision is named in messages."""
    if rev is None:
        files = Workspace(root)
        locks = {path: files.read_text(path) for path in LOCKS}
    else:
        with Revisions(root) as revisions:
            files = revisions.at(rev)
            locks = {path: files.read_text(path) for path in LOCKS}
    for path, text in locks.items():
        if text is None:
            raise DflashpipeError(f"{path}@{files.label}: no such file, so no pristine environment of that revision")
    return locks, files.label


def _uv(uv: Path, *args: str, locks: Mapping[str, str | None] | None = None, label: str = "") -> None:
    """Run uv offline, finding wheels where bin/setup has it find them; a failure is one line, and a package the
    cache lacks is named with the lock that pins it."""
    links = os.environ.get("UV_FIND_LINKS") or os.environ.get("PIP_FIND_LINKS") or str(WHEELS)
    env = {**os.environ, "UV_FIND_LINKS": links}
    proc = subprocess.run([str(uv), "--offline", *args], env=env, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return
    # "Network connectivity is disabled, but ... wasn't found in the cache" names `pkg==version`; so does "no
    # version of pkg==version" when the cache and the find-links hold no such version at all
    pin = re.search(r"([A-Za-z0-9][\w.-]*==[\w.+!-]*\w)", proc.stderr)
    lock = pin and next((p for p, t in (locks or {}).items() if _pins(t, pin.group(1))), None)
    if lock:
        raise DflashpipeError(
            f"{lock}@{label}: {pin.group(1)} is not in uv's cache, and a pristine environment is built offline: "
            "install that lock once online (bin/setup at that revision) to cache it"
        )
    last = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    raise DflashpipeError(f"uv {args[0]} failed: {last[-1] if last else f'exit {proc.returncode}'}")


def _pins(lock: str, pin: str) -> bool:
    return any(line.split(" ", 1)[0].lower() == pin.lower() for line in lock.splitlines())


def _check_cached(uv: Path, site: Path, name: str, paths: list[str]) -> None:
    """Refuse when a named file of distribution `name` differs from its RECORD here: uv's cache, which it is
    linked or copied from, holds the edit."""
    dist = next(iter(metadata.distributions(name=name, path=[str(site)])), None)
    if dist is None:
        raise DflashpipeError(f"{name} is not in the lock, so no pristine copy of {', '.join(paths)} is checked")
    found = distribution_integrity(dist, only=set(paths))
    if found.checked < len(set(paths)):  # a path RECORD does not list: nothing to check it against
        listed = {str(f) for f in dist.files or []}
        unlisted = sorted(p for p in set(paths) if p not in listed)
        raise DflashpipeError(f"{name}'s RECORD lists no {', '.join(unlisted)}: give paths as RECORD names them")
    bad = [*found.edited, *found.missing]
    if bad:
        cache = subprocess.run([str(uv), "cache", "dir"], capture_output=True, text=True).stdout.strip()
        raise DflashpipeError(
            f"uv's cache ({cache}) holds {name} with {', '.join(bad)} unlike its RECORD: "
            f"run `{uv} cache clean {name}` and build again"
        )

"""What the reliability tests share: a stage started in its own process group and killed at a
point found by watching the files it writes, the project's outputs as bytes, and DVC's record."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from dflashpipe.artifacts import PARTIAL
from tests.conftest import run


def user_env() -> dict[str, str]:
    """The environment `tests.conftest.run` gives a command."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "HF_HUB_OFFLINE": "1"}


def start(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """Start `cmd` as a user would, in a new session: its process group holds DVC and the stage."""
    with open(log, "wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=cwd, env=user_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL DVC and everything it started, at once, as a power cut or OOM kill would."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_at(cmd: list[str], cwd: Path, log: Path, point: str, reached: Callable[[int], bool],
            timeout: float = 120.0) -> None:
    """Run `cmd` and SIGKILL its whole group the moment `reached(process group id)` holds.

    Fails if the command ends first: a kill point that was never hit proves nothing."""
    proc = start(cmd, cwd, log)
    deadline, hit = time.monotonic() + timeout, False
    while proc.poll() is None and time.monotonic() < deadline:
        if reached(proc.pid):
            hit = proc.poll() is None
            break
        time.sleep(0.001)
    kill_group(proc)
    assert hit, f"kill point {point!r} was not reached before {' '.join(cmd)} ended:\n{log.read_text()[-2000:]}"


def group_process(pgid: int, script: str) -> int | None:
    """The pid of a process in group `pgid` that runs `script` (an argument starting with it), if any.

    Matching whole arguments, not the command line, skips the shell DVC may wrap the stage in:
    without $SHELL, DVC runs `/bin/sh -c "python stages/x.py"`, and dash forks instead of exec'ing."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if os.getpgid(int(entry.name)) == pgid and any(arg.startswith(script) for arg in argv):
                return int(entry.name)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return None


def partials(parent: Path, name: str) -> list[Path]:
    """What an atomic write of `parent/name` leaves while it is under way (or after a kill)."""
    return sorted(parent.glob(f".{name}{PARTIAL}*"))


def tree_bytes(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or the file itself), by relative name."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def lock_outs(project: Path, stage: str) -> dict[str, str] | None:
    """The outputs dvc.lock records for `stage` (path -> md5), or None if it records none."""
    lock = project / "dvc.lock"
    if not lock.is_file():
        return None
    entry = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}).get(stage)
    return None if entry is None else {o["path"]: o["md5"] for o in entry.get("outs", [])}


def status(project: Path, *targets: str) -> dict:
    return json.loads(run(["dvc", "status", *targets, "--json"], project).stdout or "{}")


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()  # noqa: S324 - DVC's own content hash for a file

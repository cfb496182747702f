"""What the reliability tests share: a stage started in its own process group and killed at a
point found by watching the files it writes, the project's outputs as bytes, and DVC's record."""

from __future__ import annotations

import contextlib
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

from dflashpipe.core.artifacts import PARTIAL
from tests.conftest import run


def user_env() -> dict[str, str]:
    """The environment `tests.conftest.run` gives a command."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
    }


def start(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """Start `cmd` as a user would, in a new session: its process group holds DVC and the stage."""
    with open(log, "wb") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            cmd, cwd=cwd, env=user_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL DVC and everything it started, at once, as a power cut or OOM kill would."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_at(
    cmd: list[str], cwd: Path, log: Path, point: str, reached: Callable[[int], bool], timeout: float = 120.0
) -> None:
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


MEASURED = frozenset(
    {
        "seconds",
        "warmup_s",
        "busy_s",
        "target_busy_s",
        "drafter_busy_s",
        "tokens_per_s",
        "encoded_tokens_per_second",
        "decode_tokens_per_s",
        "speedup",
        "train_tokens_per_s",
        "train_step_tokens_per_s",
        "tokens_per_s_spread",
        "encoded_tokens_per_second_spread",
        "throughput",  # FLOP/s, MFU and the bounding side follow the measured times
        "balance",  # train: each side's busy time and rate over this process's steps (a resumed run: its own)
        "compiled_over_eager",
        "compiled_over_eager_spread",
        "regressions",
        "throughput_regressions",
        "within_noise",
        "worst",  # eval_regression: which timed figure moved most, and by how much
        "worst_change",
        "step_profile",  # evaluate: shares of a verify step's time, its cost in plain decode steps
    }
)
"""Keys (at any depth of a JSON output) and plot names whose values are measurements of time."""
TIMED_VERDICTS = ("metrics/eval_regression.json", "metrics/detail/eval_regression.json")
"""Files whose `verdict` judges timed figures (a throughput regression beyond noise): measured too."""

COMPILED_KERNELS = ("data/compile/inductor/", "data/train-state/inductor-cache/")
"""Inductor caches: the same cache keys from the same inputs, but not the same bytes (the C++ compiler's
output and the pickled graphs differ from run to run, and so do the names of graph cache entries)."""


def cache_key(name: str) -> str:
    """A file's identity across runs: its path, or for an FX/AOT graph cache entry, the key it sits under."""
    parts = name.split("/")
    return "/".join(parts[:-1]) if {"fxgraph", "aotautograd"} & set(parts) else name


def comparable(name: str, data: bytes):
    """What of an output file must be identical between two runs with the same inputs.

    The whole bytes, except: compiled kernels (their presence only), a files.json listing (the keys it
    lists: the files themselves are compared one by one), and in JSON and plot files the values that
    measure time."""
    if name.startswith(COMPILED_KERNELS):
        return "present"
    if name.endswith((".tsv", ".png")):  # a curve of a measured time is itself one; others must match
        return None if Path(name).stem in MEASURED else data
    if name.endswith(".json"):
        value = json.loads(data)
        if name.endswith("/files.json"):
            return sorted({cache_key(k) for k in value})
        return _without_measured(value, MEASURED | {"verdict"} if name.endswith(TIMED_VERDICTS) else MEASURED)
    return data


def comparable_outputs(files: dict[str, bytes]) -> dict:
    """`comparable` of every file, by `cache_key`: equal for two runs with the same inputs."""
    return {cache_key(name): comparable(name, data) for name, data in files.items()}


def _without_measured(value, measured: frozenset[str] = MEASURED):
    if isinstance(value, dict) and set(value) == {"stage", "digest", "inputs"}:
        return _recorded_key(value)
    if isinstance(value, dict):
        return {k: _without_measured(v, measured) for k, v in value.items() if k not in measured}
    if isinstance(value, list):
        return [_without_measured(v, measured) for v in value]
    return value


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()  # noqa: S324 - DVC's own content hash for a file


def _recorded_key(key: dict) -> dict:
    """A stage key recorded in an output (pipeline.StageKey.to_json): the same inputs, where an input that is
    a compiled kernel or the compile report (measured seconds) counts by its name only; the digest over
    them differs with those bytes, as DVC's record of them does."""
    kernels = tuple(f"dep:{prefix}" for prefix in ("data/compile/",))
    return {
        "stage": key["stage"],
        "inputs": {cache_key(k): (None if k.startswith(kernels) else v) for k, v in key["inputs"].items()},
    }

"""The compile-cache artifact that `warmup` writes and `train`/`evaluate` load.

What gives a warm start (measured, ../shared/DESIGN.md): on the CPU, the inductor
cache directory (FX/AOT graph caches *and* the compiled C++ kernels); the mega-cache
from `torch.compiler.save_cache_artifacts()` restores graph-cache hits but not the
kernels. On CUDA the mega-cache also carries Triton kernels, so both are kept there.

Layout of `data/compile/`:
- `inductor/`   the TORCHINDUCTOR_CACHE_DIR the warmup compiled into
- `mega.bin`    the mega-cache, on CUDA only
- `report.json` each compiled graph (name, shapes, dtype, backend, seconds), the dynamo
                counters, and the environment it is valid for
- `files.json`  sha256 and size of every file above: a truncated or bit-flipped artifact
                is caught before torch reads it

A consumer never writes into `data/compile/` (it is DVC's record of warmup's output):
the loader copies the cache into a work directory and points inductor there.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashpipe.artifacts import verify_file_listing, write_bytes_atomic, write_file_listing, write_json_atomic
from dflashpipe.errors import DflashpipeError

INDUCTOR_DIR = "inductor"
MEGA_CACHE = "mega.bin"
REPORT = "report.json"


class CompileArtifactError(DflashpipeError):
    """The compile artifact is missing, damaged, or was built for another environment."""


def point_inductor_at(cache_dir: Path | str) -> Path:
    """Make this process compile into (and read from) `cache_dir`. Call before the first compile."""
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    return cache_dir


def write_artifact(out: Path, cache_dir: Path, report: dict[str, Any], with_mega_cache: bool) -> None:
    """Fill `out` (an empty directory, e.g. from atomic_directory) with the artifact."""
    import torch

    shutil.copytree(cache_dir, out / INDUCTOR_DIR, ignore=shutil.ignore_patterns("*.lock", "*.tmp*"))
    if with_mega_cache:
        result = torch.compiler.save_cache_artifacts()
        if result is not None:
            write_bytes_atomic(out / MEGA_CACHE, result[0])
    write_json_atomic(out / REPORT, report)
    write_file_listing(out)


@dataclass
class LoadedArtifact:
    report: dict[str, Any]
    cache_dir: Path
    mega_cache: bool


def verify_artifact(path: Path) -> dict[str, Any]:
    """Check every file against files.json; return the report. Raise with the fix otherwise."""
    fix = f"restore it with `dvc checkout {path}` or rebuild it with `dvc repro -f warmup`"
    verify_file_listing(path, fix, CompileArtifactError)
    return json.loads((path / REPORT).read_text())


def environment_mismatch(report: dict[str, Any], environment: dict[str, Any]) -> list[str]:
    """The environment keys whose values differ from those the artifact was compiled under."""
    built = report.get("environment", {})
    return [f"{k}: {built.get(k)!r} -> {v!r}" for k, v in sorted(environment.items()) if built.get(k) != v]


def load_artifact(path: Path | str, workdir: Path | str, environment: dict[str, Any]) -> LoadedArtifact:
    """Verify the artifact, copy its cache into `workdir` and point inductor there.

    Raises CompileArtifactError when the artifact is damaged or from another environment;
    the caller decides whether to compile cold instead (and says so).
    """
    import torch

    path, workdir = Path(path), Path(workdir)
    report = verify_artifact(path)
    mismatch = environment_mismatch(report, environment)
    if mismatch:
        raise CompileArtifactError(
            f"{path} was compiled for another environment ({'; '.join(mismatch)}): `dvc repro warmup` rebuilds it")
    if workdir.exists():
        shutil.rmtree(workdir)
    shutil.copytree(path / INDUCTOR_DIR, workdir)
    point_inductor_at(workdir)
    mega = path / MEGA_CACHE
    if mega.is_file():
        torch.compiler.load_cache_artifacts(mega.read_bytes())
    return LoadedArtifact(report, workdir, mega.is_file())


def load_artifact_or_go_cold(path: Path | str, workdir: Path | str, environment: dict[str, Any]) -> str:
    """`load_artifact`, or when the artifact cannot be used, point inductor at an empty `workdir` so that
    the first call compiles cold. Returns where the kernels come from: "artifact", or "cold compile: why"."""
    try:
        load_artifact(path, workdir, environment)
        return "artifact"
    except CompileArtifactError as exc:
        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        point_inductor_at(workdir)
        return f"cold compile: {exc}"

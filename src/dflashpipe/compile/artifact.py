"""The compile-cache artifact that `warmup` writes and `train`/`evaluate` load.

What gives a warm start (measured, docs/design.md "Facts the code relies on"): on the CPU, the inductor
cache directory (FX/AOT graph caches *and* the compiled C++ kernels); the mega-cache
from `torch.compiler.save_cache_artifacts()` restores graph-cache hits but not the
kernels. On CUDA the mega-cache also carries Triton kernels, so both are kept there.

Layout of `data/compile/`:
- `inductor/`   the TORCHINDUCTOR_CACHE_DIR the warmup compiled into
- `mega.bin`    the mega-cache, on CUDA only
- `report.json` each compiled graph (name, shapes, dtype, backend, seconds), the dynamo
                counters, and `built_for`: warmup's stage key (pipeline.stage_key) when it ran
- `files.json`  sha256 and size of every file above: a truncated or bit-flipped artifact
                is caught before torch reads it

A consumer never writes into `data/compile/` (it is DVC's record of warmup's output):
the loader copies the cache into a work directory and points inductor there.

Whether an artifact fits is decided by one definition, warmup's entry in dvc.yaml: a consumer
passes warmup's stage key as it is now, and the loader uses the artifact only if it was built
for exactly that key. So whatever makes DVC rerun warmup (its code, the drafter's code and
shapes, the target, the kernel environment in the fingerprint) also stops train and evaluate
from loading the old kernels, and no hand-kept list of what matters can fall behind dvc.yaml.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dflashpipe.core.artifacts import verify_file_listing, write_bytes_atomic, write_file_listing, write_json_atomic
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.pipeline import StageKey

INDUCTOR_DIR = "inductor"
MEGA_CACHE = "mega.bin"
REPORT = "report.json"
BUILT_FOR = "built_for"
"""The report's record of warmup's stage key (StageKey.to_json) when the artifact was built."""
INTRA_OP_THREADS = "intra_op_threads"
"""The report's record of the count the step was compiled at (dflashpipe.core.threads): the kernels are bound to it."""
NAMED_CHANGES = 5
"""A refusal names at most this many changed inputs and counts the rest: one readable line."""


class CompileArtifactError(DflashpipeError):
    """The compile artifact is missing, damaged, or was built for other inputs than warmup's now."""


def point_inductor_at(cache_dir: Path | str) -> Path:
    """Make this process compile into (and read from) `cache_dir`. Call before the first compile."""
    cache_dir = Path(cache_dir).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
    return cache_dir


def built_for(key: StageKey | None) -> dict[str, Any] | None:
    """What the report records under BUILT_FOR: the key, or None (an artifact no loader will use)."""
    return key.to_json() if key is not None else None


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


def verify_artifact(path: Path) -> dict[str, Any]:
    """Check every file against files.json; return the report. Raise with the fix otherwise."""
    fix = f"restore it with `dvc checkout {path}` or rebuild it with `dvc repro -f warmup`"
    verify_file_listing(path, fix, CompileArtifactError)
    return json.loads((path / REPORT).read_text())


def check_built_for(path: Path, report: dict[str, Any], expected: StageKey | None) -> None:
    """Raise unless the artifact at `path` was built for `expected`, warmup's stage key as it is now."""
    if expected is None:
        # The caller could not compute warmup's key (no dvc.yaml to read): nothing says these kernels fit.
        raise CompileArtifactError(
            f"{path}: no warmup stage key to check it against, so it is not used "
            f"(run from the project root, where dvc.yaml is)"
        )
    recorded = StageKey.from_json(report.get(BUILT_FOR))
    if recorded is None:
        # Built before artifacts recorded their key, or by hand. DVC may still call warmup up to date: hence -f.
        raise CompileArtifactError(
            f"{path / REPORT} records no stage key it was built for, so it cannot be "
            f"checked: `dvc repro -f warmup` rebuilds it"
        )
    if recorded.digest != expected.digest:
        raise CompileArtifactError(
            f"{path} was built for other inputs ({expected.changes_since(recorded, NAMED_CHANGES)}): "
            f"`dvc repro warmup` rebuilds it"
        )


def load_artifact(path: Path | str, workdir: Path | str, expected: StageKey | None) -> None:
    """Verify the artifact, check it was built for `expected` (warmup's stage key now), copy its
    cache into `workdir` and point inductor there.

    Raises CompileArtifactError when the artifact is damaged, was built for other inputs, or
    cannot be checked; the caller decides whether to compile cold instead (and says so).
    """
    import torch

    path, workdir = Path(path), Path(workdir)
    report = verify_artifact(path)
    check_built_for(path, report, expected)
    compiled_at, now = report.get(INTRA_OP_THREADS), torch.get_num_threads()
    if compiled_at is not None and compiled_at != now:
        raise CompileArtifactError(
            f"{path} was compiled at {compiled_at} intra-op threads per drafter, this run uses {now} "
            f"(dflashpipe.core.threads: this process's cores over its workers): `dvc repro -f warmup` on this machine"
        )
    if workdir.exists():
        shutil.rmtree(workdir)
    shutil.copytree(path / INDUCTOR_DIR, workdir)
    point_inductor_at(workdir)
    mega = path / MEGA_CACHE
    if mega.is_file():
        torch.compiler.load_cache_artifacts(mega.read_bytes())


def load_artifact_or_go_cold(path: Path | str, workdir: Path | str, expected: StageKey | None) -> str:
    """`load_artifact`, or when the artifact cannot be used, point inductor at an empty `workdir` so that
    the first call compiles cold. Returns where the kernels come from: "artifact", or "cold compile: why"."""
    try:
        load_artifact(path, workdir, expected)
        return "artifact"
    except CompileArtifactError as exc:
        workdir = Path(workdir)
        if workdir.exists():
            shutil.rmtree(workdir)
        point_inductor_at(workdir)
        return f"cold compile: {exc}"

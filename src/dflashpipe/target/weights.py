"""Where the target's weights are: in data/target/, or in the user's own model directory, checked before each load.

A local Hugging Face directory whose safetensors already hold `target.dtype` is not copied: the target stage
writes data/target/ without weights (config, tokenizer, chat template, source.json) and records two things:
- in source.json (DVC-cached, what every downstream stage depends on): each weight file's sha256 and size, what
  the weights *are*;
- in data/target-weights.json (`cache: false`, this machine's): the directory (absolute outside the project) and each
  file's size, mtime_ns and sha256, *where* they are. Touching or moving the files reruns only the target stage (the
  fingerprint's `target_source.files`), which hashes them again: same bytes, same source.json, nothing downstream.

Every reader of the weights goes through `model_directory`: data/target/ itself when it holds them, else a
scratch directory of symlinks to data/target/'s files and the recorded weight files, after each file's size and
mtime are checked against the record (a stat, no hashing: only the target stage hashes).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from dflashpipe.core.artifacts import file_sha256, write_json_atomic
from dflashpipe.core.errors import SourceError

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
"""`target.dtype` as a safetensors header spells it."""
SOURCE_JSON = "source.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def weight_files(directory: Path) -> list[Path]:
    """A model directory's safetensors and their index, in name order."""
    return sorted(f for f in directory.iterdir() if f.is_file() and f.name.endswith((".safetensors", ".index.json")))


def stored_dtypes(directory: Path) -> set[str]:
    """The dtypes of the floating-point tensors in a directory's safetensors, read off their headers."""
    from safetensors import safe_open

    dtypes = set()
    for f in weight_files(directory):
        if f.suffix == ".safetensors":
            with safe_open(f, framework="pt") as opened:
                dtypes |= {opened.get_slice(k).get_dtype() for k in opened.keys()}  # noqa: SIM118 (not iterable)
    return {d for d in dtypes if d.startswith(("F", "BF"))}


def in_place(directory: Path, dtype: str) -> bool:
    """The weights can be used where they are: every floating tensor is stored in `dtype` already."""
    return stored_dtypes(directory) == {SAFETENSORS_DTYPES[dtype]}


def location_path(target_dir: Path | str) -> Path:
    """data/target-weights.json beside data/target/."""
    target_dir = Path(target_dir)
    return target_dir.with_name(f"{target_dir.name}-weights.json")


@dataclass(frozen=True)
class Recorded:
    """One weight file as the target stage hashed it."""

    sha256: str
    size: int
    mtime_ns: int


def record(directory: Path) -> dict[str, Recorded]:
    """Each weight file of `directory` hashed, with the stat the readers check it by."""
    out = {}
    for f in weight_files(directory):
        before = f.stat()
        digest = file_sha256(f)
        if f.stat().st_mtime_ns != before.st_mtime_ns:
            raise SourceError(f"{f}: changed while the target stage hashed it: rerun `dvc repro target`")
        out[f.name] = Recorded(digest, before.st_size, before.st_mtime_ns)
    return out


def identity(recorded: dict[str, Recorded]) -> dict[str, dict[str, Any]]:
    """What source.json keeps of the record: what the weights are, not where or when they were written."""
    return {name: {"sha256": r.sha256, "size": r.size} for name, r in recorded.items()}


def write_location(
    target_dir: Path | str, directory: Path | None, recorded: dict[str, Recorded], root: Path | str = "."
) -> None:
    """data/target-weights.json: where the weights are on this machine (`directory` None: in data/target/). A
    directory in the project is recorded relative to the file, so a copy of the project reads its own."""
    location = location_path(target_dir)
    where = directory and str(directory)
    if directory is not None and directory.is_relative_to(Path(root).resolve()):
        where = os.path.relpath(directory, location.parent.resolve())
    files = {name: {"sha256": r.sha256, "size": r.size, "mtime_ns": r.mtime_ns} for name, r in recorded.items()}
    write_json_atomic(location, {"directory": where, "files": files})


def weights_sha256(target_dir: Path | str) -> dict[str, str]:
    """Each weight file's sha256 (what a reuse key names the target's weights by): read off source.json when
    they live outside, hashed when data/target/ holds them."""
    target_dir = Path(target_dir)
    outside = _read(target_dir / SOURCE_JSON).get("weights")
    if outside:
        return {name: entry["sha256"] for name, entry in outside.items() if name.endswith(".safetensors")}
    return {f.name: file_sha256(f) for f in weight_files(target_dir) if f.suffix == ".safetensors"}


def model_directory(target_dir: Path | str) -> Path:
    """A directory `from_pretrained` (or an engine) loads the target from: data/target/ when it holds the weights,
    else one of symlinks to its files and the recorded weights, once each file's size and mtime match the record."""
    named, target_dir = target_dir, Path(target_dir).resolve()
    outside = _read(target_dir / SOURCE_JSON).get("weights")
    if not outside:
        return target_dir
    stale = f"the target's weights changed under {named}: run `dvc repro target`"
    location = _read(location_path(target_dir))
    files = location.get("files") or {}
    if {n: e["sha256"] for n, e in files.items()} != {n: e["sha256"] for n, e in outside.items()}:
        raise SourceError(f"{location_path(target_dir)} does not record these weights: {stale}")
    directory = location_path(target_dir).parent / location["directory"]  # an absolute one stays as it is
    for name, entry in files.items():
        try:
            seen = (directory / name).stat()
        except OSError:
            raise SourceError(f"{directory / name}: missing: {stale}") from None
        if (seen.st_size, seen.st_mtime_ns) != (entry["size"], entry["mtime_ns"]):
            raise SourceError(f"{directory / name}: {stale}")
    return _linked(target_dir, directory, tuple(files))


@cache
def _linked(target_dir: Path, directory: Path, names: tuple[str, ...]) -> Path:
    """A scratch directory (removed at exit) of links to `target_dir`'s files and `directory`'s `names`."""
    view = Path(tempfile.mkdtemp(prefix="dflashpipe-target-"))
    atexit.register(shutil.rmtree, view, ignore_errors=True)
    for f in target_dir.iterdir():
        os.symlink(f, view / f.name)
    for name in names:
        os.symlink(directory / name, view / name)
    return view

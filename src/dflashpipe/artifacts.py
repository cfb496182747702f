"""Writing stage outputs so that DVC never records a half-written one.

Every output is built under a temporary name beside its final path and renamed
into place only when complete: a stage killed at any point leaves either the old
state or the new one, plus at most a `.<name>.partial-*` sibling that the next
run of the stage removes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARTIAL = ".partial-"


def canonical_json(obj: Any) -> bytes:
    """Sorted, indented, newline-terminated JSON: the same object gives the same bytes."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def write_bytes_atomic(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{PARTIAL}", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path | str, obj: Any) -> None:
    write_bytes_atomic(path, canonical_json(obj))


def remove_partials(path: Path) -> None:
    """Remove what an earlier, killed attempt at writing `path` left beside it."""
    if not path.parent.is_dir():
        return
    for stale in path.parent.glob(f".{path.name}{PARTIAL}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: Path | str) -> Iterator[Path]:
    """Yield an empty directory that replaces `path` only if the block completes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}{PARTIAL}", dir=path.parent))
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        for child in tmp.rglob("*"):
            if child.is_file():
                with open(child, "rb") as fh:
                    os.fsync(fh.fileno())
        if path.exists():
            old = path.with_name(f".{path.name}{PARTIAL}old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def file_sha256(path: Path | str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()

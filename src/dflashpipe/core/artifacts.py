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

from dflashpipe.core.errors import DflashpipeError

PARTIAL = ".partial-"
FILE_LISTING = "files.json"
"""sha256 and size of every other file of a directory output, so a consumer can check it before use."""


def json_number(value: Any) -> float | None:
    """`value` as a float when a JSON document holds a number there, else None. JSON's true and false arrive as
    Python's True and False, which are ints to `isinstance`: a flag is never taken for a figure."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def canonical_json(obj: Any) -> bytes:
    """Sorted, indented, newline-terminated JSON: the same object gives the same bytes."""
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def write_bytes_atomic(path: Path | str, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_partials(path)
    _write_then_rename(path, data, tempfile.mkstemp(prefix=f".{path.name}{PARTIAL}", dir=path.parent))


def write_shard_atomic(path: Path | str, data: bytes) -> None:
    """Write one file of a directory output that is built in place (an incremental shard). The temporary
    file sits beside the directory, not in it, so a write killed midway leaves nothing inside the output
    (DVC or `dvc commit` would take it for part of it); the next `remove_partials(directory)` removes it."""
    path = Path(path)
    out_dir = path.parent
    prefix = f".{out_dir.name}{PARTIAL}{path.name}-"
    _write_then_rename(path, data, tempfile.mkstemp(prefix=prefix, dir=out_dir.parent))


def _write_then_rename(path: Path, data: bytes, temp: tuple[int, str]) -> None:
    fd, tmp = temp
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


def link_or_copy(old: Path, new: Path) -> None:
    """The bytes of `old` at `new` for nothing: a hard link (a copy keeping its mtime where links are not
    possible), replacing whatever `new` was."""
    new.unlink(missing_ok=True)
    try:
        os.link(old, new)
    except OSError:
        shutil.copy2(old, new)


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
            # A hard link to a kept file of the old output is on disk already: only new files are flushed.
            if child.is_file() and child.stat().st_nlink == 1:
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


def write_file_listing(directory: Path, verified: Path | None = None) -> None:
    """Record every file under `directory` (sha256, size) in its files.json. Call last.

    `verified`: an earlier output whose files.json this run has already checked against its files.
    A file here that is the very same file as there (a hard link to the same inode) takes its listed
    sha256 instead of being read again: growing an output costs what was added, not all of it."""
    known = {}
    if verified is not None and (verified / FILE_LISTING).is_file():
        known = json.loads((verified / FILE_LISTING).read_text())

    def entry(p: Path, rel: str) -> dict:
        old, size = known.get(rel), p.stat().st_size
        if old is not None and old.get("size") == size and os.path.samefile(p, verified / rel):
            return {"sha256": old["sha256"], "size": size}
        return {"sha256": file_sha256(p), "size": size}

    files = {
        p.relative_to(directory).as_posix(): entry(p, p.relative_to(directory).as_posix())
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != FILE_LISTING
    }
    write_json_atomic(directory / FILE_LISTING, files)


def verify_file_listing(
    directory: Path, fix: str, error: type[DflashpipeError] = DflashpipeError, only: list[str] | None = None
) -> None:
    """Check every file under `directory` against its files.json: none missing, none changed, none extra.

    `only` checks just those files (paths relative to `directory`), for a reader that depends on part
    of an output (evaluate reads the manifest's eval split alone). Raises `error` naming the file and
    `fix` (what the user should run) on the first problem."""
    listing = directory / FILE_LISTING
    if not listing.is_file():
        raise error(f"{directory}: {FILE_LISTING} missing (not a complete output): {fix}")
    try:
        files = json.loads(listing.read_text())
        entries = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise error(f"{listing}: unreadable ({exc}): {fix}") from None
    if only is not None:
        unlisted = sorted(set(only) - set(files))
        if unlisted:
            raise error(f"{listing}: does not list {', '.join(unlisted)}: {fix}")
        entries = [e for e in entries if e[0] in only]
    for rel, size, sha256 in entries:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise error(f"{listing}: lists {rel!r}, a path outside {directory}: {fix}")
        file = directory / rel
        if not file.is_file():
            raise error(f"{file}: listed in {listing} but missing: {fix}")
        if file.stat().st_size != size or file_sha256(file) != sha256:
            raise error(f"{file}: does not match its sha256 in {listing} (truncated, bit-flipped or edited): {fix}")
    if only is not None:
        return
    extra = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p != listing and p.relative_to(directory).as_posix() not in files
    )
    if extra:
        raise error(f"{directory}: holds files that {listing} does not list ({', '.join(extra)}): {fix}")

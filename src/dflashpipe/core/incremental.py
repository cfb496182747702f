"""Incremental shards: how a stage builds its directory output shard by shard, reusing what still holds.

The invariant: after a run, the output directory holds exactly one shard per input shard, each the
bytes this code would write now, then summary.json, then files.json; a shard left by an earlier run
stays (untouched, same inode) only if it was written for the very key it would be written for now
and its content still hashes to what it recorded. Whether a shard was reused or written again never
shows in summary.json or files.json: only the run record (the metrics) says which.

The protocol, which a stage (tokenize, regenerate; the features stage next) follows step by step:

1. Key. A shard's key is `shard_key(stage_key, input_sha256)`: the sha256 of the stage key's digest
   (every dep and param dvc.yaml lists for the stage, less its whole input directory: see
   `dflashpipe.core.pipeline.REUSE`) and its own input shard's sha256. So a shard is reused on exactly
   the condition under which DVC would keep it, and growing the input writes only the new shards.
   Without a stage key the key is None: nothing says what made such a shard, it is never reused.
2. Format. Each shard format stores, inside the shard file itself, its key, its record (the shard's
   statistics, skip counters included) and the sha256 of its content, and gives a reader
   `Path -> StoredShard` (where the key lives is the format's business: parquet metadata, Arrow
   schema metadata...). `reusable_record` is the one reuse check: the stored key matches, then the
   content hashes to what it recorded; a file that does not parse is simply not reusable.
3. Open. `ShardedOutput.open` removes every file of the directory that is not a current shard
   (stale shards, an old summary.json and files.json, partial writes), so a killed run leaves no
   listing that vouches for it; then it keeps the records of the shards that pass the check.
4. Write. The stage makes the shards in `todo`, each written atomically (artifacts.write_shard_atomic:
   its temporary file sits beside the directory, so a kill leaves nothing inside it),
   and hands each one's record to `wrote`.
5. Summary. summary.json is rebuilt from the shards' records alone (`entries`, `total`), so it is the
   same bytes however the shards came about; `finish` writes it, then files.json, last.
6. Run record. `ShardRun` says which shards were reused and which written; with the skip counters
   (summed from the records into the summary) that is what the stage's metrics report.

The manifest follows the same rules where its stream model allows, and differs where it must. Its
shards are cut from one stream, not made from input shards: shard i depends on every sample before
it, so no shard has a key of its own. The stage key's digest (`stage_digest`) is recorded once, in
summary.json, and the reuse check (`reusable_record`) is asked of the earlier build as a whole: under
the same digest and intact (`verify_manifest`), its shards of the same rows are kept
(data.manifest). It builds a new directory beside the old one and renames it into place whole, so
no stale file can survive and `remove_all_but` has nothing to do there; its summary is the stream's
state (where each source stopped), not a sum of shard records. It shares the key derivation, the
reuse check and the run record.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import pyarrow as pa

from dflashpipe.core.artifacts import (
    canonical_json,
    file_sha256,
    remove_partials,
    write_file_listing,
    write_json_atomic,
)

if TYPE_CHECKING:
    from dflashpipe.core.pipeline import StageKey

SUMMARY_FILE = "summary.json"
"""The name every directory output gives its summary (data.shards and tokens.shards name it too)."""

UNREADABLE = (OSError, pa.ArrowException, KeyError, TypeError, ValueError, AttributeError)
"""What reading back a damaged, foreign or older shard raises: it is not reusable, it is made again."""

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


def stage_digest(key: StageKey | None) -> str | None:
    """What an output records as the stage key it was made under; None without one (then nothing is reused)."""
    return None if key is None else key.digest


def shard_key(key: StageKey | None, input_sha256: str) -> str | None:
    """The key of the shard made from the input shard `input_sha256` under the stage key `key`."""
    digest = stage_digest(key)
    if digest is None:
        return None
    return hashlib.sha256(canonical_json({"stage": digest, "input_sha256": input_sha256})).hexdigest()


def _as_stored(record: Any) -> Any:
    return record


class StoredShard(Protocol[R_co]):
    """A shard as its format reads it back: enough to decide whether it may be reused."""

    @property
    def key(self) -> str | None:
        """The key it was written for."""
        ...

    @property
    def record(self) -> R_co:
        """What it recorded of itself: its statistics (sums across shards into the summary)."""
        ...

    def intact(self) -> bool:
        """Whether its content hashes to what it recorded (asked only once the key matched)."""
        ...


def reusable_record(
    path: Path, key: str | None, read: Callable[[Path], StoredShard[Any]], parse: Callable[[Any], R] = _as_stored
) -> R | None:
    """The record (as `parse` reads it) of the shard at `path` if it was written for exactly `key` and is
    intact; else None. Never reusable without a key."""
    if key is None or not path.is_file():
        return None
    try:
        stored = read(path)
        if stored.key != key or not stored.intact():
            return None
        return parse(stored.record)
    except UNREADABLE:  # a record of another shape too: the shard is made again
        return None


def remove_all_but(out_dir: Path, wanted: Iterable[str]) -> None:
    """Remove everything in `out_dir` that is not named in `wanted`. A DVC `persist` output is never
    emptied by DVC, so the stage must: stale shards, partial writes, and summary.json and files.json
    too (both are written last, so a killed run leaves neither)."""
    wanted = set(wanted)
    for stale in sorted(out_dir.iterdir()):
        if stale.name not in wanted:
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()


@dataclass(frozen=True)
class InputShard:
    """The input shard an output shard is made from: its file name, and its sha256 (half of the key)."""

    file: str
    sha256: str

    def to_json(self) -> dict:
        return {"file": self.file, "sha256": self.sha256}


@dataclass
class ShardRun:
    """What one run did to its output's shards: which it reused untouched, which it wrote (for the metrics)."""

    reused: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)


@dataclass
class ShardedOutput(Generic[R]):
    """A directory output being brought to one shard per input shard, by the protocol above."""

    out_dir: Path
    inputs: dict[str, InputShard]
    """Each output shard's name -> its input shard, in the input's order (the summary's)."""
    keys: dict[str, str | None]
    records: dict[str, R]
    """The record of every shard reused or written so far."""
    run: ShardRun

    @classmethod
    def open(
        cls,
        out_dir: Path,
        inputs: dict[str, InputShard],
        key: StageKey | None,
        read: Callable[[Path], StoredShard[Any]],
        parse: Callable[[Any], R] = _as_stored,
    ) -> ShardedOutput[R]:
        """Remove what is not a current shard from `out_dir`, then keep the records of the shards that may be
        reused. `read` is the format's reader; `parse` turns a stored record into the stage's own."""
        out_dir.mkdir(parents=True, exist_ok=True)
        remove_partials(out_dir)  # a killed run's shard write, beside the directory
        remove_all_but(out_dir, inputs)
        keys = {name: shard_key(key, shard.sha256) for name, shard in inputs.items()}
        records = {
            name: record
            for name in inputs
            if (record := reusable_record(out_dir / name, keys[name], read, parse)) is not None
        }
        return cls(out_dir, inputs, keys, records, ShardRun(reused=sorted(records)))

    @property
    def todo(self) -> list[str]:
        """The shards this run makes: every one not reused, in the input's order."""
        reused = set(self.run.reused)
        return [name for name in self.inputs if name not in reused]

    def wrote(self, name: str, record: R) -> None:
        """Shard `name` is written (atomically, its key, record and content hash inside)."""
        self.records[name] = record
        self.run.written.append(name)

    def entries(self, samples: Callable[[R], int]) -> list[dict]:
        """summary.json's list of shards, from what is on disk and recorded, however it came about."""
        return [
            {
                "file": name,
                "samples": samples(self.records[name]),
                "sha256": file_sha256(self.out_dir / name),
                "key": self.keys[name],
                "input": shard.to_json(),
            }
            for name, shard in self.inputs.items()
        ]

    def total(self, into: Any, stats: Callable[[R], Any] = _as_stored) -> Any:
        """`into` (empty statistics) with every shard's statistics merged in, in the input's order."""
        for name in self.inputs:
            into.merge(stats(self.records[name]))
        return into

    def finish(self, summary: dict) -> None:
        write_json_atomic(self.out_dir / SUMMARY_FILE, summary)
        write_file_listing(self.out_dir)  # last: a directory without it is not a complete output

"""The manifest's files: their schema, the writer of a shard, and the reader that checks them.

`data/manifest/` holds each source's `train-<source>-NNNNN.parquet` shards and `hashes-<source>.bin` (the
content hash of every sample it kept, 32 bytes each, eval then training, then of those it dropped as an
earlier source's: the state its next growth resumes from, in one read), `eval.parquet`, `summary.json`
(per source: its key, read / train / eval / skipped by reason, where its reader stopped, the bytes of its
files it read; per file: samples and sha256) and `files.json`, the sha256 of every other file. A reader
(tokenize, evaluate) checks what it reads against files.json first, so a damaged or hand-edited manifest
is refused naming the file and the fix. This module is all that a reader of the manifest imports: the
sources the build reads are not its concern.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from dflashpipe.core.artifacts import FILE_LISTING, file_sha256, verify_file_listing
from dflashpipe.core.errors import SourceError

if TYPE_CHECKING:
    from dflashpipe.data.sources import Conversation

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("conversation", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("hash", pa.string()),
    ]
)
EVAL_FILE = "eval.parquet"
DIGEST_SIZE = 32
"""Bytes of one sample's entry in a hashes file: its sha256 (the `hash` column's hex, as bytes)."""
SUMMARY_FILE = "summary.json"


def shard_name(source: str, index: int) -> str:
    """A source's training shard `index`: named after the source, so each stage after keys it alone."""
    return f"train-{source}-{index:05d}.parquet"


def hashes_name(source: str) -> str:
    return f"hashes-{source}.bin"


def conversation_hash(conversation: Conversation) -> str:
    return hashlib.sha256(orjson.dumps(conversation, option=orjson.OPT_SORT_KEYS)).hexdigest()


class ShardWriter:
    """Collects samples as flat columns and writes them as one parquet file."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sources: list[str] = []
        self.hashes: list[str] = []
        self.offsets: list[int] = [0]
        self.roles: list[str] = []
        self.contents: list[str] = []
        self.characters = 0

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, sample_id: str, source: str, conversation: Conversation, digest: str) -> None:
        self.ids.append(sample_id)
        self.sources.append(source)
        self.hashes.append(digest)
        for turn in conversation:
            self.roles.append(turn["role"])
            self.contents.append(turn["content"])
            self.characters += len(turn["content"])
        self.offsets.append(len(self.roles))

    def table(self) -> pa.Table:
        turns = pa.StructArray.from_arrays(
            [pa.array(self.roles, pa.string()), pa.array(self.contents, pa.string())], names=["role", "content"]
        )
        conversation = pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), turns)
        return pa.Table.from_arrays(
            [
                pa.array(self.ids, pa.string()),
                pa.array(self.sources, pa.string()),
                conversation,
                pa.array(self.hashes, pa.string()),
            ],
            schema=SCHEMA,
        )

    def write(self, path: Path) -> dict:
        write_table(self.table(), path)
        return {"file": path.name, "samples": len(self), "sha256": file_sha256(path)}


def write_table(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, compression="zstd", row_group_size=max(1, table.num_rows))


def manifest_metrics(summary: dict) -> dict:
    """The headline numbers of a manifest, for `dvc metrics diff`."""
    sources = summary["sources"].values()
    return {
        "train_samples": summary["num_samples"],
        "eval_samples": summary["eval"]["samples"],
        "shards": len(summary["shards"]),
        "train_characters": summary["characters"]["train"],
        "records_read": sum(s["read"] for s in sources),
        "records_skipped": sum(sum(s["skipped"].values()) for s in sources),
    }


# --- reading it back ---------------------------------------------------------------------------


def _manifest_fix(manifest_dir: Path) -> str:
    return f"restore it with `dvc checkout {manifest_dir}` or rebuild it with `dvc repro -f manifest`"


def _check_entry(entry: object, summary_path: Path, fix: str) -> dict:
    """A file entry of summary.json: a plain file name in the directory, a row count and a sha256."""
    try:
        name, samples, sha = entry["file"], entry["samples"], entry["sha256"]  # type: ignore[index]
        if not (isinstance(name, str) and isinstance(samples, int) and isinstance(sha, str)):
            raise TypeError(f"entry {entry!r} has a wrong type")
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"file {name!r} is not a plain file name")
    except (KeyError, TypeError, ValueError) as exc:
        raise SourceError(f"{summary_path}: not a manifest summary ({exc}): {fix}") from None
    return entry  # type: ignore[return-value]


def verify_manifest(manifest_dir: Path | str) -> dict:
    """Check a manifest directory before anything reads it; return its summary.

    Every file must match files.json (none missing, changed or extra: the one integrity check of
    every directory output), summary.json must list the shards that are there, and its counts must
    add up (per source read = train + eval + skipped; the shards hold num_samples): a truncated,
    bit-flipped, half-copied or hand-edited manifest is refused with the file and the fix instead of
    surfacing as a pyarrow error or as silently wrong numbers.
    """
    manifest_dir = Path(manifest_dir)
    fix = _manifest_fix(manifest_dir)
    verify_file_listing(manifest_dir, fix, SourceError)
    summary_path = manifest_dir / SUMMARY_FILE
    try:
        summary = orjson.loads(summary_path.read_bytes())
    except FileNotFoundError:
        raise SourceError(f"{summary_path} not found: no manifest there; {fix}") from None
    except orjson.JSONDecodeError as exc:
        raise SourceError(f"{summary_path}: not valid JSON ({exc}): truncated or edited; {fix}") from None
    if not isinstance(summary, dict):
        raise SourceError(f"{summary_path}: not a manifest summary (a JSON {type(summary).__name__}): {fix}")
    if not isinstance(summary.get("shards"), list):
        raise SourceError(f"{summary_path}: not a manifest summary (no list of shards): {fix}")
    try:
        sources = summary["sources"]
        hashes = [s["hashes"] for s in sources.values()]
        entries = [_check_entry(e, summary_path, fix) for e in [summary["eval"], *hashes, *summary["shards"]]]
        for name, s in sources.items():
            if s["read"] != s["train"] + s["eval"] + sum(s["skipped"].values()):
                raise ValueError(f"source {name!r}: read {s['read']} != train + eval + skipped")
            if s["train"] != sum(e["samples"] for e in summary["shards"] if e["source"] == name):
                raise ValueError(f"source {name!r}: its shards do not hold its {s['train']} training samples")
            if not isinstance(s["hashes"]["dropped"], int) or s["hashes"]["samples"] != s["eval"] + s["train"]:
                raise ValueError(f"{s['hashes']['file']} does not hold one hash per eval and training sample")
        shard_samples = sum(e["samples"] for e in summary["shards"])
        if not shard_samples == summary["num_samples"] == sum(s["train"] for s in sources.values()):
            raise ValueError(f"shards hold {shard_samples} samples, num_samples is {summary['num_samples']}")
        if summary["eval"]["samples"] != sum(s["eval"] for s in sources.values()):
            raise ValueError("the eval split's size differs from the per-source eval counts")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise SourceError(f"{summary_path}: counts do not add up or are missing ({exc}): {fix}") from None
    listed = {e["file"] for e in entries} | {SUMMARY_FILE, FILE_LISTING}
    present = {p.name for p in manifest_dir.iterdir()}
    if listed != present:
        raise SourceError(
            f"{summary_path}: lists {sorted(listed - present)} but the directory holds "
            f"{sorted(present - listed)}: {fix}"
        )
    # tokenize keys each of its shards by the sha256 summary.json gives: it must be the file's own
    checked = orjson.loads((manifest_dir / FILE_LISTING).read_bytes())
    for entry in entries:
        if checked[entry["file"]]["sha256"] != entry["sha256"]:
            raise SourceError(
                f"{summary_path}: gives {entry['file']} the sha256 {entry['sha256'][:12]}..., but the "
                f"file's is {checked[entry['file']]['sha256'][:12]}...: {fix}"
            )
    for entry in hashes:
        counted = entry["samples"] + entry["dropped"]
        if checked[entry["file"]]["size"] != DIGEST_SIZE * counted:
            raise SourceError(
                f"{manifest_dir / entry['file']}: {checked[entry['file']]['size']} bytes, but {summary_path} counts "
                f"{counted} samples of {DIGEST_SIZE} bytes: {fix}"
            )
    return summary


def read_manifest_shard(manifest_dir: Path | str, entry: dict) -> pa.Table:
    """One shard (an entry of summary.json's `shards`, or its `eval`), checked against files.json.

    The file is checked on its own (a reader of one file need not hash the rest), then parsed; its
    schema and row count must be what summary.json says.
    """
    manifest_dir = Path(manifest_dir)
    fix = _manifest_fix(manifest_dir)
    summary_path = manifest_dir / SUMMARY_FILE
    entry = _check_entry(entry, summary_path, fix)
    path = manifest_dir / entry["file"]
    verify_file_listing(manifest_dir, fix, SourceError, only=[entry["file"]])
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:  # a file that matches its hash yet does not parse
        raise SourceError(f"{path}: not a readable parquet shard ({exc}): {fix}") from None
    if not table.schema.equals(SCHEMA, check_metadata=False) or table.num_rows != entry["samples"]:
        raise SourceError(
            f"{path}: {table.num_rows} rows of schema {table.schema.names}, but {summary_path} lists "
            f"{entry['samples']} rows of {SCHEMA.names}: {fix}"
        )
    return table

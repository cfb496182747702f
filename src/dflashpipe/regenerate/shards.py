"""data/regenerated/: conversation shards in the manifest's own schema, their writer, and the reader tokenize uses.

One `train-NNNNN.parquet` per manifest training shard, of the same name, so shards pair one for one
and growing the manifest appends shards. Disabled, each is a hard link to its manifest shard: the same
bytes and sha256, so tokenize keys and encodes exactly what it did when it read the manifest. Enabled,
each adds to the manifest's columns `reply_ids`: per sample, the token ids of each assistant reply as the target
produced them (an empty list for a conversation kept as text), which tokenize trains on instead of encoding the
replies' text again; and each carries in its parquet metadata what made it: its key (the stage key and its
input shard's sha256), the settings (max_new_tokens, temperature 0, the chat template's and the target's sha256)
and its counts, plus the sha256 of its rows, so a shard is reused only when it is both the right one and intact.

`summary.json` lists the shards (file, samples, sha256, input) and `files.json` is written last; the
reader checks every file against it before tokenize reads a row.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from dflashpipe.core.artifacts import FILE_LISTING, canonical_json, verify_file_listing, write_shard_atomic
from dflashpipe.core.errors import SourceError
from dflashpipe.data.shards import SUMMARY_FILE

METADATA_KEY = b"dflashpipe.regenerate"


@dataclass(frozen=True)
class ConversationShard:
    """One training shard of conversations (the manifest's, or its regenerated twin)."""

    index: int
    path: Path
    samples: int
    sha256: str


REPLY_IDS = "reply_ids"
REPLY_IDS_TYPE = pa.list_(pa.list_(pa.int32()))


def with_reply_ids(table: pa.Table, reply_ids: list[list[list[int]]]) -> pa.Table:
    """A shard of the manifest's schema with each sample's replies' token ids beside it."""
    return table.append_column(REPLY_IDS, pa.array(reply_ids, REPLY_IDS_TYPE))


def rows_sha256(table: pa.Table) -> str:
    """The sha256 of a shard's rows by value (parquet pages carry no checksum we check)."""
    columns = ["id", "source", "conversation", "hash", *([REPLY_IDS] if REPLY_IDS in table.column_names else [])]
    return hashlib.sha256(orjson.dumps(table.select(columns).to_pylist())).hexdigest()


def write_shard(path: Path, table: pa.Table, record: dict) -> None:
    """`table` (the manifest's schema) with `record` (key, input, settings, counts) in its metadata."""
    meta = canonical_json({**record, "rows_sha256": rows_sha256(table)})
    sink = pa.BufferOutputStream()
    pq.write_table(
        table.replace_schema_metadata({METADATA_KEY: meta}),
        sink,
        compression="zstd",
        row_group_size=max(1, table.num_rows),
    )
    write_shard_atomic(path, sink.getvalue().to_pybytes())


@dataclass(frozen=True)
class StoredConversations:
    """A regenerated shard read back for the reuse check (a `dflashpipe.core.incremental.StoredShard`)."""

    table: pa.Table
    record: dict
    """What `write_shard` stored: key, input, settings, counts and rows_sha256."""

    @property
    def key(self) -> str | None:
        return self.record["key"]

    def intact(self) -> bool:
        return self.record["rows_sha256"] == rows_sha256(self.table)


def stored_shard(path: Path) -> StoredConversations:
    """Raises OSError/ArrowException/KeyError/ValueError on a file that is not such a shard."""
    table = pq.read_table(path)
    return StoredConversations(table, json.loads(table.schema.metadata[METADATA_KEY]))


def read_conversation_shards(directory: Path | str) -> list[ConversationShard]:
    """The training shards summary.json lists, after every file of `directory` was checked against its
    files.json. Reads data/regenerated/ and, as it has the same listing, a manifest directory too."""
    directory = Path(directory)
    fix = f"restore it with `dvc checkout {directory}` or rebuild it with `dvc repro -f regenerate`"
    verify_file_listing(directory, fix, SourceError)
    summary_path = directory / SUMMARY_FILE
    try:
        entries = orjson.loads(summary_path.read_bytes())["shards"]
        shards = [
            ConversationShard(i, directory / e["file"], int(e["samples"]), str(e["sha256"]))
            for i, e in enumerate(entries)
        ]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise SourceError(f"{summary_path}: unreadable or not a shard summary ({exc!r}): {fix}") from None
    listing = orjson.loads((directory / FILE_LISTING).read_bytes())
    for s in shards:
        # tokenize keys its shards by this sha256: it must be the file's own (a missing file has none)
        if Path(s.path.name).name != s.path.relative_to(directory).as_posix() or s.path.name in (
            SUMMARY_FILE,
            FILE_LISTING,
        ):
            raise SourceError(f"{summary_path}: lists {s.path.name!r}, not a shard file name: {fix}")
        if listing.get(s.path.name, {}).get("sha256") != s.sha256:
            raise SourceError(
                f"{summary_path}: lists {s.path.name} with a sha256 that {FILE_LISTING} does not give it: {fix}"
            )
    return shards

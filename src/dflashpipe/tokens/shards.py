"""The tokens shard format: its writer, when an existing shard may be reused, and the reader training uses.

A shard is reused only under the key it was written for. Each shard carries, in its parquet
metadata, the sha256 of (the stage key: every dep and param dvc.yaml lists for `tokenize`,
less the manifest and num_proc; this shard's input manifest shard's sha256), and its own stats.
A shard whose stored key matches and whose pages pass their checksums is reused untouched.

The reader trusts nothing it has not checked: `load_tokens` verifies every file of the directory
against its files.json (written last by the stage; the one integrity check of a directory
output) before it reads the shards that summary.json lists. Training depends on this file
alone (dvc.yaml), so it imports nothing else of the tokenize stage at run time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dflashpipe.artifacts import canonical_json, verify_file_listing, write_bytes_atomic
from dflashpipe.errors import SourceError

if TYPE_CHECKING:
    from dflashpipe.tokens.encode import EncodedRows, TokenStats

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("truncated", pa.bool_()),
    ]
)
METADATA_KEY = b"dflashpipe.tokens"
SUMMARY_FILE = "summary.json"
"""Both the manifest's and this stage's."""


def shard_name(index: int) -> str:
    return f"train-{index:05d}.parquet"


def shard_key(stage_digest: str | None, input_sha256: str) -> str | None:
    """The key of the shard made from the manifest shard `input_sha256` under the stage key `stage_digest`.

    None without a stage key: a shard written so is never reused (nothing says what made it)."""
    if stage_digest is None:
        return None
    return hashlib.sha256(canonical_json({"stage": stage_digest, "input_sha256": input_sha256})).hexdigest()


def rows_table(rows: EncodedRows) -> pa.Table:
    offsets = pa.array(np.concatenate([[0], np.cumsum(rows.lengths, dtype=np.int64)]).astype(np.int32))

    def flat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    return pa.Table.from_arrays(
        [
            pa.array(rows.ids, pa.string()),
            pa.array(rows.sources, pa.string()),
            pa.ListArray.from_arrays(offsets, pa.array(flat(rows.input_ids, np.int32))),
            pa.ListArray.from_arrays(offsets, pa.array(flat(rows.loss_mask, np.uint8))),
            pa.array(rows.truncated, pa.bool_()),
        ],
        schema=SCHEMA,
    )


def write_shard(path: Path, rows: EncodedRows, stats: TokenStats, key: str | None, input_entry: dict) -> None:
    table = rows_table(rows)
    meta = {"key": key, "input": input_entry, "stats": stats.to_json()}
    table = table.replace_schema_metadata({METADATA_KEY: canonical_json(meta)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=max(1, table.num_rows), write_page_checksum=True)
    write_bytes_atomic(path, sink.getvalue().to_pybytes())


def reusable_shard(path: Path, key: str | None) -> dict | None:
    """The stored stats (TokenStats JSON) of a shard written for exactly `key` whose pages pass their
    checksums and whose row count matches them; else None. Never reusable without a key."""
    if key is None or not path.is_file():
        return None
    try:
        file = pq.ParquetFile(path, page_checksum_verification=True)
        meta = json.loads(file.schema_arrow.metadata[METADATA_KEY])
        if meta.get("key") != key:
            return None
        table = file.read()
        stats = meta["stats"]
        rows_ok = table.num_rows == stats["samples_out"]
    except (OSError, pa.ArrowException, KeyError, TypeError, ValueError):
        return None
    if not rows_ok or not table.schema.equals(SCHEMA, check_metadata=False):
        return None
    return stats


@dataclass(frozen=True)
class TokenData:
    """Every training sequence, flat: sequence i is ids[offsets[i]:offsets[i+1]].

    Kept in the stored dtypes (ids int32, loss_mask uint8; offsets int64): a batch is widened to
    int64 only when it is collated, not the whole data set.
    """

    ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence, [len(self)]."""
        return np.diff(self.offsets)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence i's ids and loss mask, views at their stored dtypes (no copy)."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.ids[start:end], self.loss_mask[start:end]

    @property
    def supervised_tokens(self) -> int:
        return int(self.loss_mask.sum(dtype=np.int64))


def load_tokens(tokens_dir: Path | str) -> TokenData:
    """Read data/tokens/ (every file checked against its files.json first) into one flat array."""
    tokens_dir = Path(tokens_dir)
    fix = f"restore it with `dvc checkout {tokens_dir}` or rebuild it with `dvc repro -f tokenize`"
    verify_file_listing(tokens_dir, fix, SourceError)
    summary_path = tokens_dir / SUMMARY_FILE
    try:
        names = [str(e["file"]) for e in json.loads(summary_path.read_text())["shards"]]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SourceError(f"{summary_path}: unreadable or not a tokens summary ({exc!r}): {fix}") from None
    ids, masks, lengths = [], [], []
    for name in names:
        path = tokens_dir / name
        if Path(name).name != name:
            raise SourceError(f"{summary_path}: lists {name!r}, not a file name in {tokens_dir}: {fix}")
        try:
            table = pq.read_table(path, columns=["input_ids", "loss_mask"])
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise SourceError(f"{path}: not a readable tokens shard ({exc}): {fix}") from None
        for column, out in (("input_ids", ids), ("loss_mask", masks)):
            out.append(table.column(column).combine_chunks().flatten().to_numpy(zero_copy_only=False))
        lengths.append(table.column("input_ids").combine_chunks().value_lengths().to_numpy(zero_copy_only=False))
    if not lengths or sum(len(x) for x in lengths) == 0:
        raise SourceError(f"{tokens_dir}: no training sequences (see its summary.json skip counts)")
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    return TokenData(
        np.concatenate(ids).astype(np.int32, copy=False),
        np.concatenate(masks).astype(np.uint8, copy=False),
        offsets,
    )

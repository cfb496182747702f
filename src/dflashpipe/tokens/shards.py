"""The tokens shard format: its writer, when an existing shard may be reused, and the reader training uses.

A shard is an uncompressed Arrow IPC file (`train-NNNNN.arrow`, one record batch) so that training
can read it memory-mapped at its stored dtypes: the list columns' value buffers (ids int32,
loss_mask uint8) and their offsets are zero-copy numpy views of the mapped file, and the kernel
pages in only what a batch touches. A flat array (1.1M samples, 355M tokens: 8.2 GB resident) or
parquet (decompressed on read) would hold the whole set in memory; `.npy` files would need three
files per shard and a sidecar for the key. IPC costs disk (about 5 bytes per token, uncompressed),
which is what buys the mapping.

A shard is reused only under the key it was written for (the protocol: dflashpipe.core.incremental).
Each shard carries, in its schema metadata, the sha256 of (the stage key: every dep and param
dvc.yaml lists for `tokenize`, less the manifest and num_proc; this shard's input manifest shard's
sha256), its own stats, and the sha256 of its content (IPC has no page checksums): a shard whose
stored key matches and whose content hashes to what it says is reused untouched.

The reader trusts nothing it has not checked: `load_tokens` verifies every file of the directory
against its files.json (written last by the stage; the one integrity check of a directory
output) before it maps the shards that summary.json lists. Training depends on this file
alone (dvc.yaml), so it imports nothing else of the tokenize stage at run time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from dflashpipe.core.artifacts import canonical_json, verify_file_listing, write_shard_atomic
from dflashpipe.core.errors import SourceError

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


def shard_name(input_file: str) -> str:
    """The shard made from the input shard `input_file`: its name, so a source's shards keep theirs."""
    return f"{Path(input_file).stem}.arrow"


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


def content_sha256(table: pa.Table | pa.RecordBatch) -> str:
    """The sha256 of a shard's rows, from their values (not their buffers' layout), so the table a
    writer built and the one read back from its file hash alike."""
    h = hashlib.sha256()
    h.update(json.dumps([table.column(n).to_pylist() for n in ("id", "source", "truncated")]).encode())
    for name in ("input_ids", "loss_mask"):
        column = table.column(name)
        array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        offsets = array.offsets.to_numpy()
        h.update((offsets - offsets[0]).astype(np.int64).tobytes())
        h.update(memoryview(np.ascontiguousarray(array.values.to_numpy()[offsets[0] : offsets[-1]])))
    return h.hexdigest()


def write_shard(path: Path, rows: EncodedRows, stats: TokenStats, key: str | None, input_entry: dict) -> None:
    table = rows_table(rows)
    meta = {"key": key, "input": input_entry, "stats": stats.to_json(), "content_sha256": content_sha256(table)}
    table = table.replace_schema_metadata({METADATA_KEY: canonical_json(meta)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:  # uncompressed: the reader maps it
        writer.write_batch(table.combine_chunks().to_batches()[0] if table.num_rows else _empty_batch())
    write_shard_atomic(path, sink.getvalue().to_pybytes())


def _empty_batch() -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=SCHEMA)


def _read(source: pa.NativeFile) -> tuple[pa.RecordBatch, dict]:
    reader = pa.ipc.open_file(source)
    if reader.num_record_batches != 1:
        raise ValueError(f"{reader.num_record_batches} record batches, not 1")
    batch = reader.get_batch(0)
    meta = json.loads(reader.schema.metadata[METADATA_KEY])
    if not batch.schema.equals(SCHEMA, check_metadata=False):

        def columns(schema: pa.Schema) -> str:
            return ", ".join(f"{f.name}: {f.type}" for f in schema)

        raise ValueError(f"columns {columns(batch.schema)}, not {columns(SCHEMA)}")
    batch.validate()  # lengths and offsets within the buffers: cheap, and never reads past the file
    return batch, meta


def read_shard(path: Path) -> tuple[pa.RecordBatch, dict]:
    """A shard's one record batch, memory-mapped (the file is closed; the mapping lives as long as the
    arrays do), and its metadata. Raises OSError/ArrowException/ValueError/KeyError on a bad file."""
    with pa.memory_map(str(path)) as source:
        return _read(source)


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
MADV_DONTNEED = 4


def _unmap_resident(source: pa.MemoryMappedFile, inside: np.ndarray) -> None:
    """Let go of the pages of `source`'s mapping that reading it mapped in (its header, footer, offsets).

    Linux maps a whole large page-cache folio on a fault (hundreds of KB), so parsing a shard's header
    and footer maps most of a small shard into this process's RSS. MADV_DONTNEED on a shared file
    mapping only drops those page-table entries: the file's pages stay in the page cache and fault
    back in when a batch reads them. Done only when the region is certainly the mapping of the file
    (page-aligned, and holding `inside`, a view of it), never on memory of our own."""
    source.seek(0)
    start, size = source.read_buffer(1).address, source.size()  # a slice of the mapping, no copy
    address = inside.__array_interface__["data"][0]
    if _LIBC is not None and start % mmap.PAGESIZE == 0 and start <= address < start + size:
        _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), MADV_DONTNEED)


def map_shard(path: Path, samples: int) -> TokenShard:
    """The training view of one shard: ids and loss_mask mapped at their stored dtypes, the offsets
    copied (8 bytes a sequence: the index is this process's own, and reading it maps no file page)."""
    with pa.memory_map(str(path)) as source:
        batch, meta = _read(source)
        ids, mask = batch.column("input_ids"), batch.column("loss_mask")
        offsets = ids.offsets.to_numpy()
        if ids.null_count or mask.null_count or not np.array_equal(offsets, mask.offsets.to_numpy()):
            raise ValueError("input_ids and loss_mask do not line up")
        if batch.num_rows != samples:
            raise ValueError(f"{batch.num_rows} rows, but summary.json lists {samples}")
        shard = TokenShard(
            ids.values.to_numpy(),
            mask.values.to_numpy(),
            offsets.astype(np.int64),
            int(meta["stats"]["supervised_tokens"]),
        )
        _unmap_resident(source, shard.ids)
    return shard


@dataclass(frozen=True)
class StoredTokens:
    """A shard read back for the reuse check: a `dflashpipe.core.incremental.StoredShard` by shape (this module
    imports nothing of the stage: training depends on it alone)."""

    batch: pa.RecordBatch
    meta: dict

    @property
    def key(self) -> str | None:
        return self.meta.get("key")

    @property
    def record(self) -> dict:
        """Its stats (TokenStats JSON)."""
        return self.meta["stats"]

    def intact(self) -> bool:
        """Its row count matches its stats, and its content hashes to what it stored."""
        return self.batch.num_rows == self.record["samples_out"] and self.meta["content_sha256"] == content_sha256(
            self.batch
        )


def stored_shard(path: Path) -> StoredTokens:
    return StoredTokens(*read_shard(path))


@dataclass(frozen=True)
class TokenShard:
    """One shard's sequences: sequence j is ids[offsets[j]:offsets[j+1]], likewise loss_mask.

    ids (int32) and loss_mask (uint8) are views of the mapped file at their stored dtypes; offsets
    (int64) are this process's own copy."""

    ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    supervised_tokens: int

    @classmethod
    def of(cls, ids: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray) -> TokenShard:
        """A shard of in-memory arrays (the supervised count from the mask itself)."""
        return cls(ids, loss_mask, offsets, int(loss_mask.sum(dtype=np.int64)))

    def __len__(self) -> int:
        return len(self.offsets) - 1


@dataclass(frozen=True)
class TokenData:
    """Every training sequence, shard by shard; sequence i is found through the global index.

    Nothing is copied: each shard's arrays are views of its memory-mapped file, so loading 355M tokens
    costs the index (8 bytes per sequence), and a batch reads only its own pages. A batch is widened
    to int64 only when it is collated.
    """

    shards: tuple[TokenShard, ...]

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """[num_shards + 1] int64: the global index of each shard's first sequence, then len(self)."""
        return np.concatenate([[0], np.cumsum([len(s) for s in self.shards], dtype=np.int64)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """Tokens per sequence, [len(self)] int64."""
        parts = [np.diff(s.offsets).astype(np.int64) for s in self.shards]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sequence i's ids and loss mask, views at their stored dtypes (no copy)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} of {len(self)}")
        shard_index = int(np.searchsorted(self.starts, i, side="right")) - 1
        shard = self.shards[shard_index]
        j = i - int(self.starts[shard_index])
        start, end = int(shard.offsets[j]), int(shard.offsets[j + 1])
        return shard.ids[start:end], shard.loss_mask[start:end]

    @property
    def supervised_tokens(self) -> int:
        return sum(s.supervised_tokens for s in self.shards)


def load_tokens(tokens_dir: Path | str) -> TokenData:
    """Map data/tokens/ (every file checked against its files.json first), shard by shard, without copying."""
    tokens_dir = Path(tokens_dir)
    fix = f"restore it with `dvc checkout {tokens_dir}` or rebuild it with `dvc repro -f tokenize`"
    verify_file_listing(tokens_dir, fix, SourceError)
    summary_path = tokens_dir / SUMMARY_FILE
    try:
        entries = [(str(e["file"]), int(e["samples"])) for e in json.loads(summary_path.read_text())["shards"]]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SourceError(f"{summary_path}: unreadable or not a tokens summary ({exc!r}): {fix}") from None
    shards = []
    for name, samples in entries:
        path = tokens_dir / name
        if Path(name).name != name:
            raise SourceError(f"{summary_path}: lists {name!r}, not a file name in {tokens_dir}: {fix}")
        try:
            shard = map_shard(path, samples)
        except (OSError, ValueError, TypeError, KeyError, pa.ArrowException) as exc:
            raise SourceError(f"{path}: not a readable tokens shard ({exc}): {fix}") from None
        shards.append(shard)
    data = TokenData(tuple(shards))
    if len(data) == 0 or not data.lengths.any():
        raise SourceError(f"{tokens_dir}: no training sequences (see its summary.json skip counts)")
    return data

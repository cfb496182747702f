"""The dataset build: sources -> deduplicated, weighted, sharded training manifest + eval split.

Growth is append-only by construction. The training stream is a fixed sequence:
each source's records in their own stable order, interleaved by stride scheduling
on the weights, duplicates (by content hash) dropped as they are met. Sample i of
the stream depends only on the sources, never on `num_samples`, so the manifest
for N=1100 begins with the manifest for N=800, shard for shard, byte for byte
(every shard but a partial last one). The eval split is drawn first, from the
head of each source, so it never changes when the training set grows and never
overlaps it.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dflashpipe.artifacts import atomic_directory, file_sha256, write_json_atomic
from dflashpipe.data.sources import Conversation, Record, read_source
from dflashpipe.errors import SourceError
from dflashpipe.params import DataParams, SourceSpec

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("conversation", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("hash", pa.string()),
])
EVAL_FILE = "eval.parquet"
SUMMARY_FILE = "summary.json"
EXAMPLES_PER_REASON = 3


def shard_name(index: int) -> str:
    return f"train-{index:05d}.parquet"


def conversation_hash(conversation: Conversation) -> str:
    return hashlib.sha256(orjson.dumps(conversation, option=orjson.OPT_SORT_KEYS)).hexdigest()


@dataclass
class SourceStats:
    read: int = 0
    train: int = 0
    eval: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(where)


class SampleStream:
    """One source's usable, not-yet-seen samples, counting everything it passes over."""

    def __init__(self, spec: SourceSpec, records: Iterator[Record], seen: set[bytes], on_bad: str) -> None:
        self.spec, self.records, self.seen, self.on_bad = spec, records, seen, on_bad
        self.stats = SourceStats()

    def next(self) -> tuple[str, Conversation, str] | None:
        for record in self.records:
            self.stats.read += 1
            if record.bad is not None:
                if self.on_bad == "error":
                    raise SourceError(
                        f"{record.locator}: bad record ({record.bad}: {record.detail}) in source "
                        f"{self.spec.name!r}; fix it, or set data.on_bad_record: skip to count and skip such records"
                    )
                self.stats.skip(record.bad, f"{record.locator}: {record.detail}")
                continue
            digest = conversation_hash(record.conversation)
            key = bytes.fromhex(digest)
            if key in self.seen:
                self.stats.skip("duplicate", record.locator)
                continue
            self.seen.add(key)
            return f"{self.spec.name}/{record.native_id}", record.conversation, digest
        return None


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
            [pa.array(self.ids, pa.string()), pa.array(self.sources, pa.string()), conversation,
             pa.array(self.hashes, pa.string())],
            schema=SCHEMA,
        )

    def write(self, path: Path) -> dict:
        write_table(self.table(), path)
        return {"file": path.name, "samples": len(self), "sha256": file_sha256(path)}


def write_table(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, compression="zstd", row_group_size=max(1, table.num_rows))


class WeightedMix:
    """Stride scheduling over the sources' weights: the source whose next sample is most due,
    (taken + 1) / weight, goes next; ties go to the source listed first. An exhausted source
    drops out and the rest keep their relative shares. Pure arithmetic on the weights, so
    the order never depends on how many samples are asked for."""

    def __init__(self, weights: list[float]) -> None:
        self.weights = weights
        self.taken = [0] * len(weights)
        self.heap = [(1.0 / w, i) for i, w in enumerate(weights) if w > 0]
        heapq.heapify(self.heap)

    def due(self) -> int | None:
        return self.heap[0][1] if self.heap else None

    def took(self) -> None:
        i = self.heap[0][1]
        self.taken[i] += 1
        heapq.heapreplace(self.heap, ((self.taken[i] + 1) / self.weights[i], i))

    def exhausted(self) -> None:
        heapq.heappop(self.heap)


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


def build_manifest(params: DataParams, out: Path | str, root: Path | str = ".") -> dict:
    """Write the training shards, the eval split and summary.json into `out`; return the summary."""
    root = Path(root)
    seen: set[bytes] = set()
    streams = [SampleStream(spec, read_source(spec, root), seen, params.on_bad_record) for spec in params.sources]
    with atomic_directory(out) as tmp:
        eval_writer = ShardWriter()
        for stream in streams:
            for _ in range(stream.spec.eval):
                sample = stream.next()
                if sample is None:
                    raise SourceError(
                        f"source {stream.spec.name!r} has only {stream.stats.eval} usable records for "
                        f"data.sources[{stream.spec.name}].eval = {stream.spec.eval}: lower it"
                    )
                eval_writer.add(sample[0], stream.spec.name, sample[1], sample[2])
                stream.stats.eval += 1
        eval_entry = eval_writer.write(tmp / EVAL_FILE)

        shards, writer, content = [], ShardWriter(), hashlib.sha256()
        train_characters, produced = 0, 0
        mix = WeightedMix([s.spec.weight for s in streams])
        with tqdm(total=params.num_samples, desc="manifest", unit="sample", mininterval=1.0) as bar:
            while produced < params.num_samples:
                due = mix.due()
                if due is None:
                    raise SourceError(
                        f"the sources hold only {produced} unique usable training samples after the eval split, "
                        f"but data.num_samples = {params.num_samples}: lower it or add sources "
                        f"(read per source: {{{', '.join(f'{s.spec.name}: {s.stats.read}' for s in streams)}}})"
                    )
                stream = streams[due]
                sample = stream.next()
                if sample is None:
                    mix.exhausted()
                    continue
                mix.took()
                writer.add(sample[0], stream.spec.name, sample[1], sample[2])
                content.update(sample[2].encode())
                stream.stats.train += 1
                produced += 1
                bar.update(1)
                if len(writer) == params.shard_size or produced == params.num_samples:
                    train_characters += writer.characters
                    shards.append(writer.write(tmp / shard_name(len(shards))))
                    writer = ShardWriter()

        summary = {
            "num_samples": params.num_samples,
            "shard_size": params.shard_size,
            "shards": shards,
            "eval": eval_entry,
            "characters": {"train": train_characters, "eval": eval_writer.characters},
            "content_hash": content.hexdigest(),
            "sources": {
                s.spec.name: {
                    "kind": s.spec.kind,
                    "read": s.stats.read,
                    "train": s.stats.train,
                    "eval": s.stats.eval,
                    "skipped": dict(sorted(s.stats.skipped.items())),
                    "skipped_examples": dict(sorted(s.stats.examples.items())),
                }
                for s in streams
            },
        }
        write_json_atomic(tmp / SUMMARY_FILE, summary)
    return summary


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

    Every listed file must exist with the sha256 that summary.json records, no other file may sit
    there, and the counts must add up (per source read = train + eval + skipped; the shards hold
    num_samples): a truncated, bit-flipped, half-copied or hand-edited manifest is refused with the
    file and the fix instead of surfacing as a pyarrow error or as silently wrong numbers.
    """
    manifest_dir = Path(manifest_dir)
    fix = _manifest_fix(manifest_dir)
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
    entries = [_check_entry(e, summary_path, fix) for e in [summary.get("eval"), *summary["shards"]]]
    try:
        sources = summary["sources"]
        for name, s in sources.items():
            if s["read"] != s["train"] + s["eval"] + sum(s["skipped"].values()):
                raise ValueError(f"source {name!r}: read {s['read']} != train + eval + skipped")
        shard_samples = sum(e["samples"] for e in summary["shards"])
        if not shard_samples == summary["num_samples"] == sum(s["train"] for s in sources.values()):
            raise ValueError(f"shards hold {shard_samples} samples, num_samples is {summary['num_samples']}")
        if summary["eval"]["samples"] != sum(s["eval"] for s in sources.values()):
            raise ValueError("the eval split's size differs from the per-source eval counts")
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise SourceError(f"{summary_path}: counts do not add up or are missing ({exc}): {fix}") from None
    listed = {e["file"] for e in entries} | {SUMMARY_FILE}
    extra = sorted(p.name for p in manifest_dir.iterdir() if p.name not in listed)
    if extra:
        raise SourceError(f"{manifest_dir}: holds files that {summary_path} does not list ({', '.join(extra)}): {fix}")
    for entry in entries:
        _check_sha256(manifest_dir / entry["file"], entry["sha256"], summary_path, fix)
    return summary


def _check_sha256(path: Path, expected: str, summary_path: Path, fix: str, data: bytes | None = None) -> None:
    if data is None:
        if not path.is_file():
            raise SourceError(f"{path}: listed in {summary_path} but missing: {fix}")
        actual = file_sha256(path)
    else:
        actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise SourceError(
            f"{path}: sha256 {actual[:12]}... does not match {expected[:12]}... in {summary_path} "
            f"(truncated, bit-flipped or edited): {fix}"
        )


def read_manifest_shard(manifest_dir: Path | str, entry: dict) -> pa.Table:
    """One shard (an entry of summary.json's `shards`, or its `eval`), checked against its sha256.

    The bytes are read once, hashed, then parsed from memory, so what is parsed is what was checked.
    Call `verify_manifest` first for the whole directory; this guards each read on its own.
    """
    manifest_dir = Path(manifest_dir)
    fix = _manifest_fix(manifest_dir)
    summary_path = manifest_dir / SUMMARY_FILE
    entry = _check_entry(entry, summary_path, fix)
    path = manifest_dir / entry["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"{path}: listed in {summary_path} but missing: {fix}") from None
    _check_sha256(path, entry["sha256"], summary_path, fix, data)
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as exc:  # a file that matches its hash yet does not parse
        raise SourceError(f"{path}: not a readable parquet shard ({exc}): {fix}") from None
    if not table.schema.equals(SCHEMA, check_metadata=False) or table.num_rows != entry["samples"]:
        raise SourceError(
            f"{path}: {table.num_rows} rows of schema {table.schema.names}, but {summary_path} lists "
            f"{entry['samples']} rows of {SCHEMA.names}: {fix}"
        )
    return table

"""The dataset build: sources -> deduplicated, sharded training manifest + eval split, one stream per source.

Growth is append-only by construction, per source. Each source is its own stream: its records in their
stable order, duplicates (by content hash) dropped as they are met, its first `eval` samples its part of
the eval split, then round(weight x data.num_samples) training samples (fewer where the source holds
fewer) in shards named after it (`train-<source>-NNNNN.parquet`). A sample also held by an earlier-listed
source (its eval or training samples) is dropped from the later one, so adding a source at the end never
changes an earlier one. Training order is not the manifest's business: train shuffles sequences per epoch.

So growing the data costs what is added. `data/manifest/` is a DVC `persist` output; summary.json records
per source the key it was built under (the stage key less the data sources and data.num_samples,
pipeline.REUSE, with the source's own spec less its weight), where its reader stopped, and the bytes of
its files it has read (their sha256). An earlier build that passes `verify_manifest` gives each source
with the same key its shards back (hard-linked: same inode, bytes and mtime), and a source that grew (a
larger count, or records appended to its files: a jsonl file, or a directory of them read in name order)
resumes where it stopped, from the state it recorded (counts, `resume_at`, and its hashes file: the
hashes it kept, then those it dropped as an earlier source's). A source is rebuilt when an earlier
source now holds one of its samples or no longer holds one it dropped. A source file whose recorded
bytes changed (an edit, not an append) is refused before any work: redoing a source can cost days of
regeneration downstream, so accepting it is the user's step (rename the source). The new directory is
built beside the old one and renamed into place whole, so a killed run leaves the old output or the new.

This is the incremental shards protocol (dflashpipe.core.incremental) as far as a stream allows: the key
is recorded per source (a shard has no input shard of its own to key it by), and the run record says
which shards were kept and which written.
"""

from __future__ import annotations

import binascii
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
from tqdm import tqdm

from dflashpipe.core.artifacts import (
    atomic_directory,
    canonical_json,
    link_or_copy,
    write_file_listing,
    write_json_atomic,
)
from dflashpipe.core.errors import SourceError
from dflashpipe.core.incremental import ShardRun, reusable_record, stage_digest
from dflashpipe.core.params import DataParams, SourceSpec
from dflashpipe.core.pipeline import StageKey
from dflashpipe.data.shards import (
    DIGEST_SIZE,
    EVAL_FILE,
    SUMMARY_FILE,
    ShardWriter,
    conversation_hash,
    hashes_name,
    read_manifest_shard,
    shard_name,
    verify_manifest,
)
from dflashpipe.data.sources import Conversation, Record, read_source, source_files

EXAMPLES_PER_REASON = 3


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


@dataclass(frozen=True, slots=True)
class Sample:
    """A usable sample met for the first time, as the shards store it."""

    id: str
    conversation: Conversation
    hash: str
    """The sha256 of the conversation (conversation_hash), in hex."""


def digests(ordered: bytes) -> list[bytes]:
    # void items come out as whole bytes objects (an "S" dtype would strip trailing zero bytes), faster
    # than slicing in Python
    return np.frombuffer(ordered, f"V{DIGEST_SIZE}").tolist()


class SeenHashes:
    """One source's content hashes: those it kept (eval then training samples, in order) and those it
    dropped because an earlier source `held` them; its hashes file is the two, in one read."""

    def __init__(self, held: set[bytes], kept: bytes = b"", dropped: bytes = b"") -> None:
        self.held = held
        self.kept, self.dropped = bytearray(kept), bytearray(dropped)
        self.known = set(digests(kept))

    def add(self, digest: bytes) -> bool:
        """Whether `digest` is new (it is seen from now on)."""
        if digest in self.known:
            return False
        if digest in self.held:
            self.dropped += digest
            return False
        self.known.add(digest)
        self.kept += digest
        return True

    def still_holds(self) -> bool:
        """Whether what was decided against `held` holds now: nothing kept is an earlier source's, and
        everything dropped as one still is (then a fresh build makes the same decisions)."""
        return self.held.isdisjoint(self.known) and set(digests(bytes(self.dropped))) <= self.held


class SampleStream:
    """One source's usable, not-yet-seen samples, counting everything it passes over."""

    def __init__(self, spec: SourceSpec, records: Iterator[Record], seen: SeenHashes, on_bad: str) -> None:
        self.spec, self.records, self.seen, self.on_bad = spec, records, seen, on_bad
        self.stats = SourceStats()
        self.resume_at: tuple[int, ...] | None = None
        """The last record's `resume_at`: where a growth's reader can start again."""

    def next(self) -> Sample | None:
        for record in self.records:
            self.stats.read += 1
            self.resume_at = record.resume_at
            if record.bad is not None:
                if self.on_bad == "error":
                    raise SourceError(
                        f"{record.locator}: bad record ({record.bad}: {record.detail}) in source "
                        f"{self.spec.name!r}; fix it, or set data.on_bad_record: skip to count and skip such records"
                    )
                self.stats.skip(record.bad, f"{record.locator}: {record.detail}")
                continue
            digest = conversation_hash(record.conversation)
            if not self.seen.add(bytes.fromhex(digest)):
                self.stats.skip("duplicate", record.locator)
                continue
            return Sample(f"{self.spec.name}/{record.native_id}", record.conversation, digest)
        return None


@dataclass(frozen=True)
class EarlierBuild:
    """The manifest already in a directory, read back for the reuse check (a `dflashpipe.core.incremental.StoredShard`
    of the whole build: its stage key is recorded once, in summary.json; each source's beside it)."""

    directory: Path
    record: dict
    """Its summary.json."""

    @property
    def key(self) -> str | None:
        return self.record.get("reuse_key")

    def intact(self) -> bool:
        """It passes every check of `verify_manifest` (a damaged one is rebuilt, never reused)."""
        try:
            return verify_manifest(self.directory) == self.record
        except SourceError:
            return False


def previous_manifest(out: Path, digest: str | None) -> dict | None:
    """The summary of the manifest already in `out` if it was built under the stage key `digest` and is
    intact; else None."""

    def read(summary: Path) -> EarlierBuild:
        return EarlierBuild(summary.parent, orjson.loads(summary.read_bytes()))

    return reusable_record(out / SUMMARY_FILE, digest, read)


def source_key(digest: str | None, spec: SourceSpec) -> str | None:
    """What a source's shards are built under: the stage key and its own spec, less the weight (which only
    says where its stream is cut, as data.num_samples does)."""
    if digest is None:
        return None
    spec_fields = {"name": spec.name, "kind": spec.kind, "eval": spec.eval, "path": spec.path}
    return hashlib.sha256(canonical_json({"stage": digest, "source": spec_fields})).hexdigest()


def train_count(spec: SourceSpec, num_samples: int) -> int:
    """The training samples a source is asked for: its weight is its fraction of data.num_samples."""
    return round(spec.weight * num_samples)


def file_prefixes(spec: SourceSpec, root: Path, resume_at: tuple[int, ...] | None) -> list[dict]:
    """The bytes of the source's files that its build read, as {file, bytes, sha256}: whole files, but for
    a jsonl source only up to where its reader stopped (what comes after may still be appended)."""
    files = source_files(spec, root)
    if spec.kind == "jsonl":
        index, offset = resume_at[:2] if resume_at else (0, 0)
        files, ends = files[: index + 1], [None] * index + [offset]
    else:
        ends = [None] * len(files)
    out = []
    for path, end in zip(files, ends[: len(files)], strict=True):
        with open(path, "rb") as fh:
            data = fh.read() if end is None else fh.read(end)
        out.append({"file": _label(path, root), "bytes": len(data), "sha256": _sha256(data)})
    return out


def _label(path: Path, root: Path) -> str:
    return Path(os.path.relpath(path, root)).as_posix()  # a source outside the project too, where allowed


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def refuse_edited(spec: SourceSpec, root: Path, recorded: list[dict]) -> None:
    """Stop, naming the file and the source, if a file the recorded shards were read from changed under
    them (not only grew), or a file was inserted before them in the reading order."""
    now = [_label(p, root) for p in source_files(spec, root)]
    for i, entry in enumerate(recorded):
        path = root / entry["file"]
        same = i < len(now) and now[i] == entry["file"]
        if same:
            with open(path, "rb") as fh:
                data = fh.read(entry["bytes"])
            same = len(data) == entry["bytes"] and _sha256(data) == entry["sha256"]
        if not same:
            raise SourceError(
                f"{entry['file']}: changed under the recorded shards of data.sources[{spec.name}] (its first "
                f"{entry['bytes']} bytes, or the files read before it, are not what they were built from; only "
                f"appending grows a source): to accept the edit, rename the source, which rebuilds only it"
            )


@dataclass
class SourceShards:
    """One source's training shards written so far, and the one being filled."""

    name: str
    out: Path
    previous: list[dict]
    """Its shards in an earlier build under the same key: those of the same rows are kept."""
    entries: list[dict] = field(default_factory=list)
    writer: ShardWriter = field(default_factory=ShardWriter)
    characters: int = 0
    run: ShardRun = field(default_factory=ShardRun)

    def keep(self, entry: dict, tmp: Path) -> None:
        """The earlier build's shard `entry`, linked as it is (same inode, bytes and mtime)."""
        link_or_copy(self.out / entry["file"], tmp / entry["file"])
        self.entries.append(entry)
        self.run.reused.append(entry["file"])

    def flush(self, tmp: Path) -> None:
        index, samples = len(self.entries), len(self.writer)
        path = tmp / shard_name(self.name, index)
        old = self.previous
        if index < len(old) and old[index]["samples"] == samples:  # the same key: the same rows
            self.keep(old[index], tmp)
        else:
            self.entries.append({**self.writer.write(path), "source": self.name})
            self.run.written.append(path.name)
        self.characters += self.writer.characters
        self.writer = ShardWriter()


@dataclass
class BuiltSource:
    """What one source gave the build: its record for summary.json, its eval rows, its training samples'
    hashes (in order) and its shards' run."""

    record: dict
    shards: list[dict]
    eval_rows: list[dict]
    train_hashes: bytes
    run: ShardRun


def build_source(
    spec: SourceSpec,
    params: DataParams,
    dirs: tuple[Path, Path, Path],
    key: str | None,
    done: dict | None,
    done_eval: list[dict],
    done_shards: list[dict],
    held: set[bytes],
) -> BuiltSource:
    """Build one source's eval rows and training shards into `tmp` (dirs: tmp, out, root). `done` is its
    record in an earlier build in `out` under the same stage key (or None) and `done_eval` its eval rows
    there; `held` every hash an earlier-listed source kept (this one's are added)."""
    tmp, out, root = dirs
    count = train_count(spec, params.num_samples)
    seen = SeenHashes(held)
    if done is not None and key is not None and done.get("key") == key:
        refuse_edited(spec, root, done["files"])
        stored = (out / done["hashes"]["file"]).read_bytes()
        kept_bytes = DIGEST_SIZE * done["hashes"]["samples"]
        earlier = SeenHashes(held, stored[:kept_bytes], stored[kept_bytes:])
        if earlier.still_holds():
            seen = earlier
        else:
            done = None
    else:
        done = None
    grow = done is not None and done["train"] <= count
    if done is not None and not grow:
        seen = SeenHashes(held)
    stream = SampleStream(spec, iter(()), seen, params.on_bad_record)
    shards = SourceShards(spec.name, out, done_shards if done else [])
    eval_rows: list[dict] = []
    if grow:
        stream.stats = SourceStats(
            done["read"], done["train"], done["eval"], dict(done["skipped"]), dict(done["skipped_examples"])
        )
        stream.resume_at = tuple(done["resume_at"]) if done["resume_at"] else None
        stream.records = read_source(spec, root, done["read"], stream.resume_at)
        old = done_shards
        last_partial = bool(old) and old[-1]["samples"] < params.shard_size
        for entry in old[:-1] if last_partial else old:
            shards.keep(entry, tmp)
        if last_partial:
            for row in read_manifest_shard(out, old[-1]).to_pylist():
                shards.writer.add(row["id"], row["source"], row["conversation"], row["hash"])
        shards.characters = done["characters"]["train"] - shards.writer.characters
        eval_rows = done_eval
    else:
        stream.records = read_source(spec, root)
        for _ in range(spec.eval):
            sample = stream.next()
            if sample is None:
                raise SourceError(
                    f"source {spec.name!r} has only {stream.stats.eval} usable records for "
                    f"data.sources[{spec.name}].eval = {spec.eval}: lower it"
                )
            eval_rows.append(
                {"id": sample.id, "source": spec.name, "conversation": sample.conversation, "hash": sample.hash}
            )
            stream.stats.eval += 1
    with tqdm(total=count, initial=stream.stats.train, desc=spec.name, unit="sample", mininterval=1.0) as bar:
        while stream.stats.train < count and (sample := stream.next()) is not None:
            shards.writer.add(sample.id, spec.name, sample.conversation, sample.hash)
            stream.stats.train += 1
            bar.update(1)
            if len(shards.writer) == params.shard_size:
                shards.flush(tmp)
        if len(shards.writer):
            shards.flush(tmp)
    if stream.stats.train < count:
        print(
            f"manifest: source {spec.name!r} holds {stream.stats.train} of the {count} training samples its weight asks"
        )
    hashes = tmp / hashes_name(spec.name)
    hashes.write_bytes(seen.kept + seen.dropped)
    if done is not None:
        keep_if_same(hashes, out)
    record = {
        "kind": spec.kind,
        "key": key,
        "read": stream.stats.read,
        "train": stream.stats.train,
        "eval": stream.stats.eval,
        "skipped": dict(sorted(stream.stats.skipped.items())),
        "skipped_examples": dict(sorted(stream.stats.examples.items())),
        "resume_at": stream.resume_at,
        "files": file_prefixes(spec, root, stream.resume_at),
        "characters": {"train": shards.characters},
        "hashes": {
            "file": hashes.name,
            "samples": len(seen.kept) // DIGEST_SIZE,
            "dropped": len(seen.dropped) // DIGEST_SIZE,
            "sha256": _sha256(hashes.read_bytes()),
        },
    }
    held.update(seen.known)
    return BuiltSource(
        record, shards.entries, eval_rows, bytes(seen.kept[DIGEST_SIZE * stream.stats.eval :]), shards.run
    )


def keep_if_same(path: Path, out: Path) -> bool:
    """Link the earlier build's file of the same name (built under the same key) in place of `path` if it
    holds the same bytes, so what did not change keeps its inode; whether it was."""
    earlier = out / path.name
    if not earlier.is_file() or earlier.stat().st_size != path.stat().st_size:
        return False
    if earlier.read_bytes() != path.read_bytes():
        return False
    path.unlink()
    link_or_copy(earlier, path)
    return True


def build_manifest(params: DataParams, out: Path | str, root: Path | str = ".", key: StageKey | None = None) -> dict:
    """Write each source's training shards, the eval split and summary.json into `out`; return the summary.

    `key` is the stage key less the sources and data.num_samples (see stages/manifest.py): with it, what
    an earlier manifest in `out` holds of each source built under the same key is kept, not rebuilt;
    without it, nothing is reused and nothing written says what made it."""
    root, out = Path(root), Path(out)
    digest = stage_digest(key)
    previous = previous_manifest(out, digest)
    earlier = previous["sources"] if previous else {}
    earlier_eval = read_manifest_shard(out, previous["eval"]).to_pylist() if previous else []
    held: set[bytes] = set()
    built: dict[str, BuiltSource] = {}
    with atomic_directory(out) as tmp:
        for spec in params.sources:
            done_eval = [row for row in earlier_eval if row["source"] == spec.name]
            done_shards = [e for e in previous["shards"] if e["source"] == spec.name] if previous else []
            key = source_key(digest, spec)
            done = earlier.get(spec.name)
            built[spec.name] = build_source(spec, params, (tmp, out, root), key, done, done_eval, done_shards, held)
        eval_writer = ShardWriter()
        for row in (row for source in built.values() for row in source.eval_rows):
            eval_writer.add(row["id"], row["source"], row["conversation"], row["hash"])
        eval_entry = eval_writer.write(tmp / EVAL_FILE)
        if previous is not None:
            keep_if_same(tmp / EVAL_FILE, out)
        summary = {
            "num_samples": sum(s.record["train"] for s in built.values()),
            "shard_size": params.shard_size,
            "shards": [entry for s in built.values() for entry in s.shards],
            "eval": eval_entry,
            "characters": {
                "train": sum(s.record["characters"]["train"] for s in built.values()),
                "eval": eval_writer.characters,
            },
            "content_hash": _sha256(binascii.hexlify(b"".join(s.train_hashes for s in built.values()))),
            "reuse_key": digest,
            "sources": {name: s.record for name, s in built.items()},
        }
        write_json_atomic(tmp / SUMMARY_FILE, summary)
        # last: every reader checks the directory against it first. `previous` passed verify_manifest
        # (files.json against every file) in this run, so the files kept from it are not read again.
        write_file_listing(tmp, verified=out if previous is not None else None)
    reused = sum(len(s.run.reused) for s in built.values())
    written = sum(len(s.run.written) for s in built.values())
    print(f"manifest: kept {reused} training shard(s) of the earlier build, wrote {written}")
    return summary

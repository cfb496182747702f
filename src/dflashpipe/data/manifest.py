"""The dataset build: sources -> deduplicated, weighted, sharded training manifest + eval split.

Growth is append-only by construction. The training stream is a fixed sequence:
each source's records in their own stable order, interleaved by stride scheduling
on the weights, duplicates (by content hash) dropped as they are met. Sample i of
the stream depends only on the sources, never on `num_samples`, so the manifest
for N=1100 begins with the manifest for N=800, shard for shard, byte for byte
(every shard but a partial last one). The eval split is drawn first, from the
head of each source, so it never changes when the training set grows and never
overlaps it.

So growing the data costs what is added. `data/manifest/` is a DVC `persist` output, and
summary.json records the key it was built under: the stage key (every dep and param dvc.yaml
lists for `manifest`) less `data.num_samples`, which only says where the stream is cut. An
earlier manifest under the same key that passes `verify_manifest` holds exactly the stream's
first samples: its eval split and every shard that would get the same rows are hard-linked
into the new directory (same inode, bytes and mtime; nothing rewritten), and when the data
grew, the stream resumes where the old one stopped, from the state it recorded: per source, records
read, kept, skipped (with examples) and where its reader stopped (summary.json), and every content
hash met, in order (hashes.bin: the dedup set and the content hash's input, in one read). A jsonl
source seeks past the records already consumed; other readers pass over them, never hashing,
deduplicating or writing them again. Both files are checked against files.json with the rest
before anything is kept, so a damaged or edited earlier build is rebuilt, never resumed. The new
directory is still built beside the old one and renamed into place whole, so a killed run leaves the
old output or the new one, and no stale file survives.

This is the incremental shards protocol (dflashpipe.core.incremental) as far as a stream allows: the key is the
stage key's digest, recorded once (a shard has no input shard of its own to key it by), and the run
record says which shards were kept and which written.
"""

from __future__ import annotations

import binascii
import hashlib
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson
from tqdm import tqdm

from dflashpipe.core.artifacts import atomic_directory, link_or_copy, write_file_listing, write_json_atomic
from dflashpipe.core.errors import SourceError
from dflashpipe.core.incremental import ShardRun, reusable_record, stage_digest
from dflashpipe.core.params import DataParams, SourceSpec
from dflashpipe.core.pipeline import StageKey
from dflashpipe.data.shards import (
    DIGEST_SIZE,
    EVAL_FILE,
    HASHES_FILE,
    SUMMARY_FILE,
    ShardWriter,
    conversation_hash,
    read_manifest_shard,
    shard_name,
    verify_manifest,
)
from dflashpipe.data.sources import Conversation, Record, read_source

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


class SeenHashes:
    """Every content hash met so far: a set, to drop duplicates, and in the order met (the eval split's,
    then the training samples': every sample that passes is used) the bytes of HASHES_FILE, from which a
    growth restores both in one read."""

    def __init__(self, ordered: bytes = b"") -> None:
        self.ordered = bytearray(ordered)
        # void items come out as whole bytes objects (an "S" dtype would strip trailing zero bytes), faster
        # than slicing `ordered` in Python
        self.known = set(np.frombuffer(ordered, f"V{DIGEST_SIZE}").tolist())

    def add(self, digest: bytes) -> bool:
        """Whether `digest` is new (it is seen from now on)."""
        if digest in self.known:
            return False
        self.known.add(digest)
        self.ordered += digest
        return True

    def content_hash(self, eval_samples: int) -> str:
        """The sha256 of the training samples' hex hashes, in order."""
        return hashlib.sha256(binascii.hexlify(memoryview(self.ordered)[DIGEST_SIZE * eval_samples :])).hexdigest()


class SampleStream:
    """One source's usable, not-yet-seen samples, counting everything it passes over."""

    def __init__(self, spec: SourceSpec, records: Iterator[Record], seen: SeenHashes, on_bad: str) -> None:
        self.spec, self.records, self.seen, self.on_bad = spec, records, seen, on_bad
        self.stats = SourceStats()
        self.resume_at: tuple[int, int] | None = None
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


class WeightedMix:
    """Stride scheduling over the sources' weights: the source whose next sample is most due,
    (taken + 1) / weight, goes next; ties go to the source listed first. An exhausted source
    drops out and the rest keep their relative shares. Pure arithmetic on the weights, so
    the order never depends on how many samples are asked for, and `taken` alone is its state
    (an exhausted source is found exhausted again when next due, without a sample)."""

    def __init__(self, weights: list[float], taken: list[int] | None = None) -> None:
        self.weights = weights
        self.taken = list(taken or [0] * len(weights))
        self.heap = [((t + 1) / w, i) for i, (w, t) in enumerate(zip(weights, self.taken, strict=True)) if w > 0]
        heapq.heapify(self.heap)

    def due(self) -> int | None:
        return self.heap[0][1] if self.heap else None

    def took(self) -> None:
        i = self.heap[0][1]
        self.taken[i] += 1
        heapq.heapreplace(self.heap, ((self.taken[i] + 1) / self.weights[i], i))

    def exhausted(self) -> None:
        heapq.heappop(self.heap)


@dataclass(frozen=True)
class EarlierBuild:
    """The manifest already in a directory, read back for the reuse check (a `dflashpipe.core.incremental.StoredShard`
    of the whole build: its key is recorded once, in summary.json)."""

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
    """The summary of the manifest already in `out` if it was built under the key `digest` and is intact;
    else None."""

    def read(summary: Path) -> EarlierBuild:
        return EarlierBuild(summary.parent, orjson.loads(summary.read_bytes()))

    return reusable_record(out / SUMMARY_FILE, digest, read)


@dataclass
class TrainShards:
    """The training shards written so far, and the one being filled."""

    out: Path
    previous: dict | None
    """An earlier manifest under the same key (see previous_manifest): its shards of the same rows are kept."""
    entries: list[dict] = field(default_factory=list)
    writer: ShardWriter = field(default_factory=ShardWriter)
    characters: int = 0
    run: ShardRun = field(default_factory=ShardRun)
    """Which shards were kept from the earlier build (reused) and which written."""

    def keep(self, entry: dict, tmp: Path) -> None:
        """The earlier build's shard `entry`, linked as it is (same inode, bytes and mtime)."""
        link_or_copy(self.out / entry["file"], tmp / entry["file"])
        self.entries.append(entry)
        self.run.reused.append(entry["file"])

    def flush(self, tmp: Path) -> None:
        index, samples = len(self.entries), len(self.writer)
        old = (self.previous or {"shards": []})["shards"]
        path = tmp / shard_name(index)
        if index < len(old) and old[index]["samples"] == samples:  # the same key: the same rows
            self.keep(old[index], tmp)
        else:
            self.entries.append(self.writer.write(path))
            self.run.written.append(path.name)
        self.characters += self.writer.characters
        self.writer = ShardWriter()


def resume(
    previous: dict, out: Path, tmp: Path, streams: list[SampleStream], root: Path
) -> tuple[dict, int, TrainShards]:
    """Pick the stream up where `previous` (a smaller or equal manifest under this key) stopped.

    Its eval split and full shards are kept as they are; a partial last shard is read back into the
    writer, to be filled up. Each source starts again after the records the old build read, with its
    counts restored (the dedup set came from its hashes.bin). Returns the eval split's entry and
    characters, and the training shards so far."""
    link_or_copy(out / EVAL_FILE, tmp / EVAL_FILE)
    shards = TrainShards(out, previous)
    old = previous["shards"]
    last_partial = bool(old) and old[-1]["samples"] < previous["shard_size"]
    for entry in old[:-1] if last_partial else old:
        shards.keep(entry, tmp)
    if last_partial:
        for row in read_manifest_shard(out, old[-1]).to_pylist():
            shards.writer.add(row["id"], row["source"], row["conversation"], row["hash"])
    shards.characters = previous["characters"]["train"] - shards.writer.characters
    for stream in streams:
        done = previous["sources"][stream.spec.name]
        stream.stats = SourceStats(
            done["read"], done["train"], done["eval"], dict(done["skipped"]), dict(done["skipped_examples"])
        )
        stream.resume_at = tuple(done["resume_at"]) if done["resume_at"] else None
        stream.records = read_source(stream.spec, root, done["read"], stream.resume_at)
    return previous["eval"], previous["characters"]["eval"], shards


def build_manifest(params: DataParams, out: Path | str, root: Path | str = ".", key: StageKey | None = None) -> dict:
    """Write the training shards, the eval split and summary.json into `out`; return the summary.

    `key` is the stage key less data.num_samples (see stages/manifest.py): with it, what an earlier
    manifest in `out` built under the same key already holds is kept, not rebuilt; without it, nothing
    is reused and nothing written says what made it."""
    root, out = Path(root), Path(out)
    digest = stage_digest(key)
    previous = previous_manifest(out, digest)
    grow = previous is not None and previous["num_samples"] <= params.num_samples
    # verify_manifest checked hashes.bin against files.json and its size against the sample counts
    seen = SeenHashes((out / previous["hashes"]["file"]).read_bytes() if grow else b"")
    streams = [SampleStream(spec, read_source(spec, root), seen, params.on_bad_record) for spec in params.sources]
    with atomic_directory(out) as tmp:
        if grow:
            eval_entry, eval_characters, shards = resume(previous, out, tmp, streams, root)
        else:
            eval_entry, eval_characters = draw_eval(streams, tmp, previous, out)
            shards = TrainShards(out, previous)
        produced = sum(e["samples"] for e in shards.entries) + len(shards.writer)
        mix = WeightedMix([s.spec.weight for s in streams], [s.stats.train for s in streams])
        with tqdm(total=params.num_samples, initial=produced, desc="manifest", unit="sample", mininterval=1.0) as bar:
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
                shards.writer.add(sample.id, stream.spec.name, sample.conversation, sample.hash)
                stream.stats.train += 1
                produced += 1
                bar.update(1)
                if len(shards.writer) == params.shard_size:
                    shards.flush(tmp)
            if len(shards.writer):
                shards.flush(tmp)
        (tmp / HASHES_FILE).write_bytes(seen.ordered)
        hashes = {
            "file": HASHES_FILE,
            "samples": len(seen.ordered) // DIGEST_SIZE,
            "sha256": hashlib.sha256(seen.ordered).hexdigest(),
        }

        summary = {
            "num_samples": params.num_samples,
            "shard_size": params.shard_size,
            "shards": shards.entries,
            "eval": eval_entry,
            "hashes": hashes,
            "characters": {"train": shards.characters, "eval": eval_characters},
            "content_hash": seen.content_hash(eval_entry["samples"]),
            "reuse_key": digest,
            "sources": {
                s.spec.name: {
                    "kind": s.spec.kind,
                    "read": s.stats.read,
                    "train": s.stats.train,
                    "eval": s.stats.eval,
                    "skipped": dict(sorted(s.stats.skipped.items())),
                    "skipped_examples": dict(sorted(s.stats.examples.items())),
                    "resume_at": s.resume_at,
                }
                for s in streams
            },
        }
        write_json_atomic(tmp / SUMMARY_FILE, summary)
        # last: every reader checks the directory against it first. `previous` passed verify_manifest
        # (files.json against every file) in this run, so the files kept from it are not read again.
        write_file_listing(tmp, verified=out if previous is not None else None)
    run = shards.run
    print(f"manifest: kept {len(run.reused)} training shard(s) of the earlier build, wrote {len(run.written)}")
    return summary


def draw_eval(streams: list[SampleStream], tmp: Path, previous: dict | None, out: Path) -> tuple[dict, int]:
    """The eval split, from the head of each source (kept from `previous`, a manifest under the same key,
    if there is one: the same samples); its entry and characters."""
    eval_writer = ShardWriter()
    for stream in streams:
        for _ in range(stream.spec.eval):
            sample = stream.next()
            if sample is None:
                raise SourceError(
                    f"source {stream.spec.name!r} has only {stream.stats.eval} usable records for "
                    f"data.sources[{stream.spec.name}].eval = {stream.spec.eval}: lower it"
                )
            eval_writer.add(sample.id, stream.spec.name, sample.conversation, sample.hash)
            stream.stats.eval += 1
    if previous is not None:
        link_or_copy(out / EVAL_FILE, tmp / EVAL_FILE)
        return previous["eval"], eval_writer.characters
    return eval_writer.write(tmp / EVAL_FILE), eval_writer.characters

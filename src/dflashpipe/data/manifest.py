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

from tqdm import tqdm

from dflashpipe.artifacts import atomic_directory, write_file_listing, write_json_atomic
from dflashpipe.data.shards import EVAL_FILE, SUMMARY_FILE, ShardWriter, conversation_hash, shard_name
from dflashpipe.data.sources import Conversation, Record, read_source
from dflashpipe.errors import SourceError
from dflashpipe.params import DataParams, SourceSpec

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
        write_file_listing(tmp)  # last: every reader checks the directory against it first
    return summary

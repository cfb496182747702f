"""Eval prompts: each eval-split sample's conversation up to its last assistant turn, as the target sees it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflashpipe.errors import SourceError
from dflashpipe.tokens.chat import ChatTokenizer


@dataclass(frozen=True)
class EvalPrompt:
    sample_id: str
    source: str
    prompt_ids: list[int]


def read_eval_split(manifest_dir: Path | str) -> list[dict]:
    """The eval split's rows in file order (the manifest writes it before any training shard, so growing
    data.num_samples leaves it as it was)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dflashpipe.artifacts import verify_file_listing
    from dflashpipe.data.shards import EVAL_FILE, SCHEMA

    manifest_dir = Path(manifest_dir)
    path = manifest_dir / EVAL_FILE
    # Only the eval split is checked against the manifest's files.json: evaluate depends on that one
    # file (dvc.yaml), and a damaged training shard is tokenize's to refuse, not evaluate's.
    verify_file_listing(
        manifest_dir,
        f"restore it with `dvc checkout {manifest_dir}` or rebuild it with `dvc repro -f manifest`",
        SourceError,
        only=[EVAL_FILE],
    )
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise SourceError(f"{path} not found: run `dvc repro manifest` (or `dvc checkout data/manifest`)") from None
    except (pa.ArrowException, OSError) as exc:
        raise SourceError(f"{path}: not a readable parquet file ({exc}): run `dvc repro manifest`") from None
    if not table.schema.equals(SCHEMA, check_metadata=False):
        raise SourceError(f"{path}: columns {table.schema.names}, expected {SCHEMA.names}: run `dvc repro manifest`")
    return table.to_pylist()


def eval_prompts(
    manifest_dir: Path | str, chat: ChatTokenizer, num_prompts: int, max_prompt_tokens: int
) -> tuple[list[EvalPrompt], dict[str, dict[str, int]]]:
    """The first `num_prompts` usable samples of each source, in eval-file order, and what was skipped.

    A sample's prompt is its conversation before its last assistant turn, rendered with the target's
    chat template and its generation prompt; a sample with nothing before an assistant turn, or whose
    prompt is longer than `max_prompt_tokens`, is skipped (counted per source and reason).
    """
    taken: Counter[str] = Counter()
    skipped: dict[str, dict[str, int]] = {}
    prompts = []
    for row in read_eval_split(manifest_dir):
        source = row["source"]
        if taken[source] >= num_prompts:
            continue
        turns = row["conversation"]
        last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=0)
        if last == 0:
            skipped.setdefault(source, Counter())["no_prompt_before_an_assistant_turn"] += 1
            continue
        text = chat.render(turns[:last], add_generation_prompt=True)
        ids = chat.backend.encode(text, add_special_tokens=False).ids
        if len(ids) > max_prompt_tokens:
            skipped.setdefault(source, Counter())["longer_than_max_prompt_tokens"] += 1
            continue
        taken[source] += 1
        prompts.append(EvalPrompt(row["id"], source, ids))
    return prompts, {s: dict(sorted(c.items())) for s, c in sorted(skipped.items())}

"""data/eval/prompts.json: every request evaluate decoded, in decode order, as the exact token ids it decoded.

    {"prompts": [{"benchmark": str, "id": str, "turn": int, "split": "held_out" | "train" | "benchmark",
                  "prompt_ids": [int, ...]}, ...]}

A second turn's ids hold the target's own first reply, so a reader replays the requests without rendering a chat or
decoding anything first: the served check sends them to vLLM as they are. The reader refuses a file of another
shape in one line naming the entry, so a stale or hand-edited file never serves other prompts than it claims.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from dflashpipe.core.artifacts import write_json_atomic
from dflashpipe.core.errors import SourceError

SPLITS = ("held_out", "train", "benchmark")


@dataclass(frozen=True)
class DecodedPrompt:
    """One request evaluate decoded."""

    benchmark: str
    """The row it counts in: `held_out`, or a name of evaluate.benchmarks."""
    id: str
    turn: int
    split: str
    """held_out (the manifest's eval split), train (its first training shard) or benchmark."""
    prompt_ids: tuple[int, ...]


def write_prompts_file(path: Path | str, prompts: Iterable[DecodedPrompt]) -> None:
    write_json_atomic(path, {"prompts": [{**asdict(p), "prompt_ids": list(p.prompt_ids)} for p in prompts]})


def read_prompts_file(path: Path | str) -> list[DecodedPrompt]:
    path = Path(path)
    fix = "run `dvc repro evaluate`, which writes it"
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))["prompts"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{path}: not readable as evaluate's prompts ({exc!r}): {fix}") from None
    prompts = []
    for i, row in enumerate(rows):
        try:
            prompt = DecodedPrompt(
                str(row["benchmark"]),
                str(row["id"]),
                int(row["turn"]),
                row["split"],
                tuple(map(int, row["prompt_ids"])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceError(
                f"{path}: prompts[{i}]: {exc!r} (expected {list(DecodedPrompt.__annotations__)}): {fix}"
            ) from None
        if prompt.split not in SPLITS or not prompt.prompt_ids:
            raise SourceError(
                f"{path}: prompts[{i}] ({prompt.id}): split {prompt.split!r} not one of {SPLITS}, or "
                f"no prompt_ids: {fix}"
            )
        prompts.append(prompt)
    return prompts

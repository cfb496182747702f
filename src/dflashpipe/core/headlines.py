"""The one list of headline figures: what `report` shows first, what `history` shows by default, and which of
them evaluate's regression check holds against its baseline (metrics/eval_regression.json).

Below the stages (evaluate reads it, so dvc.yaml lists it among evaluate's deps) and above the pipeline's
output paths, which name the files.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflashpipe.core.pipeline import (
    BENCH_METRICS,
    EVAL_DETAIL,
    EVAL_METRICS,
    METRICS,
    SERVE_METRICS,
    TRAIN_METRICS,
    TRAIN_METRICS_DIR,
)

EVAL = EVAL_METRICS.as_posix()
EVAL_MORE = EVAL_DETAIL.as_posix()
"""Where evaluate's figures beyond a sweep's handful are (issue 46's lean metrics files)."""
TRAIN = TRAIN_METRICS.as_posix()
BENCH = BENCH_METRICS.as_posix()
SERVE = SERVE_METRICS.as_posix()
PER_PROMPT = (METRICS / "eval" / "speedup_per_prompt.json").as_posix()
TRAIN_TOKENS_PER_STEP = (TRAIN_METRICS_DIR / "plots" / "metrics" / "tokens_per_s.tsv").as_posix()


@dataclass(frozen=True)
class HeadlineSpec:
    """One headline figure: its label, the metrics file and dotted key that hold it, and where its spread is."""

    label: str
    file: str
    key: str
    spread: tuple[str, str, str] | None = None
    """(spread file, column, what one sample is): the samples report draws its min/median/max from."""
    check: str | None = None
    """Its name in metrics/eval_regression.json when the regression check compares it with the baseline."""
    throughput: bool = False
    """A throughput: only a throughput's drop can fail evaluate (tau is the drafter's quality, which a
    retrained drafter may trade)."""
    checked_at: tuple[str, str] | None = None
    """(file, dotted key) the check reads instead of (file, key): evaluate's own copy of another stage's figure,
    since the check compares evaluate's and bench's metrics files alone."""
    against: tuple[str, ...] = ()
    """Keys of the same file that say what the figure is measured against (speedup's baseline): where one of them
    differs, the figure's move is not like for like, and explain says so on the figure's line."""


HEADLINES: list[HeadlineSpec] = [
    HeadlineSpec(
        "tau (held-out; per request, then the mean over requests)",
        EVAL,
        "tau",
        (PER_PROMPT, "tau", "prompt"),
        check="tau",
    ),
    HeadlineSpec("tau pooled (all committed tokens over all verify steps)", EVAL, "tau_pooled"),
    # vLLM's on the same prompts, counted as evaluate's (the served check; absent where it did not run)
    HeadlineSpec("served tau (vLLM's, counted as evaluate's)", SERVE, "tau"),
    HeadlineSpec(
        "speedup (speculative vs target alone)",
        EVAL,
        "speedup",
        (PER_PROMPT, "speedup", "prompt"),
        check="speedup",
        throughput=True,
        against=("baseline.decoding", "baseline.dtype"),
    ),
    HeadlineSpec(
        "decode tokens/s with drafter",
        EVAL_MORE,
        "decode_tokens_per_s.speculative",
        check="decode_tokens_per_s",
        throughput=True,
    ),
    HeadlineSpec(
        "decode tokens/s without drafter",
        EVAL_MORE,
        "decode_tokens_per_s.target",
        against=("baseline.decoding", "baseline.dtype"),
    ),
    HeadlineSpec(
        "train tokens/s",
        TRAIN,
        "tokens_per_s",
        (TRAIN_TOKENS_PER_STEP, "tokens_per_s", "step"),
        check="train_tokens_per_s",
        throughput=True,
        checked_at=(EVAL_MORE, "train.tokens_per_s"),
    ),
    HeadlineSpec(
        "train-step tokens/s (bench: the step train runs)",
        BENCH,
        "tokens_per_s",
        check="train_step_tokens_per_s",
        throughput=True,
    ),
    HeadlineSpec("final loss", TRAIN, "final_loss"),
    # the contract: false is a bug (evaluate fails after writing its metrics, so the workspace shows it)
    HeadlineSpec("lossless (each token the argmax that verified it)", EVAL, "lossless"),
]
SLOT_ACCURACY = (TRAIN, "slot_accuracy")
"""Per-slot accuracy: one headline row per slot train's record carries (in its detail file: no sweep compares it)."""


def checked() -> dict[str, tuple[str, tuple[str, ...], bool]]:
    """The headlines the regression check compares: name -> (metrics file, path in it, is a throughput)."""
    found = {}
    for h in HEADLINES:
        if h.check is not None:
            file, key = h.checked_at or (h.file, h.key)
            found[h.check] = (file, tuple(key.split(".")), h.throughput)
    return found

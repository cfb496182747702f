"""What `dflashpipe report`'s page holds: the headline figures it reads, and the `RunReport` that report.py
builds from the pipeline's state and report_page.py lays out.

Below both (and below explain, which shows the same headline figures by default), so that no module of the
report imports another that imports it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflashpipe.pipeline import BENCH_METRICS, EVAL_METRICS, METRICS, TRAIN_METRICS, TRAIN_METRICS_DIR

EVAL = EVAL_METRICS.as_posix()
TRAIN = TRAIN_METRICS.as_posix()
BENCH = BENCH_METRICS.as_posix()
PER_PROMPT = (METRICS / "eval" / "speedup_per_prompt.json").as_posix()
TRAIN_TOKENS_PER_STEP = (TRAIN_METRICS_DIR / "plots" / "metrics" / "tokens_per_s.tsv").as_posix()

HEADLINES: list[tuple[str, str, str, tuple[str, str, str] | None]] = [
    # (label, metrics file, dotted key, (spread file, column, what one sample is) or None)
    ("tau (accepted tokens per verify step)", EVAL, "tau", (PER_PROMPT, "tau", "prompt")),
    ("speedup (speculative vs target alone)", EVAL, "speedup", (PER_PROMPT, "speedup", "prompt")),
    ("decode tokens/s with drafter", EVAL, "decode_tokens_per_s.speculative", None),
    ("decode tokens/s without drafter", EVAL, "decode_tokens_per_s.target", None),
    ("train tokens/s", TRAIN, "tokens_per_s", (TRAIN_TOKENS_PER_STEP, "tokens_per_s", "step")),
    ("train-step tokens/s (bench: the step train runs)", BENCH, "tokens_per_s", None),
    ("final loss", TRAIN, "final_loss", None),
]
SLOT_ACCURACY = (TRAIN, "slot_accuracy")
"""Per-slot accuracy: one headline row per slot the train metrics carry."""


@dataclass
class Headline:
    label: str
    file: str
    key: str
    value: Any
    head: str
    spread: str


@dataclass
class Chart:
    title: str
    source: str
    svg: str
    """A whole SVG document (with its xmlns): inlined as it is in HTML, written as a file for Markdown."""


@dataclass
class RunReport:
    revision: str
    stages: list[tuple[str, str, str, str]]
    """(stage, verdict, why, its outputs in the workspace) in dvc.yaml order."""
    headlines: list[Headline]
    charts: list[Chart]
    images: list[tuple[str, bytes]]
    explain_md: str
    error: str = ""

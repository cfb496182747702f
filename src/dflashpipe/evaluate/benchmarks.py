"""Benchmarks as evaluation sets: named prompt sets, each decoded and reported as its own row.

A benchmark is user turns only: no assistant turn is needed, and a multi-turn benchmark (MT-Bench) asks each
later turn after the target's own reply to the one before, as MT-Bench is run. Which sets ship offline, and
how a user file is read, is `read_benchmark`'s; rendering, decoding and counting are evaluate's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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


def read_benchmark(spec, root: Path | str = ".") -> tuple[list[BenchmarkPrompt], dict[str, int]]:
    """The first `spec.prompts` usable prompts of the benchmark `spec` (a BenchmarkSpec), in file order, and how
    many were skipped, per reason; each skipped one is also named in one line (file, line, field) on stderr."""
    raise NotImplementedError("issue 46: being built")

"""What `dflashpipe report`'s page holds: the `RunReport` that build.py builds from the pipeline's state
(its headline figures are dflashpipe.core.headlines') and page.py lays out.

Below both, so that no module of the report imports another that imports it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
class BenchmarkTable:
    """Rows = benchmarks, columns = the paper's figures, and one line per definition to say under it."""

    columns: list[str]
    rows: list[list[str]]
    notes: list[str]

    def lines(self) -> list[str]:
        """The table as aligned plain text, its notes below: what `dflashpipe report` prints."""
        cells = [self.columns, *self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        text = [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
            for row in cells
        ]
        return [line.rstrip() for line in text] + self.notes


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
    benchmarks: BenchmarkTable | None = None
    """The per-benchmark table (the DFlash paper's layout); None where evaluate has not run."""

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
class RunReport:
    revision: str
    stages: list[tuple[str, str, str, str]]
    """(stage, verdict, why, its outputs in the workspace) in dvc.yaml order."""
    headlines: list[Headline]
    charts: list[Chart]
    images: list[tuple[str, bytes]]
    explain_md: str
    error: str = ""

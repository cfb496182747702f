"""The vocabulary of `dflashpipe explain`: the verdicts a stage can get and the records a report is made of.

Invariant: plain data only. Nothing here reads a file, talks to DVC or git, or formats text; every other
module of the package speaks in these types, and a Report turns into JSON with `dataclasses.asdict` alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class StageVerdict(StrEnum):
    """What explain says of a stage (`Verdict.verdict`): a string, so a Report is JSON as it was."""

    UNCHANGED = "unchanged"
    DIRECT = "changed (direct)"
    DOWNSTREAM = "invalidated (downstream)"
    OUTPUTS = "outputs missing/modified"
    FROZEN = "frozen"
    ALWAYS = "always-changed"
    UNKNOWN = "unknown"


RESTORABLE = "restorable: `dvc checkout` brings the recorded bytes back from the cache"


@dataclass
class StageState:
    """What one state says about one stage: its definition and the hashes/values it ran with."""

    name: str
    cmd: str | None = None
    deps: dict[str, str | None] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    outs: dict[str, str | None] = field(default_factory=dict)
    metrics: list[str] = field(default_factory=list)
    frozen: bool = False
    always_changed: bool = False
    locked: bool = True
    """False when the state has no dvc.lock entry for the stage: its hashes are unknowable."""
    where: dict[str, str] = field(default_factory=dict)
    """Evidence: for each dep/param/out key, the lock entry (or computation) it came from."""


@dataclass
class Cause:
    kind: str  # "param", "dep", "cmd", "out", "machine"
    what: str  # the key or path
    old: Any
    new: Any
    evidence: str
    """Where each side was read, in full (the lock entry, the file and key, the live observation)."""
    stages: list[str] = field(default_factory=list)
    source: str = ""
    """The evidence's name, short enough for the first screen: `dvc.lock@HEAD vs params.yaml`."""


@dataclass
class Verdict:
    stage: str
    verdict: str
    causes: list[Cause] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    note: str = ""
    paths: list[str] = field(default_factory=list)
    """File-level chains from this stage to a changed input, e.g. `evaluate <- data/drafter (train) <-
    data/tokens (tokenize) <- data/manifest/train-00003.parquet (manifest: param ...)`. Only deps whose
    recorded hash changed are named (or, in a workspace not yet rerun, deps of a stage that will rerun)."""
    linked: list[str] = field(default_factory=list)
    """The upstream stages those paths go through: a metric is attributed only to causes along them."""


@dataclass
class MetricDelta:
    file: str
    key: str
    old: Any
    new: Any
    change: float | None
    stage: str
    causes: list[str]
    call: str | None = None
    """For a throughput figure: its `NoiseCall` (spread.compare, spread.compare_rates for a rate); None for other
    metrics. A move called noise or machine is attributed to no input."""
    spread: str = ""
    """Each side's range and repeats, the evidence for `call`."""
    machine: str = ""
    """For a timed figure no changed input reaches: what was recorded about the machine of each measurement (the
    fingerprint keys each side's dvc.lock ran the stage with, where they differ; the CPU time over wall time and
    the load average its spread recorded), so a move with no cause still says what the facts say."""
    control: str = ""
    """For a rate: what the control measured beside it says, in words ("the machine was 3.3x slower at B:
    control 41 ms vs 12 ms"), or "no control" when a side recorded none."""
    slowdown: float | None = None
    """The control's factor (`spread.slowdown`, after over before) when it was applied to this rate."""
    name: str = ""
    """How it is printed: its key, or `file:key` where another metrics file records the same key."""
    ran: dict[str, Any] = field(default_factory=dict)
    """For a timed headline: what the later side's own record says of how it ran, flattened (`comparison.RAN`:
    where its kernels came from, what compiled, each side's busy time), so the first screen can say it."""


def display_names(recorded: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """How to print each recorded (metrics file, key): the key alone, or `file:key` where another metrics
    file records the same key (train's and bench's `tokens_per_s`), so that a printed name is one figure."""
    recorded = list(dict.fromkeys(recorded))
    files = Counter(key for _, key in recorded)
    return {(file, key): key if files[key] == 1 else f"{file}:{key}" for file, key in recorded}


class NoiseCall(StrEnum):
    """What moved a throughput figure (`MetricDelta.call`), by spread's one rule (spread.compare; for a rate,
    spread.compare_rates); a string, so a Report is JSON as it was."""

    NOISE = "noise"
    CHANGE = "change"
    MACHINE = "machine"
    """A rate that changed by no more than the control measured beside it moved (spread.compare_rates)."""
    UNMEASURED = "unmeasured (no spread recorded)"


@dataclass
class EditedFile:
    path: str
    """Relative to the distribution's root, as its RECORD names it (`torch/fx/_symbolic_trace.py`)."""
    recorded: str
    now: str
    functions: list[str] | None
    """The definitions that differ from the wheel's copy; None when no copy of the wheel was found."""


@dataclass
class Machine:
    """The live machine against the workspace's fingerprint file, observed by the fingerprint stage's code."""

    stale: bool
    changes: list[Cause]
    invalid: list[str]
    """Stages whose params read a changed fingerprint key, and what is downstream of them (DAG order)."""
    edited: list[EditedFile]
    check: str
    """How the torch files were checked: a full check, or re-hashing only files whose size/mtime moved."""


@dataclass
class Report:
    a: str
    b: str
    root_causes: list[Cause]
    stages: list[Verdict]
    metrics: list[MetricDelta]
    machine: Machine | None = None
    """Set when one side is the workspace: the machine now may differ from what the fingerprint file says."""
    notes: list[str] = field(default_factory=list)
    """What could not be read and was left out (a metrics file that does not parse), one line each."""
    headlines_same: list[str] = field(default_factory=list)
    """The headline figures (`file:key`, headlines.HEADLINES) recorded on both sides with the same value."""
    as_committed: list[str] = field(default_factory=list)
    """Root causes (their `what`) whose input git holds alike on both sides: the earlier side's dvc.lock was
    recorded before that side committed it (no `dvc repro` since), not a change between the sides."""

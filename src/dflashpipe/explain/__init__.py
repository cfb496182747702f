"""`dflashpipe explain`: what changed between two states of the pipeline, what it
invalidated, what it did not, and what it cost — every statement with its evidence.

A state is a git revision, a DVC experiment name, or the workspace. A revision's
state is what its dvc.yaml and dvc.lock recorded; the workspace's is what DVC
computes from the files on disk now (DVC's own hashing, through its Python API).
Stages come from dvc.yaml, so a new stage needs no change here.

The package splits where the work does: `state` reads a state (the only module that
touches files, git and DVC), `comparison` compares two states along the DAG (pure),
`render` prints a Report, `machine` checks the live machine against the fingerprint file (with the
fingerprint stage's own code), `history` walks the commits, and `report` holds the types all share. `explain()`
below wires them together; `__all__` is the public API.
"""

from __future__ import annotations

from pathlib import Path

from dflashpipe.errors import DflashpipeError
from dflashpipe.explain.comparison import compare, metric_deltas, root_causes, topological, upstream_of
from dflashpipe.explain.machine import observe_machine
from dflashpipe.explain.render import cause_line, machine_lines, metric_line, print_text, to_json, to_markdown
from dflashpipe.explain.report import (
    ALWAYS,
    CHANGE,
    DIRECT,
    DOWNSTREAM,
    FROZEN,
    NOISE,
    OUTPUTS,
    RESTORABLE,
    UNCHANGED,
    UNKNOWN,
    UNMEASURED,
    Cause,
    EditedFile,
    Machine,
    MetricDelta,
    Report,
    StageState,
    Verdict,
)
from dflashpipe.explain.state import (
    PARAMS_FILE,
    WORKSPACE,
    State,
    parse_yaml,
    read_revision_state,
    read_workspace_state,
)

__all__ = [
    "ALWAYS",
    "CHANGE",
    "DIRECT",
    "DOWNSTREAM",
    "FROZEN",
    "NOISE",
    "OUTPUTS",
    "PARAMS_FILE",
    "RESTORABLE",
    "UNCHANGED",
    "UNKNOWN",
    "UNMEASURED",
    "WORKSPACE",
    "Cause",
    "EditedFile",
    "Machine",
    "MetricDelta",
    "Report",
    "StageState",
    "State",
    "Verdict",
    "cause_line",
    "machine_lines",
    "compare",
    "explain",
    "metric_deltas",
    "metric_line",
    "print_text",
    "read_revision_state",
    "read_workspace_state",
    "root_causes",
    "to_json",
    "to_markdown",
    "topological",
    "upstream_of",
]


def explain(a: str = "HEAD", b: str = WORKSPACE, root: str | Path = ".", machine: bool = True) -> Report:
    """Compare state `a` with state `b`; with `machine`, when one side is the workspace, observe this machine
    first (report.machine)."""
    from dvc.repo import Repo

    if WORKSPACE in (a, b):  # DVC's own error for a conflicted dvc.lock would not say what happened
        lock = Path(root) / "dvc.lock"
        if lock.is_file():
            parse_yaml(lock.read_text(encoding="utf-8"), f"{lock} (workspace)")
    try:
        repo = Repo(str(root))
    except Exception as exc:  # not a DVC repo
        raise DflashpipeError(f"{root}: not a DVC project ({exc})") from None
    with repo:
        sa = State(repo, a)
        old = read_revision_state(sa) if sa.rev else read_workspace_state(repo)[0]
        sb = State(repo, b)
        recorded: dict[str, dict[str, str | None]] = {}
        if sb.rev:
            new = read_revision_state(sb)
        else:
            new, recorded = read_workspace_state(repo)
        cache = repo.cache.local
        verdicts = compare(old, new, recorded, cache, sa.label, sb.label)
        metrics = metric_deltas(sa, sb, new, verdicts)
    roots = root_causes(verdicts)
    live = observe_machine(root, new) if machine and WORKSPACE in (sa.label, sb.label) else None
    return Report(sa.label, sb.label, roots, verdicts, metrics, live)

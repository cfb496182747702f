"""`dflashpipe explain`: what changed between two states of the pipeline, what it
invalidated, what it did not, and what it cost — every statement with its evidence.

A state is a git revision, a DVC experiment name, or the workspace. A revision's
state is what its dvc.yaml and dvc.lock recorded; the workspace's is what DVC
computes from the files on disk now (DVC's own hashing, through its Python API).
Stages come from dvc.yaml, so a new stage needs no change here.

The package splits where the work does: `state` reads a state (the only module that
touches files, git and DVC), `comparison` compares two states along the DAG (pure),
`answer` picks the first screen out of a Report (the causes, the stages to rerun, the headline figures),
`render` prints a Report, `machine` checks the live machine against the fingerprint file (with the
fingerprint stage's own code), `history` walks the commits, and `report` holds the types all share. `explain()`
below wires them together; `__all__` is the public API.
"""

from __future__ import annotations

from pathlib import Path

from dflashpipe.commands.explain.answer import Answer, answer
from dflashpipe.commands.explain.comparison import (
    compare,
    headlines_same,
    metric_deltas,
    root_causes,
    unreadable_metrics,
)
from dflashpipe.commands.explain.machine import attribute_to_machine, observe_machine, with_live_fingerprint
from dflashpipe.commands.explain.records import (
    RESTORABLE,
    Cause,
    EditedFile,
    Machine,
    MetricDelta,
    NoiseCall,
    Report,
    StageState,
    StageVerdict,
    Verdict,
)
from dflashpipe.commands.explain.render import (
    answer_lines,
    cause_line,
    machine_lines,
    metric_line,
    print_text,
    to_json,
    to_markdown,
)
from dflashpipe.commands.explain.state import LocalCache, State, as_committed, read_revision_state, read_workspace_state
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.pipeline import FINGERPRINT, PARAMS_FILE, Pipeline
from dflashpipe.core.revision import WORKSPACE, Revision, Revisions, Workspace, parse_yaml

__all__ = [
    "Answer",
    "answer",
    "answer_lines",
    "PARAMS_FILE",
    "RESTORABLE",
    "WORKSPACE",
    "Cause",
    "EditedFile",
    "Machine",
    "MetricDelta",
    "NoiseCall",
    "Report",
    "StageState",
    "StageVerdict",
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
]


def explain(a: str = "HEAD", b: str = WORKSPACE, root: str | Path = ".", machine: bool = True) -> Report:
    """Compare state `a` with state `b`; with `machine`, when one side is the workspace, observe this machine
    first (report.machine) and read the workspace's fingerprint keys off it, not off the fingerprint file: what
    the machine is now is what `dvc repro` will run every stage with (it reruns the fingerprint stage first), so
    the header, every verdict and the root causes come from the same facts.

    Revisions are read through one `git cat-file --batch` process; a dvc Repo (~0.5 s of imports and
    setup) is built only for the workspace, whose hashes only DVC computes."""
    root = Path(root)
    if not (root / ".dvc").is_dir():
        raise DflashpipeError(f"{root}: not a DVC project (no .dvc directory; run from the project root)")
    if WORKSPACE in (a, b):  # DVC's own error for a conflicted dvc.lock would not say what happened
        lock = root / "dvc.lock"
        if lock.is_file():
            parse_yaml(lock.read_text(encoding="utf-8"), f"{lock} (workspace)")
    with Revisions(root) as revisions:
        sa, sb = (None if name == WORKSPACE else revisions.at(name) for name in (a, b))
        if sa is not None and sb is not None:
            old, new = read_revision_state(sa), read_revision_state(sb)
            verdicts = compare(old, new, {}, LocalCache(root), a, b)
            return _report(root, a, b, sa, sb, new, verdicts)
        from dvc.repo import Repo

        with Repo(str(root)) as repo:
            workspace, recorded = read_workspace_state(repo)
            live = observe_machine(root) if machine else None
            if live is not None:
                workspace = with_live_fingerprint(workspace, live, _fingerprint_keys(root))
            sa, sb = sa or Workspace(root), sb or Workspace(root)
            old = read_revision_state(sa) if isinstance(sa, Revision) else workspace
            new = read_revision_state(sb) if isinstance(sb, Revision) else workspace
            recorded = recorded if isinstance(sb, Workspace) else {}
            verdicts = compare(old, new, recorded, repo.cache.local, a, b)
            if live is not None:
                attribute_to_machine(verdicts, live)
            return _report(root, a, b, sa, sb, new, verdicts, live and live.machine)


def _report(root: Path, a: str, b: str, sa: State, sb: State, new, verdicts, machine: Machine | None = None) -> Report:
    """The verdicts with what they did to the metrics; a metrics file that does not parse is left out and said,
    never a reason to withhold the stage verdicts."""
    metrics = metric_deltas(sa, sb, new, verdicts)
    report = Report(a, b, root_causes(verdicts), verdicts, metrics, machine)
    report.notes = unreadable_metrics([sa, sb], new)
    report.headlines_same = headlines_same(sa, sb, metrics)
    report.as_committed = as_committed(root, sa, sb, report.root_causes)
    return report


def _fingerprint_keys(root: Path) -> dict[str, list[str]]:
    """Each stage's fingerprint keys as the workspace's dvc.yaml declares them."""
    specs = Pipeline.read(root).specs
    return {name: [key for file, key in spec.params if file == str(FINGERPRINT)] for name, spec in specs.items()}

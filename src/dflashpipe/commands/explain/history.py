"""`dflashpipe history`: every commit of a range, and the DVC experiments on them, each with its headline
metrics and, against its parent, the root causes explain would give and where a metric moved beyond noise.

Beside each step's moves against its parent, `levels` marks where a followed metric's level changed over
the commit line: a commit whose figure moved beyond noise (the same rules, the control taken into account)
from the level the commits before it held, and whose next commit holds the new level too. A drift that no
single step shows still crosses the level, and a one-commit blip that the next commit undoes is no level.

It reads only git: each commit's dvc.yaml, dvc.lock and committed metrics files (one `git cat-file --batch`
process for all of them), the files each commit changed (one `git log`), and the DVC cache's `.dir` listings
for file-level paths. Nothing is rerun or hashed, and no dvc Repo is built (its imports alone take most of a
second), so a whole history takes well under two seconds. A step is compared by explain's own `compare`,
`root_causes` and `metric_deltas`.

A commit can change a stage's code or params without re-running it: its dvc.lock and metrics then describe
the older code, and comparing locks sees nothing. Such a step is marked `unrecorded`, from facts alone: a
file under one of the stage's deps (or a params key it names) changed in the commit, and the commit's
dvc.lock records the same hash (or value) for it as the parent's.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashpipe.commands.explain.comparison import (
    compare,
    control,
    figure,
    is_rate,
    is_throughput,
    metric_deltas,
    root_causes,
)
from dflashpipe.commands.explain.records import Cause, MetricDelta, NoiseCall, StageState, Verdict, display_names
from dflashpipe.commands.explain.state import LocalCache, read_revision_state
from dflashpipe.core import spread
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.headlines import HEADLINES
from dflashpipe.core.metrics import read_metrics
from dflashpipe.core.pipeline import Pipeline, lies_under
from dflashpipe.core.pipeline import _param_value as param_value  # the value as the stage keys read it
from dflashpipe.core.revision import (
    Revision,
    Revisions,
    commit_of,
    experiment_refs,
    git,
    no_commit_reason,
    unknown_revision,
)

LOCK = "dvc.lock"


@dataclass
class Unrecorded:
    """A stage whose inputs changed in a commit that did not re-run it: its dvc.lock entry and metrics there
    describe the older inputs."""

    stage: str
    changed: list[str]
    """The changed inputs: files under its deps (as git lists them) and `params-file:key` names."""

    def line(self) -> str:
        return f"{', '.join(self.changed)} changed, dvc.lock not re-run for {self.stage}"


@dataclass
class Measured:
    """A metric as one state recorded it: its value, and its spread and control when it is a timed figure."""

    value: Any
    spread: spread.Spread | None = None
    control: spread.Control | None = None

    @classmethod
    def of(cls, flat: dict, key: str) -> Measured | None:
        """`key` of a flattened metrics dict; None when it is not recorded."""
        if key not in flat:
            return None
        return cls(flat[key], figure(flat, key), control(flat, key) if is_rate(key) else None)

    def describe(self) -> str:
        return f"{_value(self.value)}" if self.spread is None else self.spread.describe()


def moved(key: str, reference: Measured, other: Measured, far: Measured | None = None) -> tuple[bool, str]:
    """Whether `other` moved away from `reference`, and the call that says so: for a timed figure, ranges
    that do not overlap (`spread.compare`; for a rate with its control, `spread.compare_rates`); a timed
    figure without spreads goes to the nearer of `reference` and `far` when `far` is given (else: not moved,
    unmeasured); any other metric moved when its value differs (the stages are deterministic)."""
    if is_throughput(key, {}, {}) or reference.spread is not None:
        call = (
            spread.compare_rates(reference.spread, other.spread, reference.control, other.control)
            if is_rate(key)
            else spread.compare(reference.spread, other.spread)
        )
        if call != "unmeasured":
            return call == "change", call
        values = [m.value for m in (reference, other, far) if m is not None]
        if far is not None and all(json_number(v) is not None for v in values):
            nearer_far = abs(other.value - far.value) < abs(other.value - reference.value)
            return nearer_far, f"unmeasured: nearer {'BAD' if nearer_far else 'GOOD'}'s value"
        return False, NoiseCall.UNMEASURED  # a timed figure without a range on both sides cannot be told from noise
    return (True, "differs") if other.value != reference.value else (False, "equal")


@dataclass
class Level:
    """Where a followed metric's level changed on the commit line."""

    metric: str
    label: str
    """The first commit at the new level."""
    since: str
    """The commit whose figure held the old level (the last change-point, or the first record)."""
    old: str
    new: str
    call: str
    confirmed: bool
    """The next commit holds the new level too (False: the last commit of the range, nothing after it yet)."""

    def line(self, name: str) -> str:
        held = "" if self.confirmed else "; the last commit: not confirmed by a later one"
        return f"level: {name} {self.old} (since {self.since}) -> {self.new} [{self.call}{held}]"


@dataclass
class Step:
    """One commit (or experiment) against its parent (or baseline commit)."""

    rev: str
    label: str
    """Short sha, or `exp <name>` for an experiment."""
    subject: str
    parent: str | None
    """The label it is compared with; None for the first recorded commit (nothing before it)."""
    metrics: dict[str, Any]
    """The selected metrics as committed (`file:key` -> value; None where this commit has none)."""
    deltas: list[MetricDelta] = field(default_factory=list)
    root_causes: list[Cause] = field(default_factory=list)
    stages: list[Verdict] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    """Selected metrics that moved beyond noise here: a timed figure whose ranges do not overlap, or any
    other metric whose value changed (the stages are deterministic)."""
    unrecorded: list[Unrecorded] = field(default_factory=list)
    """Stages whose code or params changed here while dvc.lock kept the older record."""
    measured: dict[str, Measured] = field(default_factory=dict)
    """The selected metrics with their spreads and controls (`file:key` -> Measured), where recorded."""
    levels: list[Level] = field(default_factory=list)
    """Followed metrics whose level changed at this commit (`change_points`)."""


@dataclass
class History:
    since: str | None
    metrics: list[str]
    steps: list[Step]
    names: dict[str, str] = field(default_factory=dict)
    """How each selected metric (`file:key`) is printed: its key, or `file:key` where another metrics file of
    the range records the same key."""

    def name(self, metric: str) -> str:
        return self.names.get(metric, metric.split(":", 1)[1])


def _resolve(root: Path, name: str, experiments: dict[str, str]) -> str:
    found = commit_of(root, name) or experiments.get(name)
    if found is None:
        raise unknown_revision(name, root)
    return found


def _experiments(root: Path) -> dict[str, list[tuple[str, str]]]:
    """baseline sha -> [(experiment name, its commit)], as `dvc exp list` reads them: refs parsed by DVC."""
    refs = experiment_refs(root)
    if not refs:
        return {}
    from dvc.repo.experiments.refs import ExpRefInfo  # imported only when there are experiments (~0.5 s)

    found: dict[str, list[tuple[str, str]]] = {}
    for sha, ref in refs:
        try:
            info = ExpRefInfo.from_ref(ref)
        except Exception:  # not an experiment ref (a stash, a temp ref): `dvc exp list` skips these too
            continue
        if info.name and info.baseline_sha:
            found.setdefault(info.baseline_sha, []).append((info.name, sha))
    return {k: sorted(v) for k, v in found.items()}


def _commits(root: Path, since: str | None, experiments: dict[str, list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """(sha, subject), oldest first, first-parent from `since` (excluded) to HEAD, or from the first commit
    that has a dvc.lock."""
    if since is not None:
        names = {name: sha for exps in experiments.values() for name, sha in exps}
        spec = f"{_resolve(root, since, names)}..HEAD"
    else:
        added = git(root, "log", "--first-parent", "--reverse", "--format=%H", "HEAD", "--", LOCK).split()
        if not added:
            raise DflashpipeError(f"{root}: no commit on HEAD's first-parent line has a {LOCK}")
        spec = f"{added[0]}^..HEAD" if commit_of(root, f"{added[0]}^") else "HEAD"
    out = git(root, "log", "--first-parent", "--reverse", "--format=%H%x00%s", spec)
    commits = [tuple(line.split("\0", 1)) for line in out.splitlines() if line]
    if not commits:
        raise DflashpipeError(f"no commits in {since}..HEAD: {since!r} is HEAD or a descendant of it")
    return commits


def _changed_paths(root: Path, commits: list[tuple[str, str]]) -> dict[str, list[str]]:
    """sha -> the paths it changed against its first parent, for every commit of the range: one `git log`."""
    spec = f"{commits[0][0]}^..{commits[-1][0]}" if commit_of(root, f"{commits[0][0]}^") else commits[-1][0]
    out = git(root, "log", "--first-parent", "--diff-merges=first-parent", "--name-only", "--format=%x00%H", spec)
    changed: dict[str, list[str]] = {}
    for block in out.split("\0")[1:]:
        sha, *paths = block.splitlines()
        changed[sha] = [path for path in paths if path]
    return changed


def _metric_files(commit: Revision) -> list[str]:
    stages = read_revision_state(commit)
    return [path for st in stages.values() for path in st.metrics]


def recorded_metrics(commits: list[Revision]) -> dict[str, str]:
    """`file:key` -> file, for every key of every metrics file any of `commits` records."""
    known: dict[str, str] = {}
    for commit in commits:
        for path in _metric_files(commit):
            for key in read_metrics(commit, path):
                known.setdefault(f"{path}:{key}", path)
    return known


def selected_metrics(known: dict[str, str], wanted: list[str] | None) -> list[str]:
    """`file:key` names of the metrics to show: `wanted` (bare keys or file:key), else the headlines."""
    if not wanted:
        return [f"{h.file}:{h.key}" for h in HEADLINES if f"{h.file}:{h.key}" in known]
    chosen = []
    for name in wanted:
        matches = [k for k in known if k == name or k.split(":", 1)[1] == name]
        if not matches:
            bare = sorted({k.split(":", 1)[1] for k in known})
            near = difflib.get_close_matches(name, bare, n=5, cutoff=0.5)
            raise DflashpipeError(
                f"no state in this range records metric {name!r}; "
                + (f"nearby keys: {', '.join(near)}" if near else f"keys recorded: {', '.join(bare[:20]) or 'none'}")
            )
        chosen += [m for m in matches if m not in chosen]
    return chosen


def history(since: str | None = None, metrics: list[str] | None = None, root: str | Path = ".") -> History:
    root = Path(root)
    reason = no_commit_reason(root)
    if reason is not None:
        raise DflashpipeError(f"{root}: {reason}")
    experiments = _experiments(root)
    commits = _commits(root, since, experiments)
    cache = LocalCache(root)
    with Revisions(root) as objects:
        parent_sha = None if since is None else commit_of(root, f"{commits[0][0]}^")
        states = [Revision(objects, sha, sha[:8]) for sha, _ in commits]
        exp_states = {
            sha: [Revision(objects, exp, f"exp {name}") for name, exp in experiments.get(sha, [])] for sha, _ in commits
        }
        every = [c for c in states if c.read_text(LOCK) is not None]
        every += [e for es in exp_states.values() for e in es]
        known = recorded_metrics(every)
        keys = selected_metrics(known, metrics)
        names = display_names(tuple(k.split(":", 1)) for k in known)
        changed = _changed_paths(root, commits)
        steps = []
        previous = Revision(objects, parent_sha, parent_sha[:8]) if parent_sha else None
        for commit, (_, subject) in zip(states, commits, strict=True):
            steps.append(_step(commit, subject, previous, keys, cache, changed.get(commit.rev, [])))
            for exp in exp_states[commit.rev]:
                exp_changed = git(root, "diff", "--name-only", commit.rev, exp.rev).split()
                steps.append(_step(exp, f"experiment on {commit.label}", commit, keys, cache, exp_changed))
            previous = commit
    for key in keys:
        change_points(steps, key)
    return History(since, keys, steps, {k: names[tuple(k.split(":", 1))] for k in keys})


def change_points(steps: list[Step], metric: str) -> None:
    """Mark in `steps` (commits only, oldest first) where `metric`'s level changed (see the module docstring)."""
    key = metric.split(":", 1)[1]
    line = [s for s in steps if metric in s.measured and not s.label.startswith("exp ")]
    if not line:
        return
    level, since = line[0].measured[metric], line[0].label
    for i, step in enumerate(line[1:], start=1):
        now = step.measured[metric]
        away, call = moved(key, level, now)
        if not away:
            continue
        after = line[i + 1].measured[metric] if i + 1 < len(line) else None
        if after is not None and (not moved(key, level, after)[0] or moved(key, now, after)[0]):
            continue  # the next commit is back at the level, or elsewhere again: no level held here
        step.levels.append(Level(metric, step.label, since, level.describe(), now.describe(), call, after is not None))
        level, since = now, step.label


def _step(commit: Revision, subject: str, parent: Revision | None, keys: list[str], cache, changed: list[str]) -> Step:
    files = {path: read_metrics(commit, path) for path in {k.split(":", 1)[0] for k in keys}}
    values = {k: files[k.split(":", 1)[0]].get(k.split(":", 1)[1]) for k in keys}
    step = Step(commit.rev, commit.label, subject, parent.label if parent else None, values)
    for k in keys:
        found = Measured.of(files[k.split(":", 1)[0]], k.split(":", 1)[1])
        if found is not None:
            step.measured[k] = found
    if parent is None or parent.read_text(LOCK) is None or commit.read_text(LOCK) is None:
        return step
    old, new = read_revision_state(parent), read_revision_state(commit)
    verdicts = compare(old, new, {}, cache, parent.label, commit.label)
    step.stages = verdicts
    step.root_causes = root_causes(verdicts)
    step.deltas = metric_deltas(parent, commit, new, verdicts)
    step.unrecorded = unrecorded(commit, parent, old, new, changed)
    for d in step.deltas:
        name = f"{d.file}:{d.key}"
        if name in keys and (d.call == NoiseCall.CHANGE or d.call is None):
            step.moved.append(name)
    return step


def unrecorded(
    commit: Revision, parent: Revision, old: dict[str, StageState], new: dict[str, StageState], changed: list[str]
) -> list[Unrecorded]:
    """Stages with an input that changed in `commit` (a file under a dep of its dvc.yaml entry there, the deps and
    params the stage keys read, or a params key it names) while the commit's dvc.lock records that input as
    the parent's did. Inputs git does not hold (DVC outputs under data/) change only by a run: never listed."""
    found = []
    for name, spec in Pipeline.of(commit.read_yaml("dvc.yaml"), f"dvc.yaml@{commit.label}").specs.items():
        now, before = new.get(name), old.get(name)
        if now is None or before is None or not now.locked or not before.locked:
            continue  # no record on one side: compare() already says the stage is unknowable there
        inputs = []
        for dep in spec.deps:
            files = [p for p in changed if lies_under(p, dep)]
            if files and now.deps.get(dep) == before.deps.get(dep):
                inputs += files
        for file in sorted({f for f, _ in spec.params}):
            if file not in changed:
                continue
            values, was = commit.read_yaml(file) or {}, parent.read_yaml(file) or {}
            for key in (k for f, k in spec.params if f == file):
                recorded, recorded_before = now.params.get(file, {}).get(key), before.params.get(file, {}).get(key)
                if param_value(values, key) != param_value(was, key) and recorded == recorded_before:
                    inputs.append(f"{file}:{key}")
        if inputs:
            found.append(Unrecorded(name, inputs))
    return found


def history_lines(h: History) -> list[str]:
    """Plain text: one block per step, the moves beyond noise marked `<<`."""
    lines = []
    for s in h.steps:
        lines.append(f"{s.label}  {s.subject}" + (f"  (vs {s.parent})" if s.parent else "  (first record)"))
        shown = ", ".join(f"{h.name(k)}={_value(v)}" for k, v in s.metrics.items() if v is not None)
        lines.append(f"    metrics: {shown or 'none committed'}")
        for u in s.unrecorded:
            lines.append(f"    unrecorded: {u.line()} (its committed dvc.lock and metrics describe the older inputs)")
        for d in s.deltas:
            name = f"{d.file}:{d.key}"
            if name not in h.metrics:
                continue
            mark = "  << moved" if name in s.moved else ""
            call = f" [{d.call}: {d.spread}]" if d.call in tuple(NoiseCall) else ""
            call += f" ({d.control})" if d.control else ""
            why = f"; inputs changed on its path: {', '.join(d.causes)}" if d.causes else ""
            lines.append(f"    {h.name(name)}: {_value(d.old)} -> {_value(d.new)}{call}{why}{mark}")
        for c in s.root_causes:
            lines.append(
                f"    cause: {c.kind} {c.what}: {_value(c.old)} -> {_value(c.new)} (hits {', '.join(c.stages)})"
            )
        lines += [f"    {level.line(h.name(level.metric))}" for level in s.levels]
    return lines


def history_markdown(h: History) -> str:
    head = ["rev", "subject", *[h.name(k) for k in h.metrics], "root causes"]
    lines = ["## History", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in h.steps:
        cells = [f"`{s.label}`", s.subject.replace("|", "\\|")]
        for k in h.metrics:
            delta = next((d for d in s.deltas if f"{d.file}:{d.key}" == k), None)
            cell = _value(s.metrics.get(k))
            if delta is not None and delta.call:
                cell += f" ({delta.call})"
            cells.append(f"**{cell}**" if k in s.moved else cell)
        causes = [f"**unrecorded**: {u.line()}" for u in s.unrecorded]
        causes += [f"{c.what}: {_value(c.old)} -> {_value(c.new)}" for c in s.root_causes]
        causes += [f"**{level.line(h.name(level.metric))}**" for level in s.levels]
        cells.append("; ".join(causes).replace("|", "\\|") or ("" if s.parent else "first record"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Bold: moved beyond noise against the row's parent (a timed figure's ranges do not overlap)."]
    return "\n".join(lines) + "\n"


def _value(v: Any) -> str:
    if isinstance(v, str) and (len(v) == 32 or v.endswith(".dir")):
        return v[:12]
    text = str(v)
    return text if len(text) <= 60 else text[:57] + "..."

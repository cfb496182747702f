"""`dflashpipe explain --verify METRIC`: each root cause explain finds on METRIC's path, proven by intervention.

For every cause reaching METRIC's stage, the pipeline runs with that cause alone reverted to A (a param set
back, a code or data dep restored from A's commit, a deleted output restored from the DVC cache), and METRIC
is measured there and in the baseline (B as it is), the arms interleaved round by round so that load on the
machine falls on all of them alike. Each arm's runs are pooled by `spread.pool` and judged against the
baseline by `explain.history.moved` (a rate with its control), the rules bisect uses too. Causes that no run can
revert (the CPU or GPU model, keys of a file a stage writes from the machine) are listed with their evidence.

A metric may name a probe (`PROBES`): a cheaper stage running the same code at the same shapes, which the arms
measure instead (train's rate: bench, the data-free drafter step; seconds a run where training costs hours). A
cause the probe's stage does not read cannot move it and is said to lie outside the probe. The cost (arms x runs x
the measured stage's recorded time) is printed before any arm starts and refused over `time_budget`.

The machine's causes are reverted too, one arm per fingerprint group: a variable (`env`, `threads.env`) in the
arm's environment; an installed package (an edited torch file, another torch build, any locked version) by running
the arm in a pristine environment built from A's lock (`rerun.pristine`). What no lock or variable restores (the
CPU, the GPU, the driver) is said to need another machine.

Invariant: the workspace is never touched. Each arm is a scratch tree of B (`rerun.tree`: a git worktree sharing
the project's DVC cache, `dvc` run there as a subprocess), with the workspace's uncommitted edits and missing
outputs replayed into it — what `dvc exp run --temp` does with its clones under .dvc/tmp/exps, done here because
`exp run -S` can set a param but cannot restore a file from another commit or keep an output missing. Arms
save what they compute into that cache, so a stage any run ever computed (the run cache) is restored, never
recomputed; the measured runs alone are forced and commit nothing.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashpipe.commands.explain import RESTORABLE, WORKSPACE, Cause, Report, StageVerdict, cause_line, explain
from dflashpipe.commands.explain.history import Measured, moved
from dflashpipe.commands.explain.state import State, read_revision_state
from dflashpipe.commands.rerun.pristine import LOCKS, pinned
from dflashpipe.commands.rerun.tree import ScratchTree, pooled, shared_cache
from dflashpipe.core import spread
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import lookup, read_metrics, read_record
from dflashpipe.core.pipeline import FINGERPRINT, TRAIN_METRICS, upstream_first, upstream_of
from dflashpipe.core.revision import Revisions, Workspace, commit_of, git, has_file, run_git

MEASURED, FIXED, OVER_BUDGET, FAILED = "measured", "cannot revert here", "over budget", "failed"
OUTSIDE = "outside the probe"

PROBES: dict[str, str] = {f"{TRAIN_METRICS.as_posix()}:tokens_per_s": "metrics/bench.json:tokens_per_s"}
"""metric -> its probe, measured by the arms in its place (`--full`: the metric's own stage). bench times the step
train runs (the same code, model and compile settings, train's shapes) on synthetic inputs: no data, no target
forward over a corpus, seconds a run."""

TIME_BUDGET_S = 1800.0
"""A verification estimated to cost more than this is refused before any arm starts (`--time-budget`)."""

VARIABLE_GROUPS = ("env", "threads.env", "threads.other_env")
"""Fingerprint keys holding environment variables (name -> value): reverted by setting them in the arm."""

MACHINE_ONLY = ("torch.cpu_capability",)
"""Fingerprint keys of a locked package's group that the package does not decide: the CPU's."""


@dataclass
class Intervention:
    cause: Cause
    action: str
    """What the arm does ("revert param ... to 40"), or why no arm can (for FIXED)."""
    status: str
    figure: dict | None = None
    """The arm's METRIC: median, low, high, repeats (pooled over its runs)."""
    change: float | None = None
    """Relative to the baseline's median."""
    call: str | None = None
    """Why it moved or not against the baseline (`explain.history.moved`): noise, change or machine for a timed
    figure, differs or equal for a deterministic one."""
    moved: bool | None = None
    """Whether the arm's figure moved away from the baseline's by that rule."""
    share: float | None = None
    """How much of the gap from the baseline back to A's recorded figure this one reversion closes."""
    seconds: float | None = None
    """What the arm cost: preparing it and its measured runs."""
    note: str = ""
    causes: list[Cause] = field(default_factory=list)
    """Every cause this arm reverts: `cause` alone, or the fingerprint keys of one group (one OMP_NUM_THREADS
    moves `threads.env` and `threads.torch_intra_op`; one edited file `torch.files_edited` and `files_ok`)."""
    variables: dict[str, str | None] = field(default_factory=dict)
    """Environment variables the arm runs with (None: unset), A's values."""
    pristine: bool = False
    """The arm runs in an environment built from A's lock."""


@dataclass
class Target:
    """What the arms measure: a metric (file, key), the stage that writes it, and the time one run of it took as
    recorded (its timed part: the spread's wall seconds), None where no record says."""

    metric: str
    file: str
    key: str
    stage: str
    seconds: float | None


@dataclass
class Verification:
    metric: str
    file: str
    key: str
    stage: str
    a: str
    b: str
    runs: int
    """Measured runs per arm, interleaved with the other arms'."""
    recorded_a: Any
    recorded_b: Any
    baseline: dict | None
    baseline_seconds: float | None
    interventions: list[Intervention] = field(default_factory=list)
    together: Intervention | None = None
    """Every revertible cause reverted at once (when more than one ran): what the causes explain between them."""
    report: Report | None = None
    own: Target | None = None
    """The metric's own stage, as a run of it was recorded."""
    probe: Target | None = None
    """What the arms measure instead (PROBES), None: the metric itself."""
    probe_agreement: str = ""
    """Whether the probe's record moved with the metric's between A and B (within their spreads)."""
    estimate_s: float | None = None
    """Arms x runs x the measured stage's recorded time, said before the first arm started."""
    recorded_probe_a: Any = None

    @property
    def measured(self) -> Target:
        return self.probe or self.own


def verify(
    metric: str,
    a: str = "HEAD",
    b: str = WORKSPACE,
    root: str | Path = ".",
    budget: int | None = None,
    runs: int = 3,
    progress: bool = True,
    full: bool = False,
    time_budget: float = TIME_BUDGET_S,
    probes: dict[str, str] = PROBES,
) -> Verification:
    """Revert each cause reaching `metric` alone (at most `budget` of them) and measure it, or its probe unless
    `full`, `runs` times against the baseline B, interleaved; refused before any run when the estimated cost is over
    `time_budget` seconds."""
    root = Path(root).resolve()
    if a == WORKSPACE:
        raise DflashpipeError("--verify reverts causes to A, which must be a recorded state (a revision or experiment)")
    report = explain(a, b, root, machine=(root / FINGERPRINT).is_file())  # no fingerprint file: nothing to check
    with Revisions(root) as revisions:
        sa, sb = revisions.at(a), Workspace(root) if b == WORKSPACE else revisions.at(b)
        stages = read_revision_state(sb)
        own = _target(metric, sa, sb, stages)
        probe = None if full or own.metric not in probes else _target(probes[own.metric], sa, sb, stages)
        recorded_a, recorded_b = read_metrics(sa, own.file).get(own.key), read_metrics(sb, own.file).get(own.key)
        agreement = _agreement(own, probe, sa, sb) if probe else ""
        recorded_probe_a = read_metrics(sa, probe.file).get(probe.key) if probe else recorded_a
        base_rev = sb.rev or commit_of(root, "HEAD")
    found = Verification(
        metric, own.file, own.key, own.stage, report.a, report.b, runs, recorded_a, recorded_b, None, None
    )
    found.report, found.own, found.probe, found.probe_agreement = report, own, probe, agreement
    found.recorded_probe_a = recorded_probe_a
    producers = {out: st.name for st in stages.values() for out in st.outs}
    seen_by_probe = {(c.kind, c.what) for c in causes_reaching(report, probe.stage)} if probe else None
    for group in _grouped(causes_reaching(report, own.stage)):
        if seen_by_probe is not None and not any((c.kind, c.what) in seen_by_probe for c in group):
            reason = f"stage {probe.stage} does not read it: the probe cannot see it (--full measures {own.stage})"
            found.interventions.append(Intervention(group[0], reason, OUTSIDE, causes=group))
            continue
        found.interventions.append(_plan(group, sa.rev, root, producers))
    planned = [i for i in found.interventions if i.status == MEASURED]
    for i in planned[budget:] if budget is not None else []:
        i.status = OVER_BUDGET
    planned = planned[:budget] if budget is not None else planned
    if len(planned) > 1 and not any(i.status == OVER_BUDGET for i in found.interventions):
        every = " + ".join(i.cause.what for i in planned)
        found.together = Intervention(
            Cause("together", every, None, None, "each cause above"),
            "revert all of them",
            MEASURED,
            causes=[c for i in planned for c in i.causes],
            variables={k: v for i in planned for k, v in i.variables.items()},
            pristine=any(i.pristine for i in planned),
        )
    if planned:
        arms = 1 + len(planned) + (found.together is not None)
        _check_cost(found, arms, time_budget)
        _run_arms(found, planned, root, (sa.rev, base_rev), b == WORKSPACE, stages, shared_cache(root), progress)
    return found


def _target(metric: str, sa: State, sb: State, stages) -> Target:
    file, key, stage = _locate(metric, sa, sb, stages)
    seconds = None
    for state in (sb, sa):  # B's run first: the one the arms repeat
        record = read_record(state, file) or {}
        seconds = json_number(lookup(record, f"{key}{spread.SUFFIX}.machine.wall_s"))
        if seconds is None:  # a figure that is not timed (tau): the longest timed part of the same run
            seconds = max(_timed_parts(record, set(stages) - {stage}), default=None)
        if seconds is not None:
            break
    return Target(f"{file}:{key}", file, key, stage, seconds)


def _timed_parts(record: Any, others: set[str]) -> list[float]:
    """The wall seconds of every spread in a stage's record, but those it copies from another stage (kept under
    that stage's name: evaluate's `train`)."""
    if not isinstance(record, dict):
        return []
    found = []
    for name, value in record.items():
        if name in others:
            continue
        wall = json_number(lookup(value, "machine.wall_s")) if name.endswith(spread.SUFFIX) else None
        found += [wall] if wall is not None else _timed_parts(value, others)
    return found


def _check_cost(found: Verification, arms: int, time_budget: float) -> None:
    """The estimate, said before anything runs; over `time_budget`, a refusal that names what allows it."""
    m = found.measured
    if m.seconds is None:
        if time_budget != float("inf"):
            raise DflashpipeError(
                f"--verify {found.metric}: no record of stage {m.stage} says how long a run takes, so the cost of "
                f"{arms} arms x {found.runs} runs is unknown: pass --time-budget inf to run it anyway"
            )
        return
    found.estimate_s = round(arms * found.runs * m.seconds, 1)
    if found.estimate_s > time_budget:
        instead = "" if found.probe else f"; {m.metric} has no probe: each arm runs stage {m.stage}"
        raise DflashpipeError(
            f"--verify {found.metric}: {_cost_text(found, arms)}, over --time-budget {time_budget:.0f} s{instead}: "
            f"pass --time-budget {found.estimate_s:.0f} to run it, or --budget N for fewer causes"
        )


def _cost_text(found: Verification, arms: int) -> str:
    m = found.measured
    return (
        f"estimated {found.estimate_s:.0f} s = {arms} arms x {found.runs} runs x {m.seconds:.1f} s "
        f"(stage {m.stage}'s timed run as recorded; each run's start and each arm's preparation come on top)"
    )


def _agreement(own: Target, probe: Target, sa: State, sb: State) -> str:
    """Whether the records of A and B show the probe moving with the metric (each judged within its spreads)."""
    moves = []
    for t in (own, probe):
        ra, rb = Measured.of(read_metrics(sa, t.file), t.key), Measured.of(read_metrics(sb, t.file), t.key)
        if ra is None or rb is None or not json_number(ra.value) or json_number(rb.value) is None:
            return f"the records do not hold {t.metric} on both sides: no check of the probe against the metric"
        went, call = moved(t.key, ra, rb)
        moves.append((went, f"{t.metric} {(json_number(rb.value) / json_number(ra.value) - 1):+.0%} ({call})"))
    if moves[0][0] != moves[1][0]:
        together = "they did not move together: trust --full over the probe"
    else:
        together = "they moved together" if moves[0][0] else "neither moved between the two records"
    return f"recorded A -> B: {moves[0][1]}, probe {moves[1][1]}: {together}"


def _locate(metric: str, sa: State, sb: State, stages) -> tuple[str, str, str]:
    """(metrics file, key, stage) of `metric` (a key, or file:key), from B's and A's metrics files."""
    wanted_file, _, wanted_key = metric.rpartition(":")
    known: dict[str, str] = {}
    matches = []
    for st in stages.values():
        for path in st.metrics:
            keys = set(read_metrics(sb, path)) | set(read_metrics(sa, path))
            if wanted_key in keys and wanted_file in ("", path):
                matches.append((path, wanted_key, st.name))
            known.update({k: path for k in keys if not any(p.endswith(spread.SUFFIX) for p in k.split("."))})
    if len(matches) == 1:
        return matches[0]
    if matches:
        named = ", ".join(f"{path}:{key} (stage {name})" for path, key, name in matches)
        raise DflashpipeError(f"{metric!r} is recorded by {len(matches)} metrics files; name one of: {named}")
    near = difflib.get_close_matches(wanted_key, list(known), n=5, cutoff=0.5)
    listed = ", ".join(f"{k} ({known[k]})" for k in near or sorted(known)[:20]) or "none"
    which = "nearby keys" if near else "keys recorded"
    raise DflashpipeError(f"no metrics file of {sb.label} or {sa.label} records {metric!r}; {which}: {listed}")


def causes_reaching(report: Report, stage: str) -> list[Cause]:
    """The root causes on `stage`'s file-level paths (explain's `linked`), the live machine's changes among them:
    the same attribution explain gives the stage's metrics."""
    by_stage = {v.stage: v for v in report.stages}
    keys, todo, seen = set(), [stage], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in by_stage:
            continue
        seen.add(name)
        v = by_stage[name]
        if v.verdict in (StageVerdict.DIRECT, StageVerdict.OUTPUTS):
            keys |= {(c.kind, c.what) for c in v.causes}
        todo.extend(v.linked)
    # the live machine's changes are root causes of kind `machine` (explain reads the workspace's fingerprint
    # keys off the machine), so they are found like any other
    return [c for c in report.root_causes if (c.kind, c.what) in keys]


def _fingerprint_key(cause: Cause) -> str | None:
    """The fingerprint key a cause is about (`threads.env`), None for any other cause."""
    if cause.kind == "machine":
        return cause.what
    prefix = f"{FINGERPRINT.as_posix()}:"
    return cause.what[len(prefix) :] if cause.kind == "param" and cause.what.startswith(prefix) else None


def _grouped(causes: list[Cause]) -> list[list[Cause]]:
    """One list per arm: a fingerprint group's keys together (they move together and revert together), any other
    cause alone; in the order found."""
    groups: dict[str, list[Cause]] = {}
    for n, cause in enumerate(causes):
        key = _fingerprint_key(cause)
        groups.setdefault(f"fingerprint:{key.split('.')[0]}" if key else f"cause:{n}", []).append(cause)
    return list(groups.values())


def _variables(key: str, old: Any, new: Any) -> dict[str, str | None] | None:
    """The variables that set `key` back to `old`, None where `key` holds no variables."""
    if key in VARIABLE_GROUPS:
        old, new = old if isinstance(old, dict) else {}, new if isinstance(new, dict) else {}
        return {name: old.get(name) for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)}
    group, _, name = key.rpartition(".")
    return {name: None if old is None else str(old)} if group in VARIABLE_GROUPS else None


def _plan(group: list[Cause], a_rev: str, root: Path, producers: dict[str, str]) -> Intervention:
    """What reverting the group's cause(s) means, and whether an arm can do it here."""
    cause = group[0]

    def arm(action: str, **how) -> Intervention:
        return Intervention(cause, action, MEASURED, causes=group, **how)

    def fixed(action: str) -> Intervention:
        return Intervention(cause, action, FIXED, causes=group)

    if _fingerprint_key(cause) is not None:
        return _plan_machine(group, a_rev, root)
    if cause.kind == "param":
        file, key = cause.what.split(":", 1)
        if file in producers:
            machine = f"{file} is written by stage {producers[file]} from the machine it runs on"
            return fixed(f"{machine}: only a machine like A's ({_short(cause.old)}) reverts it; {cause.evidence}")
        return arm(f"revert param {key} in {file} to {_short(cause.old)}")
    if cause.kind == "cmd":
        return arm(f"restore stage {cause.what}'s cmd from A")
    if cause.kind == "out":
        if cause.evidence.endswith(RESTORABLE):
            return arm(f"restore output {cause.what} from the DVC cache")
        return fixed(f"output {cause.what}: {cause.evidence.split('; ')[-1]}")
    tracked = cause.old is None or has_file(root, a_rev, cause.what) or has_file(root, a_rev, cause.what + ".dvc")
    if not tracked:
        return fixed(f"{cause.what} is in neither git nor a .dvc file at A: nothing to restore it from")
    return arm(f"restore {cause.what} from A ({a_rev[:8]})")


def _plan_machine(group: list[Cause], a_rev: str, root: Path) -> Intervention:
    """A fingerprint group: its variables set back in the arm's environment, its locked package reinstalled from
    A's lock (a pristine environment); what neither restores (the CPU, the GPU) needs a machine like A's."""
    keys = {_fingerprint_key(c): c for c in group}
    variables: dict[str, str | None] = {}
    pristine, stays, locked = False, [], pinned(root, a_rev)
    for key, c in keys.items():
        found = _variables(key, c.old, c.new)
        if found is not None:
            variables.update(found)
        elif key == "threads.torch_intra_op" and "threads.env" in keys:
            continue  # torch's intra-op threads follow OMP_NUM_THREADS, reverted with threads.env
        elif key == "threads.torch_intra_op" and isinstance(c.old, int):
            variables["OMP_NUM_THREADS"] = str(c.old)
        elif key.split(".")[0] in locked and key not in MACHINE_ONLY:
            pristine = True
        else:
            stays.append(f"{key} {_short(c.old)}")
    done = [f"run with {_assignments(variables)}"] if variables else []
    done += [f"run in a pristine environment from A's {' and '.join(LOCKS)}"] if pristine else []
    if not done:
        action = f"only a machine with {', '.join(stays)} reverts it: no lock or variable does"
        return Intervention(group[0], action, FIXED, causes=group)
    note = f"stays as this machine has it: {', '.join(stays)}" if stays else ""
    return Intervention(
        group[0], "; ".join(done), MEASURED, note=note, causes=group, variables=variables, pristine=pristine
    )


def _assignments(variables: dict[str, str | None]) -> str:
    return ", ".join(f"{name} unset" if value is None else f"{name}={value}" for name, value in variables.items())


@dataclass
class Arm:
    """One scratch tree of B: the baseline, one cause reverted, or all of them."""

    dir: Path
    causes: list[Cause]
    """Reverted in this arm: none for the baseline, one for an intervention, all of them together."""
    result: Intervention | None
    samples: list[Measured] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None


def _run_arms(found: Verification, planned, root, revs, workspace, stages, cache, progress) -> None:
    from tqdm import tqdm

    a_rev, base_rev = revs
    kept_missing = [c for c in (found.report.root_causes if workspace else []) if c.kind == "out"]
    measured = found.measured
    upstream = _upstream(measured.stage, stages)
    edited = [f.path for f in (found.report.machine.edited if found.report.machine else [])]
    with tempfile.TemporaryDirectory(prefix="dflashpipe-verify-") as tmp, ExitStack() as trees:
        arms = [Arm(Path(tmp) / "baseline", [], None)]
        arms += [Arm(Path(tmp) / f"arm{n}", i.causes, i) for n, i in enumerate(planned, 1)]
        if found.together is not None:
            arms.append(Arm(Path(tmp) / "together", found.together.causes, found.together))
        total = len(arms) * (1 + found.runs)
        if progress and found.estimate_s is not None:
            print(f"verify {found.metric}: {_cost_text(found, len(arms))}", file=sys.stderr)
        desc, quiet = f"verify {measured.metric}", not progress
        with tqdm(total=total, desc=desc, unit="run", disable=quiet, file=sys.stderr) as bar:
            opened = {}
            for arm in arms:
                bar.set_postfix_str(f"preparing {arm.dir.name}")
                try:
                    opened[arm.dir] = trees.enter_context(ScratchTree(root, base_rev, arm.dir, cache))
                except DflashpipeError as exc:  # no tree (git refused the worktree): this arm reports it
                    arm.error = " ".join(str(exc).split())
                else:
                    tree = opened[arm.dir]
                    _prepare(arm, tree, root, workspace, kept_missing, a_rev, measured.stage, upstream, edited)
                bar.update(1)
            for _ in range(found.runs):
                for arm in arms:
                    if arm.error is None:
                        _measure(arm, opened[arm.dir], found, kept_missing)
                    bar.update(1)
    found.baseline_seconds = round(arms[0].seconds, 1)
    for arm in arms[1:]:
        arm.result.seconds = round(arm.seconds, 1)
    if arms[0].error:
        for i in [arm.result for arm in arms[1:]]:
            i.status, i.note = FAILED, f"the baseline failed: {arms[0].error}"
        return
    baseline = pooled(measured.key, arms[0].samples)
    found.baseline = _as_figure(baseline)
    target = json_number(found.recorded_probe_a)
    for arm in arms[1:]:
        i = arm.result
        if arm.error:
            i.status, i.note = FAILED, arm.error
            continue
        figure = pooled(measured.key, arm.samples)
        i.figure = _as_figure(figure)
        i.moved, i.call = moved(measured.key, baseline, figure)
        before, after = json_number(baseline.value), json_number(figure.value)
        if before and after is not None:
            i.change = (after - before) / abs(before)
        if target is not None and before is not None and after is not None and target != before:
            i.share = (after - before) / (target - before)


def _as_figure(m: Measured) -> dict | None:
    """An arm's pooled figure as the report holds it: median, low, high, repeats (a lone value: one repeat)."""
    if m.spread is not None:
        return asdict(m.spread)
    number = json_number(m.value)
    return None if number is None else asdict(spread.Spread.of([number]))


def _upstream(stage: str, stages) -> list[str]:
    """The stages `stage` reads outputs of, directly or not, upstream first: as deps, or as params files (the
    fingerprint stage writes the machine's, which the arm's interpreter and variables must be recorded in)."""
    deps = {n: [*s.deps, *s.params] for n, s in stages.items()}
    ups = upstream_of(deps, {n: s.outs for n, s in stages.items()})
    found, todo = set(), [stage]
    while todo:
        for producer in ups[todo.pop()]:
            if producer not in found:
                found.add(producer)
                todo.append(producer)
    return [name for name in upstream_first(stages, ups) if name in found]


def _prepare(arm: Arm, tree: ScratchTree, root, workspace, kept_missing, a_rev, stage, upstream, edited) -> None:
    """Replay the workspace into the arm's tree, apply the intervention, bring the stage's upstream to date (with
    the arm's variables and interpreter: the fingerprint stage records the machine the arm runs on)."""
    started = time.perf_counter()
    try:
        if workspace:
            _replay_workspace(root, tree.path)
        for cause in arm.causes:
            if cause.kind != "out" and _fingerprint_key(cause) is None:
                _revert(tree.path, cause, a_rev)
        if arm.result is not None:
            tree.variables = arm.result.variables
            if arm.result.pristine:
                _enter_pristine(arm, tree, root, a_rev, edited)
        missing = [c for c in kept_missing if c not in arm.causes]  # a restored output is checked out below
        # only what the metric's stage reads, directly or not: each arm holds it (linked from the shared cache)
        tree.dvc("checkout", "--quiet", "--with-deps", "--force", "--allow-missing", stage)
        for c in missing:
            _replay_output(root, tree.path, c.what)
        _bring_up_to_date(tree, upstream, {c.what for c in missing})
    except (DflashpipeError, OSError) as exc:  # a reverted cause may break the pipeline: a finding, not a crash
        arm.error = " ".join(str(exc).split())
    arm.seconds += time.perf_counter() - started


def _enter_pristine(arm: Arm, tree: ScratchTree, root: Path, a_rev: str, edited: list[str]) -> None:
    """The arm's interpreter: an environment built from A's lock beside its tree, checked to hold the wheel's bytes
    of every installed file this machine has edited."""
    from dflashpipe.commands.rerun import pristine

    env = pristine.build(root, a_rev, tree.path.parent / f"{tree.path.name}-env", tree.path, {"torch": edited})
    wanted = {k: v for k, v in env.environ().items() if k != "PATH"}  # PATH: the tree puts the interpreter first
    changed = {k: v for k, v in wanted.items() if os.environ.get(k) != v}
    changed |= {k: None for k in os.environ.keys() - wanted - {"PATH"}}
    tree.python, tree.variables = env.python, {**changed, **tree.variables}
    arm.result.note = "; ".join(filter(None, [arm.result.note, f"pristine environment built in {env.seconds:.1f} s"]))


def _bring_up_to_date(tree: ScratchTree, upstream: list[str], missing: set[str]) -> None:
    """`dvc repro` of the upstream stages, upstream first, except that a stage whose output is kept missing (or
    other, as the workspace has it) runs only when its own deps or command changed: run for its output alone, DVC
    would restore it from the run cache, and the arm would measure a repaired workspace. One `dvc repro` for
    each run of stages between two such checks (so one in all when no output is kept missing)."""
    outs = {name: set(st.outs) for name, st in read_revision_state(Workspace(tree.path)).items()}
    flags = ["--single-item", *(["--allow-missing"] if missing else [])]
    batch: list[str] = []
    for name in upstream:
        if outs.get(name, set()) & missing:
            if batch:
                tree.repro(*flags, *batch)
                batch = []
            if not _inputs_changed(tree, name):
                continue
        batch.append(name)
    if batch:
        tree.repro(*flags, *batch)


def _inputs_changed(tree: ScratchTree, stage: str) -> bool:
    """Whether `dvc status` finds stage's deps, params or command changed (its outputs are not asked about)."""
    status = json.loads(tree.dvc("status", "--json", stage) or "{}").get(stage, [])
    return any(entry == "changed command" or (isinstance(entry, dict) and "changed deps" in entry) for entry in status)


def _measure(arm: Arm, tree: ScratchTree, found: Verification, kept_missing) -> None:
    """One forced run of the metric's stage (no run cache, nothing committed), and its figure."""
    started = time.perf_counter()
    try:
        missing = ["--allow-missing"] if kept_missing else []
        target = found.measured
        tree.repro("--single-item", "--force", "--no-commit", *missing, target.stage)
        measured = tree.figure(target.file, target.key)
        if measured is None or (measured.spread is None and json_number(measured.value) is None):
            raise DflashpipeError(f"{target.file} has no number under {target.key!r} after the run")
        arm.samples.append(measured)
    except DflashpipeError as exc:
        arm.error = " ".join(str(exc).split())
    arm.seconds += time.perf_counter() - started


def _replay_workspace(root: Path, dest: Path) -> None:
    """The workspace's uncommitted edits of tracked files, and its untracked (not ignored) files."""
    diff = run_git(root, "diff", "--binary", "HEAD")
    if diff.returncode != 0:
        raise DflashpipeError(f"git diff --binary HEAD in {root}: {diff.stderr.decode(errors='replace').strip()}")
    if diff.stdout:
        applied = run_git(dest, "apply", "--whitespace=nowarn", input=diff.stdout)
        if applied.returncode != 0:
            raise DflashpipeError(f"git apply in {dest}: {applied.stderr.decode(errors='replace').strip()}")
    untracked = git(root, "ls-files", "-z", "--others", "--exclude-standard").split("\0")
    for rel in filter(None, untracked):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)


def _replay_output(root: Path, dest: Path, path: str) -> None:
    """An output the workspace lacks (or has other bytes for) is made so in the arm."""
    target, source = dest / path, root / path
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    elif target.exists() or target.is_symlink():
        target.unlink()
    if source.is_dir():
        shutil.copytree(source, target, symlinks=True)
    elif source.exists():
        shutil.copy2(source, target)


def _revert(dest: Path, cause: Cause, a_rev: str) -> None:
    if cause.kind == "param":
        from dvc.utils.serialize import MODIFIERS

        file, key = cause.what.split(":", 1)
        with MODIFIERS[Path(file).suffix.lower()](dest / file) as data:
            *parents, leaf = key.split(".")
            node = data
            for part in parents:
                node = node.setdefault(part, {})
            if cause.old is None:
                node.pop(leaf, None)
            else:
                node[leaf] = cause.old
    elif cause.kind == "cmd":
        from dvc.utils.serialize import modify_yaml

        with modify_yaml(dest / "dvc.yaml") as data:
            data["stages"][cause.what]["cmd"] = cause.old
    else:  # a dep: git's copy at A, or its .dvc file at A (the data then comes from the cache at checkout)
        path = cause.what
        tracked_by_dvc = has_file(dest, a_rev, path + ".dvc")
        restored = path + ".dvc" if tracked_by_dvc else path
        target = dest / path
        if not tracked_by_dvc and target.is_dir():
            shutil.rmtree(target)
        elif not tracked_by_dvc and target.exists():
            target.unlink()
        if has_file(dest, a_rev, restored):
            git(dest, "checkout", "-q", a_rev, "--", restored)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def amount(value: Any) -> str:
    """4.3K, 12.6K, 1.1M: figures as a person reads them."""
    number = json_number(value)
    if number is None:
        return str(value)
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(number) >= scale:
            return f"{number / scale:.1f}{suffix}"
    return f"{number:.3g}"


def _figure_text(fig: dict | None) -> str:
    if fig is None:
        return "no figure"
    return f"{amount(fig['median'])} (range {amount(fig['low'])}..{amount(fig['high'])}, {fig['repeats']} repeats)"


def ranked(v: Verification) -> list[Intervention]:
    """The interventions, measured ones first by how far each moved the figure (the share of the way back to A
    where known, else the change), the moved ahead of the noise; the rest after, as found."""
    done = [i for i in v.interventions if i.status == MEASURED and i.figure is not None]

    def effect(i: Intervention) -> tuple[bool, float]:
        size = i.share if i.share is not None else (i.change or 0.0)
        return bool(i.moved), abs(size)

    return sorted(done, key=effect, reverse=True) + [i for i in v.interventions if i not in done]


def _answer(v: Verification, order: list[Intervention]) -> str:
    moved_ = [i for i in order if i.status == MEASURED and i.moved]
    if not moved_:
        skipped = sum(i.status in (OVER_BUDGET, FAILED) for i in v.interventions)
        left = f" ({skipped} not measured: over --budget or failed)" if skipped else ""
        return f"answer: no cause reverted alone moved it beyond noise{left}" if v.baseline else ""
    lead = moved_[0]
    share = f", {lead.share:.0%} of the way back to {v.a}" if lead.share is not None else ""
    return f"answer: {_what(lead)} ({lead.change:+.0%}{share}, measured)"


def _seconds(value: float | None) -> str:
    return "not recorded" if value is None else f"{value:.1f} s"


def _what(i: Intervention) -> str:
    if i.cause.kind == "together":
        return f"together: {i.cause.what}"
    others = [c.what for c in i.causes[1:]]
    return cause_line(i.cause) + (f" (with {', '.join(others)})" if others else "")


def verification_lines(v: Verification) -> list[str]:
    """The answer first (the cause that moved the figure most, measured), then one line per cause, ranked by its
    measured effect: what was reverted, the effect with its spread and call, and its cost."""
    m = v.measured
    lines = [
        f"verify {v.metric} ({v.file}, stage {v.stage}): {v.a} -> {v.b}, each cause reverted alone to {v.a}",
        f"recorded: {amount(v.recorded_a)} at {v.a}, {amount(v.recorded_b)} at {v.b}",
    ]
    if v.probe is not None:
        took = ", ".join(f"{t.stage} {_seconds(t.seconds)}" for t in (m, v.own))
        lines.append(
            f"probe: {m.metric} (stage {m.stage}), measured in each arm in place of a {v.stage} run (timed run as "
            f"recorded: {took}); {v.probe_agreement}"
        )
    elif v.own is not None:
        took = _seconds(m.seconds)
        lines.append(f"no probe for {v.metric}: each arm runs stage {v.stage} (timed run as recorded: {took})")
    order = ranked(v)
    answer = _answer(v, order)
    if answer:
        lines.insert(1, answer)
    if v.estimate_s is not None:
        arms = 1 + sum(i.status == MEASURED for i in v.interventions) + (v.together is not None)
        lines.append(_cost_text(v, arms))
    if v.baseline is not None or v.baseline_seconds is not None:
        lines.append(
            f"baseline ({v.b} as it is): {_figure_text(v.baseline)} over {v.runs} runs interleaved with each arm's; "
            f"prepared and measured in {v.baseline_seconds} s"
        )
    if not v.interventions:
        lines.append(f"no root cause reaches stage {v.stage}: nothing to revert")
    for i in order + ([v.together] if v.together else []):
        what, note = _what(i), f"; {i.note}" if i.note and i.status != FAILED else ""
        if i.status == MEASURED:
            pct = f" ({i.change:+.0%})" if i.change is not None else ""
            call = {"noise": "within noise", "change": "change"}.get(i.call, i.call)
            share = ""
            if i.share is not None and i.moved:
                share = f"; {i.share:.0%} of the way back to {v.a}'s {amount(v.recorded_probe_a)}"
            lines.append(
                f"{i.action} [{what}]: {amount(v.baseline and v.baseline['median'])} -> {_figure_text(i.figure)}"
                f"{pct}, {call}{share}{note} [cost {i.seconds} s]"
            )
        elif i.status == FAILED:
            lines.append(f"{i.action} [{what}]: failed after {i.seconds} s: {i.note}")
        elif i.status == OVER_BUDGET:
            lines.append(f"{i.action} [{what}]: not run (over --budget)")
        elif i.status == OUTSIDE:
            lines.append(f"outside the probe [{what}]: {i.action}")
        else:
            lines.append(f"cannot revert here [{what}]: {i.action}")
    return lines


def measured_effects(v: Verification) -> dict[str, dict[str, float]]:
    """Each measured cause's share of the way back to A, for the first screen's ranking of the metric's causes."""
    shares = {c.what: i.share for i in v.interventions if i.share is not None for c in i.causes}
    return {f"{v.file}:{v.key}": shares}


def verification_markdown(v: Verification) -> str:
    head, *rest = verification_lines(v)
    return "\n".join([f"## {head}", "", *[f"- {line}" for line in rest]]) + "\n"


def verification_json(v: Verification) -> str:
    return json.dumps(asdict(v), indent=2, default=str)

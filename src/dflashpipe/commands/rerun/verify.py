"""`dflashpipe explain --verify METRIC`: each root cause explain finds on METRIC's path, proven by intervention.

For every cause reaching METRIC's stage, the pipeline runs with that cause alone reverted to A (a param set
back, a code or data dep restored from A's commit, a deleted output restored from the DVC cache), and METRIC
is measured there and in the baseline (B as it is), the arms interleaved round by round so that load on the
machine falls on all of them alike. Each arm's runs are pooled by `spread.pool` and judged against the
baseline by `explain.history.moved` (a rate with its control), the rules bisect uses too. Causes that no run can
revert (the machine itself: a torch build, an edited installed file, keys of a file a stage writes from the
machine) are listed with their evidence.

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
from dflashpipe.commands.rerun.tree import ScratchTree, pooled, shared_cache
from dflashpipe.core import spread
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.metrics import read_metrics
from dflashpipe.core.pipeline import FINGERPRINT, upstream_first, upstream_of
from dflashpipe.core.revision import Revisions, Workspace, commit_of, git, has_file, run_git

MEASURED, FIXED, OVER_BUDGET, FAILED = "measured", "cannot revert here", "over budget", "failed"


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


def verify(
    metric: str,
    a: str = "HEAD",
    b: str = WORKSPACE,
    root: str | Path = ".",
    budget: int | None = None,
    runs: int = 3,
    progress: bool = True,
) -> Verification:
    """Revert each cause reaching `metric` alone (at most `budget` of them) and measure it `runs` times
    against the baseline B, interleaved."""
    root = Path(root).resolve()
    if a == WORKSPACE:
        raise DflashpipeError("--verify reverts causes to A, which must be a recorded state (a revision or experiment)")
    report = explain(a, b, root, machine=(root / FINGERPRINT).is_file())  # no fingerprint file: nothing to check
    with Revisions(root) as revisions:
        sa, sb = revisions.at(a), Workspace(root) if b == WORKSPACE else revisions.at(b)
        stages = read_revision_state(sb)
        file, key, stage = _locate(metric, sa, sb, stages)
        recorded_a, recorded_b = read_metrics(sa, file).get(key), read_metrics(sb, file).get(key)
        base_rev = sb.rev or commit_of(root, "HEAD")
    found = Verification(metric, file, key, stage, report.a, report.b, runs, recorded_a, recorded_b, None, None)
    found.report = report
    producers = {out: st.name for st in stages.values() for out in st.outs}
    for cause in causes_reaching(report, stage):
        action, can = _plan(cause, sa.rev, root, producers)
        found.interventions.append(Intervention(cause, action, MEASURED if can else FIXED))
    planned = [i for i in found.interventions if i.status == MEASURED]
    for i in planned[budget:] if budget is not None else []:
        i.status = OVER_BUDGET
    planned = planned[:budget] if budget is not None else planned
    if len(planned) > 1 and not any(i.status == OVER_BUDGET for i in found.interventions):
        every = " + ".join(i.cause.what for i in planned)
        found.together = Intervention(
            Cause("together", every, None, None, "each cause above"), "revert all of them", MEASURED
        )
    if planned:
        _run_arms(found, planned, root, (sa.rev, base_rev), b == WORKSPACE, stages, shared_cache(root), progress)
    return found


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


def _plan(cause: Cause, a_rev: str, root: Path, producers: dict[str, str]) -> tuple[str, bool]:
    """What reverting `cause` alone means, and whether an arm can do it here."""
    if cause.kind == "machine":
        return f"the machine now differs from the fingerprint file ({cause.evidence}): revert it on the machine", False
    if cause.kind == "param":
        file, key = cause.what.split(":", 1)
        if file in producers:
            machine = f"{file} is written by stage {producers[file]} from the machine it runs on"
            return f"{machine}: only a machine like A's ({_short(cause.old)}) reverts it; {cause.evidence}", False
        return f"revert param {key} in {file} to {_short(cause.old)}", True
    if cause.kind == "cmd":
        return f"restore stage {cause.what}'s cmd from A", True
    if cause.kind == "out":
        if cause.evidence.endswith(RESTORABLE):
            return f"restore output {cause.what} from the DVC cache", True
        return f"output {cause.what}: {cause.evidence.split('; ')[-1]}", False
    tracked = cause.old is None or has_file(root, a_rev, cause.what) or has_file(root, a_rev, cause.what + ".dvc")
    if not tracked:
        return f"{cause.what} is in neither git nor a .dvc file at A: nothing to restore it from", False
    return f"restore {cause.what} from A ({a_rev[:8]})", True


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
    upstream = _upstream(found.stage, stages)
    with tempfile.TemporaryDirectory(prefix="dflashpipe-verify-") as tmp, ExitStack() as trees:
        arms = [Arm(Path(tmp) / "baseline", [], None)]
        arms += [Arm(Path(tmp) / f"arm{n}", [i.cause], i) for n, i in enumerate(planned, 1)]
        if found.together is not None:
            arms.append(Arm(Path(tmp) / "together", [i.cause for i in planned], found.together))
        total = len(arms) * (1 + found.runs)
        with tqdm(total=total, desc=f"verify {found.metric}", unit="run", disable=not progress, file=sys.stderr) as bar:
            opened = {}
            for arm in arms:
                bar.set_postfix_str(f"preparing {arm.dir.name}")
                try:
                    opened[arm.dir] = trees.enter_context(ScratchTree(root, base_rev, arm.dir, cache))
                except DflashpipeError as exc:  # no tree (git refused the worktree): this arm reports it
                    arm.error = " ".join(str(exc).split())
                else:
                    _prepare(arm, opened[arm.dir], root, workspace, kept_missing, a_rev, found.stage, upstream)
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
    baseline = pooled(found.key, arms[0].samples)
    found.baseline = _as_figure(baseline)
    target = json_number(found.recorded_a)
    for arm in arms[1:]:
        i = arm.result
        if arm.error:
            i.status, i.note = FAILED, arm.error
            continue
        measured = pooled(found.key, arm.samples)
        i.figure = _as_figure(measured)
        i.moved, i.call = moved(found.key, baseline, measured)
        before, after = json_number(baseline.value), json_number(measured.value)
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
    """The stages `stage` reads outputs of, directly or not, upstream first."""
    ups = upstream_of({n: s.deps for n, s in stages.items()}, {n: s.outs for n, s in stages.items()})
    found, todo = set(), [stage]
    while todo:
        for producer in ups[todo.pop()]:
            if producer not in found:
                found.add(producer)
                todo.append(producer)
    return [name for name in upstream_first(stages, ups) if name in found]


def _prepare(arm: Arm, tree: ScratchTree, root, workspace, kept_missing, a_rev, stage, upstream) -> None:
    """Replay the workspace into the arm's tree, apply the intervention, bring the stage's upstream to date."""
    started = time.perf_counter()
    try:
        if workspace:
            _replay_workspace(root, tree.path)
        for cause in arm.causes:
            if cause.kind != "out":
                _revert(tree.path, cause, a_rev)
        missing = [c for c in kept_missing if c not in arm.causes]  # a restored output is checked out below
        # only what the metric's stage reads, directly or not: each arm holds it (linked from the shared cache)
        tree.dvc("checkout", "--quiet", "--with-deps", "--force", "--allow-missing", stage)
        for c in missing:
            _replay_output(root, tree.path, c.what)
        _bring_up_to_date(tree, upstream, {c.what for c in missing})
    except (DflashpipeError, OSError) as exc:  # a reverted cause may break the pipeline: a finding, not a crash
        arm.error = " ".join(str(exc).split())
    arm.seconds += time.perf_counter() - started


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
        tree.repro("--single-item", "--force", "--no-commit", *missing, found.stage)
        measured = tree.figure(found.file, found.key)
        if measured is None or (measured.spread is None and json_number(measured.value) is None):
            raise DflashpipeError(f"{found.file} has no number under {found.key!r} after the run")
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


def verification_lines(v: Verification) -> list[str]:
    """One line per cause: what was reverted, the measured effect with its spread and call, and its cost."""
    lines = [
        f"verify {v.metric} ({v.file}, stage {v.stage}): {v.a} -> {v.b}, each cause reverted alone to {v.a}",
        f"recorded: {amount(v.recorded_a)} at {v.a}, {amount(v.recorded_b)} at {v.b}",
    ]
    if v.baseline is not None or v.baseline_seconds is not None:
        lines.append(
            f"baseline ({v.b} as it is): {_figure_text(v.baseline)} over {v.runs} runs interleaved with each arm's; "
            f"prepared and measured in {v.baseline_seconds} s"
        )
    if not v.interventions:
        lines.append(f"no root cause reaches stage {v.stage}: nothing to revert")
    for i in v.interventions + ([v.together] if v.together else []):
        what = f"together: {i.cause.what}" if i.cause.kind == "together" else cause_line(i.cause)
        if i.status == MEASURED:
            pct = f" ({i.change:+.0%})" if i.change is not None else ""
            call = {"noise": "within noise", "change": "change"}.get(i.call, i.call)
            share = ""
            if i.share is not None and i.moved:
                share = f"; {i.share:.0%} of the way back to {v.a}'s {amount(v.recorded_a)}"
            lines.append(
                f"{i.action} [{what}]: {amount(v.baseline and v.baseline['median'])} -> {_figure_text(i.figure)}"
                f"{pct}, {call}{share} [cost {i.seconds} s]"
            )
        elif i.status == FAILED:
            lines.append(f"{i.action} [{what}]: failed after {i.seconds} s: {i.note}")
        elif i.status == OVER_BUDGET:
            lines.append(f"{i.action} [{what}]: not run (over --budget)")
        else:
            lines.append(f"cannot revert here [{what}]: {i.action}")
    return lines


def verification_markdown(v: Verification) -> str:
    head, *rest = verification_lines(v)
    return "\n".join([f"## {head}", "", *[f"- {line}" for line in rest]]) + "\n"


def verification_json(v: Verification) -> str:
    return json.dumps(asdict(v), indent=2, default=str)

"""`dflashpipe bisect METRIC GOOD BAD`: the first commit between GOOD and BAD whose METRIC moved beyond noise.

A binary search over BAD's first-parent line after GOOD, like `git bisect`, where each probe is measured
instead of judged by hand: the commit is checked out in a scratch tree (`rerun.tree`: a git worktree sharing this
project's DVC cache), and `dvc repro <the metric's stage>` brings it about. DVC then reproduces only what it lacks: an
output the cache (or the run cache) already holds for those inputs is checked out, not recomputed, and a
metric whose committed record is current is read as committed. `--runs N` measures N times (the first as
above, then `dvc repro -f -s` again) and pools the figures by `spread.pool` (a rate's runs first brought to one
machine speed by their controls), as `explain --verify` pools its arms.

A probe is *moved* when it differs from GOOD by the rule everything else here uses: for a timed figure with a
spread, ranges that do not overlap (`spread.compare`; a rate with its control, `spread.compare_rates`, so a
probe measured on a busier machine is not called moved); for a timed figure without a spread, the nearer of
GOOD's and BAD's values; for any other metric, any difference (the stages are deterministic). A commit that
cannot be reproduced is skipped and said so, as `git bisect skip` does.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from tqdm import tqdm

from dflashpipe.commands.explain.history import Measured, moved, recorded_metrics, selected_metrics
from dflashpipe.commands.explain.state import read_revision_state
from dflashpipe.commands.rerun.tree import RunFailed, ScratchTree, pooled, shared_cache
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.revision import Revision, Revisions, commit_of, git, run_git, unknown_revision


@dataclass
class Probe:
    sha: str
    subject: str
    measured: Measured | None = None
    moved: bool | None = None
    """Against GOOD; None for GOOD itself and for a skipped commit."""
    call: str = ""
    """Why: the spread verdict, `differs`/`equal`, or the nearer endpoint."""
    stages_run: int = 0
    """Stages `dvc repro` ran (0: every output came from the cache or the commit's own record)."""
    seconds: float = 0.0
    skipped: str = ""
    """Why the commit could not be measured (empty when it was)."""


@dataclass
class Bisection:
    metric: str
    good: str
    bad: str
    candidates: int
    """Commits after GOOD up to BAD: where the first move can be."""
    probes: list[Probe] = field(default_factory=list)
    first: Probe | None = None
    ambiguous: list[str] = field(default_factory=list)
    """When skipped commits hide it: every commit the first move may be (short shas)."""
    seconds: float = 0.0


def bisect(metric: str, good: str, bad: str, runs: int = 1, root: str | Path = ".") -> Bisection:
    root = Path(root).resolve()
    if runs < 1:
        raise DflashpipeError(f"--runs {runs}: measure each probe at least once")
    began = time.perf_counter()
    good_sha, bad_sha = (commit_of(root, r) or _unknown(r, root) for r in (good, bad))
    if run_git(root, "merge-base", "--is-ancestor", good_sha, bad_sha).returncode != 0:
        raise DflashpipeError(f"{good} is not an ancestor of {bad}: bisect needs GOOD before BAD on one line")
    lines = git(root, "log", "--first-parent", "--reverse", "--format=%H%x00%s", f"{good_sha}..{bad_sha}")
    commits = [tuple(line.split("\0", 1)) for line in lines.splitlines() if line]
    if not commits:
        raise DflashpipeError(f"no commits in {good}..{bad}: {good} is {bad} or after it")
    with Revisions(root) as objects:
        ends = [Revision(objects, sha, sha[:8]) for sha in (good_sha, bad_sha)]
        (name,) = _one_metric(metric, ends)
        path, key = name.split(":", 1)
        stage = next((s for s, st in read_revision_state(ends[1]).items() if path in st.metrics), None)
        subjects = {sha: subject for sha, subject in commits}
        subjects[good_sha] = git(root, "log", "-1", "--format=%s", good_sha).strip()
    if stage is None:
        raise DflashpipeError(f"{path}: no stage of dvc.yaml@{bad} records it as metrics")
    found = Bisection(name, good, bad, len(commits))
    cache = shared_cache(root)
    expected = math.ceil(math.log2(len(commits) + 1)) + 2
    with tqdm(total=expected, desc=f"bisect {key}", unit="probe") as bar:

        def probe(sha: str) -> Probe:
            p = _measure(root, cache, sha, subjects[sha], stage, path, key, runs)
            found.probes.append(p)
            bar.set_postfix_str(f"{sha[:8]}: {p.skipped and 'skipped' or p.measured.describe()}", refresh=False)
            bar.update()
            return p

        at_good, at_bad = probe(good_sha), probe(bad_sha)
        for end, label in ((at_good, good), (at_bad, bad)):
            if end.measured is None:
                raise DflashpipeError(f"cannot measure {name} at {label} ({end.sha[:8]}): {end.skipped}")
        g, b = at_good.measured, at_bad.measured
        at_bad.moved, at_bad.call = moved(key, g, b, b)
        if not at_bad.moved:
            raise DflashpipeError(
                f"{name} did not move between {good} and {bad} ({at_bad.call}: {g.describe()} vs {b.describe()}): "
                f"nothing to bisect"
            )
        low, high, skipped = -1, len(commits) - 1, set()  # commits[low] is like GOOD (-1: GOOD), commits[high] moved
        while high - low > 1:
            middle = (low + high) // 2
            order = sorted((i for i in range(low + 1, high) if i not in skipped), key=lambda i: (abs(i - middle), i))
            if not order:
                break
            i = order[0]
            p = probe(commits[i][0])
            if p.measured is None:
                skipped.add(i)
                continue
            p.moved, p.call = moved(key, g, p.measured, b)
            low, high = (low, i) if p.moved else (i, high)
    if high - low > 1:
        found.ambiguous = [commits[i][0][:8] for i in range(low + 1, high + 1)]
        if len(found.ambiguous) == len(commits) and all(p.measured is None for p in found.probes[2:]):
            raise DflashpipeError(
                f"no commit in {good}..{bad} could be reproduced, so the first move cannot be placed: "
                f"{'; '.join(f'{p.sha[:8]} {p.skipped}' for p in found.probes[2:])}"
            )
    else:
        found.first = next(p for p in found.probes if p.sha == commits[high][0])
    found.seconds = time.perf_counter() - began
    return found


def _unknown(rev: str, root: Path) -> NoReturn:
    raise unknown_revision(rev, root)


def _one_metric(metric: str, ends: list[Revision]) -> list[str]:
    chosen = selected_metrics(recorded_metrics(ends), [metric])
    if len(chosen) > 1:
        raise DflashpipeError(f"{metric!r} is recorded by more than one file: name one of {', '.join(chosen)}")
    return chosen


def _measure(root: Path, cache: Path, sha: str, subject: str, stage: str, path: str, key: str, runs: int) -> Probe:
    """`sha` in a scratch tree sharing `root`'s DVC cache, `stage` reproduced (`runs` times), the figure read."""
    began = time.perf_counter()
    found = Probe(sha, subject)
    with (
        tempfile.TemporaryDirectory(prefix="dflashpipe-bisect-") as tmp,
        ScratchTree(root, sha, Path(tmp) / "tree", cache) as tree,
    ):
        try:
            # every output the cache holds, in place; then a stage whose only change is an output the cache never
            # holds (train's resume checkpoints, `cache: false`) is not rerun for it (--allow-missing)
            tree.dvc("checkout", "--quiet", "--allow-missing")
            samples: list[Measured] = []
            for run in range(runs):
                tree.repro(*(("--allow-missing", stage) if run == 0 else ("--force", "--single-item", stage)))
                measured = tree.figure(path, key)
                if measured is None:
                    raise RunFailed(f"{path} records no {key} at {sha[:8]}")
                samples.append(measured)
            found.measured = pooled(key, samples)
        except RunFailed as exc:
            found.skipped = str(exc)
        found.stages_run = tree.stages_run
    found.seconds = time.perf_counter() - began
    return found


def bisect_lines(b: Bisection) -> list[str]:
    lines = [f"bisect {b.metric} over {b.good}..{b.bad}: {b.candidates} commits"]
    for p in b.probes:
        where = f"{p.sha[:8]}  {p.subject[:60]}"
        if p.skipped:
            lines.append(f"  {where}: skipped: {p.skipped}")
            continue
        verdict = "GOOD" if p.moved is None else ("moved" if p.moved else "as GOOD")
        runs = f"ran {p.stages_run} stage(s)" if p.stages_run else "from the cache and its record"
        lines.append(
            f"  {where}: {p.measured.describe()} -> {verdict} [{p.call or 'reference'}] ({runs}, {p.seconds:.0f} s)"
        )
    if b.first is not None:
        lines.append(f"first moved: {b.first.sha[:8]} {b.first.subject}")
    else:
        lines.append(f"first moved: one of {', '.join(b.ambiguous)} (skipped commits hide which)")
    measured = sum(1 for p in b.probes if p.measured is not None)
    lines.append(f"{len(b.probes)} probes ({measured} measured), {b.seconds:.0f} s")
    return lines

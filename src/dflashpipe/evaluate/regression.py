"""The regression check: this run's headline metrics against a baseline revision's metrics/eval.json.

The baseline is read through git (`git show <commit>:metrics/eval.json`), never by checking
anything out, so the workspace that DVC is running the stage in stays untouched.
"""

from __future__ import annotations

import json
import subprocess
import types
from pathlib import Path

from dflashpipe.errors import DflashpipeError

EVAL_METRICS = "metrics/eval.json"

HEADLINE = {
    "tau": (("tau",), False),
    "speedup": (("speedup",), True),
    "decode_tokens_per_s": (("decode_tokens_per_s", "speculative"), True),
    "train_tokens_per_s": (("train", "tokens_per_s"), True),
    "train_step_tokens_per_s": (("train_step", "tokens_per_s"), True),
}
"""name -> (path in metrics/eval.json, is a throughput). Only a throughput drop can fail the stage:
tau is the drafter's quality, which a retrained drafter may trade."""


def resolve_revision(repo, name: str) -> str:
    """A git revision, or a DVC experiment's name, to a commit sha."""
    from dvc.repo.experiments.utils import resolve_name
    from scmrepo.exceptions import RevError

    try:
        return repo.scm.resolve_rev(name)
    except RevError:
        pass
    ref = resolve_name(repo.scm, name).get(name)
    if ref is not None:
        return repo.scm.get_ref(str(ref))
    raise DflashpipeError(f"{name!r} is neither a git revision nor a DVC experiment (see `dvc exp list`)")


class RegressionError(DflashpipeError):
    """A throughput metric fell further below the baseline than evaluate.max_regression allows."""


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)


def read_baseline(revision: str, root: Path | str = ".") -> tuple[dict | None, str | None, str]:
    """(baseline metrics or None, its commit, a note saying what was read or why there is none)."""
    root = Path(root)
    if not revision.strip() or revision.strip().lower() == "none":
        return None, None, "no baseline: evaluate.baseline is empty"
    if _git(root, "rev-parse", "--git-dir").returncode != 0:
        return None, None, f"no baseline: {root.resolve()} is not a git repository"
    if _git(root, "rev-parse", "--verify", "-q", "HEAD").returncode != 0:
        return None, None, "no baseline: the repository has no commit yet"
    from scmrepo.git import Git

    scm = Git(str(root))
    try:
        # resolve_revision reads only `.scm`: git revisions and DVC experiment names alike.
        commit = resolve_revision(types.SimpleNamespace(scm=scm), revision)
    except DflashpipeError as exc:
        raise DflashpipeError(f"params.yaml: evaluate.baseline = {revision!r}: {exc}") from None
    finally:
        scm.close()
    shown = _git(root, "show", f"{commit}:{EVAL_METRICS}")
    if shown.returncode != 0:
        return None, commit, f"no baseline: {revision} ({commit[:12]}) has no {EVAL_METRICS}"
    try:
        return json.loads(shown.stdout), commit, f"{EVAL_METRICS} at {revision} ({commit[:12]})"
    except ValueError:
        return None, commit, f"no baseline: {EVAL_METRICS} at {revision} ({commit[:12]}) is not JSON"


def _value(metrics: dict, path: tuple[str, ...]) -> float | None:
    node = metrics
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def compare(
    current: dict, baseline: dict | None, revision: str, commit: str | None, note: str, max_regression: float
) -> dict:
    """metrics/eval_regression.json: the relative change of each headline metric, and which ones regressed."""
    report = {
        "baseline": revision,
        "commit": commit,
        "note": note,
        "max_regression": max_regression,
        "metrics": {},
        "regressions": [],
        "throughput_regressions": [],
    }
    if baseline is None:
        return report
    for name, (path, throughput) in HEADLINE.items():
        new, old = _value(current, path), _value(baseline, path)
        change = round((new - old) / old, 4) if new is not None and old else None
        report["metrics"][name] = {"old": old, "new": new, "change": change}
        if change is not None and change < -max_regression:
            report["regressions"].append(name)
            if throughput:
                report["throughput_regressions"].append(name)
    return report


def regression_lines(report: dict) -> list[str]:
    """What to print: one line per regressed metric, loud, with the numbers."""
    lines = []
    for name in report["regressions"]:
        m = report["metrics"][name]
        kind = "THROUGHPUT REGRESSION" if name in report["throughput_regressions"] else "REGRESSION"
        lines.append(
            f"!!! {kind}: {name} {m['old']:g} -> {m['new']:g} ({m['change']:+.1%}) vs {report['baseline']} "
            f"({(report['commit'] or '')[:12]}); evaluate.max_regression = {report['max_regression']:g}"
        )
    return lines


def check(report: dict, fail: bool) -> None:
    """Raise if a throughput metric regressed and evaluate.fail_on_regression is true."""
    if fail and report["throughput_regressions"]:
        names = ", ".join(report["throughput_regressions"])
        raise RegressionError(
            f"{names} fell more than evaluate.max_regression = {report['max_regression']:g} below "
            f"{report['baseline']} ({(report['commit'] or '')[:12]}); see metrics/eval_regression.json. "
            f"`dflashpipe explain {report['baseline']}` says what changed; set evaluate.fail_on_regression: false "
            f"to record it without failing"
        )

"""The regression check: this run's headline metrics against a baseline revision's metrics/eval.json and
metrics/bench.json.

A throughput figure that carries its spread over repeats (dflashpipe.core.spread) regresses only when its range
and the baseline's do not overlap (a change, not noise) *and* it fell more than evaluate.max_regression. A
drop within noise is reported as such and never fails the stage. When a side has no spread (a baseline
recorded before spreads, or a single measurement) the two cannot be told apart: the figure is "unmeasured"
and today's threshold rule alone decides, which the report and the printed line say.

The baseline is read through git (dflashpipe.core.revision, the one reader of revisions), never by checking
anything out, so the workspace that DVC is running the stage in stays untouched. The figures compared are
the headlines the one list (dflashpipe.core.headlines) marks as checked, read from each file's whole record
(core.metrics: with its detail file, where the spreads are). metrics/eval_regression.json keeps the verdict and
the worst move; the per-figure comparison is its detail.
"""

from __future__ import annotations

from pathlib import Path

from dflashpipe.core import headlines, spread
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError, SourceError
from dflashpipe.core.metrics import read_record, read_record_at, write_metrics
from dflashpipe.core.revision import Revisions, no_commit_reason

EVAL_METRICS = "metrics/eval.json"
EVAL_DETAIL = "metrics/detail/eval.json"
BENCH_METRICS = "metrics/bench.json"
BASELINE_FILES = (EVAL_METRICS, EVAL_DETAIL, BENCH_METRICS)

HEADLINE = headlines.checked()
"""name -> (metrics file, path in it, is a throughput), from the one headline list. Only a throughput drop can
fail the stage: tau is the drafter's quality, which a retrained drafter may trade."""
MOVED = {"train_step_tokens_per_s": (EVAL_METRICS, ("train_step", "tokens_per_s"))}
"""Where a baseline recorded before the bench stage keeps a figure (evaluate timed the step then)."""
UNMEASURED_RULE = "threshold rule only: a side has no spread of 2+ repeats, so noise cannot be told from change"


class RegressionError(DflashpipeError):
    """A throughput metric fell further below the baseline than evaluate.max_regression allows."""


def read_current(path: Path | str) -> dict | None:
    """A metrics file's whole record in this run (metrics/bench.json with its detail), or None when there is none
    yet."""
    path = Path(path)
    try:
        return read_record_at(path)
    except DflashpipeError as exc:
        raise SourceError(f"{exc}: rerun the stage that writes it") from None


def read_baseline(revision: str, root: Path | str = ".") -> tuple[dict | None, str | None, str]:
    """({file: metrics} of BASELINE_FILES at `revision`, or None; its commit; a note saying what was read
    or why there is none). The baseline needs metrics/eval.json; metrics/bench.json may be missing (a
    revision from before the bench stage)."""
    root = Path(root)
    if not revision.strip() or revision.strip().lower() == "none":
        return None, None, "no baseline: evaluate.baseline is empty"
    reason = no_commit_reason(root)
    if reason is not None:
        where = f"{root.resolve()} is not a git repository" if reason == "not a git repository" else reason
        return None, None, f"no baseline: {where}"
    with Revisions(root) as revisions:
        try:
            at_baseline = revisions.at(revision)
        except DflashpipeError as exc:
            raise DflashpipeError(f"params.yaml: evaluate.baseline = {revision!r}: {exc}") from None
        commit = at_baseline.rev
        at = f"{revision} ({commit[:12]})"
        found = {}
        for file in BASELINE_FILES:
            try:
                content = read_record(at_baseline, file)
            except DflashpipeError:
                return None, commit, f"no baseline: {file} at {at} is not JSON"
            if content is not None:
                found[file] = content
    if EVAL_METRICS not in found:
        return None, commit, f"no baseline: {at} has no {EVAL_METRICS}"
    note = f"{' and '.join(sorted(found))} at {at}"
    # a baseline from before the detail file kept every figure in metrics/eval.json
    found.setdefault(EVAL_DETAIL, found[EVAL_METRICS])
    return found, commit, note


def _node(metrics: dict | None, path: tuple[str, ...]) -> dict | None:
    """The dict that holds the figure at `path` (its parent), or None."""
    node = metrics
    for key in path[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else None


def _value(parent: dict | None, key: str) -> float | None:
    node = parent.get(key) if parent is not None else None
    return json_number(node)


def _figure(
    files: dict | None, file: str, path: tuple[str, ...]
) -> tuple[float | None, spread.Spread | None, spread.Control | None]:
    """The figure at `path` of `file`, its spread, and the control measured beside it (None where absent)."""
    parent = _node((files or {}).get(file), path)
    if parent is None:
        return None, None, None
    record = parent.get(path[-1] + spread.SUFFIX)
    machine = record.get(spread.BUSY) if isinstance(record, dict) else None
    return _value(parent, path[-1]), spread.Spread.read(parent, path[-1]), spread.Control.read(machine)


def compare(
    current: dict, baseline: dict | None, revision: str, commit: str | None, note: str, max_regression: float
) -> dict:
    """metrics/eval_regression.json: per headline metric its relative change, the spreads' verdict
    (noise / change / unmeasured) with each side's repeats, and which ones regressed.

    `current` and `baseline` map a metrics file (EVAL_METRICS, BENCH_METRICS) to its content."""
    report = {
        "baseline": revision,
        "commit": commit,
        "note": note,
        "max_regression": max_regression,
        "rule": "a regression: ranges over repeats do not overlap (change, not noise) and the drop exceeds "
        "max_regression; for a rate, also beyond what the control measured beside it moved (machine); "
        f"unmeasured: {UNMEASURED_RULE}",
        "metrics": {},
        "regressions": [],
        "throughput_regressions": [],
        "within_noise": [],
    }
    if baseline is None:
        return {"verdict": "no_baseline", "worst": None, "worst_change": None, **report}
    for name, (file, path, throughput) in HEADLINE.items():
        new, new_spread, new_control = _figure(current, file, path)
        old, old_spread, old_control = _figure(baseline, file, path)
        if old is None and name in MOVED:
            old, old_spread, old_control = _figure(baseline, *MOVED[name])
        change = round((new - old) / old, 4) if new is not None and old else None
        # a rate moves with the machine: the control beside each side says how much (spread.compare_rates)
        rate = "per_s" in ".".join(path)
        verdict = (
            spread.compare_rates(old_spread, new_spread, old_control, new_control)
            if rate
            else spread.compare(old_spread, new_spread)
        )
        report["metrics"][name] = {
            **(
                {"controls_ms": {"old": old_control.mean, "new": new_control.mean}}
                if old_control and new_control
                else {}
            ),
            "old": old,
            "new": new,
            "change": change,
            "verdict": verdict,
            "repeats": {"old": old_spread and old_spread.repeats, "new": new_spread and new_spread.repeats},
            "ranges": {
                side: [s.low, s.high] if s is not None else None
                for side, s in (("old", old_spread), ("new", new_spread))
            },
        }
        if change is None or change >= -max_regression:
            continue
        if verdict in ("noise", "machine"):  # within the repeats, or as much as the control moved: no regression
            report["within_noise"].append(name)
            continue
        report["regressions"].append(name)
        if throughput:
            report["throughput_regressions"].append(name)
    moves = {name: m["change"] for name, m in report["metrics"].items() if m["change"] is not None}
    worst = min(moves, key=moves.get, default=None)
    verdict = "regressed" if report["regressions"] else "passed"
    return {"verdict": verdict, "worst": worst, "worst_change": moves.get(worst), **report}


def write(path: Path | str, report: dict) -> None:
    """metrics/eval_regression.json (the verdict and the worst move) and its detail (the comparison)."""
    write_metrics(path, report, name="eval_regression")


def _evidence(m: dict) -> str:
    if m["verdict"] == "unmeasured":
        return f"unmeasured ({UNMEASURED_RULE})"
    (old_low, old_high), (new_low, new_high) = m["ranges"]["old"], m["ranges"]["new"]
    overlap = "overlap" if m["verdict"] == "noise" else "do not overlap"
    said = (
        f"ranges {old_low:g}..{old_high:g} ({m['repeats']['old']} repeats) and {new_low:g}..{new_high:g} "
        f"({m['repeats']['new']} repeats) {overlap}"
    )
    if "controls_ms" in m:
        c = m["controls_ms"]
        moved = "as much as" if m["verdict"] == "machine" else "less than"
        said += f"; the control beside them moved {moved} that ({c['old']:.3g} ms -> {c['new']:.3g} ms)"
    return said


def regression_lines(report: dict) -> list[str]:
    """What to print: one line per regressed metric, loud, with the numbers and the evidence; one quiet
    line per drop beyond max_regression that the spreads call noise."""
    at = f"{report['baseline']} ({(report['commit'] or '')[:12]})"
    lines = []
    for name in report["regressions"]:
        m = report["metrics"][name]
        kind = "THROUGHPUT REGRESSION" if name in report["throughput_regressions"] else "REGRESSION"
        lines.append(
            f"!!! {kind}: {name} {m['old']:g} -> {m['new']:g} ({m['change']:+.1%}) vs {at}; "
            f"evaluate.max_regression = {report['max_regression']:g}; {_evidence(m)}"
        )
    for name in report["within_noise"]:
        m = report["metrics"][name]
        lines.append(
            f"{m['verdict']}, not a regression: {name} {m['old']:g} -> {m['new']:g} ({m['change']:+.1%}) vs {at}: "
            f"{_evidence(m)}"
        )
    return lines


def check(report: dict, fail: bool) -> None:
    """Raise if a throughput metric regressed and evaluate.fail_on_regression is true."""
    if fail and report["throughput_regressions"]:
        names = ", ".join(report["throughput_regressions"])
        raise RegressionError(
            f"{names} fell more than evaluate.max_regression = {report['max_regression']:g} below "
            f"{report['baseline']} ({(report['commit'] or '')[:12]}) beyond noise where measured; "
            f"see metrics/eval_regression.json. "
            f"`dflashpipe explain {report['baseline']}` says what changed; set evaluate.fail_on_regression: false "
            f"to record it without failing"
        )

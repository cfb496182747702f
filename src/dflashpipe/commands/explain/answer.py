"""The first screen of `dflashpipe explain`: the answer, before the evidence.

A Report holds every fact explain found; a person asking "what changed, and what did it cost?" needs three:
the root causes (what changed, from what to what, read from where) with the stages each one invalidates, what
`dvc repro` will do with each stage, and what happened to the headline figures (`headlines.HEADLINES`, the one
list) with their verdict. `answer` picks those out; everything else stays in the Report for `--all` and `--json`.

Invariant: pure, like comparison.py: it reads only the Report. Facts are shortened where they are printed
(`env.fact_change`), never here: a CauseLine keeps the Causes it stands for.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflashpipe.commands.explain.records import RESTORABLE, Cause, MetricDelta, NoiseCall, Report, StageVerdict, Verdict
from dflashpipe.core import env
from dflashpipe.core.headlines import HEADLINES
from dflashpipe.core.pipeline import FINGERPRINT, PARAMS_FILE


@dataclass
class CauseLine:
    """One root cause as the first screen names it. The keys of one fingerprint group that moved together (one
    `OMP_NUM_THREADS` moves `threads.env` and `threads.torch_intra_op`) are one cause: the machine's."""

    kind: str
    what: str
    change: str
    """`old -> new`, shortened for the screen (`env.fact_change`)."""
    source: str
    stages: list[str]
    """The stages it changes directly, in DAG order."""
    downstream: list[str]
    """The stages invalidated through those (DAG order)."""
    note: str = ""
    causes: list[Cause] = field(default_factory=list)


@dataclass
class HeadlineLine:
    label: str
    name: str
    """The metric as the rest of the report prints it (`tau`, `metrics/bench.json:tokens_per_s`)."""
    old: Any
    new: Any
    change: float | None
    verdict: str
    """change, noise, machine or unmeasured for a timed figure (the control applied to a rate); differs for
    any other, whose stages are deterministic."""
    why: str


@dataclass
class Answer:
    a: str
    b: str
    causes: list[CauseLine]
    rerun: list[str]
    """Stages whose inputs differ from the earlier side's record, directly or downstream (DAG order): what `dvc
    repro` reruns, or, after it, what it reran."""
    restore: list[str]
    """Stages whose outputs are only missing, and `dvc checkout` brings them back."""
    unknown: list[str]
    unchanged: list[str]
    always: list[str]
    frozen: list[str]
    headlines: list[HeadlineLine]
    same: list[str]
    """Headline figures recorded on both sides, equal."""
    other_metrics: int
    """Metric deltas that are not headlines: behind --all."""
    unread_facts: list[str]
    """Machine facts that differ from the fingerprint file but that no stage reads (the header's, behind --all)."""
    uncaused: list[str] = field(default_factory=list)
    """Each stage to rerun that no cause reaches, by its first file-level path (an upstream rerun, forced, that
    rewrote a file the stage reads: `evaluate <- metrics/bench.json (bench: unchanged)`)."""
    no_causes: str = ""
    """Why there is no cause, when there is none."""
    notes: list[str] = field(default_factory=list)


def answer(report: Report) -> Answer:
    by_stage = {v.stage: v for v in report.stages}
    order = [v.stage for v in report.stages]
    rerun = [v.stage for v in report.stages if v.verdict in (StageVerdict.DIRECT, StageVerdict.DOWNSTREAM)]
    restore = [v.stage for v in report.stages if v.verdict == StageVerdict.OUTPUTS and _restorable(v)]
    rerun += [v.stage for v in report.stages if v.verdict == StageVerdict.OUTPUTS and v.stage not in restore]
    causes = _cause_lines(report.root_causes, by_stage, order, report)
    edited = report.machine.edited if report.machine is not None else []
    for line in causes:  # an edited torch file: which of its definitions changed, when a copy of the wheel says
        if line.kind == "machine" and line.what.startswith("torch.files") and edited:
            line.note = "; ".join(f"{f.path}: {_definitions(f.functions)}" for f in edited)
    numbers = {c.what: n for n, line in enumerate(causes, 1) for c in line.causes}
    headlines, same, shown = _headlines(report, numbers)
    machine = report.machine
    return Answer(
        a=report.a,
        b=report.b,
        causes=causes,
        rerun=[s for s in order if s in rerun],
        restore=restore,
        unknown=[v.stage for v in report.stages if v.verdict == StageVerdict.UNKNOWN],
        unchanged=[v.stage for v in report.stages if v.verdict == StageVerdict.UNCHANGED],
        always=[v.stage for v in report.stages if v.verdict == StageVerdict.ALWAYS],
        frozen=[v.stage for v in report.stages if v.verdict == StageVerdict.FROZEN],
        headlines=headlines,
        same=same,
        other_metrics=sum(1 for m in report.metrics if (m.file, m.key) not in shown),
        unread_facts=[c.what for c in machine.changes if not c.stages] if machine is not None else [],
        no_causes=no_causes(report) if not report.root_causes else "",
        notes=list(report.notes),
        uncaused=_uncaused(rerun, causes, by_stage),
    )


def _uncaused(rerun: list[str], causes: list[CauseLine], by_stage: dict[str, Verdict]) -> list[str]:
    reached = {s for c in causes for s in (*c.stages, *c.downstream)}
    found = []
    for name in (s for s in rerun if s not in reached):
        v = by_stage[name]
        found.append(v.paths[0] if v.paths else f"{name} <- upstream {', '.join(v.upstream)}")
    return found


def _definitions(functions: list[str] | None) -> str:
    if functions is None:
        return "no copy of the wheel to name the changed definitions"
    return "changed " + (", ".join(functions) or "only whitespace or comments")


def _restorable(v: Verdict) -> bool:
    return all(c.kind == "out" and c.evidence.endswith(RESTORABLE) for c in v.causes)


def _group(c: Cause) -> str | None:
    """The fingerprint group a machine-side cause belongs to (`threads`), None for any other cause."""
    prefix = f"{FINGERPRINT}:"
    key = c.what[len(prefix) :] if c.kind == "param" and c.what.startswith(prefix) else c.what
    if c.kind == "machine" or c.what.startswith(prefix):
        return key.split(".", 1)[0]
    return None


UNRECORDED = "unrecorded"
"""The kind of the one cause line that stands for every input the earlier side committed without a `dvc repro`
after (Report.as_committed): its dvc.lock's age, not a change between the sides."""
NAMED = 2
"""How many of those inputs its line names, before it says how many more."""


def _cause_lines(
    causes: list[Cause], by_stage: dict[str, Verdict], order: list[str], report: Report
) -> list[CauseLine]:
    groups: dict[tuple, list[Cause]] = {}
    committed = set(report.as_committed)
    for c in causes:
        group = _group(c)
        key = (UNRECORDED, "") if c.what in committed else (c.kind, group) if group else (c.kind, c.what)
        groups.setdefault(key, []).append(c)
    lines = []
    for (kind, name), members in groups.items():
        stages = [s for s in order if any(s in c.stages for c in members)]
        note = ""
        if kind == UNRECORDED:
            names = list(dict.fromkeys(_printed(c) for c in members))
            what, change = f"{report.a}'s dvc.lock predates {len(names)} inputs it commits", ""
            more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
            note = f"not rerun since: {', '.join(names[:NAMED])}{more}"
        elif len(members) == 1:
            c = members[0]
            what, change = _printed(c), _change(c)
        elif kind in ("param", "machine"):  # one fingerprint group: each key's own move, the group's prefix once
            members.sort(key=_printed)
            what = name
            keys = [_printed(c).split(".", 1)[-1] for c in members]
            olds = {json.dumps(c.old, sort_keys=True, default=str) for c in members}
            if len(olds) == 1 and not isinstance(members[0].old, dict):  # a group set up at once (all were null):
                # the keys first, so that a clipped line still names every one
                moves = [_change(c).split(" -> ", 1) for c in members]
                change = f"{', '.join(keys)}: {moves[0][0]} -> {', '.join(m[-1] for m in moves)}"
            else:
                change = "; ".join(f"{k}: {_change(c)}" for k, c in zip(keys, members, strict=True))
        else:  # one path, changed for some stages and dropped from another's deps: each change once
            what, change = name, ", ".join(dict.fromkeys(_change(c) for c in members))
        if kind == "out":
            note = "restorable: `dvc checkout`" if members[0].evidence.endswith(RESTORABLE) else "not in the cache"
        source = f"dvc.lock@{report.a} vs git@{report.a}" if kind == UNRECORDED else members[0].source
        lines.append(CauseLine(kind, what, change, source, stages, _downstream(stages, by_stage, order), note, members))
    return lines


def _printed(c: Cause) -> str:
    return named(c.what) if c.kind == "param" else c.what


def named(what: str) -> str:
    """A param as the first screen prints it: params.yaml's keys bare, the fingerprint file's by their key."""
    for prefix in (f"{PARAMS_FILE}:", f"{FINGERPRINT}:"):
        if what.startswith(prefix):
            return what[len(prefix) :]
    return what


def _change(c: Cause) -> str:
    if c.kind == "out":
        return "missing" if c.new == "missing" else "other bytes than dvc.lock records"
    if c.kind in ("dep", "cmd"):
        return "edited" if c.old is not None and c.new is not None else "added" if c.old is None else "removed"
    if c.kind == "machine":  # a fact this machine no longer has (a library uninstalled) is removed
        return env.fact_change(
            env.ABSENT if c.old is None else c.old, env.ABSENT if c.new is None else c.new, gone="removed"
        )
    return env.fact_change(c.old, c.new)


def _downstream(hit: list[str], by_stage: dict[str, Verdict], order: list[str]) -> list[str]:
    """The stages invalidated through `hit`: those whose changed upstream is one of them, or one of those,
    transitively; a stage another cause changes directly is invalidated through `hit` as well (growing the data
    reaches train whether or not a thread variable changed too)."""
    reached = set(hit)
    for name in order:  # upstream first: one pass reaches the whole closure
        v = by_stage[name]
        if v.verdict in (StageVerdict.DIRECT, StageVerdict.DOWNSTREAM) and reached & set(v.upstream):
            reached.add(name)
    return [s for s in order if s in reached and s not in hit]


def _headlines(report: Report, numbers: dict[str, int]) -> tuple[list[HeadlineLine], list[str], set[tuple[str, str]]]:
    """The headline figures that moved (with their verdicts, naming causes by their number on the screen), those
    recorded equal on both sides (labels), and the (file, key) of the moved ones."""
    deltas = {(m.file, m.key): m for m in report.metrics}
    moved, same, shown = [], [], set()
    for h in HEADLINES:
        label = h.label.split(" (", 1)[0]
        m = deltas.get((h.file, h.key))
        if m is None:
            if f"{h.file}:{h.key}" in report.headlines_same:
                same.append(label)
            continue
        shown.add((h.file, h.key))
        if m.old is None or m.new is None:
            line = HeadlineLine(label, m.name, m.old, m.new, None, "differs", "recorded on one side only")
        else:
            line = HeadlineLine(label, m.name, m.old, m.new, m.change, *_verdict(m, numbers))
        # measured against another thing on each side (speedup's baseline): said on the line, not like for like; a
        # side that records none (an older revision) is no claim either way, and stays behind --all
        against = [a for key in h.against if (a := deltas.get((h.file, key))) and None not in (a.old, a.new)]
        shown.update((a.file, a.key) for a in against)
        line.why += "".join(f"; against {a.key} {env.fact_change(a.old, a.new, width=20)}" for a in against)
        moved.append(line)
    return moved, same, shown


def _verdict(m: MetricDelta, numbers: dict[str, int]) -> tuple[str, str]:
    """(verdict, why): the noise call with the control's factor, and the causes on the figure's path by number."""
    listed = _numbered(sorted({numbers[c] for c in m.causes if c in numbers}))
    causes = " ".join(listed + [named(c) for c in m.causes if c not in numbers]) or "no cause above"
    if m.call is None:  # deterministic: any move is a change of its inputs
        return "differs", causes
    if m.call == NoiseCall.MACHINE:
        return NoiseCall.MACHINE, f"control {_factor(m.slowdown)}"
    if m.call == NoiseCall.NOISE:
        return NoiseCall.NOISE, "ranges overlap"
    if m.call == NoiseCall.UNMEASURED:
        return "unmeasured", "no spread recorded"
    assert m.call == NoiseCall.CHANGE
    if m.control.startswith("control not applied"):
        return NoiseCall.CHANGE, f"{causes}, the control set aside"
    if m.slowdown is not None:
        return NoiseCall.CHANGE, f"{causes}, beyond the control's {_factor(m.slowdown)}"
    return NoiseCall.CHANGE, causes


def _numbered(numbers: list[int]) -> list[str]:
    """Cause numbers as the screen names them, a run of three or more as one range: (1)-(4) (6)."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return [f"({r[0]})-({r[-1]})" if len(r) > 2 else " ".join(f"({n})" for n in r) for r in runs]


def _factor(slowdown: float | None) -> str:
    if slowdown is None:
        return "not applied"
    return f"{slowdown:.2f}x slower" if slowdown >= 1 else f"{1 / slowdown:.2f}x faster"


def no_causes(report: Report) -> str:
    unknown = [v.stage for v in report.stages if v.verdict == StageVerdict.UNKNOWN]
    if unknown:
        return f"none found, but unknowable for {', '.join(unknown)} (no record of them at {report.a})"
    return "nothing: every stage's recorded inputs are the same"

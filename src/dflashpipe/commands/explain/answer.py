"""The first screen of `dflashpipe explain`: the answer, before the evidence.

A Report holds every fact explain found; a person asking "what changed, and what did it cost?" needs three:
the root causes (what changed, from what to what, read from where) with the stages each one invalidates, what
`dvc repro` will do with each stage, and what happened to the headline figures (`headlines.HEADLINES`, the one
list) with their verdict. `answer` picks those out; everything else stays in the Report for `--all` and `--json`.
Under a headline that moved go the causes on its path, in DAG order with the command that would measure them, or
ranked by what `--verify` measured (`answer`'s `measured`), and its run's own record of how it ran.

Invariant: pure, like comparison.py: it reads only the Report. Facts are shortened where they are printed
(`env.fact_change`), never here: a CauseLine keeps the Causes it stands for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dflashpipe.commands.explain.records import RESTORABLE, Cause, MetricDelta, NoiseCall, Report, StageVerdict, Verdict
from dflashpipe.core import env
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.headlines import HEADLINES
from dflashpipe.core.pipeline import FINGERPRINT, PARAMS_FILE
from dflashpipe.core.revision import WORKSPACE


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

    @property
    def key(self) -> str:
        """The cause as the first screen names it, without its change: `param data.num_samples`, `machine
        threads`, `output data/compile` (what `answer`'s `measured` is keyed by)."""
        return UNRECORDED if self.kind == UNRECORDED else f"{'output' if self.kind == 'out' else self.kind} {self.what}"


@dataclass
class PathCause:
    """A root cause on a headline's path, as the headline lists it."""

    number: int | None
    """Its number among the Causes (None: on the path but no line of its own)."""
    key: str
    effect: float | None = None
    """What --verify measured reverting it alone did to the figure (the fraction of the way back to A)."""


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
    causes: list[PathCause] = field(default_factory=list)
    """The root causes on its path (MetricDelta.causes) when it moved: in DAG order, or by |effect| when measured."""
    measured: bool = False
    """Whether `causes` carry --verify's measured effects."""
    verify: str = ""
    """The command that would measure them, while they are not measured."""
    ran: list[str] = field(default_factory=list)
    """What the later side's run recorded of itself (MetricDelta.ran), fact by fact: where its kernels came from,
    what compiled, the target's and drafter's busy time; none when its record says none of it."""


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


def answer(report: Report, measured: Mapping[str, Mapping[str, float]] | None = None) -> Answer:
    """The first screen of `report`. `measured`: what --verify measured, per headline figure (`file:key`), per
    cause (`CauseLine.key`, or a root cause's `Cause.what`), as the fraction of the way back to A that reverting
    it alone went; a measured headline ranks its causes by that, largest first, instead of asking for --verify."""
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
    headlines, same, shown = _headlines(report, numbers, causes, measured or {})
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


def _headlines(
    report: Report, numbers: dict[str, int], lines: list[CauseLine], measured: Mapping[str, Mapping[str, float]]
) -> tuple[list[HeadlineLine], list[str], set[tuple[str, str]]]:
    """The headline figures that moved (with their verdicts and the causes on their paths), those recorded equal
    on both sides (labels), and the (file, key) of the moved ones."""
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
            line = HeadlineLine(label, m.name, m.old, m.new, m.change, *_verdict(m))
            if line.verdict in MOVED:
                _path_causes(line, m, numbers, lines, measured.get(f"{m.file}:{m.key}"), report)
                line.ran = _ran(m.ran)
        # measured against another thing on each side (speedup's baseline): said on the line, not like for like; a
        # side that records none (an older revision) is no claim either way, and stays behind --all
        against = [a for key in h.against if (a := deltas.get((h.file, key))) and None not in (a.old, a.new)]
        shown.update((a.file, a.key) for a in against)
        line.why += "".join(f"; against {a.key} {env.fact_change(a.old, a.new, width=20)}" for a in against)
        moved.append(line)
    return moved, same, shown


MOVED = ("differs", NoiseCall.CHANGE, NoiseCall.MACHINE)
"""The verdicts of a headline that moved: its causes and its run's own record are listed under it."""


def _path_causes(
    line: HeadlineLine,
    m: MetricDelta,
    numbers: dict[str, int],
    lines: list[CauseLine],
    measured: Mapping[str, float] | None,
    report: Report,
) -> None:
    """The causes on `m`'s path under its headline: in DAG order (their numbers) with the command that would
    measure them, or with `measured` ranked by the size of their effect, the unmeasured last."""
    on_path = sorted({numbers[c] for c in m.causes if c in numbers})
    line.causes = [PathCause(n, lines[n - 1].key) for n in on_path]
    line.causes += [PathCause(None, named(c)) for c in m.causes if c not in numbers]
    if not line.causes:
        return
    if measured is None:
        # verify reverts to A, a recorded state; B is named only where it is not its default, the workspace
        sides = report.a if report.b == WORKSPACE else f"{report.a} {report.b}"
        line.verify = "" if report.a == WORKSPACE else f"dflashpipe explain {sides} --verify {m.file}:{m.key}"
        return
    for cause in line.causes:
        members = lines[cause.number - 1].causes if cause.number else []
        found = [measured[k] for k in (cause.key, *(c.what for c in members)) if k in measured]
        cause.effect = max(found, key=abs) if found else None
    line.measured = True
    line.causes.sort(key=lambda c: -abs(c.effect) if c.effect is not None else 1)  # stable: DAG order in ties


def _verdict(m: MetricDelta) -> tuple[str, str]:
    """(verdict, why): the noise call with the control's factor; the causes go under the line (_path_causes)."""
    causes = "" if m.causes else "no cause above"
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
        return NoiseCall.CHANGE, ", ".join(filter(None, [causes, "the control set aside"]))
    if m.slowdown is not None:
        return NoiseCall.CHANGE, ", ".join(filter(None, [causes, f"beyond the control's {_factor(m.slowdown)}"]))
    return NoiseCall.CHANGE, causes


KERNELS = {"artifact": "kernels from the compile cache", "cold compile": "kernels compiled here", "eager": "eager"}
"""Where a run's kernels came from, by the start of what its record says (compile.artifact's
`load_artifact_or_go_cold`, or eager); the rest (why a compile went cold) is in --json."""


def _ran(facts: dict[str, Any]) -> list[str]:
    """One line of what a run recorded of itself (MetricDelta.ran): where its kernels came from, the warm-up's
    seconds, the graphs compiled and recompiled while it was timed, each side's busy time. Only what it holds."""
    said = []
    source = facts.get("compile.source", facts.get("compile_source"))
    if isinstance(source, str):
        said.append(next((w for k, w in KERNELS.items() if source.startswith(k)), f"kernels: {source}"))
    if (warm := json_number(facts.get("compile.warmup_s"))) is not None:
        said.append(f"warm-up {_seconds(warm)} s")
    graphs = json_number(facts.get("compile.new_graphs_in_workers", facts.get("graphs_compiled_while_timed")))
    recompiles = [json_number(v) for k, v in facts.items() if k.endswith(".recompiles_in_thread")]
    timed = [] if graphs is None else [f"{graphs:.0f} graph{'' if graphs == 1 else 's'}"]
    timed += [f"{sum(recompiles):.0f} recompiles"] if recompiles and None not in recompiles else []
    if timed:
        nothing = graphs in (None, 0) and not any(recompiles)
        said.append("no compiles while timed" if nothing else f"{', '.join(timed)} while timed")
    busy = [json_number(facts.get(f"busy_s.{side}")) for side in ("target", "drafter")]
    if None not in busy:
        said.append(f"busy target {_seconds(busy[0])} s, drafter {_seconds(busy[1])} s")
    return said


def _seconds(value: float) -> str:
    """Three significant digits, never an exponent (499, 1234, 41.2, 1.04)."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _factor(slowdown: float | None) -> str:
    if slowdown is None:
        return "not applied"
    return f"{slowdown:.2f}x slower" if slowdown >= 1 else f"{1 / slowdown:.2f}x faster"


def no_causes(report: Report) -> str:
    unknown = [v.stage for v in report.stages if v.verdict == StageVerdict.UNKNOWN]
    if unknown:
        return f"none found, but unknowable for {', '.join(unknown)} (no record of them at {report.a})"
    return "nothing: every stage's recorded inputs are the same"

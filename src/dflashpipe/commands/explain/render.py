"""Rendering a Report: text for the terminal (rich), Markdown for an issue or PR, JSON for machines.

Text and Markdown open with the answer (`answer.Answer`: the root causes, what `dvc repro` will do with each
stage, the headline figures with their verdicts) in at most WIDTH columns; `full` (`--all`) prints every verdict,
every metric and the evidence in full after it. JSON is always the whole Report.

Invariant: presentation only. Every statement printed is a field of the Report (or of its Answer, which only
selects from it); nothing is read here, so the forms always agree.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from dflashpipe.commands.explain.answer import UNRECORDED, Answer, HeadlineLine, PathCause, answer, no_causes
from dflashpipe.commands.explain.records import Cause, Machine, MetricDelta, NoiseCall, Report, StageVerdict, Verdict


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    if isinstance(value, str) and len(value) == 32 or (isinstance(value, str) and value.endswith(".dir")):
        return value[:12]
    return text if len(text) <= 80 else text[:77] + "..."


def cause_line(c: Cause) -> str:
    what = {"param": "param", "dep": "dep", "cmd": "cmd of", "out": "output", "machine": "machine"}[c.kind]
    return f"{what} {c.what}: {_short(c.old)} -> {_short(c.new)}"


def machine_lines(m: Machine | None) -> list[str]:
    """What the live machine says, first: a stale fingerprint file makes the rest of the report describe
    a machine that is not this one."""
    if m is None:
        return []
    if not m.stale:
        lines = [f"the fingerprint file matches this machine ({m.check})"]
    else:
        changed = "; ".join(f"{c.what} now {_short(c.new)} (recorded {_short(c.old)})" for c in m.changes)
        lines = [
            f"the fingerprint file is stale: {changed}; these stages are invalid on this machine: "
            f"{', '.join(m.invalid) or 'none'} ({m.check})"
        ]
    for f in m.edited:
        if f.functions is None:
            where = "no copy of the wheel to diff against"
        else:
            where = "changed definitions: " + (", ".join(f.functions) or "none (only whitespace or comments)")
        lines.append(f"edited installed file {f.path}: {f.now} (the wheel's RECORD says {f.recorded}); {where}")
    return lines


def to_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2, default=str)


def to_markdown(report: Report, full: bool = False) -> str:
    """The answer as Markdown; with `full`, every verdict, metric and piece of evidence after it."""
    marks = {TITLE: "## ", SECTION: "### ", ITEM: "- ", DETAIL: "  - ", FOOTER: ""}
    lines = []
    for level, text in answer_lines(answer(report), full, width=None):
        lines += ([""] if level in (SECTION, FOOTER) else []) + [marks[level] + text]
    if full:
        lines += ["", *_markdown_all(report)]
    return "\n".join(lines) + "\n"


def _markdown_all(report: Report) -> list[str]:
    lines = []
    if report.machine is not None:
        lines += ["### This machine", *[f"- {line}" for line in machine_lines(report.machine)], ""]
    lines.append("### Root causes, with their evidence")
    if not report.root_causes:
        lines.append(f"- {no_causes(report)}")
    for c in report.root_causes:
        lines.append(f"- `{cause_line(c)}` — hits {', '.join(c.stages)}  \n  evidence: `{c.evidence}`")
    lines += ["", "### Stages (DAG order)", "", "| stage | verdict | why |", "|---|---|---|"]
    for v in report.stages:
        lines.append(f"| {v.stage} | {v.verdict} | {verdict_reason(v)} |")
    lines += ["", "### Metrics"]
    if not report.metrics:
        lines.append("- no metric differs")
    for m in report.metrics:
        change, source = metric_line(m)
        lines.append(f"- `{m.name or m.key}` {change} ({source})")
    return lines


def metric_line(m: MetricDelta) -> tuple[str, str]:
    """'old -> new (+x%)', with the noise call for a timed figure, and where it came from, with the changed
    inputs behind it (none for a move within noise)."""
    pct = f" ({m.change:+.0%})" if m.change is not None else ""
    call = f" [{m.call}]" if m.call else ""
    why = (
        "within noise: not attributed"
        if m.call == NoiseCall.NOISE
        else "the machine's move, as the control measured it: not attributed"
        if m.call == NoiseCall.MACHINE
        else ", ".join(m.causes) or "none recorded"
    )
    spread = f"; {m.spread}" if m.spread else ""
    spread += f"; {m.control}" if m.control else ""
    machine = f"; recorded machine facts: {m.machine}" if m.machine else ""
    return f"{m.old} -> {m.new}{pct}{call}", f"{m.file}, stage {m.stage}; changed inputs: {why}{spread}{machine}"


def verdict_reason(v: Verdict) -> str:
    if v.verdict == StageVerdict.DIRECT:
        return "; ".join(cause_line(c) for c in v.causes)
    if v.verdict == StageVerdict.DOWNSTREAM:
        if v.paths:
            return "; ".join(v.paths)
        return f"upstream {', '.join(v.upstream)} changed or will be regenerated"
    if v.verdict == StageVerdict.OUTPUTS:
        return "; ".join(f"{cause_line(c)} ({c.evidence.split('; ')[-1]})" for c in v.causes)
    if v.verdict == StageVerdict.UNCHANGED:
        return v.note or "none of its deps, params or upstream outputs changed"
    return v.note


WIDTH = 100
"""Columns of the first screen: every line of the answer fits, long facts cut where they are printed."""
TITLE, SECTION, ITEM, DETAIL, FOOTER = range(5)
"""The levels of an answer line: text indents an item by 2 and a detail by 4, Markdown makes them a list."""
INDENT = {TITLE: 0, SECTION: 0, ITEM: 2, DETAIL: 4, FOOTER: 0}
LISTED = 3
"""How many of the machine facts no stage reads the last line names, before it says how many more."""


def answer_lines(found: Answer, full: bool = False, width: int | None = WIDTH) -> list[tuple[int, str]]:
    """The first screen as (level, text): a title, then the sections Causes, Stages and Headlines, and a last
    line saying what --all adds. Each line fits `width` columns once indented (None: as long as it is)."""
    lines: list[tuple[int, str]] = [(TITLE, f"What changed: {found.a} -> {found.b}"), (SECTION, "Causes")]

    def add(level: int, text: str, wrap: bool = False) -> None:
        room = None if width is None else width - INDENT[level]
        if room is None or len(text) <= room:
            parts = [(level, text)]
        elif not wrap:
            parts = [(level, text[: room - 3] + "...")]
        else:
            first, *rest = textwrap.wrap(text, room, break_on_hyphens=False)
            more = textwrap.wrap(" ".join(rest), room - 2)
            parts = [(level, first), *((DETAIL if level == ITEM else level, part) for part in more)]
        lines.extend((at, part.replace(UNBROKEN, " ")) for at, part in parts)

    if not found.causes:
        add(ITEM, found.no_causes)
    for n, c in enumerate(found.causes, 1):
        if c.kind == "out":
            add(ITEM, f"({n}) output {c.what} of {', '.join(c.stages)}: {c.change}; {c.note}")
            continue
        # what changed, from what to what, then the stages it invalidates; the evidence's name goes where it fits
        item = f"({n}) {c.what}" if c.kind == UNRECORDED else f"({n}) {c.kind} {c.what}: {c.change}"
        source = f"[{c.source}]"
        downstream = f"; downstream {', '.join(c.downstream)}" if c.downstream else ""
        detail = f"invalidates {', '.join(c.stages)}{downstream}"
        if width is None or INDENT[ITEM] + len(item) + 2 + len(source) <= width:
            add(ITEM, f"{item}  {source}")
            add(DETAIL, detail, wrap=True)
        elif INDENT[DETAIL] + len(detail) + 2 + len(source) <= width:
            add(ITEM, item)
            add(DETAIL, f"{detail}  {source}")
        else:
            add(ITEM, item)
            add(DETAIL, detail, wrap=True)
            add(DETAIL, source)
        if c.note:
            add(DETAIL, c.note)
    lines.append((SECTION, "Stages"))
    for label, names in (
        ("invalidated", found.rerun),
        ("restore with `dvc checkout`", found.restore),
        ("unknown (no record at the earlier side)", found.unknown),
        ("frozen", found.frozen),
        ("unchanged", found.unchanged),
        ("always runs", found.always),
    ):
        if names:
            add(ITEM, f"{label}: {', '.join(names)}", wrap=True)
        if names and label == "invalidated":
            for path in found.uncaused:  # what makes it rerun when no cause above reaches it
                add(DETAIL, path)
    lines.append((SECTION, "Headlines"))
    if not found.headlines:
        add(ITEM, "no headline figure differs")
    moves = [_move(h.old, h.new, h.change) for h in found.headlines]
    labels = max((len(h.label) for h in found.headlines), default=0)
    widest = max((len(move) for move in moves), default=0)
    for h, move in zip(found.headlines, moves, strict=True):
        add(ITEM, f"{h.label:<{labels}}  {move:<{widest}}  {h.verdict}{': ' * bool(h.why)}{h.why}", wrap=True)
        if h.causes:
            add(DETAIL, _path(h), wrap=True)
        if h.verify:
            add(DETAIL, f"not verified: {h.verify}", wrap=True)
        if h.ran:
            add(DETAIL, f"{found.b} ran: {'; '.join(_unbroken(fact) for fact in h.ran)}", wrap=True)
    if found.same:
        add(ITEM, f"the same: {', '.join(found.same)}", wrap=True)
    for note in found.notes:
        add(ITEM, f"note: {note}")
    if not full:
        more = ["every stage's reason"]
        if found.other_metrics:
            one = found.other_metrics == 1
            more.append(f"{found.other_metrics} more {'metric that differs' if one else 'metrics that differ'}")
        if found.unread_facts:
            facts, named = "fact" if len(found.unread_facts) == 1 else "facts", found.unread_facts[:LISTED]
            others = f" and {len(found.unread_facts) - LISTED} more" if len(found.unread_facts) > LISTED else ""
            more.append(f"{len(found.unread_facts)} machine {facts} no stage reads ({', '.join(named)}{others})")
        add(FOOTER, f"--all: {', '.join(more)}, the evidence in full; --json: all of it", wrap=True)
    return lines


def _path(h: HeadlineLine) -> str:
    """The causes on a headline's path: by their number (DAG order), or ranked by --verify's measured effect."""
    if not h.measured:
        return "on its path: " + ", ".join(_unbroken(_numbered(c)) for c in h.causes)
    effects = [f"{c.effect:+.0%} measured" if c.effect is not None else "not measured" for c in h.causes]
    ranked = [_unbroken(f"{_numbered(c)} {e}") for c, e in zip(h.causes, effects, strict=True)]
    return "by measured effect: " + ", ".join(ranked)


UNBROKEN = "\u00a0"
"""A space a wrapped line is not broken at (textwrap breaks at ASCII whitespace only), printed as a space: a cause
keeps its effect, a fact its figure and unit."""


def _unbroken(text: str) -> str:
    return text.replace(" ", UNBROKEN)


def _numbered(c: PathCause) -> str:
    return f"({c.number}) {c.key}" if c.number else c.key


def _move(old: Any, new: Any, change: float | None) -> str:
    """`old -> new (+x%)`, each with the fewest significant digits (4 to 10) that tell two numbers apart."""
    digits = 4
    while digits < 10 and isinstance(old, float | int) and isinstance(new, float | int) and old != new:
        if f"{old:.{digits}g}" != f"{new:.{digits}g}":
            break
        digits += 1
    texts = [f"{v:.{digits}g}" if isinstance(v, float) else _short(v) for v in (old, new)]
    return f"{texts[0]} -> {texts[1]}" + (f" ({change:+.0%})" if change is not None else "")


def print_text(report: Report, full: bool = False, measured: Mapping[str, Mapping[str, float]] | None = None) -> None:
    """The answer (a headline's causes ranked by `measured` effects where given: `answer`); with `full` (`--all`),
    every verdict, metric and piece of evidence after it."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False, soft_wrap=True)  # the lines fit WIDTH: a narrower terminal wraps them itself
    style = {TITLE: "bold", SECTION: "bold", FOOTER: "dim"}
    for level, text in answer_lines(answer(report, measured), full):
        line = " " * INDENT[level] + escape(text)
        console.print(f"[{style[level]}]{line}[/{style[level]}]" if level in style else line)
    if full:
        _print_all(report, console)


def _print_all(report: Report, console) -> None:
    from rich.markup import escape

    console.print("\n[bold]In full[/bold]")
    for line in machine_lines(report.machine):
        console.print(f"[bold red]{escape(line)}[/bold red]" if report.machine.stale else f"[dim]{escape(line)}[/dim]")
    console.print("\n[bold]Root causes[/bold]")
    if not report.root_causes:
        console.print(f"  {escape(no_causes(report))}")
    for c in report.root_causes:
        console.print(f"  • {escape(cause_line(c))}  [dim]hits {', '.join(c.stages)}[/dim]")
        console.print(f"    [dim]evidence: {escape(c.evidence)}[/dim]")
    colour = {
        StageVerdict.DIRECT: "red",
        StageVerdict.DOWNSTREAM: "yellow",
        StageVerdict.OUTPUTS: "magenta",
        StageVerdict.UNCHANGED: "green",
    }
    console.print("\n[bold]Stages[/bold] (DAG order)")
    for v in report.stages:
        style = colour.get(v.verdict, "cyan")
        console.print(f"  [{style}]{v.stage}: {v.verdict}[/{style}] — {escape(verdict_reason(v))}")
    console.print("\n[bold]Metrics[/bold]")
    if not report.metrics:
        console.print("  no metric differs")
    for m in report.metrics:
        change, source = metric_line(m)
        console.print(f"  • {escape(m.name or m.key)} {escape(change)}  [dim]{escape(source)}[/dim]")

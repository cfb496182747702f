"""Rendering a Report: text for the terminal (rich), Markdown for an issue or PR, JSON for machines.

Invariant: presentation only. Every statement printed is a field of the Report; nothing is computed or
read here, so the three forms always agree.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from dflashpipe.explain.report import (
    DIRECT,
    DOWNSTREAM,
    MACHINE,
    NOISE,
    OUTPUTS,
    UNCHANGED,
    UNKNOWN,
    Cause,
    Machine,
    MetricDelta,
    Report,
    Verdict,
)


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


def to_markdown(report: Report) -> str:
    lines = [f"## What changed: {report.a} -> {report.b}", ""]
    if report.machine is not None:
        lines += ["### This machine", *[f"- {line}" for line in machine_lines(report.machine)], ""]
    lines.append("### Root causes")
    if not report.root_causes:
        lines.append(f"- {_no_causes(report)}")
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
    return "\n".join(lines) + "\n"


def metric_line(m: MetricDelta) -> tuple[str, str]:
    """'old -> new (+x%)', with the noise call for a timed figure, and where it came from, with the changed
    inputs behind it (none for a move within noise)."""
    pct = f" ({m.change:+.0%})" if m.change is not None else ""
    call = f" [{m.call}]" if m.call else ""
    why = (
        "within noise: not attributed"
        if m.call == NOISE
        else "the machine's move, as the control measured it: not attributed"
        if m.call == MACHINE
        else ", ".join(m.causes) or "none recorded"
    )
    spread = f"; {m.spread}" if m.spread else ""
    spread += f"; {m.control}" if m.control else ""
    machine = f"; recorded machine facts: {m.machine}" if m.machine else ""
    return f"{m.old} -> {m.new}{pct}{call}", f"{m.file}, stage {m.stage}; changed inputs: {why}{spread}{machine}"


def _no_causes(report: Report) -> str:
    unknown = [v.stage for v in report.stages if v.verdict == UNKNOWN]
    if unknown:
        return f"none found, but unknowable for {', '.join(unknown)} (no record of them at {report.a})"
    return "nothing: every stage's recorded inputs are the same"


def verdict_reason(v: Verdict) -> str:
    if v.verdict == DIRECT:
        return "; ".join(cause_line(c) for c in v.causes)
    if v.verdict == DOWNSTREAM:
        if v.paths:
            return "; ".join(v.paths)
        return f"upstream {', '.join(v.upstream)} changed or will be regenerated"
    if v.verdict == OUTPUTS:
        return "; ".join(f"{cause_line(c)} ({c.evidence.split('; ')[-1]})" for c in v.causes)
    if v.verdict == UNCHANGED:
        return v.note or "none of its deps, params or upstream outputs changed"
    return v.note


def print_text(report: Report) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(f"[bold]What changed: {report.a} -> {report.b}[/bold]")
    for line in machine_lines(report.machine):
        console.print(f"[bold red]{escape(line)}[/bold red]" if report.machine.stale else f"[dim]{escape(line)}[/dim]")
    console.print("\n[bold]Root causes[/bold]")
    if not report.root_causes:
        console.print(f"  {escape(_no_causes(report))}")
    for c in report.root_causes:
        console.print(f"  • {escape(cause_line(c))}  [dim]hits {', '.join(c.stages)}[/dim]")
        console.print(f"    [dim]evidence: {escape(c.evidence)}[/dim]")
    colour = {DIRECT: "red", DOWNSTREAM: "yellow", OUTPUTS: "magenta", UNCHANGED: "green"}
    console.print("\n[bold]Stages[/bold] (DAG order)")
    for v in report.stages:
        style = colour.get(v.verdict, "cyan")
        console.print(f"  [{style}]{v.stage}: {v.verdict}[/{style}] — {escape(verdict_reason(v))}")
    console.print("\n[bold]Metrics[/bold]")
    if not report.metrics:
        console.print("  no metric differs")
    for m in report.metrics:
        change, source = metric_line(m)
        console.print(f"  • {escape(m.name or m.key)} {change}  [dim]{escape(source)}[/dim]")

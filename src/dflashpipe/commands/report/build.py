"""`dflashpipe report`: one page for the current state of the pipeline, to paste into a PR or open after a run.

The page holds (1) the DAG in dvc.yaml order with each stage's verdict and reason from `explain` HEAD vs the
workspace, (2) the headline metrics with their spread and HEAD's value beside them, (3) the plots: PNG images
found under metrics/ and an inline SVG chart (core/plots.py's Vega-Lite specs, rendered by vl-convert) for each
plot table dvc.yaml names, and (4) the `explain` Markdown itself. contents.py says what the page holds (the
`RunReport`, and which headline figures); page.py lays it out: HTML, one self-contained file (no script,
no network URL), or Markdown with an images folder beside it.

Invariant: the same state gives the same bytes. The only varying line is "generated from <git revision>";
no wall clock, and everything is read in a sorted or dvc.yaml order.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path
from typing import Any

from dflashpipe.commands.explain import WORKSPACE, Report, explain, to_markdown
from dflashpipe.commands.explain.render import verdict_reason
from dflashpipe.commands.report.contents import BenchmarkTable, Chart, Headline, RunReport
from dflashpipe.commands.report.page import to_html, to_markdown_page
from dflashpipe.core import plots
from dflashpipe.core.artifacts import write_bytes_atomic
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.headlines import HEADLINES, SLOT_ACCURACY
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.pipeline import EVAL_DETAIL, EVAL_METRICS, METRICS, SERVE_METRICS, Pipeline
from dflashpipe.core.revision import commit_of

SINGLE = "single measurement"


# ---------------------------------------------------------------- reading the state


def build(root: str | Path = ".") -> RunReport:
    root = Path(root)
    explained: Report | None = None
    error = ""
    try:
        explained = explain("HEAD", WORKSPACE, root)
    except DflashpipeError as exc:
        error = str(exc)
    return RunReport(
        revision=_revision(root),
        stages=_stage_rows(root, explained, error),
        headlines=_headlines(root, explained),
        charts=_charts(root),
        images=[(str(p.relative_to(root)), p.read_bytes()) for p in sorted((root / METRICS).rglob("*.png"))],
        explain_md=to_markdown(explained, full=True) if explained else f"explain HEAD vs workspace failed: {error}\n",
        error=error,
        benchmarks=benchmark_table(root),
    )


POSITIONS = ("1", "2", "3")
TABLE_NOTES = ("tau", "tau_pooled", "speedup", "acceptance_per_position", "requests")


def benchmark_table(root: str | Path = ".") -> BenchmarkTable | None:
    """The DFlash paper's table from evaluate's detail (metrics/detail/eval.json) and, where the served check
    ran, vLLM's tau per benchmark (metrics/serve.json); None where evaluate has written no rows."""
    root = Path(root)
    detail = _read_json(root / EVAL_DETAIL) or _read_json(root / EVAL_METRICS)
    rows = _lookup(detail, "benchmarks")
    if not isinstance(rows, dict) or not rows:
        return None
    served = _lookup(_read_json(root / SERVE_METRICS), "benchmarks") or {}
    columns = ["benchmark", "tau", "tau pooled", "speedup", *(f"accept@{k}" for k in POSITIONS), "requests"]
    columns.append("served tau")
    table = []
    for name, row in rows.items():
        accepted = row.get("acceptance_per_position") or {}
        figures = [row.get("tau"), row.get("tau_pooled"), row.get("speedup"), *(accepted.get(k) for k in POSITIONS)]
        theirs = _lookup(served, f"{name}.tau") if isinstance(served, dict) else None
        table.append([name, *map(_figure, figures), str(row.get("requests", "-")), _figure(theirs)])
    definitions = _lookup(detail, "definitions") or {}
    notes = [f"{key}: {definitions[key]}" for key in TABLE_NOTES if key in definitions]
    notes.append(f"served tau: vLLM's mean acceptance length on the same requests ({SERVE_METRICS}); -: not served")
    first = next(iter(rows.values()))
    notes.append(f"generation: at most {first.get('max_new_tokens', '?')} new tokens, {first.get('thinking', '?')}")
    return BenchmarkTable(columns, table, notes)


def _figure(value: Any) -> str:
    number = _float(value)
    return "-" if number is None else f"{number:.3f}"


def _revision(root: Path) -> str:
    return commit_of(root, "HEAD") or "no git revision (not a git repository, or no commit)"


def _stage_rows(root: Path, explained: Report | None, error: str) -> list[tuple[str, str, str, str]]:
    verdicts = {v.stage: v for v in explained.stages} if explained else {}
    rows = []
    for name, spec in Pipeline.read(root).specs.items():
        v = verdicts.get(name)
        verdict, why = (v.verdict, verdict_reason(v)) if v else ("unknown", error or "explain gave no verdict")
        rows.append((name, verdict, why, _outputs(root, spec.plain_outs)))
    return rows


def _outputs(root: Path, outs: tuple[str, ...]) -> str:
    """Whether the stage's outs (not metrics/plots) exist in the workspace: a report after a fresh clone says so."""
    if not outs:
        return "none declared"
    missing = [o for o in outs if not (root / o).exists()]
    return f"missing: {', '.join(missing)}" if missing else "present"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _read_record(path: Path) -> Any:
    """A metrics file with its detail file (core.metrics), None where unreadable."""
    try:
        return read_record_at(path)
    except DflashpipeError:
        return None


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _headlines(root: Path, explained: Report | None) -> list[Headline]:
    specs = [(h.label, h.file, h.key, h.spread) for h in HEADLINES]
    slots = _lookup(_read_record(root / SLOT_ACCURACY[0]), SLOT_ACCURACY[1])
    for slot in sorted(slots or {}, key=lambda s: (len(s), s)):
        specs.append((f"per-slot accuracy, slot {slot}", SLOT_ACCURACY[0], f"{SLOT_ACCURACY[1]}.{slot}", None))
    deltas = {(m.file, m.key): m for m in explained.metrics} if explained else {}
    out = []
    for label, file, key, spread in specs:
        data = _read_record(root / file)
        value = _lookup(data, key)
        if value is None:
            value = f"missing ({file} not in the workspace)" if data is None else f"missing (no {key} in {file})"
        if explained is None:
            head = "unknown (explain failed)"
        elif (file, key) in deltas:
            m = deltas[(file, key)]
            pct = f" ({m.change:+.1%} at workspace)" if m.change is not None else ""
            head = f"{m.old}{pct}"
        else:
            head = "same"
        out.append(Headline(label, file, key, value, head, _spread(root, spread)))
    return out


def _spread(root: Path, spec: tuple[str, str, str] | None) -> str:
    if spec is None:
        return SINGLE
    file, column, unit = spec
    values = [y for _, y in _series(_rows(root / file), None, column) if y is not None]
    if len(values) < 2:
        return SINGLE
    return (
        f"min {_num(min(values))} / median {_num(statistics.median(values))} / max {_num(max(values))}"
        f" over {len(values)} {unit}s ({file})"
    )


def _num(x: float) -> str:
    return f"{x:.4g}"


def _rows(path: Path) -> list[dict[str, Any]]:
    """A plot table: a JSON list of records, or a TSV/CSV with a header. [] when unreadable."""
    if path.suffix == ".json":
        data = _read_json(path)
        if isinstance(data, dict):  # {"name": [records]}: DVC accepts one list under a key
            data = next((v for v in data.values() if isinstance(v, list)), None)
        return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return []
    return list(csv.DictReader(io.StringIO(text), delimiter="\t" if path.suffix == ".tsv" else ","))


def _float(v: Any) -> float | None:
    try:
        return None if isinstance(v, bool) else float(v)
    except (TypeError, ValueError):
        return None


def _series(rows: list[dict[str, Any]], x: str | None, y: str) -> list[tuple[Any, float | None]]:
    return [(r.get(x, i) if x else i, _float(r.get(y))) for i, r in enumerate(rows)]


def _plot_specs(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """(path, its dvc.yaml plot options) for every plot of every stage, in dvc.yaml order."""
    return [plot for spec in Pipeline.read(root).specs.values() for plot in spec.plots]


TABLES = (".tsv", ".csv", ".json")
"""Plot tables drawn here; image plots (PNG) are embedded as they are, found under metrics/."""


def _numeric(rows: list[dict[str, Any]], column: str) -> bool:
    return all(_float(v) is not None for v in (r.get(column) for r in rows) if v not in (None, ""))


def _axes(rows: list[dict[str, Any]], opts: dict[str, Any]) -> tuple[str | None, str, bool]:
    """(category or x column, value column, bar?) for a table and its dvc.yaml options.

    DVC's bar_horizontal puts the value on x and the category on y; a non-numeric column is a category
    whatever its axis."""
    x = opts.get("x") if isinstance(opts.get("x"), str) else None
    y = opts.get("y") if isinstance(opts.get("y"), str) else next((c for c in rows[0] if c != x), None)
    template = str(opts.get("template", ""))
    bar = template.startswith("bar") or any(c is not None and not _numeric(rows, c) for c in (x, y))
    if bar and x and y:
        swap = not _numeric(rows, y) or (template == "bar_horizontal" and _numeric(rows, x))
        if swap and _numeric(rows, x):
            x, y = y, x
    return x, y or "", bar


def _charts(root: Path) -> list[Chart]:
    charts = []
    for path, opts in _plot_specs(root):
        target = root / path
        files = sorted(target.iterdir()) if target.is_dir() else [target]
        for file in (f for f in files if f.suffix in TABLES):
            rows = _rows(file)
            if not rows:
                continue
            x, y, bar = _axes(rows, opts)
            series = _series(rows, x, y)
            if not any(v is not None for _, v in series):
                continue
            title = f"{y} by {x or 'index'}"
            charts.append(Chart(title, str(file.relative_to(root)), plots.svg(_chart_spec(series, x, y, bar, title))))
    return charts


def _chart_spec(series: list[tuple[Any, float | None]], x: str | None, y: str, bar: bool, title: str) -> dict:
    """core/plots.py's Vega-Lite spec for a series; fields "x"/"y" (a column name may hold a dot Vega-Lite would
    read as a path), with the columns' names as axis titles. Bars run horizontally, as DVC's bar_horizontal."""
    if bar:
        rows = [{"x": str(xv), "y": yv} for xv, yv in series]
        return plots.bar_spec(rows, "x", "y", title, horizontal=True, category_title=x or "index", value_title=y)
    rows = [{"x": _float(xv), "y": yv} for xv, yv in series if _float(xv) is not None]
    return plots.line_spec(rows, "x", "y", title, x_title=x or "index", y_title=y)


def write_report(root: str | Path = ".", out: str | Path | None = None, md: bool = False) -> Path:
    """Build the page for `root` and write it atomically to `out`; returns the path written."""
    r = build(root)
    path = Path(out) if out else Path("report.md" if md else "report.html")
    if not md:
        write_bytes_atomic(path, to_html(r).encode("utf-8"))
        return path
    images = path.parent / f"{path.stem}_images"
    text, files = to_markdown_page(r, images.name)
    for name, data in sorted(files.items()):
        write_bytes_atomic(images / name, data)
    if images.is_dir():  # a previous report's images that this one no longer has
        for stale in sorted(images.iterdir()):
            if stale.is_file() and stale.name not in files:
                stale.unlink()
    write_bytes_atomic(path, text.encode("utf-8"))
    return path

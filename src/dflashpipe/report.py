"""`dflashpipe report`: one page for the current state of the pipeline, to paste into a PR or open after a run.

The page holds (1) the DAG in dvc.yaml order with each stage's verdict and reason from `explain` HEAD vs the
workspace, (2) the headline metrics with their spread and HEAD's value beside them, (3) the plots: PNG images
found under metrics/ and a small SVG chart drawn here for each plot table dvc.yaml names, and (4) the `explain`
Markdown itself. HTML is one self-contained file (inline CSS, images as data: URIs, no script, no network
URL); Markdown comes with an images folder beside it.

Invariant: the same state gives the same bytes. The only varying line is "generated from <git revision>";
no wall clock, and everything is read in a sorted or dvc.yaml order.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import re
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashpipe.artifacts import write_bytes_atomic
from dflashpipe.errors import DflashpipeError
from dflashpipe.explain import WORKSPACE, Report, explain, to_markdown
from dflashpipe.explain.render import _why
from dflashpipe.pipeline import METRICS, TRAIN_METRICS, read_dvc_yaml, stage_names

EVAL_METRICS = "metrics/eval.json"
TRAIN = str(TRAIN_METRICS)
PER_PROMPT = "metrics/eval/speedup_per_prompt.json"
TRAIN_TOKENS_PER_STEP = "metrics/train/plots/metrics/tokens_per_s.tsv"
SINGLE = "single measurement"

HEADLINES: list[tuple[str, str, str, tuple[str, str, str] | None]] = [
    # (label, metrics file, dotted key, (spread file, column, what one sample is) or None)
    ("tau (accepted tokens per verify step)", EVAL_METRICS, "tau", (PER_PROMPT, "tau", "prompt")),
    ("speedup (speculative vs target alone)", EVAL_METRICS, "speedup", (PER_PROMPT, "speedup", "prompt")),
    ("decode tokens/s with drafter", EVAL_METRICS, "decode_tokens_per_s.speculative", None),
    ("decode tokens/s without drafter", EVAL_METRICS, "decode_tokens_per_s.target", None),
    ("train tokens/s", TRAIN, "tokens_per_s", (TRAIN_TOKENS_PER_STEP, "tokens_per_s", "step")),
    ("train-step tokens/s (compiled step)", EVAL_METRICS, "train_step.tokens_per_s", None),
    ("final loss", TRAIN, "final_loss", None),
]
SLOT_ACCURACY = (TRAIN, "slot_accuracy")
"""Per-slot accuracy: one headline row per slot the train metrics carry."""


@dataclass
class Headline:
    label: str
    file: str
    key: str
    value: Any
    head: str
    spread: str


@dataclass
class Chart:
    title: str
    source: str
    svg: str
    """Inline SVG without a namespace attribute (HTML5 needs none); `standalone()` adds it for a file."""

    def standalone(self) -> str:
        return self.svg.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)


@dataclass
class RunReport:
    revision: str
    stages: list[tuple[str, str, str, str]]
    """(stage, verdict, why, its outputs in the workspace) in dvc.yaml order."""
    headlines: list[Headline]
    charts: list[Chart]
    images: list[tuple[str, bytes]]
    explain_md: str
    error: str = ""
    notes: list[str] = field(default_factory=list)


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
        explain_md=to_markdown(explained) if explained else f"explain HEAD vs workspace failed: {error}\n",
        error=error,
    )


def _revision(root: Path) -> str:
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else "no git revision (not a git repository, or no commit)"


def _stage_rows(root: Path, explained: Report | None, error: str) -> list[tuple[str, str, str, str]]:
    verdicts = {v.stage: v for v in explained.stages} if explained else {}
    specs = read_dvc_yaml(root).get("stages", {})
    rows = []
    for name in stage_names(root):
        v = verdicts.get(name)
        verdict, why = (v.verdict, _why(v)) if v else ("unknown", error or "explain gave no verdict")
        rows.append((name, verdict, why, _outputs(root, specs.get(name) or {})))
    return rows


def _outputs(root: Path, spec: dict[str, Any]) -> str:
    """Whether the stage's outs (not metrics/plots) exist in the workspace: a report after a fresh clone says so."""
    outs = [o if isinstance(o, str) else next(iter(o)) for o in spec.get("outs", []) or []]
    if not outs:
        return "none declared"
    missing = [o for o in outs if not (root / o).exists()]
    return f"missing: {', '.join(missing)}" if missing else "present"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _lookup(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _headlines(root: Path, explained: Report | None) -> list[Headline]:
    specs = list(HEADLINES)
    slots = _lookup(_read_json(root / SLOT_ACCURACY[0]), SLOT_ACCURACY[1])
    for slot in sorted(slots or {}, key=lambda s: (len(s), s)):
        specs.append((f"per-slot accuracy, slot {slot}", SLOT_ACCURACY[0], f"{SLOT_ACCURACY[1]}.{slot}", None))
    deltas = {(m.file, m.key): m for m in explained.metrics} if explained else {}
    out = []
    for label, file, key, spread in specs:
        data = _read_json(root / file)
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
    if isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _series(rows: list[dict[str, Any]], x: str | None, y: str) -> list[tuple[Any, float | None]]:
    return [(r.get(x, i) if x else i, _float(r.get(y))) for i, r in enumerate(rows)]


def _plot_specs(root: Path) -> list[tuple[str, dict[str, Any]]]:
    """(path, its dvc.yaml plot options) for every plot of every stage, in dvc.yaml order."""
    specs: list[tuple[str, dict[str, Any]]] = []
    for stage in read_dvc_yaml(root).get("stages", {}).values():
        for entry in (stage or {}).get("plots", []) or []:
            if isinstance(entry, str):
                specs.append((entry, {}))
            elif isinstance(entry, dict):
                specs.extend((path, opts or {}) for path, opts in entry.items())
    return specs


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
            svg = _bar_svg(series, y) if bar else _line_svg(series, x or "index", y)
            charts.append(Chart(f"{y} by {x or 'index'}", str(file.relative_to(root)), svg))
    return charts


# ---------------------------------------------------------------- drawing (dependency-free SVG)

W, H, LEFT, RIGHT, TOP, BOTTOM = 480, 200, 56, 12, 12, 28
TEXT = 'font-size="10" fill="#444" font-family="sans-serif"'
"""Text style as attributes, not CSS: the Markdown form's .svg files stand alone."""


def _line_svg(series: list[tuple[Any, float | None]], x: str, y: str) -> str:
    pts = [(_float(xv), yv) for xv, yv in series if yv is not None and _float(xv) is not None]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    xspan, yspan = (x1 - x0) or 1.0, (y1 - y0) or 1.0
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM

    def px(v: float) -> float:
        return LEFT + (v - x0) / xspan * pw

    def py(v: float) -> float:
        return TOP + ph - (v - y0) / yspan * ph

    points = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in pts)
    e = html.escape
    return (
        f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="{e(y)} by {e(x)}">'
        f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>'
        f'<polyline points="{points}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>'
        f'<text x="{LEFT - 4}" y="{TOP + 10}" text-anchor="end" {TEXT}>{_num(y1)}</text>'
        f'<text x="{LEFT - 4}" y="{TOP + ph}" text-anchor="end" {TEXT}>{_num(y0)}</text>'
        f'<text x="{LEFT}" y="{H - 12}" {TEXT}>{_num(x0)}</text>'
        f'<text x="{W - RIGHT}" y="{H - 12}" text-anchor="end" {TEXT}>{_num(x1)}</text>'
        f'<text x="{LEFT + pw / 2:.0f}" y="{H - 2}" text-anchor="middle" {TEXT}>{e(x)}</text>'
        "</svg>"
    )


def _bar_svg(series: list[tuple[Any, float | None]], y: str) -> str:
    bars = [(str(xv), yv if yv is not None else 0.0) for xv, yv in series]
    label_w, bar_h, gap, value_w = 130, 16, 4, 60
    height = TOP + len(bars) * (bar_h + gap) + 8
    top = max((abs(v) for _, v in bars), default=0.0) or 1.0
    span = W - label_w - value_w
    e = html.escape
    parts = [f'<svg viewBox="0 0 {W} {height}" width="{W}" height="{height}" role="img" aria-label="{e(y)}">']
    for i, (label, v) in enumerate(bars):
        yy = TOP + i * (bar_h + gap)
        short = label if len(label) <= 20 else label[:19] + "…"
        parts.append(
            f'<text x="{label_w - 6}" y="{yy + bar_h - 4}" text-anchor="end" {TEXT}>{e(short)}</text>'
            f'<rect x="{label_w}" y="{yy}" width="{abs(v) / top * span:.1f}" height="{bar_h}" fill="#1f77b4"/>'
            f'<text x="{label_w + abs(v) / top * span + 4:.1f}" y="{yy + bar_h - 4}" {TEXT}>{_num(v)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------- rendering

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:.9em}td,th{border:1px solid #ddd;padding:.3em .6em;text-align:left;
vertical-align:top}th{background:#f3f3f3}td.why{font-family:ui-monospace,monospace;font-size:.85em;max-width:620px;
word-break:break-all}.v{font-weight:600;white-space:nowrap}.unchanged{color:#1a7f37}.changed{color:#cf222e}
.invalidated{color:#9a6700}.outputs{color:#8250df}.other{color:#0969da}.meta{color:#666}
figure{display:inline-block;margin:.5em 1em .5em 0;vertical-align:top}figcaption{font-size:.85em;color:#444}
pre{background:#f6f8fa;padding:1em;overflow-x:auto;
font-size:.85em;white-space:pre-wrap}img{max-width:100%}
"""


def _verdict_class(verdict: str) -> str:
    for word in ("unchanged", "changed", "invalidated", "outputs"):
        if verdict.startswith(word):
            return word
    return "other"


def _value(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, str) else v


def to_html(r: RunReport) -> str:
    e = html.escape
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>dflashpipe run report</title>',
        f"<style>{CSS}</style></head><body>",
        "<h1>dflashpipe run report</h1>",
        f'<p class="meta">generated from git revision {e(r.revision)} (HEAD) and the workspace</p>',
    ]
    if r.error:
        out.append(f"<p><strong>explain HEAD vs workspace failed:</strong> {e(r.error)}</p>")
    out += ["<h2>Pipeline (dvc.yaml order): HEAD vs workspace</h2>", "<table><tr><th>stage</th><th>verdict</th>"]
    out.append("<th>why</th><th>outputs in the workspace</th></tr>")
    for name, verdict, why, outs in r.stages:
        cls = _verdict_class(verdict)
        out.append(
            f'<tr><td>{e(name)}</td><td class="v {cls}">{e(verdict)}</td><td class="why">{e(why)}</td>'
            f'<td class="{"outputs" if outs.startswith("missing") else ""}">{e(outs)}</td></tr>'
        )
    out += [
        "</table>",
        "<h2>Headline metrics</h2>",
        "<table><tr><th>metric</th><th>workspace</th><th>HEAD</th><th>spread</th><th>from</th></tr>",
    ]
    for h in r.headlines:
        out.append(
            f"<tr><td>{e(h.label)}</td><td><b>{e(_value(h.value))}</b></td><td>{e(h.head)}</td>"
            f"<td>{e(h.spread)}</td><td>{e(h.file)}: {e(h.key)}</td></tr>"
        )
    out += ["</table>", "<h2>Plots</h2>"]
    if not r.images and not r.charts:
        out.append("<p>no plots found under metrics/</p>")
    for name, data in r.images:
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        out.append(f'<figure><img src="{uri}" alt="{e(name)}"><figcaption>{e(name)}</figcaption></figure>')
    for c in r.charts:
        out.append(f"<figure>{c.svg}<figcaption>{e(c.title)} — {e(c.source)}</figcaption></figure>")
    out += [
        "<h2>explain: HEAD vs workspace</h2>",
        f"<pre>{e(r.explain_md)}</pre>",
        "</body></html>",
    ]
    return "\n".join(out) + "\n"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown_page(r: RunReport, images_dir: str) -> tuple[str, dict[str, bytes]]:
    """The page as Markdown and the files of its images folder (name -> bytes)."""
    files: dict[str, bytes] = {}
    lines = ["# dflashpipe run report", "", f"generated from git revision {r.revision} (HEAD) and the workspace", ""]
    if r.error:
        lines += [f"**explain HEAD vs workspace failed:** {r.error}", ""]
    lines += ["## Pipeline (dvc.yaml order): HEAD vs workspace", ""]
    lines += ["| stage | verdict | why | outputs in the workspace |", "|---|---|---|---|"]
    lines += [f"| {n} | {_cell(v)} | {_cell(why)} | {_cell(o)} |" for n, v, why, o in r.stages]
    lines += ["", "## Headline metrics", "", "| metric | workspace | HEAD | spread | from |", "|---|---|---|---|---|"]
    for h in r.headlines:
        lines.append(
            f"| {_cell(h.label)} | **{_cell(_value(h.value))}** | {_cell(h.head)} | {_cell(h.spread)} "
            f"| {h.file}: `{h.key}` |"
        )
    lines += ["", "## Plots", ""]
    if not r.images and not r.charts:
        lines.append("no plots found under metrics/")
    for name, data in r.images:
        fname = _slug(name)
        files[fname] = data
        lines += [f"![{name}]({images_dir}/{fname})", ""]
    for c in r.charts:
        fname = _slug(c.source) + "-" + _slug(c.title) + ".svg"
        files[fname] = c.standalone().encode()
        lines += [f"![{c.title} — {c.source}]({images_dir}/{fname})", ""]
    lines += ["## explain: HEAD vs workspace", "", r.explain_md]
    return "\n".join(lines).rstrip("\n") + "\n", files


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

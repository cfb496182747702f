"""`dflashpipe report`'s page from a `RunReport` (contents.py; build.py reads the state): HTML, one
self-contained file (inline CSS, PNG images as data: URIs, charts as inline SVG, no script, no network URL), or
Markdown with the files of an images folder beside it. Both forms lay out the same tables from the same cells
(`_tables`).
"""

from __future__ import annotations

import base64
import html
import json
import re
from typing import Any

from dflashpipe.commands.report.contents import RunReport

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


BENCHMARKS = "Acceptance per benchmark (the DFlash paper's table)"

Cell = tuple[str, str]
"""A table cell: its text and its HTML class ("b": the value itself, bold in HTML and in Markdown)."""


def _tables(r: RunReport) -> list[tuple[str, list[str], list[list[Cell]]]]:
    """(heading, column names, rows) of the page's two tables: the same cells for the HTML and the Markdown."""
    stages = [
        [(n, ""), (v, f"v {_verdict_class(v)}"), (why, "why"), (o, "outputs" if o.startswith("missing") else "")]
        for n, v, why, o in r.stages
    ]
    metrics = [
        [(h.label, ""), (_value(h.value), "b"), (h.head, ""), (h.spread, ""), (f"{h.file}: {h.key}", "")]
        for h in r.headlines
    ]
    return [
        (
            "Pipeline (dvc.yaml order): HEAD vs workspace",
            ["stage", "verdict", "why", "outputs in the workspace"],
            stages,
        ),
        ("Headline metrics", ["metric", "workspace", "HEAD", "spread", "from"], metrics),
    ]


def _td(text: str, cls: str) -> str:
    text = html.escape(text)
    return f"<td><b>{text}</b></td>" if cls == "b" else f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>"


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
    for heading, columns, rows in _tables(r):
        out += [f"<h2>{e(heading)}</h2>", "<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in columns) + "</tr>"]
        out += ["<tr>" + "".join(_td(text, cls) for text, cls in row) + "</tr>" for row in rows]
        out.append("</table>")
    if r.benchmarks is not None:
        b = r.benchmarks
        out += [f"<h2>{e(BENCHMARKS)}</h2>", "<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in b.columns) + "</tr>"]
        out += ["<tr>" + "".join(_td(text, "") for text in row) + "</tr>" for row in b.rows]
        out += ["</table>", *(f'<p class="meta">{e(note)}</p>' for note in b.notes)]
    out.append("<h2>Plots</h2>")
    if not r.images and not r.charts:
        out.append("<p>no plots found under metrics/</p>")
    for name, data in r.images:
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        out.append(f'<figure><img src="{uri}" alt="{e(name)}"><figcaption>{e(name)}</figcaption></figure>')
    for c in r.charts:
        out.append(f"<figure>{c.svg}<figcaption>{e(c.title)} — {e(c.source)}</figcaption></figure>")
    out += ["<h2>explain: HEAD vs workspace</h2>", f"<pre>{e(r.explain_md)}</pre>", "</body></html>"]
    return "\n".join(out) + "\n"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def _cell(text: str, cls: str = "") -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"**{text}**" if cls == "b" else text


def to_markdown_page(r: RunReport, images_dir: str) -> tuple[str, dict[str, bytes]]:
    """The page as Markdown and the files of its images folder (name -> bytes)."""
    files: dict[str, bytes] = {}
    lines = ["# dflashpipe run report", "", f"generated from git revision {r.revision} (HEAD) and the workspace", ""]
    if r.error:
        lines += [f"**explain HEAD vs workspace failed:** {r.error}", ""]
    for heading, columns, rows in _tables(r):
        lines += [f"## {heading}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(text, cls) for text, cls in row) + " |" for row in rows] + [""]
    if r.benchmarks is not None:
        b = r.benchmarks
        lines += [f"## {BENCHMARKS}", "", "| " + " | ".join(b.columns) + " |", "|" + "---|" * len(b.columns)]
        lines += ["| " + " | ".join(_cell(text) for text in row) + " |" for row in b.rows] + [""]
        lines += [f"- {note}" for note in b.notes] + [""]
    lines += ["## Plots", ""]
    if not r.images and not r.charts:
        lines.append("no plots found under metrics/")
    for name, data in r.images:
        fname = _slug(name)
        files[fname] = data
        lines += [f"![{name}]({images_dir}/{fname})", ""]
    for c in r.charts:
        fname = _slug(c.source) + "-" + _slug(c.title) + ".svg"
        files[fname] = c.svg.encode()
        lines += [f"![{c.title} — {c.source}]({images_dir}/{fname})", ""]
    lines += ["## explain: HEAD vs workspace", "", r.explain_md]
    return "\n".join(lines).rstrip("\n") + "\n", files

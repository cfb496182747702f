"""`dflashpipe report`: the drawing on hand-made tables (fast), then the page for the real tiny pipeline run
(the shared `pipeline_run`, copied): every stage's verdict, the headline metrics, plots, no network URL."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import yaml

from dflashpipe.commands.explain import StageVerdict
from dflashpipe.commands.report.build import _axes, _chart_spec, _spread
from dflashpipe.commands.report.contents import RunReport
from dflashpipe.core import plots
from tests.conftest import copy_project, run, set_params

NETWORK_ATTR = re.compile(r"""\b(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.IGNORECASE)


def stage_verdicts(page: str) -> dict[str, str]:
    rows = re.findall(r'<tr><td>([^<]+)</td><td class="v [a-z]+">([^<]+)</td>', page)
    return {html.unescape(s): html.unescape(v) for s, v in rows}


def test_svg_charts_are_vega_lines_and_bars_inline_and_offline():
    line_spec = _chart_spec([(0, 3.0), (1, 2.0), (2, None), (3, 1.5)], "step", "loss", False, "loss by step")
    line = plots.svg(line_spec)
    assert line.startswith("<svg ") and "mark-line" in line and not NETWORK_ATTR.search(line)
    assert line.count('aria-roledescription="point"') == 3  # the missing value is skipped
    assert all(f"loss: {v}" in line for v in ("3", "2", "1.5"))  # the data's values, as Vega labels them
    bar = plots.svg(_chart_spec([("a<b", 1.0), ("c", 0.5)], "source", "tau", True, "tau by source"))
    assert bar.count('aria-roledescription="bar"') == 2 and "a&lt;b" in bar and not NETWORK_ATTR.search(bar)
    assert plots.svg(line_spec) == line  # the same table gives the same bytes


def test_bar_axes_follow_dvc_bar_horizontal_and_categories():
    slots = [{"slot": 1, "acceptance": 0.5}, {"slot": 2, "acceptance": 0.25}]
    assert _axes(slots, {"x": "acceptance", "y": "slot", "template": "bar_horizontal"}) == ("slot", "acceptance", True)
    sources = [{"source": "a", "tau": 1.5}]
    assert _axes(sources, {"x": "source", "y": "tau", "template": "bar_horizontal"}) == ("source", "tau", True)
    assert _axes(sources, {"x": "tau", "y": "source"}) == ("source", "tau", True)
    assert _axes([{"step": "0", "loss": "2.5"}], {"x": "step"}) == ("step", "loss", False)


def test_spread_is_min_median_max_or_single(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps([{"speedup": v} for v in (0.5, 0.25, 1.0)]))
    assert _spread(tmp_path, ("p.json", "speedup", "prompt")).startswith("min 0.25 / median 0.5 / max 1 over 3 prompts")
    assert _spread(tmp_path, None) == "single measurement"
    assert _spread(tmp_path, ("absent.json", "speedup", "prompt")) == "single measurement"


def test_the_benchmark_table_is_the_papers_layout_with_the_served_tau_beside_ours(tmp_path):
    from dflashpipe.commands.report.build import benchmark_table
    from dflashpipe.commands.report.page import to_markdown_page
    from dflashpipe.evaluate.metrics import DEFINITIONS

    def row(tau: float, requests: int) -> dict:
        accepted = {"1": 0.25, "2": 0.125, "3": 0.0, "4": 0.0}
        common = {"max_new_tokens": 32, "thinking": "template default", "acceptance_per_position": accepted}
        return {"tau": tau, "tau_pooled": tau - 0.01, "speedup": 0.9, "requests": requests, **common}

    assert benchmark_table(tmp_path) is None  # evaluate has not run
    detail = {"definitions": DEFINITIONS, "benchmarks": {"held_out": row(1.1, 8), "mt_bench": row(1.2, 160)}}
    (tmp_path / "metrics" / "detail").mkdir(parents=True)
    (tmp_path / "metrics" / "detail" / "eval.json").write_text(json.dumps(detail))
    (tmp_path / "metrics" / "serve.json").write_text(json.dumps({"benchmarks": {"mt_bench": {"tau": 1.19}}}))
    table = benchmark_table(tmp_path)
    lines = table.lines()
    assert lines[0].split() == [
        "benchmark", "tau", "tau", "pooled", "speedup", "accept@1", "accept@2", "accept@3", "requests", "served", "tau"
    ]  # fmt: skip
    assert lines[1].split() == ["held_out", "1.100", "1.090", "0.900", "0.250", "0.125", "0.000", "8", "-"]
    assert lines[2].split() == ["mt_bench", "1.200", "1.190", "0.900", "0.250", "0.125", "0.000", "160", "1.190"]
    assert len({len(line) for line in lines[:3]}) == 1  # aligned columns
    notes = lines[3:]
    assert notes[0] == f"tau: {DEFINITIONS['tau']}" and any(n.startswith("tau_pooled: ") for n in notes)
    assert notes[-1] == "generation: at most 32 new tokens, template default"
    page = RunReport("rev", [], [], [], [], "", benchmarks=table)
    text, _ = to_markdown_page(page, "images")
    assert "| mt_bench | 1.200 | 1.190 | 0.900 | 0.250 | 0.125 | 0.000 | 160 | 1.190 |" in text
    assert f"- tau: {DEFINITIONS['tau']}" in text


@pytest.fixture
def project(pipeline_run, tmp_path):
    return copy_project(pipeline_run, tmp_path / "project")


def report_html(project: Path) -> str:
    proc = run(["dflashpipe", "report", "--out", "out/report.html"], project)
    assert proc.returncode == 0 and "wrote out/report.html" in proc.stdout
    return (project / "out" / "report.html").read_text(encoding="utf-8")


def test_report_of_a_run_has_dag_metrics_plots_and_no_network_url(project):
    page = report_html(project)
    stages = list(yaml.safe_load((project / "dvc.yaml").read_text())["stages"])
    verdicts = stage_verdicts(page)
    assert list(verdicts) == stages  # dvc.yaml order
    assert verdicts == {s: StageVerdict.ALWAYS if s == "fingerprint" else StageVerdict.UNCHANGED for s in stages}

    metrics = json.loads((project / "metrics" / "detail" / "eval.json").read_text())
    for value in (
        metrics["tau"],
        metrics["speedup"],
        metrics["decode_tokens_per_s"]["speculative"],
        metrics["decode_tokens_per_s"]["target"],
        json.loads((project / "metrics" / "bench.json").read_text())["tokens_per_s"],
    ):
        assert f"<b>{json.dumps(value)}</b>" in page
    assert "over " in page and " prompts (metrics/eval/speedup_per_prompt.json)" in page  # tau/speedup spread
    assert "single measurement" in page

    assert "<svg" in page or "data:image/png" in page
    assert "mark-line" in page  # train's per-step tables drawn as lines (Vega's line marks, inline SVG)
    assert not NETWORK_ATTR.search(page)
    assert "<script" not in page
    assert "<pre>## What changed: HEAD -&gt; workspace" in page

    head = run(["git", "rev-parse", "HEAD"], project).stdout.strip()
    assert f"generated from git revision {head}" in page
    assert report_html(project) == page  # the same state gives the same bytes


def test_report_after_a_param_edit_shows_train_changed_and_evaluate_invalidated(project):
    lr = yaml.safe_load((project / "params.yaml").read_text())["train"]["lr"]
    set_params(project, train__lr=lr * 2)
    verdicts = stage_verdicts(report_html(project))
    assert verdicts["train"] == StageVerdict.DIRECT and verdicts["evaluate"] == StageVerdict.DOWNSTREAM
    assert verdicts["manifest"] == StageVerdict.UNCHANGED
    assert f"param params.yaml:train.lr: {lr} -&gt; {lr * 2}" in report_html(project)

    run(["dflashpipe", "report", "--md", "--out", "out/report.md"], project)
    text = (project / "out" / "report.md").read_text()
    assert "| train | changed (direct) |" in text and "| evaluate | invalidated (downstream) |" in text
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert linked and all((project / "out" / rel).is_file() for rel in linked)
    assert all(rel.startswith("report_images/") for rel in linked)

"""Plots without a network: the offline `dvc plots show` template and the PNG images the stages write."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import vl_convert

from dflashpipe.core import plots
from dflashpipe.train.metrics import IMAGES, plot_images, write_plots
from dflashpipe.train.state import StepRecord

PNG_HEADER = b"\x89PNG\r\n\x1a\n"

# What would make a browser reach the network when it opens the page. The inlined Vega bundle does
# contain URLs, but only as inert strings: license headers in comments, SVG/XML namespace URIs
# ("http://www.w3.org/2000/svg"), Vega's $schema identifiers, and vega-embed's "Open in Vega Editor"
# link target, which is followed only if a user clicks it. What counts as a network dependency is an
# element or import that loads from a URL: <script src>, <link href>, any src=/href= attribute with a
# network URL, a module import from one, a fetch of one or a CSS @import of one.
NETWORK_REFERENCES = {
    "script src": re.compile(r"<script\b[^>]*\bsrc\s*=", re.IGNORECASE),
    "link href to the network": re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?\s*(?:https?:)?//", re.IGNORECASE),
    "src/href attribute to the network": re.compile(r"\b(?:src|href)\s*=\s*[\"']\s*(?:https?:)?//", re.IGNORECASE),
    "module import from the network": re.compile(r"\bimport\b[^;\n]{0,200}?[\"']\s*https?://", re.IGNORECASE),
    "fetch of a network URL": re.compile(r"\bfetch\s*\(\s*[\"'`]\s*https?://", re.IGNORECASE),
    "CSS import from the network": re.compile(r"@import\s+(?:url\()?[\"']?\s*https?://", re.IGNORECASE),
}
CDN_HOSTS = ("cdn.jsdelivr.net", "unpkg.com", "cdnjs.cloudflare.com", "cdn.plot.ly")


def network_references(html: str) -> dict[str, list[str]]:
    found = {name: pattern.findall(html) for name, pattern in NETWORK_REFERENCES.items()}
    found["CDN host"] = [host for host in CDN_HOSTS if host in html]
    return {name: hits for name, hits in found.items() if hits}


@pytest.fixture(scope="module")
def template() -> str:
    return plots.offline_template()


def test_the_checks_catch_dvcs_default_page():
    from dvc_render.vega import VegaRenderer

    assert set(network_references(VegaRenderer.SCRIPTS)) >= {"script src", "CDN host"}


def test_template_references_no_network_url(template):
    assert network_references(template) == {}
    assert "{plot_divs}" in template  # what DVC fills
    assert "{scripts}" not in template  # what DVC fills with its CDN <script src> tags


def test_template_inlines_vega_vega_lite_and_vega_embed(template):
    assert "window.vegaEmbed=" in template  # what DVC's divs call
    assert f'"{vl_convert.get_vega_version()}"' in template
    assert len(template) > 500_000
    script = template[template.index("<script") : template.index("</script>")]
    assert script.count("<script") == 1  # nothing inside the bundle closes or reopens the element


def test_template_is_written_atomically_and_the_same_every_time(tmp_path, template):
    path = plots.write_template(tmp_path / ".dvc" / "plots" / "offline.html")
    assert path.read_text(encoding="utf-8") == template
    assert [p.name for p in path.parent.iterdir()] == ["offline.html"]  # no partial left beside it


def run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{cmd}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def dvc_project(tmp_path_factory, template) -> Path:
    """A real DVC project (in a git repository) with a line plot, a bar plot and an image plot, configured
    like this one: plots.html_template = plots/offline.html (relative to .dvc/)."""
    root = tmp_path_factory.mktemp("project")
    dvc = [sys.executable, "-m", "dvc"]
    run(["git", "init", "-q"], root)
    run([*dvc, "init", "-q"], root)
    run([*dvc, "config", "core.analytics", "false"], root)
    run([*dvc, "config", "plots.html_template", "plots/offline.html"], root)
    plots.write_template(root / ".dvc" / "plots" / "offline.html")
    (root / "loss.tsv").write_text("step\tloss\n" + "".join(f"{i}\t{4 / (i + 1):.4f}\n" for i in range(20)))
    tau = [{"source": "chat", "tau": 2.5}, {"source": "code", "tau": 3.25}]
    (root / "tau.json").write_text(json.dumps(tau))
    (root / "tau.png").write_bytes(plots.png(plots.bar_spec(tau, "source", "tau", "tau", horizontal=True)))
    (root / "dvc.yaml").write_text(
        "plots:\n"
        "  - loss.tsv:\n      x: step\n      y: loss\n"
        "  - tau.json:\n      x: source\n      y: tau\n      template: bar_horizontal\n"
        "  - tau.png\n"
    )
    return root


@pytest.mark.parametrize("command", [["show"], ["diff", "HEAD"]])
def test_dvc_plots_page_inlines_vega_and_reaches_no_network(dvc_project, command, tmp_path):
    if command[0] == "diff":
        run(["git", "add", "-A"], dvc_project)
        run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "plots"], dvc_project)
    out = tmp_path / "dvc_plots"
    run([sys.executable, "-m", "dvc", "plots", *command, "-o", str(out)], dvc_project)
    page = (out / "index.html").read_text(encoding="utf-8")
    assert network_references(page) == {}
    assert f'"{vl_convert.get_vega_version()}"' in page and "window.vegaEmbed=" in page
    assert page.count("vegaEmbed('#") == 2  # the line and the bar plot
    body = page[page.index("</script>") :]  # after the bundle (which builds <img> tags of its own)
    images = re.findall(r'<img src="([^"]+)"', body)
    assert images and all((out / src).read_bytes().startswith(PNG_HEADER) for src in images)


def history(steps: int = 12, slots: int = 3) -> list[StepRecord]:
    return [
        StepRecord(
            step=s,
            loss=5.0 / (s + 1),
            lr=1e-3,
            tokens=64,
            seconds=0.1 + 0.01 * (s % 3),
            slot_correct=[float(s + k) for k in range(slots)],
            slot_count=[64.0] * slots,
            target_busy_s=0.05 * s,
            drafter_busy_s=0.04 * s,
        )
        for s in range(1, steps + 1)
    ]


def test_train_images_are_valid_pngs_and_the_same_bytes_for_the_same_history():
    first, second = plot_images(history()), plot_images(history())
    assert list(first) == list(IMAGES)
    assert first == second
    assert all(data.startswith(PNG_HEADER) for data in first.values())
    assert plot_images(history(steps=13))["loss"] != first["loss"]


def test_write_plots_writes_curves_and_images(tmp_path):
    write_plots(history(), tmp_path)
    images = tmp_path / "plots" / "images"
    assert sorted(p.name for p in images.iterdir()) == sorted(f"{name}.png" for name in IMAGES)
    assert (images / "loss.png").read_bytes() == plot_images(history())["loss"]
    assert (tmp_path / "plots" / "metrics" / "loss.tsv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"]  # no scratch or partial left


def test_eval_images_are_valid_pngs_and_the_same_bytes_for_the_same_tables(tmp_path):
    from dflashpipe.evaluate.metrics import PLOT_IMAGES, PLOT_TABLES, PLOTS_DIR, write_plot_tables

    tables = {
        "tau_per_source": [{"source": "chat", "tau": 2.75}, {"source": "code", "tau": 3.5}],
        "tau_per_benchmark": [{"benchmark": "held_out", "tau": 3.1}, {"benchmark": "mt_bench", "tau": 2.6}],
        "slot_acceptance": [{"slot": k, "acceptance": round(1 / (k + 1), 4)} for k in range(1, 8)],
        "speedup_per_prompt": [{"prompt": 0, "id": "a", "source": "chat", "speedup": 1.5}],
    }
    for attempt in ("a", "b"):
        write_plot_tables(tables, tmp_path / attempt)
    written = {a: sorted(p.name for p in (tmp_path / a / PLOTS_DIR).iterdir()) for a in ("a", "b")}
    assert written["a"] == sorted([f"{n}.json" for n in PLOT_TABLES] + [f"{n}.png" for n in PLOT_IMAGES])
    for name in PLOT_IMAGES:
        a, b = ((tmp_path / x / PLOTS_DIR / f"{name}.png").read_bytes() for x in ("a", "b"))
        assert a == b and a.startswith(PNG_HEADER)


def test_cli_writes_the_template(tmp_path, template):
    from typer.testing import CliRunner

    from dflashpipe.cli import app

    path = tmp_path / "plots" / "offline.html"
    result = CliRunner().invoke(app, ["plots-template", str(path)])
    assert result.exit_code == 0, result.output
    assert path.read_text(encoding="utf-8") == template


def test_this_project_points_dvc_at_the_offline_template():
    root = Path(__file__).resolve().parents[1]
    config = (root / ".dvc" / "config").read_text()
    assert re.search(r"^\s*html_template\s*=\s*plots/offline\.html\s*$", config, re.MULTILINE)
    ignored = subprocess.run(["git", "check-ignore", "-q", ".dvc/plots/offline.html"], cwd=root)
    assert ignored.returncode == 0  # generated by bin/setup, not committed

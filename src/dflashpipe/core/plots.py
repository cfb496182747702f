"""Plots that need no network: DVC's HTML page with Vega inlined, and static PNG images of the key curves.

`dvc plots show` fills an HTML template; DVC's default one loads vega, vega-lite and vega-embed from a
public CDN, so on a machine without internet the page is blank. `offline_template()` is a template with
the three libraries inlined from vl-convert-python's bundle (`vl_convert.javascript_bundle()`: Vega
Embed, Vega-Lite, Vega and their dependencies, assigned to `window.vegaEmbed`, `window.vegaLite` and
`window.vega`). DVC's generated divs call `vegaEmbed('#id', spec)` from inline scripts as the page is
parsed, so the bundle sits in a classic `<script>` in `<head>`. The template has no `{scripts}`
placeholder, so DVC's CDN `<script src=...>` tags (what it substitutes there) are dropped.

bin/setup writes the template (`dflashpipe plots-template .dvc/plots/offline.html`), and .dvc/config
points `plots.html_template` at it (`plots/offline.html`: DVC resolves a relative path against .dvc/).

`png()` and `svg()` render a Vega-Lite spec with vl-convert (no browser, no network): the same spec gives
the same bytes, so the images the stages write (and the charts `dflashpipe report` inlines) are stable.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dflashpipe.core.artifacts import write_bytes_atomic

PLOT_DIVS = "{plot_divs}"
"""What DVC replaces with the plots' divs (dvc_render.html.HTML.PLOTS_PLACEHOLDER)."""
REFRESH_TAG = "{refresh_tag}"
"""What DVC replaces with a `<meta http-equiv="refresh">` tag when it serves live plots."""
DVC_PLACEHOLDERS = ("{scripts}", PLOT_DIVS, REFRESH_TAG)

WIDTH, HEIGHT = 480, 240
"""Size of a PNG plot's data rectangle, in pixels at scale 1."""

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>DVC Plot (offline)</title>
    <!-- vega {vega}, vega-lite {vega_lite}, vega-embed {vega_embed}: inlined from vl-convert-python {vl_convert} -->
    <script type="text/javascript">
{bundle}
    </script>
    <style>
        body {{ font-family: sans-serif; }}
        table {{ border-spacing: 15px; }}
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def _safe_in_script(js: str) -> str:
    """`js` as the content of an HTML `<script>` element: no `</script` or `<!--` ends or confuses it.

    Inside JavaScript strings, template literals and regular expressions `<\\/` means `</` and `<\\!`
    means `<!`, so the escaped bundle runs the same."""
    js = re.sub(r"</(script)", r"<\\/\1", js, flags=re.IGNORECASE)
    return js.replace("<!--", "<\\!--")


def offline_template() -> str:
    """The HTML template for `plots.html_template`: DVC's page with Vega, Vega-Lite and Vega Embed inlined."""
    import vl_convert

    bundle = vl_convert.javascript_bundle()
    if "window.vegaEmbed" not in bundle:
        raise RuntimeError("vl_convert.javascript_bundle() no longer defines window.vegaEmbed, which DVC's divs call")
    clashes = [p for p in DVC_PLACEHOLDERS if p in bundle]
    if clashes:
        raise RuntimeError(f"the Vega bundle contains DVC's placeholders {clashes}: DVC would substitute inside it")
    # Its own scope: the bundle's top-level const/let/class names stay out of the page's global scope
    # (DVC's divs declare `var spec`); it publishes its libraries on `window` itself.
    bundle = "(function () {\n" + _safe_in_script(bundle) + "\n}).call(window);"
    page = PAGE.format(
        refresh_tag=REFRESH_TAG,
        plot_divs=PLOT_DIVS,
        vega=vl_convert.get_vega_version(),
        vega_lite=vl_convert.get_vegalite_versions()[-1],
        vega_embed=vl_convert.get_vega_embed_version(),
        vl_convert=_vl_convert_version(),
        bundle="{bundle}",
    )
    return page.replace("{bundle}", bundle)  # not through format(): the bundle is full of braces


def _vl_convert_version() -> str:
    from importlib.metadata import version

    return version("vl-convert-python")


def write_template(path: Path | str) -> Path:
    """Write `offline_template()` to `path` (atomically) and return the path."""
    path = Path(path)
    write_bytes_atomic(path, offline_template().encode("utf-8"))
    return path


def _finite(value: float | int | None) -> float | int | None:
    """A value Vega-Lite's JSON can carry: NaN and infinities become null (a gap in the line)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _chart(title: str, rows: list[dict], **body) -> dict:
    """The frame every chart shares (title, size, white background, the data), around `body`."""
    data = [{k: _finite(v) for k, v in row.items()} for row in rows]
    return {"title": title, "width": WIDTH, "height": HEIGHT, "background": "white", "data": {"values": data}, **body}


def line_spec(rows: list[dict], x: str, y: str, title: str, x_title: str | None = None, y_title: str | None = None):
    """A Vega-Lite line chart of `rows` (one dict per point)."""
    return _chart(
        title,
        rows,
        mark={"type": "line", "point": len(rows) <= 50},
        encoding={
            "x": {"field": x, "type": "quantitative", "title": x_title or x},
            "y": {"field": y, "type": "quantitative", "title": y_title or y, "scale": {"zero": False}},
        },
    )


def bar_spec(
    rows: list[dict],
    category: str,
    value: str,
    title: str,
    horizontal: bool = False,
    category_title: str | None = None,
    value_title: str | None = None,
):
    """A Vega-Lite bar chart of `rows`: one bar per `category`, labelled with its `value`."""
    cat = {"field": category, "type": "ordinal", "title": category_title or category, "sort": None}
    val = {"field": value, "type": "quantitative", "title": value_title or value}
    label = {"field": value, "type": "quantitative", "format": ".3~f"}
    if horizontal:
        bars = {"y": cat, "x": val}
        text = {"mark": {"type": "text", "align": "left", "dx": 3}, "encoding": {"y": cat, "x": val, "text": label}}
    else:
        bars = {"x": {**cat, "axis": {"labelAngle": 0}}, "y": val}
        text = {
            "mark": {"type": "text", "baseline": "bottom", "dy": -2},
            "encoding": {"x": cat, "y": val, "text": label},
        }
    return _chart(title, rows, layer=[{"mark": "bar", "encoding": bars}, text])


def png(spec: dict) -> bytes:
    """`spec` rendered to PNG: the same spec gives the same bytes. Loads no external data."""
    import vl_convert

    return vl_convert.vegalite_to_png(spec, scale=1, allowed_base_urls=[])


def svg(spec: dict) -> str:
    """`spec` rendered to an SVG document: the same spec gives the same text. Loads no external data."""
    import vl_convert

    return vl_convert.vegalite_to_svg(spec, allowed_base_urls=[])

"""The docs hold together: every relative link resolves, the prose stays small, reference docs carry no dated
figures (those live in docs/measurements.md), and a few facts are said in one place only.

Reads files only; no models, no DVC."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ROOT / "docs" / "measurements.md"
MAX_PROSE_CHARS = 100_000
"""README.md, CONTRIBUTING.md and docs/**/*.md together: a reader needs the why and the how, not the lab notebook."""

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
DATE_STAMP = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def reference_docs() -> list[Path]:
    return [doc for doc in docs() if doc != MEASUREMENTS]


def prose(text: str) -> str:
    """The text a reader follows links in: fenced blocks and inline code left out."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens, a
    repeated slug numbered."""
    seen: dict[str, int] = {}
    for title in HEADING.findall(FENCE.sub("", doc.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            slug = f"{slug}-{count}"
        seen.setdefault(slug, 1)
    return set(seen)


def broken_links(doc: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of `doc` whose file, or heading anchor in a Markdown file, does not exist."""
    broken = []
    for target in LINK.findall(prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{doc.relative_to(root)}: {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{doc.relative_to(root)}: {target}: no heading with that anchor in {file.name}")
    return broken


def test_every_relative_link_resolves():
    broken = [line for doc in docs() for line in broken_links(doc)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_sees_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("# A heading\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md) [ok](there.md#a-heading) [gone](missing.md) [no anchor](there.md#nowhere)\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    found = [line.split(": ", 1)[1] for line in broken_links(doc, tmp_path)]
    assert found == [
        "missing.md: no such file",
        "there.md#nowhere: no heading with that anchor in there.md",
    ]


def test_prose_stays_under_its_budget():
    sizes = {doc.relative_to(ROOT).as_posix(): len(doc.read_bytes()) for doc in docs()}
    total = sum(sizes.values())
    largest = ", ".join(f"{name} {size}" for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
    assert total <= MAX_PROSE_CHARS, f"docs are {total} characters, over {MAX_PROSE_CHARS} (largest: {largest})"


def test_no_reference_doc_carries_a_date_stamp():
    dated = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
        for doc in reference_docs()
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if DATE_STAMP.search(line)
    ]
    assert not dated, "dated figures belong in docs/measurements.md:\n" + "\n".join(dated)


def test_the_regenerate_default_is_said_once_and_as_params_yaml_sets_it():
    stated = re.compile(r"regenerate\.enabled`?\s*[:=]\s*`?(true|false)|^\s*enabled\s*:\s*(true|false)", re.M)
    where = {doc.relative_to(ROOT).as_posix(): stated.findall(doc.read_text()) for doc in docs()}
    where = {name: found for name, found in where.items() if found}
    assert list(where) == ["docs/regenerate.md"], f"the regenerate default is stated in {sorted(where)}"
    enabled = yaml.safe_load((ROOT / "params.yaml").read_text())["regenerate"]["enabled"]
    assert {a or b for a, b in where["docs/regenerate.md"]} == {str(enabled).lower()}


def test_one_stage_table():
    header = re.compile(r"^\|\s*stage\s*\|", re.M)
    tables = [doc.relative_to(ROOT).as_posix() for doc in docs() if header.search(doc.read_text())]
    assert tables == ["docs/pipeline.md"], f"a table of the stages in {tables}: cross-link docs/pipeline.md instead"


@pytest.mark.parametrize(
    ("metrics", "key"), [("metrics/eval.json", "tau"), ("metrics/eval.json", "speedup"), ("metrics/serve.json", "tau")]
)
def test_recorded_figures_are_named_by_key_not_copied(metrics, key):
    value = json.loads((ROOT / metrics).read_text())[key]
    figure = f"{value}"
    if len(figure.partition(".")[2]) < 3:
        pytest.skip(f"{metrics}:{key} = {figure} is too short to tell a copy from a coincidence")
    copies = [doc.relative_to(ROOT).as_posix() for doc in docs() if figure in doc.read_text()]
    assert not copies, f"{metrics}:{key} = {figure} copied into {copies}: name it by its `dvc metrics show` key"

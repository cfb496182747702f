"""The library code each stage runs, and dvc.yaml's `src/` deps written from it.

DVC reruns a stage when a file under one of its deps changed, so a module that a stage runs but
dvc.yaml does not list is code whose edits DVC never sees, and a listed module it does not run
reruns it for nothing. The list is therefore computed from the code, never kept by hand:
`bin/deps --write` writes it into dvc.yaml, `bin/deps` and tests/test_pipeline.py say where they differ.

The rule, exact: an edit to a file reruns the stages that run it, and no other.
1. A stage runs its script's imports, transitively through src/ (imports inside functions too, not those
   under `if TYPE_CHECKING:`), with the packages that hold them (importing a.b.c runs a/__init__.py and
   a/b/__init__.py), and a script beside a module that it starts in another interpreter
   (`Path(__file__).with_name("x.py")`).
2. Left out: INFRASTRUCTURE, which every stage imports and which is checked on its own, and inert files
   (a docstring and nothing else: editing one cannot change an output).
3. A directory is one dep when the stage runs every file DVC hashes under it (the highest such
   directory); every other file it runs is a dep by itself. So tokenize lists `src/dflashpipe/tokens`,
   while `tokens/shards.py`, which features, train and evaluate read, is a dep of exactly those.

In dvc.yaml a stage's deps are its script, then these, then its inputs; only the `src/` lines are written.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import re
import sys
from pathlib import Path

from dflashpipe.core.pipeline import DVC_FILE, Pipeline, PipelineError, dvcignore

PACKAGE = "dflashpipe"
INFRASTRUCTURE = {f"{PACKAGE}.core.{m}" for m in ("params", "errors", "stage", "artifacts", "pipeline")} | {
    f"{PACKAGE}.cli"
}
"""Imported by every stage and validated on their own (tests/test_params.py, the stage runner): no stage lists
them, and an edit to them is not meant to rerun the pipeline."""
WRITE = "bin/deps --write"
SCRIPT = re.compile(r"stages/\w+\.py")


def stage_script(cmd: str | None) -> str | None:
    """The stages/ script a stage's cmd runs (None: it runs none, and gets no code deps)."""
    found = SCRIPT.findall(cmd or "")
    return found[0] if len(found) == 1 else None


def _imported(tree: ast.Module, package: str) -> set[str]:
    """Every module an import statement anywhere in `tree` may load, but not those only under
    `if TYPE_CHECKING:`; `from pkg import name` yields pkg and pkg.name (a module or not: a miss is skipped)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Name | ast.Attribute)
        and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def _started(tree: ast.Module, file: Path) -> set[Path]:
    """Scripts beside `file` that it runs in another interpreter, named as `Path(__file__).with_name("x.py")`:
    no import shows them (serve's vllm_run.py, run by the serving environment's python)."""
    return {
        file.with_name(node.args[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "with_name"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and node.args[0].value.endswith(".py")
        and file.with_name(node.args[0].value).is_file()
    }


def inert(tree: ast.Module) -> bool:
    """Nothing but a docstring (a package's __init__.py, often): editing it cannot change an output,
    and once it holds code it is no longer inert and is listed."""
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in tree.body)


def _module_file(src: Path, module: str) -> Path | None:
    """The source file of a module under `src` (a package's __init__.py), or None if there is none."""
    base = src.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def runs(script: Path, root: Path | str = ".") -> dict[str, bool]:
    """The files under src/ that `script` runs (rule 1, infrastructure left out), each with whether it is inert,
    as paths relative to `root`."""
    root = Path(root)
    src = root / "src"
    found: dict[str, bool] = {}
    todo, seen = [script], set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
        if file != script:
            found[file.relative_to(root).as_posix()] = inert(tree)
        package = file.parent.relative_to(src).as_posix().replace("/", ".") if file.is_relative_to(src) else ""
        for module in _imported(tree, package):
            parts = module.split(".")
            if parts[0] != PACKAGE or any(".".join(parts[:i]) in INFRASTRUCTURE for i in range(2, len(parts) + 1)):
                continue
            for i in range(2, len(parts) + 1):  # the enclosing packages, then the module itself
                module_file = _module_file(src, ".".join(parts[:i]))
                if module_file is not None:
                    todo.append(module_file)
        todo += _started(tree, file)
    return found


def code_deps(script: Path, root: Path | str = ".") -> list[str]:
    """The `src/` deps of the stage that runs `script`, by the rule above, sorted."""
    root = Path(root)
    ran = runs(script, root)
    ignore = dvcignore(root)

    @functools.cache
    def whole(directory: str) -> bool:
        files = [p.relative_to(root).as_posix() for p in (root / directory).rglob("*") if p.is_file()]
        hashed = [f for f in files if not (ignore and ignore.match_file(f))]
        return bool(hashed) and all(f in ran for f in hashed)

    deps = set()
    for file, is_inert in ran.items():
        parts = file.split("/")
        # from src/<package> down: the first directory the stage runs whole covers the file
        covering = next((d for d in ("/".join(parts[:i]) for i in range(2, len(parts))) if whole(d)), None)
        if covering is not None:
            deps.add(covering)
        elif not is_inert:
            deps.add(file)
    return sorted(deps)


def pipeline_code_deps(root: Path | str = ".") -> dict[str, list[str]]:
    """For every stage of dvc.yaml that runs a stages/ script, its `src/` deps."""
    root = Path(root)
    return {
        name: code_deps(root / script, root)
        for name, spec in Pipeline.read(root).specs.items()
        if (script := stage_script(spec.cmd)) is not None
    }


def declared_code_deps(root: Path | str = ".") -> dict[str, list[str]]:
    """The `src/` deps dvc.yaml lists now, per stage that runs a stages/ script."""
    return {
        name: [d for d in spec.deps if d.startswith("src/")]
        for name, spec in Pipeline.read(root).specs.items()
        if stage_script(spec.cmd) is not None
    }


STAGE_LINE = re.compile(r"^  (?P<name>[\w-]+):\s*(#.*)?$")
DEPS_LINE = re.compile(r"^    deps:\s*(#.*)?$")
ITEM_LINE = re.compile(r"^      - (?P<path>[^\s#]+)")


def with_code_deps(text: str, deps: dict[str, list[str]], where: str = DVC_FILE) -> str:
    """dvc.yaml's text with each stage's `src/` deps replaced by `deps[stage]`, placed right after the stage's
    script; every other line as it was. A textual edit of the deps blocks (dvc.yaml as this project writes it:
    two-space indents, block lists), so that anchors, comments and the order of everything else stay."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    in_stages, stage, in_deps, placed = False, None, False, set()
    for number, line in enumerate(lines, 1):
        bare = line.rstrip("\n")
        indent = len(bare) - len(bare.lstrip())
        if in_deps and bare.strip() and not bare.lstrip().startswith("#") and indent <= 4:
            in_deps = False
        if bare.strip() and indent == 0 and not bare.startswith("#"):
            in_stages, stage = bare.startswith("stages:"), None
        elif in_stages and (match := STAGE_LINE.match(bare)):
            stage = match["name"]
        elif bare.startswith("    deps:") and stage in deps:
            if not DEPS_LINE.match(bare):
                raise PipelineError(f"{where}:{number}: stage {stage!r}: write its deps as a block list, one per line")
            in_deps = True
        elif in_deps and (item := ITEM_LINE.match(bare)):
            if item["path"].startswith("src/"):
                continue
            if SCRIPT.fullmatch(item["path"]) and stage not in placed:
                out.append(line)
                out += [f"      - {dep}\n" for dep in deps[stage]]
                placed.add(stage)
                continue
        out.append(line)
    unplaced = sorted(set(deps) - placed)
    if unplaced:
        raise PipelineError(
            f"{where}: stages {unplaced} do not list their script under deps: add `- stages/<script>.py` first"
        )
    return "".join(out)


def drift(root: Path | str = ".") -> list[str]:
    """Where dvc.yaml's `src/` deps differ from the rule's: one line per stage, each naming the fix."""
    root = Path(root)
    wanted, declared = pipeline_code_deps(root), declared_code_deps(root)
    lines = []
    for name, deps in wanted.items():
        missing = [d for d in deps if d not in declared[name]]
        extra = [d for d in declared[name] if d not in deps]
        said = [f"missing {', '.join(missing)}"] * bool(missing) + [f"extra {', '.join(extra)}"] * bool(extra)
        if said:
            lines.append(f"{DVC_FILE} stage {name}: {'; '.join(said)} (run {WRITE})")
    text = (root / DVC_FILE).read_text(encoding="utf-8")
    if not lines and with_code_deps(text, wanted) != text:
        lines.append(f"{DVC_FILE}: the src/ deps are not in the order or place {WRITE} puts them (run {WRITE})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bin/deps", description="dvc.yaml's src/ deps, from each stage script's imports (exit 1: they differ)."
    )
    parser.add_argument("--write", action="store_true", help="rewrite them in dvc.yaml")
    args = parser.parse_args(argv)
    path = Path(DVC_FILE)
    try:
        text = path.read_text(encoding="utf-8")
        new = with_code_deps(text, pipeline_code_deps())
    except (PipelineError, FileNotFoundError) as exc:
        print(f"bin/deps: error: {exc}", file=sys.stderr)
        return 2
    if args.write:
        if new != text:
            path.write_text(new, encoding="utf-8")
        return 0
    if new == text:
        return 0
    sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True), DVC_FILE, DVC_FILE))
    sys.stdout.flush()
    print("\n".join(drift()), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""`dflashpipe explain`: what changed between two states of the pipeline, what it
invalidated, what it did not, and what it cost — every statement with its evidence.

A state is a git revision, a DVC experiment name, or the workspace. A revision's
state is what its dvc.yaml and dvc.lock recorded; the workspace's is what DVC
computes from the files on disk now (DVC's own hashing, through its Python API).
Stages come from dvc.yaml, so a new stage needs no change here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflashpipe.errors import DflashpipeError
from dflashpipe.evaluate.regression import resolve_revision

WORKSPACE = "workspace"
PARAMS_FILE = "params.yaml"

UNCHANGED = "unchanged"
DIRECT = "changed (direct)"
DOWNSTREAM = "invalidated (downstream)"
OUTPUTS = "outputs missing/modified"
FROZEN = "frozen"
ALWAYS = "always-changed"
UNKNOWN = "unknown"
RESTORABLE = "restorable: `dvc checkout` brings the recorded bytes back from the cache"


@dataclass
class StageState:
    """What one state says about one stage: its definition and the hashes/values it ran with."""

    name: str
    cmd: str | None = None
    deps: dict[str, str | None] = field(default_factory=dict)
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    outs: dict[str, str | None] = field(default_factory=dict)
    metrics: list[str] = field(default_factory=list)
    frozen: bool = False
    always_changed: bool = False
    locked: bool = True
    """False when the state has no dvc.lock entry for the stage: its hashes are unknowable."""
    where: dict[str, str] = field(default_factory=dict)
    """Evidence: for each dep/param/out key, the lock entry (or computation) it came from."""


@dataclass
class Cause:
    kind: str  # "param", "dep", "cmd", "out"
    what: str  # the key or path
    old: Any
    new: Any
    evidence: str
    stages: list[str] = field(default_factory=list)


@dataclass
class Verdict:
    stage: str
    verdict: str
    causes: list[Cause] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    note: str = ""


@dataclass
class MetricDelta:
    file: str
    key: str
    old: Any
    new: Any
    change: float | None
    stage: str
    causes: list[str]


@dataclass
class Report:
    a: str
    b: str
    root_causes: list[Cause]
    stages: list[Verdict]
    metrics: list[MetricDelta]


# --- reading a state ---------------------------------------------------------------


class State:
    """Files of one state: a git revision (read through git, the workspace untouched) or the workspace."""

    def __init__(self, repo, name: str) -> None:
        self.repo, self.name = repo, name
        if name == WORKSPACE:
            self.rev, self.fs = None, None
        else:
            self.rev = resolve_revision(repo, name)
            self.fs = repo.scm.get_fs(self.rev)

    @property
    def label(self) -> str:
        return WORKSPACE if self.rev is None else self.name

    def read_text(self, path: str) -> str | None:
        try:
            if self.fs is None:
                return (Path(self.repo.root_dir) / path).read_text(encoding="utf-8")
            with self.fs.open(path, mode="r", encoding="utf-8") as fh:
                return fh.read()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def read_yaml(self, path: str) -> Any:
        text = self.read_text(path)
        return None if text is None else yaml.safe_load(text)


def _dvc_yaml_stages(state: State) -> dict[str, dict]:
    doc = state.read_yaml("dvc.yaml")
    if doc is None:
        raise DflashpipeError(f"no dvc.yaml at {state.label}")
    return doc.get("stages", {}) or {}


def _entry_path(entry: Any) -> str:
    return next(iter(entry)) if isinstance(entry, dict) else entry


def _declared(stage: dict) -> tuple[list[str], dict[str, list[str]], list[str], list[str]]:
    """deps, params by file, outs (all kinds), metrics of one dvc.yaml stage."""
    params: dict[str, list[str]] = {}
    for entry in stage.get("params", []) or []:
        if isinstance(entry, str):
            params.setdefault(PARAMS_FILE, []).append(entry)
        else:
            for file, keys in entry.items():
                params.setdefault(file, []).extend(keys or [])
    outs = [_entry_path(o) for kind in ("outs", "metrics", "plots") for o in stage.get(kind, []) or []]
    metrics = [_entry_path(o) for o in stage.get("metrics", []) or []]
    return [_entry_path(d) for d in stage.get("deps", []) or []], params, outs, metrics


def _lock_hash(entry: dict) -> str | None:
    return entry.get("md5")


def read_revision_state(state: State) -> dict[str, StageState]:
    stages = _dvc_yaml_stages(state)
    lock = (state.read_yaml("dvc.lock") or {}).get("stages", {})
    result = {}
    for name, definition in stages.items():
        deps, params, outs, metrics = _declared(definition)
        entry = lock.get(name)
        st = StageState(
            name,
            cmd=definition.get("cmd"),
            metrics=metrics,
            frozen=bool(definition.get("frozen")),
            always_changed=bool(definition.get("always_changed")),
            locked=entry is not None,
        )
        where = f"dvc.lock@{state.label}"
        if entry is not None:
            st.cmd = entry.get("cmd", st.cmd)
            for i, dep in enumerate(entry.get("deps", []) or []):
                st.deps[dep["path"]] = _lock_hash(dep)
                st.where[f"dep:{dep['path']}"] = f"{where} stages.{name}.deps[{i}].md5"
            for file, values in (entry.get("params", {}) or {}).items():
                st.params[file] = dict(values)
                for key in values:
                    st.where[f"param:{file}:{key}"] = f"{where} stages.{name}.params['{file}']['{key}']"
            for i, out in enumerate(entry.get("outs", []) or []):
                st.outs[out["path"]] = _lock_hash(out)
                st.where[f"out:{out['path']}"] = f"{where} stages.{name}.outs[{i}].md5"
        else:
            st.deps = {d: None for d in deps}
            st.params = {f: {k: None for k in keys} for f, keys in params.items()}
            st.outs = {o: None for o in outs}
        result[name] = st
    return result


def read_workspace_state(repo) -> tuple[dict[str, StageState], dict[str, dict[str, str | None]]]:
    """The workspace as DVC computes it now, and what the workspace's dvc.lock recorded for outs."""
    from dvc.dependency.param import ParamsDependency

    result, recorded_outs = {}, {}
    for stage in repo.index.stages:
        name = stage.name
        st = StageState(
            name,
            cmd=stage.cmd,
            frozen=stage.frozen,
            always_changed=stage.always_changed,
            metrics=[o.def_path for o in stage.outs if o.metric],
        )
        for dep in stage.deps:
            if isinstance(dep, ParamsDependency):
                values = dep.read_params()
                st.params[dep.def_path] = dict(values)
                for key in values:
                    st.where[f"param:{dep.def_path}:{key}"] = f"{dep.def_path} (workspace) {key}"
            else:
                st.deps[dep.def_path] = _hash_now(dep)
                st.where[f"dep:{dep.def_path}"] = f"md5 of {dep.def_path} in the workspace (computed by DVC)"
        recorded_outs[name] = {}
        for out in stage.outs:
            st.outs[out.def_path] = _hash_now(out)
            recorded_outs[name][out.def_path] = out.hash_info.value if out.hash_info else None
            st.where[f"out:{out.def_path}"] = f"md5 of {out.def_path} in the workspace (computed by DVC)"
        result[name] = st
    return result, recorded_outs


def _hash_now(item) -> str | None:
    try:
        if not item.exists:
            return None
        return item.get_hash().value
    except Exception:  # unreadable or vanished while hashing: report as missing, never guess
        return None


# --- comparing -----------------------------------------------------------------------


def upstream_of(stages: dict[str, StageState]) -> dict[str, list[str]]:
    """For each stage, the stages whose outputs it takes as file deps (params files excluded:
    a stage that reads keys of another's output depends on those keys, compared one by one)."""
    producers = {out: s.name for s in stages.values() for out in s.outs}
    result = {}
    for s in stages.values():
        ups = []
        for dep in s.deps:
            for out, producer in producers.items():
                if producer != s.name and (dep == out or dep.startswith(out.rstrip("/") + "/")):
                    ups.append(producer)
        result[s.name] = sorted(set(ups))
    return result


def topological(stages: dict[str, StageState], ups: dict[str, list[str]]) -> list[str]:
    order, seen = [], set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for u in ups.get(name, []):
            visit(u)
        order.append(name)

    for name in stages:
        visit(name)
    return order


def explain(a: str = "HEAD", b: str = WORKSPACE, root: str | Path = ".") -> Report:
    from dvc.repo import Repo

    try:
        repo = Repo(str(root))
    except Exception as exc:  # not a DVC repo
        raise DflashpipeError(f"{root}: not a DVC project ({exc})") from None
    with repo:
        sa = State(repo, a)
        old = read_revision_state(sa) if sa.rev else read_workspace_state(repo)[0]
        sb = State(repo, b)
        recorded: dict[str, dict[str, str | None]] = {}
        if sb.rev:
            new = read_revision_state(sb)
        else:
            new, recorded = read_workspace_state(repo)
        cache = repo.cache.local
        verdicts = compare(old, new, recorded, cache, sa.label, sb.label)
        metrics = metric_deltas(sa, sb, new, verdicts, upstream_of(new))
    roots = root_causes(verdicts)
    return Report(sa.label, sb.label, roots, verdicts, metrics)


def compare(
    old: dict[str, StageState], new: dict[str, StageState], recorded: dict, cache, a: str, b: str
) -> list[Verdict]:
    ups = upstream_of(new)
    upstream_outs = {s: {o for u in ups[s] for o in new[u].outs} for s in new}
    verdicts: dict[str, Verdict] = {}
    for name in topological(new, ups):
        st, before = new[name], old.get(name)
        v = Verdict(name, UNCHANGED)
        verdicts[name] = v
        if before is None:
            v.verdict, v.note = UNKNOWN, f"no stage {name!r} in dvc.yaml at {a}: nothing to compare"
            continue
        if not before.locked:
            v.verdict, v.note = UNKNOWN, f"no dvc.lock entry for {name!r} at {a}: its inputs then are unknowable"
            continue
        if st.cmd != before.cmd:
            v.causes.append(Cause("cmd", name, before.cmd, st.cmd, f"dvc.yaml stages.{name}.cmd"))
        for path in sorted(set(st.deps) | set(before.deps)):
            old_md5, new_md5 = before.deps.get(path), st.deps.get(path)
            if old_md5 == new_md5 or any(
                path == o or path.startswith(o.rstrip("/") + "/") for o in upstream_outs[name]
            ):
                continue
            v.causes.append(
                Cause(
                    "dep",
                    path,
                    old_md5,
                    new_md5,
                    f"{before.where.get(f'dep:{path}', f'dvc.lock@{a} (not listed)')} vs "
                    f"{st.where.get(f'dep:{path}', f'{b} (not listed)')}",
                )
            )
        for file in sorted(set(st.params) | set(before.params)):
            old_values, new_values = before.params.get(file, {}), st.params.get(file, {})
            for key in sorted(set(old_values) | set(new_values)):
                if old_values.get(key) != new_values.get(key):
                    v.causes.append(
                        Cause(
                            "param",
                            f"{file}:{key}",
                            old_values.get(key),
                            new_values.get(key),
                            f"{before.where.get(f'param:{file}:{key}', f'dvc.lock@{a}')} vs "
                            f"{st.where.get(f'param:{file}:{key}', b)}",
                        )
                    )
        for u in ups[name]:
            changed_outs = [o for o in new[u].outs if old.get(u) and old[u].outs.get(o) != new[u].outs.get(o)]
            if verdicts[u].verdict in (DIRECT, DOWNSTREAM) or (changed_outs and not _restorable(verdicts[u])):
                v.upstream.append(u)
        if st.frozen:
            v.verdict, v.note = FROZEN, "frozen in dvc.yaml: `dvc repro` will not rerun it"
        elif st.always_changed:
            v.verdict, v.note = ALWAYS, "always_changed: it reruns on every `dvc repro` and observes the machine"
        elif v.causes:
            v.verdict = DIRECT
        elif v.upstream:
            v.verdict = DOWNSTREAM
        elif recorded:
            v.causes.extend(_output_problems(st, recorded.get(name, {}), cache))
            if v.causes:
                v.verdict = OUTPUTS
    return [verdicts[n] for n in topological(new, ups)]


def _restorable(v: Verdict) -> bool:
    """Outputs that `dvc checkout` brings back as recorded: what reads them is not invalidated by their absence."""
    return v.verdict == OUTPUTS and all(c.kind == "out" and c.evidence.endswith(RESTORABLE) for c in v.causes)


def _output_problems(st: StageState, recorded: dict[str, str | None], cache) -> list[Cause]:
    problems = []
    for path, locked in recorded.items():
        now = st.outs.get(path)
        if locked is None or now == locked:
            continue
        restorable = _in_cache(cache, locked)
        fix = RESTORABLE if restorable else f"not in the cache: `dvc repro -f {st.name}` rebuilds it"
        problems.append(
            Cause(
                "out",
                path,
                locked,
                now or "missing",
                f"dvc.lock (workspace) stages.{st.name}.outs md5 vs the workspace; {fix}",
            )
        )
    return problems


def _in_cache(cache, md5: str) -> bool:
    path = Path(cache.oid_to_path(md5))
    if not path.is_file():
        return False
    if md5.endswith(".dir"):
        entries = json.loads(path.read_text())
        return all(Path(cache.oid_to_path(e["md5"])).is_file() for e in entries)
    return True


def root_causes(verdicts: list[Verdict]) -> list[Cause]:
    """The direct causes, each once, with every stage it hits directly."""
    merged: dict[tuple, Cause] = {}
    for v in verdicts:
        if v.verdict not in (DIRECT, OUTPUTS):
            continue
        for c in v.causes:
            key = (
                c.kind,
                c.what,
                json.dumps(c.old, sort_keys=True, default=str),
                json.dumps(c.new, sort_keys=True, default=str),
            )
            if key not in merged:
                merged[key] = Cause(c.kind, c.what, c.old, c.new, c.evidence, [])
            merged[key].stages.append(v.stage)
    return list(merged.values())


# --- metrics -------------------------------------------------------------------------


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def _read_metrics(state: State, path: str) -> dict[str, Any]:
    text = state.read_text(path)
    if text is None:
        return {}
    return _flatten(json.loads(text) if path.endswith(".json") else yaml.safe_load(text))


def metric_deltas(
    sa: State, sb: State, new: dict[str, StageState], verdicts: list[Verdict], ups: dict[str, list[str]]
) -> list[MetricDelta]:
    by_stage = {v.stage: v for v in verdicts}

    def causes_reaching(stage: str) -> list[str]:
        found, todo, seen = [], [stage], set()
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            found.extend(f"{c.what}" for c in by_stage[s].causes if by_stage[s].verdict == DIRECT)
            todo.extend(ups.get(s, []))
        return sorted(set(found))

    deltas = []
    for st in new.values():
        for path in st.metrics:
            old, cur = _read_metrics(sa, path), _read_metrics(sb, path)
            for key in sorted(set(old) | set(cur)):
                o, n = old.get(key), cur.get(key)
                if o == n:
                    continue
                change = None
                if isinstance(o, (int, float)) and isinstance(n, (int, float)) and not isinstance(o, bool) and o != 0:
                    change = (n - o) / abs(o)
                deltas.append(MetricDelta(path, key, o, n, change, st.name, causes_reaching(st.name)))
    return deltas


# --- rendering -----------------------------------------------------------------------


def _short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    if isinstance(value, str) and len(value) == 32 or (isinstance(value, str) and value.endswith(".dir")):
        return value[:12]
    return text if len(text) <= 80 else text[:77] + "..."


def cause_line(c: Cause) -> str:
    what = {"param": "param", "dep": "dep", "cmd": "cmd of", "out": "output"}[c.kind]
    return f"{what} {c.what}: {_short(c.old)} -> {_short(c.new)}"


def to_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2, default=str)


def to_markdown(report: Report) -> str:
    lines = [f"## What changed: {report.a} -> {report.b}", ""]
    lines.append("### Root causes")
    if not report.root_causes:
        lines.append(f"- {_no_causes(report)}")
    for c in report.root_causes:
        lines.append(f"- `{cause_line(c)}` — hits {', '.join(c.stages)}  \n  evidence: `{c.evidence}`")
    lines += ["", "### Stages (DAG order)", "", "| stage | verdict | why |", "|---|---|---|"]
    for v in report.stages:
        lines.append(f"| {v.stage} | {v.verdict} | {_why(v)} |")
    lines += ["", "### Metrics"]
    if not report.metrics:
        lines.append("- no metric differs")
    for m in report.metrics:
        change, source = metric_line(m)
        lines.append(f"- `{m.key}` {change} ({source})")
    return "\n".join(lines) + "\n"


def metric_line(m: MetricDelta) -> tuple[str, str]:
    """'old -> new (+x%)' and where it came from, with the changed inputs behind it."""
    pct = f" ({m.change:+.0%})" if m.change is not None else ""
    return (
        f"{m.old} -> {m.new}{pct}",
        f"{m.file}, stage {m.stage}; changed inputs: {', '.join(m.causes) or 'none recorded'}",
    )


def _no_causes(report: Report) -> str:
    unknown = [v.stage for v in report.stages if v.verdict == UNKNOWN]
    if unknown:
        return f"none found, but unknowable for {', '.join(unknown)} (no record of them at {report.a})"
    return "nothing: every stage's recorded inputs are the same"


def _why(v: Verdict) -> str:
    if v.verdict == DIRECT:
        return "; ".join(cause_line(c) for c in v.causes)
    if v.verdict == DOWNSTREAM:
        return f"upstream {', '.join(v.upstream)} changed or will be regenerated"
    if v.verdict == OUTPUTS:
        return "; ".join(f"{cause_line(c)} ({c.evidence.split('; ')[-1]})" for c in v.causes)
    if v.verdict == UNCHANGED:
        return "none of its deps, params or upstream outputs changed"
    return v.note


def print_text(report: Report) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(f"[bold]What changed: {report.a} -> {report.b}[/bold]")
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
        console.print(f"  [{style}]{v.stage}: {v.verdict}[/{style}] — {escape(_why(v))}")
    console.print("\n[bold]Metrics[/bold]")
    if not report.metrics:
        console.print("  no metric differs")
    for m in report.metrics:
        change, source = metric_line(m)
        console.print(f"  • {escape(m.key)} {change}  [dim]{escape(source)}[/dim]")

"""Comparing two states along the DAG: each stage's verdict, the root causes, the metric deltas.

Invariant: pure. Given the StageStates that state.py read, the verdicts depend on nothing else; the only
reads are through the arguments (the cache lookup for outputs the workspace lost, and the metric files of
the two states via `read_metrics`). Stages are visited upstream first, so a stage's verdict may rely on its
upstream's; a dep inside an upstream's output is that upstream's doing, never a root cause of its own.
"""

from __future__ import annotations

import json

from dflashpipe.commands.explain.records import (
    RESTORABLE,
    Cause,
    MetricDelta,
    NoiseCall,
    StageState,
    StageVerdict,
    Verdict,
    display_names,
)
from dflashpipe.commands.explain.state import State, cached_json, dir_listing, in_cache, read_revision_state
from dflashpipe.compile.artifact import BUILT_FOR, REPORT
from dflashpipe.core import env, pipeline, spread
from dflashpipe.core.artifacts import json_number
from dflashpipe.core.errors import DflashpipeError
from dflashpipe.core.headlines import HEADLINES
from dflashpipe.core.metrics import read_metrics
from dflashpipe.core.pipeline import COMPILE, FINGERPRINT, lies_under
from dflashpipe.core.revision import WORKSPACE

RAN = ("compile", "compile_source", "graphs_compiled_while_timed", "busy_s")
"""The parts of a timing stage's record that say how its run went (train's `compile` and `busy_s`, bench's
`compile_source` and `graphs_compiled_while_timed`): carried with a timed headline's delta (MetricDelta.ran)."""

LISTED_FILES = 5
"""How many changed files of one directory a path names before it says how many more there are."""


def compare(
    old: dict[str, StageState], new: dict[str, StageState], recorded: dict, cache, a: str, b: str
) -> list[Verdict]:
    # file deps only: a stage that reads keys of another's output depends on those keys, compared one by one
    ups = pipeline.upstream_of({n: s.deps for n, s in new.items()}, {n: s.outs for n, s in new.items()})
    upstream_outs = {s: {o for u in ups[s] for o in new[u].outs} for s in new}
    verdicts: dict[str, Verdict] = {}
    for name in pipeline.upstream_first(new, ups):
        st, before = new[name], old.get(name)
        v = Verdict(name, StageVerdict.UNCHANGED)
        verdicts[name] = v
        if before is None:
            v.verdict, v.note = StageVerdict.UNKNOWN, f"no stage {name!r} in dvc.yaml at {a}: nothing to compare"
            continue
        if not before.locked:
            v.verdict, v.note = (
                StageVerdict.UNKNOWN,
                f"no dvc.lock entry for {name!r} at {a}: its inputs then are unknowable",
            )
            continue
        if st.cmd != before.cmd:
            v.causes.append(
                Cause("cmd", name, before.cmd, st.cmd, f"dvc.yaml stages.{name}.cmd", source=_source("cmd", a, b))
            )
        for path in sorted(set(st.deps) | set(before.deps)):
            old_md5, new_md5 = before.deps.get(path), st.deps.get(path)
            if old_md5 == new_md5 or any(lies_under(path, o) for o in upstream_outs[name]):
                continue
            v.causes.append(
                Cause(
                    "dep",
                    path,
                    old_md5,
                    new_md5,
                    f"{before.where.get(f'dep:{path}', f'dvc.lock@{a} (not listed)')} vs "
                    f"{st.where.get(f'dep:{path}', f'{b} (not listed)')}",
                    source=_source("dep", a, b),
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
                            source=_source("param", a, b, file),
                        )
                    )
        for u in ups[name]:
            # only the outputs this stage reads: a metrics file an upstream rewrote (its timings) reaches no one;
            # nor does an output rebuilt to other bytes that hold the same thing by its own key (the compile cache)
            changed_outs = [
                o
                for o in new[u].outs
                if old.get(u)
                and old[u].outs.get(o) != new[u].outs.get(o)
                and any(lies_under(d, o) for d in st.deps)
                and not equivalent(o, old[u].outs.get(o), new[u].outs.get(o), cache)
            ]
            if verdicts[u].verdict in (StageVerdict.DIRECT, StageVerdict.DOWNSTREAM) or (
                changed_outs and not _restorable(verdicts[u])
            ):
                v.upstream.append(u)
        if st.frozen:
            v.verdict, v.note = StageVerdict.FROZEN, "frozen in dvc.yaml: `dvc repro` will not rerun it"
        elif st.always_changed:
            v.verdict, v.note = (
                StageVerdict.ALWAYS,
                "always_changed: it reruns on every `dvc repro` and observes the machine",
            )
        elif v.causes:
            v.verdict = StageVerdict.DIRECT
            # it reruns anyway, but a lost output is a fact of its own (the compile cache gone: a cold compile)
            v.causes.extend(_output_problems(st, recorded.get(name, {}), cache))
        elif v.upstream:
            v.verdict = StageVerdict.DOWNSTREAM
        elif recorded:
            v.causes.extend(_output_problems(st, recorded.get(name, {}), cache))
            if v.causes:
                v.verdict = StageVerdict.OUTPUTS
        if v.verdict == StageVerdict.UNCHANGED and before is not None:
            same = [equivalent(o, before.outs.get(o), h, cache) for o, h in st.outs.items() if before.outs.get(o) != h]
            v.note = "; ".join(n for n in same if n)
    _trace_paths(verdicts, old, new, ups, cache, workspace=bool(recorded))
    return [verdicts[n] for n in pipeline.upstream_first(new, ups)]


def _source(kind: str, a: str, b: str, file: str = "") -> str:
    """The evidence's name for a cause of `kind` between states `a` and `b`: what each side was read from."""

    def side(state: str) -> str:
        if state != WORKSPACE:
            return f"dvc.yaml@{state}" if kind == "cmd" else f"dvc.lock@{state}"
        return {"cmd": "dvc.yaml", "param": file}.get(kind, "the workspace")

    return f"{side(a)} vs {side(b)}"


def equivalent(out: str, was: str | None, now: str | None, cache) -> str:
    """Why two hashes of `out` hold the same thing, or "" when they may not. Only the compile cache has such a
    rule: its bytes differ from build to build and machine to machine (the shared objects, the timings inside
    the FX graph entries), but inductor names every kernel by a hash of its source and every graph entry by its
    cache key, and report.json records the warmup key it was built for. The same names and the same
    `built_for` digest are the same kernels for the same inputs."""
    if out.rstrip("/") != str(COMPILE) or not was or not now or was == now:
        return ""
    before, after = dir_listing(cache, was), dir_listing(cache, now)
    if before is None or after is None or _cache_keys(before) != _cache_keys(after):
        return ""
    keys = [_built_for(cache, listing.get(REPORT)) for listing in (before, after)]
    if keys[0] is None or keys[0] != keys[1]:
        return ""
    return (
        f"{out} rebuilt here, equivalent: other bytes, the same {len(_cache_keys(after))} entries by inductor's "
        f"cache keys, built for the same warmup key ({keys[0][:12]})"
    )


KEYED_ENTRIES = ("fxgraph", "aotautograd")
"""inductor's caches that store an entry as `<cache>/<xx>/<key>/<entry>`, the entry file named by a hash of its own
bytes (which hold timings): the key is the directory. Kernels are `<xx>/<hash of the source>.cpp|.so`."""


def _cache_keys(listing: dict[str, str | None]) -> set[str]:
    return {
        path.rsplit("/", 1)[0] if any(f"/{name}/" in f"/{path}" for name in KEYED_ENTRIES) else path for path in listing
    }


def _built_for(cache, md5: str | None) -> str | None:
    report = cached_json(cache, md5)
    try:
        return str(report[BUILT_FOR]["digest"])
    except (KeyError, TypeError):
        return None


def _trace_paths(verdicts: dict[str, Verdict], old, new, ups, cache, workspace: bool) -> None:
    """Each stage's file-level chains to what changed: a link is a dep whose recorded hash moved, or (in a
    workspace whose upstream has not rerun yet, so no new hash exists) a dep of an upstream that will rerun.
    A chain ends at a stage changed directly, naming the changed files inside the dep it produced."""
    memo: dict[str, list[str]] = {}

    def below(name: str) -> list[str]:
        if name in memo:
            return memo[name]
        memo[name] = []  # a cycle cannot be a DAG's, but never recurse forever
        st, before, found = new[name], old.get(name), []
        for u in ups[name]:
            pending = (
                workspace
                and verdicts[u].verdict in (StageVerdict.DIRECT, StageVerdict.DOWNSTREAM)
                and old.get(u) is not None
            )
            pending = pending and all(old[u].outs.get(o) == h for o, h in new[u].outs.items())
            for dep in (d for d in st.deps if any(lies_under(d, o) for o in new[u].outs)):
                was, now = (before.deps.get(dep) if before else None), st.deps.get(dep)
                if (was == now and not pending) or (was != now and equivalent(dep, was, now, cache)):
                    continue  # same bytes, or the same content by its own key: not on the path
                if u not in verdicts[name].linked:
                    verdicts[name].linked.append(u)
                upper = [] if verdicts[u].verdict == StageVerdict.DIRECT else below(u)
                if upper:
                    found += [f"{dep} ({u}{', not rerun yet' if was == now else ''}) <- {c}" for c in upper]
                    continue
                files = [dep] if was == now else _changed_files(dep, was, now, cache)
                why = ", ".join(c.what for c in verdicts[u].causes) or verdicts[u].verdict
                found.append(f"{', '.join(files)} ({u}{', not rerun yet' if was == now else ''}: {why})")
        memo[name] = found
        return found

    for name, v in verdicts.items():
        v.paths = [f"{name} <- {chain}" for chain in below(name)]


def _changed_files(dep: str, was: str | None, now: str | None, cache) -> list[str]:
    """The files of dep whose hash moved: a file dep itself; a directory's entries from the two `.dir` listings."""
    if not (was or "").endswith(".dir") and not (now or "").endswith(".dir"):
        return [dep if now else f"{dep} (missing)"]
    before, after = dir_listing(cache, was), dir_listing(cache, now)
    if before is None or after is None:
        return [f"{dep}: directory changed (file listing not in the cache)"]
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    named = [f"{dep.rstrip('/')}/{k}" for k in changed[:LISTED_FILES]]
    return named + ([f"{len(changed) - LISTED_FILES} more"] if len(changed) > LISTED_FILES else [])


def _restorable(v: Verdict) -> bool:
    """Outputs that `dvc checkout` brings back as recorded: what reads them is not invalidated by their absence."""
    return v.verdict == StageVerdict.OUTPUTS and all(
        c.kind == "out" and c.evidence.endswith(RESTORABLE) for c in v.causes
    )


def _output_problems(st: StageState, recorded: dict[str, str | None], cache) -> list[Cause]:
    problems = []
    for path, locked in recorded.items():
        now = st.outs.get(path)
        if locked is None or now == locked:
            continue
        restorable = in_cache(cache, locked)
        fix = RESTORABLE if restorable else f"not in the cache: `dvc repro -f {st.name}` rebuilds it"
        problems.append(
            Cause(
                "out",
                path,
                locked,
                now or "missing",
                f"dvc.lock (workspace) stages.{st.name}.outs md5 vs the workspace; {fix}",
                source="dvc.lock vs the workspace",
            )
        )
    return problems


def root_causes(verdicts: list[Verdict]) -> list[Cause]:
    """The direct causes, each once, with every stage it hits directly."""
    merged: dict[tuple, Cause] = {}
    for v in verdicts:
        if v.verdict not in (StageVerdict.DIRECT, StageVerdict.OUTPUTS):
            continue
        for c in v.causes:
            key = (
                c.kind,
                c.what,
                json.dumps(c.old, sort_keys=True, default=str),
                json.dumps(c.new, sort_keys=True, default=str),
            )
            if key not in merged:
                merged[key] = Cause(c.kind, c.what, c.old, c.new, c.evidence, [], c.source)
            merged[key].stages.append(v.stage)
    return list(merged.values())


def metric_deltas(sa: State, sb: State, new: dict[str, StageState], verdicts: list[Verdict]) -> list[MetricDelta]:
    by_stage = {v.stage: v for v in verdicts}

    def causes_reaching(stage: str) -> list[Cause]:
        found, todo, seen = {}, [stage], set()
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            # a `machine` cause is what `dvc repro` will run with here, not what a recorded figure was measured
            # with (each side's dvc.lock says that): it moves no recorded metric
            found.update(
                (c.what, c)
                for c in by_stage[s].causes
                if by_stage[s].verdict == StageVerdict.DIRECT and c.kind != "machine"
            )
            # only through deps whose bytes changed: an upstream that reran to the same output is no path
            todo.extend(by_stage[s].linked)
        return [found[what] for what in sorted(found)]

    recorded: list[dict[str, StageState]] = []  # each side's dvc.lock: what each measurement ran with

    def ran_with() -> list[dict[str, StageState]]:
        if not recorded:
            recorded.extend((_lock_state(sa), _lock_state(sb)))
        return recorded

    deltas, keys_recorded = [], []
    headline_keys = {(h.file, h.key) for h in HEADLINES}
    for st in new.values():
        reaching = causes_reaching(st.name) if st.metrics else []
        for path in st.metrics:
            old, cur = readable_metrics(sa, path), readable_metrics(sb, path)
            keys_recorded += [(path, key) for key in {**old, **cur} if not _is_spread(key)]
            for key in sorted(set(old) | set(cur)):
                o, n = old.get(key), cur.get(key)
                if o == n or _is_spread(key):
                    continue  # a `<key>_spread` is read with its figure, below
                was, now = json_number(o), json_number(n)
                change = (now - was) / abs(was) if was and now is not None else None
                delta = MetricDelta(path, key, o, n, change, st.name, [c.what for c in reaching])
                if is_throughput(key, old, cur):
                    before, after = figure(old, key), figure(cur, key)
                    if not is_rate(key):  # a ratio of two paths timed in the same rounds: the machine cancels out
                        call = spread.compare(before, after)
                    # what the control runs on differs (its threads, its kernels, its device): it is no neutral
                    # reference then, and the figure is compared as it is; any other fact leaves it one
                    elif ran_on := [c.what for c in reaching if moves_the_control(c)] or _fingerprint_moves(
                        st.name, ran_with(), control_only=True
                    ):
                        call = spread.compare(before, after)
                        delta.control = f"control not applied: {ran_on[0].split(':', 1)[-1]} changed what it runs on"
                    else:  # work per second: the machine's speed moves it, the control says how much
                        controls = control(old, key), control(cur, key)
                        call = spread.compare_rates(before, after, *controls)
                        delta.control = control_words(*controls, sa.label, sb.label)
                        if None not in controls:
                            delta.slowdown = spread.slowdown(*controls)
                    delta.call = NoiseCall.UNMEASURED if call == "unmeasured" else call
                    delta.spread = f"before {_described(before)}; after {_described(after)}"
                    if delta.call in (NoiseCall.NOISE, NoiseCall.MACHINE):
                        delta.causes = []  # within the repeats' range, or the machine's move: no input to blame
                    if not delta.causes:
                        delta.machine = _machine_facts(st.name, key, old, cur, ran_with())
                    if (path, key) in headline_keys:
                        delta.ran = {k: v for k, v in cur.items() if k.split(".", 1)[0] in RAN}
                deltas.append(delta)
    names = display_names(keys_recorded)
    for delta in deltas:
        delta.name = names[delta.file, delta.key]
    return deltas


def headlines_same(sa: State, sb: State, deltas: list[MetricDelta]) -> list[str]:
    """The headline figures (`file:key`) both states record, with no delta between them."""
    moved = {(d.file, d.key) for d in deltas}
    files = {h.file for h in HEADLINES}
    read = {f: (readable_metrics(sa, f), readable_metrics(sb, f)) for f in files}
    return [
        f"{h.file}:{h.key}"
        for h in HEADLINES
        if (h.file, h.key) not in moved and all(h.key in side for side in read[h.file])
    ]


def readable_metrics(state: State, path: str) -> dict:
    """`read_metrics`, with a file that does not parse read as absent: the stage verdicts never depend on it, and
    `unreadable_metrics` says which it was."""
    try:
        return read_metrics(state, path)
    except DflashpipeError:
        return {}


def unreadable_metrics(states: list[State], new: dict[str, StageState]) -> list[str]:
    """The metrics files of `states` that exist but do not parse, each as the one line read_metrics gives."""
    found = []
    for state in states:
        for path in (p for st in new.values() for p in st.metrics):
            try:
                read_metrics(state, path)
            except DflashpipeError as exc:
                found.append(str(exc))
    return found


def _is_spread(key: str) -> bool:
    """A `<key>_spread` part of a flattened metrics file: read with its figure, never a figure of its own."""
    return any(part.endswith(spread.SUFFIX) for part in key.split("."))


TIMED_NAMES = ("seconds", "speedup", "mfu", "compiled_over_eager", "bound_by", "waited", "waiting_fraction")
"""Figures read off a clock whose names do not say so (a time ratio, a utilisation, which side was busier and
which waited for it, and for how much of the run)."""


def is_throughput(key: str, *flat_metrics: dict) -> bool:
    """A timed figure: its name says seconds or per second (`_s`, `per_second`; not `per_step`, `per_source`),
    it is a ratio of times, or a side records its spread over repeats. Such a move is never called
    deterministic: without a spread it is unmeasured."""
    parts = key.split(".")
    return any(p.endswith("_s") or "per_second" in p or p in TIMED_NAMES for p in parts) or any(
        f"{key}{spread.SUFFIX}.low" in m for m in flat_metrics
    )


def is_rate(key: str) -> bool:
    """A figure in work per second (tokens_per_s, encoded_tokens_per_second, decode_tokens_per_s.target)."""
    return "per_s" in key


def control(flat: dict, key: str) -> spread.Control | None:
    """The control recorded beside `key` (in its spread's machine facts), from a flattened metrics dict."""
    prefix = f"{key}{spread.SUFFIX}.{spread.BUSY}."
    return spread.Control.read({k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)})


def control_words(before: spread.Control | None, after: spread.Control | None, a: str, b: str) -> str:
    """The control's move in words: which side the machine was slower at, by what factor, on what evidence."""
    if before is None or after is None:
        missing = " and ".join(label for label, c in ((a, before), (b, after)) if c is None)
        return f"no control recorded at {missing}"
    factor = spread.slowdown(before, after)
    times = f"control {after.mean:.3g} ms at {b} vs {before.mean:.3g} ms at {a}"
    if factor >= 1:
        return f"the machine was {factor:.2f}x slower at {b}: {times}"
    return f"the machine was {1 / factor:.2f}x faster at {b}: {times}"


def figure(flat: dict, key: str) -> spread.Spread | None:
    """`key` with its `<key>_spread` from a flattened metrics dict (read_metrics flattens the spread too)."""
    prefix = f"{key}{spread.SUFFIX}."
    parts = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    return spread.Spread.read({key: flat.get(key), key + spread.SUFFIX: parts or None}, key)


def _described(s: spread.Spread | None) -> str:
    return "no spread recorded" if s is None else s.describe()


def _lock_state(state: State) -> dict[str, StageState]:
    try:
        return read_revision_state(state)
    except Exception:  # an unreadable record says nothing here; the verdicts already reported on it
        return {}


def _machine_facts(stage: str, key: str, old: dict, cur: dict, recorded: list[dict[str, StageState]]) -> str:
    """What the two measurements' records say about their machines: fingerprint keys of `stage` that its two
    dvc.lock entries differ on, and each side's `machine` facts from `<key>_spread` (spread.Busy)."""
    said = []
    moved = _fingerprint_moves(stage, recorded, values=True)
    if moved:
        said.append(f"the runs were recorded (dvc.lock) with {'; '.join(moved)}")
    busy = [_busy(flat, key) for flat in (old, cur)]
    if any(busy):
        said.append(f"while measuring: before {busy[0] or 'not recorded'}; after {busy[1] or 'not recorded'}")
    return "; ".join(said)


def moves_the_control(c: Cause) -> bool:
    """Whether a cause is a recorded fingerprint key the control can follow (env.CONTROL_INPUTS)."""
    prefix = f"{FINGERPRINT}:"
    return c.kind == "param" and c.what.startswith(prefix) and c.what[len(prefix) :] in env.CONTROL_INPUTS


def _fingerprint_moves(
    stage: str, recorded: list[dict[str, StageState]], values: bool = False, control_only: bool = False
) -> list[str]:
    """The fingerprint keys `stage`'s two dvc.lock entries (each side's) ran with that differ, with their two
    values when `values`; only those that can move the control with `control_only`."""
    before, after = (r.get(stage) for r in recorded) if len(recorded) == 2 else (None, None)
    if before is None or after is None or not before.locked or not after.locked:
        return []
    was, now = before.params.get(str(FINGERPRINT), {}), after.params.get(str(FINGERPRINT), {})
    keys = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    keys = [k for k in keys if k in env.CONTROL_INPUTS] if control_only else keys
    return [f"{k} {_compact(was.get(k))} -> {_compact(now.get(k))}" if values else k for k in keys]


def _busy(flat: dict, key: str) -> str:
    prefix = f"{key}{spread.SUFFIX}.{spread.BUSY}."
    facts = {k[len(prefix) :]: v for k, v in flat.items() if k.startswith(prefix)}
    if not facts:
        return ""
    ratio, load, cpus = facts.get("cpu_over_wall"), facts.get("load_1m"), facts.get("cpus")
    return f"CPU time/wall {ratio} on {cpus} CPUs, load {load}"


def _compact(value) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."

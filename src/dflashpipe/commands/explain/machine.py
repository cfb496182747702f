"""The live machine against the workspace's fingerprint file.

The fingerprint stage records the machine when it last ran; `dvc repro` reruns it, but `explain` and
`dvc status` compare against the file as it is. So explain observes the machine now, with the fingerprint
stage's own code (`dflashpipe.core.env.observe`), says first when the file is stale, and reads every fingerprint key
of the workspace off the machine, not the file (`with_live_fingerprint`): `dvc repro` reruns the fingerprint stage
before anything that reads it, so the live value is what each stage will run with. A key whose live value the file
does not show yet is the machine's change (`attribute_to_machine`): a `machine` cause of every stage that names it,
a root cause, and the header's list of stages invalid here is read off those same verdicts. One set of facts, so the
header, the verdicts, the root causes and every rendering of them agree.

It costs no torch import when nothing moved: torch's files are re-hashed only where their size or mtime moved,
and the facts only an imported torch tells are reused when recorded under the same key (torch's files, the
CPU, the GPUs, the variables that steer loading); the report says which of those happened.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dflashpipe.commands.explain.records import Cause, EditedFile, Machine, StageState, StageVerdict, Verdict
from dflashpipe.core import env
from dflashpipe.core.pipeline import FINGERPRINT


def fingerprint_changes(recorded: dict[str, Any], now: dict[str, Any]) -> list[Cause]:
    """Changed keys, one level below each group (`torch.files_edited`, `env.TORCHINDUCTOR_MAX_AUTOTUNE`)."""
    changes = []
    for group in sorted(set(recorded) | set(now)):
        was, cur = recorded.get(group), now.get(group)
        if not isinstance(was, dict) or not isinstance(cur, dict):
            if was != cur:
                changes.append(Cause("machine", group, was, cur, f"{FINGERPRINT} vs this machine now"))
            continue
        for key in sorted(set(was) | set(cur)):
            if was.get(key) != cur.get(key):
                changes.append(
                    Cause("machine", f"{group}.{key}", was.get(key), cur.get(key), f"{FINGERPRINT} vs this machine now")
                )
    return changes


def _covers(named: str, changed: str) -> bool:
    return changed == named or changed.startswith(named + ".") or named.startswith(changed + ".")


@dataclass
class Live:
    """The machine observed now: the report's Machine and the facts a fingerprint stage would write here."""

    machine: Machine
    facts: dict[str, Any]


def observe_machine(root: str | Path, distribution: str = "torch") -> Live:
    root = Path(root)
    seen = env.observe(root / env.HASH_STATE, root / env.LOADED_STATE, reuse_loaded=True, project=root)
    now, integrity = seen.facts, seen.integrity
    check = (
        f"full check: hashed all {integrity.checked} {distribution} files"
        if integrity.full
        else f"re-hashed {integrity.rehashed} of {integrity.checked} {distribution} files (the rest kept their "
        f"size and mtime since {env.HASH_STATE} recorded them)"
    )
    check += (
        f"; imported {distribution} for its build, libraries, CPU capability and GPUs"
        if seen.probed
        else f"; its build, libraries, CPU capability and GPUs as {env.LOADED_STATE} recorded them under the same "
        "key (its files, the CPU, the GPUs, the loading variables)"
    )
    dist = metadata.distribution(distribution)
    edited = [
        EditedFile(path, recorded, current, env.edited_functions(dist, path))
        for path, (recorded, current) in integrity.edited.items()
    ]
    try:
        recorded = json.loads((root / FINGERPRINT).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # never written (or torn): every key is news, as `dvc repro` will find
        recorded = {}
    changes = fingerprint_changes(recorded, now)
    return Live(Machine(bool(changes), changes, [], edited, check), now)


def _compact(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def with_live_fingerprint(
    stages: dict[str, StageState], live: Live, declared: dict[str, list[str]]
) -> dict[str, StageState]:
    """The workspace's stages with every fingerprint key they name read off the machine now, not the file.

    `dvc repro` reruns the fingerprint stage (always_changed) before anything that reads it, so what each stage
    will run with here is the live value; the file only says what the machine was when that stage last ran.
    `declared`: each stage's fingerprint keys in dvc.yaml, so a key the file does not hold yet (a key added since
    the fingerprint stage last ran) is read off the machine too."""
    file = str(FINGERPRINT)
    result = {}
    for name, st in stages.items():
        keys = list(dict.fromkeys([*st.params.get(file, {}), *declared.get(name, [])]))
        if not keys:
            result[name] = st
            continue
        values, where = dict(st.params.get(file, {})), dict(st.where)
        for key in keys:
            now, was = env.fact_at(live.facts, key), values.get(key, env.ABSENT)
            if now is env.ABSENT:  # DVC reads a key the file lacks as absent
                values.pop(key, None)
                continue
            if now != was:
                says = "lacks it" if was is env.ABSENT else f"still says {_compact(was)}"
                where[f"param:{file}:{key}"] = f"this machine now (observed live; {file} {says}: stale)"
            values[key] = now
        result[name] = replace(st, params={**st.params, file: values}, where=where)
    return result


def attribute_to_machine(verdicts: list[Verdict], live: Live) -> None:
    """A fingerprint key whose live value the file does not show yet is the machine's change, not the file's:
    its causes become `machine` causes (with the edited files and definitions behind torch.files_*), and the
    report's Machine names the stages they invalidate, from these same verdicts."""
    prefix = f"{FINGERPRINT}:"
    stale = {c.what for c in live.machine.changes}
    edited = "; ".join(f"edited {f.path} ({_definitions(f)})" for f in live.machine.edited)
    hit: set[str] = set()
    for v in verdicts:
        for c in v.causes:
            key = c.what[len(prefix) :] if c.kind == "param" and c.what.startswith(prefix) else None
            if key is None or not any(_covers(key, s) for s in stale):
                continue
            c.kind, c.what = "machine", key
            c.source = f"{c.source.split(' vs ')[0]} vs this machine"
            if edited and key.startswith("torch.files"):
                c.evidence += f"; {edited}"
            hit.add(v.stage)
            for change in live.machine.changes:
                if _covers(key, change.what) and v.stage not in change.stages:
                    change.stages.append(v.stage)
        if v.verdict == StageVerdict.DOWNSTREAM and any(u in hit for u in v.upstream):
            hit.add(v.stage)
    live.machine.invalid = [v.stage for v in verdicts if v.stage in hit]


def _definitions(f: EditedFile) -> str:
    if f.functions is None:
        return "no copy of the wheel to diff against"
    return "changed: " + (", ".join(f.functions) or "only whitespace or comments")

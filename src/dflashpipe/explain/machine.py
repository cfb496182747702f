"""The live machine against the workspace's fingerprint file.

The fingerprint stage records the machine when it last ran; `dvc repro` reruns it, but `explain` and
`dvc status` compare against the file as it is. So explain observes the machine now, with the fingerprint
stage's own code (`dflashpipe.env.observe`), and says first when the file is stale and which stages that
makes invalid here: those whose dvc.yaml params name a changed key, and what is downstream of them.

It costs no torch import when nothing moved: torch's files are re-hashed only where their size or mtime moved,
and the facts only an imported torch tells are reused when recorded under the same key (torch's files, the
CPU, the GPUs, the variables that steer loading); the report says which of those happened.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
from pathlib import Path
from typing import Any

from dflashpipe import env
from dflashpipe.explain.comparison import topological, upstream_of
from dflashpipe.explain.report import Cause, EditedFile, Machine, StageState
from dflashpipe.pipeline import FINGERPRINT


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


def invalid_stages(changes: list[Cause], stages: dict[str, StageState]) -> list[str]:
    """Stages whose params read a changed key (a named key covers the keys below it), then their downstream."""
    hit = set()
    for st in stages.values():
        names = st.params.get(str(FINGERPRINT), {})
        for c in changes:
            if any(c.what == n or c.what.startswith(n + ".") or n.startswith(c.what + ".") for n in names):
                c.stages.append(st.name)
                hit.add(st.name)
    ups = upstream_of(stages)
    order = topological(stages, ups)
    for name in order:
        if any(u in hit for u in ups[name]):
            hit.add(name)
    return [n for n in order if n in hit]


def observe_machine(root: str | Path, stages: dict[str, StageState], distribution: str = "torch") -> Machine:
    root = Path(root)
    seen = env.observe(root / env.HASH_STATE, root / env.LOADED_STATE, reuse_loaded=True)
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
    return Machine(bool(changes), changes, invalid_stages(changes, stages), edited, check)

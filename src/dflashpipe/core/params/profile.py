"""Profiles: named sets of params.yaml values, applied as a DVC experiment rather than by editing.

A profile (`profiles/*.yaml`) has params.yaml's shape, with only the keys it changes. `experiment_command`
checks it the way a stage would read it (laid over the project's params.yaml, every section built and
range-checked) and turns it into one `dvc exp run -n NAME -S key=value ...` line, so a profile is a
recorded experiment whose params `dvc params diff` and `dflashpipe explain` can name key by key.

A profile for GPUs (its topology names a cuda device) is a recipe: it must state every key that params.yaml sizes
for the CPU (`cpu_sized_keys`), or the run would silently be 200 samples and 120 steps on eight GPUs.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params.loading import PARAMS_FILE, _read_yaml, build
from dflashpipe.core.params.sections import SECTIONS


def profile_overrides(profile: Path | str, root: Path | str = ".") -> dict[str, Any]:
    """The profile's `section.key -> value` pairs, after checking them over `root`'s params.yaml."""
    path = Path(profile)
    raw = _read_yaml(path)
    if not isinstance(raw, dict) or not raw:
        raise ParamsError(f"{path}: expected a mapping of params.yaml sections to the keys it changes")
    base = _read_yaml(Path(root) / PARAMS_FILE)
    overrides: dict[str, Any] = {}
    merged_sections: dict[str, dict] = {}
    for section, keys in raw.items():
        if section not in SECTIONS:
            raise ParamsError(f"{path}: unknown section {section!r}; params.yaml has {sorted(SECTIONS)}")
        if not isinstance(keys, dict) or not keys:
            raise ParamsError(f"{path}: {section}: expected a mapping of the keys it changes")
        merged = merged_sections[section] = {**(base.get(section) or {}), **keys}
        try:
            build(SECTIONS[section], merged, section)
        except ParamsError as exc:
            raise ParamsError(f"{path} (over {PARAMS_FILE}): {str(exc).removeprefix(PARAMS_FILE + ': ')}") from None
        overrides.update({f"{section}.{key}": value for key, value in keys.items()})
    devices = (merged_sections.get("topology") or base.get("topology") or {}).values()
    if any(str(d).startswith("cuda") for value in devices if isinstance(value, list) for d in value):
        inherited = [key for key in cpu_sized_keys() if key not in overrides]
        if inherited:
            raise ParamsError(
                f"{path}: a GPU profile (its topology names cuda devices) inherits CPU-sized keys from "
                f"{PARAMS_FILE}: {', '.join(inherited)}; state each for the run (profiles/gpu8.yaml says where "
                f"each of its values comes from)"
            )
    return overrides


def cpu_sized_keys() -> list[str]:
    """`section.key` of every field marked CPU_SIZED (core.params.sections), in params.yaml's order."""
    return [
        f"{section}.{f.name}"
        for section, cls in SECTIONS.items()
        for f in dataclasses.fields(cls)
        if f.metadata.get("cpu_sized")
    ]


def experiment_command(profile: Path | str, name: str | None = None, root: Path | str = ".") -> str:
    """One shell line that runs the profile as the DVC experiment `name` (default: the file's stem)."""
    return shlex.join(experiment_words(profile_overrides(profile, root), name or Path(profile).stem))


def experiment_words(overrides: dict[str, Any], name: str | None, queue: bool = False) -> list[str]:
    """`dvc exp run [--queue] [-n NAME] -S key=value ...` as a command's words."""
    words = ["dvc", "exp", "run", *(["--queue"] if queue else []), *(["-n", name] if name else [])]
    for key, value in overrides.items():
        # a mapping (target.chat_template_kwargs) into params.yaml's: Hydra refuses keys a plain override would add
        # to it ("not in struct"); `++` adds or overrides them
        words += ["-S", f"{'++' if isinstance(value, dict) else ''}{key}={_flow(value)}"]
    return words


def _flow(value: Any) -> str:
    """`value` in the override grammar `dvc exp run -S` parses (Hydra's): lists, mappings, quoted strings."""
    if isinstance(value, list):
        return "[" + ",".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # strings double-quoted; numbers, true/false and null as they are

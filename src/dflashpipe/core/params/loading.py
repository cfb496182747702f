"""Loading params.yaml into the typed sections, and checking a stage's reads against dvc.yaml.

Invariant: every value a stage reads passed through `build` (types, unknown and missing keys) and its
section's `__post_init__` (ranges), and a stage reads only the keys its dvc.yaml entry declares (a section of
which it declares some keys is a `Declared` view). Every failure is one ParamsError naming the file and key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params.sections import SECTIONS
from dflashpipe.core.pipeline import Pipeline, PipelineError

PARAMS_FILE = "params.yaml"
DVC_FILE = "dvc.yaml"


@dataclass(frozen=True)
class StageParams:
    """The sections that one stage may read: exactly those its dvc.yaml entry declares."""

    stage: str
    sections: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self.sections[name]
        except KeyError:
            raise ParamsError(
                f"stage {self.stage!r} reads params section {name!r}, but dvc.yaml does not declare it "
                f"for that stage: add its keys under stages.{self.stage}.params"
            ) from None


class Declared:
    """A section of which the stage declares some keys (the target stage reads target.source, the stages that render
    chats target.chat_template_kwargs): reading any other key is refused, as reading an undeclared section is."""

    __slots__ = ("_stage", "_section", "_values", "_keys")

    def __init__(self, stage: str, section: str, values: Any, keys: set[str]) -> None:
        self._stage, self._section, self._values, self._keys = stage, section, values, frozenset(keys)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name not in {f.name for f in dataclasses.fields(self._values)}:
            raise AttributeError(name)
        if name not in self._keys:
            raise ParamsError(
                f"dvc.yaml: stages.{self._stage}.params misses {self._section}.{name}, which the stage reads: "
                f"add it (or a change to it goes unseen)"
            )
        return getattr(self._values, name)


def load_params(root: Path | str = ".") -> dict[str, Any]:
    """Read and validate the whole of params.yaml into one typed object per section."""
    path = Path(root) / PARAMS_FILE
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ParamsError(f"{path}: unknown section(s) {unknown}; allowed: {sorted(SECTIONS)}")
    missing = sorted(set(SECTIONS) - set(raw))
    if missing:
        raise ParamsError(f"{path}: missing section(s) {missing}")
    return {name: build(cls, raw[name], name) for name, cls in SECTIONS.items()}


def declared_keys(stage: str, root: Path | str = ".") -> list[str]:
    """The params.yaml keys that dvc.yaml declares for `stage` (other params files left out)."""
    path = Path(root) / DVC_FILE
    try:
        specs = Pipeline.read(root).specs
    except PipelineError as exc:  # the same one line, as the params error a stage's caller expects
        raise ParamsError(str(exc)) from None
    if stage not in specs:
        raise ParamsError(f"{path}: no stage {stage!r}; stages: {sorted(specs)}")
    return [key for file, key in specs[stage].params if file == PARAMS_FILE]


def load_stage_params(stage: str, root: Path | str = ".") -> StageParams:
    """Validate params.yaml, check it against dvc.yaml, and return what `stage` may read."""
    params = load_params(root)
    by_section: dict[str, set[str]] = {}
    for key in declared_keys(stage, root):
        section, _, rest = key.partition(".")
        if section not in SECTIONS:
            raise ParamsError(
                f"dvc.yaml: stages.{stage}.params names {key!r}, but params.yaml has no section {section!r}"
            )
        if not rest:
            raise ParamsError(
                f"dvc.yaml: stages.{stage}.params names the whole section {key!r}; list its keys one by one"
            )
        by_section.setdefault(section, set()).add(rest)
    for section, keys in by_section.items():
        fields = {f.name for f in dataclasses.fields(SECTIONS[section])}
        extra = sorted(keys - fields)
        if extra:
            raise ParamsError(
                f"dvc.yaml: stages.{stage}.params declares {[f'{section}.{k}' for k in extra]}, "
                f"which the stage does not read: remove them (they make it rerun for nothing)"
            )
    whole = {s for s, keys in by_section.items() if keys == {f.name for f in dataclasses.fields(SECTIONS[s])}}
    sections = {s: params[s] if s in whole else Declared(stage, s, params[s], keys) for s, keys in by_section.items()}
    if "compile" in sections:  # `auto` is decided where the drafter runs, once, here
        topology = sections.get("topology")
        if topology is None and sections["compile"].enabled == "auto":
            raise ParamsError(f"dvc.yaml: stages.{stage} reads compile.enabled: auto, which needs topology.*")
        sections["compile"] = sections["compile"].on(topology.drafter_devices) if topology else sections["compile"]
    return StageParams(stage, sections)


def build(cls: type, raw: Any, key: str) -> Any:
    """Turn a parsed YAML value into an instance of dataclass `cls`, naming `key` in every error."""
    if not isinstance(raw, dict):
        raise ParamsError(f"params.yaml: {key} = {raw!r}: expected a mapping with keys {_field_names(cls)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ParamsError(f"params.yaml: {key}: unknown key(s) {unknown}; allowed: {_field_names(cls)}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING:
                raise ParamsError(f"params.yaml: {key}.{name} is missing")
            continue
        values[name] = _convert(hints[name], raw[name], f"{key}.{name}")
    return cls(**values)


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, key)
    if origin is Literal:
        if value not in args:
            raise ParamsError(f"params.yaml: {key} = {value!r}: allowed values are {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [a for a in args if a is not type(None)]
        for arm in arms[:-1]:  # the first arm that takes the value; the last one's error names the key
            try:
                return _convert(arm, value, key)
            except ParamsError:
                continue
        return _convert(arms[-1], value, key)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected a mapping with string keys")
        return {k: _convert(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if hint is Any:  # passed on as YAML gave it (a template variable may be any value)
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected a list")
        return tuple(_convert(args[0], item, _item_key(key, i, item)) for i, item in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected a number")
        try:
            number = float(value)
        except OverflowError:
            number = float("inf")
        if not math.isfinite(number):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected a finite number")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ParamsError(f"params.yaml: {key} = {value!r}: expected a string")
        return value
    raise TypeError(f"unsupported params type {hint!r} for {key}")


def _item_key(key: str, index: int, item: Any) -> str:
    name = item.get("name") if isinstance(item, dict) else None
    return f"{key}[{name}]" if isinstance(name, str) else f"{key}[{index}]"


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path} not found: run from the project root") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParamsError(f"{path}: not valid YAML: {exc}") from None

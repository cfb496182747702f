"""Bad params: every key of params.yaml, found by walking the dataclasses of `params.SECTIONS` (so a
new section or field is covered the day it lands), given wrong types, negatives, empty values, huge
values, NaN and arbitrary YAML. `load_params` either accepts the value or raises ParamsError naming
the key; never another exception, never a silent acceptance of a value out of a documented range."""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflashpipe.core.errors import ParamsError
from dflashpipe.core.params import SECTIONS, load_params
from tests.conftest import ROOT


@dataclasses.dataclass(frozen=True)
class Key:
    path: tuple[Any, ...]
    """Where the value sits in the parsed YAML: ("data", "sources", 1, "weight")."""
    hint: Any
    required: bool

    def dotted(self, raw: dict) -> str:
        """The key as errors spell it: list items by their `name` when they have one."""
        out, node = "", raw
        for part in self.path:
            if isinstance(part, int):
                name = node[part].get("name") if isinstance(node[part], dict) else None
                out += f"[{name if isinstance(name, str) else part}]"
            else:
                out += f".{part}" if out else part
            node = node[part] if isinstance(node, (dict, list)) and (isinstance(part, int) or part in node) else {}
        return out


def keys_of(cls: type, prefix: tuple, raw: Any) -> list[Key]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, path = hints[f.name], (*prefix, f.name)
        keys.append(Key(path, hint, f.default is dataclasses.MISSING))
        value = raw.get(f.name) if isinstance(raw, dict) else None
        if typing.get_origin(hint) is tuple and isinstance(value, list):
            (item,) = typing.get_args(hint)[:1]
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(item):
                    keys.append(Key((*path, i), item, True))
                    keys.extend(keys_of(item, (*path, i), v))
                else:
                    keys.append(Key((*path, i), item, True))
    return keys


BASE = yaml.safe_load((ROOT / "params.yaml").read_text())
"""The project's own params.yaml: valid, so every refusal below is the mutation's doing."""
SECTION_KEYS = [Key((name,), cls, True) for name, cls in SECTIONS.items()]
KEYS = SECTION_KEYS + [k for name, cls in SECTIONS.items() for k in keys_of(cls, (name,), BASE[name])]


def with_value(raw: dict, path: tuple, value: Any, delete: bool = False) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    for part in path[:-1]:
        node = node[part]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


def load(tmp_path: Path, raw: dict) -> dict:
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    return load_params(tmp_path)


def refuses_naming(tmp_path: Path, raw: dict, key: str) -> str:
    with pytest.raises(ParamsError) as err:
        load(tmp_path, raw)
    message = str(err.value)
    assert key in message or key.split("[")[0] in message, f"{message!r} does not name {key}"
    return message


HUGE_INT, HUGE_FLOAT = 10**30, 1e300


def wrong_types(hint: Any) -> list[Any]:
    """Values of the wrong kind for `hint`: always refused."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    optional = origin in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        (hint,) = [a for a in args if a is not type(None)]
        origin = typing.get_origin(hint)
    none = [] if optional else [None]
    if origin in (typing.Union, types.UnionType):  # a choice of arms (bool or 'auto'): wrong for every arm
        wrong = [v for arm in typing.get_args(hint) for v in wrong_types(arm)]
        return [
            v
            for i, v in enumerate(wrong)
            if not any(fits(arm, v) for arm in typing.get_args(hint))
            and not any(type(v) is type(w) and v == w for w in wrong[:i])
        ]
    if dataclasses.is_dataclass(hint):
        return [5, "x", [1], True, *none]
    if origin is Literal:
        return ["no-such-choice", 5, [], {"a": 1}, True, *none]
    if origin is tuple:
        return ["x", 5, {"a": 1}, *none]
    if origin is dict:  # a mapping of names (target.chat_template_kwargs)
        return ["x", 5, [1], True, {5: "a"}, *none]
    if hint is bool:
        return ["true", 1, 0, [], *none]
    if hint is int:
        return ["7", 1.5, True, [1], {"a": 1}, *none]
    if hint is float:
        return ["1.0", True, [1.0], {"a": 1}, *none]
    if hint is str:
        return [5, 1.5, True, [], {"a": 1}, *none]
    raise AssertionError(f"add wrong values for {hint!r} to this test")


def fits(hint: Any, value: Any) -> bool:
    """`value` is one `hint` takes as it is (for the arms of a union; only the kinds a union here holds)."""
    if typing.get_origin(hint) is Literal:
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    return type(value) is hint


def out_of_range(hint: Any) -> list[Any]:
    """Negatives, huge values, NaN, empties: refused unless listed in ACCEPTED below."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return [""]
    if hint is int:
        return [-1, -HUGE_INT, HUGE_INT]
    if hint is float:
        return [-1.0, -HUGE_FLOAT, HUGE_FLOAT, math.inf, math.nan, 10**400]
    if hint is str:
        return ["", "   "]
    if origin is tuple:
        return [[]]
    return []


ACCEPTED = {
    ("model.target_layer_ids", "[]"): "[] means the even spacing",
    ("evaluate.baseline", "''"): "'' means no baseline",
    ("regenerate.endpoints", "[]"): "[] means generating in this process",
    ("evaluate.benchmarks", "[]"): "[] means the held-out split alone",
    ("gate.served_acceptance", "[]"): "[] means the served bars off (gate.floor still checks)",
}
"""(key, repr of value) pairs from out_of_range that are valid on purpose, with the reason."""


def label(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        return f"{'-' if value < 0 else ''}10**{len(str(abs(value))) - 1}"
    return repr(value)


def cases(values_of) -> list:
    return [pytest.param(k, v, id=f"{k.dotted(BASE)}={label(v)}") for k in KEYS for v in values_of(k.hint)]


def test_the_walk_covers_every_section_and_field():
    dotted = {k.dotted(BASE) for k in KEYS}
    assert {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)} <= dotted
    assert {
        f"data.sources[{s['name']}].{f}"
        for s in BASE["data"]["sources"]
        for f in ("name", "kind", "weight", "eval", "path")
    } <= dotted
    assert load_params(ROOT)


@pytest.mark.parametrize(("key", "value"), cases(wrong_types))
def test_a_wrong_type_is_refused_naming_the_key(tmp_path, key, value):
    raw = with_value(BASE, key.path, value)
    refuses_naming(tmp_path, raw, key.dotted(raw))


@pytest.mark.parametrize(("key", "value"), cases(out_of_range))
def test_a_negative_huge_nan_or_empty_value_is_refused_naming_the_key(tmp_path, key, value):
    raw = with_value(BASE, key.path, value)
    if (key.dotted(raw), repr(value)) in ACCEPTED:
        load(tmp_path, raw)
        return
    refuses_naming(tmp_path, raw, key.dotted(raw))


@pytest.mark.parametrize(
    "key", [k for k in KEYS if k.required and not isinstance(k.path[-1], int)], ids=lambda k: k.dotted(BASE)
)
def test_a_missing_key_is_refused_naming_it(tmp_path, key):
    refuses_naming(tmp_path, with_value(BASE, key.path, None, delete=True), key.dotted(BASE))


@pytest.mark.parametrize("key", [k for k in KEYS if dataclasses.is_dataclass(k.hint)], ids=lambda k: k.dotted(BASE))
def test_an_unknown_key_is_refused_naming_where(tmp_path, key):
    refuses_naming(tmp_path, with_value(BASE, (*key.path, "bogus_key"), 1), key.dotted(BASE))


YAML_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=YAML_VALUES)
def test_any_value_anywhere_is_accepted_or_refused_with_the_key(tmp_path, key, value):
    raw = with_value(BASE, key.path, value)
    try:
        load(tmp_path, raw)
    except ParamsError as err:
        name = key.dotted(raw)
        assert name in str(err) or name.split("[")[0] in str(err), f"{err} does not name {name}"

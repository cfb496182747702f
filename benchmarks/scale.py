"""The data path at the scale of the 800K -> 1.1M growth: manifest build and growth, tokenize, and the
memory that training's token data costs.

    python benchmarks/scale.py [--scale 1.0 --repeats 3 --work /tmp/dflashpipe-scale]

At --scale 1 (--scale 0.25 runs a quarter of every count):
1. writes a 1.15M-line ShareGPT-format JSONL of real text: the paragraphs of the text files of the
   installed packages (docs, licences, sources), deduplicated, each line one unique pairing
   (user: paragraph a; assistant: paragraphs b and c), chosen by arithmetic on the line number;
2. manifest: a full build of 800K samples, then growing it to 1.1M in place (the stage's key, so the
   earlier shards are kept), `--repeats` times; the growth's time as a ratio to the full build's
   (goal < 0.5), and a fresh 1.1M build for what growth cost before (a full rebuild);
3. tokenize (all cores): the 800K manifest, then the grown one reusing its shards: tokens/s;
4. the peak RSS, each in a fresh process, of `load_tokens` of the 1.1M tokens plus `collate` of a few
   hundred batches, memory-mapped (this code) and as one flat in-memory array (the loading before it),
   side by side (goal: under 2 GB). The peak is the child's VmHWM: getrusage's maxrss of a process
   started from this large one begins at this one's high-water mark (Linux carries it across exec),
   so it is printed too but overstates small peaks. The batches are train's own: its packing plan
   (the 8-GPU profile's shapes: seq_len 2048, 3 drafter replicas) and collate.

`--memory-only` runs 4 alone at the full scale, on synthetic token shards written by tokenize's own
shard writer (random ids, the real set's mean length): what train reads, without hours of encoding.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import orjson  # noqa: E402

from dflashpipe.core.params import DataParams, SourceSpec, TokenizeParams  # noqa: E402
from dflashpipe.core.pipeline import StageKey  # noqa: E402
from dflashpipe.data.manifest import build_manifest  # noqa: E402

LINES, FULL, GROWN, SHARD_SIZE = 1_150_000, 800_000, 1_100_000, 500
SOURCE = "data/sources/scale.jsonl"
TEXT_SUFFIXES = {".py", ".md", ".rst", ".txt", ".pyi", ".toml", ".cfg"}
TEXT_NAMES = ("LICENSE", "LICENCE", "COPYING", "METADATA", "README", "NOTICE", "AUTHORS")
KEY = StageKey("manifest", {"benchmark": "scale"})
"""One key for every build, as the stage's would be: same sources, params and code."""


def paragraphs(site_packages: Path, limit_bytes: int = 1 << 20) -> list[str]:
    """Every distinct blank-line-separated paragraph of 80..1500 characters in the packages' text files."""
    seen: dict[str, None] = {}
    for path in sorted(site_packages.rglob("*")):
        if not (path.suffix in TEXT_SUFFIXES or path.name.startswith(TEXT_NAMES)) or not path.is_file():
            continue
        if path.stat().st_size > limit_bytes:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for block in text.split("\n\n"):
            block = block.strip("\n")
            if 80 <= len(block) <= 1500 and block.strip():
                seen.setdefault(block, None)
    return list(seen)


def write_source(path: Path, lines: int, texts: list[str]) -> int:
    """`lines` unique conversations: line i pairs paragraph a = i mod P with b, c chosen from (a, i div P)."""
    count = len(texts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for i in range(lines):
            a, k = i % count, i // count
            b = (a * 7 + k * 1009 + 1) % count
            c = (b * 13 + 5) % count
            fh.write(
                orjson.dumps(
                    {
                        "conversations": [
                            {"from": "human", "value": texts[a]},
                            {"from": "gpt", "value": f"{texts[b]}\n\n{texts[c]}"},
                        ]
                    }
                )
                + b"\n"
            )
    return path.stat().st_size


def data_params(num_samples: int) -> DataParams:
    return DataParams(
        num_samples=num_samples,
        shard_size=SHARD_SIZE,
        on_bad_record="skip",
        sources=(SourceSpec(name="scale", kind="jsonl", weight=1.0, eval=0, path=SOURCE),),
    )


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


# --- memory: run in a fresh process per mode -------------------------------------------------


def vm(field: str) -> str:
    """A line of /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile), e.g. '123456 kB'."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return next(line.split(":", 1)[1].strip() for line in lines if line.startswith(f"{field}:"))


def memory_child(tokens_dir: str, mode: str, batches: int) -> None:
    """Load the tokens (mapped, or flat as before), collate `batches` batches; print the peak RSS as JSON."""
    from dflashpipe.features.packing import collate
    from dflashpipe.tokens.shards import TokenData, TokenShard, load_tokens, read_shard
    from dflashpipe.train.data import BatchPlan

    before_load = vm("VmRSS")
    began = time.perf_counter()
    data = load_tokens(tokens_dir)
    if mode == "flat":  # what load_tokens did before: every shard read into one array at the stored dtypes
        ids, masks, lengths = [], [], []
        for i in range(len(data.shards)):
            batch, _ = read_shard(Path(tokens_dir) / f"train-{i:05d}.arrow")
            ids.append(np.array(batch.column("input_ids").values.to_numpy()))  # a copy, as parquet's read was
            masks.append(np.array(batch.column("loss_mask").values.to_numpy()))
            lengths.append(np.diff(batch.column("input_ids").offsets.to_numpy()))
        offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
        data = TokenData((TokenShard.of(np.concatenate(ids), np.concatenate(masks), offsets),))
        del ids, masks
    loaded = time.perf_counter() - began
    # Train's own path: the packing plan over every sequence (the 8-GPU profile's shapes: seq_len 2048,
    # 3 drafter replicas, micro_batch 1), then collate of its rows, step after step.
    plan = BatchPlan(data.lengths, 2048, 1, 3, 1, 0)
    began = time.perf_counter()
    tokens = 0
    for step in range(batches):
        for replica in range(3):
            batch = collate(data, plan.rows(step, 0, replica), 2048, 0)
            tokens += int(batch.attention_mask.sum())
    status = dict(
        line.split(":", 1)
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith(("Rss", "VmHWM"))
    )
    print(
        json.dumps(
            {
                "mode": mode,
                "before_load": before_load,
                "sequences": len(data),
                "tokens": int(data.lengths.sum()),
                "load_s": round(loaded, 2),
                "collate_s": round(time.perf_counter() - began, 2),
                "collated_tokens": tokens,
                "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                **{k: v.strip() for k, v in status.items()},
            }
        )
    )


def memory(tokens_dir: Path, mode: str, batches: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(tokens_dir), mode, str(batches)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the run ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--work", type=Path, default=Path("/tmp/dflashpipe-scale"))
    parser.add_argument("--skip-tokenize", action="store_true", help="manifest only")
    parser.add_argument(
        "--memory-only", action="store_true", help="only 4, on synthetic token shards of the 1.1M scale's sizes"
    )
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], args.memory_child[1], int(args.memory_child[2]))
        return
    lines, full, grown = (round(n * args.scale) for n in (LINES, FULL, GROWN))
    root = args.work
    root.mkdir(parents=True, exist_ok=True)
    if args.memory_only:
        tokens = root / "tokens-synthetic"
        if not (tokens / "files.json").is_file():
            seconds, count = timed(lambda: write_synthetic_tokens(tokens, grown))
            print(f"synthetic tokens: {count:,} tokens in {grown:,} sequences ({seconds:.0f} s)")
        report_memory(tokens, args.batches)
        return
    source = root / SOURCE
    with open(source, "rb") if source.is_file() else open("/dev/null", "rb") as fh:
        have = sum(1 for _ in fh)
    if have != lines:
        site = Path(np.__file__).resolve().parents[1]
        seconds, texts = timed(lambda: paragraphs(site))
        size = write_source(source, lines, texts)
        print(
            f"source: {lines:,} lines, {size / 1e9:.2f} GB, from {len(texts):,} paragraphs of {site} ({seconds:.0f}s)"
        )

    manifest = root / "manifest"
    full_s, grow_s = [], []
    for _ in range(args.repeats):
        shutil.rmtree(manifest, ignore_errors=True)
        seconds, _ = timed(lambda: build_manifest(data_params(full), manifest, root=root, key=KEY))
        full_s.append(seconds)
        seconds, _ = timed(lambda: build_manifest(data_params(grown), manifest, root=root, key=KEY))
        grow_s.append(seconds)
    shutil.rmtree(root / "manifest-fresh", ignore_errors=True)  # from nothing: what growth cost before
    fresh_s, _ = timed(lambda: build_manifest(data_params(grown), root / "manifest-fresh", root=root, key=KEY))
    same = all((manifest / p.name).read_bytes() == p.read_bytes() for p in sorted((root / "manifest-fresh").iterdir()))
    ratios = [g / f for g, f in zip(grow_s, full_s, strict=True)]
    print(f"manifest full build of {full:,}: {spread(full_s)} s")
    print(f"manifest growth {full:,} -> {grown:,}: {spread(grow_s)} s; ratio to the full build: {spread(ratios)}")
    print(
        f"  (before: growth rebuilt everything: a fresh {grown:,} build took {fresh_s:.2f} s, "
        f"{fresh_s / statistics.median(full_s):.2f}x; grown == fresh byte for byte: {same})"
    )
    if args.skip_tokenize:
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tokens import tokenizer_dir  # the benchmark's own way to the SmolLM2 tokenizer

    from dflashpipe.tokens.run import tokenize_manifest

    params = TokenizeParams(
        max_length=2048, truncation="turn", assistant_turns="all", min_supervised_tokens=16, num_proc=0
    )
    tok = tokenizer_dir(root)
    key = StageKey("tokenize", {"benchmark": "scale"})
    tokens = root / "tokens"
    shutil.rmtree(tokens, ignore_errors=True)
    shutil.rmtree(root / "manifest-small", ignore_errors=True)
    build_manifest(data_params(full), root / "manifest-small", root=root, key=KEY)
    first_s, first = timed(lambda: tokenize_manifest(params, root / "manifest-small", tok, tokens, key))
    again_s, again = timed(lambda: tokenize_manifest(params, manifest, tok, tokens, key))
    disk = sum(p.stat().st_size for p in tokens.iterdir())
    print(
        f"tokenize {full:,} samples: {first.summary['tokens']:,} tokens in {first_s:.0f} s = "
        f"{first.encoded_tokens / first_s:,.0f} tokens/s ({first.num_proc} processes)"
    )
    print(
        f"tokenize growth to {grown:,}: {again_s:.0f} s ({len(again.reused_shards)} shards reused, "
        f"{len(again.encoded_shards)} encoded: {again.encoded_tokens / again_s:,.0f} new tokens/s), "
        f"{again_s / first_s:.2f}x the first run; on disk {disk / 1e9:.2f} GB"
    )

    report_memory(tokens, args.batches)


def report_memory(tokens: Path, batches: int) -> None:
    for mode in ("mapped", "flat"):
        m = memory(tokens, mode, batches)
        print(
            f"memory, {mode}: peak RSS {m['VmHWM']} (VmHWM; {m['before_load']} after the imports; getrusage maxrss "
            f"{m['maxrss_mb']:,.0f} MB) for {m['tokens']:,} tokens in {m['sequences']:,} sequences "
            f"(load {m['load_s']} s, {batches} steps x 3 replicas {m['collate_s']} s; at the end "
            f"RssAnon {m['RssAnon']}, RssFile {m['RssFile']})"
        )


SYNTHETIC_MEAN_TOKENS = 323
"""355M tokens over 1.1M sequences: the real-text set's mean length, measured on the landed main."""


def write_synthetic_tokens(out: Path, sequences: int) -> int:
    """Token shards of `sequences` random sequences (lengths around the real set's mean, ids below
    SmolLM2's vocabulary), written by tokenize's own shard writer, summary and listing: what train reads,
    without hours of encoding."""
    from dflashpipe.core.artifacts import write_file_listing, write_json_atomic
    from dflashpipe.tokens.encode import EncodedRows, TokenStats
    from dflashpipe.tokens.shards import SUMMARY_FILE, shard_name, write_shard

    rng = np.random.default_rng(0)
    out.mkdir(parents=True, exist_ok=True)
    entries, total = [], 0
    for index in range(-(-sequences // SHARD_SIZE)):
        n = min(SHARD_SIZE, sequences - index * SHARD_SIZE)
        lengths = np.clip(rng.exponential(SYNTHETIC_MEAN_TOKENS, n).astype(np.int64), 16, 2048)
        ids = [rng.integers(0, 49152, int(k), dtype=np.int32) for k in lengths]
        masks = [(np.arange(int(k)) >= int(k) // 2).astype(np.uint8) for k in lengths]
        rows = EncodedRows([str(i) for i in range(n)], ["synthetic"] * n, [False] * n, lengths.tolist(), ids, masks)
        stats = TokenStats(samples_in=n, samples_out=n, tokens=int(lengths.sum()))
        stats.supervised_tokens = int(sum(int(m.sum()) for m in masks))
        write_shard(out / shard_name(f"train-{index:05d}"), rows, stats, None, {"file": "synthetic", "sha256": ""})
        entries.append({"file": shard_name(f"train-{index:05d}"), "samples": n})
        total += int(lengths.sum())
    write_json_atomic(out / SUMMARY_FILE, {"shards": entries})
    write_file_listing(out)
    return total


if __name__ == "__main__":
    main()

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
   so it is printed too but overstates small peaks.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
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

from dflashpipe.data.manifest import build_manifest  # noqa: E402
from dflashpipe.data.sources import read_source  # noqa: E402
from dflashpipe.params import DataParams, SourceSpec, TokenizeParams  # noqa: E402
from dflashpipe.pipeline import StageKey  # noqa: E402

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
    from dflashpipe.tokens.shards import TokenData, TokenShard, load_tokens, read_shard
    from dflashpipe.train.data import collate

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
    rng = np.random.default_rng(0)
    rows_api = list(inspect.signature(collate).parameters)[1] == "rows"  # packing: rows of sequences
    began = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        picked = [int(i) for i in rng.integers(0, len(data), size=8)]
        batch = collate(data, [[i] for i in picked] if rows_api else picked, 2048, 0)
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
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child[0], args.memory_child[1], int(args.memory_child[2]))
        return
    lines, full, grown = (round(n * args.scale) for n in (LINES, FULL, GROWN))
    root = args.work
    root.mkdir(parents=True, exist_ok=True)
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
    fresh_s, _ = timed(lambda: build_manifest(data_params(grown), root / "manifest-fresh", root=root, key=KEY))
    same = all((manifest / p.name).read_bytes() == p.read_bytes() for p in sorted((root / "manifest-fresh").iterdir()))
    ratios = [g / f for g, f in zip(grow_s, full_s, strict=True)]
    print(f"manifest full build of {full:,}: {spread(full_s)} s")
    print(f"manifest growth {full:,} -> {grown:,}: {spread(grow_s)} s; ratio to the full build: {spread(ratios)}")
    print(
        f"  (before: growth rebuilt everything: a fresh {grown:,} build took {fresh_s:.2f} s, "
        f"{fresh_s / statistics.median(full_s):.2f}x; grown == fresh byte for byte: {same})"
    )
    # What growth spends passing over the records the old build consumed: the jsonl reader parses each
    # one (it has no way to start at a line), where counting raw lines would do.
    spec = data_params(full).sources[0]
    parse_s, _ = timed(lambda: sum(1 for _ in itertools.islice(read_source(spec, root), full)))
    with open(source, "rb") as fh:
        raw_s, _ = timed(lambda: sum(1 for _ in itertools.islice((line for line in fh if line.strip()), full)))
    print(
        f"  of the growth, the reader passing over the {full:,} consumed records: {parse_s:.2f} s; as raw lines: "
        f"{raw_s:.2f} s: with a reader that can start at a record, growth would be about "
        f"{(statistics.median(grow_s) - parse_s + raw_s) / statistics.median(full_s):.2f}x"
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

    for mode in ("mapped", "flat"):
        m = memory(tokens, mode, args.batches)
        print(
            f"memory, {mode}: peak RSS {m['VmHWM']} (VmHWM; {m['before_load']} after the imports; getrusage maxrss "
            f"{m['maxrss_mb']:,.0f} MB) for {m['tokens']:,} tokens in {m['sequences']:,} sequences "
            f"(load {m['load_s']} s, {args.batches} batches {m['collate_s']} s; at the end "
            f"RssAnon {m['RssAnon']}, RssFile {m['RssFile']})"
        )


if __name__ == "__main__":
    main()

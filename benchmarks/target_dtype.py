"""The target's compute dtype on this machine: float32 against bfloat16, side by side in one process.

    python benchmarks/target_dtype.py [--data data] [--repeats 5] [--threads 1]

Loads data/target/ twice (the same stored weights, computed in each dtype) and times, in interleaved
repeats whose order alternates (a machine that gets busier slows both alike):
- features: one forward of 4 rows x 512 tokens through the drafter's layers (target.layers.target_layer_features,
  what the features stage and train's online worker run), on token ids of the eval prompts repeated;
- replies: a batch of 16 greedy replies of 32 tokens to the first 16 eval prompts (target.batching.greedy_replies,
  what regenerate runs), and how many of the 16 replies differ between the dtypes;
- step: one decode step at batch 1 after a prompt (Target.decode_step, evaluate's baseline step).
Prints per-repeat bfloat16 / float32 time ratios, their median and range, as JSON. Needs data/target and
data/manifest (`dvc repro manifest target`); read-only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DTYPES = ("float32", "bfloat16")


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def cases(target, prompts: list[list[int]], layer_ids: list[int], stop: list[int]) -> dict:
    """name -> a function that runs the case once on `target` (and returns what it made)."""
    import torch

    from dflashpipe.target.batching import greedy_replies
    from dflashpipe.target.hidden_states import target_layer_features

    stream = [t for p in prompts for t in p]
    stream = (stream * (2048 // len(stream) + 1))[:2048]
    rows = torch.tensor(stream).view(4, 512)
    mask = torch.ones_like(rows)
    first = prompts[0]
    cache = target.new_cache()
    with torch.no_grad():
        target.decode_step(torch.tensor([first[:-1]]), cache)
    last = torch.tensor([[first[-1]]])

    def features():
        with torch.no_grad():
            return target_layer_features(target.model, rows, mask, layer_ids)

    def replies():
        return [r.tokens for r in greedy_replies(target, prompts[:16], 32, stop)]

    def step():
        with torch.no_grad():
            logits = target.decode_step(last, cache)
        cache.crop(-1)  # back to the prompt less its last token, for the next repeat
        return logits

    return {"features": features, "replies": replies, "step": step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from dflashpipe.core.params import load_params
    from dflashpipe.evaluate.prompts import eval_prompts
    from dflashpipe.model.target_layers import spaced_target_layer_ids
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.chat import load_chat_tokenizer

    torch.set_num_threads(args.threads)
    p = load_params(ROOT)
    # in decoding form, as regenerate and evaluate load it (a features forward's thousands of rows take torch's
    # linear in it, as the features stage's does)
    targets = {d: Target.load(args.data / "target", "cpu", d, decoding=True) for d in DTYPES}
    chat = load_chat_tokenizer(args.data / "target")
    found, _ = eval_prompts(args.data / "manifest", chat, 16, 256)
    prompts = [list(e.prompt_ids) for e in found][:16]
    if len(prompts) < 16:
        raise SystemExit(f"{args.data / 'manifest'}: {len(prompts)} eval prompts of at most 256 tokens; need 16")
    layers = targets["float32"].config.num_hidden_layers
    layer_ids = spaced_target_layer_ids(layers, p["model"].target_layers or p["model"].layers)
    stop = targets["float32"].stop_token_ids(chat.tokenizer)
    runs = {d: cases(targets[d], prompts, layer_ids, stop) for d in DTYPES}
    seconds = {d: {c: [] for c in runs[d]} for d in DTYPES}
    made = {}
    for d in DTYPES:  # untimed: first-call costs (allocator, kernel selection) land in no measurement
        made[d] = {c: fn() for c, fn in runs[d].items()}
    for r in range(args.repeats):
        for case in runs["float32"]:
            for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                seconds[d][case].append(timed(runs[d][case]))
        done = {c: round(seconds["bfloat16"][c][-1] / seconds["float32"][c][-1], 3) for c in runs["float32"]}
        print(f"repeat {r + 1}: bf16/fp32 {done}", file=sys.stderr, flush=True)  # a killed run keeps these
    ratios = {
        c: [b / f for b, f in zip(seconds["bfloat16"][c], seconds["float32"][c], strict=True)]
        for c in seconds["float32"]
    }
    differing = sum(a != b for a, b in zip(made["float32"]["replies"], made["bfloat16"]["replies"], strict=True))
    result = {
        "threads": args.threads,
        "repeats": args.repeats,
        "layer_ids": layer_ids,
        "cpu_bf16_flags": [f for f in ("avx512_bf16", "amx_bf16") if f in Path("/proc/cpuinfo").read_text()],
        "seconds_median": {d: {c: statistics.median(s) for c, s in seconds[d].items()} for d in DTYPES},
        "bf16_over_fp32": {
            c: {"median": statistics.median(v), "min": min(v), "max": max(v), "each": v} for c, v in ratios.items()
        },
        "replies_differing_of_16": differing,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The lossless contract on a trained drafter, the target in a dtype of choice: each prompt's verdict.

    python benchmarks/lossless.py [--data data] [--dtype bfloat16] [--prompts 9] [--max-new-tokens 32]

Decodes the eval split's and the first training shard's prompts (`--prompts` per source each, as evaluate
picks them) plain and speculatively with evaluate's own functions, the target in `--dtype`, and prints the
contract's record (src/dflashpipe/evaluate/lossless.py): how many prompts match plain greedy decoding exactly,
and for each that does not, its first divergence: the position, both tokens, the plain path's top-2 margin, the
paths' difference there, the tolerance measured before it and the verdict (numerics or bug). float32 expects
every prompt exact; bfloat16 shows what the rule has to decide. Needs `dvc repro train` under `--data`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    from dflashpipe.evaluate.evaluation import decode_prompts
    from dflashpipe.evaluate.metrics import lossless_record
    from dflashpipe.evaluate.prompts import TRAIN, eval_prompts
    from dflashpipe.model import DFlashDrafter, TargetHead
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.chat import load_chat_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--prompts", type=int, default=9, help="per source, in each split")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    target = Target.load(args.data / "target", "cpu", args.dtype, decoding=True)
    chat = load_chat_tokenizer(args.data / "target")
    drafter = DFlashDrafter.from_pretrained(
        args.data / "drafter", TargetHead.of(target.model), dtype=target.dtype, attention="sdpa"
    ).eval()
    prompts = [
        p
        for split in ("held_out", TRAIN)
        for p in eval_prompts(args.data / "manifest", chat, args.prompts, 512, split)[0]
    ]
    results = decode_prompts(target, drafter, prompts, args.max_new_tokens, target.stop_token_ids(chat.tokenizer))
    record = lossless_record(results)
    contract = record["contract"]
    print(
        f"target {args.dtype}: {contract['prompts']} prompts, {contract['equal_to_plain']} equal to plain greedy, "
        f"{contract['exact']} exact, {contract['numerics']} numerics, {contract['bugs']} bugs: "
        f"lossless {record['lossless']}"
    )
    for entry in contract["departures"]:
        print(json.dumps(entry, sort_keys=True))


if __name__ == "__main__":
    main()

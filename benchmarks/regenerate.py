"""Regeneration's rate: the stage's decoding before and after continuous batching, against transformers'
`generate` and against this CPU's matmul rate, side by side in one process.

    python benchmarks/regenerate.py [--data data] [--prompts 8] [--max-new-tokens 64] [--rounds 2]

Prompts: the first `--prompts` training prompts of each source (rendered with the chat template, at most
1,024 tokens, the stage's default), sorted by length as the stage sorts them. Each round runs, in a
rotating order (a machine that gets busier slows each alike):
- `batches`: the stage before this change: batches of 16, each decoded until its longest reply ends (a
  finished row leaves, none joins), torch's linear layers;
- `continuous`: the stage now: 16 rows kept decoding, a finished row's place taken by the next prompt
  (target.batching.greedy_replies with batch_size), the linear layers in kernels.RowsFirstLinear's form;
- `generate`: transformers' `model.generate` on the same batches of 16, left-padded, greedy.
And a 2048 x 2048 float32 matmul, whose rate is the machine's in that round: each run's tokens/s x FLOPs a
token (2 x the weights of every linear layer, LM head included; attention over the context not counted)
is stated as a share of it, for the generated tokens alone (the stage's tokens/s) and for all the tokens
the run computed (prompts read in, plus generated). Last, untimed: each prompt decoded alone (batch_size
1), and how many replies of each run differ from it (ties flipped by batching and padding). Needs
data/target and data/manifest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

BATCH = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--prompts", type=int, default=8, help="per source")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch

    from dflashpipe.core.kernels import RowsFirstLinear
    from dflashpipe.core.spread import Spread
    from dflashpipe.core.threads import thread_budget
    from dflashpipe.evaluate.prompts import TRAIN, eval_prompts
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.batching import greedy_replies
    from dflashpipe.target.chat import load_chat_tokenizer

    thread_budget({"target": 1}).apply("target")
    target = Target.load(args.data / "target", "cpu", "auto")
    chat = load_chat_tokenizer(args.data / "target")
    found, _ = eval_prompts(args.data / "manifest", chat, args.prompts, 1024, TRAIN)
    prompts = sorted((list(e.prompt_ids) for e in found), key=len)
    stop = target.stop_token_ids(chat.tokenizer)
    linears = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    flops_a_token = 2 * sum(m.weight.numel() for m in linears)
    batches = [prompts[k : k + BATCH] for k in range(0, len(prompts), BATCH)]
    limit = args.max_new_tokens

    def form(cls) -> None:
        for m in linears:
            m.__class__ = cls

    def before():
        form(torch.nn.Linear)
        return [r.tokens for b in batches for r in greedy_replies(target, b, limit, stop)]

    def continuous():
        form(RowsFirstLinear)
        return [r.tokens for r in greedy_replies(target, prompts, limit, stop, batch_size=BATCH)]

    def generate():
        form(torch.nn.Linear)
        pad = chat.tokenizer.pad_token_id if chat.tokenizer.pad_token_id is not None else stop[0]
        out = []
        for b in batches:
            width = max(len(p) for p in b)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in b])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in b])
            with torch.no_grad():
                made = target.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=limit,
                    do_sample=False,
                    eos_token_id=stop,
                    pad_token_id=pad,
                )
            for row in made[:, width:].tolist():
                cut = next((i for i, t in enumerate(row) if t in stop or t == pad), len(row))
                out.append(tuple(row[:cut]))
        return out

    a = torch.randn(2048, 2048)

    def matmul_flops_per_s() -> float:
        a @ a
        began = time.perf_counter()
        for _ in range(5):
            a @ a
        return 5 * 2 * 2048**3 / (time.perf_counter() - began)

    runs = {"batches": before, "continuous": continuous, "generate": generate}
    rates = {name: [] for name in runs}
    shares = {name: [] for name in runs}
    work_shares = {name: [] for name in runs}
    prompt_tokens = sum(len(p) for p in prompts)
    replies = {}
    print(
        f"{len(prompts)} prompts of {len(prompts[0])}-{len(prompts[-1])} tokens ({prompt_tokens} in all), "
        f"{limit} new tokens at most, "
        f"{flops_a_token / 1e6:.0f} MFLOP a token",
        flush=True,
    )
    for round_ in range(args.rounds):
        order = list(runs)[round_ % 3 :] + list(runs)[: round_ % 3]
        peak = matmul_flops_per_s()
        for name in order:
            began = time.perf_counter()
            replies[name] = runs[name]()
            seconds = time.perf_counter() - began
            tokens = sum(len(r) + 1 for r in replies[name])  # a stop token is decoded work too
            rates[name].append(tokens / seconds)
            shares[name].append(tokens / seconds * flops_a_token / peak)
            work_shares[name].append((tokens + prompt_tokens) / seconds * flops_a_token / peak)
        print(
            f"round {round_ + 1}: matmul {peak / 1e9:.0f} GFLOPS; "
            + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in order),
            flush=True,
        )
    for name in runs:
        print(
            f"{name:10s} tokens/s {Spread.of(rates[name]).describe()}; share of the matmul rate "
            f"{Spread.of(shares[name]).describe()}, counting the prompts read {Spread.of(work_shares[name]).describe()}"
        )
    for name in ("batches", "generate"):
        ratio = [c / o for c, o in zip(rates["continuous"], rates[name], strict=True)]
        print(f"continuous / {name} (same round): {Spread.of(ratio).describe()}")
    form(RowsFirstLinear)
    alone = [greedy_replies(target, [p], limit, stop)[0].tokens for p in prompts]
    for name in runs:
        differ = sum(tuple(x) != tuple(y) for x, y in zip(replies[name], alone, strict=True))
        print(f"{name:10s} replies differing from each prompt decoded alone: {differ} of {len(prompts)}")


if __name__ == "__main__":
    main()

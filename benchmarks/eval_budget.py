"""How many held-out prompts evaluate needs: the 95% bootstrap interval of tau (the paper's count) at 2, 4 and 8
prompts per source, and what one prompt costs, on a trained drafter.

    python benchmarks/eval_budget.py [--data data] [--per-source 2,4,8] [--max-new-tokens 32] [--start 0]
                                     [--tau-only]

Decodes the first max(--per-source) usable held-out prompts of each source once, as evaluate does (one prefill,
target-only and speculative decoding, the device's decode dtype), then takes the first n per source of those
requests for each n: the interval a run of evaluate.num_prompts = n would report, its half-width relative to
tau (a 5% change is told from noise where two runs' intervals cannot overlap: half-width under 2.5%), and the
seconds per prompt (both decodings, after the warm-up). `--start K` skips each source's first K prompts (a
recorded evaluate run has their taus in metrics/eval/speedup_per_prompt.json); `--tau-only` decodes speculatively
alone (half the time; the seconds are then not evaluate's cost).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--per-source", default="2,4,8")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--tau-only", action="store_true")
    args = parser.parse_args()
    counts = sorted(int(n) for n in args.per_source.split(","))

    import torch

    from dflashpipe.core.kernels import rows_first
    from dflashpipe.core.threads import thread_budget
    from dflashpipe.evaluate.evaluation import Decoding
    from dflashpipe.evaluate.metrics import bootstrap_interval, tau_paper, tau_per_request, tau_pooled
    from dflashpipe.evaluate.prompts import eval_prompts
    from dflashpipe.evaluate.speculative import DFlashProposer, speculative_generate
    from dflashpipe.model import DFlashDrafter, TargetHead
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.target.prefill import prefill

    device = torch.device("cpu")
    thread_budget({"decode": 1}).apply("decode", device)
    target = Target.load(args.data / "target", device, "auto", decoding=True)
    chat = load_chat_tokenizer(args.data / "target")
    drafter = DFlashDrafter.from_pretrained(
        args.data / "drafter", TargetHead.of(target.model), dtype=target.dtype, attention="sdpa"
    ).eval()
    rows_first(drafter)
    found, _ = eval_prompts(args.data / "manifest", chat, counts[-1], 512)
    # round-robin over sources: a run cut short still holds the first k prompts of every source
    by_source = {s: [p for p in found if p.source == s] for s in sorted({p.source for p in found})}
    prompts = [q[k] for k in range(args.start, counts[-1]) for q in by_source.values() if k < len(q)]
    decoding = Decoding(target, DFlashProposer(drafter), args.max_new_tokens, target.stop_token_ids(chat.tokenizer))
    decoding.warm(prompts[0])
    results, seconds = [], []
    for prompt in prompts:
        began = time.perf_counter()
        if args.tau_only:
            start = prefill(target, prompt.prompt_ids, decoding.proposer.target_layer_ids)
            spec = speculative_generate(target, decoding.proposer, start, args.max_new_tokens, decoding.stop)
            results.append(types.SimpleNamespace(speculative=spec))
        else:
            results.append(decoding.decode(prompt))
        seconds.append(time.perf_counter() - began)
        spec = results[-1].speculative
        print(
            f"{prompt.source} {prompt.sample_id}: tau {spec.tau:.4f}, {sum(spec.produced)} tokens in "
            f"{len(spec.produced)} steps, {seconds[-1]:.1f} s",
            flush=True,
        )
    sources = sorted({p.source for p in prompts})
    print(f"\n{len(prompts)} prompts of {len(sources)} sources ({', '.join(sources)}), {args.max_new_tokens} tokens")
    print("per source | requests | tau | tau pooled | 95% interval | half-width / tau | s per prompt")
    for n in (c - args.start for c in counts if c > args.start):
        chosen = [i for s in sources for i in [j for j, p in enumerate(prompts) if p.source == s][:n]]
        spec = [results[i].speculative for i in chosen]
        tau, (low, high) = tau_paper(spec), bootstrap_interval(tau_per_request(spec))
        cost = sum(seconds[i] for i in chosen) / len(chosen)
        print(
            f"{n} | {len(chosen)} | {tau:.3f} | {tau_pooled(spec):.3f} | [{low:.3f}, {high:.3f}] | "
            f"{(high - low) / 2 / tau:.1%} | {cost:.1f}"
        )


if __name__ == "__main__":
    main()

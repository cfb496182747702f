"""The decoding loop's own overhead: time per verify step minus the drafter's and the target's
forwards, measured inside the same steps (device-synchronised), as a fraction of the step.

    python benchmarks/evaluate.py [--prompts 2] [--max-new-tokens 32]

Needs data/drafter (`dvc repro train`). Goal: overhead <= 10% of a step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    from dflashpipe.evaluate.evaluation import stop_token_ids
    from dflashpipe.evaluate.prompts import eval_prompts
    from dflashpipe.evaluate.speculative import DFlashProposer, prefill, speculative_generate
    from dflashpipe.model import DFlashDrafter, TargetHead
    from dflashpipe.pipeline import DRAFTER, MANIFEST, TARGET
    from dflashpipe.target import load_materialised_target
    from dflashpipe.tokens.chat import load_chat_tokenizer

    target = load_materialised_target(ROOT / TARGET, "cpu")
    chat = load_chat_tokenizer(ROOT / TARGET)
    drafter = DFlashDrafter.from_pretrained(ROOT / DRAFTER, TargetHead.of(target), attention="sdpa").eval()
    proposer = DFlashProposer(drafter)
    prompts, _ = eval_prompts(ROOT / MANIFEST, chat, args.prompts, 512)
    stop = stop_token_ids(target, chat.tokenizer)
    total = {"draft_s": 0.0, "verify_s": 0.0, "extend_s": 0.0, "step_s": 0.0}
    steps = 0
    for prompt in prompts:
        result = speculative_generate(
            target, proposer, prefill(target, prompt.prompt_ids), args.max_new_tokens, stop, profile=True
        )
        for k in total:
            total[k] += result.profile[k]
        steps += len(result.accepted)
    forwards = total["draft_s"] + total["verify_s"] + total["extend_s"]
    overhead = total["step_s"] - forwards
    print(f"{len(prompts)} prompts, {steps} verify steps, {total['step_s']:.2f} s in steps")
    print(
        f"per step: draft {total['draft_s'] / steps * 1e3:.1f} ms, verify {total['verify_s'] / steps * 1e3:.1f} ms, "
        f"extend {total['extend_s'] / steps * 1e3:.1f} ms, loop overhead {overhead / steps * 1e3:.2f} ms"
    )
    print(f"loop overhead / step: {overhead / total['step_s']:.1%} (goal <= 10%)")


if __name__ == "__main__":
    main()

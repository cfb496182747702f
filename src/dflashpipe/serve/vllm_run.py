"""The served side of the served check: runs in the serving environment's interpreter, never imported by dflashpipe.

    <serving python> vllm_run.py REQUEST.json RESULT.json
    <serving python> vllm_run.py --loop      (lines "REQUEST.json<TAB>RESULT.json" on stdin, each RESULT's path
                                              echoed on stdout when written: several checks, one vLLM import)

It imports vLLM and the standard library only (the serving environment has no dflashpipe and another transformers).
REQUEST names the target and drafter directories, the compute dtype, K (num_speculative_tokens), the prompts as
token ids, max_new_tokens, the stop token ids and how many top logprobs to keep. Two engines of vLLM's offline API
decode every prompt greedily, one prompt per call (so that every proposal belongs to one prompt and no batch
changes the numerics): speculative first, with method "dflash" named (vLLM infers it only from a path containing
"dflash") and K passed (vLLM never reads the drafter's block_size), so that a drafter vLLM cannot load fails before
the plain engine costs its start; then plain. RESULT holds, per prompt and engine, the tokens, each position's top
logprobs, and for the speculative engine every step's anchor and proposals as vLLM's DFlash proposer returned them,
and vLLM's own acceptance counters for that prompt. A failure is written as
{"error": {"while": ..., "type": ..., "message": ...}} and exits 3, so the caller can say it in one line. With
--loop (the served tests, which serve several drafters with one target) the process goes on after a failure, and a
request whose plain run an earlier one already made (the same target, prompts and settings) reuses it.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): that is what lets
the proposer's method be wrapped to record its proposals, and vLLM's metrics be read after each call.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

# before vLLM is imported: the engine core in this process, a KV cache sized for a check, not for serving
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_position",
}


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters now (cumulative since the engine started)."""
    found = {}
    for metric in llm.get_metrics():
        name = COUNTERS.get(metric.name)
        if name is not None:
            found[name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return found


def delta(after: dict, before: dict) -> dict:
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [int(a - b) for a, b in zip(value, old, strict=True)]
        else:
            out[name] = int(value - (old or 0))
    return out


def decoded(output, seconds: float) -> dict:
    completion = output.outputs[0]
    logprobs = [{str(token): float(lp.logprob) for token, lp in position.items()} for position in completion.logprobs]
    return {
        "tokens": list(completion.token_ids),
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "seconds": seconds,
    }


def engine(request: dict, speculative: bool):
    from vllm import LLM

    spec = None
    if speculative:
        spec = {"method": "dflash", "model": request["drafter"], "num_speculative_tokens": request["num_speculative"]}
    return LLM(
        model=request["target"],
        dtype=request["dtype"],
        max_model_len=request["max_model_len"],
        seed=0,
        enforce_eager=True,  # no compile at start-up: minutes on a CPU, for a check of a few prompts
        distributed_executor_backend="uni",
        disable_log_stats=False,  # the acceptance counters
        max_logprobs=request["logprobs"],
        speculative_config=spec,
    )


STEPS: list[list] = []
"""Every proposal vLLM's DFlash proposer returned since the last clear: [anchor, proposals] per step."""


def observe_proposals() -> None:
    """Wrap vLLM's DFlash proposer to record what it returns in STEPS (once per process)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    propose = DFlashProposer.propose
    if getattr(propose, "observed", False):
        return

    def observed(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        anchors = kwargs["next_token_ids"].tolist()
        STEPS.extend([int(a), [int(t) for t in row]] for a, row in zip(anchors, drafts.tolist(), strict=True))
        return drafts

    observed.observed = True
    DFlashProposer.propose = observed


def plain_key(request: dict) -> str:
    """What the plain engine's output depends on: the request without the drafter."""
    return json.dumps({k: v for k, v in request.items() if k != "drafter"}, sort_keys=True)


def run(request: dict, progress: dict, plain_runs: dict | None = None) -> dict:
    """`plain_runs`: the plain engine's runs of earlier requests in this process, by `plain_key`; a request with
    the same target, prompts and settings takes its plain run from there instead of starting that engine again."""
    from vllm import SamplingParams

    observe_proposals()
    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        stop_token_ids=request["stop_token_ids"],
        logprobs=request["logprobs"],
    )
    result = {
        "init_seconds": {},
        "speculative": [],
        "plain": [],
    }
    for kind in ("speculative", "plain"):
        if kind == "plain" and plain_runs is not None and plain_key(request) in plain_runs:
            result["plain"] = plain_runs[plain_key(request)]
            continue
        progress["while"] = f"loading the {kind} engine"
        began = time.perf_counter()
        llm = engine(request, kind == "speculative")
        result["init_seconds"][kind] = round(time.perf_counter() - began, 3)
        for ids in request["prompts"]:
            progress["while"] = f"decoding with the {kind} engine"
            STEPS.clear()
            before = counters(llm)
            began = time.perf_counter()
            (output,) = llm.generate({"prompt_token_ids": ids}, sampling, use_tqdm=False)
            record = decoded(output, time.perf_counter() - began)
            if kind == "speculative":
                record["steps"] = list(STEPS)
                record["counters"] = delta(counters(llm), before)
            result[kind].append(record)
        del llm
        gc.collect()
    if plain_runs is not None:
        plain_runs[plain_key(request)] = result["plain"]
    return result


def serve_request(request_path: str, result_path: str, plain_runs: dict | None = None) -> int:
    with open(request_path, encoding="utf-8") as fh:
        request = json.load(fh)
    code, progress = 0, {"while": "importing vLLM"}
    try:
        result = run(request, progress, plain_runs)
    except Exception as exc:  # noqa: BLE001 - any failure of the engine is the check's finding, told by the caller
        traceback.print_exc()
        result = {"error": {**progress, "type": type(exc).__name__, "message": str(exc)[:4000]}}
        code = 3
    tmp = f"{result_path}.partial"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    os.replace(tmp, result_path)
    return code


def loop() -> int:
    """Serve requests from stdin until it closes. The replies go to this process's stdout as it was started; vLLM's
    own output is sent to stderr, so that a reply line is never mixed with a log line."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    plain_runs: dict = {}
    for line in sys.stdin:
        request_path, result_path = line.rstrip("\n").split("\t")
        serve_request(request_path, result_path, plain_runs)
        print(result_path, file=replies, flush=True)
    return 0


if __name__ == "__main__":  # vLLM may start processes that import this file: the work runs only in the first
    sys.exit(loop() if sys.argv[1:] == ["--loop"] else serve_request(*sys.argv[1:3]))

"""The served check: a real engine serves the drafter on evaluate's prompts, and what it does is held against ours.

A drafter that looks good in training can accept nothing once served when the engine reads a config field
otherwise, or runs other torch or transformers builds. So after evaluate, vLLM (from the serving environment,
`bin/setup --serve`) serves the drafter as `dflashpipe export` hands it on (`serve.served_files`) with
the target, on the requests evaluate decoded (data/eval/prompts.json: their exact token ids, second turns with the
target's own first reply), and three comparisons are recorded:

1. **Acceptance**: vLLM's own counters, read around each request (one request a call), so per benchmark as well as
   over all: the served tau counted as evaluate counts its own, beside evaluate's on the same requests, and the
   acceptance per position. Requests of the training split are served for 2 and 3 only, as evaluate keeps them out
   of its rows.
2. **Lossless**: vLLM's speculative output against vLLM's plain greedy output, per prompt, under the contract of
   `evaluate.lossless` (a divergence's margins come from the top logprobs vLLM returns: at one position, a logprob
   margin is the logit margin).
3. **Proposals**: at every step vLLM drafted, our decoder's proposals from the same context, equal up to a tie
   of our logits (`serve.replay`).

metrics/serve.json holds what a sweep compares (`served`, `tau`, `acceptance_per_position`, `agreement`, and per
benchmark `tau` beside `ours`); metrics/detail/serve.json the rest, with each figure's definition. The check fails
(after writing both) when the contract is broken or fewer steps agree than `serve.min_proposal_agreement`. Without
a serving environment it records `served: not_run` and says how to set one up: never a pass.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashpipe.core.artifacts import verify_file_listing, write_json_atomic
from dflashpipe.core.errors import DflashpipeError, SourceError
from dflashpipe.core.params import ComputeParams, EvaluateParams, ServeParams
from dflashpipe.core.serving_env import PYTHON_ENV, SERVE_VENV, SETUP, engine_versions, serving_python
from dflashpipe.core.spread import Spread
from dflashpipe.evaluate import lossless
from dflashpipe.evaluate.prompts import HELD_OUT, TRAIN
from dflashpipe.evaluate.prompts_file import DecodedPrompt, read_prompts_file
from dflashpipe.evaluate.speculative import DFlashProposer
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.serve.engine import Engine, EngineError, EngineRequest, run_engine
from dflashpipe.serve.replay import EngineStep, replay
from dflashpipe.serve.served_files import write_served_files
from dflashpipe.target.adapter import Target
from dflashpipe.target.weights import model_directory

PASSED, FAILED, NOT_RUN = "passed", "failed", "not_run"

DEFINITIONS = {
    "tau": "on the held-out requests (as metrics/eval.json's tau; each benchmark's in its row): per request, "
    "1 + accepted / drafts of vLLM's counters (a draft is one verify step: the proposals it "
    "accepted and the token the target adds), then the mean over the requests that drafted: evaluate's count, "
    "except that vLLM counts proposals accepted past a stop token or max_new_tokens, which evaluate does not commit "
    "(a benchmark of replies a few drafts long reads higher served)",
    "tau_pooled": "1 + all accepted / all drafts of the requests: vLLM's own mean acceptance length",
    "acceptance_per_position": "on the held-out requests: the drafts whose proposal at that position was accepted / "
    "all drafts",
    "ours": "metrics/eval.json benchmarks.<name>.tau: evaluate's tau on the same requests",
    "agreement": "the verified draft steps (all requests) at which our proposals equal vLLM's, up to a tie",
}


class ServedCheckError(DflashpipeError):
    """The engine served the drafter otherwise than our decoder runs it, or could not serve it."""


@dataclass(frozen=True)
class ServeInputs:
    serve: ServeParams
    evaluate: EvaluateParams
    """How many new tokens, how many proposals a step verifies: evaluate's, so the two compare."""
    compute: ComputeParams


@dataclass(frozen=True)
class Served:
    """What the check writes: `metrics` (metrics/serve.json, what a sweep compares) and `detail`
    (metrics/detail/serve.json, the rest)."""

    metrics: dict
    detail: dict


def sparse_rows(positions: list[dict[str, float]], vocab: int) -> list[torch.Tensor]:
    """Each position's top logprobs as a row [vocab]; a token outside them reads as the row's lowest kept value
    (an upper bound on it), so a margin against it is a lower bound."""
    rows = []
    for kept in positions:
        row = torch.full((vocab,), min(kept.values()), dtype=torch.float32)
        row[torch.tensor([int(t) for t in kept])] = torch.tensor(list(kept.values()), dtype=torch.float32)
        rows.append(row)
    return rows


def acceptance(counters: list[dict], k: int) -> dict:
    """vLLM's figures over `counters`, one request's each (DEFINITIONS)."""
    drafted = [c for c in counters if c["drafts"]]
    drafts, accepted = sum(c["drafts"] for c in counters), sum(c["accepted"] for c in counters)
    per_position = [sum(c["accepted_per_position"][i] for c in counters) for i in range(k)]
    return {
        "requests": len(counters),
        "drafts": drafts,
        "accepted": accepted,
        "tau": round(sum(1 + c["accepted"] / c["drafts"] for c in drafted) / len(drafted), 4) if drafted else None,
        "tau_pooled": round(1 + accepted / drafts, 4) if drafts else None,
        "acceptance_per_position": {
            str(i + 1): round(n / drafts, 4) if drafts else 0.0 for i, n in enumerate(per_position)
        },
    }


def by_benchmark(prompts: list[DecodedPrompt], counters: list[dict], k: int) -> dict[str, dict]:
    """`acceptance` per benchmark, in the order the benchmarks first appear."""
    groups: dict[str, list[dict]] = {}
    for prompt, c in zip(prompts, counters, strict=True):
        groups.setdefault(prompt.benchmark, []).append(c)
    return {name: acceptance(group, k) for name, group in groups.items()}


def rates(runs: list[dict]) -> Spread:
    """New tokens per second of each prompt's call (prefill included: the engine times no part apart)."""
    return Spread.of([len(r["tokens"]) / r["seconds"] for r in runs if r["seconds"] > 0] or [0.0])


def ours(evaluation: dict, benchmark: str) -> float | None:
    """evaluate's tau on `benchmark`'s requests (metrics/eval.json, contract: `benchmarks.<name>.tau`)."""
    row = (evaluation.get("benchmarks") or {}).get(benchmark)
    return row.get("tau") if isinstance(row, dict) else None


def compare(
    prompts: list[DecodedPrompt],
    result: dict,
    target: Target,
    proposer: DFlashProposer,
    vocab: int,
) -> dict:
    """The lossless contract and the proposals (the module docstring's 2 and 3), over every prompt."""
    departures, steps, equal, mismatches = [], 0, 0, []
    for prompt, plain, spec in zip(prompts, result["plain"], result["speculative"], strict=True):
        where = {"id": prompt.id, "benchmark": prompt.benchmark, "turn": prompt.turn}
        divergence = lossless.judge(
            plain["tokens"],
            sparse_rows(plain["logprobs"], vocab),
            spec["tokens"],
            sparse_rows(spec["logprobs"], vocab),
            target.dtype,
        )
        if divergence is not None:
            departures.append({**where, "split": prompt.split, **divergence.to_json()})
        engine_steps = [EngineStep(anchor, tuple(p)) for anchor, p in spec["steps"]]
        compared = replay(target, proposer, prompt.prompt_ids, spec["tokens"], engine_steps)
        steps, equal = steps + len(compared.equal), equal + sum(compared.equal)
        mismatches += [{**where, **m} for m in compared.mismatches]
    return {
        "lossless": not any(d["verdict"] == lossless.BUG for d in departures),
        "contract": {
            "prompts": len(prompts),
            "equal_to_plain": len(prompts) - len(departures),
            "numerics": sum(d["verdict"] == lossless.NUMERICS for d in departures),
            "bugs": sum(d["verdict"] == lossless.BUG for d in departures),
            "departures": departures,
        },
        "proposals": {
            "steps": steps,
            "equal": equal,
            "agreement": round(equal / steps, 4) if steps else None,
            "ties": sum(m["tie"] for m in mismatches),  # steps that differ only where our logits tie (replay.TIE)
            # the first few, real differences first: enough to see which slots and tokens differ, and by how much
            "mismatches": sorted(mismatches, key=lambda m: m["tie"])[:5],
        },
    }


def verdict(detail: dict, serve: ServeParams) -> list[str]:
    """What failed the check, one line each (none: it passed)."""
    failures = []
    contract, proposals = detail["contract"], detail["proposals"]
    for d in contract["departures"]:
        if d["verdict"] == lossless.BUG:
            failures.append(
                f"prompt {d['id']} ({d['benchmark']}, turn {d['turn']}): vLLM's speculative output left its plain "
                f"greedy output at position {d['position']} (token {d['speculative_token']} instead of "
                f"{d['plain_token']}, plain margin {d['margin']})"
            )
    agreement = proposals["agreement"]
    if agreement is None:
        failures.append("vLLM drafted no step that was verified: nothing to compare its proposals with")
    elif agreement < serve.min_proposal_agreement:
        first = proposals["mismatches"][0]
        failures.append(
            f"vLLM's proposals equal ours (up to a tie) on {proposals['equal']} of {proposals['steps']} steps "
            f"({agreement:.1%} < serve.min_proposal_agreement {serve.min_proposal_agreement:.0%}); first at prompt "
            f"{first['id']} position {first['position']}: vLLM {first['engine']}, ours {first['ours']}, our logits "
            f"{first['gap']} apart: the engine reads the "
            f"drafter otherwise (config.json: dflash_config.target_layer_ids, mask_token_id, block size)"
        )
    return failures


def served_record(prompts: list[DecodedPrompt], result: dict, compared: dict, evaluation: dict, k: int) -> Served:
    """The two files' contents of a check that served: acceptance on the held-out requests (what metrics/eval.json's
    `tau` covers, so the two headlines compare), and per benchmark beside evaluate's tau."""
    measured = [(p, s["counters"]) for p, s in zip(prompts, result["speculative"], strict=True) if p.split != TRAIN]
    overall = acceptance([c for p, c in measured if p.split == HELD_OUT], k)
    rows = by_benchmark([p for p, _ in measured], [c for _, c in measured], k)
    metrics = {
        "served": PASSED,
        "tau": overall["tau"],
        "acceptance_per_position": overall["acceptance_per_position"],
        "agreement": compared["proposals"]["agreement"],
        "benchmarks": {name: {"tau": row["tau"], "ours": ours(evaluation, name)} for name, row in rows.items()},
    }
    spec_rates, plain_rates = rates(result["speculative"]), rates(result["plain"])
    detail = {
        "served": PASSED,
        "reason": None,
        "definitions": DEFINITIONS,
        "held_out": {key: overall[key] for key in ("requests", "drafts", "accepted", "tau_pooled")},
        "benchmarks": {
            name: {key: value for key, value in row.items() if key not in metrics["benchmarks"][name]}
            for name, row in rows.items()
        },
        **compared,
        "tokens_per_s": {**plain_rates.record("plain"), **spec_rates.record("speculative")},
    }
    return Served(metrics, detail)


def write_served(served: Served, out: Path | str, detail_out: Path | str) -> Served:
    write_json_atomic(detail_out, served.detail)
    write_json_atomic(out, served.metrics)
    return served


def served_check(
    inputs: ServeInputs,
    drafter_dir: Path | str,
    target_dir: Path | str,
    prompts_file: Path | str,
    evaluation: dict,
    out: Path | str,
    detail_out: Path | str,
    root: Path | str = ".",
    served_dir: Path | str | None = None,
    engine: Engine | None = None,
) -> Served:
    """Write metrics/serve.json (`out`) and metrics/detail/serve.json (`detail_out`) and return them; raise
    ServedCheckError when the check failed.

    `prompts_file`: data/eval/prompts.json. `evaluation`: metrics/eval.json. `served_dir`: what the engine serves
    instead of `drafter_dir`'s served files (a test plants a config fault there); our decoder always runs
    `drafter_dir`. `engine`: a process of the serving environment's interpreter for this check, unless given one
    (the tests share an `EngineWorker`)."""
    from dflashpipe.target.chat import load_chat_tokenizer

    prompts = read_prompts_file(prompts_file)
    python = serving_python(root)
    if python is None:
        reason = f"no serving environment ({SERVE_VENV}/ or ${PYTHON_ENV}): set one up with `{SETUP}`"
        print(f"serve: not run: {reason}", flush=True)
        return write_served(
            Served({"served": NOT_RUN}, {"served": NOT_RUN, "reason": reason, "engine": None}), out, detail_out
        )
    drafter_dir, p = Path(drafter_dir), inputs.evaluate
    fix = f"restore it with `dvc checkout {drafter_dir}` or retrain with `dvc repro -f train`"
    verify_file_listing(drafter_dir, fix, SourceError)
    target = Target.load(target_dir, "cpu", inputs.compute.target_dtype, decoding=True)
    drafter = DFlashDrafter.from_pretrained(
        drafter_dir, TargetHead.of(target.model), dtype=target.dtype, attention="sdpa"
    ).eval()
    k = p.draft_tokens or drafter.config.block_size - 1
    dtype = str(target.dtype).removeprefix("torch.")
    versions = engine_versions(python)
    setup = {"method": "dflash", "num_speculative_tokens": k, "dtype": dtype, "max_new_tokens": p.max_new_tokens}
    with tempfile.TemporaryDirectory(prefix="dflashpipe-serve-") as scratch:
        served = Path(served_dir) if served_dir is not None else Path(scratch) / "drafter"
        if served_dir is None:
            served.mkdir()
            write_served_files(drafter_dir, target_dir, served)
        request = EngineRequest(
            model_directory(target_dir),
            served.resolve(),
            dtype,
            k,
            [list(prompt.prompt_ids) for prompt in prompts],
            p.max_new_tokens,
            target.stop_token_ids(load_chat_tokenizer(target_dir).tokenizer),
        )
        try:
            serve = engine or functools.partial(run_engine, python)
            result = serve(request, Path(scratch) / "engine", _read_config(served))
        except EngineError as exc:
            detail = {"served": FAILED, "reason": str(exc), "engine": versions, "setup": setup}
            write_served(Served({"served": FAILED}, detail), out, detail_out)
            raise ServedCheckError(str(exc)) from None
    compared = compare(prompts, result, target, DFlashProposer(drafter), target.model.config.vocab_size)
    record = served_record(prompts, result, compared, evaluation, k)
    record.detail.update(
        engine=versions, setup={**setup, "prompts": len(prompts), "engine_start_s": result["init_seconds"]}
    )
    failures = verdict(record.detail, inputs.serve)
    if failures:
        record.metrics["served"] = record.detail["served"] = FAILED
        record.detail["reason"] = failures[0]
    write_served(record, out, detail_out)
    m = record.metrics
    print(
        f"serve: vLLM {versions.get('vllm')} served tau {m['tau']}, lossless {compared['contract']['equal_to_plain']}"
        f"/{len(prompts)} equal to plain greedy, proposals {compared['proposals']['equal']}/"
        f"{compared['proposals']['steps']} steps equal to ours: {m['served']}",
        flush=True,
    )
    for name, row in m["benchmarks"].items():
        print(f"serve:   {name}: vLLM tau {row['tau']}, ours {row['ours']}", flush=True)
    if failures:
        raise ServedCheckError(f"the served check failed ({Path(detail_out).as_posix()}):\n  " + "\n  ".join(failures))
    return record


def _read_config(drafter: Path) -> dict:
    try:
        return json.loads((drafter / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}

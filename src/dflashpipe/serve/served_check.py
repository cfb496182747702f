"""The served check: a real engine serves the drafter on evaluate's prompts, and what it does is held against ours.

A drafter that looks good in training can accept nothing once served when the engine reads a config field
otherwise, or runs other torch or transformers builds. So after evaluate, vLLM (from the serving environment,
`bin/setup --serve`) serves the drafter as `dflashpipe export` hands it on (`serve.served_files`) with
the target, on the prompts evaluate decoded, and metrics/serve.json records three comparisons:

1. **Acceptance**: vLLM's own counters (mean acceptance length, the served tau, and the acceptance per position)
   beside evaluate's tau and slot acceptance on the held-out prompts.
2. **Lossless**: vLLM's speculative output against vLLM's plain greedy output, per prompt, under the contract of
   `evaluate.lossless` (a divergence's margins come from the top logprobs vLLM returns: at one position, a logprob
   margin is the logit margin).
3. **Proposals**: at every step vLLM drafted, our decoder's proposals from the same context, equal up to a tie
   of our logits (`serve.replay`).

It fails (after writing the metrics) when the contract is broken or fewer steps agree than
`serve.min_proposal_agreement`. Without a serving environment it records `served: not_run` and says how to set
one up: never a pass.
"""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflashpipe.core.artifacts import verify_file_listing, write_json_atomic
from dflashpipe.core.errors import DflashpipeError, SourceError
from dflashpipe.core.params import ComputeParams, EvaluateParams, ServeParams
from dflashpipe.core.serving_env import PYTHON_ENV, SERVE_VENV, SETUP, engine_versions, serving_python
from dflashpipe.core.spread import Spread
from dflashpipe.evaluate import lossless
from dflashpipe.evaluate.prompts import HELD_OUT, TRAIN, EvalPrompt, eval_prompts
from dflashpipe.evaluate.speculative import DFlashProposer
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.serve.engine import Engine, EngineError, EngineRequest, run_engine
from dflashpipe.serve.replay import EngineStep, replay
from dflashpipe.serve.served_files import write_served_files
from dflashpipe.target.adapter import Target
from dflashpipe.target.weights import model_directory

PASSED, FAILED, NOT_RUN = "passed", "failed", "not_run"


class ServedCheckError(DflashpipeError):
    """The engine served the drafter otherwise than our decoder runs it, or could not serve it."""


@dataclass(frozen=True)
class ServeInputs:
    serve: ServeParams
    evaluate: EvaluateParams
    """Which prompts, how many new tokens, how many proposals a step verifies: evaluate's, so the two compare."""
    compute: ComputeParams
    template_kwargs: dict = field(default_factory=dict)
    """target.chat_template_kwargs: evaluate's prompts are rendered with them, and vLLM is sent their token ids."""


def not_run(reason: str) -> dict:
    """The record of a check that did not run: no figure, so nothing reads as a pass."""
    return {"served": NOT_RUN, "reason": reason, "engine": None}


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
    """vLLM's mean acceptance length (1 + accepted / drafts: its served tau) and per-position acceptance."""
    drafts = sum(c["drafts"] for c in counters)
    per_position = [sum(c["accepted_per_position"][i] for c in counters) for i in range(k)]
    return {
        "drafts": drafts,
        "accepted": sum(c["accepted"] for c in counters),
        "tau": round(1 + sum(c["accepted"] for c in counters) / drafts, 4) if drafts else None,
        "slot_acceptance": {str(i + 1): round(n / drafts, 4) if drafts else 0.0 for i, n in enumerate(per_position)},
    }


def rates(runs: list[dict]) -> Spread:
    """New tokens per second of each prompt's call (prefill included: the engine times no part apart)."""
    return Spread.of([len(r["tokens"]) / r["seconds"] for r in runs if r["seconds"] > 0] or [0.0])


def read_evaluate(metrics: dict) -> dict:
    """evaluate's figures on the same held-out prompts, beside the served ones."""
    return {"tau": metrics.get("tau"), "slot_acceptance": metrics.get("slot_acceptance")}


def compare(
    prompts: list[EvalPrompt],
    result: dict,
    target: Target,
    proposer: DFlashProposer,
    vocab: int,
    k: int,
) -> dict:
    """The three comparisons of the module docstring, over every prompt (acceptance: held-out ones only)."""
    departures, steps, equal, mismatches = [], 0, 0, []
    for prompt, plain, spec in zip(prompts, result["plain"], result["speculative"], strict=True):
        divergence = lossless.judge(
            plain["tokens"],
            sparse_rows(plain["logprobs"], vocab),
            spec["tokens"],
            sparse_rows(spec["logprobs"], vocab),
            target.dtype,
        )
        if divergence is not None:
            departures.append(
                {"id": prompt.sample_id, "split": prompt.split, "source": prompt.source, **divergence.to_json()}
            )
        engine_steps = [EngineStep(anchor, tuple(p)) for anchor, p in spec["steps"]]
        compared = replay(target, proposer, prompt.prompt_ids, spec["tokens"], engine_steps)
        steps, equal = steps + len(compared.equal), equal + sum(compared.equal)
        mismatches += [{"id": prompt.sample_id, **m} for m in compared.mismatches]
    held_out = [s["counters"] for p, s in zip(prompts, result["speculative"], strict=True) if p.split == HELD_OUT]
    return {
        **acceptance(held_out, k),
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


def verdict(record: dict, serve: ServeParams) -> list[str]:
    """What failed the check, one line each (none: it passed)."""
    failures = []
    contract, proposals = record["contract"], record["proposals"]
    for d in contract["departures"]:
        if d["verdict"] == lossless.BUG:
            failures.append(
                f"prompt {d['id']} ({d['split']}): vLLM's speculative output left its plain greedy output at "
                f"position {d['position']} (token {d['speculative_token']} instead of {d['plain_token']}, plain "
                f"margin {d['margin']})"
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


def served_check(
    inputs: ServeInputs,
    drafter_dir: Path | str,
    target_dir: Path | str,
    manifest_dir: Path | str,
    evaluation: dict,
    out: Path | str,
    root: Path | str = ".",
    served_dir: Path | str | None = None,
    engine: Engine | None = None,
) -> dict:
    """Write metrics/serve.json (`out`) and return it; raise ServedCheckError when the check failed.

    `evaluation`: metrics/eval.json. `served_dir`: what the engine serves instead of `drafter_dir`'s served files
    (a test plants a config fault there); our decoder always runs `drafter_dir`. `engine`: a process of the
    serving environment's interpreter for this check, unless given one (the tests share an `EngineWorker`)."""
    from dflashpipe.target.chat import load_chat_tokenizer

    chat = load_chat_tokenizer(target_dir, inputs.template_kwargs)
    python = serving_python(root)
    if python is None:
        reason = f"no serving environment ({SERVE_VENV}/ or ${PYTHON_ENV}): set one up with `{SETUP}`"
        write_json_atomic(out, not_run(reason))
        print(f"serve: not run: {reason}", flush=True)
        return not_run(reason)
    drafter_dir, p = Path(drafter_dir), inputs.evaluate
    fix = f"restore it with `dvc checkout {drafter_dir}` or retrain with `dvc repro -f train`"
    verify_file_listing(drafter_dir, fix, SourceError)
    prompts = [
        prompt
        for split in (HELD_OUT, TRAIN)
        for prompt in eval_prompts(manifest_dir, chat, p.num_prompts, p.max_prompt_tokens, split)[0]
    ]
    target = Target.load(target_dir, "cpu", inputs.compute.target_dtype, decoding=True, kind="decode")
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
            target.stop_token_ids(chat.tokenizer),
        )
        try:
            serve = engine or functools.partial(run_engine, python)
            result = serve(request, Path(scratch) / "engine", _read_config(served))
        except EngineError as exc:
            record = {"served": FAILED, "reason": str(exc), "engine": versions, "setup": setup}
            write_json_atomic(out, record)
            raise ServedCheckError(str(exc)) from None
    compared = compare(prompts, result, target, DFlashProposer(drafter), target.model.config.vocab_size, k)
    spec_rates, plain_rates = rates(result["speculative"]), rates(result["plain"])
    record = {
        "served": PASSED,
        "reason": None,
        "engine": versions,
        "setup": {**setup, "prompts": len(prompts), "engine_start_s": result["init_seconds"]},
        **compared,
        "evaluate": read_evaluate(evaluation),
        "tokens_per_s": {**plain_rates.record("plain"), **spec_rates.record("speculative")},
    }
    theirs, ours = record["tau"], record["evaluate"]["tau"]
    record["tau_gap"] = round(theirs - ours, 4) if isinstance(theirs, float) and isinstance(ours, float) else None
    failures = verdict(record, inputs.serve)
    if failures:
        record["served"], record["reason"] = FAILED, failures[0]
    write_json_atomic(out, record)
    print(
        f"serve: vLLM {versions.get('vllm')} served tau {theirs} (evaluate {ours}), lossless "
        f"{compared['contract']['equal_to_plain']}/{len(prompts)} equal to plain greedy, proposals "
        f"{compared['proposals']['equal']}/{compared['proposals']['steps']} steps equal to ours: {record['served']}",
        flush=True,
    )
    if failures:
        raise ServedCheckError("the served check failed (metrics/serve.json):\n  " + "\n  ".join(failures))
    return record


def _read_config(drafter: Path) -> dict:
    try:
        return json.loads((drafter / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}

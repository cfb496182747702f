"""The whole evaluate stage: decode the eval prompts both ways, time a training step, compare a baseline."""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashpipe.artifacts import PARTIAL, verify_file_listing, write_json_atomic
from dflashpipe.errors import SourceError
from dflashpipe.evaluate import regression
from dflashpipe.evaluate.metrics import PromptResult, eval_metrics, write_plot_tables
from dflashpipe.evaluate.prompts import EvalPrompt, eval_prompts
from dflashpipe.evaluate.speculative import DFlashProposer, prefill, speculative_generate, target_generate
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.params import CompileParams, EvaluateParams, ModelParams
from dflashpipe.pipeline import StageKey

TRAIN_STEP_REPEATS = 3
"""Timed training steps after one untimed one; the median is reported."""


@dataclass(frozen=True)
class EvaluateInputs:
    evaluate: EvaluateParams
    model: ModelParams
    compile: CompileParams


def stop_token_ids(target, tokenizer) -> list[int]:
    """End of turn: the generation config's eos ids and the tokenizer's eos token."""
    ids = target.generation_config.eos_token_id if target.generation_config is not None else None
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return sorted({i for i in [*ids, tokenizer.eos_token_id] if i is not None})


def decode_prompts(
    target, drafter: DFlashDrafter, prompts: list[EvalPrompt], max_new_tokens: int, stop: list[int]
) -> list[PromptResult]:
    """Each prompt: one prefill, then target-only greedy and speculative decoding from copies of it."""
    proposer = DFlashProposer(drafter)
    if prompts:  # one untimed run, so that first-call costs (allocator, kernels) land in no measurement
        warm = prefill(target, prompts[0].prompt_ids)
        target_generate(target, warm.fork(), min(max_new_tokens, 8), stop)
        speculative_generate(target, proposer, warm, min(max_new_tokens, 8), stop)
    results = []
    for prompt in prompts:
        start = prefill(target, prompt.prompt_ids)
        baseline = target_generate(target, start.fork(), max_new_tokens, stop)
        results.append(
            PromptResult(prompt, baseline, speculative_generate(target, proposer, start, max_new_tokens, stop))
        )
    return results


def measure_train_step(
    drafter_dir: Path,
    target,
    model: ModelParams,
    compile: CompileParams,
    compile_dir: Path,
    scratch: Path,
    compile_key: StageKey | None,
) -> dict:
    """One drafter training step (forward + backward) timed on its own: no target forward, no data
    loading, no threads, so only the drafter's kernels are in the figure. It runs the path train runs:
    compiled from the warmup artifact (copied into `scratch`) when compile.enabled and the artifact was
    built for `compile_key` (warmup's stage key now), compiled cold when not (compile_source says why),
    eager when compile.enabled is false."""
    from dflashpipe.compile.artifact import load_artifact_or_go_cold
    from dflashpipe.compile.guard import dynamo_counters
    from dflashpipe.compile.warmup import compiled_step, run_step_once

    device = target.device
    # float32 master weights, as train steps them (bf16 on disk loads exactly)
    drafter = DFlashDrafter.from_pretrained(
        drafter_dir, TargetHead.of(target), dtype=torch.float32, attention=model.attention, gamma=model.gamma
    )
    drafter.train()
    step_fn, source = drafter, "eager: compile.enabled is false"
    if compile.enabled:
        source = load_artifact_or_go_cold(compile_dir, scratch, compile_key)
        step_fn = compiled_step(drafter)
    run_step_once(step_fn, drafter, model, compile.micro_batch, device)  # the compile (or cache load) is here
    warm = dynamo_counters()
    runs = [run_step_once(step_fn, drafter, model, compile.micro_batch, device) for _ in range(TRAIN_STEP_REPEATS)]
    seconds = statistics.median(r["seconds"] for r in runs)
    positions = compile.micro_batch * model.seq_len
    return {
        "what": f"{'compiled' if compile.enabled else 'eager'} drafter forward+backward, {runs[0]['backend']} "
        f"attention, median of {TRAIN_STEP_REPEATS} after 1 warm step; tokens = micro_batch x seq_len positions",
        "compiled": compile.enabled,
        "compile_source": source,
        "graphs_compiled_while_timed": dynamo_counters()["unique_graphs"] - warm["unique_graphs"],
        "device": device.type,
        "shapes": runs[0]["shapes"],
        "seconds": round(seconds, 4),
        "tokens_per_s": round(positions / seconds, 2) if seconds > 0 else 0.0,
    }


def read_train_metrics(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return {"tokens_per_s": raw["tokens_per_s"], "compile": raw["compile"]}
    except FileNotFoundError:
        raise SourceError(f"{path} not found: run `dvc repro train` first") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"{path}: not the train stage's metrics ({exc}): run `dvc repro train`") from None


def verify_drafter(drafter_dir: Path | str) -> None:
    """Check every file of the drafter against its files.json before anything loads it; raise SourceError otherwise."""
    drafter_dir = Path(drafter_dir)
    verify_file_listing(
        drafter_dir, f"restore it with `dvc checkout {drafter_dir}` or retrain with `dvc repro -f train`", SourceError
    )


def evaluate_drafter(
    inputs: EvaluateInputs,
    drafter_dir: Path | str,
    target_dir: Path | str,
    manifest_dir: Path | str,
    train_metrics: Path | str,
    compile_dir: Path | str,
    metrics_dir: Path | str,
    root: Path | str = ".",
    device: str | None = None,
    *,
    compile_key: StageKey | None = None,
) -> dict:
    """Write metrics/eval.json, metrics/eval_regression.json and the plot tables; return the eval metrics.

    `compile_key` is warmup's stage key now (pipeline.stage_key("warmup")): the timed train step uses
    the artifact in `compile_dir` only if it was built for it. Without one the step compiles cold (in
    its untimed first call, so the figure holds) and eval.json's train_step.compile_source says why."""
    from dflashpipe.target import load_materialised_target
    from dflashpipe.tokens.chat import load_chat_tokenizer

    p = inputs.evaluate
    drafter_dir, metrics_dir = Path(drafter_dir), Path(metrics_dir)
    verify_drafter(drafter_dir)
    train = read_train_metrics(Path(train_metrics))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    target = load_materialised_target(target_dir, device)
    chat = load_chat_tokenizer(target_dir)
    # sdpa for decoding: every step has a new context length, which a compiled flex kernel would recompile for.
    # Drafts in the target's dtype, as engines serve it: bf16 on CUDA; on the CPU the bf16 weights in float32.
    target_dtype = next(target.parameters()).dtype
    drafter = DFlashDrafter.from_pretrained(
        drafter_dir, TargetHead.of(target), dtype=target_dtype, attention="sdpa"
    ).eval()
    prompts, skipped = eval_prompts(manifest_dir, chat, p.num_prompts, p.max_prompt_tokens)
    if not prompts:
        raise SourceError(
            f"{Path(manifest_dir) / 'eval.parquet'}: no usable eval prompt (skipped: {skipped}); "
            f"raise evaluate.max_prompt_tokens or give the sources an eval count (data.sources[*].eval)"
        )
    results = decode_prompts(target, drafter, prompts, p.max_new_tokens, stop_token_ids(target, chat.tokenizer))
    decoding, tables = eval_metrics(results, drafter.config.block_size)
    metrics_dir.mkdir(parents=True, exist_ok=True)
    # a partial sibling of eval.json: if this run is killed, the next one's write of eval.json removes it
    with tempfile.TemporaryDirectory(prefix=f".eval.json{PARTIAL}inductor-", dir=metrics_dir) as scratch:
        train_step = measure_train_step(
            drafter_dir, target, inputs.model, inputs.compile, Path(compile_dir), Path(scratch), compile_key
        )
    metrics = {
        **decoding,
        "skipped_prompts": skipped,
        "train": train,
        "train_step": train_step,
        "setup": {
            "block_size": drafter.config.block_size,
            "max_new_tokens": p.max_new_tokens,
            "num_prompts_per_source": p.num_prompts,
            "device": device.type,
            "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
            "temperature": 0,
        },
    }
    baseline, commit, note = regression.read_baseline(p.baseline, root)
    report = regression.compare(metrics, baseline, p.baseline, commit, note, p.max_regression)
    write_plot_tables(tables, metrics_dir)
    write_json_atomic(metrics_dir / "eval.json", metrics)
    write_json_atomic(metrics_dir / "eval_regression.json", report)
    print(
        f"evaluate: {len(results)} prompts, tau {metrics['tau']:.3f}, speedup {metrics['speedup']:.3f}x, "
        f"decode {metrics['decode_tokens_per_s']['speculative']:.1f} tok/s (target alone "
        f"{metrics['decode_tokens_per_s']['target']:.1f}), lossless: {metrics['lossless']}; baseline: {note}",
        flush=True,
    )
    for line in regression.regression_lines(report):
        print(line, flush=True)
    if not metrics["lossless"]:
        print(
            f"!!! NOT LOSSLESS: speculative output differs from target greedy on {metrics['mismatched_prompts']}",
            flush=True,
        )
    regression.check(report, p.fail_on_regression)
    return metrics

"""The whole evaluate stage: decode the eval prompts both ways, compare a baseline.

The drafter's training step is timed by the bench stage (dflashpipe.bench.stage), not here: evaluate decodes
eagerly and depends on no compile artifact, so what reruns it (the drafter, the eval split) and what
reruns bench (kernels, shapes) stay apart."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dflashpipe.core.artifacts import verify_file_listing, write_json_atomic
from dflashpipe.core.errors import ParamsError, SourceError
from dflashpipe.core.kernels import rows_first
from dflashpipe.core.metrics import read_record_at
from dflashpipe.core.params import ComputeParams, EvaluateParams
from dflashpipe.core.spread import SUFFIX, Measuring
from dflashpipe.core.threads import thread_budget
from dflashpipe.evaluate import lossless, regression
from dflashpipe.evaluate.floor import bigram_floor, bigram_table
from dflashpipe.evaluate.metrics import PromptResult, eval_metrics, write_plot_tables
from dflashpipe.evaluate.prompts import TRAIN, EvalPrompt, eval_prompts
from dflashpipe.evaluate.speculative import (
    DFlashProposer,
    prefill,
    speculative_generate,
    target_generate,
)
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.target.adapter import Target
from dflashpipe.target.dtype import compute_dtype


@dataclass(frozen=True)
class EvaluateInputs:
    evaluate: EvaluateParams
    compute: ComputeParams
    template_kwargs: dict = field(default_factory=dict)
    """target.chat_template_kwargs: the prompts are rendered as regenerate and tokenize render them."""


def decode_prompts(
    target: Target | torch.nn.Module,
    drafter: DFlashDrafter,
    prompts: list[EvalPrompt],
    max_new_tokens: int,
    stop: list[int],
    draft_tokens: int = 0,
    fastest: Target | None = None,
) -> list[PromptResult]:
    """Each prompt: one prefill, then target-only greedy and speculative decoding from copies of it.

    The speculative run is profiled (STEP_PARTS) in the same run on the CPU, where reading the clock costs
    nothing; on CUDA the profile's syncs would slow the timed run, so an extra run is profiled instead.
    `fastest`: the target in the dtype this device decodes fastest in, when `target` computes in another; its
    plain decoding is then what speedup divides by (the lossless contract still compares `target`'s own)."""
    proposer, target = DFlashProposer(drafter), Target.of(target)
    layers, inline = proposer.target_layer_ids, target.device.type != "cuda"
    if prompts:  # one untimed run, so that first-call costs (allocator, kernels) land in no measurement
        warm = prefill(target, prompts[0].prompt_ids, layers)
        target_generate(target, warm.fork(), min(max_new_tokens, 8), stop)
        if fastest is not None:
            target_generate(fastest, prefill(fastest, prompts[0].prompt_ids), min(max_new_tokens, 8), stop)
        speculative_generate(target, proposer, warm, min(max_new_tokens, 8), stop, draft_tokens=draft_tokens)
    results = []
    # progress on stderr, as regenerate and train show theirs: a prompt decodes twice (three times on CUDA)
    bar = tqdm(prompts, desc="evaluate", unit="prompt", mininterval=1.0)
    for prompt in bar:
        start = prefill(target, prompt.prompt_ids, layers)
        baseline = target_generate(target, start.fork(), max_new_tokens, stop)
        profiled = (
            None
            if inline
            else speculative_generate(target, proposer, start.fork(), max_new_tokens, stop, True, draft_tokens)
        )
        speculative = speculative_generate(target, proposer, start, max_new_tokens, stop, inline, draft_tokens)
        if profiled is not None:
            speculative.profile = profiled.profile
        plain = (
            None
            if fastest is None
            else target_generate(fastest, prefill(fastest, prompt.prompt_ids), max_new_tokens, stop)
        )
        results.append(PromptResult(prompt, baseline, speculative, target.dtype, plain, fastest and fastest.dtype))
        rates = [run.decode_tokens / run.decode_s for run in (baseline, speculative) if run.decode_s > 0]
        if len(rates) == 2:
            bar.set_postfix_str(f"target {rates[0]:.1f} tok/s, speculative {rates[1]:.1f} tok/s", refresh=False)
    return results


def check_contract(contract: dict) -> None:
    """Fail the stage, naming the prompt, position, both tokens and the margins, when a prompt broke the lossless
    contract (dflashpipe.evaluate.lossless); numerics divergences are recorded, not failed."""
    broken = []
    for entry in contract["departures"]:
        where = f"prompt {entry['id']} ({entry['split']})"
        if entry["not_verified_at"]:
            broken.append(f"{where}: tokens at {entry['not_verified_at']} are not the verify forward's argmax")
        divergence = entry["divergence"]
        if divergence and divergence["verdict"] == lossless.BUG:
            broken.append(
                f"{where}: left plain greedy decoding at position {divergence['position']}: token "
                f"{divergence['speculative_token']} instead of {divergence['plain_token']}, plain margin "
                f"{divergence['margin']} > tolerance {divergence['tolerance']}"
            )
    if broken:
        raise lossless.ContractError(
            "speculative decoding is not lossless (metrics/eval.json: contract):\n  " + "\n  ".join(broken)
        )


def read_train_metrics(path: Path) -> dict:
    raw = read_record_at(path)  # with its detail file, which holds the spread and the compile facts
    if raw is None:
        raise SourceError(f"{path} not found: run `dvc repro train` first")
    try:
        spread = {key: raw[key] for key in ("tokens_per_s" + SUFFIX,) if key in raw}  # absent in older runs
        return {"tokens_per_s": raw["tokens_per_s"], **spread, "compile": raw["compile"]}
    except (KeyError, TypeError) as exc:
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
    bench_metrics: Path | str,
    metrics_dir: Path | str,
    root: Path | str = ".",
    device: str | None = None,
    tokens_dir: Path | str | None = None,
) -> dict:
    """Write metrics/eval.json, metrics/eval_regression.json and the plot tables; return the eval metrics.

    `bench_metrics` (metrics/bench.json) is read for the regression check only; missing, its figure is
    reported as not measured. `tokens_dir` (data/tokens): the training tokens the bigram floor is counted on
    (evaluate.floor); None records no floor."""
    from dflashpipe.target.chat import load_chat_tokenizer

    p = inputs.evaluate
    chat = load_chat_tokenizer(target_dir, inputs.template_kwargs)
    drafter_dir, metrics_dir = Path(drafter_dir), Path(metrics_dir)
    verify_drafter(drafter_dir)
    train = read_train_metrics(Path(train_metrics))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = thread_budget({"decode": 1})  # one decoding thread: every core this process may use
    threads.apply("decode", device)
    # one sequence at a time: the decode kind's dtype (target.dtype); speedup divides by the fastest plain decoding
    # this device has (compute.target_dtype: auto's decode dtype), loaded a second time only when it differs
    target = Target.load(target_dir, device, inputs.compute.target_dtype, decoding=True, kind="decode")
    fastest_dtype = compute_dtype(device, "auto", "decode")
    fastest = None if fastest_dtype == target.dtype else Target.load(target_dir, device, "auto", True, "decode")
    # sdpa for decoding: every step has a new context length, which a compiled flex kernel would recompile for.
    # Drafts in the target's dtype, as engines serve it: bf16 on CUDA; on the CPU the bf16 weights in float32.
    drafter = DFlashDrafter.from_pretrained(
        drafter_dir, TargetHead.of(target.model), dtype=target.dtype, attention="sdpa"
    ).eval()
    rows_first(
        drafter
    )  # a draft's block of rows: the fast form on the CPU, as the target has (dflashpipe.core.kernels)
    prompts, skipped = eval_prompts(manifest_dir, chat, p.num_prompts, p.max_prompt_tokens)
    train_prompts, _ = eval_prompts(manifest_dir, chat, p.num_prompts, p.max_prompt_tokens, TRAIN)
    if not prompts:
        raise SourceError(
            f"{Path(manifest_dir) / 'eval.parquet'}: no usable eval prompt (skipped: {skipped}); "
            f"raise evaluate.max_prompt_tokens or give the sources an eval count (data.sources[*].eval)"
        )
    block_size = drafter.config.block_size
    if p.draft_tokens > block_size - 1:
        raise ParamsError(
            f"params.yaml: evaluate.draft_tokens = {p.draft_tokens}: the drafter proposes model.block_size - 1 = "
            f"{block_size - 1} tokens a step; set at most that (0: all of them)"
        )
    verified = p.draft_tokens + 1 if p.draft_tokens else block_size  # positions of a verify forward
    stop = target.stop_token_ids(chat.tokenizer)  # the same end of turn as regeneration
    with Measuring(device) as window:  # what the machine gave the decoding, and the control beside it
        results = decode_prompts(
            target, drafter, prompts + train_prompts, p.max_new_tokens, stop, p.draft_tokens, fastest
        )
    decoding, tables = eval_metrics(results, verified, window.busy)
    if tokens_dir is not None:  # on the held-out prompts' plain greedy outputs, as the headline figures are
        held_out = [r.target.tokens for r in results if r.prompt.split != TRAIN]
        decoding["floor"] = {"bigram": bigram_floor(*bigram_table(tokens_dir), held_out, verified)}
    metrics_dir.mkdir(parents=True, exist_ok=True)
    metrics = {
        **decoding,
        "skipped_prompts": skipped,
        "train": train,
        "threads": threads.to_json(),
        "setup": {
            "block_size": block_size,
            "draft_tokens": verified - 1,
            "max_new_tokens": p.max_new_tokens,
            "num_prompts_per_source": p.num_prompts,
            "device": device.type,
            "target_dtype": str(target.dtype).removeprefix("torch."),
            "temperature": 0,
        },
    }
    current = {regression.EVAL_METRICS: metrics, regression.BENCH_METRICS: regression.read_current(bench_metrics)}
    baseline, commit, note = regression.read_baseline(p.baseline, root)
    report = regression.compare(current, baseline, p.baseline, commit, note, p.max_regression)
    write_plot_tables(tables, metrics_dir)
    write_json_atomic(metrics_dir / "eval.json", metrics)
    regression.write(metrics_dir / "eval_regression.json", report)
    sides, profile = metrics["train_vs_held_out"], metrics["step_profile"]
    if "floor" in metrics:
        print(
            f"evaluate: held-out slot-1 acceptance {metrics['slot_acceptance']['1']:.1%} against "
            f"{metrics['floor']['bigram']['slot_1_acceptance']:.1%} for a bigram table counted on the training "
            f"tokens (tau {metrics['floor']['bigram']['tau']:.3f})",
            flush=True,
        )
    print(
        f"evaluate: {metrics['prompts']} held-out prompts, tau {metrics['tau']:.3f}, "
        f"speedup {metrics['speedup']:.3f}x (against plain decoding in {metrics['baseline']['dtype']}), "
        f"decode {metrics['decode_tokens_per_s']['speculative']:.1f} tok/s (target alone "
        f"{metrics['decode_tokens_per_s']['target']:.1f}), lossless: {metrics['lossless']}; baseline: {note}",
        flush=True,
    )
    print(
        f"evaluate: {sides['train']['prompts']} training prompts, tau {sides['train']['tau']:.3f} "
        f"(held-out {sides['held_out']['tau']:.3f}, gap {sides['gap']['tau']:+.3f}); a verify step costs "
        f"{profile.get('step_over_decode_step', 0.0):.2f} plain decode steps",
        flush=True,
    )
    for line in regression.regression_lines(report):
        print(line, flush=True)
    regression.check(report, p.fail_on_regression)
    check_contract(metrics["contract"])
    return metrics

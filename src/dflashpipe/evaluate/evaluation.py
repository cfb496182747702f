"""The whole evaluate stage: decode the eval prompts both ways, compare a baseline.

The drafter's training step is timed by the bench stage (dflashpipe.bench.stage), not here: evaluate decodes
eagerly and depends on no compile artifact, so what reruns it (the drafter, the eval split) and what
reruns bench (kernels, shapes) stay apart."""

from __future__ import annotations

import sys
from collections import Counter
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
from dflashpipe.evaluate.benchmarks import BenchmarkPrompt, read_benchmark
from dflashpipe.evaluate.floor import bigram_floor, bigram_table
from dflashpipe.evaluate.metrics import DEFINITIONS, PromptResult, eval_metrics, lean_metrics, write_plot_tables
from dflashpipe.evaluate.prompts import (
    BENCHMARK,
    EARLIER_TURN_SKIPPED,
    HELD_OUT,
    TOO_LONG,
    TRAIN,
    EvalPrompt,
    eval_prompts,
    render_prompt,
)
from dflashpipe.evaluate.prompts_file import DecodedPrompt, write_prompts_file
from dflashpipe.evaluate.speculative import DFlashProposer, speculative_generate, target_generate
from dflashpipe.model import DFlashDrafter, TargetHead
from dflashpipe.target.adapter import Target
from dflashpipe.target.chat import ChatTokenizer
from dflashpipe.target.dtype import compute_dtype
from dflashpipe.target.prefill import prefill


@dataclass(frozen=True)
class EvaluateInputs:
    evaluate: EvaluateParams
    compute: ComputeParams
    template_kwargs: dict = field(default_factory=dict)
    """target.chat_template_kwargs: the prompts are rendered as regenerate and tokenize render them."""
    benchmarks: list[BenchmarkPrompt] = field(default_factory=list)
    """evaluate.benchmarks' prompts (read_benchmarks), each benchmark a row of its own."""
    benchmark_skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    """What the benchmark readers skipped, per benchmark and reason."""


@dataclass
class Decoding:
    """What decoding one request needs besides its prompt: the two models, the stop tokens and the budget."""

    target: Target
    proposer: DFlashProposer
    max_new_tokens: int
    stop: list[int]
    draft_tokens: int = 0
    fastest: Target | None = None
    """The target in the dtype this device decodes fastest in, when `target` computes in another; its plain
    decoding is then what speedup divides by (the lossless contract still compares `target`'s own)."""

    def warm(self, prompt: EvalPrompt) -> None:
        """One untimed run, so that first-call costs (allocator, kernels) land in no measurement."""
        target, budget = self.target, min(self.max_new_tokens, 8)
        start = prefill(target, prompt.prompt_ids, self.proposer.target_layer_ids)
        target_generate(target, start.fork(), budget, self.stop)
        if self.fastest is not None:
            target_generate(self.fastest, prefill(self.fastest, prompt.prompt_ids), budget, self.stop)
        speculative_generate(target, self.proposer, start, budget, self.stop, draft_tokens=self.draft_tokens)

    def decode(self, prompt: EvalPrompt) -> PromptResult:
        """One prefill, then target-only greedy and speculative decoding from copies of it.

        The speculative run is profiled (STEP_PARTS) in the same run on the CPU, where reading the clock costs
        nothing; on CUDA the profile's syncs would slow the timed run, so an extra run is profiled instead."""
        target, proposer, n, stop, k = self.target, self.proposer, self.max_new_tokens, self.stop, self.draft_tokens
        inline = target.device.type != "cuda"
        start = prefill(target, prompt.prompt_ids, proposer.target_layer_ids)
        baseline = target_generate(target, start.fork(), n, stop)
        profiled = None if inline else speculative_generate(target, proposer, start.fork(), n, stop, True, k)
        speculative = speculative_generate(target, proposer, start, n, stop, inline, k)
        if profiled is not None:
            speculative.profile = profiled.profile
        fastest = self.fastest
        plain = None if fastest is None else target_generate(fastest, prefill(fastest, prompt.prompt_ids), n, stop)
        return PromptResult(prompt, baseline, speculative, target.dtype, plain, fastest and fastest.dtype)


def decode_prompts(
    target: Target | torch.nn.Module,
    drafter: DFlashDrafter,
    prompts: list[EvalPrompt],
    max_new_tokens: int,
    stop: list[int],
    draft_tokens: int = 0,
    fastest: Target | None = None,
) -> list[PromptResult]:
    """Each prompt decoded both ways (Decoding.decode), in order, after one untimed warm-up run."""
    decoding = Decoding(Target.of(target), DFlashProposer(drafter), max_new_tokens, stop, draft_tokens, fastest)
    if prompts:
        decoding.warm(prompts[0])
    bar = _bar(len(prompts))
    return [_progress(bar, decoding.decode(p)) for p in prompts]


def _bar(total: int) -> tqdm:
    # progress on stderr, as regenerate and train show theirs: a request decodes twice (three times on CUDA)
    return tqdm(total=total, desc="evaluate", unit="request", mininterval=1.0)


def _progress(bar: tqdm, result: PromptResult) -> PromptResult:
    rates = [run.decode_tokens / run.decode_s for run in (result.target, result.speculative) if run.decode_s > 0]
    if len(rates) == 2:
        bar.set_postfix_str(f"target {rates[0]:.1f} tok/s, speculative {rates[1]:.1f} tok/s", refresh=False)
    bar.update()
    return result


def decode_benchmarks(
    decoding: Decoding, chat: ChatTokenizer, benchmarks: list[BenchmarkPrompt], max_prompt_tokens: int
) -> tuple[list[PromptResult], dict[str, dict[str, int]]]:
    """Every turn of every benchmark prompt, one request each, in order; what was skipped, per benchmark and reason.

    User turns only, as the target's chat template renders them with its generation prompt. A later turn is
    asked after the target's OWN reply to the turn before (its plain greedy decoding, at most max_new_tokens, as
    text), as MT-Bench is run. A turn longer than `max_prompt_tokens` is skipped, and so is every later turn of it."""
    results: list[PromptResult] = []
    skipped: dict[str, Counter] = {}
    bar = _bar(sum(len(b.turns) for b in benchmarks))
    for item in benchmarks:
        conversation: list[dict[str, str]] = []
        for turn, text in enumerate(item.turns, start=1):
            conversation.append({"role": "user", "content": text})
            ids = render_prompt(chat, conversation)
            if len(ids) > max_prompt_tokens:
                skipped.setdefault(item.benchmark, Counter())[TOO_LONG] += 1
                skipped[item.benchmark][EARLIER_TURN_SKIPPED] += len(item.turns) - turn
                print(
                    f"evaluate: {item.locator} turn {turn} ({item.benchmark}): {len(ids)} prompt tokens > "
                    f"evaluate.max_prompt_tokens {max_prompt_tokens}: skipped"
                    + (f", and its {len(item.turns) - turn} later turn(s)" if turn < len(item.turns) else ""),
                    file=sys.stderr,
                    flush=True,
                )
                break
            result = _progress(
                bar, decoding.decode(EvalPrompt(item.id, item.benchmark, ids, BENCHMARK, item.benchmark, turn))
            )
            results.append(result)
            reply = chat.tokenizer.decode(result.target.tokens, skip_special_tokens=True)
            conversation.append({"role": "assistant", "content": reply})
    counts = {b: {k: v for k, v in sorted(c.items()) if v} for b, c in sorted(skipped.items())}
    return results, counts


def read_benchmarks(specs, root: Path | str = ".") -> tuple[list[BenchmarkPrompt], dict[str, dict[str, int]]]:
    """Every prompt of evaluate.benchmarks (BenchmarkSpec each), in params order, and what each reader skipped."""
    prompts, skipped = [], {}
    for spec in specs:
        found, counts = read_benchmark(spec, root)
        prompts += found
        if counts:
            skipped[spec.name] = dict(counts)
    return prompts, skipped


def thinking_setting(template_kwargs: dict) -> str:
    """What the prompts were rendered with, as the table says it: Qwen3's enable_thinking, or the template's own."""
    if "enable_thinking" in template_kwargs:
        return f"enable_thinking={str(template_kwargs['enable_thinking']).lower()}"
    return "template default"


def request_records(results: list[PromptResult]) -> list[DecodedPrompt]:
    """data/eval/prompts.json's entries: every request decoded, in decode order, with the exact token ids it decoded."""
    return [
        DecodedPrompt(r.prompt.benchmark, r.prompt.sample_id, r.prompt.turn, r.prompt.split, tuple(r.prompt.prompt_ids))
        for r in results
    ]


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
        trained_in = {"target_dtype": raw["target_dtype"]} if "target_dtype" in raw else {}  # absent in older runs
        return {"tokens_per_s": raw["tokens_per_s"], **spread, "compile": raw["compile"], **trained_in}
    except (KeyError, TypeError) as exc:
        raise SourceError(f"{path}: not the train stage's metrics ({exc}): run `dvc repro train`") from None


AS_TRAINED = "as trained"


def numerics_note(trained_in: str | None, judged_in: str) -> str:
    """`as trained` when the drafter is judged in the dtype it learnt in, else what differs: a drafter trained in
    bfloat16 and decoded in float32 drafts for numerics it never saw, and its tau says less about either."""
    if trained_in == judged_in:
        return AS_TRAINED
    if trained_in is None:
        return f"trained in an unrecorded dtype, judged in {judged_in}"
    return f"trained in {trained_in}, judged in {judged_in}: not the numerics it learnt in"


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
    prompts_out: Path | str | None = None,
) -> dict:
    """Write metrics/eval.json (contract 3's keys), metrics/detail/eval.json (the rest, with each figure's
    definition), metrics/eval_regression.json and the plot tables; return the detail.

    `bench_metrics` (metrics/bench.json) is read for the regression check only; missing, its figure is
    reported as not measured. `tokens_dir` (data/tokens): the training tokens the bigram floor is counted on
    (evaluate.floor); None records no floor. `prompts_out` (data/eval/prompts.json): every request decoded, with
    its exact token ids, for the served check to replay; None writes none."""
    from dflashpipe.target.chat import load_chat_tokenizer

    p = inputs.evaluate
    chat = load_chat_tokenizer(target_dir, inputs.template_kwargs)
    drafter_dir, metrics_dir = Path(drafter_dir), Path(metrics_dir)
    verify_drafter(drafter_dir)
    train = read_train_metrics(Path(train_metrics))
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = thread_budget({"decode": 1})  # one decoding thread: every core this process may use
    threads.apply("decode", device)
    # the dtype the drafter was trained in (target.dtype); speedup divides by the fastest plain decoding this device
    # has (compute.target_dtype: auto's), loaded a second time only when it differs
    target = Target.load(target_dir, device, inputs.compute.target_dtype, decoding=True)
    fastest_dtype = compute_dtype(device, "auto")
    fastest = None if fastest_dtype == target.dtype else Target.load(target_dir, device, "auto", True)
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
    decoding = Decoding(target, DFlashProposer(drafter), p.max_new_tokens, stop, p.draft_tokens, fastest)
    with Measuring(device) as window:  # what the machine gave the decoding, and the control beside it
        decoding.warm(prompts[0])
        bar = _bar(len(prompts) + len(train_prompts))
        results = [_progress(bar, decoding.decode(q)) for q in prompts + train_prompts]
        bench_results, bench_skipped = decode_benchmarks(decoding, chat, inputs.benchmarks, p.max_prompt_tokens)
    results += bench_results
    decoding_metrics, tables = eval_metrics(results, verified, window.busy, p.max_new_tokens)
    if tokens_dir is not None:  # on the held-out prompts' plain greedy outputs, as the headline figures are
        held_out = [r.target.tokens for r in results if r.prompt.split == HELD_OUT]
        decoding_metrics["floor"] = {"bigram": bigram_floor(*bigram_table(tokens_dir), held_out, verified)}
    thinking = thinking_setting(inputs.template_kwargs)
    judged_in = str(target.dtype).removeprefix("torch.")
    numerics = numerics_note(train.get("target_dtype"), judged_in)
    if numerics != AS_TRAINED:
        print(f"evaluate: {numerics}")
    for name, row in decoding_metrics["benchmarks"].items():
        row["thinking"] = thinking
        counts = {**inputs.benchmark_skipped.get(name, {}), **bench_skipped.get(name, {})}
        row["skipped"] = skipped if name == HELD_OUT else dict(sorted(counts.items()))
    detail = {
        "definitions": DEFINITIONS,
        **decoding_metrics,
        "skipped_prompts": skipped,
        "train": train,
        "threads": threads.to_json(),
        "setup": {
            "block_size": block_size,
            "draft_tokens": verified - 1,
            "max_new_tokens": p.max_new_tokens,
            "num_prompts_per_source": p.num_prompts,
            "device": device.type,
            "target_dtype": judged_in,
            "numerics": numerics,
            "temperature": 0,
            "thinking": thinking,
        },
    }
    lean = lean_metrics(detail)
    current = {
        regression.EVAL_METRICS: lean,
        regression.EVAL_DETAIL: detail,
        regression.BENCH_METRICS: regression.read_current(bench_metrics),
    }
    baseline, commit, note = regression.read_baseline(p.baseline, root)
    report = regression.compare(current, baseline, p.baseline, commit, note, p.max_regression)
    write_plot_tables(tables, metrics_dir)
    if prompts_out is not None:
        write_prompts_file(prompts_out, request_records(results))
    write_json_atomic(metrics_dir / "detail" / "eval.json", detail)
    write_json_atomic(metrics_dir / "eval.json", lean)
    regression.write(metrics_dir / "eval_regression.json", report)
    _print_summary(detail, note)
    for line in regression.regression_lines(report):
        print(line, flush=True)
    regression.check(report, p.fail_on_regression)
    check_contract(detail["contract"])
    return detail


def _print_summary(metrics: dict, note: str) -> None:
    sides, profile = metrics["train_vs_held_out"], metrics["step_profile"]
    if "floor" in metrics:
        print(
            f"evaluate: held-out slot-1 acceptance {metrics['slot_acceptance']['1']:.1%} against "
            f"{metrics['floor']['bigram']['slot_1_acceptance']:.1%} for a bigram table counted on the training "
            f"tokens (tau {metrics['floor']['bigram']['tau']:.3f})",
            flush=True,
        )
    print(
        f"evaluate: {metrics['prompts']} held-out prompts, tau {metrics['tau']:.3f} (pooled "
        f"{metrics['tau_pooled']:.3f}), speedup {metrics['speedup']:.3f}x (against plain decoding in "
        f"{metrics['baseline']['dtype']}), decode {metrics['decode_tokens_per_s']['speculative']:.1f} tok/s (target "
        f"alone {metrics['decode_tokens_per_s']['target']:.1f}), lossless: {metrics['lossless']}; baseline: {note}",
        flush=True,
    )
    for name, row in metrics["benchmarks"].items():
        low, high = row["tau_interval_95"]
        print(f"evaluate: {name}: {row['requests']} requests, tau {row['tau']:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    print(
        f"evaluate: {sides['train']['prompts']} training prompts, tau {sides['train']['tau']:.3f} "
        f"(held-out {sides['held_out']['tau']:.3f}, gap {sides['gap']['tau']:+.3f}); a verify step costs "
        f"{profile.get('step_over_decode_step', 0.0):.2f} plain decode steps",
        flush=True,
    )

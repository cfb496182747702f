"""The drafter's training step alone, on synthetic inputs: what the kernels do, with no data in the figure.

Invariant: nothing here reads data/manifest, data/tokens or train's outputs, and the bench entry in dvc.yaml
lists none of them, so a data change cannot move this stage's figure (tests/test_bench.py checks both).

The step is warmup's: the same drafter (sized from data/target's config.json, initialised as warmup does),
the same fixed shapes (model.seq_len x compile.micro_batch), compiled from warmup's artifact when it was
built for warmup's key now. The eager and the compiled step run in interleaved rounds on the same random
inputs, so a machine that gets busier slows both alike: each round gives one rate of each and their ratio,
and the rounds give the spread (dflashpipe.core.spread) that tells a real change from noise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from dflashpipe.compile.warmup import autocast, compiled_step, run_step_once, step_inputs
from dflashpipe.core.artifacts import PARTIAL
from dflashpipe.core.errors import SourceError
from dflashpipe.core.metrics import write_metrics
from dflashpipe.core.params import CompileParams, ModelParams
from dflashpipe.core.pipeline import StageKey
from dflashpipe.core.spread import Measuring, Spread, clock
from dflashpipe.core.threads import ThreadBudget, thread_budget
from dflashpipe.model import DFlashDrafter, StepInputs
from dflashpipe.target.dtype import compute_dtype

REPEATS = 5
"""Interleaved rounds; each gives one sample of every figure (the spread needs 2 or more)."""
STEPS = 3
"""Timed steps per path per round, after one untimed step of each."""
SEED = 0
NOTE = (
    "data changes cannot reach bench: it times the drafter step on synthetic inputs of fixed shapes, "
    "and dvc.yaml gives it no data, tokens or train input"
)


def synthetic_target(target_dir: Path | str, device: torch.device, target_dtype: str):
    """A model of data/target's config.json with seeded random weights, in the dtype train loads the
    target in: the drafter borrows its embedding, norm and head (shapes and tying matter, values do not),
    so the step compiles to warmup's graph without reading the target's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target_dir = Path(target_dir)
    if not (target_dir / "config.json").is_file():
        raise SourceError(f"{target_dir}: no materialised target: run `dvc repro target`")
    config = AutoConfig.from_pretrained(target_dir, local_files_only=True)
    torch.manual_seed(SEED)
    return (
        AutoModelForCausalLM.from_config(config, dtype=compute_dtype(device, target_dtype))
        .to(device)
        .eval()
        .requires_grad_(False)
    )


def synthetic_inputs(drafter: DFlashDrafter, model: ModelParams, micro_batch: int, device: torch.device) -> StepInputs:
    """warmup's step inputs (every one of them, same shapes, dtypes and anchors), with random features and
    token ids from SEED in place of its zeros."""
    inputs = step_inputs(drafter, model, micro_batch, device)
    generator = torch.Generator().manual_seed(SEED)
    inputs.features.copy_(torch.randn(inputs.features.shape, generator=generator))
    inputs.input_ids.copy_(torch.randint(0, drafter.config.vocab_size, inputs.input_ids.shape, generator=generator))
    return inputs


def time_steps(step_fn, drafter: DFlashDrafter, inputs: StepInputs, steps: int, device: torch.device) -> float:
    """Seconds for `steps` forward+backward steps, the device drained before and after."""
    began = clock(device)
    for _ in range(steps):
        with autocast(device):
            out = step_fn(*inputs.args())
        out.loss.backward()
        drafter.zero_grad(set_to_none=True)
    return clock(device) - began


def bench_step(
    model: ModelParams,
    compile: CompileParams,
    target_dir: Path | str,
    compile_dir: Path | str,
    scratch: Path | str,
    compile_key: StageKey | None,
    device: str | None = None,
    threads: ThreadBudget | None = None,
    target_dtype: str = "auto",
) -> dict:
    """metrics/bench.json's content. The compiled step loads the artifact in `compile_dir` (copied into
    `scratch`) if it was built for `compile_key` (warmup's key now), else compiles cold in its untimed
    first call (compile_source says why). With compile.enabled false only the eager step is timed."""
    from transformers import AutoTokenizer

    from dflashpipe.compile.artifact import load_artifact_or_go_cold
    from dflashpipe.compile.guard import dynamo_counters

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # compiled and timed at the drafter threads' count (the kernels are bound to it: dflashpipe.core.threads);
    # without a topology, the one step thread gets every core this process may use
    threads = threads or thread_budget({"drafter": 1})
    threads.apply("drafter", device)
    target = synthetic_target(target_dir, device, target_dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    drafter = DFlashDrafter.for_target(target, tokenizer, model, generator=torch.Generator().manual_seed(0)).to(device)
    drafter.train()
    paths = {"eager": drafter}
    source = "eager: compile.enabled is false"
    if compile.enabled:
        source = load_artifact_or_go_cold(compile_dir, scratch, compile_key)
        paths["compiled"] = compiled_step(drafter)
    for step_fn in paths.values():  # first calls (the compile or the cache load) are timed by no round
        first = run_step_once(step_fn, drafter, model, compile.micro_batch, device)
    inputs = synthetic_inputs(drafter, model, compile.micro_batch, device)
    warm = dynamo_counters()
    positions = STEPS * compile.micro_batch * model.seq_len
    rates: dict[str, list[float]] = {name: [] for name in paths}
    # what the machine gave the rounds, recorded with each figure; progress on stderr, as regenerate and train
    # show theirs: one tick per timed round of one path
    with (
        Measuring(device) as window,
        tqdm(total=REPEATS * len(paths), desc="bench", unit="round", mininterval=1.0) as bar,
    ):
        for round_ in range(REPEATS):
            # ABBA order: a drift in the machine's load over the run favours neither path
            for name in paths if round_ % 2 == 0 else reversed(paths):
                seconds = time_steps(paths[name], drafter, inputs, STEPS, device)
                rates[name].append(positions / seconds if seconds > 0 else 0.0)
                bar.set_postfix_str(f"{name} {rates[name][-1]:.0f} tok/s", refresh=False)
                bar.update()
    busy = window.busy
    headline = "compiled" if compile.enabled else "eager"
    metrics = {
        "note": NOTE,
        "what": f"drafter forward+backward on synthetic inputs, {first['backend']} attention: {REPEATS} interleaved "
        f"rounds of {STEPS} steps per path after 1 untimed step; tokens = micro_batch x seq_len positions; "
        f"tokens_per_s is the {headline} step (the one train runs)",
        "runs": headline,
        **Spread.of(rates[headline]).record("tokens_per_s", busy=busy),
        "paths": {name: Spread.of(samples).record("tokens_per_s", busy=busy) for name, samples in rates.items()},
        "compile_source": source,
        "graphs_compiled_while_timed": dynamo_counters()["unique_graphs"] - warm["unique_graphs"],
        "device": device.type,
        "dtype": first["dtype"],
        "shapes": first["shapes"],
        "repeats": REPEATS,
        "steps_per_repeat": STEPS,
        "threads": threads.to_json(),
    }
    if compile.enabled:  # what compile buys: a ratio within each round, where both saw the same machine
        ratios = [c / e for c, e in zip(rates["compiled"], rates["eager"], strict=True) if e > 0]
        metrics.update(Spread.of(ratios or [0.0]).record("compiled_over_eager", digits=3, busy=busy))
    return metrics


def run_bench(
    model: ModelParams,
    compile: CompileParams,
    target_dir: Path | str,
    compile_dir: Path | str,
    out: Path | str,
    compile_key: StageKey | None,
    device: str | None = None,
    threads: ThreadBudget | None = None,
    target_dtype: str = "auto",
) -> dict:
    """Write metrics/bench.json and its detail (core.metrics) and return the whole record."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the inductor scratch is a partial sibling of bench.json: a killed run's is removed by the next write
    with tempfile.TemporaryDirectory(prefix=f".{out.name}{PARTIAL}inductor-", dir=out.parent) as scratch:
        metrics = bench_step(
            model, compile, target_dir, compile_dir, scratch, compile_key, device, threads, target_dtype
        )
    write_metrics(out, metrics, name="bench")
    ratio = f", compiled/eager {metrics['compiled_over_eager']:.2f}x" if "compiled_over_eager" in metrics else ""
    print(
        f"bench: {metrics['runs']} step {metrics['tokens_per_s']:.1f} tokens/s "
        f"(range {metrics['tokens_per_s_spread']['low']:.1f}..{metrics['tokens_per_s_spread']['high']:.1f}, "
        f"{REPEATS} rounds){ratio}; kernels: {metrics['compile_source']}",
        flush=True,
    )
    return metrics
